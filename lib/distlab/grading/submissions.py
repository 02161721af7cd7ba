"""A term's grading around ``distlab grade``: collect a folder of submissions, flag late ones, regrade only what
changed, and export what an instructor hands on (a CSV for the gradebook, Gradescope's ``results.json``, one
feedback file per student).

The anchors are nbgrader's collect/autograde/feedback/export and Gradescope's autograder output. A submission is
a notebook, named for its student by its folder (``submissions/alice/03_ddp.ipynb``) or, where notebooks lie in
the folder itself, by its file name. Lateness compares the submission time (from a CSV the LMS exports, else the
file's modification time) with the deadline; it is reported, and the points stay what the checks gave, so the
course's policy decides what a late flag costs.
"""

from __future__ import annotations

import csv
import hashlib
import json
from datetime import datetime, timezone
from pathlib import Path

from distlab.grading.contract import CheckResult
from distlab.grading.registry import sort_key

__all__ = ["collect", "student_names", "content_hash", "parse_time", "submission_times", "previous_grades",
           "write_csv", "write_gradescope", "write_feedback"]


def collect(paths: list[str]) -> list[tuple[Path, str]]:
    """Notebooks to grade and their students: each path a notebook, or a folder of submissions in which
    ``folder/<student>/*.ipynb`` belongs to ``<student>`` and ``folder/<name>.ipynb`` to ``<name>``. Notebooks
    named one by one are named as :func:`student_names` says. Checkpoint copies Jupyter keeps beside a
    notebook are skipped."""
    found: list[tuple[Path, str]] = []
    loose: list[Path] = []
    for given in map(Path, paths):
        if given.is_dir():
            found += [(p, p.stem) for p in sorted(given.glob("*.ipynb"))]
            found += [(p, p.parent.name) for p in sorted(given.glob("*/*.ipynb"))
                      if ".ipynb_checkpoints" not in p.parts]
        else:
            loose.append(given)
    found += list(zip(loose, student_names([str(p) for p in loose])))
    return found


def student_names(paths: list[str]) -> list[str]:
    """How the report names each notebook: its folder when every file has the same name
    (``submissions/alice/02_collectives.ipynb`` → ``alice``), else its file name."""
    paths = [Path(p) for p in paths]
    if len({p.name for p in paths}) == 1 and len({p.parent.name for p in paths}) == len(paths) > 1:
        return [p.parent.name for p in paths]
    stems = [p.stem for p in paths]
    return stems if len(set(stems)) == len(stems) else [str(p) for p in paths]


def content_hash(path: Path) -> str:
    """What ``--changed`` compares: the notebook's bytes, so a re-save with the same content is not a change."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def parse_time(text: str) -> datetime:
    """An ISO 8601 time; one without a zone is UTC (a deadline written as "2026-12-01T23:59")."""
    moment = datetime.fromisoformat(text.strip())
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


def submission_times(paths: list[Path], students: list[str], times_csv: str | None) -> dict[str, datetime]:
    """When each student submitted: the ``submitted`` column of ``times_csv`` (columns ``student,submitted``),
    else the notebook file's modification time."""
    if times_csv:
        with open(times_csv, newline="", encoding="utf-8") as handle:
            rows = list(csv.DictReader(handle))
        if rows and not {"student", "submitted"} <= set(rows[0]):
            raise ValueError(f"{times_csv}: expected the columns student,submitted, found {','.join(rows[0])}")
        table = {row["student"].strip(): parse_time(row["submitted"]) for row in rows}
        missing = [s for s in students if s not in table]
        if missing:
            raise ValueError(f"{times_csv} has no submission time for {', '.join(missing)}")
        return {s: table[s] for s in students}
    return {s: datetime.fromtimestamp(p.stat().st_mtime, tz=timezone.utc) for p, s in zip(paths, students)}


def previous_grades(report_path: str | None) -> dict[tuple[str, str], dict]:
    """The last report's notebooks by (student, content hash): what ``--changed`` keeps without regrading."""
    if not report_path or not Path(report_path).is_file():
        return {}
    report = json.loads(Path(report_path).read_text(encoding="utf-8"))
    return {(n["student"], n.get("sha256", "")): n for n in report.get("notebooks", []) if n.get("sha256")}


def _exercise_ids(report: dict) -> list[str]:
    return sorted({e["id"] for n in report["notebooks"] for e in n["exercises"]}, key=sort_key)


def write_csv(report: dict, path: str) -> None:
    """One row per student and lab; one column of points per exercise and quiz question (a gradebook import)."""
    ids = _exercise_ids(report)
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["student", "lab", "points", "max_points", "passed", "late", "submitted", *ids])
        for n in sorted(report["notebooks"], key=lambda n: (n["student"], n["lab"] if n["lab"] is not None else -1)):
            points = {e["id"]: e["points"] for e in n["exercises"]}
            writer.writerow([n["student"], n["lab"], n["points"], n["max_points"], n["passed"],
                             "" if n.get("late") is None else n["late"], n.get("submitted") or "",
                             *[points.get(i, "") for i in ids]])


def write_gradescope(report: dict, folder: str) -> list[Path]:
    """``<folder>/<notebook>/<student>/results.json`` (Gradescope grades one assignment per notebook) in its
    autograder format: the score, and one test per exercise with its points, status and the printed line."""
    written = []
    for n in report["notebooks"]:
        results = [CheckResult.from_entry(e) for e in sorted(n["exercises"], key=lambda e: sort_key(e["id"]))]
        tests = [{"name": r.name, "number": r.id, "score": r.points, "max_score": r.max_points,
                  "status": "passed" if r.status == "passed" else "failed", "output": r.line()} for r in results]
        output = [n["error"]] if n.get("error") else []
        if n.get("late"):
            output.append(f"submitted {n['submitted']}, after the deadline")
        target = Path(folder) / Path(n["path"]).stem / n["student"] / "results.json"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps({"score": n["points"], "output": "\n".join(output), "tests": tests},
                                     indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        written.append(target)
    return written


def write_feedback(report: dict, folder: str) -> list[Path]:
    """``<folder>/<student>/<notebook>.md``: what the student's notebook got, exercise by exercise, with each
    check's line, the cells that raised, and whether it ran to the end. Never a quiz key."""
    written = []
    for n in report["notebooks"]:
        lab = f"lab {n['lab']:02d}" if n["lab"] is not None else Path(n["path"]).name
        lines = [f"# {n['student']}: {lab}", "",
                 f"**{n['points']}/{n['max_points']} points** ({n['fraction']:.0%}); "
                 f"{'passed' if n['passed'] else 'not passed'} at the course's threshold."]
        if n.get("late") is not None:
            lines.append(f"Submitted {n['submitted']}{', after the deadline' if n['late'] else ''}.")
        if n.get("error"):
            lines.append(f"The notebook did not run to the end: {n['error']}.")
        lines += ["", "## Exercises and questions", ""]
        lines += [f"- {CheckResult.from_entry(e).line()}"
                  for e in sorted(n["exercises"], key=lambda e: sort_key(e["id"]))]
        if n.get("cell_errors"):
            lines += ["", "## Cells that raised", ""]
            lines += [f"- cell {c['cell']}: {c['ename']}: {c['message']}" for c in n["cell_errors"]]
        target = Path(folder) / n["student"] / f"{Path(n['path']).stem}.md"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("\n".join(lines) + "\n", encoding="utf-8")
        written.append(target)
    return written
