"""Where every exercise and quiz question is listed: id, title, points and checker, one lab module each.

Each ``distlab.grading.labNN`` module defines ``EXERCISES``, a list of
:class:`Exercise`. Lab modules are found by name in this module's own folder
(``lab00.py`` … ``lab13.py``), so adding a lab never edits a shared list.

Ids: ``"2.1"`` is exercise 1 of lab 2; ``"Q2.1"`` is quiz question 1 of lab 2
(see :mod:`distlab.grading.quiz`).
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

_LAB_MODULE = re.compile(r"lab\d\d$")
_ID = re.compile(r"(?P<quiz>Q?)(?P<lab>\d+)\.(?P<k>\d+)$")


@dataclass(frozen=True)
class Exercise:
    id: str  # "2.1": lab 2, exercise 1; "Q2.1": lab 2, quiz question 1
    title: str
    points: int
    checker: Callable[..., str]  # returns a detail on success, raises CheckFailed on failure
    # A quiz question's key, which the student's feedback never shows; an instructor's report shows it
    # beside a wrong answer only when asked (``distlab grade --answers``, after the deadline).
    answer: object = None
    # Library functions that are this exercise's answer (dotted paths): handing one in, or calling it, scores 0.
    references: tuple[str, ...] = ()
    # A numeric quiz question whose numbers differ per student in a graded class (:class:`quiz.Variation`).
    variation: object = None
    # Why a numeric question keeps the chapter's numbers in a graded class too (no number in it can vary).
    fixed: str = ""

    def __post_init__(self) -> None:
        if not _ID.match(self.id):
            raise ValueError(f"exercise id {self.id!r} must look like '4.2' (exercise) or 'Q4.2' (quiz)")

    @property
    def lab(self) -> int:
        return lab_of(self.id)

    @property
    def is_quiz(self) -> bool:
        return self.id.startswith("Q")

    @property
    def label(self) -> str:
        """How a result line names it: "Exercise 4.2" or "Question Q4.2"."""
        return f"{'Question' if self.is_quiz else 'Exercise'} {self.id}"

    @property
    def asked(self) -> str:
        """The title as this kernel asks it: a varied question with the student's numbers once their released
        notebook called :func:`~distlab.grading.quiz.your_numbers`, else ``title`` (the chapter's numbers)."""
        return self.variation.asked(self.id) if self.variation is not None else self.title


def lab_of(exercise_id: str) -> int:
    match = _ID.match(exercise_id)
    if not match:
        raise ValueError(f"exercise id {exercise_id!r} must look like '4.2' or 'Q4.2'")
    return int(match["lab"])


def lab_number(path) -> int | None:
    """The lab a notebook belongs to, read from its file name (``03_ddp.ipynb`` -> 3), or None."""
    match = re.match(r"(\d+)_", Path(path).name)
    return int(match.group(1)) if match else None


def sort_key(exercise_id: str) -> tuple[int, int, int]:
    """Lab order, exercises before quiz questions, then by number."""
    match = _ID.match(exercise_id)
    return int(match["lab"]), int(bool(match["quiz"])), int(match["k"])


def lab_modules() -> list[str]:
    """The names of the ``labNN`` checker modules beside this one, in lab order."""
    return sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)]) if _LAB_MODULE.match(m.name))


@lru_cache(maxsize=1)
def all_exercises() -> dict[str, Exercise]:
    table: dict[str, Exercise] = {}
    for name in lab_modules():
        module = importlib.import_module(f"distlab.grading.{name}")
        for exercise in module.EXERCISES:
            if exercise.id in table:
                raise ValueError(f"exercise {exercise.id} is defined twice")
            if exercise.lab != int(name[3:]):
                raise ValueError(f"exercise {exercise.id} is listed in {name}; it belongs to lab {exercise.lab}")
            table[exercise.id] = exercise
    return dict(sorted(table.items(), key=lambda item: sort_key(item[0])))


def exercises_of_lab(lab: int) -> dict[str, Exercise]:
    """Lab ``lab``'s exercises, read from its own checker module only: a kernel checking lab 3 imports lab 3's
    checkers and the topics they need, not every lab's (seconds per graded notebook). :func:`all_exercises` is
    where the course's table is checked whole."""
    name = f"lab{lab:02d}"
    if name not in lab_modules():
        return {}
    module = importlib.import_module(f"distlab.grading.{name}")
    return dict(sorted(((e.id, e) for e in module.EXERCISES if e.lab == lab), key=lambda item: sort_key(item[0])))


def find_exercise(exercise_id: str) -> Exercise:
    lab = re.match(r"Q?(\d+)\.", exercise_id)
    found = exercises_of_lab(int(lab[1])).get(exercise_id) if lab else None
    if found is not None:
        return found
    table = all_exercises()
    if exercise_id not in table:
        raise KeyError(f"no exercise {exercise_id!r}; known exercises: {', '.join(table)}")
    return table[exercise_id]
