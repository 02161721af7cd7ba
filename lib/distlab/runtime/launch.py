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
  still computing is not deadlocked: it waits (up to :data:`~distlab.runtime.group.SLOW_RANK_PATIENCE`),
  so a slow step on a loaded laptop never fails a correct program.

This module holds the entry points and their argument checks. The processes are handled in
:mod:`~distlab.runtime.group`, failures are diagnosed and worded in :mod:`~distlab.runtime.diagnose`,
and the exceptions, re-exported here, are defined in :mod:`~distlab.runtime.errors`.
"""

from __future__ import annotations

import atexit
import math
import os
import pickle
import sys
from pathlib import Path
from typing import Callable

import torch

from distlab.runtime import diagnose, output, trace
from distlab.runtime.comm import CommLog
from distlab.runtime.errors import (
    CollectiveTimeout,
    LaunchError,
    LaunchInterrupted,
    LaunchTimeout,
    RankCrashed,
    RankFailed,
    ReturnValueError,
    UnmatchedCommunication,
)
from distlab.runtime.group import LIVE_GROUPS, JobResult, Phase, RankGroup
from distlab.runtime.interrupts import InterruptGuard, close_quietly
from distlab.runtime.timeline import Counter, Span

__all__ = ["launch", "Ranks", "Run", "last_run", "shutdown", "resolve_backend", "default_threads",
           "DEFAULT_COLLECTIVE_TIMEOUT", "MAX_CPU_RANKS", "LaunchError", "RankFailed", "RankCrashed",
           "CollectiveTimeout", "LaunchTimeout", "UnmatchedCommunication", "ReturnValueError", "LaunchInterrupted"]

DEFAULT_COLLECTIVE_TIMEOUT = 10.0  # seconds all running ranks may sit blocked in communication (a deadlock)
MAX_CPU_RANKS = 32


class Run(list):
    """The ranks' return values in rank order, plus what was measured while they ran."""

    def __init__(self, values, comm, spans, stdout, stderr, wall_time, backend, counters=(), phases=(),
                 profiles=(), failure: LaunchError | None = None, memory_snapshots=()):
        super().__init__(values)
        self.comm: list[CommLog] = comm
        self.spans: list[Span] = spans
        self.stdout: list[str] = stdout
        self.stderr: list[str] = stderr
        self.wall_time: float = wall_time
        self.backend: str = backend
        self.counters: list[Counter] = list(counters)
        self.phases: list[Phase] = list(phases)
        self.profiles: list = list(profiles)  # per rank: torch.profiler events (profile=True), else None
        self.memory_snapshots: list = list(memory_snapshots)  # per rank: CUDA allocator (memory_snapshot=True)
        self.failure = failure  # the error a failed run raised (its ``.run`` is this record up to the failure)

    @classmethod
    def from_job(cls, job: JobResult, backend: str, failure: LaunchError | None = None) -> "Run":
        return cls(job.values, job.comm, job.spans, job.stdout, job.stderr, job.wall_time, backend, job.counters,
                   job.phases, job.profiles, failure, job.memory_snapshots)

    def trace(self, **options) -> dict:
        """This run as a Trace Event Format dict (see :func:`distlab.runtime.trace.from_run` for ``options``)."""
        return trace.from_run(self, **options)

    def save_trace(self, path, **options):
        """Write this run's trace (ui.perfetto.dev, chrome://tracing) to ``path``; returns the path.

        ``options``: ``max_events`` (a cap; events past it are left out, with a warning saying how many),
        ``window=(start, end)`` seconds since the job was sent. See :mod:`distlab.runtime.trace`.
        """
        return trace.save(self.trace(**options), path)

    def save_memory_snapshots(self, folder) -> list[Path]:
        """Write each GPU rank's allocator snapshot (``launch(..., memory_snapshot=True)``) to
        ``folder/rank<r>.pickle``, the file https://pytorch.org/memory_viz opens (drag it onto the page: the
        allocations over time with their stacks, and the segments at the job's end); returns the paths."""
        taken = [(r, snap) for r, snap in enumerate(self.memory_snapshots) if snap is not None]
        if not taken:
            raise ValueError("this run has no memory snapshots: launch it with memory_snapshot=True on GPU ranks")
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        paths = []
        for r, snap in taken:
            paths.append(folder / f"rank{r}.pickle")
            paths[-1].write_bytes(pickle.dumps(snap))
        return paths

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


BACKEND_ENV = "DISTLAB_BACKEND"  # the backend a launch uses when it asks for 'auto'


def resolve_backend(backend: str, world_size: int) -> str:
    """Pick gloo or NCCL, or say clearly why the requested one cannot run here."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    if backend == "auto" and os.environ.get(BACKEND_ENV):
        # A machine-wide choice for every launch that names no backend: a grader forcing gloo on a GPU box,
        # or a GPU check asking every notebook for NCCL.
        backend = os.environ[BACKEND_ENV].strip().lower()
        if backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"{BACKEND_ENV} must be 'auto', 'gloo' or 'nccl', got {os.environ[BACKEND_ENV]!r}")
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


def _check_memory_snapshot(memory_snapshot: bool, backend: str) -> None:
    """Refuse ``memory_snapshot=True`` before any rank starts where there is no CUDA allocator to record."""
    if memory_snapshot and backend != "nccl":
        raise ValueError(f"memory_snapshot=True records the CUDA caching allocator, and this launch runs {backend} "
                         "ranks on the CPU: use it on GPU ranks (backend='nccl'), or distlab.memory's formulas here")


def default_threads(world_size: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // world_size)


def _interrupted(world_size: int) -> LaunchInterrupted:
    return diagnose.interrupted(world_size)


# ---------------------------------------------------------------- public API

_last: list[Run] = []  # the most recent run of this process, failed or not


def last_run() -> Run | None:
    """The most recent run, finished or failed (a failed one holds what happened up to the failure): in a
    notebook, ``distlab.last_run().save_trace("fail.json")`` after a cell that raised."""
    return _last[0] if _last else None


def _one_job(group: RankGroup, fn, args, kwargs, timeout, profile: bool, backend: str,
             memory_snapshot: bool = False) -> Run:
    """One job on ``group``, kept as :func:`last_run`; a failed job's record rides on its error as ``error.run``."""
    __tracebackhide__ = True
    try:
        job = group.run(fn, args, kwargs, timeout, profile=profile, memory_snapshot=memory_snapshot)
    except LaunchError as error:
        partial = getattr(error, "partial", None)
        if partial is not None:
            error.run = Run.from_job(partial, backend, failure=error)
            _last[:] = [error.run]
        raise
    run = Run.from_job(job, backend)
    _last[:] = [run]
    return run


def launch(fn: Callable, world_size: int = 4, args: tuple = (), kwargs: dict | None = None, *,
           backend: str = "auto", timeout: float | None = None,
           collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT, threads: int | None = None,
           warm: bool = False, show_output: bool = True, profile: bool = False, memory_snapshot: bool = False) -> Run:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh ranks; return their values in rank order.

    ``fn`` may be defined in a notebook cell. Inside it, ``torch.distributed`` is
    initialised; use ``dist.get_rank()``, ``distlab.device()`` and collectives as
    under torchrun. ``collective_timeout`` bounds how long a rank waits for the
    others in one collective; ``timeout`` bounds the whole job. With
    ``warm=True`` the ranks stay alive for the next launch of the same shape.
    ``profile=True`` runs each rank under ``torch.profiler`` (CPU activities; CUDA's too on GPU ranks),
    with every ``distlab.span`` a ``record_function`` range; ``run.save_trace(path)`` then merges the
    ranks' profiles into the run's one trace file (:mod:`distlab.runtime.trace`). ``memory_snapshot=True``
    (GPU ranks only) records each rank's CUDA allocator history over the job; ``run.save_memory_snapshots(folder)``
    writes the files https://pytorch.org/memory_viz draws.
    """
    __tracebackhide__ = True
    args, kwargs = _check_arguments(fn, args, kwargs, threads)
    timeout = _seconds("timeout", timeout, optional=True)
    collective_timeout = _seconds("collective_timeout", collective_timeout)
    if warm:
        return Ranks.shared(world_size, backend, collective_timeout, threads).run(
            fn, args, kwargs, timeout=timeout, show_output=show_output, profile=profile,
            memory_snapshot=memory_snapshot)
    backend = resolve_backend(backend, world_size)
    _check_memory_snapshot(memory_snapshot, backend)
    with InterruptGuard() as guard:
        group = None
        try:
            group = RankGroup(world_size, backend, collective_timeout, threads or default_threads(world_size))
            run = _one_job(group, fn, args, kwargs, timeout, profile, backend, memory_snapshot)
        except KeyboardInterrupt as error:  # the group's own report says what each rank was doing
            raise (error if isinstance(error, LaunchInterrupted) else _interrupted(world_size)) from None
        finally:
            close_quietly(group, guard)
        if guard.absorbed:
            raise _interrupted(world_size)
    if show_output:
        output.show(run.stdout, run.stderr)
    return run


class Ranks:
    """A warm group of ranks that stays alive between cells.

    ``ranks = Ranks(4); ranks.run(fn)`` costs milliseconds after the first call.
    A job that fails, hangs or is interrupted ends the group; the next ``run``
    starts a new one. Jobs never see each other's leftovers: see :mod:`distlab.runtime.rank`.
    """

    _shared: dict[tuple, "Ranks"] = {}

    def __init__(self, world_size: int = 4, backend: str = "auto",
                 collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT, threads: int | None = None):
        self.backend = resolve_backend(backend, world_size)
        _check_arguments(lambda: None, (), None, threads)
        self.world_size, self.threads = world_size, threads
        self.collective_timeout = _seconds("collective_timeout", collective_timeout)
        self._group: RankGroup | None = None

    @classmethod
    def shared(cls, world_size, backend="auto", collective_timeout=DEFAULT_COLLECTIVE_TIMEOUT, threads=None):
        key = (world_size, resolve_backend(backend, world_size), collective_timeout, threads)
        if key not in cls._shared:
            cls._shared[key] = cls(world_size, key[1], collective_timeout, threads)
        return cls._shared[key]

    def start(self) -> "Ranks":
        if self._group is None or not self._group.alive:
            stale, self._group = self._group, None
            with InterruptGuard() as guard:
                close_quietly(stale, guard)
            self._group = RankGroup(self.world_size, self.backend, self.collective_timeout,
                                    self.threads or default_threads(self.world_size))
        return self

    def run(self, fn: Callable, args: tuple = (), kwargs: dict | None = None, *,
            timeout: float | None = None, show_output: bool = True, profile: bool = False,
            memory_snapshot: bool = False) -> Run:
        __tracebackhide__ = True
        args, kwargs = _check_arguments(fn, args, kwargs, self.threads)
        _check_memory_snapshot(memory_snapshot, self.backend)
        timeout = _seconds("timeout", timeout, optional=True)
        with InterruptGuard() as guard:
            try:
                self.start()
                run = _one_job(self._group, fn, args, kwargs, timeout, profile, self.backend, memory_snapshot)
            except BaseException as error:
                if isinstance(error, ReturnValueError) or getattr(error, "group_intact", False):
                    raise  # the ranks are clean: keep them for the next job
                group, self._group = self._group, None  # detached first: no later run can reuse it
                close_quietly(group, guard)
                if isinstance(error, KeyboardInterrupt) and not isinstance(error, LaunchInterrupted):
                    raise _interrupted(self.world_size) from None
                raise
        if show_output:
            output.show(run.stdout, run.stderr)
        return run

    @property
    def alive(self) -> bool:
        """True while this group's ranks are up: not yet started, closed, or ended by a failure is False."""
        return self._group is not None and self._group.alive

    def processes(self) -> list[tuple[int, int | None]]:
        """(pid, exit code) of each rank, the code None while it runs; empty when no ranks are up or kept."""
        return [(proc.pid, proc.exitcode) for proc in self._group.procs] if self._group is not None else []

    def close(self) -> None:
        group, self._group = self._group, None
        with InterruptGuard() as guard:
            close_quietly(group, guard)

    def __enter__(self) -> "Ranks":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def shutdown() -> None:
    """End every group of ranks this process started and has not closed (warm ones included)."""
    for ranks in Ranks._shared.values():
        ranks.close()
    Ranks._shared.clear()
    for group in list(LIVE_GROUPS):
        with InterruptGuard() as guard:
            close_quietly(group, guard)


# Registered after multiprocessing's own exit handler, so it runs first (atexit is last-in, first-out).
atexit.register(shutdown)
