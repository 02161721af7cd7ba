"""Communication accounting: count every collective and point-to-point op a rank makes.

Inside a launched rank, the public ``torch.distributed`` functions are wrapped
(not replaced: the real collective still runs) so that each call records its
op, the bytes of the tensors handed to it, and the bytes this rank puts on the
wire. For point-to-point ops the wire bytes are exact. For collectives they
follow the ring algorithm that NCCL and gloo use for large messages, so a lab
can compare a measured payload with the textbook cost model, e.g. ring
all-reduce sends 2(N-1)/N * M bytes per rank.

Calls made from C++ (the reducer inside torch's DDP, for example) do not pass
through the Python API and are not counted; the labs say so where it matters.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

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
class CommLog:
    """One rank's record of a job: totals per op and a time-stamped event list."""

    rank: int = 0
    ops: dict[str, OpStats] = field(default_factory=lambda: defaultdict(OpStats))
    events: list[tuple[str, int, float, float]] = field(default_factory=list)  # op, bytes, start, end

    def total(self, attribute: str = "wire_bytes", ops: tuple[str, ...] | None = None) -> float:
        return sum(getattr(s, attribute) for name, s in self.ops.items() if ops is None or name in ops)

    def summary(self) -> dict[str, dict[str, float]]:
        return {name: vars(stats).copy() for name, stats in sorted(self.ops.items())}


class _Recorder(threading.local):
    depth = 0


_recorder = _Recorder()
_log = CommLog()
_clock_origin = 0.0
_status_hook: Callable[[str | None], None] = lambda op: None


def current_log() -> CommLog:
    return _log


def reset(rank: int, clock_origin: float) -> None:
    """Start a fresh log for a new job; times are seconds since ``clock_origin``."""
    global _log, _clock_origin
    _log = CommLog(rank=rank)
    _clock_origin = clock_origin


def set_status_hook(hook: Callable[[str | None], None]) -> None:
    """The launcher's watchdog learns which op a rank is blocked in through this hook."""
    global _status_hook
    _status_hook = hook


class _TrackedWork:
    """Wraps the handle of an async op so its completion time lands in the log."""

    def __init__(self, work, op: str, index: int):
        self._work, self._op, self._index = work, op, index

    def wait(self, *args, **kwargs):
        _status_hook(f"wait({self._op})")
        try:
            return self._work.wait(*args, **kwargs)
        except Exception as error:
            error.distlab_op = f"wait({self._op})"
            raise
        finally:
            _status_hook(None)
            _finish_event(self._index)

    def __getattr__(self, name):
        return getattr(self._work, name)


def _finish_event(index: int) -> None:
    op, size, start, end = _log.events[index]
    if end != end:  # NaN: not finished yet
        _log.events[index] = (op, size, start, time.perf_counter() - _clock_origin)


def _wrap(op: str, real: Callable) -> Callable:
    @functools.wraps(real)
    def counted(*args, **kwargs):
        if _recorder.depth:  # an op built from other ops (all_gather_object…) counts once
            return real(*args, **kwargs)
        group = kwargs.get("group")
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        size = _message_bytes(op, args, kwargs, world)
        stats = _log.ops[op]
        stats.calls += 1
        stats.payload_bytes += size
        stats.wire_bytes += WIRE_BYTES[op](size, world)
        start = time.perf_counter() - _clock_origin
        index = len(_log.events)
        _log.events.append((op, size, start, float("nan")))
        _recorder.depth += 1
        blocking = not kwargs.get("async_op", False) and op not in ("isend", "irecv")
        if blocking:
            _status_hook(op)
        try:
            work = real(*args, **kwargs)
        except Exception as error:
            error.distlab_op = op  # lets the launcher say which collective failed
            raise
        finally:
            _recorder.depth -= 1
            if blocking:
                _status_hook(None)
        if work is None or blocking:
            _finish_event(index)
            return work
        try:  # stamp the true completion time, so overlap shows on the timeline
            work.get_future().add_done_callback(lambda _: _finish_event(index))
        except RuntimeError:
            pass  # this backend/op has no future; the span then ends at wait()
        return _TrackedWork(work, op, index)

    counted.__distlab_real__ = real
    return counted


def install() -> None:
    """Wrap the torch.distributed ops in this process (idempotent).

    Both the package attribute and the ``distributed_c10d`` global are replaced,
    so ``dist.all_reduce`` from user code, torch's own Python callers (FSDP2,
    ``batch_isend_irecv``'s P2POp check) and nested ops all see one wrapper.
    """
    from torch.distributed import distributed_c10d

    for op in WIRE_BYTES:
        real = getattr(distributed_c10d, op, None)
        if real is None or hasattr(real, "__distlab_real__"):  # absent in this torch version, or done
            continue
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

FUNCTIONAL_OPS: dict[str, str] = {  # funcol function -> name in the log (its cost model: WIRE_BYTES of the c10d op)
    "all_reduce": "functional_all_reduce",
    "all_gather_tensor": "functional_all_gather",
    "all_gather_single": "functional_all_gather",  # torch >= 2.13 name of all_gather_tensor
    "reduce_scatter_tensor": "functional_reduce_scatter",
    "reduce_scatter_single": "functional_reduce_scatter",
    "all_to_all_single": "functional_all_to_all",
    "broadcast": "functional_broadcast",
}
_FUNCTIONAL_COST = {"functional_all_reduce": "all_reduce", "functional_all_gather": "all_gather",
                    "functional_reduce_scatter": "reduce_scatter", "functional_all_to_all": "all_to_all",
                    "functional_broadcast": "broadcast"}


def _functional_group_size(group) -> int:
    from torch.distributed import _functional_collectives as funcol

    try:
        return funcol._expand_group(group)[2]
    except Exception:  # a private helper: if it moves, fall back to the default group
        return dist.get_world_size() if dist.is_initialized() else 1


def _wrap_functional(name: str, real: Callable) -> Callable:
    import inspect

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
        stats.wire_bytes += WIRE_BYTES[_FUNCTIONAL_COST[logged]](size, world)
        start = time.perf_counter() - _clock_origin
        index = len(_log.events)
        _log.events.append((logged, size, start, float("nan")))
        _recorder.depth += 1
        try:
            return real(*args, **kwargs)
        except Exception as error:
            error.distlab_op = logged
            raise
        finally:
            _recorder.depth -= 1
            _finish_event(index)

    counted.__distlab_real__ = real
    return counted


def _install_functional() -> None:
    """Wrap the functional collectives DTensor calls (module attributes of funcol; idempotent)."""
    from torch.distributed import _functional_collectives as funcol

    for name in FUNCTIONAL_OPS:
        real = getattr(funcol, name, None)
        if real is None or hasattr(real, "__distlab_real__"):
            continue
        setattr(funcol, name, _wrap_functional(name, real))
