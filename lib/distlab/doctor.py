"""``distlab doctor``: is this machine ready for the labs? One line per check, with a hint when not.

Checks Python and torch versions, CPU cores, CUDA GPUs and NCCL, gloo, a real
two-rank gloo all-reduce through :func:`distlab.launch` (timed), a free local
port, the size of ``/dev/shm`` and the notebook packages. ``✓`` is fine, ``!``
works but deserves a look, ``✗`` stops the labs from running.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import re
import socket
import sys
import time
from dataclasses import dataclass
from typing import Callable

OK, WARN, FAIL = "ok", "warn", "fail"
MARKS = {OK: "✓", WARN: "!", FAIL: "✗"}
MIN_TORCH = (2, 8)
SUPPORTED_PYTHON = ((3, 10), (3, 13))
GiB = 2**30


@dataclass
class Check:
    name: str
    status: str  # "ok" | "warn" | "fail"
    detail: str
    hint: str = ""

    @property
    def ok(self) -> bool:
        return self.status != FAIL

    def line(self) -> str:
        text = f"{MARKS[self.status]} {self.name:<18} {self.detail}"
        if self.hint and self.status != OK:
            text += f"  → {self.hint}"
        return text


def parse_version(text: str) -> tuple[int, ...]:
    """``"2.13.0+cpu"`` → ``(2, 13, 0)``; anything unparsable → ``()``."""
    match = re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", text.strip())
    if not match:
        return ()
    return tuple(int(part) for part in match.groups() if part is not None)


# ---------------------------------------------------------------- checks

def check_python() -> Check:
    version = sys.version_info[:3]
    text = ".".join(map(str, version))
    low, high = SUPPORTED_PYTHON
    if low <= version[:2] <= high:
        return Check("Python", OK, text)
    return Check("Python", WARN, f"{text} (distlab is tested on 3.10-3.13)", "use Python 3.10-3.13")


def check_torch() -> Check:
    try:
        import torch  # noqa: PLC0415  this check reports a torch that does not import
    except ImportError as error:
        return Check("torch", FAIL, f"not importable ({error})", "pip install 'torch>=2.8'")
    version = parse_version(torch.__version__)
    if version[:2] < MIN_TORCH:
        return Check("torch", FAIL, f"{torch.__version__} (need >= {MIN_TORCH[0]}.{MIN_TORCH[1]})",
                     "pip install -U 'torch>=2.8'")
    return Check("torch", OK, torch.__version__)


def check_cpu() -> Check:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if cores >= 4:
        return Check("CPU cores", OK, f"{cores} available")
    return Check("CPU cores", WARN, f"{cores} available: 4 CPU ranks will share them",
                 "labs run, but timings are slower and noisier than on 4+ cores")


def check_gpus() -> Check:
    import torch  # noqa: PLC0415  run_doctor skips this check when torch does not import

    if not torch.cuda.is_available():
        built = "CPU-only torch build" if torch.version.cuda is None else f"CUDA {torch.version.cuda} build"
        return Check("CUDA GPUs", OK, f"none ({built}): every lab runs on CPU ranks with gloo")
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    summary = ", ".join(f"{count}x {name}" for name, count in _counts(names).items())
    return Check("CUDA GPUs", OK, f"{len(names)}: {summary}")


def check_nccl() -> Check:
    import torch  # noqa: PLC0415  run_doctor skips this check when torch does not import
    import torch.distributed as dist  # noqa: PLC0415  run_doctor skips this check when torch does not import

    if not torch.cuda.is_available():
        return Check("NCCL", OK, "not needed without GPUs (ranks use gloo)")
    if not dist.is_nccl_available():
        return Check("NCCL", FAIL, "this torch build has no NCCL", "install a CUDA build of torch on Linux")
    try:
        version = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001  the version query is informative only
        version = "version unknown"
    gpus = torch.cuda.device_count()
    detail = f"{version}; backend='auto' uses NCCL for up to {gpus} rank{'s' if gpus != 1 else ''}"
    return Check("NCCL", OK, detail)


def check_gloo() -> Check:
    import torch.distributed as dist  # noqa: PLC0415  run_doctor skips this check when torch does not import

    if not dist.is_available():
        return Check("gloo", FAIL, "torch.distributed is not available in this build", "install torch from pytorch.org")
    if not dist.is_gloo_available():
        return Check("gloo", FAIL, "this torch build has no gloo backend", "install torch from pytorch.org")
    return Check("gloo", OK, "available")


def _doctor_all_reduce():
    import torch  # noqa: PLC0415  torch stays out of the doctor's top level (check_torch)
    import torch.distributed as dist  # noqa: PLC0415  torch stays out of the doctor's top level (check_torch)

    x = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(x)
    return x.item()


def check_launch(world_size: int = 2) -> Check:
    """A real all-reduce on ``world_size`` gloo ranks, start-up included."""
    from distlab.runtime.launch import LaunchError, launch  # noqa: PLC0415  imports torch: run_doctor checks it first

    name = f"{world_size}-rank all-reduce"
    start = time.perf_counter()
    try:
        values = launch(_doctor_all_reduce, world_size, backend="gloo", timeout=120, collective_timeout=30,
                        show_output=False)
    except LaunchError as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return Check(name, FAIL, f"{type(error).__name__}: {first}",
                     "check that localhost resolves and that local TCP connections are allowed")
    seconds = time.perf_counter() - start
    expected = world_size * (world_size + 1) / 2
    if list(values) != [expected] * world_size:
        return Check(name, FAIL, f"wrong result {list(values)} (expected {expected:g} on every rank)",
                     "report this: gloo returned a wrong sum")
    detail = f"gloo, correct, {seconds:.2f} s including start-up"
    if seconds > 15:
        return Check(name, WARN, detail, "slow start: is the machine overloaded?")
    return Check(name, OK, detail)


def check_port() -> Check:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    except OSError as error:
        return Check("free port", FAIL, f"cannot bind 127.0.0.1 ({error})",
                     "ranks talk over local TCP: allow binding to 127.0.0.1")
    return Check("free port", OK, f"127.0.0.1:{port} can be bound")


def check_shm(path: str = "/dev/shm") -> Check:
    if not sys.platform.startswith("linux"):
        return Check("/dev/shm", OK, f"not used on {sys.platform}")
    try:
        stats = os.statvfs(path)
    except OSError:
        return Check("/dev/shm", WARN, "missing", "tensors passed between processes need shared memory")
    size = stats.f_frsize * stats.f_blocks
    free = stats.f_frsize * stats.f_bavail
    detail = f"{size / GiB:.1f} GiB ({free / GiB:.1f} GiB free)"
    if size < 1 * GiB:
        return Check("/dev/shm", WARN, detail,
                     "small (Docker's default is 64 MB): start the container with --shm-size=2g or --ipc=host")
    return Check("/dev/shm", OK, detail)


def check_notebook() -> Check:
    found, missing = [], []
    for module, dist_name in (("jupyterlab", "jupyterlab"), ("ipywidgets", "ipywidgets")):
        if importlib.util.find_spec(module) is None:
            missing.append(dist_name)
            continue
        try:
            found.append(f"{dist_name} {importlib.metadata.version(dist_name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(dist_name)
    if missing:
        detail = f"missing {', '.join(missing)}" + (f" ({', '.join(found)} found)" if found else "")
        return Check("notebooks", WARN, detail, f"pip install {' '.join(missing)}")
    return Check("notebooks", OK, ", ".join(found))


CHECKS: list[Callable[[], Check]] = [check_python, check_torch, check_cpu, check_gpus, check_nccl, check_gloo,
                                     check_launch, check_port, check_shm, check_notebook]
NEEDS_TORCH = {check_gpus, check_nccl, check_gloo, check_launch}


def run_doctor(launch: bool = True) -> list[Check]:
    """Run every check (``launch=False`` skips starting ranks); a crashing check is reported, not raised."""
    results = []
    torch_ok = True
    for check in CHECKS:
        if check is check_launch and not launch:
            continue
        if check in NEEDS_TORCH and not torch_ok:
            results.append(Check(check.__name__.replace("check_", ""), FAIL, "skipped: torch is not usable",
                                 "fix torch first"))
            continue
        try:
            result = check()
        except Exception as error:  # noqa: BLE001  the doctor reports, it does not crash
            result = Check(check.__name__.replace("check_", ""), FAIL, f"{type(error).__name__}: {error}",
                           "report this with the output of `distlab doctor`")
        if check is check_torch and result.status == FAIL and "not importable" in result.detail:
            torch_ok = False
        results.append(result)
    return results


def report(checks: list[Check]) -> str:
    lines = [check.line() for check in checks]
    failed = sum(1 for c in checks if c.status == FAIL)
    warned = sum(1 for c in checks if c.status == WARN)
    if failed:
        lines.append(f"{failed} problem{'s' if failed != 1 else ''} to fix before the labs will run.")
    elif warned:
        lines.append(f"Ready for the labs ({warned} note{'s' if warned != 1 else ''} above).")
    else:
        lines.append("Ready for the labs.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``distlab doctor [--no-launch]``: print the checks; exit status 1 when any failed."""
    parser = argparse.ArgumentParser(prog="distlab doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--no-launch", action="store_true", help="skip the check that starts two ranks")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    checks = run_doctor(launch=not args.no_launch)
    print(report(checks))
    return 1 if any(c.status == FAIL for c in checks) else 0


def _counts(items: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return counts


if __name__ == "__main__":
    sys.exit(main())
