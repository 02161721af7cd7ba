"""The one tolerance rule every comparison in grading/ uses (``harness.tolerance``): relative and absolute, from the
dtype's epsilon and the computation's size; and a failure's hint chosen by what differs, never "subtract the max" for
a difference of rounding's size."""

import math

import pytest
import torch

from distlab.grading import CheckFailed, harness
from distlab.grading.harness import ATOL, ROUNDING_ULPS, assert_close, is_close, tolerance
from distlab.grading.lab05 import EXP_OVERFLOWS_FP32_ABOVE, _loss_mistake


def test_the_rule_scales_with_the_magnitude_the_dtype_and_the_terms():
    one, big = torch.tensor([1.0]), torch.tensor([128.0])
    eps = torch.finfo(torch.float32).eps
    assert tolerance(one, terms=1).rtol == pytest.approx(ROUNDING_ULPS * eps)
    assert tolerance(big, terms=1).atol == pytest.approx(128 * tolerance(one, terms=1).atol)  # scaled, not fixed
    assert tolerance(one, terms=400).rtol == pytest.approx(20 * tolerance(one, terms=1).rtol)  # grows like sqrt(n)
    assert tolerance(one.double()).rtol < 1e-12 < tolerance(one).rtol  # float64 is held to float64's rounding
    assert tolerance(torch.tensor([0.001])).atol == tolerance(one).atol  # order one and below: order one's
    assert ATOL == tolerance(one).atol and 1e-5 < ATOL < 2e-5  # what "values of order one" meant before
    masked = torch.tensor([-math.inf, 2.0])
    assert math.isfinite(tolerance(masked).atol)  # a masked row's -inf is no magnitude


def test_16_bit_values_accumulate_in_fp32_and_round_once_more():
    bf16 = tolerance(torch.ones(1, dtype=torch.bfloat16), terms=64)
    fp32 = tolerance(torch.ones(1), terms=64)
    assert bf16.rtol == pytest.approx(fp32.rtol + 2 * torch.finfo(torch.bfloat16).eps)
    assert bf16.rtol < 0.02  # a wrong formula is still far outside


def test_a_checkers_own_tolerance_is_a_floor():
    assert tolerance(torch.ones(1), atol=1e-3).atol == 1e-3
    assert tolerance(torch.full((1,), 1e6), atol=1e-3).atol > 1e-3


def test_a_loss_of_128_off_by_fp32_rounding_passes_and_a_real_mistake_does_not():
    """Issue 44's 5.5: a loss of 127.991 off by 1.53e-05 (one unit in fp32's last place there) was failed at 1e-5."""
    expected = torch.tensor(127.991)
    got = expected + 1.53e-05
    assert is_close(got, expected)
    assert_close("case", "the loss", got, expected)
    with pytest.raises(CheckFailed, match=r"the loss differs from the reference by up to"):
        assert_close("case", "the loss", expected * 1.01, expected)


def test_a_difference_of_rounding_size_gets_no_hint_but_says_so():
    expected = torch.linspace(-3, 3, 50)
    with pytest.raises(CheckFailed) as failure:
        assert_close("case", "out", expected + 1e-4, expected, hint="subtract the max")
    assert "rounding's size" in str(failure.value) and "subtract the max" not in str(failure.value)
    with pytest.raises(CheckFailed, match=r": subtract the max$"):
        assert_close("case", "out", expected * 2, expected, hint="subtract the max")


def test_a_hint_can_be_chosen_by_what_differs():
    expected = torch.ones(4)
    def hint(got, want):
        return "a NaN: divide by zero?" if torch.isnan(got).any() else "off by a factor"
    with pytest.raises(CheckFailed, match=r": a NaN: divide by zero\?$"):
        assert_close("case", "x", torch.tensor([1.0, float("nan"), 1.0, 1.0]), expected, hint=hint)
    with pytest.raises(CheckFailed, match=r": off by a factor$"):
        assert_close("case", "x", expected * 2, expected, hint=hint)


def test_lab_05s_loss_hint_names_the_overflow_only_when_there_is_one():
    logits = 60 * torch.randn(2, 4, 48, generator=torch.Generator().manual_seed(0))
    loss, tokens = torch.tensor(127.991), 8
    assert logits.abs().max() > EXP_OVERFLOWS_FP32_ABOVE  # exp() past fp32's range: log(3.4e38) = 88.72
    assert math.log(torch.finfo(torch.float32).max) == pytest.approx(EXP_OVERFLOWS_FP32_ABOVE, abs=0.01)
    finite = torch.zeros(2, 4, 24)
    overflowed = _loss_mistake(torch.tensor(math.nan), finite, loss, tokens, logits)
    assert f"reach {logits.abs().max().item():.0f}" in overflowed and "subtract the max over the whole" in overflowed
    assert _loss_mistake(loss + 1.53e-05, finite, loss, tokens, logits) == ""  # round-off: nothing to fix
    assert "sum over the 8 tokens" in _loss_mistake(loss * tokens, finite, loss, tokens, logits)


def test_every_harness_comparison_goes_through_the_rule(monkeypatch):
    """assert_close and is_close both ask tolerance(): one place to change it."""
    calls = []
    real = harness.tolerance
    monkeypatch.setattr(harness, "tolerance", lambda *a, **k: calls.append(k) or real(*a, **k))
    harness.is_close(torch.ones(2), torch.ones(2))
    harness.assert_close("case", "x", torch.ones(2), torch.ones(2), terms=9)
    assert len(calls) == 2 and calls[1]["terms"] == 9
