"""What runs inside each launched rank: set-up, the job loop, and helpers user code calls.

The parent (:mod:`distlab.launcher`) starts one process per rank from a
forkserver that has already imported torch, so a rank starts in a fraction of
a second. Each rank joins the process group once, then runs jobs sent over a
pipe: a cold launch sends one job, a warm group many.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from datetime import timedelta

import cloudpickle
import torch
import torch.distributed as dist

from distlab import comm, timeline

# Process-wide default seed torch uses in a fresh interpreter; every job starts from it,
# so a job in a warm rank draws the same random numbers as in a cold one.
_FRESH_TORCH_SEED = torch.initial_seed()
_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_FILE = os.path.abspath(__file__)
OP_NAMES = list(comm.WIRE_BYTES)


@dataclass(frozen=True)
class RankSpec:
    rank: int
    world_size: int
    backend: str
    store_port: int
    collective_timeout: float
    threads: int
    stdout_path: str
    stderr_path: str


def device() -> torch.device:
    """The device this rank should compute on: its own GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    return torch.device("cpu")


def main(spec: RankSpec, conn, lifeline, status) -> None:
    """Entry point of a rank process."""
    _die_with_launcher(lifeline)
    _name_process(f"distlab-rank{spec.rank}")
    _capture_output(spec)
    _limit_threads(spec.threads)
    _set_rank_environment(spec)
    status_hook = _status_writer(status, spec.rank)
    try:
        _join_process_group(spec)
    except BaseException as error:  # reported to the parent, which ends the launch
        conn.send(("error", describe_error(error, in_op="init_process_group")))
        return
    comm.install()
    comm.set_status_hook(status_hook)
    # torch 2.13 renamed all_gather_into_tensor/reduce_scatter_tensor to *_single; labs keep the
    # names that work on every supported torch (>=2.8), so the rename notice is noise here.
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed\.\w+_single`",
                            category=FutureWarning)
    os.ftruncate(1, 0)  # start-up chatter is not the user's output
    os.ftruncate(2, 0)
    conn.send(("ready",))
    while True:
        try:
            job = conn.recv()
        except EOFError:  # the parent went away
            break
        if job is None:
            break
        conn.send(_run_job(spec.rank, *job))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def _run_job(rank: int, payload: bytes, clock_origin: float, cwd: str, sys_path: list[str]):
    os.chdir(cwd)
    sys.path[:] = sys_path
    torch.manual_seed(_FRESH_TORCH_SEED)
    comm.reset(rank, clock_origin)
    timeline.reset(clock_origin)
    try:
        fn, args, kwargs = cloudpickle.loads(payload)
        value = fn(*args, **kwargs)
        try:
            result = cloudpickle.dumps(value)
        except Exception as error:
            raise TypeError(f"the return value ({type(value).__name__}) cannot be sent back: {error}") from None
        outcome = ("ok", result)
    except BaseException as error:
        outcome = ("error", describe_error(error, in_op=getattr(error, "distlab_op", None)))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    log = comm.current_log()
    return outcome + (dict(log.ops), timeline.collect(rank, log.events))


def describe_error(error: BaseException, in_op: str | None) -> dict:
    """A picklable account of an exception with the frames a user needs: theirs, not ours or torch's."""
    frames = traceback.extract_tb(error.__traceback__)
    frames = [f for f in frames if os.path.abspath(f.filename) != _THIS_FILE]
    last_user = max((i for i, f in enumerate(frames) if not _is_library_frame(f.filename)), default=len(frames) - 1)
    hidden = len(frames) - 1 - last_user
    frames = frames[: last_user + 1]
    return {
        "exc_type": type(error).__name__,
        "message": str(error),
        "frames": [(f.filename, f.lineno, f.name, f.line) for f in frames],
        "hidden_frames": hidden,
        "in_op": in_op,
    }


def _is_library_frame(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(_TORCH_DIR) or path == os.path.abspath(comm.__file__)


def _status_writer(status, rank: int):
    """Publish which op this rank is blocked in, and since when, for the parent's watchdog."""

    def write(op: str | None) -> None:
        if op is None:
            status[2 * rank] = 0.0
        else:
            waiting = op.startswith("wait(")
            code = OP_NAMES.index(op[5:-1] if waiting else op) + 1
            status[2 * rank] = -code if waiting else code
            status[2 * rank + 1] = time.perf_counter()

    return write


def _join_process_group(spec: RankSpec) -> None:
    timeout = timedelta(seconds=spec.collective_timeout)
    store = dist.TCPStore("127.0.0.1", spec.store_port, spec.world_size, is_master=False, timeout=timeout)
    if spec.backend == "nccl":
        torch.cuda.set_device(spec.rank)
    dist.init_process_group(spec.backend, store=store, rank=spec.rank, world_size=spec.world_size, timeout=timeout)


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
    faulthandler.enable()  # a segfault leaves a Python traceback in the rank's stderr


def _die_with_launcher(lifeline) -> None:
    """End this rank when the launching process goes away, even by kill -9, even mid-job.

    Only the launcher holds the lifeline's write end, so EOF means it is gone.
    (The forkserver is no help here: it lives on while any rank does.)
    """
    def watch():
        try:
            lifeline.recv()
        except (EOFError, OSError):
            pass
        os._exit(1)

    threading.Thread(target=watch, name="distlab-lifeline", daemon=True).start()


def _name_process(name: str) -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME, what `ps -o comm` shows
