"""Lab 12 checkers: the references pass and untouched stubs are "not attempted" (the wrong answers and what
each checker says about them are tabled in test_wrong_answers_lab12.py)."""

import math
import sys

import cloudpickle
import pytest

import distlab
from distlab.fault_tolerance import (
    SpikeGuard,
    find_divergent_replicas,
    job_mtbf_hours,
    resumable_train,
    young_interval,
)

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = [pytest.mark.timeout(300)]


# ---------------------------------------------------------------- answers a student might give

def reference_loop(ckpt_dir, steps, save_every, *, attempt=0, fault=None, **setup):
    return resumable_train(ckpt_dir, steps, save_every, attempt=attempt, fault=fault, **setup)["losses"]


def stub(*args, **kwargs):
    raise NotImplementedError("Exercise 12.1: replace this line with your solution")


class StubGuard(SpikeGuard):
    def decide(self, loss, grad_norm):
        raise NotImplementedError("Exercise 12.3: replace this line with your solution")


# ---------------------------------------------------------------- the references pass

def test_references_pass_every_checker():
    for exercise_id, code, detail in [
            ("12.4", (job_mtbf_hours, young_interval), "Young's interval"),
            ("12.3", (SpikeGuard,), "rolled back identically"),
            ("12.2", (find_divergent_replicas,), "a 1-ulp flip"),
            ("12.1", (reference_loop,), "matched the uninterrupted run bit for bit")]:
        result = distlab.check(exercise_id, *code, quiet=True)
        assert result.status == "passed" and result.points == result.max_points, result
        assert detail in result.detail


def test_quiz_answers_and_hints():
    answers = {"Q12.1": 3.093, "Q12.2": young_interval(60, 54 * 24 / 419 * 3600) / 60, "Q12.3": "b", "Q12.4": "c",
               "Q12.5": "c", "Q12.6": "b", "Q12.7": 2}
    for question, answer in answers.items():
        assert distlab.check(question, answer, quiet=True).status == "passed", question
    wrong = distlab.check("Q12.2", math.sqrt(60 * 11_134) / 60, quiet=True)  # the hint: where, not how
    assert wrong.status == "failed" and "section 'How often to checkpoint'" in wrong.detail


@pytest.mark.parametrize("exercise_id,code", [("12.1", (stub,)), ("12.2", (stub,)), ("12.3", (StubGuard,)),
                                               ("12.4", (stub, stub))])
def test_stub_is_not_attempted(exercise_id, code, capsys):
    result = distlab.check(exercise_id, *code)
    assert result.status == "not attempted" and result.points == 0
    assert "(not attempted)" in capsys.readouterr().out
