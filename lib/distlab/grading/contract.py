"""The grading contract's ground floor: what a check raises, what it returns, and how its result reads.

A checker raises :class:`CheckFailed` saying what differs; ``distlab.check`` (:mod:`distlab.grading`) turns
the outcome into a :class:`CheckResult`, whose :meth:`~CheckResult.line` is the one line a student reads, in
the notebook and in the feedback an instructor hands back (:mod:`distlab.grading.submissions`). An error in
the student's code is told in one line too (:func:`describe_error`): its type, its first line, the student's
own source line. This module imports nothing of distlab, so every other part of grading can stand on it.
"""

from __future__ import annotations

import traceback
from collections.abc import Mapping
from dataclasses import dataclass, fields

__all__ = ["STUB_MESSAGE", "MARKS", "CheckFailed", "CheckResult", "is_not_attempted", "describe_error",
           "student_frame", "first_line"]

# What an untouched exercise raises: ``distlab labs`` writes it into the student's stub, and a check reads a
# NotImplementedError as "not attempted".
STUB_MESSAGE = "Exercise {id}: replace this line with your solution"

# A result's mark by status; "not run" is the grader's, for a check whose cell never ran.
MARKS = {"passed": "✓", "failed": "✗", "not attempted": "·", "not run": "-"}


class CheckFailed(AssertionError):
    """Raised by a checker when the student's answer is wrong; the message says how."""


@dataclass
class CheckResult:
    id: str
    title: str
    status: str  # "passed" | "failed" | "not attempted" (and "not run", which only the grader writes)
    points: int
    max_points: int
    detail: str = ""
    label: str = ""  # "Exercise 2.1" or "Question Q2.1"
    given: float | None = None  # a varied quiz question's answer, which the grader marks itself (grading/quiz.py)

    @classmethod
    def from_entry(cls, entry: Mapping) -> CheckResult:
        """A result read back from a report: the ledger's JSON, with whatever keys the grader added."""
        return cls(**{f.name: entry[f.name] for f in fields(cls) if f.name in entry})

    def _ipython_display_(self) -> None:
        """``check`` already printed the line; a bare call at the end of a cell shows nothing more."""

    @property
    def name(self) -> str:
        """Label and title: "Exercise 2.1 ring all-reduce from send/recv"."""
        return f"{self.label or 'Exercise ' + self.id} {self.title}"

    def line(self) -> str:
        """Mark, name, points and what differed: what the notebook prints and the feedback repeats."""
        head = f"{MARKS.get(self.status, '?')} {self.name}: {self.points}/{self.max_points} points"
        if self.status in ("not attempted", "not run"):
            return f"{head} ({self.status})"
        return f"{head} ({self.detail})" if self.detail else head


def is_not_attempted(error: BaseException) -> bool:
    """True for the NotImplementedError an untouched stub raises, in this process or in a rank."""
    if isinstance(error, NotImplementedError):
        return True
    return getattr(error, "exc_type", None) == "NotImplementedError"


def describe_error(error: BaseException) -> str:
    """One line for an error raised in or by the student's code: its type, first line and, when it was raised
    in this process, the student's line (the innermost frame outside distlab and the libraries), so the
    student sees where to look rather than a torch internal. A rank's error already names its rank and line."""
    kind = type(error).__name__  # a rank's error (RankFailed) names the rank's exception in its first line
    text = f"{kind}: {first_line(error)}" if first_line(error) else kind
    where = student_frame(error) or getattr(error, "student_line", "")  # an error rebuilt from another process's
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


def first_line(error, limit: int = 300) -> str:
    """The first line of an error (or of a message), at most ``limit`` characters: a launch error's first line
    says what happened, the lines after it are tracebacks and per-rank details a result line has no room for."""
    lines = str(error).strip().splitlines()
    return lines[0][:limit] if lines else ""
