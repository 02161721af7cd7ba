"""Benchmark results that notebooks load instead of re-measuring.

A lab's heavy measurement (a sweep, a training run, a side-by-side timing against
PyTorch) runs in ``benchmarks/bench_<topic>.py``, which calls :func:`save` once: the
figures go to ``benchmarks/results/<topic>.json`` (with the machine they were measured
on) and the printed summary to ``<topic>.txt``. The notebook calls :func:`load` and plots
or quotes them, so nbval stays fast and the numbers on screen are the benchmark's own.

A timing means something only if the ranks had the cores they would have on a real machine. So a saved result
records the machine's load when it was saved and, where the benchmark says, its ranks and threads per rank;
:func:`faithfulness` judges it by one rule, and a notebook puts :func:`title` on a figure of it, which says
"not faithful" and why instead of letting the plot draw conclusions.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path

import torch

__all__ = ["RESULTS_DIR", "machine", "save", "load", "describe", "faithfulness", "title"]

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
    if hasattr(os, "getloadavg"):  # the last minute's load: it covers the end of the run that is being saved
        info["load_average"] = round(os.getloadavg()[0], 2)
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def save(topic: str, data: dict, summary: str, directory: Path | None = None, *, ranks: int | None = None,
         threads_per_rank: int | None = None) -> Path:
    """Write ``<topic>.json`` (``data`` plus ``machine``) and ``<topic>.txt`` (``summary``).

    ``ranks`` (the most ranks that ran at once) and ``threads_per_rank`` (their intra-op threads) go into
    ``machine`` beside the cores and the load, for :func:`faithfulness`.
    """
    directory = Path(directory or RESULTS_DIR)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{topic}.json"
    conditions = machine()
    if ranks is not None:
        conditions["ranks"] = ranks
        conditions["cores_per_rank"] = round(conditions["cpus"] / ranks, 2)
    if threads_per_rank is not None:
        conditions["threads_per_rank"] = threads_per_rank
    path.write_text(json.dumps(dict(data, machine=conditions), indent=1, sort_keys=True) + "\n", encoding="utf-8")
    (directory / f"{topic}.txt").write_text(summary.rstrip() + "\n", encoding="utf-8")
    return path


def load(topic: str, directory: Path | None = None) -> dict:
    """The saved results of ``benchmarks/bench_<topic>.py``; a clear error says how to make them."""
    path = Path(directory or RESULTS_DIR) / f"{topic}.json"
    if not path.exists():
        raise FileNotFoundError(f"no saved results at {path}: run `python benchmarks/bench_{topic}.py` to measure them")
    return json.loads(path.read_text(encoding="utf-8"))


BUSY_LOAD = 1.5  # load average per core (or per rank, if more ranks than cores) above which a machine is busy


def faithfulness(results: dict) -> tuple[bool, str]:
    """Whether a saved result's timings can be trusted, and why not: one rule for every benchmark.

    Not faithful when the benchmark said so itself (``"faithful": False``, its reason in ``unfaithful_reason``, or
    ``False`` for some configurations in a ``{configuration: bool}`` map),
    when its ranks outnumbered the cores (they took turns, which no real group of GPUs does), or when the machine
    was busy: a load average above :data:`BUSY_LOAD` per core, counting the benchmark's own ranks as expected load.
    GPU results are judged by the first rule only (their ranks do not share CPU cores for the work).
    """
    m = results.get("machine", {})
    reasons = []
    marked = results.get("faithful")
    if marked is False:
        reasons.append(results.get("unfaithful_reason") or "the benchmark marked it not faithful")
    elif isinstance(marked, dict) and not all(marked.values()):  # per configuration, e.g. per TP degree
        reasons.append(f"its runs at {', '.join(str(k) for k, ok in marked.items() if not ok)} had more ranks "
                       f"than cores")
    if not m.get("gpus"):
        cpus, ranks = m.get("cpus"), m.get("ranks")
        if cpus and ranks and ranks > cpus and not isinstance(marked, dict):  # a map already named the runs
            reasons.append(f"{ranks} ranks on {cpus} cores took turns")
        # a load the benchmark measured during its run, else the machine's when the file was saved
        load = results.get("load_average", m.get("load_average"))
        if cpus and load is not None and load > BUSY_LOAD * max(cpus, ranks or 0):
            reasons.append(f"the machine was busy (load average {load:.1f} on {cpus} cores)")
    return (not reasons, "; ".join(dict.fromkeys(reasons)))


def title(results: dict, text: str) -> str:
    """A figure title for a plot of saved results: ``text``, and on a second line why the timings are not
    faithful when they are not, so the figure itself carries the warning."""
    faithful, why = faithfulness(results)
    return text if faithful else f"{text}\nnot faithful: {why}"


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
    per_rank = ""
    if m.get("ranks") and m.get("threads_per_rank"):
        per_rank = f", {m['ranks']} ranks × {m['threads_per_rank']} thread(s)"
    faithful, why = faithfulness(results)
    return (f"measured by the benchmark on {where}{per_rank}, torch {m.get('torch', '?')}, {m.get('date', '?')}"
            + ("" if faithful else f"; not faithful: {why}"))
