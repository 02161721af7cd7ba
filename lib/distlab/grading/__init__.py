"""The grading contract: every exercise of every lab, checked the same way.

A notebook calls ``distlab.check("2.1", my_ring_all_reduce)``. The checker for
that id (listed in :mod:`distlab.grading.registry`) runs the student's code on
hidden, randomised cases against a reference and either returns a short detail
string (pass) or raises :class:`CheckFailed` saying what differs. The result is
printed as one line and, when ``DISTLAB_GRADE_REPORT`` names a file, appended to
it as JSON so ``distlab grade`` can total a notebook without parsing output.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import asdict, dataclass

from distlab.grading.registry import Exercise, find_exercise

REPORT_ENV = "DISTLAB_GRADE_REPORT"
STUB_MESSAGE = "Exercise {id}: replace this line with your solution"


class CheckFailed(AssertionError):
    """Raised by a checker when the student's answer is wrong; the message says how."""


@dataclass
class CheckResult:
    id: str
    title: str
    status: str  # "passed" | "failed" | "not attempted"
    points: int
    max_points: int
    detail: str
    label: str = ""  # "Exercise 2.1" or "Question Q2.1"

    def _ipython_display_(self) -> None:
        """``check`` already printed the line; a bare call at the end of a cell shows nothing more."""

    def line(self) -> str:
        mark = {"passed": "✓", "failed": "✗", "not attempted": "·"}[self.status]
        head = f"{mark} {self.label or 'Exercise ' + self.id} {self.title}: {self.points}/{self.max_points} points"
        if self.status == "not attempted":
            return f"{head} (not attempted)"
        return f"{head} ({self.detail})" if self.detail else head


def is_not_attempted(error: BaseException) -> bool:
    """True for the NotImplementedError an untouched stub raises, in this process or in a rank."""
    if isinstance(error, NotImplementedError):
        return True
    return getattr(error, "exc_type", None) == "NotImplementedError"


def check(exercise_id: str, *student_code, quiet: bool = False) -> CheckResult:
    """Grade one exercise: run its checker on the student's code and print one line."""
    exercise: Exercise = find_exercise(exercise_id)
    try:
        detail = exercise.checker(*student_code) or ""
        status, points = "passed", exercise.points
    except CheckFailed as failure:
        status, points, detail = "failed", 0, str(failure)
    except BaseException as error:  # a student's crash is a result, not a crash of the grader
        if isinstance(error, KeyboardInterrupt) and not hasattr(error, "exc_type"):
            raise
        if is_not_attempted(error):
            status, points, detail = "not attempted", 0, ""
        else:
            from distlab.grading.harness import first_line  # noqa: PLC0415  the harness imports this module

            status, points = "failed", 0
            detail = f"raised {type(error).__name__}: {first_line(error)}"
    result = CheckResult(exercise.id, exercise.title, status, points, exercise.points, detail, exercise.label)
    _record(result)
    if not quiet:
        print(result.line())
    return result


@contextmanager
def needs(*exercise_ids: str):
    """Run a cell's measurement only once the exercises it uses are done.

    A lab runs top to bottom with its stubs in place: inside ``with distlab.needs("2.1"):``
    the ``NotImplementedError`` of an untouched stub (raised here or in a rank) becomes one
    line, "· finish exercise 2.1 to see this", and the notebook carries on. Any other error
    propagates. Keep everything that uses the exercise's results inside the block.
    """
    try:
        yield
    except BaseException as error:
        if isinstance(error, KeyboardInterrupt) and not hasattr(error, "exc_type"):
            raise
        if not is_not_attempted(error):
            raise
        names = " and ".join(exercise_ids) if exercise_ids else "the exercises above"
        print(f"· finish exercise {names} to see this")


def _record(result: CheckResult) -> None:
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as report:
            report.write(json.dumps(asdict(result)) + "\n")


__all__ = ["CheckFailed", "CheckResult", "check", "needs", "is_not_attempted", "REPORT_ENV", "STUB_MESSAGE"]
