"""The bytes a rank really put on the wire, counted by the operating system's TCP stack.

``distlab.runtime.comm`` logs every collective with a *modelled* ``wire_bytes``: a built-in
``dist.all_reduce`` of M bytes is booked as the ring's 2(N-1)/N * M, because the library does not see
inside gloo's or NCCL's C++ code. This module measures instead. gloo talks to the other ranks over TCP
sockets, and on Linux the kernel keeps per-socket counters (``ss -ti`` prints them as ``bytes_sent`` and
``bytes_received``): :func:`socket_counters` reads them for every TCP socket this process holds, with
``getsockopt(TCP_INFO)`` on a duplicate of each descriptor listed in ``/proc/self/fd`` (the same
``struct tcp_info`` that netlink's ``INET_DIAG_INFO`` returns to ``ss``; no privileges are needed for
one's own sockets), leaving out the connection to the rendezvous store (``MASTER_PORT``).

What is counted: the TCP payload, i.e. the tensor bytes *plus* gloo's own framing (a header per message,
its notifications); not the TCP/IP headers below it. ``bytes_sent`` also counts retransmissions, which do
not happen on the loopback interface. Under NCCL the bytes travel over NVLink, PCIe or InfiniBand verbs,
which no socket counter sees: :func:`supported` is False there, and the modelled figure is all there is.

:func:`count` brackets a block of code on every rank between two barriers and subtracts the bytes of one
barrier, so what remains is what the block itself sent and received.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch.distributed as dist

__all__ = ["WireBytes", "supported", "socket_counters", "unique_bytes_sent", "count"]

# Offsets in Linux's struct tcp_info (include/uapi/linux/tcp.h).
_BYTES_RECEIVED = 128  # __u64 tcpi_bytes_received, Linux >= 4.1
_BYTES_SENT = 200  # __u64 tcpi_bytes_sent, Linux >= 4.19
_BYTES_RETRANS = 208  # __u64 tcpi_bytes_retrans, beside it: bytes sent again (a loaded machine drops segments)
# The length of a tcp_info that unique_bytes_sent can read (distlab.grading.wiretap checks its answers against it too)
UNIQUE_BYTES_SENT_NEEDS = _BYTES_RETRANS + 8
_TCP_INFO_LEN = 256  # ask for more than any kernel returns; a shorter answer is an older kernel's


@dataclass(frozen=True)
class WireBytes:
    """TCP payload bytes this process sent and received, over ``sockets`` sockets."""

    sent: int = 0
    received: int = 0
    sockets: int = 0

    def __sub__(self, other: WireBytes) -> WireBytes:
        return WireBytes(self.sent - other.sent, self.received - other.received, self.sockets)


def _store_port() -> int | None:
    port = os.environ.get("MASTER_PORT", "")
    return int(port) if port.isdigit() else None


def _tcp_sockets() -> Iterator[socket.socket]:
    """A duplicate of each connected TCP socket of this process, closed after use by the caller's loop."""
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:  # closed since the listing, or not a socket we may inspect
            continue
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
                yield sock
        finally:
            sock.close()


def unique_bytes_sent(info: bytes, offset: int = 0) -> int:
    """The bytes a socket sent once, from its ``struct tcp_info`` at ``offset`` of ``info``: what the program sent.
    ``tcpi_bytes_sent`` counts a segment sent again as often as it went, and a busy machine's loopback drops some
    (a test once read a 400 kB send as 432,864 bytes); ``tcpi_bytes_retrans`` counts those, and comes off."""
    sent, again = struct.unpack_from("=QQ", info, offset + _BYTES_SENT)
    return sent - again


def socket_counters() -> WireBytes:
    """The kernel's ``bytes_sent``/``bytes_received`` summed over this process's connected TCP sockets,
    except the one to the rendezvous store. Raises ``RuntimeError`` where the kernel does not count them."""
    if not sys.platform.startswith("linux") or not hasattr(socket, "TCP_INFO"):
        raise RuntimeError("per-socket byte counters need Linux (struct tcp_info)")
    store, sent, received, sockets = _store_port(), 0, 0, 0
    for sock in _tcp_sockets():
        try:
            peer_port = sock.getpeername()[1]
        except OSError:  # a listening socket: it carries no data
            continue
        if peer_port == store:
            continue
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
        if len(info) < UNIQUE_BYTES_SENT_NEEDS:
            raise RuntimeError(f"this kernel's tcp_info has {len(info)} bytes, without tcpi_bytes_sent "
                               "(Linux 4.19 or later)")
        sent += unique_bytes_sent(info)
        received += struct.unpack_from("=Q", info, _BYTES_RECEIVED)[0]
        sockets += 1
    return WireBytes(sent, received, sockets)


def supported() -> bool:
    """True inside a gloo rank on a Linux kernel that counts TCP bytes per socket."""
    if not dist.is_initialized() or dist.get_backend() != "gloo":
        return False
    try:
        return socket_counters().sockets > 0
    except RuntimeError:
        return False


BARRIERS_SUBTRACTED = 3


class _Count:
    """What :func:`count` yields: ``sent``/``received`` are filled in when the block ends."""

    def __init__(self) -> None:
        self.bytes = WireBytes()

    @property
    def sent(self) -> int:
        return self.bytes.sent

    @property
    def received(self) -> int:
        return self.bytes.received


@contextmanager
def count() -> Iterator[_Count]:
    """Measure the TCP bytes this rank sends and receives inside the block (call on every rank).

    A barrier before the block starts every rank together; one after it ends only once every rank has
    received all it was sent, so nothing is still queued; that barrier's bytes are subtracted, as the fewest that
    each of :data:`BARRIERS_SUBTRACTED` barriers counted alone sent: a busy machine can make a barrier send more
    (a segment sent again), never less, and subtracting one that did once read a rank's all-reduce 48 bytes short."""
    if not supported():
        raise RuntimeError("wire.count() needs a gloo process group on Linux (see wire.supported())")
    result = _Count()
    dist.barrier()
    before = socket_counters()
    yield result
    dist.barrier()
    after = socket_counters()
    barriers = []
    for _ in range(BARRIERS_SUBTRACTED):
        start = socket_counters()
        dist.barrier()
        barriers.append(socket_counters() - start)
    barrier = WireBytes(min(b.sent for b in barriers), min(b.received for b in barriers))
    result.bytes = after - before - barrier
