"""A group of rank processes: start them, send them jobs, collect what they report, watch them, end them.

This is the part of the launcher that handles processes: the forkserver the ranks come from, their
pipes, the shared status array the watchdog reads, the reaper, the capture files, the signals. What
a failure *means* is decided by :mod:`~distlab.runtime.diagnose` from a copy of the ranks' states, and
the public entry points that own groups (``launch``, ``Ranks``) are in :mod:`~distlab.runtime.launch`.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import time
import weakref
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, NamedTuple

import torch.distributed as dist

from distlab.runtime import diagnose, output, payload, progress, reaper
from distlab.runtime import rank as rank_module
from distlab.runtime.comm import CommLog
from distlab.runtime.errors import LaunchError, LaunchInterrupted, ReturnValueError
from distlab.runtime.interrupts import InterruptGuard, close_quietly, interrupts_deferred
from distlab.runtime.timeline import Span

SLOW_RANK_PATIENCE = 60.0  # seconds a rank may wait for a peer that is still computing (at least 6x the timeout)
BACKSTOP_GRACE = 15.0  # the backend's own timeout is the patience plus this: the parent's watchdog acts first
_FAILURE_WINDOW = 0.3  # after a root-cause failure, how long to listen for the other ranks' reports
_CONSEQUENCE_WINDOW = 2.0  # after only consequences (a peer's connection closed), how long to wait for the cause
_POLITE_EXIT = 0.5  # seconds healthy ranks get to leave the process group before they are killed
_SF = rank_module.STATUS_FIELDS
# Every group not yet closed. Ranks are not daemonic (they may start processes of their own), so
# multiprocessing would wait for them at interpreter exit: launch.shutdown() closes these first.
LIVE_GROUPS: "weakref.WeakSet[RankGroup]" = weakref.WeakSet()

_context = None
# What the forkserver imports before it forks the first process: what every rank imports as it starts (comm
# wraps the functional collectives, a job's baseline holds numpy's RNG state), and what was asked for with
# preload(). The server imports them one after the other while the first launch waits.
_preload = ["torch", "torch.distributed", "torch.distributed._functional_collectives", "numpy.random", "cloudpickle",
            "distlab.runtime.payload", "distlab.runtime.rank", "distlab.runtime.reaper"]


# multiprocessing's forkserver listens on a Unix socket at $TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX
# (multiprocessing.connection.arbitrary_address), and a Unix socket's path holds at most 107 bytes on Linux,
# 103 on macOS (sun_path less its NUL, man 7 unix).
_SOCKET_PATH_LIMIT = 103 if sys.platform == "darwin" else 107
_LISTENER_SUFFIX = len("/pymp-XXXXXXXX/listener-XXXXXXXX")


def check_socket_room(temp: str | None = None) -> None:
    """Refuse, in one line, a temporary folder too long for the forkserver's socket.

    Python's own error comes from deep inside multiprocessing (``OSError: AF_UNIX path too long``) and names
    no folder; a cluster job's ``$TMPDIR`` (``/local/scratch/job-…/…``) can be that long."""
    temp = temp or tempfile.gettempdir()
    room = _SOCKET_PATH_LIMIT - _LISTENER_SUFFIX
    if len(os.fsencode(temp)) > room:
        raise OSError(f"the temporary folder {temp!r} is {len(os.fsencode(temp))} bytes long; the ranks' forkserver "
                      f"listens on a Unix socket inside it, which allows {room}: set TMPDIR to a shorter folder "
                      "(export TMPDIR=/tmp) before starting Python")


def forkserver_context():
    """A forkserver context whose server imported torch once, before any CUDA use."""
    global _context
    if _context is None:
        if "forkserver" not in mp.get_all_start_methods():  # Windows, macOS without it
            _context = mp.get_context("spawn")
        else:
            check_socket_room()
            _context = mp.get_context("forkserver")
            _context.set_forkserver_preload(list(_preload))
    return _context


def preload(*modules: str) -> None:
    """Have the forkserver import ``modules`` once, so that the ranks it forks need not import them each.

    For modules that jobs import lazily and that are slow to import, asked for by the code whose jobs
    need them: the first model built on the meta device imports ``torch._dynamo`` (about a second of
    CPU per rank, ``torch.fx.experimental.symbolic_shapes`` with it), so a module that builds its models
    there calls ``preload("torch._dynamo")`` when it is imported. Only what is asked for before the server
    starts (this process's first launch) is preloaded. A job that needs none of it does not wait for it:
    a cold launch waits for every module on this list.
    """
    _preload.extend(name for name in modules if name not in _preload)
    if _context is not None and _context.get_start_method() == "forkserver":
        _context.set_forkserver_preload(list(_preload))


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


class JobResult(NamedTuple):
    """A job that completed on every rank: the fields of a :class:`~distlab.runtime.launch.Run`, less the backend."""

    values: list
    comm: list[CommLog]
    spans: list[Span]
    stdout: list[str]
    stderr: list[str]
    wall_time: float
    counters: tuple = ()  # distlab.runtime.timeline.Counter samples, every rank's
    phases: tuple = ()  # Phase: what the launcher itself did and saw (start, job, failure), for the trace
    profiles: tuple = ()  # per rank: its torch.profiler events (launch(..., profile=True)), else None
    memory_snapshots: tuple = ()  # per rank: its CUDA allocator snapshot (launch(..., memory_snapshot=True)), else None


class Phase(NamedTuple):
    """A step of the launcher's own, in seconds since the job was sent (``rank``: a rank's track, else its own)."""

    name: str
    start: float
    end: float
    rank: int | None = None
    args: dict | None = None


class RankGroup:
    """``world_size`` rank processes sharing one process group, driven through pipes."""

    def __init__(self, world_size: int, backend: str, collective_timeout: float, threads: int):
        self.world_size, self.backend = world_size, backend
        self.collective_timeout = float(collective_timeout)
        self.patience = max(SLOW_RANK_PATIENCE, 6 * self.collective_timeout)
        self.conns, self.procs, self.reaper, self.lifeline = [], [], None, None
        self.dump_offsets: dict[int, int] = {}  # where a rank's stack dump starts in its stderr
        self.job_id = 0
        self.created_at = time.perf_counter()
        self.ready_at: dict[int, float] = {}  # when each rank joined the process group (seen during the first job)
        self._live = (set(range(world_size)), {}, {})  # pending, errors, crashed of the job under way
        ctx = forkserver_context()
        self.store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=max(30.0, self.collective_timeout)))
        self.workdir = tempfile.mkdtemp(prefix="distlab-")
        self.status = ctx.RawArray("d", [0.0, 0.0, -1.0, -1.0] * world_size)
        self.board = ctx.RawArray("d", 4 * world_size)
        self.bars = progress.RankBars(self.store, world_size)  # what the ranks' progress bars report, drawn here
        LIVE_GROUPS.add(self)
        try:
            self._start(ctx, threads)
        except BaseException:  # an interrupt while starting: end whatever did start
            close_quietly(self, InterruptGuard())
            raise

    def _start(self, ctx, threads: int) -> None:
        lifeline_end, self.lifeline = ctx.Pipe(duplex=False)
        self.reaper = ctx.Process(target=reaper.main, args=(lifeline_end, self.workdir), name="distlab-reaper",
                                  daemon=True)
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
            with interrupts_deferred(), _main_module_hidden():  # a rank forked is a rank recorded, and reaped
                proc.start()
                self.conns.append(parent_end)
                self.procs.append(proc)
                self.lifeline.send(proc.pid)  # the rank leads a process group of that id
            child_end.close()

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def run(self, fn: Callable, args: tuple, kwargs: dict, timeout: float | None, profile: bool = False,
            memory_snapshot: bool = False) -> JobResult:
        __tracebackhide__ = True  # IPython: show the rank's traceback, not the launcher's frames
        try:
            job_payload = payload.dumps((fn, tuple(args), dict(kwargs)))
        except Exception as error:
            raise TypeError(f"the job cannot be sent to the ranks: {type(error).__name__}: {error} "
                            "(fn, args and kwargs must be picklable)") from None
        self.job_id += 1
        self.dump_offsets = {}
        self._clear_output()
        self.bars.start_job()
        start = time.perf_counter()
        job = (self.job_id, job_payload, start, os.getcwd(), list(sys.path), {"profile": bool(profile),
                                                                  "memory_snapshot": bool(memory_snapshot)})
        for conn in self.conns:
            try:
                conn.send(job)
            except (BrokenPipeError, ConnectionResetError, OSError):
                pass  # that rank is gone; collecting reports how it ended
        try:
            outcome = self._collect(start, timeout)
        except KeyboardInterrupt:
            raise self._interrupted() from None
        finally:
            self.bars.finish()
        wall = time.perf_counter() - start
        phases = self._phases(start, wall, outcome if isinstance(outcome, LaunchError) else None)
        stdout = [self._read_output(r) for r in range(self.world_size)]
        stderr = [self._read_output(r, stream="err")[:self.dump_offsets.get(r)] for r in range(self.world_size)]
        values, comm_logs, spans, counters, profiles, snapshots = self._gathered
        if isinstance(outcome, LaunchError):
            # What happened up to the failure, for its trace (launch attaches it to the error as ``error.run``).
            outcome.partial = JobResult(values, comm_logs, sorted(spans, key=lambda s: (s.rank, s.start)), stdout,
                                        stderr, wall, tuple(counters), phases, tuple(profiles), tuple(snapshots))
            if not (isinstance(outcome, ReturnValueError) or getattr(outcome, "group_intact", False)):
                self.close()  # ranks left mid-communication (or dead): the next job needs fresh ones
            output.show(stdout, [diagnose.without_fault_dump(text) for text in stderr])
            raise outcome
        values, comm_logs, spans = outcome
        return JobResult(values, comm_logs, spans, stdout, stderr, wall, tuple(counters), phases, tuple(profiles),
                         tuple(snapshots))

    def _interrupted(self) -> LaunchInterrupted:
        """The stop button during a job: show what the ranks printed so far, and say what each was doing and at
        which of the user's lines (a faulthandler dump of every rank still at work, as for a hang).

        Runs under the caller's :class:`InterruptGuard`, which absorbs the presses that follow the first.
        """
        pending, errors, crashed = self._live
        joined = [r for r in sorted(pending) if self.job_id > 1 or r in self.ready_at]
        frames = self._blocked_frames(joined) if joined else {}
        states = self._states(pending, errors, crashed)
        output.show([self._read_output(r) for r in range(self.world_size)],
                    [self._read_output(r, stream="err")[:self.dump_offsets.get(r)] for r in range(self.world_size)])
        return diagnose.interrupted(self.world_size, states, frames)

    def _phases(self, start: float, wall: float, failure: LaunchError | None) -> tuple[Phase, ...]:
        """The launcher's side of the job, for its trace: starting the ranks (a group's first job), the job,
        each rank's report, and on a failure the report and where each silent rank was blocked."""
        phases = []
        if self.job_id == 1:
            joined = max(self.ready_at.values(), default=start)
            phases.append(Phase("start ranks", self.created_at - start, joined - start))
            phases += [Phase(f"rank {r} joined", t - start, t - start) for r, t in sorted(self.ready_at.items())]
        phases.append(Phase(f"job {self.job_id}", 0.0, wall))
        phases += [Phase(f"rank {r} reported", t - start, t - start) for r, t in sorted(self._reported_at.items())]
        if failure is not None:
            end = wall
            for r, (op, seconds, peer) in sorted(self._in_op(range(self.world_size), start + end).items()):
                if r not in self._reported_at:
                    phases.append(Phase(f"blocked in {op}", end - seconds, end, r, {"peer": peer}))
            lines = str(failure).strip().splitlines()
            phases.append(Phase(f"failure: {type(failure).__name__}", end, end, None,
                                {"message": "\n".join(lines[:20])[:4000]}))
        return tuple(phases)

    def _collect(self, start: float, timeout: float | None):
        n = self.world_size
        values: list[Any] = [None] * n
        comm_logs = [CommLog(rank=r) for r in range(n)]
        spans: list[Span] = []
        counters: list = []
        profiles: list = [None] * n
        snapshots: list = [None] * n
        self._gathered = (values, comm_logs, spans, counters, profiles, snapshots)  # whole, for a failed job's trace
        self._reported_at: dict[int, float] = {}
        ledgers: list[dict] = [{} for _ in range(n)]
        pending = set(range(n))
        errors: dict[int, dict] = {}
        crashed: dict[int, int | None] = {}
        self._live = (pending, errors, crashed)  # updated in place: what an interrupt reports (_interrupted)
        unrebuilt: dict[int, Exception] = {}
        first_failure_at = None
        settled_at = start  # when a rank last finished: a peer it just released may not have run yet
        while pending:
            self.bars.poll()
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
                if kind == "ready":
                    self.ready_at[r] = time.perf_counter()
                if kind == "ready" or (message[1] is not None and message[1] != self.job_id):
                    continue  # joined the process group, or a report of an earlier job
                if kind == "ok":
                    try:
                        values[r] = payload.load_result(message[2])
                    except Exception as error:
                        unrebuilt[r] = error
                else:
                    errors[r] = message[2]
                if len(message) > 3:
                    comm_logs[r].ops.update(message[3])
                    spans += message[4]
                    ledgers[r] = message[5]
                if len(message) > 6:
                    extras = message[6]
                    comm_logs[r].events[:] = extras["events"]
                    comm_logs[r].peers[:] = extras["peers"]
                    counters += extras["counters"]
                    profiles[r] = extras["profile"]
                    snapshots[r] = extras.get("memory_snapshot")
                self._reported_at[r] = time.perf_counter()
                pending.discard(r)
                settled_at = time.perf_counter()
            now = time.perf_counter()
            if (errors or crashed) and first_failure_at is None:
                first_failure_at = now
            if first_failure_at is not None:
                window = _FAILURE_WINDOW if diagnose.has_root_cause(errors, crashed) else _CONSEQUENCE_WINDOW
                if not pending or now - first_failure_at > window:
                    return diagnose.failure(self._states(pending, errors, crashed), ledgers)
            stuck = diagnose.stuck_ranks(self._in_op(pending, now), pending, now - settled_at,
                                         self.collective_timeout, self.patience)
            if stuck:
                frames = self._blocked_frames(stuck)
                return diagnose.timeout_report(self._states(pending, errors, crashed), stuck, frames=frames)
            if timeout is not None and now - start > timeout:
                return diagnose.job_timeout(self._states(pending, errors, crashed), timeout)
        if unrebuilt:
            return diagnose.return_value_error(unrebuilt)
        unmatched = diagnose.unmatched_communication(ledgers)
        if unmatched:
            return diagnose.unmatched_error(unmatched)
        spans.sort(key=lambda s: (s.rank, s.start))
        return values, comm_logs, spans

    def _receive(self, r: int):
        conn = self.conns[r]
        try:
            if not conn.poll():
                return None
            if not payload.results_distrusted():
                return conn.recv()
            # A grading process: the rank ran a student's code, so its report is read as plain data only, and
            # a report that is not is the rank's failure (payload.loads_plain).
            try:
                return payload.loads_plain(conn.recv_bytes())
            except (EOFError, OSError):
                raise
            except Exception as error:  # noqa: BLE001  crafted bytes: reported as this rank's error
                return ("error", self.job_id, {"exc_type": "UnpicklingError", "message": f"the rank's report was "
                        f"refused: {str(error)[:200]}", "frames": [], "hidden_frames": 0, "in_op": None, "peer": -1})
        except (EOFError, OSError):
            return None

    # ---- what the ranks are doing, copied out for diagnose

    def _states(self, pending, errors, crashed) -> diagnose.RankStates:
        return diagnose.RankStates(
            world_size=self.world_size, collective_timeout=self.collective_timeout, patience=self.patience,
            pending=frozenset(pending), errors=dict(errors), crashed=dict(crashed),
            in_op=self._in_op(range(self.world_size), time.perf_counter()),
            sending_to={r: int(self.status[_SF * r + 3]) for r in range(self.world_size)
                        if self.status[_SF * r + 3] >= 0},
            stderr={r: self._read_output(r, stream="err") for r in crashed},
        )

    def _in_op(self, ranks, now: float) -> dict[int, tuple[str, float, int]]:
        """(op, seconds inside it, peer) for each of ``ranks`` that the status array shows inside an op."""
        found = {}
        for r in ranks:
            code = self.status[_SF * r]
            if code != 0:
                name = rank_module.OP_NAMES[int(abs(code)) - 1]
                found[r] = ((f"wait({name})" if code < 0 else name), now - self.status[_SF * r + 1],
                            int(self.status[_SF * r + 2]))
        return found

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
                    where = diagnose.blocked_at(dump)
                    if where is not None:
                        frames[r] = where
        for r in ranks:  # in characters: run() cuts the dump off the stderr it returns
            before_dump = self._read_output(r, stream="err").encode()[:offsets[r]]
            self.dump_offsets[r] = len(before_dump.decode(errors="replace"))
        return {r: f for r, f in frames.items() if f}

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
        if self.bars is not None:
            self.bars.close()
        self.store = self.bars = None  # the TCPStore server (a thread and its sockets) goes with them
        shutil.rmtree(self.workdir, ignore_errors=True)
        LIVE_GROUPS.discard(self)
