"""Communication accounting: count every collective and point-to-point op a rank makes.

Inside a launched rank, the public ``torch.distributed`` functions are wrapped
(not replaced: the real collective still runs) so that each call records its
op, the bytes of the tensors handed to it, and the bytes this rank puts on the
wire. For point-to-point ops the wire bytes are exact. For collectives they
follow the ring algorithm that NCCL and gloo use for large messages, so a lab
can compare a measured payload with the textbook cost model, e.g. ring
all-reduce sends 2(N-1)/N * M bytes per rank. ``since(before)``, ``before`` a
``snapshot()``, reads what a piece of code sent, per collective whichever torch function issued it.

The same wrapper keeps the launcher informed and jobs honest:

* a *status hook* tells the parent's watchdog which op (and which peer) a rank
  is blocked in, so a hang is reported as "rank 0 waited 10 s in recv from rank 1";
* a *ledger* per job (collective calls per group, bytes sent to and received from
  each peer) lets the launcher prove that a job left nothing unmatched in flight;
* unfinished async ops are tracked so a job's end can drain them;
* on the default group, a *fingerprint board* in shared memory catches a
  collective whose op, size or dtype differs between ranks before gloo aborts.

Calls made from C++ (the reducer inside torch's DDP, for example) do not pass
through the Python API and are not counted; the labs say so where it matters.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Iterable, Mapping

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol
from torch.distributed import distributed_c10d

from distlab.runtime.frames import is_library_frame

# The Python API functions we wrap, with how many bytes one rank sends for each.
# ``size`` is bytes of the tensor argument that defines the op's message size M,
# ``n`` the group size.
_RING = lambda size, n: (n - 1) * size / n  # noqa: E731  one pass of a ring
WIRE_BYTES: dict[str, Callable[[int, int], float]] = {
    "all_reduce": lambda size, n: 2 * (n - 1) * size / n,
    "reduce": _RING,
    "broadcast": _RING,
    "all_gather": _RING,  # M = the gathered output
    "all_gather_into_tensor": _RING,
    "all_gather_single": _RING,  # torch>=2.13 name of all_gather_into_tensor
    "reduce_scatter": _RING,  # M = the full input
    "reduce_scatter_tensor": _RING,
    "reduce_scatter_single": _RING,  # torch>=2.13 name of reduce_scatter_tensor
    "all_to_all": _RING,  # every chunk but our own leaves this rank
    "all_to_all_single": _RING,
    "gather": lambda size, n: size / n,  # each non-root sends its piece; averaged
    "scatter": lambda size, n: size / n,
    "send": lambda size, n: size,
    "isend": lambda size, n: size,
    "recv": lambda size, n: 0,
    "irecv": lambda size, n: 0,
    "barrier": lambda size, n: 0,
}
P2P_OPS = ("send", "isend", "recv", "irecv")
_SENDS, _RECVS = ("send", "isend"), ("recv", "irecv")
# Collectives whose tensor must have the same number of elements on every rank (the one
# the fingerprint compares); for the others only the op and dtype must agree.
_SAME_SIZE = {"all_reduce": 0, "reduce": 0, "broadcast": 0, "all_gather": 1, "all_gather_into_tensor": 1,
              "all_gather_single": 1, "reduce_scatter": 0, "reduce_scatter_tensor": 0,
              "reduce_scatter_single": 0}
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
           torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128]


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(item) for item in obj)
    return 0


def _message_bytes(op: str, args: tuple, kwargs: dict, world: int) -> int:
    """The op's message size M in bytes, the quantity cost models are written in."""
    first = args[0] if args else next(iter(kwargs.values()), None)
    if op in ("all_gather", "all_gather_into_tensor", "all_gather_single"):
        return _nbytes(first)  # output: list of N tensors or one N-times tensor
    if op == "reduce_scatter":
        return _nbytes(args[1] if len(args) > 1 else kwargs.get("input_list"))
    if op in ("reduce_scatter_tensor", "reduce_scatter_single"):
        return _nbytes(args[1] if len(args) > 1 else kwargs.get("input"))
    if op in ("all_to_all", "all_to_all_single"):
        return _nbytes(args[1] if len(args) > 1 else kwargs.get("input_tensor_list", kwargs.get("input")))
    if op == "gather":
        return _nbytes(first) * world
    if op == "scatter":
        return _nbytes(args[1] if len(args) > 1 else kwargs.get("scatter_list")) or _nbytes(first) * world
    return _nbytes(first)


@dataclass
class OpStats:
    calls: int = 0
    payload_bytes: int = 0  # M summed over calls
    wire_bytes: float = 0.0  # bytes this rank sent (exact for p2p, ring model for collectives)


@dataclass
class Ledger:
    """What one job asked of the network, for the launcher to check that every call was matched.

    ``collectives``: calls per group (``"world"`` or the group's ranks); ``sent``/``received``:
    point-to-point bytes per peer (``-1``: a receive from any source not yet completed).
    """

    collectives: dict = field(default_factory=lambda: defaultdict(int))
    sent: dict = field(default_factory=lambda: defaultdict(int))
    received: dict = field(default_factory=lambda: defaultdict(int))


@dataclass
class CommLog:
    """One rank's record of a job: totals per op and a time-stamped event list."""

    rank: int = 0
    ops: dict[str, OpStats] = field(default_factory=lambda: defaultdict(OpStats))
    events: list[tuple[str, int, float, float]] = field(default_factory=list)  # op, bytes, start, end
    ledger: Ledger = field(default_factory=Ledger)
    # One (peer, group) per event, in the same order: the global rank on the other end of a point-to-point op
    # (-1 for collectives and any-source receives not yet completed) and the group ("world" or its ranks).
    peers: list[tuple[int, str]] = field(default_factory=list)

    def total(self, attribute: str = "wire_bytes", ops: tuple[str, ...] | None = None) -> float:
        return sum(getattr(s, attribute) for name, s in self.ops.items() if ops is None or name in ops)

    def summary(self) -> dict[str, dict[str, float]]:
        return {name: vars(stats).copy() for name, stats in sorted(self.ops.items())}


class CollectiveMismatch(RuntimeError):
    """Two ranks called different collectives (or with different sizes or dtypes) at the same point."""


class _Recorder(threading.local):
    depth = 0


_recorder = _Recorder()
_log = CommLog()
_clock_origin = 0.0


def _no_status(op: str | None, peer: int = -1) -> None:
    """Outside a launched rank (a plain script, torchrun) nobody watches the status: publish nothing."""


def _no_inflight(peer: int) -> None:
    """See :func:`_no_status`."""


_status_hook: Callable[[str | None, int], None] = _no_status
_inflight_hook: Callable[[int], None] = _no_inflight
_unfinished: dict[int, "_TrackedWork"] = {}
_unfinished_sends: dict[int, int] = {}  # index -> peer of the isends among them, oldest first
_sends_lock = threading.Lock()  # a work's completion callback may run on the backend's thread
_backend_name: str | None = None  # the default group's backend, looked up once per job
_board = None  # shared fingerprint board: 4 doubles per rank (sequence, op, size, dtype)
_board_rank = 0
_board_seq = 0
_group_keys: dict[int, str] = {}  # id(group) -> its key, looked up once per job (the p2p path stays cheap)


def current_log() -> CommLog:
    return _log


def reset(rank: int, clock_origin: float) -> None:
    """Start a fresh log for a new job; times are seconds since ``clock_origin``."""
    global _log, _clock_origin, _backend_name
    _log = CommLog(rank=rank)
    _clock_origin = clock_origin
    _backend_name = None
    _group_keys.clear()
    _unfinished.clear()
    with _sends_lock:
        _unfinished_sends.clear()
    _inflight_hook(-1)


def set_status_hook(hook: Callable[[str | None, int], None], inflight: Callable[[int], None] | None = None) -> None:
    """The launcher's watchdog learns which op (and peer) a rank is blocked in through ``hook``, and
    to which peer its oldest unfinished isend goes (-1: none) through ``inflight``."""
    global _status_hook, _inflight_hook
    _status_hook = hook
    if inflight is not None:
        _inflight_hook = inflight


def set_fingerprint_board(board, rank: int) -> None:
    """Shared memory in which ranks of one launch compare their default-group collectives."""
    global _board, _board_rank, _board_seq
    _board, _board_rank, _board_seq = board, rank, 0


def unfinished() -> list["_TrackedWork"]:
    """Async ops of this job that have not completed yet, oldest first."""
    return [work for _, work in sorted(_unfinished.items())]


# ---------------------------------------------------------------- arguments by name

_PARAMS: dict[str, dict[str, int]] = {}


def _argument(op: str, args: tuple, kwargs: dict, name: str, default=None):
    if name in kwargs:
        return kwargs[name]
    index = _PARAMS.get(op, {}).get(name)
    return args[index] if index is not None and index < len(args) else default


def _is_world(group) -> bool:
    return group is None or group is dist.GroupMember.WORLD


def _group_key(group) -> str:
    return "world" if _is_world(group) else ",".join(map(str, dist.get_process_group_ranks(group)))


def _cached_group_key(group) -> str:
    if _is_world(group):
        return "world"
    key = _group_keys.get(id(group))
    if key is None:
        key = _group_keys[id(group)] = _group_key(group)
    return key


def _peer(op: str, args: tuple, kwargs: dict, group) -> int:
    """The global rank on the other end of a point-to-point op (-1: any source)."""
    name = "dst" if op in _SENDS else "src"
    peer = _argument(op, args, kwargs, name)
    if peer is None:
        local = _argument(op, args, kwargs, f"group_{name}")
        if local is None:
            return -1
        peer = local if _is_world(group) else dist.get_global_rank(group, local)
    return int(peer)


# ---------------------------------------------------------------- the fingerprint board

def _check_fingerprint(op: str, args: tuple, kwargs: dict) -> None:
    """Publish this collective's fingerprint, and compare it with ranks already at the same call.

    A seqlock: the sequence number is set to -1 while the fields change, so a reader never
    mixes two calls' fields. A rank arriving second sees the first's fingerprint; a mismatch
    raises here, with both calls named, instead of gloo aborting the process.
    """
    global _board_seq
    board, me = _board, _board_rank
    _board_seq += 1
    code = list(WIRE_BYTES).index(op) + 1
    index = _SAME_SIZE.get(op)
    tensor = args[index] if index is not None and index < len(args) else None
    numel = tensor.numel() if isinstance(tensor, torch.Tensor) else -1
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    dtype = _DTYPES.index(first.dtype) if isinstance(first, torch.Tensor) and first.dtype in _DTYPES else -1
    base = 4 * me
    board[base] = -1.0
    board[base + 1], board[base + 2], board[base + 3] = code, numel, dtype
    board[base] = float(_board_seq)
    for q in range(len(board) // 4):
        if q == me:
            continue
        seq = board[4 * q]
        if seq != _board_seq:
            continue
        other = (board[4 * q + 1], board[4 * q + 2], board[4 * q + 3])
        if board[4 * q] != seq:  # it moved on while we read
            continue
        mine = (float(code), float(numel), float(dtype))
        if other != mine:
            raise CollectiveMismatch(
                f"collective call #{_board_seq} on the default group differs between ranks: rank {me} called "
                f"{_describe(*mine)}, rank {q} called {_describe(*other)}. Every rank must make the same "
                f"collective calls, in the same order, with tensors of the same size and dtype.")


def _describe(code: float, numel: float, dtype: float) -> str:
    op = list(WIRE_BYTES)[int(code) - 1]
    parts = [f"{int(numel)} elements"] if numel >= 0 else []
    if dtype >= 0:
        parts.append(str(_DTYPES[int(dtype)]).replace("torch.", ""))
    return f"{op}({', '.join(parts)})" if parts else op


# ---------------------------------------------------------------- async work

class _TrackedWork:
    """Wraps the handle of an async op so its completion time lands in the log."""

    def __init__(self, work, op: str, index: int, peer: int):
        self._work, self._op, self._index, self.peer = work, op, index, peer
        self._log = _log  # the job that issued it, even if it completes during the next one
        self.issued_at = _caller_line()

    @property
    def op(self) -> str:
        return self._op

    def wait(self, *args, **kwargs):
        _status_hook(f"wait({self._op})", self.peer)
        try:
            result = self._work.wait(*args, **kwargs)
        except Exception as error:
            error.distlab_op = f"wait({self._op})"
            error.distlab_peer = self.peer
            raise
        finally:
            _status_hook(None, -1)
        self._done()
        return result

    def _done(self, *_) -> None:
        _finish_event(self._log, self._index)
        if self._log is _log and _unfinished.pop(self._index, None) is not None and self._op == "isend":
            with _sends_lock:
                was_oldest = next(iter(_unfinished_sends), None) == self._index
                _unfinished_sends.pop(self._index, None)
                oldest_peer = next(iter(_unfinished_sends.values()), -1)
            if was_oldest:  # the watchdog is told of the oldest isend only
                _inflight_hook(oldest_peer)

    def __getattr__(self, name):
        return getattr(self._work, name)


def _caller_line() -> str:
    """``file:line`` of the user code that issued an op (its first frame outside the library, :mod:`.frames`)."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not is_library_frame(filename):
            return f"{filename}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


_NO_FUTURE: set[tuple[str, str]] = set()  # (backend, op) whose works have no future


def _on_completion(work, op: str, callback) -> None:
    """Stamp the true completion time, so overlap shows on the timeline.

    Some works have no future (gloo's point-to-point ones); asking raises a C++ error that captures a
    backtrace, ~100 µs per message, so each (backend, op) is asked once. Without a future the span
    ends at ``wait()``.
    """
    global _backend_name
    if _backend_name is None and dist.is_initialized():
        _backend_name = dist.get_backend()
    key = (_backend_name or "", op)
    if key in _NO_FUTURE:
        return
    try:
        work.get_future().add_done_callback(callback)
    except RuntimeError:
        _NO_FUTURE.add(key)


def _finish_event(log: CommLog, index: int) -> None:
    op, size, start, end = log.events[index]
    if end != end:  # NaN: not finished yet
        log.events[index] = (op, size, start, time.perf_counter() - _clock_origin)


# ---------------------------------------------------------------- the wrapper

def _wrap(op: str, real: Callable) -> Callable:
    """The counting wrapper of one op.

    It runs on every message, and a pipelined ring or a pipeline schedule sends thousands of
    small ones, so the point-to-point path asks torch for nothing it does not need (no group
    size, the backend once per job): each Python call here is time on the sender's critical path.
    """
    p2p = op in P2P_OPS
    nonblocking = op in ("isend", "irecv")

    @functools.wraps(real)
    def counted(*args, **kwargs):
        if _recorder.depth:  # an op built from other ops (all_gather_object…) counts once
            return real(*args, **kwargs)
        group = _argument(op, args, kwargs, "group")
        world = 1 if p2p else dist.get_world_size(group) if dist.is_initialized() else 1
        size = _message_bytes(op, args, kwargs, world)
        stats = _log.ops[op]
        stats.calls += 1
        stats.payload_bytes += size
        stats.wire_bytes += WIRE_BYTES[op](size, world)
        peer = _peer(op, args, kwargs, group) if p2p else -1
        if not p2p and dist.is_initialized():
            _log.ledger.collectives[_group_key(group)] += 1
            if _board is not None and _is_world(group):
                try:
                    _check_fingerprint(op, args, kwargs)
                except CollectiveMismatch as error:
                    error.distlab_op = op
                    raise
        if op in _SENDS:
            _log.ledger.sent[peer] += size
        start = time.perf_counter() - _clock_origin
        index = len(_log.events)
        _log.events.append((op, size, start, float("nan")))
        _log.peers.append((peer, _cached_group_key(group) if dist.is_initialized() else "world"))
        _recorder.depth += 1
        blocking = not nonblocking and not _argument(op, args, kwargs, "async_op", False)
        if blocking:
            _status_hook(op, peer)
        try:
            work = real(*args, **kwargs)
        except Exception as error:
            error.distlab_op = op  # lets the launcher say which op failed, and with whom
            error.distlab_peer = peer
            raise
        finally:
            _recorder.depth -= 1
            if blocking:
                _status_hook(None, -1)
        if op in _RECVS:  # a receive from any source learns its peer when it completes
            source = work if op == "recv" and isinstance(work, int) else peer
            _log.ledger.received[source if source is not None else -1] += size
            if peer == -1 and source is not None:
                _log.peers[index] = (int(source), _log.peers[index][1])
        if work is None or blocking:
            _finish_event(_log, index)
            return work
        tracked = _TrackedWork(work, op, index, peer)
        _unfinished[index] = tracked
        if op == "isend":
            with _sends_lock:
                _unfinished_sends[index] = peer
                oldest = len(_unfinished_sends) == 1
            if oldest:
                _inflight_hook(peer)
        _on_completion(work, op, tracked._done)
        return tracked

    counted.__distlab_real__ = real
    return counted


def install() -> None:
    """Wrap the torch.distributed ops in this process (idempotent).

    Both the package attribute and the ``distributed_c10d`` global are replaced,
    so ``dist.all_reduce`` from user code, torch's own Python callers (FSDP2,
    ``batch_isend_irecv``'s P2POp check) and nested ops all see one wrapper.
    """
    for op in WIRE_BYTES:
        real = getattr(distributed_c10d, op, None)
        if real is None or hasattr(real, "__distlab_real__"):  # absent in this torch version, or done
            continue
        _PARAMS[op] = {name: i for i, name in enumerate(inspect.signature(inspect.unwrap(real)).parameters)}
        counted = _wrap(op, real)
        setattr(distributed_c10d, op, counted)
        setattr(dist, op, counted)
    _install_functional()


# ---------------------------------------------------------------- functional collectives (DTensor)
#
# DTensor (``parallelize_module``'s tensor parallelism, ``distribute_tensor``, ``full_tensor()``)
# redistributes tensors with ``torch.distributed._functional_collectives`` ("funcol"), not with
# the ``torch.distributed`` calls above. They are counted here under their own names
# (``functional_all_reduce`` ...), so a log can tell them apart from the c10d calls a lab makes.
# A functional collective returns at once (its result is waited for on first use), so its
# event ends when it is issued: calls and bytes are exact; its span on a timeline is not.

FUNCTIONAL_OPS: dict[str, str] = {  # funcol function -> name in the log (cost model: WIRE_BYTES[canonical(name)])
    "all_reduce": "functional_all_reduce",
    "all_gather_tensor": "functional_all_gather",
    "all_gather_single": "functional_all_gather",  # torch >= 2.13 name of all_gather_tensor
    "reduce_scatter_tensor": "functional_reduce_scatter",
    "reduce_scatter_single": "functional_reduce_scatter",
    "all_to_all_single": "functional_all_to_all",
    "broadcast": "functional_broadcast",
}


def _functional_group_size(group) -> int:
    try:
        return funcol._expand_group(group)[2]
    except Exception:  # a private helper: if it moves, fall back to the default group
        return dist.get_world_size() if dist.is_initialized() else 1


def _wrap_functional(name: str, real: Callable) -> Callable:
    logged = FUNCTIONAL_OPS[name]
    signature = inspect.signature(real)

    @functools.wraps(real)
    def counted(*args, **kwargs):
        if _recorder.depth:  # all_gather_tensor calls all_gather_single: count once
            return real(*args, **kwargs)
        bound = signature.bind(*args, **kwargs).arguments
        world = _functional_group_size(bound.get("group"))
        size = _nbytes(next(iter(bound.values())))
        if logged == "functional_all_gather":
            size *= world  # M = the gathered output, as for the c10d all-gathers
        stats = _log.ops[logged]
        stats.calls += 1
        stats.payload_bytes += size
        stats.wire_bytes += WIRE_BYTES[canonical(logged)](size, world)
        start = time.perf_counter() - _clock_origin
        log, index = _log, len(_log.events)
        log.events.append((logged, size, start, float("nan")))
        log.peers.append((-1, "functional"))
        _recorder.depth += 1
        try:
            return real(*args, **kwargs)
        except Exception as error:
            error.distlab_op = logged
            raise
        finally:
            _recorder.depth -= 1
            _finish_event(log, index)

    counted.__distlab_real__ = real
    return counted


def _install_functional() -> None:
    """Wrap the functional collectives DTensor calls (module attributes of funcol; idempotent)."""
    for name in FUNCTIONAL_OPS:
        real = getattr(funcol, name, None)
        if real is None or hasattr(real, "__distlab_real__"):
            continue
        setattr(funcol, name, _wrap_functional(name, real))


# ---------------------------------------------------------------- snapshots: what a piece of code sent
#
# A lab measures a step, a layer or a student's function by what the log gained while it ran:
# ``before = snapshot(); ...; since(before)``. The log names an op by the function called, and one
# collective has several (``all_gather_into_tensor``, renamed ``all_gather_single`` in torch 2.13;
# DTensor's ``functional_all_gather``), so a measurement counts each under one canonical name and
# reads the same on every torch version and through every API.

CANONICAL_OPS: dict[str, str] = {  # name in the log -> the collective it is; names not listed are their own
    "all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather", "functional_all_gather": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
    "functional_reduce_scatter": "reduce_scatter",
    "all_to_all_single": "all_to_all", "functional_all_to_all": "all_to_all",
    "functional_all_reduce": "all_reduce", "functional_broadcast": "broadcast",
}


def canonical(op: str) -> str:
    """The collective a logged op is (``all_gather_single`` → ``all_gather``); other names are their own."""
    return CANONICAL_OPS.get(op, op)


@dataclass(frozen=True)
class OpCounts:
    """One canonical op's calls, payload bytes and bytes sent (as in :class:`OpStats`)."""

    calls: int = 0
    payload_bytes: int = 0
    wire_bytes: float = 0.0


@dataclass(frozen=True)
class Snapshot:
    """This rank's counts at one moment, per canonical op, and how many events its log held then."""

    ops: Mapping[str, OpCounts]
    events: int
    log: CommLog = field(repr=False, compare=False)  # the job's log: a diff across jobs would be meaningless


@dataclass(frozen=True)
class Traffic:
    """What this rank communicated between two moments: counts of each canonical op called in between,
    and the events in order as ``(logged op, bytes, start, end)`` (``end`` is NaN while an async op is in flight)."""

    ops: Mapping[str, OpCounts]
    events: tuple[tuple[str, int, float, float], ...]

    def total(self, attribute: str = "wire_bytes", ops: str | Iterable[str] | None = None) -> float:
        """``attribute`` summed over ``ops`` (canonical or logged names; default: every op)."""
        wanted = None if ops is None else {canonical(op) for op in ([ops] if isinstance(ops, str) else ops)}
        return sum(getattr(counts, attribute) for op, counts in self.ops.items() if wanted is None or op in wanted)


def snapshot() -> Snapshot:
    """Freeze this rank's counts now; :func:`since` then says what was communicated after."""
    merged: dict[str, list] = defaultdict(lambda: [0, 0, 0.0])
    for name, stats in _log.ops.items():
        row = merged[canonical(name)]
        row[0] += stats.calls
        row[1] += stats.payload_bytes
        row[2] += stats.wire_bytes
    return Snapshot(MappingProxyType({op: OpCounts(*row) for op, row in merged.items()}), len(_log.events), _log)


def since(before: Snapshot, until: Snapshot | None = None) -> Traffic:
    """What this rank communicated after ``before`` and up to ``until`` (a later :func:`snapshot`; default: now)."""
    after = until or snapshot()
    if after.log is not before.log:
        raise ValueError("the two snapshots come from different jobs (each job starts a fresh comm log); "
                         "take both in the same job")
    ops = {}
    for op, now in after.ops.items():
        then = before.ops.get(op, OpCounts())
        if now.calls != then.calls:
            ops[op] = OpCounts(now.calls - then.calls, now.payload_bytes - then.payload_bytes,
                               now.wire_bytes - then.wire_bytes)
    return Traffic(MappingProxyType(ops), tuple(before.log.events[before.events:after.events]))
