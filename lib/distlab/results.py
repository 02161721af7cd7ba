"""Benchmark results that notebooks load instead of re-measuring.

A lab's heavy measurement (a sweep, a training run, a side-by-side timing against
PyTorch) runs in ``benchmarks/bench_<topic>.py``, which calls :func:`save` once: the
figures go to ``benchmarks/results/<topic>.json`` (with the machine they were measured
on) and the printed summary to ``<topic>.txt``. The notebook calls :func:`load` and plots
or quotes them, so nbval stays fast and the numbers on screen are the benchmark's own.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path

import torch

__all__ = ["RESULTS_DIR", "machine", "save", "load", "describe"]

RESULTS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def machine() -> dict:
    """What the figures were measured on: enough to tell a laptop from a GPU node."""
    info = {
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def save(topic: str, data: dict, summary: str, directory: Path | None = None) -> Path:
    """Write ``<topic>.json`` (``data`` plus ``machine``) and ``<topic>.txt`` (``summary``)."""
    directory = Path(directory or RESULTS_DIR)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{topic}.json"
    path.write_text(json.dumps(dict(data, machine=machine()), indent=1, sort_keys=True) + "\n", encoding="utf-8")
    (directory / f"{topic}.txt").write_text(summary.rstrip() + "\n", encoding="utf-8")
    return path


def load(topic: str, directory: Path | None = None) -> dict:
    """The saved results of ``benchmarks/bench_<topic>.py``; a clear error says how to make them."""
    path = Path(directory or RESULTS_DIR) / f"{topic}.json"
    if not path.exists():
        raise FileNotFoundError(f"no saved results at {path}: run `python benchmarks/bench_{topic}.py` to measure them")
    return json.loads(path.read_text(encoding="utf-8"))


def describe(results: dict) -> str:
    """One line naming the machine a result came from, for the notebook to print beside it.

    A benchmark that ran CPU ranks on a machine that also has GPUs saves ``ran_on`` (e.g. "16 CPU
    cores, gloo ranks") so the line names what it measured, not the hardware it ignored.
    """
    m = results.get("machine", {})
    if results.get("ran_on"):
        where = results["ran_on"]
    elif m.get("gpus"):
        where = ", ".join(m["gpus"])
    else:
        where = f"{m.get('cpus', '?')} CPU cores ({m.get('processor', '?')})"
    return f"measured by the benchmark on {where}, torch {m.get('torch', '?')}, {m.get('date', '?')}"
