"""The quizzes of labs 00-03: every answer is what distlab's own functions compute, a wrong answer fails with
the hint that points back to the lab, and a blank one is 'not attempted'."""

import json
import re
from pathlib import Path

import pytest
import torch

from distlab import collectives as C
from distlab import memory
from distlab.data_parallel import pytorch_buckets
from distlab.flops import mfu
from distlab.grading import lab00, lab01, lab02, lab03
from distlab.grading.quiz import CheckFailed

ANSWERS = {
    # lab 00: ranks on nodes of 8 GPUs; a sum over ranks; the comm table's 2(N-1)/N * M
    "Q0.1": 11 % 8, "Q0.2": sum(r + 1 for r in range(8)), "Q0.3": "b",
    "Q0.4": C.ring_all_reduce_bytes(1000 * 4, 4), "Q0.5": "b",
    # lab 01: distlab.memory is the source of truth
    "Q1.1": memory.bytes_per_param(0, 1).total, "Q1.2": memory.bytes_per_param(3, 64).total,
    "Q1.3": round(memory.bytes_per_param(1, 10**12).total, 6),
    "Q1.4": round(memory.PRESETS["70B"].memory(64, 3).states / memory.GiB, 2),
    "Q1.5": memory.activation_bytes_per_layer(1, 1, 1, 1, checkpointing=True), "Q1.6": "c",
    # lab 02: the cost models
    "Q2.1": C.ring_all_reduce_bytes(1e9, 8) / 1e9, "Q2.2": C.ring_all_reduce_time(7e9 * 2, 8, 0.0, 450e9) * 1e3,
    "Q2.3": "b", "Q2.4": C.crossover_bytes(4, 10e-6, 100e9) / 1e6, "Q2.5": C.tree_steps(1024), "Q2.6": "c",
    # lab 03; Q3.3: PyTorch's rebuilt buckets (1 MiB first, then 25 MiB) over 30 MB of 1 kB fp32 tensors
    "Q3.1": C.ring_all_reduce_bytes(7e9 * 2, 8) / 1e9, "Q3.2": 4,
    "Q3.3": len(pytorch_buckets([torch.nn.Parameter(torch.empty(250)) for _ in range(30_000)])), "Q3.4": "b",
    "Q3.5": mfu(6 * 7e9, 3000, 989e12), "Q3.6": "d",
}
QUIZ = {q.id: q for module in (lab00, lab01, lab02, lab03) for q in module.QUIZ}


def test_every_lab_has_at_least_five_questions_and_all_are_answered_here():
    for module in (lab00, lab01, lab02, lab03):
        assert len(module.QUIZ) >= 5 and all(q.is_quiz for q in module.QUIZ)
        assert set(q.id for q in module.QUIZ) <= set(e.id for e in module.EXERCISES)
    assert set(QUIZ) == set(ANSWERS)


@pytest.mark.parametrize("question_id", sorted(ANSWERS))
def test_the_answer_computed_by_distlab_is_accepted(question_id):
    assert QUIZ[question_id].checker(ANSWERS[question_id]) == "correct"


@pytest.mark.parametrize("question_id", sorted(ANSWERS))
def test_a_wrong_answer_fails_with_a_hint_and_a_blank_is_not_attempted(question_id):
    right = ANSWERS[question_id]
    wrong = ("a" if right != "a" else "b") if isinstance(right, str) else right * 3 + 1
    with pytest.raises(CheckFailed, match=r"is not right: .*(section|exercise|'|chapter)"):
        QUIZ[question_id].checker(wrong)
    with pytest.raises(NotImplementedError):
        QUIZ[question_id].checker(...)


def test_q3_3_follows_the_chapters_rule_for_many_small_tensors():
    """Q3.3 asks about "many small tensors": its key is the rule on 1 kB tensors for every number it can ask (80 MB:
    1 MiB + 3 x 25 MiB = 79.7 MB < 80 MB, so 5 buckets; 100 kB tensors happened to fill exactly 4)."""
    for values, key, _ in QUIZ["Q3.3"].checker.variants():
        params = [torch.nn.Parameter(torch.empty(250, device="meta")) for _ in range(values["megabytes"] * 1000)]
        assert key == len(pytorch_buckets(params)), values
    assert QUIZ["Q3.3"].checker.variation.answer({"megabytes": 80}) == 5


def test_lab_02_quiz_hints_point_at_the_section_that_answers_them():
    """Q2.2 is the at-scale calculation (section 5); Q2.3 and Q2.4 the alpha-beta model and its crossover (3)."""
    notebook = json.loads((Path(__file__).resolve().parents[2] / "solutions" / "02_collectives.ipynb").read_text())
    headings = {m[1]: m[2] for cell in notebook["cells"] if cell["cell_type"] == "markdown"
                for m in re.finditer(r"^## (\d+)\. (.*)$", "".join(cell["source"]), re.MULTILINE)}
    for question, words in {"Q2.2": "At scale", "Q2.3": "α–β model", "Q2.4": "α–β model"}.items():
        with pytest.raises(CheckFailed) as wrong:
            right = ANSWERS[question]
            QUIZ[question].checker(("a" if right != "a" else "b") if isinstance(right, str) else -1.0)
        section = re.search(r"section (\d+)", str(wrong.value))[1]
        assert words in headings[section], (question, section, headings[section])
