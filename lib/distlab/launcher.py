"""Start real torch.distributed ranks from a notebook cell and bring their results back.

``launch(fn, world_size=4)`` runs ``fn`` in ``world_size`` OS processes, each
with the default process group initialised (gloo on CPU, NCCL with one GPU per
rank), and returns their return values in rank order. ``Ranks(4)`` keeps such a
group alive between cells so that a small job costs milliseconds.

Processes come from a forkserver that imported torch once: never a fork of the
notebook (which may hold CUDA state), and no per-rank torch import either.
Every outcome ends the same way: all ranks accounted for, none left behind.
"""

from __future__ import annotations

import atexit
import linecache
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable

import cloudpickle

from distlab import rank as rank_module
from distlab.comm import CommLog
from distlab.timeline import Span

DEFAULT_COLLECTIVE_TIMEOUT = 10.0  # seconds a rank may wait in one collective (torch's own default: 30 min)
WATCHDOG_GRACE = 3.0  # extra seconds before the parent kills a rank its backend did not time out
MAX_CPU_RANKS = 32
_FAILURE_WINDOW = 0.3  # after a first failure, how long to listen for the other ranks' errors


class LaunchError(RuntimeError):
    """A launch that did not complete; the message says which rank and why."""


class RankFailed(LaunchError):
    """A rank raised an exception. ``exc_type`` names it (e.g. "NotImplementedError")."""

    def __init__(self, message: str, rank: int, exc_type: str, failed_ranks: list[int]):
        super().__init__(message)
        self.rank, self.exc_type, self.failed_ranks = rank, exc_type, failed_ranks


class RankCrashed(LaunchError):
    """A rank's process ended without reporting: os._exit, a signal, a segfault."""

    def __init__(self, message: str, rank: int, exitcode: int | None):
        super().__init__(message)
        self.rank, self.exitcode = rank, exitcode


class CollectiveTimeout(LaunchError):
    """Ranks waited in a collective that the others never joined."""

    def __init__(self, message: str, waiting: dict[int, str]):
        super().__init__(message)
        self.waiting = waiting


class LaunchTimeout(LaunchError):
    """The whole job ran past the ``timeout`` given to it."""


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


def default_threads(world_size: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // world_size)


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
            # torch.fx's symbolic_shapes (sympy) is imported lazily by the first meta-device model build;
            # importing it here once saves every new rank about half a second of CPU.
            _context.set_forkserver_preload(["torch", "torch.distributed", "torch.fx.experimental.symbolic_shapes",
                                             "cloudpickle", "distlab.rank"])
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


class _RankGroup:
    """``world_size`` rank processes sharing one process group, driven through pipes."""

    def __init__(self, world_size: int, backend: str, collective_timeout: float, threads: int | None):
        import torch.distributed as dist

        self.world_size, self.backend = world_size, backend
        self.collective_timeout = float(collective_timeout)
        ctx = _forkserver_context()
        self.store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=max(30.0, self.collective_timeout)))
        self.workdir = tempfile.mkdtemp(prefix="distlab-")
        self.status = ctx.RawArray("d", 2 * world_size)
        self.conns, self.procs = [], []
        lifeline_end, self.lifeline = ctx.Pipe(duplex=False)
        try:
            self._start_ranks(ctx, lifeline_end, threads or default_threads(world_size))
        except BaseException:  # an interrupt while starting: end whatever did start
            self.close()
            raise
        finally:
            lifeline_end.close()

    def _start_ranks(self, ctx, lifeline_end, threads: int) -> None:
        for r in range(self.world_size):
            spec = rank_module.RankSpec(
                rank=r, world_size=self.world_size, backend=self.backend, store_port=self.store.port,
                collective_timeout=self.collective_timeout, threads=threads,
                stdout_path=self._output_path(r, "out"), stderr_path=self._output_path(r, "err"),
            )
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(target=rank_module.main, args=(spec, child_end, lifeline_end, self.status),
                               name=f"distlab-rank{r}", daemon=True)
            with _main_module_hidden():
                proc.start()
            child_end.close()
            self.conns.append(parent_end)
            self.procs.append(proc)

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def run(self, fn: Callable, args: tuple, kwargs: dict, timeout: float | None) -> Run:
        __tracebackhide__ = True  # IPython: show the rank's traceback, not the launcher's frames
        payload = cloudpickle.dumps((fn, tuple(args), dict(kwargs)))
        self._clear_output()
        start = time.perf_counter()
        job = (payload, start, os.getcwd(), list(sys.path))
        for conn in self.conns:
            conn.send(job)
        outcome = self._collect(start, timeout)
        wall = time.perf_counter() - start
        stdout = [self._read_output(r) for r in range(self.world_size)]
        stderr = [self._read_output(r, stream="err") for r in range(self.world_size)]
        if isinstance(outcome, LaunchError):
            self.close()
            _print_rank_output(stdout, stderr)
            raise outcome
        values, comm_logs, spans = outcome
        return Run(values, comm_logs, spans, stdout, stderr, wall, self.backend)

    def _collect(self, start: float, timeout: float | None):
        n = self.world_size
        values: list[Any] = [None] * n
        comm_logs = [CommLog(rank=r) for r in range(n)]
        spans: list[Span] = []
        pending = set(range(n))
        errors: dict[int, dict] = {}
        crashed: dict[int, int | None] = {}
        first_failure_at = None
        while pending:
            waitables = [self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending]
            for ready in multiprocessing.connection.wait(waitables, timeout=0.05):
                r = self._rank_of(ready)
                if r not in pending:
                    continue
                if ready is self.conns[r] or self.conns[r].poll():
                    try:
                        message = self.conns[r].recv()
                    except (EOFError, OSError):
                        message = None
                    if message is None:
                        crashed[r] = self._exitcode(r)
                        pending.discard(r)
                    elif message[0] == "ready":
                        pass  # joined the process group; its job is already queued
                    elif message[0] == "ok":
                        values[r] = cloudpickle.loads(message[1])
                        comm_logs[r].ops.update(message[2])
                        spans += message[3]
                        pending.discard(r)
                    else:  # "error"
                        errors[r] = message[1]
                        if len(message) > 2:
                            comm_logs[r].ops.update(message[2])
                            spans += message[3]
                        pending.discard(r)
                else:  # the process ended and left no message
                    crashed[r] = self._exitcode(r)
                    pending.discard(r)
            now = time.perf_counter()
            if (errors or crashed) and first_failure_at is None:
                first_failure_at = now
            if first_failure_at is not None and (now - first_failure_at > _FAILURE_WINDOW or not pending):
                return self._failure(errors, crashed, pending)
            stuck = self._stuck_ranks(pending, now)
            if stuck:
                return self._hang(stuck, pending)
            if timeout is not None and now - start > timeout:
                return LaunchTimeout(
                    f"the job ran longer than timeout={timeout:g} s; all ranks were stopped.\n"
                    + self._whereabouts(range(n), pending, heading="When stopped")
                )
        spans.sort(key=lambda s: (s.rank, s.start))
        return values, comm_logs, spans

    # ---- failure reports

    def _failure(self, errors, crashed, pending) -> LaunchError:
        if errors:
            # The root cause is a rank that raised outside a collective, else the lowest failing rank.
            causes = sorted(errors, key=lambda r: (errors[r]["in_op"] is not None, r))
            first = causes[0]
            info = errors[first]
            same = [r for r in sorted(errors) if errors[r]["exc_type"] == info["exc_type"]
                    and errors[r]["message"] == info["message"]]
            who = f"rank {first}" if len(same) == 1 else f"ranks {_ranks(same)}"
            where = f" in {info['in_op']}" if info["in_op"] else ""
            if info["in_op"] and _looks_like_timeout(info["message"]) and not crashed:
                waiting = {r: errors[r]["in_op"] for r in errors if errors[r]["in_op"]}
                return CollectiveTimeout(
                    f"{who} timed out after {self.collective_timeout:g} s waiting{where}: the other ranks never "
                    f"joined that collective (a mismatched or missing collective call).\n"
                    + self._whereabouts(set(range(self.world_size)) - set(same), pending, errors, crashed)
                    + "\n\n" + _format_traceback(first, info),
                    waiting,
                )
            if crashed and info["in_op"]:
                r = min(crashed)
                return RankCrashed(self._crash_message(r, crashed[r], pending, errors, crashed), r, crashed[r])
            headline = f"{who} raised {info['exc_type']}{where}: {_first_line(info['message'])}"
            others = set(range(self.world_size)) - set(same)
            context = self._whereabouts(others, pending, errors, crashed)
            return RankFailed(
                "\n".join(filter(None, [headline, context])) + "\n\n" + _format_traceback(first, info),
                first, info["exc_type"], same,
            )
        r = min(crashed)
        return RankCrashed(self._crash_message(r, crashed[r], pending, errors, crashed), r, crashed[r])

    def _crash_message(self, r, code, pending, errors, crashed) -> str:
        how = _describe_exit(code)
        tail = self._read_output(r, stream="err").strip().splitlines()[-8:]
        detail = ("\nits last stderr lines:\n  " + "\n  ".join(tail)) if tail else ""
        others = set(range(self.world_size)) - {r}
        return (f"rank {r} exited without finishing its job ({how}).\n"
                + self._whereabouts(others, pending, errors, crashed) + detail)

    def _hang(self, stuck: dict[int, tuple[str, float]], pending) -> CollectiveTimeout:
        waiting = {r: op for r, (op, _) in stuck.items()}
        lines = [f"rank {r} waited {secs:.0f} s in {op}" for r, (op, secs) in sorted(stuck.items())]
        return CollectiveTimeout(
            "a collective never completed (timeout "
            f"{self.collective_timeout:g} s + {WATCHDOG_GRACE:g} s grace): " + "; ".join(lines) + ".\n"
            + self._whereabouts(set(range(self.world_size)) - set(stuck), pending),
            waiting,
        )

    def _whereabouts(self, ranks, pending, errors=None, crashed=None, heading="Other ranks, all now stopped") -> str:
        """One line on what each other rank was doing when the launch was ended."""
        errors, crashed = errors or {}, crashed or {}
        now = time.perf_counter()
        parts = []
        for r in sorted(ranks):
            status = self._status(r)
            if r in crashed:
                parts.append(f"rank {r}: exited ({_describe_exit(crashed[r])})")
            elif r in errors:
                where = f" in {errors[r]['in_op']}" if errors[r]["in_op"] else ""
                parts.append(f"rank {r}: raised {errors[r]['exc_type']}{where}")
            elif r in pending and status:
                parts.append(f"rank {r}: waiting in {status[0]} for {now - status[1]:.1f} s")
            elif r in pending:
                parts.append(f"rank {r}: still running (not in a collective)")
            else:
                parts.append(f"rank {r}: finished its job")
        return (f"{heading}: " + "; ".join(parts) + ".") if parts else ""

    def _stuck_ranks(self, pending, now) -> dict[int, tuple[str, float]]:
        limit = self.collective_timeout + WATCHDOG_GRACE
        stuck = {}
        for r in pending:
            status = self._status(r)
            if status and now - status[1] > limit:
                stuck[r] = (status[0], now - status[1])
        return stuck

    def _status(self, r: int) -> tuple[str, float] | None:
        code = self.status[2 * r]
        if code == 0:
            return None
        name = rank_module.OP_NAMES[int(abs(code)) - 1]
        return (f"wait({name})" if code < 0 else name), self.status[2 * r + 1]

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
        """End every rank (politely, then by force) and remove the group's files; safe to repeat."""
        for conn in self.conns:
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
        deadline = time.perf_counter() + 0.5
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.perf_counter()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)
        for conn in self.conns:
            conn.close()
        self.lifeline.close()
        self.procs, self.conns = [], []
        shutil.rmtree(self.workdir, ignore_errors=True)


def _looks_like_timeout(message: str) -> bool:
    text = message.lower()
    return "timed out" in text or "timeout" in text


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        import signal

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
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if collective_timeout <= 0:
        raise ValueError(f"collective_timeout must be positive seconds, got {collective_timeout!r}")
    if warm:
        return Ranks.shared(world_size, backend, collective_timeout, threads).run(
            fn, args, kwargs, timeout=timeout, show_output=show_output)
    backend = resolve_backend(backend, world_size)
    group = None
    try:
        group = _RankGroup(world_size, backend, collective_timeout, threads)
        run = group.run(fn, args, kwargs or {}, timeout)
    except KeyboardInterrupt:
        raise _interrupted(world_size) from None
    finally:
        if group is not None:
            group.close()
    if show_output:
        _print_rank_output(run.stdout, run.stderr)
    return run


class Ranks:
    """A warm group of ranks that stays alive between cells.

    ``ranks = Ranks(4); ranks.run(fn)`` costs milliseconds after the first call.
    A job that fails or hangs ends the group; the next ``run`` starts a new one.
    """

    _shared: dict[tuple, "Ranks"] = {}

    def __init__(self, world_size: int = 4, backend: str = "auto",
                 collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT, threads: int | None = None):
        self.backend = resolve_backend(backend, world_size)
        self.world_size, self.collective_timeout, self.threads = world_size, collective_timeout, threads
        self._group: _RankGroup | None = None

    @classmethod
    def shared(cls, world_size, backend="auto", collective_timeout=DEFAULT_COLLECTIVE_TIMEOUT, threads=None):
        key = (world_size, resolve_backend(backend, world_size), collective_timeout, threads)
        if key not in cls._shared:
            cls._shared[key] = cls(world_size, key[1], collective_timeout, threads)
        return cls._shared[key]

    def start(self) -> "Ranks":
        if self._group is None or not self._group.alive:
            if self._group is not None:
                self._group.close()
            self._group = _RankGroup(self.world_size, self.backend, self.collective_timeout, self.threads)
        return self

    def run(self, fn: Callable, args: tuple = (), kwargs: dict | None = None, *,
            timeout: float | None = None, show_output: bool = True) -> Run:
        __tracebackhide__ = True
        try:
            self.start()
            run = self._group.run(fn, args, kwargs or {}, timeout)
        except BaseException as error:
            self.close()
            if isinstance(error, KeyboardInterrupt) and not isinstance(error, LaunchInterrupted):
                raise _interrupted(self.world_size) from None
            raise
        if show_output:
            _print_rank_output(run.stdout, run.stderr)
        return run

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None

    def __enter__(self) -> "Ranks":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def shutdown() -> None:
    """End every warm group this process started."""
    for ranks in Ranks._shared.values():
        ranks.close()
    Ranks._shared.clear()


atexit.register(shutdown)
