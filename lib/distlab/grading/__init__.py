"""The grading contract: every exercise of every lab, checked the same way.

A notebook calls ``distlab.check("2.1", my_ring_all_reduce)``. The checker for
that id (listed in :mod:`distlab.grading.registry`) runs the student's code on
hidden, randomised cases against a reference and either returns a short detail
string (pass) or raises :class:`CheckFailed` saying what differs. The result is
printed as one line and kept in this kernel's ledger, which ``distlab grade`` asks
for in its own request after the notebook's last cell (:func:`ledger`): what a
notebook prints or writes to a file is never read as a result.
"""

from __future__ import annotations

import json
import traceback
from contextlib import contextmanager
from dataclasses import asdict, dataclass

from distlab.grading.integrity import reference_use
from distlab.grading.registry import Exercise, find_exercise

STUB_MESSAGE = "Exercise {id}: replace this line with your solution"

# Each exercise's latest check in this kernel, by id. The grader reads it through its own request (``ledger``);
# ``needs`` reads the status to tell a demo that fails because the student's exercise is wrong (a line, the
# notebook runs on) from a bug (a traceback).
_ledger: dict[str, CheckResult] = {}


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
    given: float | None = None  # a varied quiz question's answer, which the grader marks itself (grading/quiz.py)

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
        if passed_through := reference_use(student_code, exercise.references):
            raise CheckFailed(f"{passed_through}: write your own (a submission that uses it scores 0)")
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
            status, points, detail = "failed", 0, f"raised {describe_error(error)}"
    from distlab.grading.quiz import answer_given  # noqa: PLC0415  quiz imports this module

    result = CheckResult(exercise.id, exercise.asked, status, points, exercise.points, detail, exercise.label,
                         answer_given(exercise, student_code))
    _ledger[exercise.id] = result
    if not quiet:
        print(result.line())
    return result


@contextmanager
def needs(*exercise_ids: str):
    """Run a cell's work only once the exercises it uses are done, and never stop the notebook for them.

    A lab runs top to bottom with its stubs in place: inside ``with distlab.needs("2.1"):``
    the ``NotImplementedError`` of an untouched stub (raised here or in a rank) becomes one
    line, "· finish exercise 2.1 to see this", and the notebook carries on.

    A *wrong* answer must not stop Run All either, or the student never reaches the check line that
    says what is wrong. Any other error inside the block, while one of ``exercise_ids`` has not passed
    its check in this kernel (it failed, or its check comes later in the notebook), becomes a line
    naming the error, the student's source line and the exercise to fix. Once every exercise named has
    passed, an error propagates: it is then a bug in the cell, not the student's answer.
    Keep everything that uses the exercise's results inside the block.
    """
    try:
        yield
    except BaseException as error:
        if isinstance(error, KeyboardInterrupt) and not hasattr(error, "exc_type"):
            raise
        names = " and ".join(exercise_ids) if exercise_ids else "the exercises above"
        if is_not_attempted(error):
            print(f"· finish exercise {names} to see this")
            return
        status = {i: _ledger[i].status for i in exercise_ids if i in _ledger}
        pending = [i for i in exercise_ids if status.get(i) != "passed"]
        if not pending:
            raise
        failed = [i for i in pending if status.get(i) == "failed"]
        why = (f"exercise {' and '.join(failed)} fails its check (its ✗ line says what differs)" if failed
               else f"this uses exercise {' and '.join(pending)}; its check says what differs")
        print(f"✗ this cell stopped: {describe_error(error)}\n  {why}; the rest of the notebook runs on")


def describe_error(error: BaseException) -> str:
    """One line for an error raised in or by the student's code: its type, first line and, when it was raised
    in this process, the student's line (the innermost frame outside distlab and the libraries), so the
    student sees where to look rather than a torch internal. A rank's error already names its rank and line."""
    from distlab.grading.harness import first_line  # noqa: PLC0415  the harness imports this module

    kind = type(error).__name__  # a rank's error (RankFailed) names the rank's exception in its first line
    text = f"{kind}: {first_line(error)}" if first_line(error) else kind
    where = student_frame(error)
    return f"{text} (at {where})" if where else text


def student_frame(error: BaseException) -> str:
    """``"line 7: total += x"`` for the innermost traceback frame in a notebook cell or a user's file, or ""."""
    frames = traceback.extract_tb(error.__traceback__) if error.__traceback__ else []
    for frame in reversed(frames):
        name = frame.filename.replace("\\", "/")
        if "/distlab/" in name or "site-packages" in name or "/lib/python" in name or name.startswith("<frozen"):
            continue
        line = (frame.line or "").strip()
        return f"line {frame.lineno}: {line}" if line else f"line {frame.lineno}"
    return ""


def ledger() -> str:
    """This kernel's check results as JSON, the latest per exercise: what ``distlab grade`` totals."""
    return json.dumps([asdict(result) for result in _ledger.values()])


__all__ = ["CheckFailed", "CheckResult", "check", "needs", "describe_error", "is_not_attempted", "ledger",
           "STUB_MESSAGE"]
