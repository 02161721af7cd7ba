"""Lab 01: formulas students plausibly write, each run through its checker: every one fails, naming the term, stage
or flag to look at; the solution notebook's own answers pass."""

import pytest

from distlab.memory import GiB, activation_bytes_per_layer
from distlab.mutants import lab_source, reference_namespace
from wrong_answers import checker_tests

pytestmark = [pytest.mark.timeout(60)]

SOLUTION = reference_namespace(lab_source(1))[0]


def stage_2_as_stage_1(stage, n):
    return {0: 16, 1: 4 + 12 / n, 2: 4 + 12 / n, 3: 16 / n}[stage]


def floor_divided(stage, n):
    return {0: 16, 1: 4 + 12 // n, 2: 2 + 14 // n, 3: 16 // n}[stage]


def everything_sharded(stage, n):
    return 16 / n


def no_attention_scores(s, b, h, a):
    return s * b * h * 34


def scores_without_batch(s, b, h, a):
    return s * b * h * 34 + 5 * a * s * s


def wrong_constant(s, b, h, a):
    return s * b * h * 35 + 5 * a * s * s * b


def one_layer(s, b, h, a, n_layer, ckpt):
    return activation_bytes_per_layer(s, b, h, a, checkpointing=ckpt)


def flag_reversed(s, b, h, a, n_layer, ckpt):
    return n_layer * activation_bytes_per_layer(s, b, h, a, checkpointing=not ckpt)


def states_only(preset, n, stage, micro, ckpt):
    return preset.memory(n, stage, micro_batch=micro, checkpointing=ckpt).states / GiB


def in_gigabytes(preset, n, stage, micro, ckpt):
    return preset.memory(n, stage, micro_batch=micro, checkpointing=ckpt).total / 1e9


def one_sequence(preset, n, stage, micro, ckpt):
    return preset.memory(n, stage, micro_batch=1, checkpointing=ckpt).total / GiB


WRONG = [
    ("1.1", "stage 2 counted as stage 1", (stage_2_as_stage_1,), r"zero_stage=2.*that is stage 1's count \(2 \+ 2 \+ "
                                                                 r"12/N\); stage 2 shards the optimizer state and the "
                                                                 r"2 bytes of gradients"),
    ("1.1", "floor division", (floor_divided,), r"// rounds each share down to whole bytes: divide with /"),
    ("1.1", "every stage sharded", (everything_sharded,), r"zero_stage=0, world_size=2.*stage 0 \(DDP\) shards "
                                                          r"nothing"),
    ("1.2", "no attention scores", (no_attention_scores,), r"your part that grows with n_head is 0, expected "
                                                           r"5·a·s²·b"),
    ("1.2", "scores without the batch", (scores_without_batch,), r"batch=\d+.*your part that grows with n_head is "
                                                                 r"[\d.e+]+, expected 5·a·s²·b"),
    ("1.2", "35 bytes per element", (wrong_constant,), r"your part that does not grow with n_head is [\d.e+]+, "
                                                       r"expected 34·s·b·h"),
    ("1.3", "one layer only", (one_layer,), r"that is one layer's: multiply by n_layer = \d+"),
    ("1.3", "checkpointing flag reversed", (flag_reversed,), r"that is the count with(out)? checkpointing"),
    ("1.4", "model states only", (states_only,), r"that is the model states only: add the activations"),
    ("1.4", "GB, not GiB", (in_gigabytes,), r"that is in GB \(10⁹ bytes\): a GiB is 2³⁰ bytes"),
    ("1.4", "activations of one sequence", (one_sequence,), r"the activations are for one sequence: they scale with "
                                                            r"micro_batch = \d"),
]

RIGHT = {"1.1": (SOLUTION["bytes_per_param"],), "1.2": (SOLUTION["activation_bytes_per_layer"],),
         "1.3": (SOLUTION["activation_bytes"],), "1.4": (SOLUTION["training_memory_gib"],)}

test_wrong_answer_fails_naming_the_mistake, test_right_answer_passes = checker_tests(WRONG, RIGHT)
