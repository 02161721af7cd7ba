"""Install torch into the course's environment, choosing the build this machine needs (run by ``make install``).

Why a choice at all: on Linux, PyPI's torch wheel is the CUDA build. ``pip install torch==2.13.0`` there fetches a
~530 MB wheel that requires ``cuda-toolkit``, ``nvidia-cudnn-cu13``, ``nvidia-nccl-cu13``, … (gigabytes) — on a
laptop with no NVIDIA GPU, for nothing: its ranks run gloo on the CPU. PyTorch publishes CPU-only wheels on its
own index (https://download.pytorch.org/whl/cpu, the command pytorch.org's "Get Started" page gives for
"Compute Platform: CPU"). So:

* torch already importable (Colab, Kaggle, a conda env, a cluster's module): nothing is installed, ever.
* Linux (WSL included) with an NVIDIA GPU (``nvidia-smi -L`` lists one): PyPI's wheel, the CUDA build, which the
  NCCL ranks need.
* Linux without one: the CPU wheel from PyTorch's CPU index; when that index cannot be reached (no route, a
  mirror-only network, a firewall) within a few seconds, PyPI's wheel instead, saying so.
* macOS (and anything else): PyPI's wheel, which is the CPU/MPS build there.

In every case the course's pin is tried first and ``torch>=2.8`` (what the course supports) where no wheel of
the pin exists for this Python. ``--dry-run`` prints the choice and the pip commands without running them.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import urllib.error
import urllib.request

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
SUPPORTED = "torch>=2.8"
PROBE_SECONDS = 5.0


def has_nvidia_gpu() -> bool:
    """An NVIDIA GPU with a working driver: ``nvidia-smi -L`` lists at least one (on WSL too, where the Windows
    driver provides it)."""
    tool = shutil.which("nvidia-smi") or ("/usr/lib/wsl/lib/nvidia-smi"
                                          if os.path.exists("/usr/lib/wsl/lib/nvidia-smi") else None)
    if tool is None:
        return False
    try:
        listed = subprocess.run([tool, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return listed.returncode == 0 and "GPU" in listed.stdout


def reachable(index: str, seconds: float = PROBE_SECONDS) -> bool:
    """Whether the index answers torch's page within ``seconds`` (pip itself would wait minutes, retrying)."""
    try:
        with urllib.request.urlopen(f"{index.rstrip('/')}/torch/", timeout=seconds) as response:
            return response.status < 400
    except (urllib.error.URLError, OSError, ValueError):
        return False


def choose(system: str, gpu: bool, index_reachable: bool | None, index: str = CPU_INDEX) -> tuple[list[str], str]:
    """pip's extra arguments for torch on this machine (``[]``: PyPI, the default) and the reason, in one line.

    ``index_reachable`` is only asked for where it matters (Linux without a GPU); pass ``None`` elsewhere."""
    if system != "Linux":
        return [], f"{system}: PyPI's wheel, which has no CUDA there (on Apple silicon it runs on MPS or the CPU)"
    if gpu:
        return [], "an NVIDIA GPU is present: PyPI's wheel, the CUDA build the NCCL ranks need"
    if index_reachable:
        return ["--index-url", index], f"no NVIDIA GPU: the CPU-only wheel from {index}"
    return [], (f"no NVIDIA GPU, but {index} cannot be reached: PyPI's wheel instead (on Linux the CUDA build, "
                "several GB, unless pip is configured to take torch from elsewhere)")


def commands(python: str, pin: str, extra: list[str]) -> list[list[str]]:
    """The pip commands to try in turn: the pin, then any torch the course supports."""
    return [[python, "-m", "pip", "install", "-q", *extra, requirement] for requirement in (pin, SUPPORTED)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pin", help='the course\'s torch, e.g. "torch==2.13.0"')
    parser.add_argument("--python", default=sys.executable, help="the environment's interpreter")
    parser.add_argument("--index", default=os.environ.get("TORCH_CPU_INDEX", CPU_INDEX),
                        help="PyTorch's CPU wheel index (default: %(default)s)")
    parser.add_argument("--dry-run", action="store_true", help="print the choice and the commands; install nothing")
    args = parser.parse_args(argv)
    if subprocess.run([args.python, "-c", "import torch"], capture_output=True).returncode == 0:
        print("torch: already installed here; left as it is")
        return 0
    system, gpu = platform.system(), has_nvidia_gpu()
    index_ok = reachable(args.index) if system == "Linux" and not gpu else None
    extra, reason = choose(system, gpu, index_ok, args.index)
    tries = commands(args.python, args.pin, extra)
    if extra:  # the CPU index failed after answering: PyPI as the last resort
        tries += commands(args.python, args.pin, [])
    print(f"torch: {reason}")
    for command in tries:
        if args.dry_run:
            print("would run: " + " ".join(command))
        elif subprocess.run(command).returncode == 0:
            return 0
    return 0 if args.dry_run else 1


if __name__ == "__main__":
    sys.exit(main())
