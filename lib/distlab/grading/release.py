"""Releasing a lab to a graded class: one notebook per student, its quiz asking that student's numbers.

``distlab release labs/01_memory_math.ipynb --students alice bob --secret-file course.secret`` writes
``release/<student>/01_memory_math.ipynb`` (nbgrader's release step, per student). Each copy is the lab as handed
out with two additions: a code cell before the first quiz answer that calls
:func:`~distlab.grading.quiz.your_numbers` with the student's name and token, so the check lines ask and mark
their numbers as they work; and, under each varied question, a line with their numbers. The token is an HMAC of
the name under the course secret (:func:`~distlab.grading.quiz.student_token`); the secret stays with the
instructor, who grades with the same file (``distlab grade --secret-file``), and the grader derives each token
again rather than reading it from the notebook.
"""

from __future__ import annotations

import copy
import importlib
from pathlib import Path

import nbformat

from distlab.grading.quiz import student_token
from distlab.grading.registry import lab_modules, lab_number

__all__ = ["NEW_SECRET", "read_secret", "read_roster", "varied_questions", "release_notebook", "release"]

# How an instructor makes a course secret (once per course; keep it out of the class repository).
NEW_SECRET = "python -c \"import secrets; print(secrets.token_hex(32))\" > course.secret"
_FIRST_ANSWER = 'distlab.check("Q'


def read_secret(path: str | Path) -> bytes:
    """The course secret in ``path``: at least 16 characters, or an error that says how to make one."""
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as error:
        raise ValueError(f"cannot read the course secret {path}: {error.strerror}; make one with: {NEW_SECRET}") \
            from None
    if len(secret) < 16:
        raise ValueError(f"the course secret in {path} is {len(secret)} characters; make one of 64 with: {NEW_SECRET}")
    return secret


def read_roster(path: str | Path) -> list[str]:
    """Student names, one a line (blank lines and ``#`` comments skipped): the folder names of their submissions."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def varied_questions(lab: int) -> dict:
    """Lab ``lab``'s quiz questions that vary per student, by id; only its own checker module is imported (a
    release reads one or two labs, not every lab's checkers and the topics behind them)."""
    name = f"lab{lab:02d}"
    if name not in lab_modules():
        return {}
    return {e.id: e for e in importlib.import_module(f"distlab.grading.{name}").EXERCISES if e.variation is not None}


def release_notebook(notebook: nbformat.NotebookNode, lab: int, student: str, token: str) -> nbformat.NotebookNode:
    """``student``'s copy of a lab: its quiz asks their numbers (see the module's docstring)."""
    mine = copy.deepcopy(notebook)
    varied = varied_questions(lab)
    if not varied:
        return mine
    for cell in mine.cells:
        for question_id, exercise in varied.items():
            if cell.cell_type == "markdown" and f"**{question_id}**" in cell.source:
                values = exercise.variation.numbers(question_id, token)
                cell.source += f"\n\n> **Your numbers** ({student}): {exercise.variation.title(values)}"
    first = next((i for i, c in enumerate(mine.cells) if c.cell_type == "code" and _FIRST_ANSWER in c.source), None)
    if first is not None:
        mine.cells.insert(first, nbformat.v4.new_code_cell(
            "# Your quiz numbers: put here by your instructor's release; keep this cell as it is.\n"
            "from distlab.grading.quiz import your_numbers\n"
            f"your_numbers({student!r}, {token!r}, lab={lab})"))
    mine.metadata.setdefault("distlab", {})["student"] = student
    return mine


def release(paths: list[str | Path], students: list[str], secret: bytes, out: str | Path) -> list[Path]:
    """Write ``out/<student>/<notebook>`` for every lab notebook in ``paths`` and every student."""
    bad = [s for s in students if not s or "/" in s or "\\" in s or s.startswith(".")]
    if bad:
        raise ValueError(f"student names become folder names: {', '.join(map(repr, bad))} cannot")
    if len(set(students)) != len(students):
        raise ValueError("a student is named twice")
    written = []
    for path in map(Path, paths):
        lab = lab_number(path)
        if lab is None:
            raise ValueError(f"{path}: a lab notebook's name starts with its number (01_memory_math.ipynb)")
        notebook = nbformat.read(path, as_version=4)
        for student in students:
            target = Path(out) / student / path.name
            target.parent.mkdir(parents=True, exist_ok=True)
            nbformat.write(release_notebook(notebook, lab, student, student_token(secret, student)), target)
            written.append(target)
    return written
