"""Lab 11: answers students plausibly write, each run through its checker: every one fails, naming the mistake.

The right answers are the solution notebook's own exercise cells, executed into one namespace as in a kernel.
A wrong answer is that same code with the one line a student gets wrong changed (the table shows the line
before and after), so each row is exactly one mistake, and the right answer passes beside it. The four
exercises are independent (11.4's checker compares with the planner, not with 11.2's run), so a wrong answer
to one never fails another.
"""

import re

import pytest

import distlab
from wrong_answers import exercise_cells

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("one_thread")]

ANSWERS = {"11.1": "grid_groups", "11.2": "sync_gradients", "11.3": "model_flops_utilization",
           "11.4": "predicted_bytes"}
CELLS = exercise_cells("11_3d_parallelism.ipynb", ANSWERS)


def answer(exercise: str, old: str = "", new: str = ""):
    """The notebook's answer to ``exercise``, with the line ``old`` replaced by ``new`` (a student's mistake)."""
    source = CELLS[exercise]
    if old:
        assert source.count(old) == 1, f"the solution of {exercise} no longer holds {old!r}"
        source = source.replace(old, new)
    source = source.split("\ndistlab.check")[0]  # the definition, not the check below it
    namespace = {"__name__": "lab11_notebook"}
    exec("import torch\nimport torch.distributed as dist\n" + source, namespace)  # noqa: S102  the notebook's code
    return namespace[ANSWERS[exercise]]


# exercise, the solution's line, the student's line, what the failure must say
WRONG = [
    # 11.1: the grid
    ("11.1", '"pp": grid.permute(0, 2, 1).reshape(-1, pp).tolist(),', '"pp": grid.reshape(-1, pp).tolist(),',
     r"rank \d+'s pp group is \[.*\], expected \[.*\]: PP ranks are tp apart: take every tp-th rank"),
    ("11.1", '"tp": grid.reshape(-1, tp).tolist()}',
     '"tp": [list(range(i, world, world // tp)) for i in range(world // tp)]}',
     r"rank \d+'s tp group is .*: TP is the innermost axis: take consecutive ranks"),
    ("11.1", '"dp": grid.permute(1, 2, 0).reshape(-1, dp).tolist(),  # the axis last: one group per row',
     '"dp": grid.reshape(-1, dp).tolist(),', r"dp group .*DP ranks are pp·tp apart|dp groups .* repeat or miss"),
    ("11.1", "    if world != dp * pp * tp:\n", "    if world != dp * pp:\n",
     r"dp=2, pp=2, tp=2: grid_groups\(8, 2, 2, 2\) raised ValueError .*check the condition before your raise"),
    ("11.1", "    if world != dp * pp * tp:\n", "    if world < 0:\n",
     r"raised RuntimeError.*a world of 6 ranks is not 2 × 2 × 2 = 8: .*raise ValueError"),
    # 11.3: MFU (issue 27: "ratio 0.427" was a 2·N for 6·N slip, unnamed)
    ("11.3", "6 * matmul_params + 12 * n_layer", "2 * matmul_params + 12 * n_layer",
     r"ratio 0\.427.*2·N for the weights: training counts 6·N"),
    ("11.3", "6 * matmul_params + 12 * n_layer * d_model * seq_len",
     "2 * matmul_params + 4 * n_layer * d_model * seq_len",
     r"ratio 0\.333.*forward FLOPs only"),
    ("11.3", "6 * matmul_params + 12 * n_layer * d_model * seq_len", "6 * matmul_params",
     r"attention FLOPs .* are missing"),
    ("11.3", "6 * matmul_params + 12 * n_layer * d_model * seq_len",
     "6 * matmul_params + 6 * n_layer * d_model * seq_len",
     r"half the attention FLOPs"),
    ("11.3", "/ (gpus * peak_flops)", "/ peak_flops", r"the peak is per GPU: divide by gpus × peak"),
    ("11.3", "return flops_per_token * tokens_per_second / (gpus * peak_flops)",
     "return 100 * flops_per_token * tokens_per_second / (gpus * peak_flops)", r"a percentage: return the fraction"),
    # 11.4: the bytes per axis
    ("11.4", "        per_micro += 3 * micro_batch * cfg.seq_len * 4  # the loss", "        # the loss",
     r"the loss's three all-reduces"),
    ("11.4", "        per_micro += activation  # the output layer's f: an all-reduce in backward\n", "",
     r"one activation-sized all-reduce per micro-batch \(the output layer's f"),
    ("11.4", "        if pp == 1:\n            per_micro += activation",
     "        if True:\n            per_micro += activation",
     r"the embedding's all-reduce is on stage 0"),
    ("11.4", "out[\"pp\"] = m * activation * (1 if pp == 2 else 2)", "out[\"pp\"] = m * activation * 2",
     r"with PP = 2 each rank sends one way only"),
    ("11.4", "out[\"pp\"] = m * activation * (1 if pp == 2 else 2)", "out[\"pp\"] = m * activation",
     r"a middle stage sends both ways"),
]

# 11.2 runs 8 ranks per check: the three mistakes whose update factors differ, and the one with no factor
WRONG_SYNC = [
    ("11.2", "    flat /= dp\n", "", r"2x too big — summed over the DP group, not averaged"),
    ("11.2", "    flat /= dp\n", "    flat /= dist.get_world_size()\n",
     r"4x too small — divided by the world size \(8\) instead of the DP group's \(2\)"),
    ("11.2", "    dist.all_reduce(flat, group=dp_group)\n", "",
     r"ranks \d and \d \(one DP group\) end the step with different .*not averaged over the DP group"),
]


@pytest.mark.parametrize("exercise,old,new,named", WRONG, ids=lambda x: x if len(x) < 8 else None)
def test_a_wrong_answer_fails_and_names_the_mistake(exercise, old, new, named):
    result = distlab.check(exercise, answer(exercise, old, new), quiet=True)
    assert result.status == "failed", (exercise, new, result)
    assert re.search(named, result.detail), result.detail


@pytest.mark.parametrize("exercise,old,new,named", WRONG_SYNC, ids=["summed", "world size", "no all-reduce"])
def test_a_wrong_gradient_sync_fails_and_names_the_mistake(exercise, old, new, named):
    result = distlab.check(exercise, answer(exercise, old, new), quiet=True)
    assert result.status == "failed", result
    assert re.search(named, result.detail), result.detail


@pytest.mark.parametrize("exercise", ["11.1", "11.3", "11.4"])
def test_the_notebook_answer_passes(exercise):
    assert distlab.check(exercise, answer(exercise), quiet=True).status == "passed"


def test_the_notebook_gradient_sync_passes():
    assert distlab.check("11.2", answer("11.2"), quiet=True).status == "passed"
