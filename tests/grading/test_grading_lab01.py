"""Lab 01 checkers: the reference passes, wrong formulas fail naming the case, stubs are 'not attempted'."""

import pytest

import distlab
from distlab.grading import CheckFailed
from distlab.grading.lab01 import (
    EXERCISES,
    check_activation_bytes,
    check_activation_bytes_per_layer,
    check_bytes_per_param,
    check_training_memory_gib,
)
from distlab.memory import GiB, activation_bytes_per_layer, bytes_per_param


def ref_bytes_per_param(stage, n):
    return bytes_per_param(stage, n).total


def ref_activation_bytes(s, b, h, a, n_layer, ckpt):
    return n_layer * activation_bytes_per_layer(s, b, h, a, checkpointing=ckpt)


def ref_training_memory_gib(preset, n, stage, micro, ckpt):
    return preset.memory(n, stage, micro_batch=micro, checkpointing=ckpt).total / GiB


def test_exercise_ids():
    assert [e.id for e in EXERCISES if not e.is_quiz] == ["1.1", "1.2", "1.3", "1.4"]
    assert all(e.points > 0 for e in EXERCISES)


def test_reference_passes_every_checker():
    assert "cases" in check_bytes_per_param(ref_bytes_per_param)
    assert check_activation_bytes_per_layer(lambda s, b, h, a: activation_bytes_per_layer(s, b, h, a))
    assert check_activation_bytes(ref_activation_bytes)
    assert check_training_memory_gib(ref_training_memory_gib)
    for exercise, fn in zip(EXERCISES, [ref_bytes_per_param, activation_bytes_per_layer,
                                         ref_activation_bytes, ref_training_memory_gib]):
        result = distlab.check(exercise.id, fn, quiet=True)
        assert result.status == "passed" and result.points == exercise.points, result


def test_ddp_everywhere_fails_naming_the_case():
    with pytest.raises(CheckFailed, match=r"for zero_stage=0, world_size=1: expected 16 bytes/param, got 17"):
        check_bytes_per_param(lambda stage, n: 17)
    with pytest.raises(CheckFailed, match=r"for zero_stage=1, world_size=2: expected 10 bytes/param, got 16"):
        check_bytes_per_param(lambda stage, n: 16.0)


def test_swapped_stage_fails():
    def wrong(stage, n):  # ZeRO-2 written as 4 + 12/N
        return {0: 16, 1: 4 + 12 / n, 2: 4 + 12 / n, 3: 16 / n}[stage]
    with pytest.raises(CheckFailed, match=r"zero_stage=2, world_size=2: expected 9 bytes/param, got 10"):
        check_bytes_per_param(wrong)


def test_activation_mistakes_fail():
    with pytest.raises(CheckFailed, match=r"for seq_len=4096, batch=1, d_model=4096, n_head=32: expected"):
        check_activation_bytes_per_layer(lambda s, b, h, a: s * b * h * 34)  # forgot the attention scores
    with pytest.raises(CheckFailed, match=r"checkpointing=True"):
        check_activation_bytes(lambda s, b, h, a, L, ckpt: L * activation_bytes_per_layer(s, b, h, a))
    with pytest.raises(CheckFailed, match=r"expected a number, got None"):
        check_activation_bytes(lambda *args: None)


def test_training_memory_mistakes_fail():
    # forgot the activations
    with pytest.raises(CheckFailed, match=r"for the 7B model, world_size=\d+, zero_stage=\d, micro_batch=\d"):
        check_training_memory_gib(lambda p, n, stage, micro, ckpt: p.n_params * bytes_per_param(stage, n).total / GiB)
    # reported GB instead of GiB
    with pytest.raises(CheckFailed, match=r"GiB"):
        check_training_memory_gib(lambda *args: ref_training_memory_gib(*args) * GiB / 1e9)


def test_stub_is_not_attempted_not_failed():
    def stub(*args):
        raise NotImplementedError("Exercise 1.1: replace this line with your solution")
    with pytest.raises(NotImplementedError):
        check_bytes_per_param(stub)
    result = distlab.check("1.1", stub, quiet=True)
    assert result.status == "not attempted" and result.points == 0
    crash = distlab.check("1.2", lambda *a: 1 / 0, quiet=True)
    assert crash.status == "failed" and "ZeroDivisionError" in crash.detail
