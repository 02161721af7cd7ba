"""Solutions → labs, executing notebooks, and grading them.

``solutions/NN_slug.ipynb`` is the source of truth. A lab is the same notebook
with every ``# BEGIN SOLUTION N.k`` … ``# END SOLUTION`` block replaced by a
stub that raises ``NotImplementedError("Exercise N.k: …")`` and all outputs
cleared. Grading executes a notebook headless with ``DISTLAB_GRADE_REPORT``
set, so every ``distlab.check`` call lands in a JSON-lines file we total.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import nbformat

from distlab.grading import REPORT_ENV, STUB_MESSAGE
from distlab.grading.registry import exercises_of_lab, sort_key

REPO_ROOT = Path(__file__).resolve().parents[2]
SOLUTION_BLOCK = re.compile(
    r"^(?P<indent>[ \t]*)# BEGIN SOLUTION (?P<id>\d+\.\d+)[^\n]*\n(?P<body>.*?)^[ \t]*# END SOLUTION[^\n]*(?:\n|\Z)",
    re.MULTILINE | re.DOTALL,
)
# A one-line answer: ``q4_1 = 1.5  # SOLUTION Q4.1`` becomes ``q4_1 = ...  # your answer``.
SOLUTION_LINE = re.compile(
    r"^(?P<head>[ \t]*[\w.\[\]'\"]+[ \t]*=[ \t]*)(?P<value>[^\n]*?)[ \t]*#[ \t]*SOLUTION[ \t]+(?P<id>Q?\d+\.\d+)[ \t]*$",
    re.MULTILINE,
)
_MARKER = re.compile(r"#\s*(BEGIN SOLUTION|END SOLUTION|SOLUTION\b)")
# nbval's cell markers are test plumbing: solutions keep them, students never see them.
_NBVAL_LINE = re.compile(r"^[ \t]*#[ \t]*NBVAL_[A-Z_]+[^\n]*\n?", re.MULTILINE)


class NotebookError(ValueError):
    """A solution notebook that cannot be turned into a lab (unbalanced markers…)."""


# ---------------------------------------------------------------- solutions → labs

def strip_solutions(source: str, where: str = "") -> str:
    """Replace each solution block with a stub at the block's indentation."""
    def stub(match: re.Match) -> str:
        message = STUB_MESSAGE.format(id=match["id"])
        return f'{match["indent"]}raise NotImplementedError("{message}")\n'

    stripped = SOLUTION_BLOCK.sub(stub, source)
    stripped = SOLUTION_LINE.sub(lambda m: f"{m['head']}...  # your answer", stripped)
    leftover = _MARKER.search(stripped)
    if leftover:
        line = stripped[: leftover.start()].count("\n") + 1
        raise NotebookError(f"{where}: unmatched '{leftover.group(0)}' marker at line {line} of the cell")
    return stripped


def make_lab(solution: nbformat.NotebookNode, where: str = "") -> nbformat.NotebookNode:
    lab = nbformat.from_dict(json.loads(json.dumps(solution)))
    for index, cell in enumerate(lab.cells):
        if cell.cell_type != "code":
            continue
        cell.source = _NBVAL_LINE.sub("", strip_solutions(cell.source, f"{where} cell {index}"))
        cell.outputs = []
        cell.execution_count = None
    return lab


def exercise_ids(notebook: nbformat.NotebookNode) -> list[str]:
    """Ids of every solution block and one-line answer, in notebook order."""
    return [m["id"] for cell in notebook.cells if cell.cell_type == "code"
            for pattern in (SOLUTION_BLOCK, SOLUTION_LINE) for m in pattern.finditer(cell.source)]


def build_labs(solutions_dir: Path, labs_dir: Path, check_only: bool = False) -> list[Path]:
    """Write (or, with ``check_only``, compare) every lab; return the labs that were out of date."""
    stale = []
    labs_dir.mkdir(parents=True, exist_ok=True)
    for solution_path in sorted(solutions_dir.glob("[0-9][0-9]_*.ipynb")):
        solution = nbformat.read(solution_path, as_version=4)
        text = nbformat.writes(make_lab(solution, solution_path.name)) + "\n"
        lab_path = labs_dir / solution_path.name
        if not lab_path.exists() or lab_path.read_text(encoding="utf-8") != text:
            stale.append(lab_path)
            if not check_only:
                lab_path.write_text(text, encoding="utf-8")
    orphans = {p.name for p in labs_dir.glob("*.ipynb")} - {p.name for p in solutions_dir.glob("*.ipynb")}
    stale += [labs_dir / name for name in sorted(orphans)]
    if not check_only:
        for name in orphans:
            (labs_dir / name).unlink()
    return stale


# ---------------------------------------------------------------- execution

@contextmanager
def _environment(**values: str):
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def execute(path: Path, cell_timeout: int = 600, allow_errors: bool = False,
            env: dict[str, str] | None = None) -> nbformat.NotebookNode:
    """Run a notebook top to bottom in a fresh kernel, in its own folder; return it with outputs."""
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, timeout=cell_timeout, allow_errors=allow_errors,
                            kernel_name=notebook.metadata.get("kernelspec", {}).get("name", "python3"),
                            resources={"metadata": {"path": str(Path(path).resolve().parent)}})
    with _environment(**(env or {})):
        client.execute()
    return notebook


# ---------------------------------------------------------------- grading

@dataclass
class NotebookGrade:
    path: str
    exercises: list[dict] = field(default_factory=list)
    error: str | None = None  # the notebook could not be executed at all

    @property
    def points(self) -> int:
        return sum(e["points"] for e in self.exercises)

    @property
    def max_points(self) -> int:
        return sum(e["max_points"] for e in self.exercises)


def lab_number(path: Path) -> int | None:
    match = re.match(r"(\d+)_", Path(path).name)
    return int(match.group(1)) if match else None


def grade_notebook(path: Path, cell_timeout: int = 600) -> NotebookGrade:
    """Execute a (student) notebook headless and total its exercise checks.

    Exercises of the lab that no check reported (a deleted check cell) score 0 as "not run".
    """
    grade = NotebookGrade(str(path))
    with tempfile.TemporaryDirectory(prefix="distlab-grade-") as tmp:
        report = Path(tmp) / "report.jsonl"
        report.touch()
        try:
            execute(Path(path), cell_timeout=cell_timeout, allow_errors=True, env={REPORT_ENV: str(report)})
        except Exception as error:  # a dead kernel or a cell past its timeout
            grade.error = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
        reported = {}
        for line in report.read_text(encoding="utf-8").splitlines():
            result = json.loads(line)
            reported[result["id"]] = result  # the last check of an exercise counts
    number = lab_number(Path(path))
    expected = exercises_of_lab(number) if number is not None else {}
    for exercise_id in sorted(set(expected) | set(reported), key=sort_key):
        if exercise_id in reported:
            grade.exercises.append(reported[exercise_id])
        else:
            e = expected[exercise_id]
            grade.exercises.append({"id": e.id, "title": e.title, "status": "not run", "points": 0,
                                    "max_points": e.points, "detail": "its check cell never ran"})
    return grade


def format_grades(grades: list[NotebookGrade]) -> str:
    rows = []
    for grade in grades:
        rows.append(f"{grade.path}: {grade.points}/{grade.max_points} points"
                    + (f"  (execution stopped: {grade.error})" if grade.error else ""))
        for e in grade.exercises:
            mark = {"passed": "✓", "failed": "✗"}.get(e["status"], "·")
            detail = f"  {e['detail']}" if e["detail"] and e["status"] == "failed" else ""
            rows.append(f"  {mark} {e['id']:<6}{e['title']:<44}{e['points']:>3}/{e['max_points']:<3} {e['status']}{detail}")
    total = sum(g.points for g in grades)
    maximum = sum(g.max_points for g in grades)
    rows.append(f"total: {total}/{maximum} points ({100 * total / maximum if maximum else 0:.0f}%)")
    return "\n".join(rows)


def grades_json(grades: list[NotebookGrade]) -> dict:
    total = sum(g.points for g in grades)
    maximum = sum(g.max_points for g in grades)
    return {
        "points": total, "max_points": maximum, "fraction": total / maximum if maximum else 0.0,
        "notebooks": [dict(asdict(g), points=g.points, max_points=g.max_points) for g in grades],
    }
