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


def test_needs_lets_run_all_go_on_past_a_wrong_answer_and_raises_once_the_exercise_passes(capsys, monkeypatch):
    """A demo that fails because the student's answer is wrong prints one line naming the error, the student's
    source line and the exercise, so Run All reaches the check; after the check passes, an error is a bug."""
    from distlab import grading

    monkeypatch.setattr(grading, "_ledger", {})

    def checked(status):
        return grading.CheckResult("9.1", "exercise", status, 0, 1, "")

    with distlab.needs("9.1"):
        print(1 / 0)  # the student's line
    out = capsys.readouterr().out
    assert out.startswith("✗ this cell stopped: ZeroDivisionError: division by zero (at line ")
    assert "print(1 / 0)  # the student's line" in out
    assert "this uses exercise 9.1; its check says what differs; the rest of the notebook runs on" in out
    grading._ledger["9.1"] = checked("failed")
    with distlab.needs("9.1"):
        raise AssertionError("losses differ at step 3")
    assert "exercise 9.1 fails its check (its ✗ line says what differs)" in capsys.readouterr().out
    grading._ledger["9.1"] = checked("passed")
    with pytest.raises(ZeroDivisionError):
        with distlab.needs("9.1"):
            1 / 0
    with pytest.raises(KeyboardInterrupt):
        with distlab.needs("9.2"):
            raise KeyboardInterrupt


def test_a_crash_in_the_students_code_is_described_with_the_students_line():
    from distlab.grading import describe_error

    def wrong(sizes):
        return sizes["missing"]  # the student's line

    try:
        wrong({})
    except KeyError as error:
        line = describe_error(error)
    assert line.startswith("KeyError: 'missing' (at line ") and 'return sizes["missing"]' in line


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
