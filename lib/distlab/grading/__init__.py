"""The grading contract's entry: every exercise of every lab, checked the same way.

A notebook calls ``distlab.check("2.1", my_ring_all_reduce)``. The checker for
that id (found by :mod:`distlab.grading.registry` in its lab's module) runs the
student's code on hidden, randomised cases against a reference and either returns
a short detail string (pass) or raises :class:`CheckFailed` saying what differs
(:func:`outcome`). The result is printed as one line and kept in this kernel's ledger,
which ``needs`` reads and the student sees; ``distlab grade`` never reads it: it grades
each exercise again in a process of its own, where the student's top-level code never
ran (:mod:`distlab.grading.isolation`), and in the kernels it runs a check only says so
(:data:`DEFERRED_VARIABLE`). What a check raises and returns, and how a result reads, is
the ground floor every part of grading stands on: :mod:`distlab.grading.contract`.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import asdict

from distlab.grading.contract import (
    STUB_MESSAGE,
    CheckFailed,
    CheckResult,
    describe_error,
    is_not_attempted,
)
from distlab.grading.integrity import reference_use
from distlab.grading.quiz import answer_given
from distlab.grading.registry import Exercise, find_exercise

# Each exercise's latest check in this kernel, by id: ``needs`` reads the status to tell a demo that fails because the
# student's exercise is wrong (a line, the notebook runs on) from a bug (a traceback). ``distlab grade`` never reads it.
_ledger: dict[str, CheckResult] = {}

# Set in the kernels ``distlab grade`` runs a notebook in: a check there only says that the grader checks it apart
# (its result would count for nothing, and the grader's seed of hidden cases stays out of the student's process).
DEFERRED_VARIABLE = "DISTLAB_CHECKS_DEFERRED"


def outcome(exercise: Exercise, *student_code) -> CheckResult:
    """Run ``exercise``'s checker on the student's code: the result, whatever the code does (it never raises but
    for an interrupt). Where it runs is the caller's: this kernel (:func:`check`), or a grading process that holds
    the student's code at arm's length (:mod:`distlab.grading.isolation`)."""
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
    return CheckResult(exercise.id, exercise.asked, status, points, exercise.points, detail, exercise.label,
                       answer_given(exercise, student_code))


def check(exercise_id: str, *student_code, quiet: bool = False) -> CheckResult:
    """Grade one exercise: run its checker on the student's code and print one line."""
    exercise: Exercise = find_exercise(exercise_id)
    if os.environ.get(DEFERRED_VARIABLE):
        result = CheckResult(exercise.id, exercise.asked, "not run", 0, exercise.points,
                             "distlab grade checks it apart from this kernel", exercise.label)
    else:
        result = outcome(exercise, *student_code)
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


def ledger() -> str:
    """This kernel's check results as JSON, the latest per exercise (the student's own record; the grader grades
    apart)."""
    return json.dumps([asdict(result) for result in _ledger.values()])


__all__ = ["CheckFailed", "CheckResult", "check", "outcome", "needs", "DEFERRED_VARIABLE", "describe_error",
           "is_not_attempted", "ledger",
           "STUB_MESSAGE"]
