"""The ``distlab`` command: build labs, execute and grade notebooks, check the machine, run the data pipeline."""

from __future__ import annotations

import argparse
import importlib
import json
import secrets
import sys
import time
from importlib import metadata
from pathlib import Path

import nbformat
from packaging.requirements import Requirement

from distlab import mutants
from distlab.grading.classroom import (
    DEFAULT_THRESHOLD,
    DEFAULT_TIMEOUT,
    InstallationChanged,
    NotebookGrade,
    class_report,
    format_report,
    grade_notebooks,
)
from distlab.grading.release import read_roster, read_secret, release
from distlab.grading.submissions import (
    collect,
    content_hash,
    parse_time,
    previous_grades,
    submission_times,
    write_csv,
    write_feedback,
    write_gradescope,
)
from distlab.mutants import MAX_PER_EXERCISE
from distlab.notebooks import REPO_ROOT, build_labs, execute, set_kernelspec, stale_kernelspecs, tag_grader_skips
from distlab.runtime.progress import progress as progress_bar

# Subcommands that own their argument parsing: name -> "module:function(argv) -> int".
DELEGATED = {"data": "distlab.data.cli:main", "doctor": "distlab.doctor:main"}
DELEGATED["plan"] = "distlab.torchrun:plan_main"  # the planner's layout as torchrun and SLURM lines


def _delegate(target: str, argv: list[str]) -> int:
    module, function = target.split(":")
    return int(getattr(importlib.import_module(module), function)(argv) or 0)


def _labs(args) -> int:
    stale = build_labs(Path(args.solutions), Path(args.labs), check_only=args.check)
    if args.check and stale:
        names = ", ".join(str(p) for p in stale)
        print(f"labs/ is out of sync with solutions/: {names}\nrun `make labs` (or `distlab labs`) and commit.")
        return 1
    respec = stale_kernelspecs(sorted(Path(args.solutions).glob("[0-9][0-9]_*.ipynb")))
    if args.check and respec:
        print(f"these solutions name another kernelspec than distlab.notebooks.KERNELSPEC: "
              f"{', '.join(map(str, respec))}\nrun `make labs` (`distlab notebooks tag` stores it) and commit.")
        return 1
    verb = "in sync" if args.check else f"rebuilt {len(stale)}"
    print(f"labs: {verb} ({len(list(Path(args.solutions).glob('[0-9][0-9]_*.ipynb')))} notebooks)")
    return 0


def _tag(args) -> int:
    """Keep each solution's ``grader-skips`` tags on exactly the cells no check needs, and its kernelspec the
    installed kernel's (``distlab.notebooks.KERNELSPEC``); with --check, only say."""
    stale = []
    for path in args.paths:
        notebook = nbformat.read(path, as_version=4)
        retagged = tag_grader_skips(notebook)
        if set_kernelspec(notebook) or retagged:
            stale.append(path)
            if not args.check:
                nbformat.write(notebook, path)
    if args.check and stale:
        print(f"grader-skips tags or the kernelspec are stale in {', '.join(stale)}: "
              f"run `distlab notebooks tag {' '.join(stale)}`")
        return 1
    print(f"grader-skips tags and kernelspec: {'updated in ' + str(len(stale)) if stale else 'current in all'} "
          f"of {len(args.paths)}")
    return 0


def _execute(args) -> int:
    for path in args.paths:
        print(f"executing {path} …", flush=True)
        nbformat.write(execute(Path(path), cell_timeout=args.timeout), path)
    return 0


def _mutants(args) -> int:
    """Mutation-test the checkers (:mod:`distlab.mutants`): resumable, one lab at a time."""
    if args.report_only:
        results = mutants.load_results()
        print(mutants.write_report(results, stale=mutants.stale_exercises(results)), end="")
        return 0
    labs = args.labs if args.labs is not None else sorted({int(p.name[:2]) for p in
                                                           (REPO_ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")})
    report = mutants.main_loop(labs, args.exercises, limit_per_exercise=args.max_per_exercise or None,
                               seed=args.seed, fresh=args.fresh)
    print(report, end="")
    return 0


def _grade(args) -> int:
    submissions = collect(args.paths)
    missing = [str(p) for p, _ in submissions if not p.is_file()]
    if missing or not submissions:
        print(f"distlab grade: no such notebook: {', '.join(missing) or ' '.join(args.paths)}"
              + _unmatched_pattern_hint(missing), file=sys.stderr)
        return 2
    if args.changed and not args.json:
        print("distlab grade: --changed needs --json FILE (the last report, which it reads and rewrites)",
              file=sys.stderr)
        return 2
    if args.times and not args.deadline:
        print("distlab grade: --times needs --deadline TIME (the submission times are read to flag late ones)",
              file=sys.stderr)
        return 2
    try:
        deadline = parse_time(args.deadline) if args.deadline else None
        times = submission_times([p for p, _ in submissions], [s for _, s in submissions], args.times) \
            if deadline else {}
    except ValueError as error:
        print(f"distlab grade: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # only --times is opened here: the notebooks were found above
        print(f"distlab grade: --times {args.times}: {error.strerror or error}", file=sys.stderr)
        return 2
    try:
        secret = read_secret(args.secret_file) if args.secret_file else None
    except ValueError as error:
        print(f"distlab grade: {error}", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else secrets.randbelow(10**9)  # fresh hidden cases per grading run
    started = time.perf_counter()

    previous = previous_grades(args.json) if args.changed else {}
    kept = [NotebookGrade(**{k: v for k, v in previous[(student, content_hash(path))].items()
                             if k in NotebookGrade.__dataclass_fields__ and k != "reused"}, reused=True)
            for path, student in submissions if (student, content_hash(path)) in previous]
    todo = [(path, student) for path, student in submissions if (student, content_hash(path)) not in previous]
    jobs = args.jobs or None
    print(f"grading {len(todo)} notebook(s){f' ({len(kept)} unchanged since the last report)' if kept else ''}, "
          f"{jobs or 'auto'} at a time, at most {args.timeout:g} s each …", file=sys.stderr, flush=True)
    # A bar of the notebooks (rate, ETA) on an instructor's terminal, each notebook's line printed above it;
    # where nobody watches (CI, a log file) only the lines.
    bar = progress_bar(total=len(todo), desc="grading", unit="notebook")

    def notebook_done(done: int, total: int, grade) -> None:
        note = f", {grade.error}" if grade.error else ""
        bar.write(f"[{done}/{total}] {grade.student}: {grade.points}/{grade.max_points} points, "
                  f"{grade.seconds:.0f} s{note}", file=sys.stderr)
        bar.update()

    try:
        grades = grade_notebooks([p for p, _ in todo], timeout=args.timeout, jobs=jobs, warm=not args.cold,
                                 progress=notebook_done, students=[s for _, s in todo], all_cells=args.all_cells,
                                 secret=secret, seed=seed) if todo else []
    except InstallationChanged as error:  # nothing is written: no grade of this run can be trusted
        print(f"distlab grade: {error}; reinstall (make install) and grade in a container or as a user of its "
              "own (course/instructor_guide.md)", file=sys.stderr)
        return 2
    finally:
        bar.close()
    for grade in grades + kept:
        if deadline is not None:
            grade.submitted = times[grade.student].isoformat()
            grade.late = times[grade.student] > deadline
    report = class_report(grades + kept, threshold=args.threshold, min_pass=args.min_pass)
    report["wall_seconds"] = round(time.perf_counter() - started, 1)
    report["deadline"] = deadline.isoformat() if deadline else None
    report["seed"] = seed
    print(format_report(report, answers=args.answers))
    print(f"hidden cases drawn with --seed {seed} (pass it to regrade on the same cases)")
    print(f"graded {len(grades)} in {report['wall_seconds']:.0f} s" + (f"; {len(kept)} unchanged" if kept else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    if args.csv:
        write_csv(report, args.csv)
    if args.gradescope:
        write_gradescope(report, args.gradescope)
    if args.feedback:
        write_feedback(report, args.feedback)
    return 0 if report["ok"] else 1


def _unmatched_pattern_hint(missing: list[str]) -> str:
    """What to pass instead when a shell pattern reached the grader unexpanded: it matched no file, typically
    ``submissions/*.ipynb`` in a class whose notebooks sit in one folder per student (``distlab release``'s
    layout), which the folder itself grades."""
    patterns = [m for m in missing if any(c in m for c in "*?[")]
    if not patterns:
        return ""
    folder = Path(patterns[0]).parent
    while any(c in str(folder) for c in "*?[") and folder != folder.parent:
        folder = folder.parent
    return (f" (the pattern matched no file; for one folder per student, as `distlab release` writes them, "
            f"pass the folder: distlab grade {folder}/)")


def _release(args) -> int:
    """Write one notebook per student and lab, its quiz asking that student's numbers (grading/release.py)."""
    students = (args.students or []) + (read_roster(args.roster) if args.roster else [])
    try:
        if not students:
            raise ValueError("name the students (--students NAME ..., or --roster FILE with one name a line)")
        written = release(args.paths, students, read_secret(args.secret_file), args.out)
    except (ValueError, OSError) as error:
        print(f"distlab release: {error}", file=sys.stderr)
        return 2
    print(f"released {len(args.paths)} notebook(s) to {len(students)} student(s): {len(written)} files under "
          f"{Path(args.out)}/; grade them with the same --secret-file")
    return 0


def _lock_drift(args) -> int:
    """Print every locked package whose installed version differs: what the next `make lock` would change.

    The lock is universal: a package may be pinned once per Python version or platform, each pin behind an
    environment marker. Only the pins whose marker holds here are compared.
    """
    drift = []
    for line in Path(args.lock).read_text(encoding="utf-8").splitlines():
        if not line or line[0] in "# -":
            continue
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue  # pinned for another Python or platform
        locked = next(iter(requirement.specifier)).version
        try:
            installed = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            continue
        if installed != locked:
            drift.append(f"  {requirement.name}: locked {locked}, newest allowed {installed}")
    print(f"{len(drift)} package(s) differ from {args.lock}" + (":" if drift else ""))
    if drift:
        print("\n".join(drift))
    return 0


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a fraction between 0 and 1, got {text}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="distlab", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    labs = sub.add_parser("labs", help="write labs/ from solutions/ (solution blocks → stubs, outputs cleared)")
    labs.add_argument("--solutions", default="solutions")
    labs.add_argument("--labs", default="labs")
    labs.add_argument("--check", action="store_true", help="only verify labs/ is up to date (exit 1 if not)")
    labs.set_defaults(run=_labs)

    notebooks = sub.add_parser("notebooks", help="maintainer tools for notebooks")
    nb_sub = notebooks.add_subparsers(dest="action", required=True)
    execute = nb_sub.add_parser("execute", help="execute notebooks in place (store fresh outputs)")
    execute.add_argument("paths", nargs="+")
    execute.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    execute.set_defaults(run=_execute)
    tag = nb_sub.add_parser("tag", help="tag grader-skips on the cells no check needs (then run distlab labs)")
    tag.add_argument("paths", nargs="+")
    tag.add_argument("--check", action="store_true", help="only report stale tags (exit status 1)")
    tag.set_defaults(run=_tag)
    mutants = nb_sub.add_parser("mutants", help="mutation-test the checkers on their exercises' reference solutions "
                                                "(results in benchmarks/results/mutants.json and .txt)")
    mutants.add_argument("--labs", nargs="+", type=int, metavar="NN", help="only these labs (default: every lab)")
    mutants.add_argument("--exercises", nargs="+", metavar="N.K", help="only these exercises (of the labs given)")
    mutants.add_argument("--max-per-exercise", type=int, default=MAX_PER_EXERCISE, metavar="N",
                         help=f"mutants per exercise, every operator kept (default {MAX_PER_EXERCISE}; 0: all)")
    mutants.add_argument("--seed", type=int, metavar="N", help="grade seed of the hidden cases (default: the "
                                                              "self-study seed)")
    mutants.add_argument("--fresh", action="store_true", help="forget the saved results of these labs and redo them")
    mutants.add_argument("--report-only", action="store_true", help="only rewrite mutants.txt from mutants.json")
    mutants.set_defaults(run=_mutants)

    grade = sub.add_parser("grade", help="execute student notebooks headless and report per student and exercise")
    grade.add_argument("paths", nargs="+", metavar="NOTEBOOK_OR_FOLDER",
                       help="notebooks, or folders of submissions (folder/<student>/*.ipynb or folder/<student>.ipynb)")
    grade.add_argument("--json", metavar="FILE", help="write the per-student and per-exercise report as JSON")
    grade.add_argument("--threshold", type=_fraction, default=DEFAULT_THRESHOLD,
                       help=f"fraction of its points a notebook needs to pass (default {DEFAULT_THRESHOLD:g})")
    grade.add_argument("--min-pass", type=int, metavar="N",
                       help="exit status 0 when at least N notebooks pass (default: all of them)")
    grade.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                       help=f"seconds per notebook; a notebook still running is stopped and reported "
                            f"(default {DEFAULT_TIMEOUT:g})")
    grade.add_argument("--jobs", type=int, default=0, help="notebooks at once (default: one per two CPU cores)")
    grade.add_argument("--deadline", metavar="TIME", help="ISO time (UTC unless it says); later submissions are "
                       "flagged late in the report and every export")
    grade.add_argument("--times", metavar="CSV", help="submission times (columns student,submitted) for --deadline; "
                       "default: each notebook file's modification time")
    grade.add_argument("--changed", action="store_true",
                       help="regrade only notebooks whose content differs from the --json report's; keep the rest")
    grade.add_argument("--csv", metavar="FILE", help="write one row per student, one column per exercise and question")
    grade.add_argument("--gradescope", metavar="DIR", help="write DIR/<notebook>/<student>/results.json (Gradescope)")
    grade.add_argument("--feedback", metavar="DIR", help="write DIR/<student>/<notebook>.md, each exercise's line")
    grade.add_argument("--all-cells", action="store_true",
                       help="run every cell, the demos and benchmark cells no check needs included (slower)")
    grade.add_argument("--answers", action="store_true",
                       help="show each failed quiz question's key in the report (for instructors, after the deadline)")
    grade.add_argument("--cold", action="store_true",
                       help="start every kernel from scratch instead of forking warm ones")
    grade.add_argument("--secret-file", metavar="FILE",
                       help="the course secret the notebooks were released with (distlab release): each student's "
                            "quiz numbers are derived from it and their name, and their answers marked here "
                            "(/dev/stdin reads it from standard input, so it is no file the notebooks could read)")
    grade.add_argument("--seed", type=int, metavar="N",
                       help="seed of the checks' hidden cases (default: a fresh one per run, printed and saved in "
                            "the report; pass it to regrade on the same cases)")
    grade.set_defaults(run=_grade)

    rel = sub.add_parser("release", help="write one notebook per student, its quiz asking that student's numbers")
    rel.add_argument("paths", nargs="+", metavar="NOTEBOOK", help="lab notebooks as handed out (labs/NN_*.ipynb)")
    rel.add_argument("--students", nargs="+", metavar="NAME", help="student names (their submission folders)")
    rel.add_argument("--roster", metavar="FILE", help="student names, one a line")
    rel.add_argument("--secret-file", required=True, metavar="FILE",
                     help="the course secret (make one: python -c \"import secrets; print(secrets.token_hex(32))\""
                          " > course.secret); keep it from students and grade with it")
    rel.add_argument("--out", default="release", metavar="DIR",
                     help="writes DIR/<student>/<notebook> (default: release)")
    rel.set_defaults(run=_release)

    drift = sub.add_parser("lock-drift", help="list installed packages whose versions differ from the lock")
    drift.add_argument("lock", nargs="?", default="requirements.lock")
    drift.set_defaults(run=_lock_drift)

    for name in DELEGATED:
        sub.add_parser(name, add_help=False, help=f"see `distlab {name} --help`")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in DELEGATED:
        return _delegate(DELEGATED[argv[0]], argv[1:])
    args = parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
