"""Lab 07: answers students plausibly write, each run through its checker: every one fails, naming the mistake.

The right answers are the solution notebook's own exercise cells, executed into one namespace as in a kernel.
A wrong answer is that same code with the one line a student gets wrong changed (the table shows the line
before and after), so each row is exactly one mistake, and the right answer passes beside it.
"""

from pathlib import Path

import pytest

from distlab.grading import lab07
from wrong_answers import checker_tests, exercise_cells

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_thread")]

NOTEBOOK = Path(__file__).resolve().parents[2] / "solutions" / "07_ring_attention.ipynb"
ANSWERS = {"7.1": ("online_softmax_attention",), "7.2": ("merge_partials", "blockwise_attention"),
           "7.3": ("my_ring_attention",), "7.4": ("zigzag_positions", "causal_ring_attention"),
           "7.5": ("MyRingAttention",), "7.6": ("ulysses_attention",)}
IMPORTS = ("import math\nimport torch\nimport torch.distributed as dist\nimport torch.nn.functional as F\n"
           "from distlab.context_parallel import (attention_block, attention_block_backward, layout_positions, "
           "merge_attention, ring_attention_forward, ring_pass)\n")
CELLS = exercise_cells("07_ring_attention.ipynb", ANSWERS)


def answer(exercise: str, *changes: tuple[str, str]) -> list:
    """The notebook's answer to ``exercise``, with each line ``old`` replaced by ``new`` (a student's mistake)."""
    source = CELLS[exercise]
    for old, new in changes:
        assert source.count(old) == 1, f"the solution of {exercise} no longer holds {old!r} once"
        source = source.replace(old, new)
    namespace = {"__name__": "lab07_notebook"}
    exec(IMPORTS + source, namespace)  # noqa: S102  the solution notebook's own exercise code
    return [namespace[name] for name in ANSWERS[exercise]]


MERGE, BLOCKWISE = answer("7.2")
MERGE_OUT = ("    out = out_a * torch.exp(lse_a - finite).unsqueeze(-1) + out_b * torch.exp(lse_b - finite)"
             ".unsqueeze(-1)\n")
ZIGZAG = answer("7.4")[0]

# (exercise, what the student did, the answer's functions, what the failure message must say)
WRONG = [
    ("7.1", "old sums never rescaled", answer("7.1", ("            l = l * rescale + p.sum(-1)\n",
                                                      "            l = l + p.sum(-1)\n"),
                                              ("            acc = acc * rescale.unsqueeze(-1) + p @ v_block\n",
                                               "            acc = acc + p @ v_block\n")), r"exp\(m_old - m_new\)"),
    ("7.1", "scores not scaled by 1/sqrt(d)", answer("7.1", ("    scale = 1.0 / math.sqrt(q.shape[-1])\n",
                                                             "    scale = 1.0\n")), r"not scaled"),
    ("7.1", "accumulator not divided by l", answer("7.1", ("    return acc / l.unsqueeze(-1), m + torch.log(l)",
                                                           "    return acc, m + torch.log(l)")), r"divide it by"),
    ("7.1", "lse without the running max", answer("7.1", ("    return acc / l.unsqueeze(-1), m + torch.log(l)",
                                                          "    return acc / l.unsqueeze(-1), torch.log(l)")),
     r"add the running max back"),
    ("7.1", "running sum not rescaled (the accumulator is)",
     answer("7.1", ("            l = l * rescale + p.sum(-1)\n", "            l = l + p.sum(-1)\n")),
     r"a stream of one block is right, so the update"),
    ("7.1", "scores multiplied by sqrt(d)", answer("7.1", ("    scale = 1.0 / math.sqrt(q.shape[-1])\n",
                                                           "    scale = math.sqrt(q.shape[-1])\n")),
     r"a stream of one block already differs"),
    ("7.2", "query blocks stop one token early",
     [MERGE, answer("7.2", ("    for q_start in range(0, q.shape[2], block_size):",
                            "    for q_start in range(0, q.shape[2] - 1, block_size):"))[1]],
     r"query positions, expected"),
    ("7.2", "parts added", [answer("7.2", (MERGE_OUT, "    out = out_a + out_b\n"))[0], BLOCKWISE],
     r"out_a \+ out_b"),
    ("7.2", "parts averaged", [answer("7.2", (MERGE_OUT, "    out = (out_a + out_b) / 2\n"))[0], BLOCKWISE],
     r"mean of the parts"),
    ("7.2", "lse as the larger part's", [answer("7.2", ("    lse = torch.logaddexp(lse_a, lse_b)\n",
                                                         "    lse = torch.maximum(lse_a, lse_b)\n"))[0], BLOCKWISE],
     r"max\(lse_a, lse_b\)"),
    ("7.2", "causal blocks skipped but the diagonal block unmasked",
     [MERGE, answer("7.2", ("            k_pos = torch.arange(k_start, k_stop) if causal else None\n",
                            "            k_pos = None\n"),
                    ("        q_pos = torch.arange(q_start, q_stop) if causal else None\n",
                     "        q_pos = None\n"))[1]], r"diagonal block is not masked"),
    ("7.3", "transfer posted after the block's compute",
     answer("7.3", ("        block = attention_block(q, kv[0], kv[1])\n        out, lse = block if out is None else "
                    "merge_attention(out, lse, *block)\n", ""),
            ("        if step < world - 1:  # post", "        block = attention_block(q, kv[0], kv[1])\n"
             "        out, lse = block if out is None else merge_attention(out, lse, *block)\n"
             "        if step < world - 1:  # post")), r"posted after .* compute began"),
    ("7.3", "a block sent after the last step too",
     answer("7.3", ("        if step < world - 1:  # post", "        if True:  # post"),
            ("        if step < world - 1:\n            for request", "        if True:\n            for request")),
     r"nothing after the last step"),
    ("7.4", "zig-zag chunks in the wrong order",
     [answer("7.4", ("    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk), torch.arange(late * chunk, "
                     "(late + 1) * chunk)])", "    return torch.cat([torch.arange(late * chunk, (late + 1) * chunk), "
                                              "torch.arange(rank * chunk, (rank + 1) * chunk)])"))[0],
      answer("7.4")[1]], r"rank r holds chunk r, then chunk 2N-1-r"),
    ("7.4", "blocks masked with the wrong sender, (rank + step) % N: right on 2 ranks only",
     [ZIGZAG, answer("7.4", ("positions_of((rank - step) % world)", "positions_of((rank + step) % world)"))[1]],
     r"positions of the rank it came from"),
    ("7.4", "every block masked with this rank's own positions",
     [ZIGZAG, answer("7.4", ("positions_of((rank - step) % world)", "positions_of(rank)"))[1]],
     r"positions of the rank it came from"),
    ("7.5", "the accumulators stay at home", answer("7.5", ("                dkv = dkv_incoming\n            dkv[0]",
                                                            "                pass\n            dkv[0]"),
                                                    ("            dkv = dkv_incoming\n        return",
                                                     "            pass\n        return")),
     r"receive the block's accumulator from the left"),
    ("7.5", "no last hop home", answer("7.5", ("            dkv = dkv_incoming\n        return",
                                               "            pass\n        return")), r"one more hop"),
    ("7.5", "the last accumulator never waited for",
     answer("7.5", ("            for request in grad_requests:\n                request.wait()\n"
                    "            dkv = dkv_incoming\n        return",
                    "            dkv = dkv_incoming\n        return")),
     r"never waited for"),
    ("7.5", "K/V passed on after the last step too",
     answer("7.5", ("            if step < world - 1:\n                incoming", "            if step < world:\n"
                    "                incoming"),
            ("            if step < world - 1:\n                for request in kv_requests",
             "            if step < world:\n                for request in kv_requests")), r"sent .* bytes, expected"),
    ("7.6", "heads % N not refused", answer("7.6", ("    if h % world:\n", "    if False:\n")), r"raise a ValueError"),
    ("7.6", "head groups reassembled in the wrong order",
     answer("7.6", ("        return recv.permute(1, 2, 0, 3, 4).reshape(b, h // world, world * t, d)",
                    "        return recv.permute(1, 2, 3, 0, 4).reshape(b, h // world, world * t, d)")),
     r"sequence chunks in rank order"),
]


# every numeric quiz key with decimals, as the notebook would print it (issue 27 item 8)
KEYS = {q.id: (f"{q.answer:.2f}",) + ((f"{q.answer:,.0f} ",) if q.answer > 100 else ())
        for q in lab07.EXERCISES if q.id.startswith("Q") and isinstance(q.answer, float) and q.answer % 1}

test_wrong_answer_fails_naming_the_mistake, test_right_answer_passes, test_demos_do_not_give_the_quiz_away = \
    checker_tests(WRONG, {exercise: answer(exercise) for exercise in ANSWERS}, NOTEBOOK, KEYS)
