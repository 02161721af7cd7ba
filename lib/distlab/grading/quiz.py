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

**Per-student variants.** Self-study asks the chapter's numbers, answered at the chapter's end, so in a graded
class a copied answer would pass. A numeric question whose numbers can change is therefore written as a formula
of them: ``given`` (the chapter's numbers), ``vary`` (other values each may take), ``solve`` (the library's own
formula) and a title that is a template of the same names::

    number("Q1.2", "ZeRO-3 bytes per parameter per rank on {ranks} ranks", given=dict(ranks=64),
           vary=dict(ranks=(8, 16, 32, 128, 256, 512)), solve=lambda ranks: bytes_per_param(3, ranks).total)

A student's numbers are drawn from their token, ``HMAC(course secret, student name)`` (:func:`student_token`),
and always answer differently from the chapter's. ``distlab release`` writes each student a notebook whose quiz
starts with ``your_numbers(student, token, lab)``: from then on the check lines ask and mark that student's
numbers. The grader trusts no token in a notebook: it derives the token again from the student's name and the
secret, which never leaves the instructor's machine, and marks the answers the kernel reported itself
(:func:`remark`). A question whose answer cannot vary says why in ``fixed``.

**Named wrong answers.** ``wrong`` lists what the plausible slips answer, by name (a number, or for a varied
question a function of its numbers, like ``solve``). The tolerance must keep each of them out for every set of
numbers the question can ask: ``tests/grading/test_quiz_tolerances.py`` checks that the point halfway between the
key and each named wrong answer fails, so a looser tolerance, or a variant that brings a slip too close to the key,
fails the test instead of passing a student's slip.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import math
import numbers
import random
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from distlab.grading.contract import CheckFailed
from distlab.grading.registry import Exercise, exercises_of_lab, find_exercise

__all__ = ["number", "choice", "Variation", "NumberCheck", "student_token", "your_numbers", "answer_given", "remark"]

# The token of the student whose released notebook called :func:`your_numbers` in this kernel.
_student: dict[str, str] = {}
# Draws of a student's numbers before giving up on finding ones whose answer differs from the chapter's.
_DRAWS = 64


def _unanswered(value) -> bool:
    return value is ... or value is None


def _not_attempted(question_id: str) -> NotImplementedError:
    return NotImplementedError(f"Question {question_id}: replace ... with your answer")


def _judge(given, answer: float, rel_tol: float, abs_tol: float, hint: str, question_id: str) -> str:
    if _unanswered(given):
        raise _not_attempted(question_id)
    if isinstance(given, bool) or not isinstance(given, numbers.Real):
        raise CheckFailed(f"answer with a number, not {type(given).__name__} {given!r}")
    if not math.isclose(float(given), answer, rel_tol=rel_tol, abs_tol=abs_tol):
        raise CheckFailed(f"{given:g} is not right" + (f": {hint}" if hint else ""))
    return "correct"


def student_token(secret: bytes, student: str) -> str:
    """The seed of ``student``'s quiz numbers: an HMAC of their name under the course secret. A student who
    knows their own token cannot derive the secret or anyone else's token from it."""
    return hmac.new(secret, student.strip().encode("utf-8"), hashlib.sha256).hexdigest()[:16]


@dataclass(frozen=True)
class Variation:
    """How a numeric question's numbers vary: see the module's docstring."""

    template: str
    given: dict
    vary: dict
    solve: Callable[..., float]
    rel_tol: float
    abs_tol: float
    hint: str

    def answer(self, values: dict) -> float:
        return float(self.solve(**values))

    def title(self, values: dict) -> str:
        return self.template.format(**values)

    def numbers(self, question_id: str, token: str) -> dict:
        """The student's numbers: each name the chapter's value or one of ``vary``'s, drawn from the token, such
        that the chapter's answer is wrong for them (off by more than twice the tolerance)."""
        rng = random.Random(f"{token}:{question_id}")
        chapter = self.answer(self.given)
        for _ in range(_DRAWS):
            values = {name: rng.choice((self.given[name], *others)) for name, others in self.vary.items()}
            if not math.isclose(self.answer(values), chapter, rel_tol=2 * self.rel_tol, abs_tol=2 * self.abs_tol):
                return {**self.given, **values}
        raise ValueError(f"{question_id}: no numbers in {self.vary} change the chapter's answer {chapter:g}")

    def current(self, question_id: str) -> dict:
        """The numbers this kernel asks: the student's after :func:`your_numbers`, else the chapter's."""
        return self.numbers(question_id, _student["token"]) if _student else self.given

    def asked(self, question_id: str) -> str:
        return self.title(self.current(question_id))


@dataclass(frozen=True, eq=False)
class NumberCheck:
    """A numeric question's checker: the key (``answer``, or ``variation``'s for the numbers this kernel asks),
    the tolerance, and the named wrong answers it must keep out (the module's docstring)."""

    question_id: str
    answer: float
    rel_tol: float
    abs_tol: float
    hint: str
    variation: Variation | None = None
    wrong: dict[str, float | Callable[..., float]] = field(default_factory=dict)

    def __call__(self, given_answer) -> str:
        key = self.variation.answer(self.variation.current(self.question_id)) if self.variation else self.answer
        return _judge(given_answer, key, self.rel_tol, self.abs_tol, self.hint, self.question_id)

    def accepts(self, given: float, key: float) -> bool:
        return math.isclose(given, key, rel_tol=self.rel_tol, abs_tol=self.abs_tol)

    def variants(self) -> Iterator[tuple[dict, float, dict[str, float]]]:
        """Every set of numbers the question can ask (the chapter's, and each combination :meth:`Variation.numbers`
        can draw), with its key and what each named wrong answer comes to there."""
        if self.variation is None:
            yield {}, self.answer, {name: float(wrong) for name, wrong in self.wrong.items()}
            return
        given, vary = self.variation.given, self.variation.vary
        for drawn in itertools.product(*((given[name], *others) for name, others in vary.items())):
            values = {**given, **dict(zip(vary, drawn))}
            yield values, self.variation.answer(values), {name: float(wrong(**values))
                                                          for name, wrong in self.wrong.items()}


def number(question_id: str, title: str, answer: float | None = None, *, rel_tol: float = 0.01,
           abs_tol: float = 0.0, points: int = 1, hint: str = "", given: dict | None = None,
           vary: dict | None = None, solve: Callable[..., float] | None = None, fixed: str = "",
           wrong: dict[str, float | Callable[..., float]] | None = None) -> Exercise:
    """A numeric question: correct within ``rel_tol`` (relative) or ``abs_tol`` (absolute).

    Either a fixed ``answer`` (``fixed`` says why no number of it can vary), or ``given``/``vary``/``solve``:
    a per-student variant whose answer is ``solve`` of the student's numbers (the module's docstring).
    ``wrong``: the named wrong answers the tolerance must keep out, numbers for a fixed question, functions of
    the numbers (as ``solve``) for a varied one."""
    variation = None
    if solve is not None:
        if answer is not None or not given or not vary or set(vary) - set(given):
            raise ValueError(f"{question_id}: a varied question takes given, vary and solve (over given's names), "
                             "and no fixed answer")
        variation = Variation(title, dict(given), dict(vary), solve, rel_tol, abs_tol, hint)
        title, answer = variation.title(given), variation.answer(given)
    elif answer is None:
        raise ValueError(f"{question_id}: give an answer, or given, vary and solve")
    checker = NumberCheck(question_id, answer, rel_tol, abs_tol, hint, variation, dict(wrong or {}))
    return Exercise(question_id, title, points, checker, answer=answer, variation=variation, fixed=fixed)


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


# ---------------------------------------------------------------- a graded class


def your_numbers(student: str, token: str, lab: int) -> None:
    """Ask this kernel's quiz with ``student``'s numbers (the first quiz cell of a released notebook calls it)
    and print the lab's varied questions as that student is asked them."""
    _student.update(token=token)
    varied = [e for e in exercises_of_lab(lab).values() if e.variation is not None]
    print(f"Your quiz, {student}: {len(varied)} question(s) ask your own numbers, not the chapter's")
    for exercise in varied:
        print(f"  {exercise.id}: {exercise.asked}")


def answer_given(exercise: Exercise, student_code: tuple) -> float | None:
    """A varied question's answer as a number for the ledger, so the grader can mark it itself; else None."""
    if exercise.variation is None or len(student_code) != 1:
        return None
    value = student_code[0]
    return float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else None


def remark(entry: dict, student: str, secret: bytes) -> dict:
    """A ledger entry of a varied question marked by the grader against ``student``'s numbers (from the secret,
    not from anything in the notebook), with the student's key for ``--answers``; other entries unchanged.

    The kernel's own mark is not trusted: its notebook may ask other numbers (no release, another student's
    token). Only the number it reported counts; a pass without one is not believed."""
    exercise = find_exercise(entry["id"])
    if exercise.variation is None:
        return entry
    values = exercise.variation.numbers(exercise.id, student_token(secret, student))
    key = exercise.variation.answer(values)
    marked = {**entry, "title": exercise.variation.title(values), "answer": key}
    if entry["status"] in ("not attempted", "not run"):
        return marked
    given = entry.get("given")
    if given is None:
        detail = entry["detail"] if entry["status"] == "failed" else "no numeric answer reached the grader"
        return {**marked, "status": "failed", "points": 0, "detail": detail}
    try:
        detail = _judge(given, key, exercise.variation.rel_tol, exercise.variation.abs_tol,
                        exercise.variation.hint, entry["id"])
        return {**marked, "status": "passed", "points": exercise.points, "detail": detail}
    except CheckFailed as failure:
        return {**marked, "status": "failed", "points": 0, "detail": str(failure)}
