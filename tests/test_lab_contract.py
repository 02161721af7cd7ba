"""The pieces every lab notebook uses besides checkers: quiz questions, the needs() guard, claims."""

import pytest

import distlab
from distlab.claims import ClaimFailed
from distlab.grading import quiz
from distlab.grading.registry import Exercise, lab_modules, lab_of, sort_key


def stub():
    raise NotImplementedError("Exercise 9.1: replace this line with your solution")


def test_lab_modules_are_found_by_name_and_ids_sort_by_lab():
    assert {"lab00", "lab01", "lab02", "lab03", "lab10"} <= set(lab_modules())
    assert sorted(["Q2.1", "10.1", "2.2", "2.10", "2.1"], key=sort_key) == ["2.1", "2.2", "2.10", "Q2.1", "10.1"]
    assert lab_of("Q11.3") == 11
    with pytest.raises(ValueError, match="must look like"):
        Exercise("4a", "bad", 1, lambda: "")


def test_numeric_question_tolerance_hint_and_not_attempted():
    q = quiz.number("Q9.1", "ZeRO-3 bytes vs DDP", answer=1.5, rel_tol=0.02, hint="count the collectives")
    assert q.label == "Question Q9.1" and q.is_quiz
    assert q.checker(1.51) == "correct"
    with pytest.raises(AssertionError, match=r"^2 is not right: count the collectives$"):
        q.checker(2)
    with pytest.raises(AssertionError, match="answer with a number"):
        q.checker("1.5")
    for blank in (..., None):
        with pytest.raises(NotImplementedError):
            q.checker(blank)


def test_choice_question_accepts_one_letter_case_insensitively():
    q = quiz.choice("Q9.2", "which collective", answer="b", options="abcd")
    assert q.checker(" B ") == "correct"
    with pytest.raises(AssertionError, match="'c' is not right"):
        q.checker("c")
    with pytest.raises(AssertionError, match="answer with one of"):
        q.checker("e")
    with pytest.raises(ValueError, match="not one of the options"):
        quiz.choice("Q9.3", "x", answer="z", options="ab")


def test_needs_turns_an_unfinished_exercise_into_one_line(capsys):
    with distlab.needs("9.1"):
        stub()
        raise AssertionError("never reached")
    assert capsys.readouterr().out == "· finish exercise 9.1 to see this\n"
    with pytest.raises(ZeroDivisionError):
        with distlab.needs("9.1"):
            1 / 0


def test_needs_recognises_a_stub_raised_inside_ranks(capsys):
    with distlab.needs("9.1", "9.2"):
        distlab.launch(stub, 2, collective_timeout=5)
    assert capsys.readouterr().out.endswith("· finish exercise 9.1 and 9.2 to see this\n")


def test_claim_prints_what_held_or_stops_with_one_line(capsys):
    assert distlab.claim(2 < 3, holds="2 is below 3", fails="unreachable") is None
    assert capsys.readouterr().out == "✓ 2 is below 3\n"
    with pytest.raises(ClaimFailed, match="^overlap lost: look at the timeline$") as info:
        distlab.claim(False, holds="unused", fails="overlap lost: look at the timeline")
    assert info.value._render_traceback_() == ["ClaimFailed: overlap lost: look at the timeline"]
