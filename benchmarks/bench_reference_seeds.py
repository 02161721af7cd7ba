"""Every exercise's reference solution under 50 grading seeds: a grader must pass a right answer on every seed.

``distlab grade`` draws a fresh seed per grading run for the hidden cases (``harness.lab_seed``), so a check whose
tolerance or hint holds on the self-study seed but not on another fails correct students at random, and a regrade
changes marks (issue 44: 5.5 failed its own reference on 5 of 11 seeds, a loss of 128 held to 1e-5). This sweep
checks the solution notebook's own answers (``distlab.mutants.reference_namespace``: what a kernel holds after
running the solution) against every exercise's checker under the seeds below, each lab in a process of its own
with warm ranks, and records every failure with its message, and every seed whose hidden cases missed a boundary
the exercise's text names (its lab's ``EDGES``). ``make test`` adds one more seed per exercise
(``tests/grading/test_reference_seeds.py``), so every exercise is graded on 51 seeds in all, the self-study seed
of its lab's own tests besides.

    python benchmarks/bench_reference_seeds.py               # every lab, resumable (hours on 2 loaded cores)
    python benchmarks/bench_reference_seeds.py --labs 05 --seeds 5

Results: ``benchmarks/results/reference_seeds.json`` (each exercise's seeds, status, seconds, failures) and
``.txt``; saved after every exercise, so an interrupted sweep resumes where it stopped.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import time

from distlab import mutants, results
from distlab.grading.harness import GRADE_SEED_VARIABLE, cases_drawn, uncovered
from distlab.notebooks import REPO_ROOT

TOPIC = "reference_seeds"
# The grader's seeds are secrets.randbelow(10**9): the sweep's are 50 such numbers, fixed so a rerun repeats them.
SEEDS = random.Random(44).sample(range(10**9), 50)


def sweep_lab(lab: int, seeds: list[int], done: dict, save) -> None:
    """In a process of its own: every exercise of lab ``lab`` under ``seeds``; ``done`` holds what a previous run
    finished (skipped), ``save(done)`` is called after each exercise."""
    import distlab  # noqa: PLC0415  in the lab's forked process, imported already

    source = mutants.lab_source(lab)
    namespace, _ = mutants.reference_namespace(source)
    mutants.check_threads()  # this process forks nothing that computes: it may use torch's threads
    edges = getattr(importlib.import_module(f"distlab.grading.lab{lab:02d}"), "EDGES", {})
    for exercise in sorted(source.answers, key=lambda e: int(e.split(".")[1])):
        entry = done.get(exercise, {"seeds": {}})
        todo = [seed for seed in seeds if str(seed) not in entry["seeds"]]
        for seed in todo:
            os.environ[GRADE_SEED_VARIABLE] = str(seed)
            args = [eval(expression, namespace) for expression in source.check_args[exercise]]  # noqa: S307
            cases_drawn(exercise, clear=True)
            started = time.monotonic()
            result = distlab.check(exercise, *args, quiet=True)
            missed = uncovered(edges.get(exercise, []), cases_drawn(exercise))
            entry["seeds"][str(seed)] = {"status": result.status, "seconds": round(time.monotonic() - started, 2),
                                         **({"detail": result.detail} if result.status != "passed" else {}),
                                         **({"edges missed": missed} if missed else {})}
        done[exercise] = entry
        save(done)


def summary(done: dict, seeds: list[int]) -> str:
    lines = [f"Each exercise's reference solution (the solution notebook's code) checked under {len(seeds)} grading "
             "seeds (benchmarks/bench_reference_seeds.py); 'edges' counts the seeds whose hidden cases sat on every "
             "boundary the exercise's text names (its lab's EDGES; - where the lab lists none).", "",
             f"{'exercise':<9} {'seeds':>5} {'passed':>6} {'edges':>5} {'median s':>8}  failures"]
    total = passed = 0
    for exercise in sorted(done, key=lambda e: tuple(int(p) for p in e.split("."))):
        runs = done[exercise]["seeds"]
        ok = sum(r["status"] == "passed" for r in runs.values())
        covered = sum("edges missed" not in r for r in runs.values())
        listed = getattr(importlib.import_module(f"distlab.grading.lab{int(exercise.split('.')[0]):02d}"), "EDGES",
                         {}).get(exercise)
        times = sorted(r["seconds"] for r in runs.values())
        failures = "; ".join(f"seed {s}: {r['status']} {r.get('detail', '')[:160]}" for s, r in runs.items()
                             if r["status"] != "passed")
        failures += "; ".join(f"seed {s}: no case on {r['edges missed']}" for s, r in runs.items()
                              if "edges missed" in r)
        lines.append(f"{exercise:<9} {len(runs):>5} {ok:>6} {covered if listed else '-':>5} "
                     f"{times[len(times) // 2]:>8.2f}  {failures or '-'}")
        total += len(runs)
        passed += ok
    lines += ["", f"{len(done)} exercises x seeds: {total} checks, {passed} passed, {total - passed} failed"]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--labs", nargs="+", type=int, help="only these labs (default: every lab)")
    parser.add_argument("--seeds", type=int, default=len(SEEDS), help="the first N of the sweep's seeds")
    parser.add_argument("--fresh", action="store_true", help="forget saved results and start over")
    args = parser.parse_args()
    seeds = SEEDS[: args.seeds]
    labs = args.labs if args.labs is not None else sorted({int(p.name[:2]) for p in
                                                           (REPO_ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")})
    path = results.RESULTS_DIR / f"{TOPIC}.json"
    saved = {} if args.fresh or not path.exists() else json.loads(path.read_text(encoding="utf-8"))
    done = saved.get("exercises", {})
    mutants.prepare_forks(labs)

    def save(progress: dict) -> None:
        results.save(TOPIC, {"seeds": seeds, "exercises": progress}, summary(progress, seeds))

    for lab in labs:
        started = time.monotonic()
        mine = {e: entry for e, entry in done.items() if int(e.split(".")[0]) == lab}

        def job(lab=lab, mine=mine) -> dict:
            sweep_lab(lab, seeds, mine, lambda progress: save({**done, **progress}))
            return {"status": "done", "detail": ""}

        outcome, _ = mutants.in_fork(job, float("inf"))
        saved = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        done = saved.get("exercises", done)
        print(f"lab {lab:02d}: {outcome['status'] if outcome else 'stopped'}"
              f"{' ' + outcome['detail'] if outcome and outcome['detail'] else ''} "
              f"in {time.monotonic() - started:.0f} s", flush=True)
    save(done)
    print(summary(done, seeds))
    failed = sum(r["status"] != "passed" or "edges missed" in r for entry in done.values()
                 for r in entry["seeds"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
