"""Where every exercise is listed: id, title, points and checker, one lab module each.

Each ``distlab.grading.labNN`` module defines ``EXERCISES``, a list of
:class:`Exercise`. This file only knows which lab modules exist.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

LAB_MODULES = ["lab00", "lab01", "lab02", "lab03", "lab10"]


@dataclass(frozen=True)
class Exercise:
    id: str  # "2.1": lab 2, exercise 1
    title: str
    points: int
    checker: Callable[..., str]  # returns a detail on success, raises CheckFailed on failure


def all_exercises() -> dict[str, Exercise]:
    table: dict[str, Exercise] = {}
    for name in LAB_MODULES:
        module = importlib.import_module(f"distlab.grading.{name}")
        for exercise in module.EXERCISES:
            if exercise.id in table:
                raise ValueError(f"exercise {exercise.id} is defined twice")
            table[exercise.id] = exercise
    return table


def find_exercise(exercise_id: str) -> Exercise:
    table = all_exercises()
    if exercise_id not in table:
        known = ", ".join(sorted(table, key=_sort_key))
        raise KeyError(f"no exercise {exercise_id!r}; known exercises: {known}")
    return table[exercise_id]


def _sort_key(exercise_id: str) -> tuple[int, ...]:
    return tuple(int(part) for part in exercise_id.split("."))
