"""Grading a class: 30 student notebooks of a real lab, graded by ``distlab grade``, timed; where the time goes.

The class is generated from a lab's real notebooks (lab 00, or lab 03 with ``--lab 03``: DDP, whose solution
runs for minutes of demos and benchmarks, which the grader leaves out because no check needs them): *blank*
is the generated lab, *correct* the solution, *wrong* the solution with one exercise body or quiz answer
broken (lab 00: a sum not divided by the world size, a formula instead of the all-reduce, wrong quiz answers;
lab 03: gradients summed not averaged, buckets never flushed, wrong quiz answers), *deadlocked* a rank that
skips its collective (a hang the checker's collective timeout ends), and *looping* a notebook stuck in an
endless loop in a cell (only the per-notebook time limit ends it).

It first measures where a notebook's time goes, grading the blank lab alone with a fresh kernel and
with a kernel forked from the warm factory (kernel start, the imports of the first cell, the first
launch that starts the forkserver and the ranks), then grades the class with ``distlab grade`` as an
instructor would (warm kernels, as many notebooks at once as cores allow, each exercise graded apart
from the kernel in a process of its own: ``grading/isolation.py``) and checks that every notebook got
the result its kind should get. Results: ``benchmarks/results/grading.json`` and ``.txt``.

    python benchmarks/bench_grading.py                # ~10 minutes on 2 cores
    python benchmarks/bench_grading.py --lab 03       # the target: 30 lab-03 notebooks in 15 minutes on 2 cores
    python benchmarks/bench_grading.py --quick        # 6 notebooks, nothing saved
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
LABS = {"00": "00_setup.ipynb", "03": "03_ddp.ipynb"}
MIX = {"correct": 12, "blank": 8, "wrong": 6, "deadlocked": 2, "looping": 2}  # 30 notebooks
TIMEOUT = 120  # seconds per notebook: a looping notebook costs this much, alone
TARGET_S = {"03": 15 * 60}  # the target for a class of 30 on 2 cores

# Each lab's mistakes, as (old, new) edits of its solution: three wrong students, one deadlock, where to loop.
EDITS = {
    "00": {
        "wrong": [[("return total / dist.get_world_size()", "return total")],
                  [("dist.all_reduce(total)\n    return rank, world_size, total.item()",
                    "return rank, world_size, world_size * (world_size - 1) // 2")],
                  [("q0_1 = 3  # SOLUTION Q0.1", "q0_1 = 11  # SOLUTION Q0.1"),
                   ('q0_3 = "b"  # SOLUTION Q0.3', 'q0_3 = "a"  # SOLUTION Q0.3')]],
        "deadlocked": [("    dist.all_reduce(total)\n    return rank, world_size,",
                        "    if rank != 0:\n        dist.all_reduce(total)\n    return rank, world_size,")],
        "check": 'result = distlab.check("0.2", mean_across_ranks)',
        "first_exercise": "0.1",
    },
    "03": {
        "wrong": [[("        dist.all_reduce(p.grad)\n        p.grad /= world", "        dist.all_reduce(p.grad)")],
                  [("    if current:\n        buckets.append(current)\n    return buckets", "    return buckets")],
                  [("q3_1 = 24.5  # SOLUTION Q3.1", "q3_1 = 12.25  # SOLUTION Q3.1"),
                   ('q3_4 = "b"  # SOLUTION Q3.4', 'q3_4 = "a"  # SOLUTION Q3.4')]],
        "deadlocked": [("        dist.all_reduce(p.grad)\n        p.grad /= world",
                        "        if dist.get_rank() != 0:\n            dist.all_reduce(p.grad)\n"
                        "        p.grad /= world")],
        "check": 'distlab.check("3.1", broadcast_parameters, allreduce_gradients)',
        "first_exercise": "3.1",
    },
}


def _edit(nb, old: str, new: str):
    """A copy of ``nb`` with ``old`` replaced by ``new`` in the one code cell that has it."""
    copy = nbformat.from_dict(json.loads(json.dumps(nb)))
    hits = [c for c in copy.cells if c.cell_type == "code" and old in c.source]
    assert len(hits) == 1, old
    hits[0].source = hits[0].source.replace(old, new)
    return copy


def _edits(nb, edits):
    for old, new in edits:
        nb = _edit(nb, old, new)
    return nb


def build_class(folder: Path, mix: dict, lab: str) -> dict[str, str]:
    """Write ``folder/<student>/<lab notebook>`` for each student; return student -> kind."""
    solution = nbformat.read(REPO / "solutions" / LABS[lab], as_version=4)
    edits = EDITS[lab]
    wrongs = [_edits(solution, e) for e in edits["wrong"]]
    makers = {
        "correct": lambda i: solution,
        "blank": lambda i: make_lab(solution),
        "wrong": lambda i: wrongs[i % len(wrongs)],
        "deadlocked": lambda i: _edits(solution, edits["deadlocked"]),
        "looping": lambda i: _edit(solution, edits["check"], "while True:  # the student's endless loop\n"
                                                              "    pass\n" + edits["check"]),
    }
    kinds = {}
    for kind, count in mix.items():
        for i in range(count):
            student = f"s{len(kinds) + 1:02d}-{kind}"
            (folder / student).mkdir(parents=True)
            nbformat.write(makers[kind](i), folder / student / LABS[lab])
            kinds[student] = kind
    return kinds


def _expected(kind: str, notebook: dict, first_exercise: str) -> bool:
    status = {e["id"]: e["status"] for e in notebook["exercises"]}
    if kind == "correct":
        return notebook["passed"] and not notebook["error"]
    if kind == "blank":
        return set(status.values()) == {"not attempted"} and not notebook["error"]
    if kind == "wrong":
        return not notebook["passed"] and "failed" in status.values() and not notebook["error"]
    if kind == "deadlocked":
        return status[first_exercise] == "failed" and not notebook["error"]
    return bool(notebook["error"]) and "time limit" in notebook["error"]  # looping


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one notebook of each kind and a short limit; saves nothing")
    p.add_argument("--jobs", type=int, default=0, help="notebooks at once (default: distlab grade's choice)")
    p.add_argument("--lab", choices=sorted(LABS), default="00", help="whose notebooks make up the class")
    args = p.parse_args(argv)
    lab, name = args.lab, LABS[args.lab]
    load_before = os.getloadavg()[0]  # a busy machine slows every notebook: recorded beside the time
    mix = {kind: 1 for kind in MIX} | {"correct": 2} if args.quick else MIX
    timeout = 60 if args.quick else TIMEOUT
    out = []
    with tempfile.TemporaryDirectory(prefix="distlab-class-") as tmp:
        tmp = Path(tmp)
        blank = tmp / "alone" / name
        blank.parent.mkdir()
        nbformat.write(make_lab(nbformat.read(REPO / "solutions" / name, as_version=4)), blank)
        where = {}
        for mode, warm in (("fresh kernel", False), ("warm kernel", True)):
            started = time.perf_counter()
            grade, = grade_notebooks([blank], timeout=timeout, warm=warm)
            where[mode] = {"wall_s": time.perf_counter() - started, "notebook_s": grade.seconds,
                           "startup_s": grade.startup, "slowest_cells": grade.slowest_cells}
            out.append(f"blank lab {lab} alone, {mode}: {grade.seconds:.1f} s in the notebook (kernel start "
                       f"{grade.startup:.1f} s; "
                       f"slowest cells {', '.join(f'{c}: {s:.1f} s' for c, s in grade.slowest_cells)})"
                       f"; {where[mode]['wall_s']:.1f} s with the grader's own start")
            print(out[-1], flush=True)
        kinds = build_class(tmp / "class", mix, lab)
        paths = sorted(str(p) for p in (tmp / "class").glob(f"*/{name}"))
        command = [sys.executable, "-m", "distlab", "grade", *paths, "--timeout", str(timeout),
                   "--json", str(tmp / "class.json")] + (["--jobs", str(args.jobs)] if args.jobs else [])
        started = time.perf_counter()
        run = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
        wall = time.perf_counter() - started
        report = json.loads((tmp / "class.json").read_text())
    wrong = [n["student"] for n in report["notebooks"]
             if not _expected(kinds[n["student"]], n, EDITS[lab]["first_exercise"])]
    per_kind = {kind: statistics.median(n["seconds"] for n in report["notebooks"] if kinds[n["student"]] == kind)
                for kind in mix}
    cpus = results.machine()["cpus"]
    jobs = args.jobs or max(1, min(len(paths), cpus // 2))
    out.append(f"class of {len(paths)} lab {lab} notebooks ({', '.join(f'{v} {k}' for k, v in mix.items())}), "
               f"limit {timeout} s each, {jobs} at a time on {cpus} cores: graded in {wall:.0f} s "
               f"({wall / 60:.1f} min), {report['notebooks_passed']} passed, exit status {run.returncode}")
    out.append("median seconds per notebook: " + ", ".join(f"{k} {v:.0f}" for k, v in per_kind.items()))
    apart = {kind: statistics.median(n["graded_seconds"] for n in report["notebooks"] if kinds[n["student"]] == kind)
             for kind in mix}
    out.append("of which grading its exercises apart from the kernel (median): "
               + ", ".join(f"{k} {v:.0f}" for k, v in apart.items()))
    out.append("every notebook got the result of its kind" if not wrong else f"UNEXPECTED results: {wrong}")
    skipped = statistics.median(n["skipped_cells"] for n in report["notebooks"])
    out.append(f"cells no check needs, left out per notebook (median): {skipped:.0f}")
    if lab in TARGET_S:
        met = wall <= TARGET_S[lab]
        out.append(f"target: a class of 30 in {TARGET_S[lab] / 60:.0f} min on 2 cores; here {wall / 60:.1f} min on "
                   f"{cpus} cores, load average {load_before:.1f} at the start: {'met' if met else 'missed'}")
    print("\n".join(out[2:]))
    if not args.quick:
        data = {"where_the_time_goes": where, "class_wall_s": wall, "notebooks": len(paths), "mix": mix,
                "timeout_s": timeout, "jobs": jobs, "median_s_by_kind": per_kind, "median_apart_s_by_kind": apart,
                "passed": report["notebooks_passed"], "exit_status": run.returncode, "all_as_expected": not wrong}
        data["ran_on"] = f"{len(os.sched_getaffinity(0))} CPU cores (CPU kernels and gloo ranks)"
        data.update(lab=lab, load_average_at_start=load_before,
                    median_skipped_cells=skipped, target_s=TARGET_S.get(lab))
        print(f"saved {results.save('grading' if lab == '00' else f'grading_lab{lab}', data, chr(10).join(out))}")
    return 0 if not wrong else 1


if __name__ == "__main__":
    sys.exit(main())
