"""Start real torch.distributed ranks from a notebook cell and bring their results back.

``launch(fn, world_size=4)`` runs ``fn`` in ``world_size`` OS processes, each
with the default process group initialised (gloo on CPU, NCCL with one GPU per
rank), and returns their return values in rank order. ``Ranks(4)`` keeps such a
group alive between cells so that a small job costs milliseconds.

Processes come from a forkserver that imported torch once: never a fork of the
notebook (which may hold CUDA state), and no per-rank torch import either.
Every outcome ends the same way: all ranks accounted for, none left behind.

* Each rank leads its own process group, so ending a rank ends everything it
  started (a DataLoader's workers, a subprocess).
* A small reaper process per group holds the other end of a lifeline: if the
  launching process dies, even by ``kill -9`` while a rank spins holding its GIL,
  the reaper kills the ranks' process groups.
* An interrupt (the notebook's stop button, Ctrl-C) stops a launch at once;
  repeated interrupts while the ranks are being ended are absorbed, so cleanup
  always completes.
* A failure is reported by its root cause: a rank that raised, crashed or timed
  out, not a peer that merely saw the connection drop.
* Hangs are judged by the parent, which sees every rank: when all running ranks
  have sat blocked in communication for ``collective_timeout`` with none left
  computing, that is a deadlock (or a mismatched or missing call) and the launch
  ends, naming each rank's op, peer and line. A rank waiting for a peer that is
  still computing is not deadlocked: it waits (up to :data:`SLOW_RANK_PATIENCE`),
  so a slow step on a loaded laptop never fails a correct program.
"""

from __future__ import annotations

import atexit
import linecache
import math
import multiprocessing as mp
import multiprocessing.connection
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import weakref
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable

from distlab import payload
from distlab import rank as rank_module
from distlab import reaper
from distlab.comm import CommLog
from distlab.timeline import Span

DEFAULT_COLLECTIVE_TIMEOUT = 10.0  # seconds all running ranks may sit blocked in communication (a deadlock)
SLOW_RANK_PATIENCE = 60.0  # seconds a rank may wait for a peer that is still computing (at least 6x the above)
BACKSTOP_GRACE = 15.0  # the backend's own timeout is the patience plus this: the parent's watchdog acts first
MAX_CPU_RANKS = 32
_FAILURE_WINDOW = 0.3  # after a root-cause failure, how long to listen for the other ranks' reports
_CONSEQUENCE_WINDOW = 2.0  # after only consequences (a peer's connection closed), how long to wait for the cause
_POLITE_EXIT = 0.5  # seconds healthy ranks get to leave the process group before they are killed
_SF = rank_module.STATUS_FIELDS
# Every group not yet closed. Ranks are not daemonic (they may start processes of their own), so
# multiprocessing would wait for them at interpreter exit: shutdown() closes these first.
_LIVE_GROUPS: "weakref.WeakSet[_RankGroup]" = weakref.WeakSet()


class LaunchError(RuntimeError):
    """A launch that did not complete; the message says which rank and why."""


class RankFailed(LaunchError):
    """A rank raised an exception. ``exc_type`` names it (e.g. "NotImplementedError").

    ``group_intact`` is True when every rank reported, none was inside a communication op or had one in
    flight, and their ledgers balance: the process group is as clean as after a successful job, so a warm
    group keeps its ranks (a stub lab's guarded cells then cost milliseconds, not a restart each).
    """

    def __init__(self, message: str, rank: int, exc_type: str, failed_ranks: list[int],
                 group_intact: bool = False):
        super().__init__(message)
        self.rank, self.exc_type, self.failed_ranks = rank, exc_type, failed_ranks
        self.group_intact = group_intact


class RankCrashed(LaunchError):
    """A rank's process ended without reporting: os._exit, a signal, a segfault, an abort."""

    def __init__(self, message: str, rank: int, exitcode: int | None):
        super().__init__(message)
        self.rank, self.exitcode = rank, exitcode


class CollectiveTimeout(LaunchError):
    """Ranks waited in a collective or point-to-point op that never completed.

    ``waiting`` maps each waiting rank to its op; ``kind`` says what the launcher saw:
    ``"deadlock"`` (every running rank waits in a point-to-point op), ``"mismatch"``
    (ranks wait in different collectives), ``"missing"`` (the others finished without
    the call), ``"slow"`` (the others were still computing), or ``"hang"``; ``hint`` says what to check.
    """

    def __init__(self, message: str, waiting: dict[int, str], kind: str = "hang", hint: str = ""):
        super().__init__(message)
        self.waiting, self.kind, self.hint = waiting, kind, hint


class LaunchTimeout(LaunchError):
    """The whole job ran past the ``timeout`` given to it."""


class UnmatchedCommunication(LaunchError):
    """The job returned, but a send was never received or ranks made different numbers of collective calls."""


class ReturnValueError(LaunchError):
    """A rank's return value could not be rebuilt in the launching process."""


class LaunchInterrupted(KeyboardInterrupt):
    """The notebook's interrupt button (or Ctrl-C) stopped a launch; every rank was ended."""


class Run(list):
    """The ranks' return values in rank order, plus what was measured while they ran."""

    def __init__(self, values, comm, spans, stdout, stderr, wall_time, backend):
        super().__init__(values)
        self.comm: list[CommLog] = comm
        self.spans: list[Span] = spans
        self.stdout: list[str] = stdout
        self.stderr: list[str] = stderr
        self.wall_time: float = wall_time
        self.backend: str = backend

    @property
    def world_size(self) -> int:
        return len(self.comm)

    def comm_table(self) -> str:
        """Calls, payload and bytes sent per rank and op, as a fixed-width table."""
        rows = [f"{'rank':>4}  {'op':<24}{'calls':>6}{'payload bytes':>16}{'sent bytes':>16}"]
        for log in self.comm:
            for op, stats in sorted(log.ops.items()):
                rows.append(f"{log.rank:>4}  {op:<24}{stats.calls:>6}{stats.payload_bytes:>16,}"
                            f"{round(stats.wire_bytes):>16,}")
        return "\n".join(rows)


# ---------------------------------------------------------------- validation

_SAID_CPU_FALLBACK: set[int] = set()  # world sizes already told that they run on the CPU despite a GPU


def resolve_backend(backend: str, world_size: int) -> str:
    """Pick gloo or NCCL, or say clearly why the requested one cannot run here."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        backend = "nccl" if gpus >= world_size and sys.platform.startswith("linux") else "gloo"
        if backend == "gloo" and gpus and world_size not in _SAID_CPU_FALLBACK:
            # Colab's one GPU, a 4-rank lab: the lab still runs, and the student should know where.
            _SAID_CPU_FALLBACK.add(world_size)
            print(f"distlab: {world_size} ranks but {gpus} GPU(s): running gloo ranks on the CPU "
                  f"(NCCL needs one GPU per rank)", file=sys.stderr)
    if backend == "nccl":
        if gpus < world_size:
            raise ValueError(
                f"backend='nccl' needs one CUDA GPU per rank: world_size={world_size} but {gpus} GPU(s) are "
                f"visible. Use backend='gloo' to run the ranks on the CPU"
                + (f", or world_size<={gpus}." if gpus else ".")
            )
    elif world_size > MAX_CPU_RANKS:
        raise ValueError(
            f"world_size={world_size} would start {world_size} CPU processes on {os.cpu_count()} cores; "
            f"distlab allows at most {MAX_CPU_RANKS} gloo ranks on one machine."
        )
    return backend


def _seconds(name: str, value, *, optional: bool = False) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        allowed = "None or a positive number" if optional else "a positive number"
        raise ValueError(f"{name} must be {allowed} of seconds, got {value!r}")
    return float(value)


def _check_arguments(fn, args, kwargs, threads) -> tuple[tuple, dict]:
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple of positional arguments, got {type(args).__name__} {args!r} "
                        "(for one argument write args=(value,))")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict of keyword arguments, got {type(kwargs).__name__}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be None or a positive integer, got {threads!r}")
    return tuple(args), dict(kwargs or {})


def default_threads(world_size: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // world_size)


# ---------------------------------------------------------------- interrupts

class _InterruptGuard:
    """The first interrupt stops a launch; interrupts that follow, while ranks are ended, are absorbed.

    Replaces the SIGINT handler while active (main thread only; elsewhere it does nothing):
    the first SIGINT runs the previous handler (IPython's raises KeyboardInterrupt), every
    later one, and any once ``stopping`` is set, only sets ``absorbed``.
    """

    def __init__(self):
        self.previous = None
        self.stopping = False
        self.absorbed = False

    def __enter__(self) -> "_InterruptGuard":
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGINT)
            if callable(previous):  # not SIG_IGN / SIG_DFL: those keep their meaning
                self.previous = previous
                signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.stopping:
            self.absorbed = True
            return
        self.stopping = True
        self.previous(signum, frame)

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
            self.previous = None


def _close_quietly(group: "_RankGroup | None", guard: _InterruptGuard) -> None:
    """End ``group`` whatever interrupts arrive meanwhile (they are recorded on the guard)."""
    guard.stopping = True
    while group is not None:
        try:
            group.close()
            return
        except KeyboardInterrupt:  # arrived before the guard could absorb it: close again
            guard.absorbed = True


# ---------------------------------------------------------------- processes

_context = None


def _forkserver_context():
    """A forkserver context whose server imported torch once, before any CUDA use."""
    global _context
    if _context is None:
        if "forkserver" not in mp.get_all_start_methods():  # Windows, macOS without it
            _context = mp.get_context("spawn")
        else:
            _context = mp.get_context("forkserver")
            # torch.fx's symbolic_shapes (sympy) and torch._dynamo are imported lazily by the first meta-device
            # model build and the first dispatch mode; importing them here once saves every new rank ~1.5 s of CPU.
            _context.set_forkserver_preload(["torch", "torch.distributed", "torch.fx.experimental.symbolic_shapes",
                                             "torch._dynamo", "cloudpickle", "distlab.payload", "distlab.rank", "distlab.reaper"])
    return _context


@contextmanager
def _main_module_hidden():
    """Keep multiprocessing from re-running the user's script in every rank.

    A forkserver child normally imports the parent's ``__main__`` file so that
    pickled references into it resolve. Ours never need it (the job travels by
    value with cloudpickle), and re-running a script without an
    ``if __name__ == "__main__"`` guard would launch ranks from ranks.
    """
    main = sys.modules["__main__"]
    saved = {key: main.__dict__[key] for key in ("__file__", "__spec__") if key in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__dict__["__spec__"] = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def _kill_process_group(proc) -> None:
    """SIGKILL a rank and everything it started (it leads its own process group)."""
    if proc.pid is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # not yet its own group leader, or already gone
        try:
            proc.kill()
        except (OSError, AttributeError, ValueError):
            pass


class _RankGroup:
    """``world_size`` rank processes sharing one process group, driven through pipes."""

    def __init__(self, world_size: int, backend: str, collective_timeout: float, threads: int | None):
        import torch.distributed as dist

        self.world_size, self.backend = world_size, backend
        self.collective_timeout = float(collective_timeout)
        self.patience = max(SLOW_RANK_PATIENCE, 6 * self.collective_timeout)
        self.conns, self.procs, self.reaper, self.lifeline = [], [], None, None
        self.dump_offsets: dict[int, int] = {}  # where a rank's stack dump starts in its stderr
        self.job_id = 0
        ctx = _forkserver_context()
        self.store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=max(30.0, self.collective_timeout)))
        self.workdir = tempfile.mkdtemp(prefix="distlab-")
        self.status = ctx.RawArray("d", [0.0, 0.0, -1.0, -1.0] * world_size)
        self.board = ctx.RawArray("d", 4 * world_size)
        _LIVE_GROUPS.add(self)
        try:
            self._start(ctx, threads or default_threads(world_size))
        except BaseException:  # an interrupt while starting: end whatever did start
            _close_quietly(self, _InterruptGuard())
            raise

    def _start(self, ctx, threads: int) -> None:
        lifeline_end, self.lifeline = ctx.Pipe(duplex=False)
        self.reaper = ctx.Process(target=reaper.main, args=(lifeline_end,), name="distlab-reaper", daemon=True)
        with _main_module_hidden():
            self.reaper.start()
        lifeline_end.close()
        for r in range(self.world_size):
            spec = rank_module.RankSpec(
                rank=r, world_size=self.world_size, backend=self.backend, store_port=self.store.port,
                backend_timeout=self.patience + BACKSTOP_GRACE, threads=threads,
                stdout_path=self._output_path(r, "out"), stderr_path=self._output_path(r, "err"),
            )
            parent_end, child_end = ctx.Pipe()
            # Not daemonic: a rank may start processes of its own (DataLoader workers, a Pool).
            proc = ctx.Process(target=rank_module.main, args=(spec, child_end, self.status, self.board),
                               name=f"distlab-rank{r}", daemon=False)
            with _main_module_hidden():
                proc.start()
            child_end.close()
            self.conns.append(parent_end)
            self.procs.append(proc)
            self.lifeline.send(proc.pid)  # the rank leads a process group of that id

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def run(self, fn: Callable, args: tuple, kwargs: dict, timeout: float | None) -> Run:
        __tracebackhide__ = True  # IPython: show the rank's traceback, not the launcher's frames
        try:
            job_payload = payload.dumps((fn, tuple(args), dict(kwargs)))
        except Exception as error:
            raise TypeError(f"the job cannot be sent to the ranks: {type(error).__name__}: {error} "
                            "(fn, args and kwargs must be picklable)") from None
        self.job_id += 1
        self.dump_offsets = {}
        self._clear_output()
        start = time.perf_counter()
        job = (self.job_id, job_payload, start, os.getcwd(), list(sys.path))
        for conn in self.conns:
            try:
                conn.send(job)
            except (BrokenPipeError, ConnectionResetError, OSError):
                pass  # that rank is gone; collecting reports how it ended
        outcome = self._collect(start, timeout)
        wall = time.perf_counter() - start
        stdout = [self._read_output(r) for r in range(self.world_size)]
        stderr = [self._read_output(r, stream="err")[:self.dump_offsets.get(r)] for r in range(self.world_size)]
        if isinstance(outcome, LaunchError):
            if not (isinstance(outcome, ReturnValueError) or getattr(outcome, "group_intact", False)):
                self.close()  # ranks left mid-communication (or dead): the next job needs fresh ones
            _print_rank_output(stdout, [_without_fault_dump(text) for text in stderr])
            raise outcome
        values, comm_logs, spans = outcome
        return Run(values, comm_logs, spans, stdout, stderr, wall, self.backend)

    def _collect(self, start: float, timeout: float | None):
        n = self.world_size
        values: list[Any] = [None] * n
        comm_logs = [CommLog(rank=r) for r in range(n)]
        spans: list[Span] = []
        ledgers: list[dict] = [{} for _ in range(n)]
        pending = set(range(n))
        errors: dict[int, dict] = {}
        crashed: dict[int, int | None] = {}
        unpicklable: dict[int, str] = {}
        first_failure_at = None
        settled_at = start  # when a rank last finished: a peer it just released may not have run yet
        while pending:
            waitables = [self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending]
            for ready in multiprocessing.connection.wait(waitables, timeout=0.05):
                r = self._rank_of(ready)
                if r not in pending:
                    continue
                message = self._receive(r)
                if message is None:  # the process ended and left no report
                    crashed[r] = self._exitcode(r)
                    pending.discard(r)
                    continue
                kind = message[0]
                if kind == "ready" or (message[1] is not None and message[1] != self.job_id):
                    continue  # joined the process group, or a report of an earlier job
                if kind == "ok":
                    try:
                        values[r] = payload.loads(message[2])
                    except Exception as error:
                        unpicklable[r] = f"{type(error).__name__}: {_first_line(str(error))}"
                else:
                    errors[r] = message[2]
                if len(message) > 3:
                    comm_logs[r].ops.update(message[3])
                    spans += message[4]
                    ledgers[r] = message[5]
                pending.discard(r)
                settled_at = time.perf_counter()
            now = time.perf_counter()
            if (errors or crashed) and first_failure_at is None:
                first_failure_at = now
            if first_failure_at is not None:
                window = _FAILURE_WINDOW if self._has_root_cause(errors, crashed) else _CONSEQUENCE_WINDOW
                if not pending or now - first_failure_at > window:
                    failure = self._failure(errors, crashed, pending)
                    if isinstance(failure, RankFailed):
                        failure.group_intact = _group_intact(errors, crashed, pending, ledgers)
                    return failure
            stuck = self._stuck_ranks(pending, now, settled_at)
            if stuck:
                return self._timeout_report(stuck, {}, pending, crashed, frames=self._blocked_frames(stuck))
            if timeout is not None and now - start > timeout:
                return LaunchTimeout(
                    f"the job ran longer than timeout={timeout:g} s; all ranks were stopped.\n"
                    + self._whereabouts(range(n), pending, heading="When stopped")
                )
        if unpicklable:
            return ReturnValueError("; ".join(
                f"rank {r}'s return value could not be rebuilt here ({why})" for r, why in sorted(unpicklable.items()))
                + ". Return plain values (numbers, lists, dicts, tensors) or objects of classes this process "
                  "can import.")
        unmatched = _unmatched_communication(ledgers)
        if unmatched:
            return UnmatchedCommunication(
                "the job returned, but its communication did not match across ranks: " + "; ".join(unmatched)
                + ". Every send needs a matching receive and every collective a call on each rank of its group; "
                  "the ranks were restarted so that the next job starts clean.")
        spans.sort(key=lambda s: (s.rank, s.start))
        return values, comm_logs, spans

    def _receive(self, r: int):
        conn = self.conns[r]
        try:
            if not conn.poll():
                return None
            return conn.recv()
        except (EOFError, OSError):
            return None

    # ---- failure reports

    @staticmethod
    def _has_root_cause(errors, crashed) -> bool:
        return bool(crashed) or any(_classify(info) != "peer_gone" for info in errors.values())

    def _failure(self, errors, crashed, pending) -> LaunchError:
        kinds = {r: _classify(info) for r, info in errors.items()}
        raised = sorted(r for r in errors if kinds[r] == "raised")
        if raised:  # an error in the user's own code is the root cause of whatever followed
            return self._rank_failed(raised, errors, crashed, pending)
        if crashed:
            r = min(crashed)
            return RankCrashed(self._crash_message(r, crashed[r], pending, errors, crashed), r, crashed[r])
        op_errors = sorted(r for r in errors if kinds[r] == "op_error")
        if op_errors:
            return self._rank_failed(op_errors, errors, crashed, pending)
        if any(kind == "timeout" for kind in kinds.values()):
            waiting = {r: (info["in_op"], info.get("peer", -1), kinds[r] == "timeout") for r, info in errors.items()}
            return self._timeout_report({}, waiting, pending, crashed, errors)
        return self._rank_failed(sorted(errors), errors, crashed, pending)

    def _rank_failed(self, candidates, errors, crashed, pending) -> RankFailed:
        first = candidates[0]
        info = errors[first]
        same = [r for r in sorted(errors) if errors[r]["exc_type"] == info["exc_type"]
                and errors[r]["message"] == info["message"]]
        who = f"rank {first}" if len(same) == 1 else f"ranks {_ranks(same)}"
        where = f" in {_op_text(info['in_op'], info.get('peer', -1))}" if info["in_op"] else ""
        headline = f"{who} raised {info['exc_type']}{where}: {_first_line(info['message'])}"
        context = self._whereabouts(set(range(self.world_size)) - set(same), pending, errors, crashed)
        return RankFailed("\n".join(filter(None, [headline, context])) + "\n\n" + _format_traceback(first, info),
                          first, info["exc_type"], same)

    def _timeout_report(self, stuck, waiting, pending, crashed, errors=None, frames=None) -> CollectiveTimeout:
        """Why ranks waited: a point-to-point deadlock, mismatched collectives, a missing call or a slow rank.

        ``waiting`` holds ranks whose op failed ((op, peer, timed_out)); ``stuck`` ranks the
        watchdog found blocked past the timeout; pending ranks are still blocked or computing.
        """
        errors = errors or {}
        blocked: dict[int, tuple[str, int]] = {r: (op, peer) for r, (op, peer, _) in waiting.items()}
        for r in pending:
            status = self._status(r)
            if status:
                blocked[r] = (status[0], status[2])
        blocked.update({r: (op, peer) for r, (op, _, peer) in stuck.items()})
        timed_out = sorted(r for r, (_, _, out) in waiting.items() if out) or sorted(stuck)
        computing = sorted(r for r in pending if r not in blocked)
        finished = sorted(set(range(self.world_size)) - set(pending) - set(errors) - set(crashed))
        seconds = f"{self.collective_timeout:g} s"
        lead = timed_out[0] if timed_out else min(blocked)
        op, peer = blocked[lead]
        ops = {_base_op(o) for o, _ in blocked.values()}
        p2p = ops <= {"send", "isend", "recv", "irecv"}
        who = f"rank {lead}" if len(timed_out) <= 1 else f"ranks {_ranks(timed_out)}"
        if p2p and not computing:
            kind = "deadlock"
            receiving = all(_base_op(o) in ("recv", "irecv") for o, _ in blocked.values())
            sending = all(_base_op(o) in ("send", "isend") for o, _ in blocked.values())
            pairs = ", ".join(f"rank {r} {_op_text(o, p, short=True)}" for r, (o, p) in sorted(blocked.items()))
            sends_elsewhere = {r: to for r, info in errors.items()
                               for kind_of_op, to in info.get("in_flight", ()) if kind_of_op == "isend" and to >= 0}
            sends_elsewhere.update({r: int(self.status[_SF * r + 3]) for r in pending if self.status[_SF * r + 3] >= 0})
            sends_elsewhere = sorted(sends_elsewhere.items())
            hint = ("each rank must send to the rank that receives from it, in the same step: in a ring, send to "
                    "(rank + 1) % N and receive from (rank - 1) % N.")
            if receiving and sends_elsewhere:
                went = ", ".join(f"rank {r} to rank {p}" for r, p in sends_elsewhere)
                headline = (f"every rank waits to receive ({pairs}) but the sends went elsewhere ({went}): the "
                            f"sends and receives do not pair up; check each send's destination against the "
                            f"receiver's source (timed out after {seconds}).")
            elif receiving and not finished:
                headline = (f"every rank waits to receive ({pairs}) and none is sending: a point-to-point deadlock "
                            f"(timed out after {seconds}).")
                hint = "start each send before the matching receive (dist.isend), then wait on both."
            elif sending and not finished:
                headline = (f"every rank waits in a send ({pairs}) and none is receiving: a point-to-point deadlock "
                            f"(timed out after {seconds}).")
                hint = ("a blocking dist.send waits for a receiver that is itself sending: post dist.isend and "
                        "dist.irecv, then wait on both.")
            else:
                done = f"; rank(s) {_ranks(finished)} finished their job" if finished else ""
                headline = (f"a point-to-point op never completed ({pairs}{done}): no rank is sending or receiving "
                            f"what another waits for; check each send's destination against the receiver's "
                            f"source (timed out after {seconds}).")
        elif len(ops) > 1:
            kind = "mismatch"
            hint = "every rank must make the same collective calls in the same order."
            calls = ", ".join(f"rank {r} in {_op_text(o, p)}" for r, (o, p) in sorted(blocked.items()))
            headline = (f"mismatched collectives: {calls}; every rank must make the same collective calls in the "
                        f"same order (timed out after {seconds}).")
        elif computing:
            kind = "slow"
            hint = "look for a collective those ranks skip, or an endless loop before it."
            headline = (f"{who} waited {self.patience:g} s in {_op_text(op, peer)} while rank(s) "
                        f"{_ranks(computing)} kept computing (not in any collective): either they never reach "
                        f"that call, or their work before it takes longer than {self.patience:g} s.")
        elif finished:
            kind = "missing"
            hint = "every rank must make the same collective calls in the same order."
            headline = (f"{who} timed out after {seconds} waiting in {_op_text(op, peer)}: rank(s) "
                        f"{_ranks(finished)} finished their job without calling it (a missing collective call; "
                        f"every rank must make the same collective calls in the same order).")
        else:
            kind, hint = "hang", "check that every rank makes this call with the same arguments."
            headline = f"{who} timed out after {seconds} waiting in {_op_text(op, peer)}, which never completed."
        others = self._whereabouts(set(range(self.world_size)), pending, errors, crashed,
                                   heading="What each rank was doing, all now stopped", stuck=stuck)
        lines = "".join(f"\n  rank {r} was blocked at {frame}" for r, frame in sorted((frames or {}).items()))
        trace = ("\n\n" + _format_traceback(lead, errors[lead])) if lead in errors else lines
        return CollectiveTimeout(f"{headline}\n{others}{trace}", {r: o for r, (o, _) in sorted(blocked.items())},
                                 kind, hint)

    def _crash_message(self, r, code, pending, errors, crashed) -> str:
        how = _describe_exit(code)
        stderr = self._read_output(r, stream="err")
        status = self._status(r)
        during = f" in {_op_text(status[0], status[2])}" if status else ""
        cause, frame = _abort_details(stderr)
        lines = [f"rank {r} exited without finishing its job ({how}){during}."]
        if frame:
            lines.append(f"  the call it was in: {frame}")
        if cause:
            lines.append(f"  cause: {cause}")
        others = set(range(self.world_size)) - {r}
        lines.append(self._whereabouts(others, pending, errors, crashed))
        if not cause:
            tail = _without_fault_dump(stderr).strip().splitlines()[-8:]
            if tail:
                lines.append("its last stderr lines:\n  " + "\n  ".join(tail))
        return "\n".join(line for line in lines if line)

    def _whereabouts(self, ranks, pending, errors=None, crashed=None, heading="Other ranks, all now stopped",
                     stuck=None) -> str:
        """One line on what each other rank was doing when the launch was ended."""
        errors, crashed, stuck = errors or {}, crashed or {}, stuck or {}
        now = time.perf_counter()
        parts = []
        for r in sorted(ranks):
            status = self._status(r)
            if r in crashed:
                parts.append(f"rank {r}: exited ({_describe_exit(crashed[r])})")
            elif r in errors:
                info = errors[r]
                kind = _classify(info)
                where = f" in {_op_text(info['in_op'], info.get('peer', -1))}" if info["in_op"] else ""
                if kind == "timeout":
                    parts.append(f"rank {r}: timed out{where}")
                elif kind == "peer_gone":
                    parts.append(f"rank {r}: lost its connection{where} when a peer stopped")
                else:
                    parts.append(f"rank {r}: raised {info['exc_type']}{where}")
            elif r in stuck:
                op, secs, peer = stuck[r]
                parts.append(f"rank {r}: blocked {secs:.0f} s in {_op_text(op, peer)}")
            elif r in pending and status:
                parts.append(f"rank {r}: waiting in {_op_text(status[0], status[2])} for {now - status[1]:.1f} s")
            elif r in pending:
                parts.append(f"rank {r}: still running (not in a collective)")
            else:
                parts.append(f"rank {r}: finished its job")
        return (f"{heading}: " + "; ".join(parts) + ".") if parts else ""

    def _stuck_ranks(self, pending, now, settled_at) -> dict[int, tuple[str, float, int]]:
        """Blocked ranks the watchdog ends: all of them when every running rank has been blocked for
        ``collective_timeout`` (nobody left to unblock them), or those that waited ``patience`` for a
        peer still computing.

        A rank that finished may have just completed the collective its blocked peer is still
        inside: on a loaded machine the peer can need a while to be scheduled and return. So the
        running ranks are judged only once ``collective_timeout`` has also passed since the last
        rank finished (``settled_at``), never at the moment a peer is released.
        """
        blocked = {}
        for r in pending:
            status = self._status(r)
            if status:
                blocked[r] = (status[0], now - status[1], status[2])
        if not blocked:
            return {}
        if len(blocked) == len(pending):
            if (all(secs > self.collective_timeout for _, secs, _ in blocked.values())
                    and now - settled_at > self.collective_timeout):
                return blocked
            return {}
        return {r: b for r, b in blocked.items() if b[1] > self.patience}

    def _blocked_frames(self, ranks) -> dict[int, str]:
        """The user's line each blocked rank is waiting in, from a faulthandler dump (SIGUSR1).

        The rank is blocked inside the backend, so it cannot answer through its pipe; the
        signal handler runs in C and writes every thread's Python stack to its stderr.
        """
        offsets = {r: len(self._read_output(r, stream="err").encode()) for r in ranks}
        for r in ranks:
            try:
                os.kill(self.procs[r].pid, rank_module.STACK_DUMP_SIGNAL)
            except (ProcessLookupError, AttributeError):
                pass
        frames: dict[int, str] = {}
        deadline = time.perf_counter() + 3.0
        while len(frames) < len(ranks) and time.perf_counter() < deadline:
            time.sleep(0.05)
            for r in ranks:
                if r not in frames:
                    dump = self._read_output(r, stream="err").encode()[offsets[r]:].decode(errors="replace")
                    if "_drain_async_ops" in dump:
                        frames[r] = "the end of its job, which returned with this async op in flight (never waited on)"
                    elif "_run_job" in dump:
                        frames[r] = _abort_details(dump)[1] or ""
        for r in ranks:
            self.dump_offsets[r] = len(self._read_output(r, stream="err").encode()[:offsets[r]].decode(errors="replace"))
        return {r: f for r, f in frames.items() if f}

    def _status(self, r: int) -> tuple[str, float, int] | None:
        code = self.status[_SF * r]
        if code == 0:
            return None
        name = rank_module.OP_NAMES[int(abs(code)) - 1]
        return (f"wait({name})" if code < 0 else name), self.status[_SF * r + 1], int(self.status[_SF * r + 2])

    # ---- plumbing

    def _rank_of(self, waitable) -> int:
        for r in range(self.world_size):
            if waitable is self.conns[r] or waitable == self.procs[r].sentinel:
                return r
        raise LookupError(waitable)

    def _exitcode(self, r: int) -> int | None:
        self.procs[r].join(timeout=1.0)
        return self.procs[r].exitcode

    def _output_path(self, r: int, stream: str) -> str:
        return os.path.join(self.workdir, f"rank{r}.{stream}")

    def _clear_output(self) -> None:
        """Empty every rank's capture files before a job (ranks append, so they continue at 0)."""
        for r in range(self.world_size):
            for stream in ("out", "err"):
                if os.path.exists(self._output_path(r, stream)):
                    os.truncate(self._output_path(r, stream), 0)

    def _read_output(self, r: int, stream: str = "out") -> str:
        try:
            with open(self._output_path(r, stream), encoding="utf-8", errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def close(self) -> None:
        """End every rank and everything it started, then free the group's store, pipes and files.

        Safe to repeat. Healthy ranks get a moment to leave the process group; then every
        rank's process group is killed (children included) whether or not it left.
        """
        healthy = self.procs and all(p.is_alive() for p in self.procs)
        for conn in self.conns:
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
        if healthy:
            deadline = time.perf_counter() + _POLITE_EXIT
            for p in self.procs:
                p.join(timeout=max(0.0, deadline - time.perf_counter()))
        for p in self.procs:
            _kill_process_group(p)
        for p in self.procs:
            p.join(timeout=5)
        for conn in self.conns:
            conn.close()
        if self.lifeline is not None:
            try:
                self.lifeline.send(None)  # tell the reaper we ended the ranks ourselves
            except (OSError, ValueError):
                pass
            self.lifeline.close()
            self.lifeline = None
        if self.reaper is not None and self.reaper.pid is not None:  # None: interrupted before it started
            self.reaper.join(timeout=5)
            if self.reaper.is_alive():
                self.reaper.kill()
            self.reaper = None
        self.procs, self.conns = [], []
        self.store = None  # the TCPStore server (a thread and its sockets) goes with it
        shutil.rmtree(self.workdir, ignore_errors=True)
        _LIVE_GROUPS.discard(self)


# ---------------------------------------------------------------- reports

_PEER_GONE = re.compile(r"connection closed by peer|connection reset|broken pipe|econnreset|epipe|"
                        r"socket closed|communicator was aborted|remote worker crash", re.IGNORECASE)


def _classify(info: dict) -> str:
    """raised (outside any op: the user's error), timeout, peer_gone (a consequence) or op_error."""
    if not info.get("in_op"):
        return "raised"
    message = info["message"]
    if _PEER_GONE.search(message):
        return "peer_gone"
    if _looks_like_timeout(message):
        return "timeout"
    return "op_error"


def _group_intact(errors, crashed, pending, ledgers) -> bool:
    """Every rank reported, each failure was raised outside any op with nothing in flight, and the ledgers balance."""
    return (not pending and not crashed
            and all(not info.get("in_op") and not info.get("in_flight") for info in errors.values())
            and not _unmatched_communication(ledgers))


def _unmatched_communication(ledgers: list[dict]) -> list[str]:
    """What the ranks' ledgers say was left unmatched: collective counts per group, p2p bytes per pair."""
    problems = []
    n = len(ledgers)
    keys = sorted({key for ledger in ledgers for key in ledger.get("collectives", {})})
    for key in keys:
        members = range(n) if key == "world" else [int(x) for x in key.split(",")]
        counts = {r: ledgers[r].get("collectives", {}).get(key, 0) for r in members}
        if len(set(counts.values())) > 1:
            group = "the default group" if key == "world" else f"the group of ranks {key}"
            problems.append(f"collective calls on {group} differ ("
                            + ", ".join(f"rank {r}: {c}" for r, c in counts.items()) + ")")
    for dst in range(n):
        received = ledgers[dst].get("received", {})
        if -1 in received:  # receives from any source: only the total can be checked
            sent = sum(ledgers[src].get("sent", {}).get(dst, 0) for src in range(n))
            if sent != sum(received.values()):
                problems.append(f"{sent} bytes were sent to rank {dst}, which received {sum(received.values())}")
            continue
        for src in range(n):
            sent, got = ledgers[src].get("sent", {}).get(dst, 0), received.get(src, 0)
            if sent > got:
                problems.append(f"rank {src} sent {sent - got} bytes to rank {dst} that it never received")
            elif got > sent:
                problems.append(f"rank {dst} received {got - sent} bytes from rank {src} that it never sent")
    return problems


def _base_op(op: str) -> str:
    return op[5:-1] if op.startswith("wait(") else op


def _op_text(op: str, peer: int = -1, short: bool = False) -> str:
    """``recv from rank 1`` / ``waits for rank 1``, ``isend to rank 2`` / ``sends to rank 2``; collectives by name."""
    base = _base_op(op)
    if base in ("recv", "irecv"):
        source = f"rank {peer}" if peer >= 0 else "any rank"
        return f"waits for {source}" if short else f"{op} from {source}"
    if base in ("send", "isend") and peer >= 0:
        return f"sends to rank {peer}" if short else f"{op} to rank {peer}"
    return op


def _abort_details(stderr: str) -> tuple[str | None, str | None]:
    """From a crashed rank's stderr: the C++ error line (gloo's own words) and the user's call in the fault dump."""
    cause = None
    for line in stderr.splitlines():
        stripped = line.strip()
        if stripped.startswith("what():"):
            cause = stripped[len("what():"):].strip()
            break
        if stripped.startswith("Fatal Python error:") and cause is None:
            cause = stripped
    frame = None
    library = (os.path.dirname(__file__), os.path.dirname(mp.__file__),
               os.path.dirname(threading.__file__) + os.sep + "threading.py")
    torch_dir = os.path.dirname(rank_module.torch.__file__)
    block = []
    for line in stderr.splitlines():
        if "(most recent call first)" in line:
            block = []
        match = re.match(r'\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<fn>\S+)', line)
        if match:
            block.append(match)
        if any(m["fn"] == "_run_job" for m in block) and not line.strip():
            break  # the thread that ran the job: its frames are complete
    for match in block:
        path = os.path.abspath(match["file"])
        if path.startswith(torch_dir) or any(path.startswith(lib) for lib in library) or match["file"] == "<string>":
            continue
        source = linecache.getline(match["file"], int(match["line"])).strip()
        frame = f'File "{match["file"]}", line {match["line"]}, in {match["fn"]}' + (f": {source}" if source else "")
        break
    return cause, frame


def _without_fault_dump(stderr: str) -> str:
    """A crashed rank's stderr minus faulthandler's thread dump (summarised in the error instead)."""
    kept, skipping = [], False
    for line in stderr.splitlines(keepends=True):
        if line.startswith("Fatal Python error:"):
            skipping = True
        if not skipping:
            kept.append(line)
        elif line.startswith("Extension modules:"):
            skipping = False
    return "".join(kept)


def _looks_like_timeout(message: str) -> bool:
    text = message.lower()
    return "timed out" in text or "timeout" in text


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def _first_line(message: str) -> str:
    lines = message.strip().splitlines()
    return lines[0] if lines else ""


def _format_traceback(rank: int, info: dict) -> str:
    """The rank's traceback, with source lines filled in from this kernel's cells."""
    out = [f"Traceback of rank {rank} (most recent call last):"]
    for filename, lineno, name, line in info["frames"]:
        out.append(f'  File "{filename}", line {lineno}, in {name}')
        line = line or linecache.getline(filename, lineno).strip()
        if line:
            out.append(f"    {line}")
    if info["hidden_frames"]:
        out.append(f"  ... {info['hidden_frames']} frame(s) inside torch and distlab not shown")
    out.append(f"{info['exc_type']}: {info['message']}".rstrip())
    return "\n".join(out)


def _print_rank_output(stdout: list[str], stderr: list[str]) -> None:
    """Each rank's output after the run, rank by rank, so notebooks show it deterministically."""
    for r, text in enumerate(stdout):
        for line in text.splitlines():
            print(f"[rank {r}] {line}")
    for r, text in enumerate(stderr):
        for line in text.splitlines():
            print(f"[rank {r}] {line}", file=sys.stderr)


def _interrupted(world_size: int) -> LaunchInterrupted:
    return LaunchInterrupted(
        f"launch interrupted: all {world_size} ranks were stopped; the next launch starts fresh")


# ---------------------------------------------------------------- public API

def launch(fn: Callable, world_size: int = 4, args: tuple = (), kwargs: dict | None = None, *,
           backend: str = "auto", timeout: float | None = None,
           collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT, threads: int | None = None,
           warm: bool = False, show_output: bool = True) -> Run:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh ranks; return their values in rank order.

    ``fn`` may be defined in a notebook cell. Inside it, ``torch.distributed`` is
    initialised; use ``dist.get_rank()``, ``distlab.device()`` and collectives as
    under torchrun. ``collective_timeout`` bounds how long a rank waits for the
    others in one collective; ``timeout`` bounds the whole job. With
    ``warm=True`` the ranks stay alive for the next launch of the same shape.
    """
    __tracebackhide__ = True
    args, kwargs = _check_arguments(fn, args, kwargs, threads)
    timeout = _seconds("timeout", timeout, optional=True)
    collective_timeout = _seconds("collective_timeout", collective_timeout)
    if warm:
        return Ranks.shared(world_size, backend, collective_timeout, threads).run(
            fn, args, kwargs, timeout=timeout, show_output=show_output)
    backend = resolve_backend(backend, world_size)
    with _InterruptGuard() as guard:
        group = None
        try:
            group = _RankGroup(world_size, backend, collective_timeout, threads)
            run = group.run(fn, args, kwargs, timeout)
        except KeyboardInterrupt:
            raise _interrupted(world_size) from None
        finally:
            _close_quietly(group, guard)
        if guard.absorbed:
            raise _interrupted(world_size)
    if show_output:
        _print_rank_output(run.stdout, run.stderr)
    return run


class Ranks:
    """A warm group of ranks that stays alive between cells.

    ``ranks = Ranks(4); ranks.run(fn)`` costs milliseconds after the first call.
    A job that fails, hangs or is interrupted ends the group; the next ``run``
    starts a new one. Jobs never see each other's leftovers: see :mod:`distlab.rank`.
    """

    _shared: dict[tuple, "Ranks"] = {}

    def __init__(self, world_size: int = 4, backend: str = "auto",
                 collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT, threads: int | None = None):
        self.backend = resolve_backend(backend, world_size)
        _check_arguments(lambda: None, (), None, threads)
        self.world_size, self.threads = world_size, threads
        self.collective_timeout = _seconds("collective_timeout", collective_timeout)
        self._group: _RankGroup | None = None

    @classmethod
    def shared(cls, world_size, backend="auto", collective_timeout=DEFAULT_COLLECTIVE_TIMEOUT, threads=None):
        key = (world_size, resolve_backend(backend, world_size), collective_timeout, threads)
        if key not in cls._shared:
            cls._shared[key] = cls(world_size, key[1], collective_timeout, threads)
        return cls._shared[key]

    def start(self) -> "Ranks":
        if self._group is None or not self._group.alive:
            stale, self._group = self._group, None
            with _InterruptGuard() as guard:
                _close_quietly(stale, guard)
            self._group = _RankGroup(self.world_size, self.backend, self.collective_timeout, self.threads)
        return self

    def run(self, fn: Callable, args: tuple = (), kwargs: dict | None = None, *,
            timeout: float | None = None, show_output: bool = True) -> Run:
        __tracebackhide__ = True
        args, kwargs = _check_arguments(fn, args, kwargs, self.threads)
        timeout = _seconds("timeout", timeout, optional=True)
        with _InterruptGuard() as guard:
            try:
                self.start()
                run = self._group.run(fn, args, kwargs, timeout)
            except BaseException as error:
                if isinstance(error, ReturnValueError) or getattr(error, "group_intact", False):
                    raise  # the ranks are clean: keep them for the next job
                group, self._group = self._group, None  # detached first: no later run can reuse it
                _close_quietly(group, guard)
                if isinstance(error, KeyboardInterrupt) and not isinstance(error, LaunchInterrupted):
                    raise _interrupted(self.world_size) from None
                raise
        if show_output:
            _print_rank_output(run.stdout, run.stderr)
        return run

    def close(self) -> None:
        group, self._group = self._group, None
        with _InterruptGuard() as guard:
            _close_quietly(group, guard)

    def __enter__(self) -> "Ranks":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def shutdown() -> None:
    """End every group of ranks this process started and has not closed (warm ones included)."""
    for ranks in Ranks._shared.values():
        ranks.close()
    Ranks._shared.clear()
    for group in list(_LIVE_GROUPS):
        with _InterruptGuard() as guard:
            _close_quietly(group, guard)


# Registered after multiprocessing's own exit handler, so it runs first (atexit is last-in, first-out).
atexit.register(shutdown)
