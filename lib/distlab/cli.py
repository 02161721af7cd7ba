"""The ``distlab`` command: build labs, execute and grade notebooks, check the machine, run the data pipeline."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

# Subcommands that own their argument parsing: name -> "module:function(argv) -> int".
DELEGATED = {"data": "distlab.data.cli:main", "doctor": "distlab.doctor:main"}


def _delegate(target: str, argv: list[str]) -> int:
    module, function = target.split(":")
    return int(getattr(importlib.import_module(module), function)(argv) or 0)


def _labs(args) -> int:
    from distlab.notebooks import build_labs

    stale = build_labs(Path(args.solutions), Path(args.labs), check_only=args.check)
    if args.check and stale:
        names = ", ".join(str(p) for p in stale)
        print(f"labs/ is out of sync with solutions/: {names}\nrun `make labs` (or `distlab labs`) and commit.")
        return 1
    verb = "in sync" if args.check else f"rebuilt {len(stale)}"
    print(f"labs: {verb} ({len(list(Path(args.solutions).glob('[0-9][0-9]_*.ipynb')))} notebooks)")
    return 0


def _execute(args) -> int:
    import nbformat

    from distlab.notebooks import execute

    for path in args.paths:
        print(f"executing {path} …", flush=True)
        nbformat.write(execute(Path(path), cell_timeout=args.timeout), path)
    return 0


def _grade(args) -> int:
    from distlab.notebooks import format_grades, grade_notebook, grades_json

    grades = []
    for path in args.paths:
        print(f"grading {path} …", file=sys.stderr, flush=True)
        grades.append(grade_notebook(Path(path), cell_timeout=args.timeout))
    print(format_grades(grades))
    report = grades_json(grades)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    met = report["fraction"] >= args.threshold
    print(f"threshold {args.threshold:.0%}: {'met' if met else 'not met'}")
    return 0 if met else 1


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

    grade = sub.add_parser("grade", help="execute notebooks headless and score their exercises")
    grade.add_argument("paths", nargs="+")
    grade.add_argument("--json", metavar="FILE", help="write the full report as JSON")
    grade.add_argument("--threshold", type=float, default=1.0,
                       help="fraction of all points needed for exit code 0 (default 1.0)")
    grade.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    grade.set_defaults(run=_grade)

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
