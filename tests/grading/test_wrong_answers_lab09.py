"""Lab 09: answers students plausibly write, each run through its checker: every one fails, naming the mistake.

The right answers are the solution notebook's own code, executed into one namespace as in a kernel. Each wrong
answer below bends that code in one place (a small function or class); the table pairs it with a regex for the
words of the ✗ line that should send the student to the mistake. The last test runs the notebook's outlier cell
with an inverted scale, as Run All would after a failed 9.3 check, and reads the line it prints.
"""

import contextlib
import io
import math
import re
from pathlib import Path

import nbformat
import pytest
import torch

import distlab
from distlab.fp8 import FORMATS, DelayedScaling, decode, encode, fp8_matmul, quantize
from wrong_answers import solution_namespace

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_thread")]

NOTEBOOK = Path(__file__).resolve().parents[2] / "solutions" / "09_fp8.ipynb"
CELLS = nbformat.read(NOTEBOOK, as_version=4).cells


SOLUTION = solution_namespace("09_fp8.ipynb", 9)
ANSWERS = {"9.1": ("decode_fp8", "encode_fp8"), "9.2": ("MyLossScaler",),
           "9.3": ("quantize_blocks", "MyDelayedScaling"), "9.4": ("emulated_mm", "native_mm", "fp8_mm"),
           "9.5": ("MyFloat8Linear",)}


def answer(exercise: str, namespace: dict) -> list:
    return [namespace[name] for name in ANSWERS[exercise]]


# ---------------------------------------------------------------- 9.1: decode and encode


def decode_implicit_one_in_subnormals(code, fmt):
    """Subnormals decoded with the implicit leading 1 of a normal number."""
    exponent = (code >> fmt.mantissa_bits) & ((1 << fmt.exponent_bits) - 1)
    if exponent == 0 and code & 0x7F:
        sign = -1.0 if code & 0x80 else 1.0
        return sign * (1 + (code & ((1 << fmt.mantissa_bits) - 1)) / 2**fmt.mantissa_bits) * 2.0 ** (1 - fmt.bias)
    return decode(code, fmt)


def decode_unsigned_zero(code, fmt):
    """The sign bit dropped for zero: 0x80 decoded as +0.0."""
    value = decode(code, fmt)
    return 0.0 if value == 0 else value


def quantize_tests_columns_only(x, fmt, block=None):
    """Only the columns tested against the block: rows that the blocks do not divide get past the test."""
    br, bc = x.shape if block is None else block
    if x.shape[1] % bc:
        raise ValueError(f"{br}x{bc} blocks do not tile a {x.shape[0]}x{x.shape[1]} tensor")
    tiles = x.float().reshape(x.shape[0] // br, br, x.shape[1] // bc, bc)
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True)
    scale = torch.where(amax > 0, amax / fmt.max, torch.ones_like(amax))
    q = (tiles / scale).clamp(-fmt.max, fmt.max).to(fmt.dtype).reshape(x.shape)
    return q, scale.reshape(x.shape[0] // br, x.shape[1] // bc)


def quantize_clamps_to_fmt_min(x, fmt, block=None):
    """A range clamped to (fmt.min, fmt.max), as if a Format had a .min: it has .max, and its range is symmetric."""
    br, bc = x.shape if block is None else block
    tiles = x.float().reshape(x.shape[0] // br, br, x.shape[1] // bc, bc)
    scale = tiles.abs().amax(dim=(1, 3), keepdim=True).clamp_min(1e-30) / fmt.max
    return (tiles / scale).clamp(fmt.min, fmt.max).to(fmt.dtype).reshape(x.shape), scale.squeeze(1).squeeze(-1)


def auto_native_only_tensorwise(a, b, scale_a, scale_b, out_dtype=torch.bfloat16):
    """Row-wise scales always emulated, even where torch._scaled_mm takes them."""
    fits = a.shape[1] % 16 == 0 and b.shape[1] % 16 == 0
    if fits and scale_a.numel() == 1:
        return SOLUTION["native_mm"](a, b, scale_a, scale_b, out_dtype), "torch._scaled_mm"
    return SOLUTION["emulated_mm"](a, b, scale_a, scale_b, out_dtype), "emulated"


def decode_e4m3_as_ieee(code, fmt):
    """E4M3's top exponent read as IEEE's inf/NaN, which gives a max of 240."""
    exponent = (code >> fmt.mantissa_bits) & ((1 << fmt.exponent_bits) - 1)
    if not fmt.ieee_specials and exponent == (1 << fmt.exponent_bits) - 1:
        mantissa = code & ((1 << fmt.mantissa_bits) - 1)
        return math.copysign(math.inf, -1.0 if code & 0x80 else 1.0) if mantissa == 0 else math.nan
    return decode(code, fmt)


def decode_bias_off_by_one(code, fmt):
    """A normal number's exponent taken as e - bias + 1."""
    value = decode(code, fmt)
    exponent = (code >> fmt.mantissa_bits) & ((1 << fmt.exponent_bits) - 1)
    return value * 2 if math.isfinite(value) and exponent != 0 else value


def encode_ties_away(value, fmt):
    """Exact ties rounded up, away from zero, instead of to the even code."""
    code = encode(value, fmt)
    if math.isfinite(value) and 0 < value < fmt.max:
        up = code + 1 if decode(code, fmt) < value else code
        if up > 0 and decode(up, fmt) - value == value - decode(up - 1, fmt):
            return up
    return code


def encode_truncates(value, fmt):
    """Rounds toward zero: the code just below, never the nearest one above."""
    code = encode(value, fmt)
    magnitude = abs(decode(code, fmt)) if math.isfinite(value) else 0.0
    if math.isfinite(value) and magnitude > abs(value) and code & 0x7F:
        return code - 1
    return code


def encode_e5m2_saturates(value, fmt):
    """E5M2 made to saturate at its max like E4M3, instead of overflowing to inf."""
    if fmt.ieee_specials and not math.isnan(value) and abs(value) > fmt.max:
        return (0x80 if value < 0 else 0) | 0x7B
    return encode(value, fmt)


def encode_overflow_a_whole_step_late(value, fmt):
    """E5M2's overflow to inf from max plus a whole step (the half step taken twice over): max plus half a step, the
    round-to-nearest tie past max, becomes max."""
    step = fmt.max - decode(0x7A, fmt)  # the code below E5M2's largest finite, 0x7B
    if fmt.ieee_specials and not math.isnan(value) and fmt.max < abs(value) < fmt.max + step:
        return (0x80 if value < 0 else 0) | 0x7B
    return encode(value, fmt)


# ---------------------------------------------------------------- 9.2: the loss scaler


class NeverSkips(SOLUTION["MyLossScaler"]):
    """Steps the optimizer even when a gradient is inf or NaN."""

    def step(self, optimizer):
        super().step(optimizer)
        if self.found_inf:
            optimizer.step()


class NoUnscale(SOLUTION["MyLossScaler"]):
    """Forgets to divide the gradients by the scale before optimizer.step()."""

    def step(self, optimizer):
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        self.found_inf = not all(bool(torch.isfinite(g).all()) for g in grads)
        if not self.found_inf:
            optimizer.step()


class GrowsEveryCleanStep(SOLUTION["MyLossScaler"]):
    """Multiplies the scale by growth_factor after every clean step, ignoring growth_interval."""

    def update(self):
        self.scale_value *= self.backoff_factor if self.found_inf else self.growth_factor


class KeepsCountAfterOverflow(SOLUTION["MyLossScaler"]):
    """Backs off after an overflow but does not restart the count of clean steps."""

    def update(self):
        if self.found_inf:
            self.scale_value *= self.backoff_factor
        else:
            super().update()


# ---------------------------------------------------------------- 9.3: block scales and delayed scaling


def inverted_scale(x, fmt, block=None):
    """scale = fmt.max / amax (the quantisation factor) where the dequantisation factor is asked for."""
    q, scale = SOLUTION["quantize_blocks"](x, fmt, block)
    return q, 1 / scale


def e4m3_max_for_every_format(x, fmt, block=None):
    """448 written in for fmt.max, so E5M2 tensors get E4M3's scale."""
    q, scale = SOLUTION["quantize_blocks"](x, FORMATS["e4m3"], block)
    return q.float().to(fmt.dtype), scale


def amax_over_wrong_axes(x, fmt, block=None):
    """The amax reduced over dims 0 and 2 of the (rows/br, br, cols/bc, bc) view: across blocks, not inside one."""
    br, bc = x.shape if block is None else block
    tiles = x.float().reshape(x.shape[0] // br, br, x.shape[1] // bc, bc)
    amax = tiles.abs().amax(dim=(0, 2), keepdim=True)
    scale = torch.where(amax > 0, amax / fmt.max, torch.ones_like(amax))
    return (tiles / scale).clamp(-fmt.max, fmt.max).to(fmt.dtype).reshape(x.shape), scale.reshape(br, bc)


def signed_amax(x, fmt, block=None):
    """amax = the largest x, not the largest |x|."""
    br, bc = x.shape if block is None else block
    tiles = x.float().reshape(x.shape[0] // br, br, x.shape[1] // bc, bc)
    amax = tiles.amax(dim=(1, 3), keepdim=True)
    scale = torch.where(amax > 0, amax / fmt.max, torch.ones_like(amax))
    q = (tiles / scale).clamp(-fmt.max, fmt.max).to(fmt.dtype).reshape(x.shape)
    return q, scale.reshape(x.shape[0] // br, x.shape[1] // bc)


def zero_block_divides_by_zero(x, fmt, block=None):
    """No special case for an all-zero block: its scale is 0."""
    q, scale = SOLUTION["quantize_blocks"](x, fmt, block)
    br, bc = x.shape if block is None else block
    amax = x.reshape(x.shape[0] // br, br, x.shape[1] // bc, bc).abs().amax(dim=(1, 3))
    return q, amax / fmt.max


class DelayedWithoutClamp(SOLUTION["MyDelayedScaling"]):
    """Casts x / scale without clamping: a spike beyond the history's amax overflows (E5M2: inf)."""

    def quantize(self, x):
        current = x.abs().max().item()
        amax = max(self.amax_history, default=current)
        self.amax_history.append(current)
        scale = amax / self.fmt.max if amax > 0 else 1.0
        return (x.float() / scale).to(self.fmt.dtype), torch.tensor(scale, dtype=torch.float32)


class DelayedUsesCurrent(SOLUTION["MyDelayedScaling"]):
    """Records this tensor's amax before taking the history's largest: current scaling in disguise."""

    def quantize(self, x):
        self.amax_history.append(x.abs().max().item())
        amax = max(self.amax_history)
        scale = amax / self.fmt.max if amax > 0 else 1.0
        return (x.float() / scale).clamp(-self.fmt.max, self.fmt.max).to(self.fmt.dtype), torch.tensor(scale)


class DelayedInverted(SOLUTION["MyDelayedScaling"]):
    """Delayed scaling right, but returns fmt.max / amax."""

    def quantize(self, x):
        q, scale = super().quantize(x)
        return q, 1 / scale


# ---------------------------------------------------------------- 9.4: the FP8 matmul


def emulated_divides(a, b, scale_a, scale_b, out_dtype):
    """Divides by the scales, as if they were quantisation factors."""
    return ((a.float() / scale_a) @ (b.float() / scale_b)).to(out_dtype)


def emulated_ignores_scales(a, b, scale_a, scale_b, out_dtype):
    """Multiplies the FP8 codes and forgets the scales."""
    return (a.float() @ b.float()).to(out_dtype)


def native_emulates(a, b, scale_a, scale_b, out_dtype):
    """The 'native' path that never calls torch._scaled_mm."""
    return SOLUTION["emulated_mm"](a, b, scale_a, scale_b, out_dtype)


def auto_always_native(a, b, scale_a, scale_b, out_dtype=torch.bfloat16):
    """Takes torch._scaled_mm whenever the device has it, whatever the shape."""
    if SOLUTION["scaled_mm_support"](a.device).tensorwise:
        return SOLUTION["emulated_mm"](a, b, scale_a, scale_b, out_dtype), "torch._scaled_mm"
    return SOLUTION["emulated_mm"](a, b, scale_a, scale_b, out_dtype), "emulated"


def auto_checks_m_and_k(a, b, scale_a, scale_b, out_dtype=torch.bfloat16):
    """The multiple-of-16 rule applied to M and K (a's shape) instead of K and N."""
    if SOLUTION["scaled_mm_support"](a.device).tensorwise and a.shape[0] % 16 == 0 and a.shape[1] % 16 == 0:
        return SOLUTION["native_mm"](a, b, scale_a, scale_b, out_dtype), "torch._scaled_mm"
    return SOLUTION["emulated_mm"](a, b, scale_a, scale_b, out_dtype), "emulated"


# ---------------------------------------------------------------- 9.5: Float8Linear


def float8_layer(forward, backward):
    """The notebook's MyFloat8Linear around a Float8Matmul whose forward and backward are given."""

    class Matmul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight):
            return forward(ctx, x, weight)

        @staticmethod
        def backward(ctx, grad_out):
            return backward(ctx, grad_out)

    class Layer(SOLUTION["MyFloat8Linear"]):
        def forward(self, x):
            device = x.device.type
            dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
            with torch.autocast(device, enabled=False):
                y = Matmul.apply(x.to(dtype).reshape(-1, x.shape[-1]), self.weight).reshape(*x.shape[:-1], -1)
                return y if self.bias is None else y + self.bias.to(dtype)

    return Layer


def forward_in(fmt_x, fmt_w):
    def forward(ctx, x, weight):
        xq, sx = quantize(x, fmt_x) if fmt_x else (x, None)
        wq, sw = quantize(weight, fmt_w) if fmt_w else (weight, None)
        ctx.save_for_backward(*quantize(x, "e4m3"), *quantize(weight, "e4m3"))
        xs = xq.float() * sx if fmt_x else xq
        ws = wq.float() * sw if fmt_w else wq
        return (xs @ ws.t()).to(x.dtype)
    return forward


def backward_with(grad_format, transpose_grad_w=False):
    def backward(ctx, grad_out):
        xq, sx, wq, sw = ctx.saved_tensors
        gq, sg = quantize(grad_out, grad_format)
        grad_x = fp8_matmul(gq, wq, sg, sw, out_dtype=grad_out.dtype)
        grad_w = fp8_matmul(xq.t(), gq, sx, sg, out_dtype=torch.float32) if transpose_grad_w else \
            fp8_matmul(gq.t(), xq, sg, sx, out_dtype=torch.float32)
        return grad_x, grad_w
    return backward


# ---------------------------------------------------------------- the table

WRONG = [
    ("9.1", "decode_fp8", decode_implicit_one_in_subnormals,
     r"subnormal, \(-1\)\^s · 0\.m .*no implicit leading 1: check your exponent-0 branch"),
    ("9.1", "decode_fp8", decode_unsigned_zero,
     r"decode\(0x80 .*says -0\.0: the sign is wrong: take the sign from bit 7"),
    ("9.1", "decode_fp8", decode_e4m3_as_ieee, r"exponent 1111 holds ordinary numbers up to 448"),
    ("9.1", "decode_fp8", decode_bias_off_by_one, r"\(-1\)\^s · 1\.m · 2\^\(e - 7\)"),
    ("9.1", "encode_fp8", encode_ties_away, r"on an exact tie to the code with an even"),
    ("9.1", "encode_fp8", encode_truncates, r"round to nearest"),
    ("9.1", "encode_fp8", encode_e5m2_saturates, r"E5M2 overflows to ±inf"),
    ("9.1", "encode_fp8", encode_overflow_a_whole_step_late, r"max plus half its step.*from max plus half the step"),
    ("9.2", "MyLossScaler", NeverSkips, r"skip optimizer\.step\(\) when any gradient is inf or NaN"),
    ("9.2", "MyLossScaler", NoUnscale, r"unscale"),
    ("9.2", "MyLossScaler", GrowsEveryCleanStep, r"only after growth_interval consecutive clean steps"),
    ("9.2", "MyLossScaler", KeepsCountAfterOverflow, r"an overflow restarts the count too"),
    ("9.3", "quantize_blocks", inverted_scale, r"amax / fp8_max .*not its inverse"),
    ("9.3", "quantize_blocks", e4m3_max_for_every_format, r"E5M2's max is 57344, not the other format's"),
    ("9.3", "quantize_blocks", amax_over_wrong_axes, r"wrong axes"),
    ("9.3", "quantize_blocks", signed_amax, r"largest \|x\|.*abs\(\)"),
    ("9.3", "quantize_blocks", zero_block_divides_by_zero, r"all-zero block has amax 0, give it scale 1"),
    ("9.3", "quantize_blocks", quantize_tests_columns_only,
     r"tensor in 128×128 blocks raised RuntimeError.*do not divide its rows: test both sides"),
    ("9.3", "quantize_blocks", quantize_clamps_to_fmt_min,
     r"quantize raised AttributeError: 'Format' object has no attribute 'min'.*so clamp to \(-fmt\.max, fmt\.max\)"),
    ("9.3", "MyDelayedScaling", DelayedWithoutClamp, r"clamp x / scale to ±fmt\.max"),
    ("9.3", "MyDelayedScaling", DelayedUsesCurrent, r"largest amax of the previous steps"),
    ("9.3", "MyDelayedScaling", DelayedInverted, r"not its inverse"),
    ("9.4", "emulated_mm", emulated_divides, r"you divided by the scales"),
    ("9.4", "emulated_mm", emulated_ignores_scales, r"the scales were not applied"),
    ("9.4", "native_mm", native_emulates, r"torch\._scaled_mm was never called"),
    ("9.4", "fp8_mm", auto_always_native, r"K and N must be multiples of 16.*emulated path"),
    ("9.4", "fp8_mm", auto_checks_m_and_k, r"M may be anything.*N = 24 is not"),
    ("9.4", "fp8_mm", auto_native_only_tensorwise, r"row-wise scales on this CPU chose 'emulated'.*check your test on "
                                                   r"the scales"),
    ("9.5", "MyFloat8Linear", float8_layer(forward_in(None, None), backward_with("e5m2")),
     r"quantise x and the weight to E4M3"),
    ("9.5", "MyFloat8Linear", float8_layer(forward_in("e4m3", None), backward_with("e5m2")),
     r"the weight was not quantised"),
    ("9.5", "MyFloat8Linear", float8_layer(forward_in("e5m2", "e5m2"), backward_with("e5m2")),
     r"quantised to E5M2: activations and weights use E4M3"),
    ("9.5", "MyFloat8Linear", float8_layer(forward_in("e4m3", "e4m3"), backward_with("e4m3")),
     r"gradients use E5M2"),
    ("9.5", "MyFloat8Linear", float8_layer(forward_in("e4m3", "e4m3"), backward_with("e5m2", transpose_grad_w=True)),
     r"wrong shape.*grad_W = gᵀ @ x"),
]


@pytest.mark.parametrize("exercise, name, wrong, message", WRONG,
                         ids=[f"{e}-{getattr(w, '__name__', n)}-{i}" for i, (e, n, w, _) in enumerate(WRONG)])
def test_wrong_answer_fails_naming_the_mistake(exercise, name, wrong, message):
    if name == "native_mm" and not SOLUTION["scaled_mm_support"]("cpu").tensorwise:
        pytest.skip("this torch has no CPU torch._scaled_mm: the native path is not checked here")
    result = distlab.check(exercise, *answer(exercise, {**SOLUTION, name: wrong}), quiet=True)
    assert result.status == "failed", result
    assert re.search(message, result.detail), result.detail


def test_right_answers_pass():
    for exercise in ANSWERS:
        result = distlab.check(exercise, *answer(exercise, SOLUTION), quiet=True)
        assert result.status == "passed", result


def test_reference_delayed_scaling_passes_the_e5m2_spike():
    """The E5M2 case that catches a missing clamp is one the library's DelayedScaling passes as well."""
    assert "E5M2" in distlab.check("9.3", quantize_with_fmt, DelayedScaling, quiet=True).detail


def quantize_with_fmt(x, fmt, block=None):
    return quantize(x, fmt, block)


def test_outlier_cell_points_at_an_inverted_scale():
    """Run All after a failed 9.3: the outlier cell's one line names the bug (the scale), not the outliers."""
    assert distlab.check("9.3", inverted_scale, SOLUTION["MyDelayedScaling"], quiet=True).status == "failed"
    cell = next(c for c in CELLS if c.get("id") == "f808c075")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(cell.source, {**SOLUTION, "quantize_blocks": inverted_scale})  # noqa: S102  the notebook's cell
    line = printed.getvalue()
    assert "✗ this cell stopped: ClaimFailed: your quantize_blocks gives" in line, line
    assert "fix exercise 9.3 first (scale = amax / fmt.max" in line and "exercise 9.3 fails its check" in line, line
