"""What runs inside each launched rank: set-up, the job loop, and helpers user code calls.

The parent (:mod:`distlab.runtime.launch`) starts one process per rank from a
forkserver that has already imported torch, so a rank starts in a fraction of
a second. Each rank joins the process group once, then runs jobs sent over a
pipe: a cold launch sends one job, a warm group many.

Jobs in a warm rank are isolated from each other: every job starts from the
process state the rank had when it became ready (environment, default dtype,
grad mode, RNG states…), async ops a job left in flight are drained before it
reports, and its communication ledger goes back to the parent, which checks
that every send was received and every collective matched.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import random
import signal
import sys
import time
import traceback
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing import forkserver

import torch
import torch.distributed as dist

from distlab.runtime import comm, payload, progress, timeline
from distlab.runtime.frames import is_library_frame

# Process-wide default seed torch uses in a fresh interpreter; every job starts from it,
# so a job in a warm rank draws the same random numbers as in a cold one.
_FRESH_TORCH_SEED = torch.initial_seed()
_THIS_FILE = os.path.abspath(__file__)  # _run_job's frame, above the user's first: never part of their traceback
OP_NAMES = list(comm.WIRE_BYTES)
# Per rank in the shared status array: op code (negative: waiting on an async op), since, peer, and the
# peer of the oldest isend still in flight (-1: none), which tells a wrong neighbour from a deadlock.
STATUS_FIELDS = 4
STACK_DUMP_SIGNAL = signal.SIGUSR1  # the launcher asks a blocked rank for its Python stack with it
CLOCK_MARK = "distlab.clock"  # the record_function range a profiled job opens first; it ends at a known time


@dataclass(frozen=True)
class RankSpec:
    rank: int
    world_size: int
    backend: str
    store_port: int
    backend_timeout: float  # a backstop: the launcher's watchdog ends real hangs well before it
    threads: int
    stdout_path: str
    stderr_path: str


class UnfinishedAsyncOp(RuntimeError):
    """A job returned while an async op it issued could not complete."""


def device() -> torch.device:
    """The device this rank should compute on: its own GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    return torch.device("cpu")


def native_bf16(dev: torch.device) -> bool:
    """Whether ``dev`` computes bf16 in hardware: a GPU of compute capability 8.0 or more.

    ``torch.cuda.is_bf16_supported()`` with its defaults also answers True where bf16 is only emulated (a T4 or a
    V100, Colab's and Kaggle's GPUs; ``including_emulation`` in ``torch/cuda/__init__.py``), and bf16 then runs at
    a fraction of fp16's speed; the course picks a dtype by what the hardware does, so it asks without emulation."""
    return dev.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)


def main(spec: RankSpec, conn, status, board) -> None:
    """Entry point of a rank process."""
    # Our own process group: the launcher ends this rank and every process it starts with one
    # killpg, and a notebook's interrupt (sent to the kernel's process group) is the launcher's to handle.
    os.setpgid(0, 0)
    _detach_from_forkserver()
    _name_process(f"distlab-rank{spec.rank}")
    _capture_output(spec)
    _limit_threads(spec.threads)
    _set_rank_environment(spec)
    try:
        _join_process_group(spec)
    except BaseException as error:  # reported to the parent, which ends the launch
        conn.send(("error", None, describe_error(error, in_op="init_process_group")))
        return
    progress.report_to(spec.store_port, spec.rank)  # the rank's bars are drawn by the launcher
    comm.install()
    comm.set_status_hook(_status_writer(status, spec.rank), _inflight_writer(status, spec.rank))
    comm.set_fingerprint_board(board, spec.rank)
    # torch 2.13 renamed all_gather_into_tensor/reduce_scatter_tensor to *_single; labs keep the
    # names that work on every supported torch (>=2.8), so the rename notice is noise here.
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed\.\w+_single`",
                            category=FutureWarning)
    os.ftruncate(1, 0)  # start-up chatter is not the user's output
    os.ftruncate(2, 0)
    baseline = ProcessState.capture()
    conn.send(("ready",))
    while True:
        try:
            job = conn.recv()
        except EOFError:  # the parent went away
            break
        if job is None:
            break
        conn.send(_run_job(spec.rank, baseline, *job))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def _run_job(rank: int, baseline: "ProcessState", job_id: int, job_payload: bytes, clock_origin: float, cwd: str,
             sys_path: list[str], options: dict | None = None):
    baseline.restore()
    os.chdir(cwd)
    sys.path[:] = sys_path
    torch.manual_seed(_FRESH_TORCH_SEED)
    comm.reset(rank, clock_origin)
    options = options or {}
    profiler = _Profiler(clock_origin) if options.get("profile") else None
    history = _MemoryHistory() if options.get("memory_snapshot") else None
    timeline.reset(clock_origin, annotate=profiler.annotate if profiler else None, memory=_cuda_memory_sampler())
    try:
        fn, args, kwargs = payload.loads(job_payload)
        with profiler if profiler is not None else nullcontext(), history if history is not None else nullcontext():
            value = fn(*args, **kwargs)
            _drain_async_ops()
        try:
            result = payload.dumps(value)
        except Exception as error:
            raise TypeError(f"the return value ({type(value).__name__}) cannot be sent back: {error}") from None
        outcome = ("ok", job_id, result)
    except BaseException as error:
        info = describe_error(error, in_op=getattr(error, "distlab_op", None))
        info["in_flight"] = [(work.op, work.peer) for work in comm.unfinished()]
        outcome = ("error", job_id, info)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    log = comm.current_log()
    ledger = {name: dict(getattr(log.ledger, name)) for name in ("collectives", "sent", "received")}
    extras = {"events": list(log.events), "peers": list(log.peers), "counters": timeline.collect_counters(rank),
              "profile": profiler.events() if profiler is not None else None,
              "memory_snapshot": history.snapshot if history is not None else None}
    return outcome + (dict(log.ops), timeline.collect(rank, log.events), ledger, extras)


def _cuda_memory_sampler():
    """On a GPU rank, the allocator's bytes sampled at every span's end (a trace's memory counter); else None."""
    if not (dist.is_initialized() and dist.get_backend() == "nccl"):
        return None
    dev = device()
    return lambda: ("cuda memory allocated", torch.cuda.memory_allocated(dev))


@contextmanager
def _stderr_silenced():
    """fd 2 to /dev/null for the duration (C++ logging, which Python's redirections cannot catch)."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


class _Profiler:
    """``torch.profiler`` around one job: CPU activities, and CUDA's where this rank has a GPU.

    Every distlab span is also a ``record_function`` range (``annotate``), which is how the profiler's
    clock is put on distlab's: :mod:`distlab.runtime.trace` pairs each range with its span. The events
    come back as the profiler's Chrome trace, read from a temporary file.
    """

    def __init__(self, clock_origin: float):
        from torch.profiler import ProfilerActivity, profile, record_function  # noqa: PLC0415  only when profiling

        activities = [ProfilerActivity.CPU]
        if dist.is_initialized() and dist.get_backend() == "nccl":
            activities.append(ProfilerActivity.CUDA)
        self._profile = profile(activities=activities)
        self.annotate = record_function
        self._trace: list[dict] | None = None
        self._error: str | None = None
        self._origin, self._mark = clock_origin, 0.0

    def __enter__(self):
        with _stderr_silenced():  # kineto logs "profiler_start" to fd 2: not the user's output
            self._profile.__enter__()
        with self.annotate(CLOCK_MARK):  # a first pairing of the two clocks, even for a job with no spans
            self._mark = time.perf_counter() - self._origin  # the range's end, as a span's end is stamped
        return self

    def __exit__(self, *exc):
        import json  # noqa: PLC0415  only when profiling
        import tempfile  # noqa: PLC0415  as above

        try:
            with _stderr_silenced():
                self._profile.__exit__(*exc)
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
                path = f.name
            try:
                self._profile.export_chrome_trace(path)
                with open(path, encoding="utf-8") as f:
                    self._trace = json.load(f).get("traceEvents", [])
            finally:
                os.unlink(path)
        except Exception as error:  # a broken profiler must not fail the job it watched
            self._error = f"{type(error).__name__}: {error}"
        return False

    def events(self) -> dict:
        return {"events": self._trace or [], "error": self._error, "mark": self._mark}


MEMORY_HISTORY_ENTRIES = 20_000  # allocator events kept per rank: a long job keeps its last ones, in megabytes


class _MemoryHistory:
    """The CUDA caching allocator's history and state over one job (``launch(..., memory_snapshot=True)``).

    ``torch.cuda.memory._record_memory_history`` keeps, for every allocation and free, its size and Python stack;
    ``_snapshot()`` returns that history with every segment and block the allocator holds at the job's end, the
    dict https://pytorch.org/memory_viz draws. The history is a ring of ``MEMORY_HISTORY_ENTRIES`` events, so a
    long job's snapshot stays bounded. The launcher refuses the option on CPU ranks before any rank starts.
    """

    def __init__(self):
        self.snapshot: dict | None = None

    def __enter__(self):
        torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        return self

    def __exit__(self, *exc):
        try:
            self.snapshot = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)  # stop: the next job starts its own
        return False


def _drain_async_ops() -> None:
    """Wait for the async ops the job issued but never waited on, so none spills into the next job.

    Matched ops complete in moments. One the other ranks never issued fails at the
    collective timeout, and the job fails with the line that issued it.
    """
    for work in comm.unfinished():
        try:
            work.wait()
        except Exception as error:
            lines = str(error).strip().splitlines()
            raise UnfinishedAsyncOp(
                f"the job returned while its async {work.op} (issued at {work.issued_at}) was still in flight, "
                f"and it never completed ({lines[0] if lines else type(error).__name__}). Wait on every handle "
                "before returning; an op that never completes was not issued by the other ranks.") from None


@dataclass
class ProcessState:
    """The per-process settings a job may change and the next job must not inherit."""

    environ: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)
    python_random: object = None
    numpy_random: object = None

    _TORCH_SETTINGS = {  # name: (getter, setter)
        "default_dtype": (torch.get_default_dtype, torch.set_default_dtype),
        "grad_enabled": (torch.is_grad_enabled, torch.set_grad_enabled),
        "anomaly": (torch.is_anomaly_enabled, torch.set_anomaly_enabled),
        "num_threads": (torch.get_num_threads, torch.set_num_threads),
        "matmul_precision": (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
        "deterministic": (lambda: (torch.are_deterministic_algorithms_enabled(),
                                   torch.is_deterministic_algorithms_warn_only_enabled()),
                          lambda value: torch.use_deterministic_algorithms(value[0], warn_only=value[1])),
        "stdout": (lambda: sys.stdout, lambda value: setattr(sys, "stdout", value)),
        "stderr": (lambda: sys.stderr, lambda value: setattr(sys, "stderr", value)),
        "warning_filters": (lambda: list(warnings.filters),
                            lambda value: warnings.filters.__setitem__(slice(None), value)),
    }
    if hasattr(torch, "get_default_device"):  # torch >= 2.3; setting "cpu" back would leave a mode active
        _TORCH_SETTINGS["default_device"] = (
            torch.get_default_device,
            lambda value: torch.set_default_device(None if value == torch.device("cpu") else value))

    @classmethod
    def capture(cls) -> "ProcessState":
        state = cls(environ=dict(os.environ), python_random=random.getstate())
        state.settings = {name: get() for name, (get, _) in cls._TORCH_SETTINGS.items()}
        if "numpy" in sys.modules:
            state.numpy_random = sys.modules["numpy"].random.get_state()
        return state

    def restore(self) -> None:
        if os.environ != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        for name, (get, set_) in self._TORCH_SETTINGS.items():
            if get() != self.settings[name]:
                set_(self.settings[name])
        random.setstate(self.python_random)
        if self.numpy_random is not None:
            sys.modules["numpy"].random.set_state(self.numpy_random)


def describe_error(error: BaseException, in_op: str | None) -> dict:
    """A picklable account of an exception with the frames a user needs: theirs, not ours or torch's."""
    frames = traceback.extract_tb(error.__traceback__)
    frames = [f for f in frames if os.path.abspath(f.filename) != _THIS_FILE]
    users = [i for i, f in enumerate(frames) if not is_library_frame(f.filename)]
    # From the user's first frame (a %%ranks cell is run by the runtime's console) to their last (what they
    # called inside torch or distlab is counted, not shown).
    first_user, last_user = (users[0], users[-1]) if users else (0, len(frames) - 1)
    hidden = len(frames) - 1 - last_user
    frames = frames[first_user: last_user + 1]
    return {
        "exc_type": type(error).__name__,
        "message": str(error),
        "frames": [(f.filename, f.lineno, f.name, f.line) for f in frames],
        "hidden_frames": hidden,
        "in_op": in_op,
        "peer": getattr(error, "distlab_peer", -1),
    }


def _status_writer(status, rank: int):
    """Publish which op this rank is blocked in, since when and with which peer, for the parent's watchdog."""
    base = STATUS_FIELDS * rank

    def write(op: str | None, peer: int = -1) -> None:
        if op is None:
            status[base] = 0.0
        else:
            waiting = op.startswith("wait(")
            code = OP_NAMES.index(op[5:-1] if waiting else op) + 1
            status[base + 1] = time.perf_counter()
            status[base + 2] = peer
            status[base] = -code if waiting else code  # written last: the parent reads it first

    return write


def _inflight_writer(status, rank: int):
    def write(peer: int) -> None:
        status[STATUS_FIELDS * rank + 3] = peer

    return write


def _join_process_group(spec: RankSpec) -> None:
    """Rendezvous in the store until every rank is up, then join the process group.

    On a loaded machine the last rank can start seconds after the first; waiting for all
    of them in the store first keeps gloo's mesh connection from racing a slow starter.
    """
    patience = timedelta(seconds=max(60.0, spec.backend_timeout))
    store = dist.TCPStore("127.0.0.1", spec.store_port, spec.world_size, is_master=False, timeout=patience)
    store.set(f"distlab/up/{spec.rank}", "1")
    store.wait([f"distlab/up/{r}" for r in range(spec.world_size)], patience)
    if spec.backend == "nccl":
        torch.cuda.set_device(spec.rank)
    dist.init_process_group(spec.backend, store=store, rank=spec.rank, world_size=spec.world_size,
                            timeout=timedelta(seconds=spec.backend_timeout))


def _set_rank_environment(spec: RankSpec) -> None:
    """The variables torchrun sets, so code written for torchrun runs unchanged."""
    os.environ.update(
        RANK=str(spec.rank), LOCAL_RANK=str(spec.rank), WORLD_SIZE=str(spec.world_size),
        LOCAL_WORLD_SIZE=str(spec.world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec.store_port),
    )
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    elif sys.platform == "darwin":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo0")


def _limit_threads(threads: int) -> None:
    """N ranks on few cores: each gets its share, or they thrash."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # only settable before the first parallel region; the forkserver ran none


def _capture_output(spec: RankSpec) -> None:
    """Send fd 1 and 2 (Python and C++ alike) to files the parent reads back in rank order."""
    for fd, path in ((1, spec.stdout_path), (2, spec.stderr_path)):
        target = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.dup2(target, fd)
        os.close(target)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)
        except (AttributeError, ValueError):
            pass
    faulthandler.enable()  # a segfault or an abort leaves a Python traceback in the rank's stderr
    faulthandler.register(STACK_DUMP_SIGNAL, all_threads=True)  # so does the launcher's request for a blocked rank


def _detach_from_forkserver() -> None:
    """Forget the launcher's forkserver: a rank that uses multiprocessing starts its own.

    A forkserver child inherits the server's address and a copy of its "alive" pipe.
    Holding that copy would keep the shared server alive after the notebook dies, and
    children started through it would be the server's, outside this rank's process
    group, where the launcher could not reach them.
    """
    server = forkserver._forkserver
    alive = getattr(server, "_forkserver_alive_fd", None)
    if alive is not None:
        try:
            os.close(alive)
        except OSError:
            pass
    for name in ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid", "_forkserver_authkey"):
        if hasattr(server, name):
            setattr(server, name, None)


def _name_process(name: str) -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME, what `ps -o comm` shows
