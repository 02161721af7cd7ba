"""Quiz questions at the end of each lab, graded by ``distlab.check`` like the exercises.

A lab's checker module lists them next to its exercises::

    EXERCISES = [..., number("Q4.1", "ZeRO-3 bytes moved vs DDP", answer=1.5, rel_tol=0.02,
                             hint="count the all-gathers in forward and backward"), ...]

and the notebook asks them with a one-line answer the lab generator blanks out::

    q4_1 = 1.5  # SOLUTION Q4.1
    distlab.check("Q4.1", q4_1)

In the student's lab that line reads ``q4_1 = ...  # your answer``; an answer left at
``...`` (or ``None``) is "not attempted". A wrong answer fails with the question's hint,
never with the answer itself.
"""

from __future__ import annotations

import math
import numbers
from typing import Sequence

from distlab.grading import CheckFailed
from distlab.grading.registry import Exercise

__all__ = ["number", "choice"]


def _unanswered(value) -> bool:
    return value is ... or value is None


def _not_attempted(question_id: str) -> NotImplementedError:
    return NotImplementedError(f"Question {question_id}: replace ... with your answer")


def number(question_id: str, title: str, answer: float, *, rel_tol: float = 0.01, abs_tol: float = 0.0,
           points: int = 1, hint: str = "") -> Exercise:
    """A numeric question: correct within ``rel_tol`` (relative) or ``abs_tol`` (absolute)."""

    def checker(given) -> str:
        if _unanswered(given):
            raise _not_attempted(question_id)
        if isinstance(given, bool) or not isinstance(given, numbers.Real):
            raise CheckFailed(f"answer with a number, not {type(given).__name__} {given!r}")
        if not math.isclose(float(given), answer, rel_tol=rel_tol, abs_tol=abs_tol):
            raise CheckFailed(f"{given:g} is not right" + (f": {hint}" if hint else ""))
        return "correct"

    return Exercise(question_id, title, points, checker, answer=answer)


def choice(question_id: str, title: str, answer: str, options: Sequence[str], *, points: int = 1,
           hint: str = "") -> Exercise:
    """A multiple-choice question answered with one letter; ``options`` are the letters offered."""
    letters = [o.lower() for o in options]
    if answer.lower() not in letters:
        raise ValueError(f"{question_id}: answer {answer!r} is not one of the options {options}")

    def checker(given) -> str:
        if _unanswered(given):
            raise _not_attempted(question_id)
        if not isinstance(given, str) or given.strip().lower() not in letters:
            raise CheckFailed(f"answer with one of {', '.join(repr(o) for o in options)}, not {given!r}")
        if given.strip().lower() != answer.lower():
            raise CheckFailed(f"{given.strip()!r} is not right" + (f": {hint}" if hint else ""))
        return "correct"

    return Exercise(question_id, title, points, checker, answer=answer.lower())
