"""What the kernel saw the ranks send to each other, read from outside the ranks.

A rank runs the student's code, so everything it keeps about itself is theirs to rewrite: its log of collective
calls (:mod:`distlab.runtime.comm`) is a Python object the student's function can edit (one line turns "no
all-reduce" into "one all-reduce"), and even :mod:`distlab.runtime.wire`, which reads the kernel's TCP counters,
runs in the rank and returns what the rank says. The kernel's counters themselves are out of the rank's reach:
Linux counts the payload bytes of every TCP socket (``struct tcp_info``, ``tcpi_bytes_sent``), and any process of
the same user may read them for all sockets through the socket-diagnostics netlink interface that ``ss -ti`` uses
(``NETLINK_SOCK_DIAG``, ``INET_DIAG_INFO``; man 7 sock_diag). The grading process, whose memory the student's
code never touched, reads them here.

Which sockets are the group's: ``/proc/<pid>/fd`` of each rank names the inodes of its sockets, and a socket
counts when its peer is a socket of another rank of the group. gloo's mesh of pair connections is exactly that;
the connection to the rendezvous store (served by the grading process) is not, nor is anything else a rank holds.

What a rank can still do: add bytes, never remove them. So :func:`observed_job` accepts the job's traffic only on
the mesh that stood before the job (a connection a rank opened to another during it, to send a count's worth of
bytes of its own, is reported, as is a mesh connection closed), and a rank whose descriptors cannot be listed
(it made itself undumpable) is reported too: :class:`Unaccounted`, which the caller scores as a disagreement.
What it cannot tell: bytes a rank writes into gloo's own sockets in gloo's framing, so that the peer's gloo takes
them without complaint; that is writing gloo's protocol by hand, far more work than the one all-reduce it would
stand for. Where the platform has no such interface (macOS, a kernel without ``tcpi_bytes_sent``, a sandbox that
refuses netlink), :func:`available` is False and the caller says so.
"""

from __future__ import annotations

import functools
import os
import socket
import struct
import sys
from dataclasses import dataclass

from distlab.collectives import GLOO_PREAMBLE_BYTES, gloo_all_reduce_wire
from distlab.grading.harness import run_job
from distlab.runtime.wire import UNIQUE_BYTES_SENT_NEEDS, unique_bytes_sent

__all__ = ["Unaccounted", "available", "observed_job", "all_reduce_bytes", "allowance", "one_all_reduce"]

# linux/netlink.h, linux/sock_diag.h, linux/inet_diag.h
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_INET_DIAG_INFO = 2
_HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, sequence, port id
_REQUEST = struct.Struct("=BBBxI48s")  # inet_diag_req_v2: family, protocol, extensions, pad, states, sockid
_MESSAGE = struct.Struct("=BBBB2s2s16s16sI8sIIIII")  # inet_diag_msg: ..., sport, dport, src, dst, ..., inode
_ATTRIBUTE = struct.Struct("=HH")  # rtattr: length, type


class Unaccounted(RuntimeError):
    """What the ranks sent each other cannot be put down to the mesh they started the job with: a rank hid its
    descriptors, or opened or closed connections to another rank during the job."""


@dataclass(frozen=True)
class _Socket:
    inode: int
    local: tuple[bytes, int]
    remote: tuple[bytes, int]
    sent: int


def _dump(family: int) -> list[_Socket]:
    """Every TCP socket of ``family`` the kernel reports in this network namespace, with its bytes sent."""
    found = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG) as link:
        request = _REQUEST.pack(family, socket.IPPROTO_TCP, 1 << (_INET_DIAG_INFO - 1), 0xFFFFFFFF, bytes(48))
        link.send(_HEADER.pack(_HEADER.size + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, 1,
                               0) + request)
        while True:
            data = link.recv(1 << 16)
            offset = 0
            while offset + _HEADER.size <= len(data):
                length, kind, _, _, _ = _HEADER.unpack_from(data, offset)
                if kind == _NLMSG_DONE:
                    return found
                if kind == _NLMSG_ERROR:
                    raise Unaccounted("the kernel refused the socket-diagnostics request")
                found.append(_parse(data[offset + _HEADER.size:offset + length]))
                offset += (length + 3) & ~3


def _parse(body: bytes) -> _Socket:
    fields = _MESSAGE.unpack_from(body)
    sport, dport, src, dst, inode = fields[4], fields[5], fields[6], fields[7], fields[-1]
    sent, offset = None, (_MESSAGE.size + 3) & ~3
    while offset + _ATTRIBUTE.size <= len(body):
        length, kind = _ATTRIBUTE.unpack_from(body, offset)
        if length < _ATTRIBUTE.size:
            break
        if kind == _INET_DIAG_INFO and length - _ATTRIBUTE.size >= UNIQUE_BYTES_SENT_NEEDS:
            sent = unique_bytes_sent(body, offset + _ATTRIBUTE.size)
        offset += (length + 3) & ~3
    return _Socket(inode, (src, int.from_bytes(sport, "big")), (dst, int.from_bytes(dport, "big")),
                   -1 if sent is None else sent)


def _socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets process ``pid`` holds. An undumpable process's descriptors are closed to other
    processes of its user (the listing, or each link in it): that is hiding, not a socket closed since."""
    inodes = set()
    try:
        for name in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{name}")
            except FileNotFoundError:  # closed since the listing
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except OSError as error:
        raise Unaccounted(f"the descriptors of process {pid} cannot be listed ({type(error).__name__})") from None
    return inodes


@functools.cache
def available() -> bool:
    """True where this process can read every TCP socket's bytes sent: Linux, netlink allowed, Linux >= 4.19."""
    if not sys.platform.startswith("linux") or not hasattr(socket, "AF_NETLINK"):
        return False
    with socket.socket() as probe:  # a socket of our own, connected to itself's listener, must show up counted
        probe.bind(("127.0.0.1", 0))
        probe.listen(1)
        with socket.create_connection(probe.getsockname()) as client:
            try:
                seen = [s for s in _dump(socket.AF_INET) if s.local == (socket.inet_aton("127.0.0.1") + bytes(12),
                                                                        client.getsockname()[1])]
            except (OSError, Unaccounted):
                return False
    return bool(seen) and seen[0].sent >= 0


def _mesh(pids: list[int]) -> dict[int, tuple[int, int]]:
    """inode -> (rank, bytes it sent so far) of every socket of the processes ``pids`` (the ranks of one group,
    in rank order) whose peer is a socket of another of them, as the kernel counts them. Raises
    :class:`Unaccounted`."""
    owners = {inode: r for r, pid in enumerate(pids) for inode in _socket_inodes(pid)}
    sockets = [s for family in (socket.AF_INET, socket.AF_INET6) for s in _dump(family) if s.inode in owners]
    endpoints = {s.local: owners[s.inode] for s in sockets}
    mesh = {}
    for s in sockets:
        peer = endpoints.get(s.remote)
        if peer is None or peer == owners[s.inode]:
            continue  # the store's connection, a listener, anything that does not reach another rank
        if s.sent < 0:
            raise Unaccounted("this kernel does not count the bytes a socket sent (tcpi_bytes_sent, Linux 4.19)")
        mesh[s.inode] = (owners[s.inode], s.sent)
    return mesh


def all_reduce_bytes(message_bytes: int, world_size: int, rank: int, element_sizes=(1, 2, 4, 8, 16)) -> list[int]:
    """What rank ``rank`` sends in one gloo all-reduce of ``message_bytes``, for each of ``element_sizes`` that
    divides the message (gloo cuts its segments at element boundaries: 8 bytes as one int64 or two float32 are
    sent differently)."""
    return sorted({gloo_all_reduce_wire(message_bytes, world_size, rank, size).total
                   for size in element_sizes if message_bytes % size == 0})


def allowance(message_bytes: int) -> int:
    """How many bytes more than one all-reduce's count a rank may send for it. A busy machine sometimes sends a
    message again: a notice (a preamble) or a segment (a preamble and at most the message); measured, +48, +52 and
    +56 bytes for a 4- or 8-byte message in 16 calls of 600 on 2 cores loaded by four spinning processes. Two such
    messages are allowed: fewer bytes than any rank sends in a second all-reduce of a few elements (148 or more)
    or in a barrier (288 on 3 or 4 ranks, 144 on 2)."""
    return 2 * (GLOO_PREAMBLE_BYTES + message_bytes)


def one_all_reduce(sent: list[int], message_bytes: int, element_sizes=(1, 2, 4, 8, 16)) -> bool:
    """Whether the bytes each rank sent (:func:`observed_job`) are one all-reduce of ``message_bytes``: on every
    rank, at least one element size's count and at most :func:`allowance` above it. None, two, or another
    collective put other counts on some rank (tests/test_wire.py measures it)."""
    if message_bytes <= 0:
        return False  # an all-reduce of nothing sums nothing
    n = len(sent)
    return all(any(count <= got <= count + allowance(message_bytes)
                   for count in all_reduce_bytes(message_bytes, n, r, element_sizes))
               for r, got in enumerate(sent))


def _joined() -> None:
    """A job that does nothing: once it returned, every rank has joined the group and connected its mesh."""


def observed_job(ranks, fn, *args) -> tuple:
    """:func:`~distlab.grading.harness.run_job`, and the bytes each rank sent to the others while it ran, as the
    kernel counted them on the mesh (``None`` where :func:`available` is False). Raises :class:`Unaccounted` when
    the ranks' connections to each other changed during the job or could not be listed after it (before it,
    nothing of the student's had run there)."""
    if not available():
        return run_job(ranks, fn, *args), None
    run_job(ranks, _joined)  # a fresh group connects gloo's mesh before its first job: count from after that
    pids = [pid for pid, _ in ranks.processes()]
    before = _mesh(pids)
    run = run_job(ranks, fn, *args)
    after = _mesh(pids)
    if after.keys() != before.keys():
        opened, closed = len(after.keys() - before.keys()), len(before.keys() - after.keys())
        raise Unaccounted(f"the ranks opened {opened} and closed {closed} connections to each other during the job; "
                          "gloo's mesh stands from the start")
    sent = [0] * len(pids)
    for inode, (rank, count) in after.items():
        sent[rank] += count - before[inode][1]
    return run, sent
