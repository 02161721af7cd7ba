"""Lab 06: answers students plausibly write, each run through its checker: every one fails, naming the mistake.

The right answers are the solution notebook's own exercise cells, executed into one namespace as in a kernel.
A wrong answer is that same code with the one line a student gets wrong changed (the table shows the line
before and after), so each row is exactly one mistake, and the right answer passes beside it.
"""

from pathlib import Path

import pytest

from distlab.grading import lab06
from wrong_answers import checker_tests, exercise_cells

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_thread")]

NOTEBOOK = Path(__file__).resolve().parents[2] / "solutions" / "06_pipeline_parallel.ipynb"
ANSWERS = {"6.1": ("even_partition", "balanced_partition"), "6.2": ("gpipe", "one_f_one_b"),
           "6.3": ("interleaved_1f1b",), "6.4": ("execute",), "6.5": ("zero_bubble_h1",), "6.6": ("zero_bubble_v",)}
CELLS = exercise_cells("06_pipeline_parallel.ipynb", ANSWERS)
IMPORTS = ("import torch\nimport distlab\nfrom distlab.pipeline_parallel import Action, with_p2p, channels, lm_loss, "
           "format_schedule, validate, simulate, interleaved_bubble_fraction, peak_in_flight\n")


def answer(exercise: str, old: str = "", new: str = "") -> list:
    """The notebook's answer to ``exercise``, with the line ``old`` replaced by ``new`` (a student's mistake)."""
    source = CELLS[exercise]
    if old:
        assert source.count(old) == 1, f"the solution of {exercise} no longer holds {old!r}"
        source = source.replace(old, new)
    source = source.split("\nwith distlab.needs")[0]  # the definitions, not the demo below them
    namespace = {"__name__": "lab06_notebook"}
    exec(IMPORTS + source, namespace)  # noqa: S102  the solution notebook's own exercise code
    return [namespace[name] for name in ANSWERS[exercise]]


def even_remainder_last(n_layers, n_stages):
    """6.1: the remainder of the division all goes to the last stage (10 on 4: 2, 2, 2, 4)."""
    if n_stages > n_layers:
        raise ValueError(f"cannot split {n_layers} layers into {n_stages} stages")
    base = n_layers // n_stages
    bounds = [s * base for s in range(n_stages)] + [n_layers]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def greedy_balanced(costs, n_stages, first_extra=0.0, last_extra=0.0):
    """6.1: fill each stage up to the average cost (the ends counted), then start the next one."""
    costs = [c + (first_extra if i == 0 else 0) + (last_extra if i == len(costs) - 1 else 0)
             for i, c in enumerate(costs)]
    target = sum(costs) / n_stages
    stages, start, total = [], 0, 0.0
    for i, cost in enumerate(costs):
        left = len(costs) - i  # layers still to place, this one included
        if total + cost > target and i > start and len(stages) < n_stages - 1 and left >= n_stages - len(stages) - 1:
            stages.append(range(start, i))
            start, total = i, 0.0
        total += cost
    return stages + [range(start, len(costs))]


def balanced_ignoring_ends(costs, n_stages, first_extra=0.0, last_extra=0.0):
    """6.1: the optimal split of the blocks alone, forgetting the embedding and the head."""
    return answer("6.1")[1](costs, n_stages)


def even_no_check(n_layers, n_stages):
    """6.1: no ValueError for more stages than layers (some stages come out empty)."""
    base, extra = divmod(n_layers, n_stages)
    bounds = [0]
    for s in range(n_stages):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


EVEN, BALANCED = answer("6.1")
GPIPE, ONE_F_ONE_B = answer("6.2")
ONE_F_ONE_B_LINE = "        warmup = min(p - r - 1, m)\n"

# (exercise, what the student did, the answer's functions, what the failure message must say)
WRONG = [
    ("6.1", "the remainder all on the last stage", (even_remainder_last, BALANCED), r"differ by more than one"),
    ("6.1", "no ValueError for too many stages", (even_no_check, BALANCED), r"expected a ValueError"),
    ("6.1", "greedy fill up to the average", (EVEN, greedy_balanced), r"greedy fill is not enough"),
    ("6.1", "embedding and head forgotten", (EVEN, balanced_ignoring_ends), r"add first_extra"),
    ("6.2", "1F1B warm-up one forward too long (p - r)",
     (GPIPE, answer("6.2", ONE_F_ONE_B_LINE, "        warmup = min(p - r, m)\n")[1]), r"at most p - r"),
    ("6.2", "1F1B warm-up the same p - 1 on every rank",
     (GPIPE, answer("6.2", ONE_F_ONE_B_LINE, "        warmup = min(p - 1, m)\n")[1]), r"at most p - r"),
    ("6.2", "1F1B warm-up written for p = 2 (one forward on rank 0)",
     (GPIPE, answer("6.2", ONE_F_ONE_B_LINE, "        warmup = min(1 if r == 0 else 0, m)\n")[1]),
     r"idle .* should idle"),
    ("6.2", "1F1B warm-up not capped at m (m < p)",
     (GPIPE, answer("6.2", ONE_F_ONE_B_LINE, "        warmup = p - r - 1\n")[1]), r"outside 0\.\.|never runs"),
    ("6.2", "GPipe given 1F1B's order", (ONE_F_ONE_B, ONE_F_ONE_B), r"GPipe runs every forward"),
    ("6.3", "v = 1 warmed up like v >= 2 (2(p-r-1)): not 1F1B",
     answer("6.3", "        warmup = min(2 * (p - r - 1) + (v - 1) * p if v > 1 else p - r - 1, total)",
            "        warmup = min(2 * (p - r - 1) + (v - 1) * p, total)"), r"v = 1 is 1F1B"),
    ("6.3", "backward chunks in forward order (not reversed)",
     answer("6.3", "        if not forward:\n            chunk = v - 1 - chunk\n", ""),
     r"backward goes through the stages in reverse"),
    ("6.3", "m not a multiple of p accepted",
     answer("6.3", "    if m % p:\n", "    if False:\n"), r"expected a ValueError"),
    ("6.4", "activations sent to (s - 1) % p: right on 2 ranks only",
     answer("6.4", "outputs[(mb, s)].detach(), (s + 1) % p))", "outputs[(mb, s)].detach(), (s - 1) % p))"),
     r"deadlocked.*\(s \+ 1\) % p"),
    ("6.4", "loss not divided by m", answer("6.4", "                    out = loss / m\n",
                                            "                    out = loss\n"), r"m=\d times too large"),
    ("6.4", "loss divided by m twice", answer("6.4", "                    out = loss / m\n",
                                              "                    out = loss / m / m\n"), r"m=\d times too small"),
    ("6.4", "sends never waited for before returning",
     answer("6.4", "    for work in sends:\n        work.wait()\n", ""), r"never waited for .* wait for every send"),
    ("6.4", "micro-batch data one off: micro_batches[mb - 1]",
     answer("6.4", "            x, y = micro_batches[mb]\n", "            x, y = micro_batches[mb - 1]\n"),
     r"loss for micro-batch 0 is .*, micro-batch \d+'s.*index micro_batches"),
    ("6.5", "no weight gradient deferred", answer("6.5", "deferred, w = min(p - r - 1, m), min(r, m), 0",
                                                  "deferred, w = min(p - r - 1, m), 0, 0"), r"idle .* should idle"),
    ("6.5", "every weight gradient deferred to the cool-down",
     answer("6.5", "deferred, w = min(p - r - 1, m), min(r, m), 0", "deferred, w = min(p - r - 1, m), m, 0"),
     r"idle .* should idle|in flight"),
    ("6.6", "a W before its I", answer("6.6", '            for kind in "FIW":', '            for kind in "FWI":'),
     r"comes before .*\(the weight gradient follows the input gradient\)"),
    ("6.6", "the V mirrored the wrong way: second stage p + r (looped)",
     answer("6.6", "down, up = r, 2 * p - 1 - r", "down, up = r, p + r"), r"looped, as interleaved 1F1B"),
    ("6.6", "the second stage on the mirrored rank, 2p - 1 - r down and r up",
     answer("6.6", "down, up = r, 2 * p - 1 - r", "down, up = 2 * p - 1 - r, r"), r"goes down first"),
    ("6.6", "full backwards where ZB-V splits them",
     answer("6.6", '            for kind in "FIW":', '            for kind in "FB":'), r"uses full backwards \(B\)"),
    ("6.6", "warm-up one forward too long, 2(p - r)",
     answer("6.6", "for _ in range(2 * (p - r) - 1):", "for _ in range(2 * (p - r)):"),
     r"first phase runs 2\(p - r\) - 1 forwards"),
    ("6.6", "no padding to 2p - 1 micro-batches for small m",
     answer("6.6", "n = max(m, 2 * p - 1)", "n = m"), r"never runs|deadlocks|idle|in flight|outside"),
    ("6.6", "weight gradients not deferred in the cool-down",
     answer("6.6", '            add("I", down)\n            add("I", up)\n', '            add("I", down)\n'
            '            add("W", down)\n            add("I", up)\n            add("W", up)\n'),
     r"idle .* ZB-V idles|in flight|comes before"),
]


# Q6.1's and Q6.3's keys as the notebook would print them (issue 27 item 8)
KEYS = {q.id: (f"{q.answer:.4f}", f"{q.answer:.3f}") for q in lab06.EXERCISES if q.id in ("Q6.1", "Q6.3")}

test_wrong_answer_fails_naming_the_mistake, test_right_answer_passes, test_demos_do_not_give_the_quiz_away = \
    checker_tests(WRONG, {exercise: answer(exercise) for exercise in ANSWERS}, NOTEBOOK, KEYS)
