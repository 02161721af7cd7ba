"""Grading a class: 30 student notebooks of a real lab, graded by ``distlab grade``, timed; where the time goes.

The class is generated from lab 00's real notebooks: *blank* is the generated lab, *correct* the
solution, *wrong* the solution with one exercise body or quiz answer broken (a sum not divided by the
world size, a formula instead of the all-reduce, wrong quiz answers), *deadlocked* a rank_sum where rank 0
skips the all-reduce (a hang in a collective: the checker's collective timeout ends it), and *looping*
a notebook stuck in an endless loop in a cell (only the per-notebook time limit ends it).

It first measures where a notebook's time goes, grading the blank lab alone with a fresh kernel and
with a kernel forked from the warm factory (kernel start, the imports of the first cell, the first
launch that starts the forkserver and the ranks), then grades the class with ``distlab grade`` as an
instructor would (warm kernels, as many notebooks at once as cores allow) and checks that every
notebook got the result its kind should get. Results: ``benchmarks/results/grading.json`` and ``.txt``.

    python benchmarks/bench_grading.py            # ~10 minutes on 2 cores
    python benchmarks/bench_grading.py --quick    # 6 notebooks, nothing saved
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat

from distlab import results
from distlab.grading.classroom import grade_notebooks
from distlab.notebooks import make_lab

REPO = Path(__file__).resolve().parents[1]
LAB = "00_setup.ipynb"
MIX = {"correct": 12, "blank": 8, "wrong": 6, "deadlocked": 2, "looping": 2}  # 30 notebooks
TIMEOUT = 120  # seconds per notebook: a looping notebook costs this much, alone


def _edit(nb, old: str, new: str):
    """A copy of ``nb`` with ``old`` replaced by ``new`` in the one code cell that has it."""
    copy = nbformat.from_dict(json.loads(json.dumps(nb)))
    hits = [c for c in copy.cells if c.cell_type == "code" and old in c.source]
    assert len(hits) == 1, old
    hits[0].source = hits[0].source.replace(old, new)
    return copy


def build_class(folder: Path, mix: dict) -> dict[str, str]:
    """Write ``folder/<student>/00_setup.ipynb`` for each student; return student -> kind."""
    solution = nbformat.read(REPO / "solutions" / LAB, as_version=4)
    wrongs = [_edit(solution, "return total / dist.get_world_size()", "return total"),
              _edit(solution, "dist.all_reduce(total)\n    return rank, world_size, total.item()",
                    "return rank, world_size, world_size * (world_size - 1) // 2"),
              _edit(_edit(solution, "q0_1 = 3  # SOLUTION Q0.1", "q0_1 = 11  # SOLUTION Q0.1"),
                    'q0_3 = "b"  # SOLUTION Q0.3', 'q0_3 = "a"  # SOLUTION Q0.3')]
    makers = {
        "correct": lambda i: solution,
        "blank": lambda i: make_lab(solution),
        "wrong": lambda i: wrongs[i % len(wrongs)],
        "deadlocked": lambda i: _edit(solution, "    dist.all_reduce(total)\n    return rank, world_size,",
                                      "    if rank != 0:\n        dist.all_reduce(total)\n"
                                      "    return rank, world_size,"),
        "looping": lambda i: _edit(solution, 'result = distlab.check("0.2", mean_across_ranks)',
                                   'while True:  # the student\'s endless loop\n    pass\n'
                                   'result = distlab.check("0.2", mean_across_ranks)'),
    }
    kinds = {}
    for kind, count in mix.items():
        for i in range(count):
            student = f"s{len(kinds) + 1:02d}-{kind}"
            (folder / student).mkdir(parents=True)
            nbformat.write(makers[kind](i), folder / student / LAB)
            kinds[student] = kind
    return kinds


def _expected(kind: str, notebook: dict) -> bool:
    status = {e["id"]: e["status"] for e in notebook["exercises"]}
    if kind == "correct":
        return notebook["passed"] and not notebook["error"]
    if kind == "blank":
        return set(status.values()) == {"not attempted"} and not notebook["error"]
    if kind == "wrong":
        return not notebook["passed"] and "failed" in status.values() and not notebook["error"]
    if kind == "deadlocked":
        return status["0.1"] == "failed" and not notebook["error"]
    return bool(notebook["error"]) and "time limit" in notebook["error"]  # looping


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one notebook of each kind and a short limit; saves nothing")
    p.add_argument("--jobs", type=int, default=0, help="notebooks at once (default: distlab grade's choice)")
    args = p.parse_args(argv)
    mix = {kind: 1 for kind in MIX} | {"correct": 2} if args.quick else MIX
    timeout = 60 if args.quick else TIMEOUT
    out = []
    with tempfile.TemporaryDirectory(prefix="distlab-class-") as tmp:
        tmp = Path(tmp)
        blank = tmp / "alone" / LAB
        blank.parent.mkdir()
        nbformat.write(make_lab(nbformat.read(REPO / "solutions" / LAB, as_version=4)), blank)
        where = {}
        for mode, warm in (("fresh kernel", False), ("warm kernel", True)):
            started = time.perf_counter()
            grade, = grade_notebooks([blank], timeout=timeout, warm=warm)
            where[mode] = {"wall_s": time.perf_counter() - started, "notebook_s": grade.seconds,
                           "startup_s": grade.startup, "slowest_cells": grade.slowest_cells}
            out.append(f"blank lab 00 alone, {mode}: {grade.seconds:.1f} s in the notebook (kernel start "
                       f"{grade.startup:.1f} s; "
                       f"slowest cells {', '.join(f'{c}: {s:.1f} s' for c, s in grade.slowest_cells)})"
                       f"; {where[mode]['wall_s']:.1f} s with the grader's own start")
            print(out[-1], flush=True)
        kinds = build_class(tmp / "class", mix)
        paths = sorted(str(p) for p in (tmp / "class").glob(f"*/{LAB}"))
        command = [sys.executable, "-m", "distlab", "grade", *paths, "--timeout", str(timeout),
                   "--json", str(tmp / "class.json")] + (["--jobs", str(args.jobs)] if args.jobs else [])
        started = time.perf_counter()
        run = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
        wall = time.perf_counter() - started
        report = json.loads((tmp / "class.json").read_text())
    wrong = [n["student"] for n in report["notebooks"] if not _expected(kinds[n["student"]], n)]
    per_kind = {kind: statistics.median(n["seconds"] for n in report["notebooks"] if kinds[n["student"]] == kind)
                for kind in mix}
    cpus = results.machine()["cpus"]
    jobs = args.jobs or max(1, min(len(paths), cpus // 2))
    out.append(f"class of {len(paths)} lab 00 notebooks ({', '.join(f'{v} {k}' for k, v in mix.items())}), "
               f"limit {timeout} s each, {jobs} at a time on {cpus} cores: graded in {wall:.0f} s "
               f"({wall / 60:.1f} min), {report['notebooks_passed']} passed, exit status {run.returncode}")
    out.append("median seconds per notebook: " + ", ".join(f"{k} {v:.0f}" for k, v in per_kind.items()))
    out.append("every notebook got the result of its kind" if not wrong else f"UNEXPECTED results: {wrong}")
    print("\n".join(out[2:]))
    if not args.quick:
        data = {"where_the_time_goes": where, "class_wall_s": wall, "notebooks": len(paths), "mix": mix,
                "timeout_s": timeout, "jobs": jobs, "median_s_by_kind": per_kind,
                "passed": report["notebooks_passed"], "exit_status": run.returncode, "all_as_expected": not wrong}
        data["ran_on"] = f"{len(os.sched_getaffinity(0))} CPU cores (CPU kernels and gloo ranks)"
        print(f"saved {results.save('grading', data, chr(10).join(out))}")
    return 0 if not wrong else 1


if __name__ == "__main__":
    sys.exit(main())
