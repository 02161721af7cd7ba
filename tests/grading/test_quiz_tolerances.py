"""Every numeric quiz question's tolerance keeps its named wrong answers out, for every set of numbers it can ask.

A question lists what the plausible slips answer (``quiz.number(..., wrong={name: value or formula})``). A tolerance
that is loose against the key's size can still accept a slip where a variant brings the slip close to the key: the
limit 2 of the contiguous ring's (N - 1/2)/(N/2) at N = 64, the seeds' 2·M/β without (N - 1)/N at 64 GPUs, the
bytes that leave a GPU (63/64 of the payload) for the payload. The rule: the point halfway between the key and each
named wrong answer fails the check, for the chapter's numbers and for every combination a graded class can draw.
"""

import pytest

from distlab.grading import CheckFailed
from distlab.grading.quiz import NumberCheck
from distlab.grading.registry import all_exercises

# Labs whose every numeric question names its wrong answers; a lab joins this list when its questions get theirs.
NAMED_IN_EVERY_QUESTION = (7, 8, 11)

NUMERIC = {i: e for i, e in all_exercises().items() if isinstance(e.checker, NumberCheck)}
NAMED = sorted((i for i, e in NUMERIC.items() if e.checker.wrong), key=lambda i: (NUMERIC[i].lab, i))


def test_every_numeric_question_of_the_listed_labs_names_its_wrong_answers():
    unnamed = [i for i, e in NUMERIC.items() if e.lab in NAMED_IN_EVERY_QUESTION and not e.checker.wrong]
    assert not unnamed, f"{unnamed}: list what the plausible slips answer, quiz.number(..., wrong={{name: ...}})"


@pytest.mark.parametrize("question_id", NAMED)
def test_the_tolerance_keeps_every_named_wrong_answer_out_for_every_variant(question_id):
    check = NUMERIC[question_id].checker
    too_close = []
    for values, key, wrong in check.variants():
        for name, value in wrong.items():
            if check.accepts((key + value) / 2, key):
                too_close.append(f"{values or 'the chapter'}: key {key:.6g}, '{name}' {value:.6g}")
    assert not too_close, (f"{question_id} (rel_tol {check.rel_tol}, abs_tol {check.abs_tol}) accepts the point "
                           f"halfway to a named wrong answer; tighten the tolerance or drop the variant:\n  "
                           + "\n  ".join(too_close))


@pytest.mark.parametrize("question_id", NAMED)
def test_a_named_wrong_answer_fails_with_the_questions_hint(question_id):
    """As a self-study student meets it (the chapter's numbers): the check line fails and points at the section."""
    check = NUMERIC[question_id].checker
    _, _, wrong = next(check.variants())  # the chapter's numbers come first
    for name, value in wrong.items():
        try:
            check(value)
        except CheckFailed as failure:
            assert str(failure) == f"{value:g} is not right: {check.hint}", name
        else:
            pytest.fail(f"{question_id}: '{name}' ({value:g}) passes the check")
