"""Lab 09 — mixed precision and FP8. Checkers compare the student's code with PyTorch and :mod:`distlab.fp8`.

* 9.1 encode/decode: all 256 codes of E4M3 and E5M2 against PyTorch's float8 dtypes, plus
  random values, exact ties, subnormals, underflow, overflow, ±inf and NaN.
* 9.2 loss scaler: a tiny model trained side by side with ``torch.amp.GradScaler`` on
  gradient streams with injected inf/NaN; scale, skipped steps and weights must agree.
* 9.3 scaling: block scales and FP8 values against :func:`distlab.fp8.quantize` for
  per-tensor, per-row, 1×128 and 128×128 blocks, and delayed scaling over a stream with spikes
  (an E5M2 spike too, where a missing clamp overflows to inf). A wrong scale is matched against
  the plausible mistakes (inverted, the other format's max, signed amax, the wrong axes, one
  amax for every block) and named.
* 9.4 FP8 matmul: the emulated path against the dequantised product, the native path must
  call ``aten._scaled_mm`` (seen by a dispatch mode) and agree with it, the automatic choice
  must follow the device and the multiple-of-16 rule (K and N, each alone off the multiple).
* 9.5 ``Float8Linear``: forward, input and weight gradients against the reference
  :class:`distlab.fp8.Float8Linear` on the same weights; a wrong format or a missing
  quantisation is recognised by recomputing those variants; the layers are never square, so
  a transposed weight gradient is caught (and autograd's shape error is translated); then a GPT
  trained with it.

Cases come from the lab's seed (fixed in self-study: reproducible notebook output) over shapes, scales
and hyperparameters a student cannot special-case. An untouched stub's
``NotImplementedError`` propagates and is reported as "not attempted".
"""

from __future__ import annotations

import math
import random

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from distlab.flops import PEAK_FLOPS
from distlab.fp8.formats import FORMATS, Format, decode, encode
from distlab.fp8.formats import bit_fields as bits
from distlab.fp8.linear import Float8Linear
from distlab.fp8.matmul import MULTIPLE, emulated_scaled_mm, scaled_mm_support
from distlab.fp8.scaling import DelayedScaling, dequantize, expand_scale, quantize
from distlab.fp8.training import final_loss, train_recipe
from distlab.grading.contract import CheckFailed, describe_error, first_line
from distlab.grading.harness import Edge, case_drawn, lab_seed, run_isolated
from distlab.grading.quiz import choice, number
from distlab.grading.registry import Exercise
from distlab.model import GPTConfig

__all__ = ["EXERCISES", "check_codes", "check_loss_scaler", "check_scaling", "check_fp8_matmul",
           "check_float8_linear"]



def _seed() -> int:
    """This lab's seed for its hidden cases, read as each check runs (:func:`~distlab.grading.harness.lab_seed`)."""
    return lab_seed(9)


# ---------------------------------------------------------------- 9.1


def _same(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)


def _decode_hint(code: int, fmt: Format, expected: float, got=None) -> str:
    exponent = (code >> fmt.mantissa_bits) & ((1 << fmt.exponent_bits) - 1)
    if math.isnan(expected):
        return ("E4M3 has no infinities: only S.1111.111 is NaN: check your NaN test" if not fmt.ieee_specials
                else "E5M2 follows IEEE: exponent all ones with a non-zero mantissa is NaN: check your NaN test")
    if math.isinf(expected):
        return "exponent all ones with mantissa 0 is ±inf in E5M2: check your tests for inf and NaN"
    if (isinstance(got, (int, float)) and not math.isnan(got) and abs(got) == abs(expected)
            and math.copysign(1.0, got) != math.copysign(1.0, expected)):
        return "the sign is wrong: take the sign from bit 7 (code & 0x80), for zero too (0x80 is -0.0)"
    if exponent == 0:
        return (f"exponent 0 is subnormal, (-1)^s · 0.m · 2^(1-{fmt.bias}) with no implicit leading 1: check your "
                f"exponent-0 branch")
    if exponent == (1 << fmt.exponent_bits) - 1 and not fmt.ieee_specials:
        return ("in E4M3 (fn) exponent 1111 holds ordinary numbers up to 448; only S.1111.111 is NaN: check your "
                "NaN test")
    return (f"a normal number is (-1)^s · 1.m · 2^(e - {fmt.bias}): check the bias, the implicit leading 1 and "
            f"the mantissa's scale, m / 2^M")


def _value_cases(fmt: Format, rng: random.Random) -> list[tuple[float, str]]:
    finite = sorted({decode(c, fmt) for c in range(256) if math.isfinite(decode(c, fmt))})
    cases = [((a + b) / 2, "an exact tie between two codes") for a, b in zip(finite, finite[1:]) if a >= 0]
    exponents = [rng.uniform(-fmt.bias - fmt.mantissa_bits - 2, math.log2(fmt.max)) for _ in range(400)]
    # float32 values, which PyTorch casts to FP8 in one rounding (a float64 could be rounded twice)
    randoms = torch.tensor([rng.uniform(-1, 1) * 2.0**e for e in exponents], dtype=torch.float32)
    cases += [(value, "a random value") for value in randoms.tolist()]
    cases += [(fmt.min_subnormal / 2, "half the smallest subnormal (a tie with 0)"),
              (fmt.min_subnormal * 0.51, "just above half the smallest subnormal"),
              (fmt.min_subnormal / 3, "a value below half the smallest subnormal"),
              (-0.0, "-0.0"), (fmt.max * 1.03, "just above max"), (fmt.max * 1.5, "above max"), (1e30, "1e30"),
              # past max by half the top step, and by a little more: E5M2 rounds these to inf (round to nearest,
              # as if the next binade went on), E4M3 saturates
              (fmt.max + (finite[-1] - finite[-2]) / 2, "max plus half its step"),
              (fmt.max + (finite[-1] - finite[-2]) * 0.7, "max plus 0.7 of its step"),
              (-1e30, "-1e30"), (math.inf, "+inf"), (-math.inf, "-inf")]
    return cases


def check_codes(decode_fn, encode_fn) -> str:
    """9.1: ``decode_fn(code, fmt) -> float`` and ``encode_fn(value, fmt) -> int`` for E4M3 and E5M2."""
    rng = random.Random(_seed() + 1)
    checked = 0
    for fmt in (FORMATS["e4m3"], FORMATS["e5m2"]):
        torch_values = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float().tolist()
        for code, expected in enumerate(torch_values):
            got = decode_fn(code, fmt)
            if not isinstance(got, (int, float)) or not _same(float(got), expected):
                raise CheckFailed(f"{fmt.name.upper()} decode({bits(code, fmt)}) returned {got!r}; PyTorch's "
                                  f"{fmt.dtype} says {expected!r}: {_decode_hint(code, fmt, expected, got)}")
        for code, value in enumerate(torch_values):
            if math.isnan(value):
                continue
            got = encode_fn(value, fmt)
            if got != code:
                raise CheckFailed(f"{fmt.name.upper()} encode({value!r}) returned {_code(got, fmt)}; expected "
                                  f"{bits(code, fmt)}, the code whose value it is: "
                                  f"{_encode_hint(value, fmt, got, code)}")
        cases = _value_cases(fmt, rng)
        case_drawn("9.1", fmt=fmt.name, whats={what for _, what in cases})
        for value, what in cases:
            expected = encode(value, fmt)
            in_range = abs(value) <= fmt.max
            if in_range:  # where conventions cannot differ, PyTorch itself is the reference
                expected = torch.tensor([value], dtype=torch.float32).to(fmt.dtype).view(torch.uint8).item()
            got = encode_fn(value, fmt)
            if got != expected:
                raise CheckFailed(f"{fmt.name.upper()} encode({value!r}), {what}, returned {_code(got, fmt)}; expected "
                                  f"{bits(expected, fmt)} = {decode(expected, fmt)!r}: "
                                  f"{_encode_hint(value, fmt, got, expected)}")
        got = encode_fn(math.nan, fmt)
        if not isinstance(got, int) or not 0 <= got < 256 or not math.isnan(decode(got, fmt)):
            raise CheckFailed(f"{fmt.name.upper()} encode(nan) returned {_code(got, fmt)}, which is not a NaN code")
        checked += len(cases)
    return (f"all 256 codes of E4M3 and E5M2 equal PyTorch's float8 dtypes; {checked} more values encoded: "
            f"ties to even, subnormals, overflow, ±inf, NaN")


def _code(got, fmt: Format) -> str:
    return bits(got, fmt) if isinstance(got, int) and 0 <= got < 256 else repr(got)


def _encode_hint(value: float, fmt: Format, got, expected: int) -> str:
    if isinstance(got, int) and got == expected ^ 0x80:
        return "the sign bit is wrong: set 0x80 for a negative value, -0.0 included (math.copysign(1.0, value) < 0)"
    if math.isinf(value) or abs(value) > fmt.max:
        if not fmt.ieee_specials:
            return "E4M3 has no inf: values beyond ±448 saturate to ±448, so return the code of ±448 (S.1111.110)"
        if math.isinf(decode(expected, fmt)):
            return ("E5M2 overflows to ±inf (exponent 11111, mantissa 00), as IEEE does, from max plus half the "
                    "step below max on (half_step = (max - the next code down) / 2)")
        return "a value less than half a step above max rounds down to max"
    if isinstance(got, int) and 0 <= got < 256 and abs(got - expected) == 1 and value != 0:
        return "round to nearest, and on an exact tie to the code with an even (0) last mantissa bit"
    if abs(value) < fmt.min_normal:
        return (f"below 2^{1 - fmt.bias} values are subnormal: exponent field 0, "
                f"mantissa = value / 2^{1 - fmt.bias - fmt.mantissa_bits}: check your subnormal branch, and that "
                f"the overflow test comes first only for values above max")
    return "check the sign, the biased exponent and the rounded mantissa"


# ---------------------------------------------------------------- 9.2


def _scaler_case(rng: random.Random) -> dict:
    steps = rng.randint(10, 14)
    bad = set(rng.sample(range(2, steps), 3))
    return dict(init_scale=2.0 ** rng.randint(4, 12), growth_factor=rng.choice([2.0, 4.0]),
                backoff_factor=rng.choice([0.5, 0.25]), growth_interval=rng.randint(2, 4), steps=steps, bad=bad,
                poison=[rng.choice([math.inf, -math.inf, math.nan]) for _ in range(steps)], seed=rng.randrange(1000))


def _scaler_run(scaler, case: dict) -> list[dict]:
    torch.manual_seed(case["seed"])
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(case["seed"])
    trace = []
    for step in range(case["steps"]):
        x = torch.randn(16, 8, generator=generator)
        optimizer.zero_grad(set_to_none=True)
        loss = model(x).pow(2).mean()
        scale_before = float(scaler.get_scale())
        scaler.scale(loss).backward()
        if step in case["bad"]:  # an overflow somewhere in backward
            model[0].weight.grad[0, 0] = case["poison"][step]
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(optimizer)
        scaler.update()
        moved = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        trace.append({"scale": scale_before, "stepped": moved, "after": float(scaler.get_scale()),
                      "params": [p.detach().clone() for p in model.parameters()], "bad": step in case["bad"]})
    return trace


def _scaler_job(scaler_class, knobs: dict, case: dict) -> list[dict]:
    """9.2 where the student's code runs: their scaler drives a training run, which returns its trace."""
    return _scaler_run(scaler_class(**knobs), case)


def check_loss_scaler(scaler_class) -> str:
    """9.2: a class with ``scale``, ``step``, ``update``, ``get_scale`` that behaves like ``torch.amp.GradScaler``."""
    rng = random.Random(_seed() + 2)
    cases = [_scaler_case(rng) for _ in range(4)]
    first_bad = sorted(cases[0]["bad"])  # whatever the draw: a NaN and an inf, and growth after two clean steps
    cases[0]["poison"][first_bad[0]], cases[0]["poison"][first_bad[1]] = math.nan, math.inf
    cases[0]["growth_interval"] = 2
    for case in cases:
        knobs = {k: case[k] for k in ("init_scale", "growth_factor", "backoff_factor", "growth_interval")}
        case_drawn("9.2", poison={str(case["poison"][s]) for s in case["bad"]}, clean_run=max(
            len(run) for run in "".join("b" if s in case["bad"] else "." for s in range(case["steps"])).split("b")),
                   interval=case["growth_interval"])
        where = ", ".join(f"{k}={v:g}" for k, v in knobs.items())
        ours = run_isolated(_scaler_job, scaler_class, knobs, case)
        ref = _scaler_run(torch.amp.GradScaler("cpu", **knobs), case)
        for step, (got, want) in enumerate(zip(ours, ref)):
            kind = "with an inf/NaN gradient" if want["bad"] else "with finite gradients"
            if got["stepped"] != want["stepped"]:
                raise CheckFailed(f"{where}: step {step} ({kind}) " + (
                    "updated the weights: skip optimizer.step() when any gradient is inf or NaN" if got["stepped"]
                    else "did not update the weights: step the optimizer when every gradient is finite"))
            if got["after"] != want["after"]:
                overflowed = any(earlier["bad"] for earlier in ref[:step])
                raise CheckFailed(f"{where}: after step {step} ({kind}) the scale is {got['after']:g}, GradScaler's is "
                                  f"{want['after']:g}: " + (
                                      "multiply it by backoff_factor after an overflow and restart the count"
                                      if want["bad"] else
                                      "grow it by growth_factor only after growth_interval consecutive clean steps, "
                                      "then restart the count" + ("; an overflow restarts the count too (an earlier "
                                                                  "step had one)" if overflowed else "")))
            diff = max(float((a - b).abs().max()) for a, b in zip(got["params"], want["params"]))
            if diff > 1e-6:
                factor = _update_ratio(ours, ref, step)
                hint = (f"the update is {factor:.4g}× GradScaler's: unscale the gradients (multiply by 1/scale) "
                        f"before optimizer.step()" if factor else "unscale each gradient by 1/scale in place")
                raise CheckFailed(f"{where}: after step {step} the weights differ from GradScaler's by {diff:.3g}: "
                                  f"{hint}")
    return (f"{len(cases)} runs against torch.amp.GradScaler with random scales, factors and intervals: same scale, "
            f"same skipped steps, same weights")


def _update_ratio(ours, ref, step) -> float | None:
    prev_ours = ours[step - 1]["params"] if step else None
    prev_ref = ref[step - 1]["params"] if step else None
    if prev_ours is None:
        return None
    d_ours = torch.cat([(a - b).flatten() for a, b in zip(ours[step]["params"], prev_ours)]).double()
    d_ref = torch.cat([(a - b).flatten() for a, b in zip(ref[step]["params"], prev_ref)]).double()
    if float(d_ref.norm()) == 0:
        return None
    return float(d_ours @ d_ref / (d_ref @ d_ref))


# ---------------------------------------------------------------- 9.3


def _outlier_tensor(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, cols, generator=generator)
    x[:, torch.randint(cols, (2,), generator=generator)] *= 50.0  # outlier channels
    x[torch.randint(rows, (1,), generator=generator)] *= 20.0  # an outlier token
    return x


def check_scaling(quantize_fn, delayed_class) -> str:
    """9.3: ``quantize_fn(x, fmt, block) -> (q, scale)`` and a delayed-scaling class with ``quantize(x)``."""
    rng = random.Random(_seed() + 3)
    generator = torch.Generator().manual_seed(_seed() + 3)
    count = 0
    for i in range(3):
        rows, cols = 128 * rng.randint(1, 2), 128 * rng.randint(1, 3)
        if i == 0 and rows == cols:
            cols += 128  # a tensor that is not square: rows and columns cannot be confused
        x = _outlier_tensor(rows, cols, generator)
        x[:1, :128] = 0.0  # an all-zero tile: its scale must not be 0 or NaN
        for block, name in ((None, "per-tensor"), ((1, cols), "per-row"), ((1, 128), "1×128 tiles"),
                            ((128, 128), "128×128 blocks")):
            for fmt in (FORMATS["e4m3"], FORMATS["e5m2"]):
                case_drawn("9.3", block=name, fmt=fmt.name, zero_tile=bool((x[:1, :128] == 0).all()),
                           square=rows == cols)
                where = f"{name} {fmt.name.upper()} of a {rows}×{cols} tensor"
                try:
                    got = _quantized_by(quantize_fn, x, fmt, block)
                except ValueError as error:
                    br, bc = x.shape if block is None else block
                    raise CheckFailed(f"{where}: raised ValueError ({first_line(error)[:80]}), but {br}×{bc} blocks "
                                      f"tile it: check the condition before your raise (x.shape[0] % br, "
                                      f"x.shape[1] % bc)") from None
                _compare_quantized(got, quantize(x, fmt, block), x, fmt, where, block=block)
                count += 1
    for bad, block, side in ((x[:, :cols - 1], (1, 128), "columns"), (x[:rows - 1], (128, 128), "rows")):
        error = None
        try:
            quantize_fn(bad, FORMATS["e4m3"], block)
        except Exception as raised:  # noqa: BLE001  a ValueError is right, any other error the mistake named below
            error = raised
        if isinstance(error, ValueError):
            continue
        told = (f"raised {describe_error(error)}; the blocks do not divide its {side}: test both sides, "
                f"x.shape[0] % br and x.shape[1] % bc, and raise ValueError first" if error is not None else
                f"should raise ValueError (the blocks do not divide its {side}), not quietly drop or pad {side}")
        raise CheckFailed(f"quantizing a {bad.shape[0]}×{bad.shape[1]} tensor in {block[0]}×{block[1]} blocks "
                          f"{told}")
    history = rng.randint(3, 6)
    scaler, reference = delayed_class(FORMATS["e4m3"], history), DelayedScaling("e4m3", history)
    for step in range(12):
        x = torch.randn(64, 128, generator=generator) * (1 + step / 4)
        if step in (5, 9):
            x[3, 7] = 400.0  # a spike the history has not seen
        case_drawn("9.3", delayed="e4m3", spike=bool(x.abs().max() > 100))
        got, want = _quantized_by(scaler.quantize, x), reference.quantize(x)
        _compare_quantized(got, want, x, FORMATS["e4m3"], f"delayed scaling (history={history}), step {step}",
                           delayed=True, first=step == 0)
    # E5M2 overflows to inf where E4M3's cast saturates: a spike beyond the delayed amax shows a missing clamp
    scaler, reference = delayed_class(FORMATS["e5m2"], 2), DelayedScaling("e5m2", 2)
    for step in range(4):
        x = torch.randn(32, 128, generator=generator)
        if step == 3:
            x[1, 5] = -1e4
        _compare_quantized(_quantized_by(scaler.quantize, x), reference.quantize(x), x, FORMATS["e5m2"],
                           f"delayed scaling in E5M2 (history=2), step {step}", delayed=True, first=step == 0)
    # a tensor of zeros first (amax 0: scale 1, not 0), then values under 1 (a scale below 1 is no special case)
    scaler, reference = delayed_class(FORMATS["e4m3"], 2), DelayedScaling("e4m3", 2)
    for step in range(3):
        x = torch.zeros(16, 32) if step == 0 else torch.randn(16, 32, generator=generator) * 0.01
        case_drawn("9.3", delayed="e4m3", all_zero=step == 0, below_one=bool(0 < x.abs().max() < 1))
        _compare_quantized(_quantized_by(scaler.quantize, x), reference.quantize(x), x, FORMATS["e4m3"],
                           f"delayed scaling (history=2), step {step}: "
                           + ("all zeros" if step == 0 else "values under 1"), delayed=True, first=step == 0)
    return (f"{count} tensors with outliers, per-tensor/per-row/1×128/128×128 in E4M3 and E5M2, and 19 steps of "
            f"delayed scaling with spikes, zeros and values under 1 in E4M3 and E5M2: scales and FP8 values equal "
            f"the reference")


def _quantized_by(quantize_fn, *args):
    """``quantize_fn(*args)``, with an attribute a :class:`~distlab.fp8.Format` does not have named for what it
    has: a range is symmetric, so there is no ``fmt.min`` to clamp to."""
    try:
        return quantize_fn(*args)
    except AttributeError as error:
        if "'Format' object has no attribute" not in str(error):
            raise
        raise CheckFailed(f"quantize raised {describe_error(error)}: a Format has .max (its largest finite value; "
                          f"its range is symmetric, -fmt.max to fmt.max), .min_normal and .min_subnormal, so clamp "
                          f"to (-fmt.max, fmt.max) and scale by amax / fmt.max") from None


def _scale_mistake(got: torch.Tensor, x: torch.Tensor, fmt: Format, block) -> str:
    """Name the plausible mistake whose scales are ``got`` (same count as the reference), or ""."""
    rows, cols = x.shape if block is None else block
    tiles = x.float().reshape(x.shape[0] // rows, rows, x.shape[1] // cols, cols)
    candidates = (
        (tiles.amax(dim=(1, 3)), "amax is the largest |x| of the block: take .abs() before the max "
                                 "(a block whose largest magnitude is negative got a wrong scale)"),
        (tiles.abs().amax(dim=(0, 2)), "the amax was taken over the wrong axes: reshape to "
                                       "(rows/br, br, cols/bc, bc) and reduce dims 1 and 3 (inside a block)"),
        (x.abs().max().expand(got.shape), "every block got the whole tensor's amax: reduce over each block's "
                                          "own elements"))
    for amax, hint in candidates:
        scale = torch.where(amax > 0, amax / fmt.max, torch.ones_like(amax)).float()
        if scale.numel() == got.numel() and torch.allclose(got.flatten(), scale.flatten(), rtol=1e-5):
            return hint
    return ""


def _compare_quantized(got, want, x, fmt: Format, where: str, delayed: bool = False, first: bool = False,
                       block=None) -> None:
    try:
        q, scale = got
    except (TypeError, ValueError):
        raise CheckFailed(f"{where}: return (q, scale), got {type(got).__name__}") from None
    ref_q, ref_scale = want
    if not isinstance(q, torch.Tensor) or q.dtype != fmt.dtype or q.shape != x.shape:
        raise CheckFailed(f"{where}: q should be a {tuple(x.shape)} {fmt.dtype} tensor, got "
                          f"{getattr(q, 'dtype', type(q).__name__)} {tuple(getattr(q, 'shape', ()))}")
    scale = torch.as_tensor(scale)
    if scale.numel() != ref_scale.numel():
        br, bc = x.shape if block is None else block
        axes = (" — as many as there are elements in one block: the amax was taken over the wrong axes, reduce "
                "each block's rows and columns (dims 1 and 3 of the (rows/br, br, cols/bc, bc) view)"
                if not delayed and scale.numel() == br * bc else "")
        raise CheckFailed(f"{where}: {scale.numel()} scales, expected {ref_scale.numel()} "
                          f"(one per block: a grid of shape {tuple(ref_scale.shape)}){axes}")
    if ref_scale.numel() > 1 and tuple(scale.shape) != tuple(ref_scale.shape):
        raise CheckFailed(f"{where}: scale has shape {tuple(scale.shape)}, expected the grid of blocks "
                          f"(rows / br, cols / bc) = {tuple(ref_scale.shape)}: scale[i, j] is block (i, j)'s, so a "
                          f"caller can expand it over the tensor")
    scale = scale.reshape(ref_scale.shape).float()
    if not torch.isfinite(scale).all() or (scale <= 0).any():
        raise CheckFailed(f"{where}: a scale is {scale[~torch.isfinite(scale) | (scale <= 0)][0].item()}: an all-zero "
                          f"block has amax 0, give it scale 1 instead of dividing by zero")
    if not torch.allclose(scale, ref_scale, rtol=1e-5, atol=0):
        i = int(((scale - ref_scale).abs() / ref_scale).flatten().argmax())
        g, w = scale.flatten()[i].item(), ref_scale.flatten()[i].item()
        mistake = "" if delayed else _scale_mistake(scale, x, fmt, block)
        if math.isclose(g * w, 1.0, rel_tol=1e-4):
            hint = "scale is the dequantisation factor amax / fp8_max (x ≈ q · scale), not its inverse"
        elif math.isclose(g * FORMATS["e4m3" if fmt.name == "e5m2" else "e5m2"].max, w * fmt.max, rel_tol=1e-4):
            hint = f"scale = amax / fmt.max, and {fmt.name.upper()}'s max is {fmt.max:g}, not the other format's"
        elif mistake:
            hint = mistake
        elif delayed:
            hint = ("the first call has an empty history: use this tensor's own amax" if first else
                    "scale with the largest amax of the previous steps (not this tensor's), then record this "
                    "tensor's amax")
        else:
            hint = f"each block's scale is its amax / {fmt.max:g}"
        raise CheckFailed(f"{where}: scale {i} (of grid {tuple(ref_scale.shape)}) is {g:.6g}, expected {w:.6g}: {hint}")
    ulp = 2.0 ** -fmt.mantissa_bits  # one step of the format, relative; subnormals step by ulp · min_normal
    back, ref_back = dequantize(q, scale), dequantize(ref_q, ref_scale)
    floor = fmt.min_normal * expand_scale(ref_scale, tuple(x.shape))
    if not torch.isfinite(back).all():
        raise CheckFailed(f"{where}: the FP8 values hold {int((~torch.isfinite(back)).sum())} inf/NaN: an element "
                          f"beyond ±{fmt.max:g} after x / scale overflowed in the cast (E5M2 has inf; not every "
                          f"device's E4M3 cast saturates): clamp x / scale to ±fmt.max before casting")
    err = ((back - ref_back).abs() / torch.maximum(ref_back.abs(), floor)).max().item()
    if err > 1.01 * ulp:
        raise CheckFailed(f"{where}: dequantised values differ from the reference by up to {err:.3g} relative "
                          f"(more than one {fmt.name.upper()} step, {ulp:g}): q = clamp(x / scale, ±{fmt.max:g}) "
                          f"cast to {fmt.dtype}")


# ---------------------------------------------------------------- 9.4


class _CountScaledMM(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten._scaled_mm:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _native_job(native_fn, a, b, sa, sb):
    """9.4's native path where the student's code runs: its output, and how many times it called
    ``torch._scaled_mm`` (counted in that process: a count the code could alter, as any count taken beside it)."""
    mode = _CountScaledMM()
    with mode:
        got = native_fn(a, b, sa, sb, torch.float32)
    return got, mode.calls


def _matmul_case(rng: random.Random, generator: torch.Generator, m: int, k: int, n: int, rowwise: bool,
                 dtype_b=torch.float8_e4m3fn):
    a = (torch.randn(m, k, generator=generator) * 100).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k, generator=generator) * 100).to(dtype_b).t()  # (k, n), column-major like a weight's .t()
    if rowwise:
        sa = torch.rand(m, 1, generator=generator) * 0.02 + 0.001
        sb = torch.rand(1, n, generator=generator) * 0.02 + 0.001
    else:
        sa, sb = torch.tensor(rng.uniform(0.001, 0.02)), torch.tensor(rng.uniform(0.001, 0.02))
    return a, b, sa, sb


def check_fp8_matmul(emulated_fn, native_fn, auto_fn) -> str:
    """9.4: ``emulated_fn``/``native_fn(a, b, scale_a, scale_b, out_dtype)`` and ``auto_fn(...) -> (out, path)``."""
    rng = random.Random(_seed() + 4)
    generator = torch.Generator().manual_seed(_seed() + 4)
    support = scaled_mm_support("cpu")
    shapes = [(16 * rng.randint(1, 4), 16 * rng.randint(1, 6), 16 * rng.randint(1, 4)) for _ in range(3)]
    for m, k, n in shapes:
        for rowwise in (False, True):
            for dtype_b in (torch.float8_e4m3fn, torch.float8_e5m2):
                a, b, sa, sb = _matmul_case(rng, generator, m, k, n, rowwise, dtype_b)
                case_drawn("9.4", rowwise=rowwise, e5m2=dtype_b == torch.float8_e5m2)
                where = (f"{'row-wise' if rowwise else 'tensor-wise'} {m}×{k} @ {k}×{n} "
                         f"(E4M3 × {'E5M2' if dtype_b == torch.float8_e5m2 else 'E4M3'})")
                expected = emulated_scaled_mm(a, b, sa, sb, torch.float32)
                _compare_matmul(emulated_fn(a, b, sa, sb, torch.float32), expected, a, b, sa, sb, f"emulated, {where}")
                if support.tensorwise and (support.rowwise or not rowwise):
                    got, calls = run_isolated(_native_job, native_fn, a, b, sa, sb)
                    if calls == 0:
                        raise CheckFailed(f"native, {where}: torch._scaled_mm was never called")
                    _compare_matmul(got, expected, a, b, sa, sb, f"native, {where}")
    for m, k, n in ((17, 40, 24), (32, 48, 24), (32, 40, 32)):  # K and N, N alone, K alone off the multiple
        a, b, sa, sb = _matmul_case(rng, generator, m, k, n, False)
        case_drawn("9.4", auto=True, k_off=k % MULTIPLE != 0, n_off=n % MULTIPLE != 0)
        out, path = auto_fn(a, b, sa, sb, torch.bfloat16)
        if path != "emulated":
            off = [f"{name} = {size}" for name, size in (("K", k), ("N", n)) if size % MULTIPLE]
            raise CheckFailed(f"auto, a {m}×{k} @ {k}×{n} matmul chose {path!r}: K and N must be multiples of "
                              f"{MULTIPLE} for torch._scaled_mm on a GPU (M may be anything), and here "
                              f"{' and '.join(off)} {'is' if len(off) == 1 else 'are'} not, so this shape takes the "
                              f"emulated path")
        _compare_matmul(out, emulated_scaled_mm(a, b, sa, sb, torch.bfloat16), a, b, sa, sb,
                        f"auto, {m}×{k} @ {k}×{n}")
    a, b, sa, sb = _matmul_case(rng, generator, 32, 64, 48, False)
    out, path = auto_fn(a, b, sa, sb, torch.bfloat16)
    if path != support.path:
        raise CheckFailed(f"auto, a 32×64 @ 64×48 matmul on this CPU chose {path!r}; expected {support.path!r} "
                          f"({support.reason})")
    # row-wise scales through auto, two rows (M may be anything): native where this device has row-wise scaling
    a, b, sa, sb = _matmul_case(rng, generator, 2, 32, 16, True)
    case_drawn("9.4", auto=True, rowwise=True, two_rows=True)
    out, path = auto_fn(a, b, sa, sb, torch.bfloat16)
    want_path = "torch._scaled_mm" if support.tensorwise and support.rowwise else "emulated"
    if path != want_path:
        raise CheckFailed(f"auto, a 2×32 @ 32×16 matmul with row-wise scales on this CPU chose {path!r}; expected "
                          f"{want_path!r}: check your test on the scales, torch._scaled_mm takes row-wise ones "
                          f"wherever the device supports them (support.rowwise)")
    _compare_matmul(out, emulated_scaled_mm(a, b, sa, sb, torch.bfloat16), a, b, sa, sb,
                    "auto, a 2×32 @ 32×16 matmul with row-wise scales")
    return (f"{len(shapes) * 4} matmuls per path, tensor-wise and row-wise, E4M3×E4M3 and E4M3×E5M2: emulated = "
            f"dequantised product, native calls torch._scaled_mm; auto picks {support.path} here and emulates "
            f"shapes whose K or N is not a multiple of {MULTIPLE}")


def _compare_matmul(got, expected, a, b, sa, sb, where: str) -> None:
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        raise CheckFailed(f"{where}: expected a {tuple(expected.shape)} tensor, got "
                          f"{tuple(getattr(got, 'shape', ())) or type(got).__name__}")
    if got.dtype != expected.dtype:
        raise CheckFailed(f"{where}: the output has dtype {got.dtype}; return out_dtype={expected.dtype}")
    tol = 1e-5 if expected.dtype == torch.float32 else 1e-2
    err = float((got.float() - expected.float()).norm() / expected.float().norm())
    if err <= tol:
        return
    inverse = emulated_scaled_mm(a, b, 1 / sa, 1 / sb, torch.float32)
    if float((got.float() - inverse).norm() / inverse.norm()) < 1e-3:
        hint = "you divided by the scales: they are dequantisation factors, multiply (a · scale_a) @ (b · scale_b)"
    elif _relative(got, a.float() @ b.float()) < 1e-3:
        hint = "the scales were not applied: multiply (a · scale_a) @ (b · scale_b)"
    else:
        hint = "scale_a multiplies the rows of a (shape (M, 1) or one number), scale_b the columns of b ((1, N))"
    raise CheckFailed(f"{where}: relative error {err:.3g} against the dequantised product: {hint}")


# ---------------------------------------------------------------- 9.5


def _reference_linear(k: int, n: int, generator: torch.Generator, bias: bool) -> Float8Linear:
    ref = Float8Linear(k, n, bias=bias)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(n, k, generator=generator) * 0.05)
        if bias:
            ref.bias.copy_(torch.randn(n, generator=generator) * 0.1)
    return ref


def _linear_job(student_class, ref: Float8Linear, x: torch.Tensor, grad_out: torch.Tensor):
    """9.5 where the student's code runs: their layer, made from a linear and given ``ref``'s weights, forward
    and backward; what the checker compares (its weight's dtype, the output, autograd's error if backward
    failed, the input and weight gradients)."""
    mine = student_class.from_linear(nn.Linear(ref.in_features, ref.out_features, bias=ref.bias is not None))
    with torch.no_grad():
        mine.weight.copy_(ref.weight)
        if ref.bias is not None:
            mine.bias.copy_(ref.bias)
    dtype = mine.weight.dtype
    x = x.detach().clone().requires_grad_()
    y = mine(x)
    if y.shape != (x.shape[0], ref.out_features):
        return dtype, y, "", None, None
    try:
        y.backward(grad_out)
    except RuntimeError as error:
        if "index 0" not in str(error) and "index 1" not in str(error):
            raise
        return dtype, y, first_line(error), None, None
    return dtype, y, "", x.grad, mine.weight.grad


def _variant_grads(x, weight, grad_out, grad_format):
    """Input and weight gradients of the FP8 recipe, the incoming gradient in ``grad_format`` (None: unquantised)."""
    xq, sx = quantize(x, "e4m3")
    wq, sw = quantize(weight, "e4m3")
    g = grad_out.float() if grad_format is None else dequantize(*quantize(grad_out, grad_format))
    return g @ dequantize(wq, sw), g.t() @ dequantize(xq, sx)


def check_float8_linear(student_class) -> str:
    """9.5: an ``nn.Linear`` subclass whose matmuls are FP8 (E4M3 forward, E5M2 gradients), fp32 master weights."""
    rng = random.Random(_seed() + 5)
    generator = torch.Generator().manual_seed(_seed() + 5)
    shapes = []
    for i in range(4):  # in ≠ out features: a square layer would hide a transposed weight gradient
        k = 16 * rng.randint(1, 6)
        shapes.append((16 * rng.randint(2, 8), k, 16 * rng.choice([i for i in range(1, 7) if 16 * i != k]),
                       rng.random() < 0.5 if i > 1 else i == 0))  # a layer with a bias and one without, always
    for m, k, n, bias in shapes:
        case_drawn("9.5", bias=bias, square=k == n)
        ref = _reference_linear(k, n, generator, bias)
        where = f"{m}×{k} input, {k}→{n} layer{' with bias' if bias else ''}"
        x = (torch.randn(m, k, generator=generator) * 2).requires_grad_()
        x_ref = x.detach().clone().requires_grad_()
        grad_out = torch.randn(m, n, generator=generator) * 1e-3
        dtype, y, backward_error, x_grad, weight_grad = run_isolated(_linear_job, student_class, ref, x, grad_out)
        if dtype != torch.float32:
            raise CheckFailed(f"{where}: weight is {dtype}; keep float32 master weights, quantise a copy")
        y_ref = ref(x_ref)
        if y.shape != y_ref.shape:
            raise CheckFailed(f"{where}: output shape {tuple(y.shape)}, expected {tuple(y_ref.shape)}")
        err = _relative(y, y_ref)
        if err > 1e-4:
            raise CheckFailed(f"{where}: forward differs from the FP8 reference by {err:.3g} (relative): "
                              f"{_forward_hint(y, x.detach(), ref.weight.detach(), ref.bias)}")
        if backward_error:  # autograd's own words for a gradient of the wrong shape
            index = "0" if "index 0" in backward_error else "1"
            what = ("grad_x must have x's shape (M×K): grad_x = g @ W" if index == "0" else
                    "grad_W must have the weight's shape (N×K): grad_W = gᵀ @ x, not xᵀ @ g")
            raise CheckFailed(f"{where}: backward returned a gradient of the wrong shape ({backward_error}): "
                              f"{what}")
        y_ref.backward(grad_out)
        for name, got, want in (("input gradient", x_grad, x_ref.grad), ("weight gradient", weight_grad,
                                                                         ref.weight.grad)):
            if got is None:
                raise CheckFailed(f"{where}: no {name}: backward must return grad_x and grad_W")
            if got.dtype != want.dtype:
                raise CheckFailed(f"{where}: the {name} is {got.dtype}, expected {want.dtype} (the dtype of what it "
                                  f"is the gradient of)")
            err = _relative(got, want)
            if err > 1e-4:
                raise CheckFailed(f"{where}: the {name} differs from the FP8 reference by {err:.3g} (relative): "
                                  f"{_gradient_hint(name, got, x_ref.detach(), ref.weight.detach(), grad_out)}")
    cfg_losses = _compare_training(run_isolated(_train_job, student_class))
    return (f"{len(shapes)} layers: output, input and weight gradients equal the reference (E4M3 forward, E5M2 "
            f"gradients, fp32 weights); a GPT trained with it for 3 steps matches ({cfg_losses})")


def _forward_hint(y, x, weight, bias) -> str:
    """Which plausible forward the student's output is: unquantised, one operand left out, or E5M2 operands."""
    def fp8(t, fmt):
        return dequantize(*quantize(t, fmt))

    for xs, ws, hint in ((x, weight, "the output equals the high-precision linear: quantise x and the weight to "
                                     "E4M3 before the matmul"),
                         (fp8(x, "e4m3"), weight, "the weight was not quantised: quantise W to E4M3 too"),
                         (x, fp8(weight, "e4m3"), "the input was not quantised: quantise x to E4M3 too"),
                         (fp8(x, "e5m2"), fp8(weight, "e5m2"), "the operands were quantised to E5M2: activations "
                                                               "and weights use E4M3 (one more mantissa bit); E5M2 "
                                                               "is for gradients")):
        if _relative(y, nn.functional.linear(xs, ws, bias)) < 1e-4:
            return hint
    return "forward is quantize(x) @ quantize(W)ᵀ in E4M3 (+ bias)"


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm().clamp_min(1e-30))


def _gradient_hint(name: str, got, x, weight, grad_out) -> str:
    index = 0 if name == "input gradient" else 1
    for fmt, hint in ((None, "the gradient was not quantised: quantise grad_output to E5M2 before both matmuls"),
                      ("e4m3", "grad_output was quantised to E4M3: gradients use E5M2 (wider range)")):
        if _relative(got, _variant_grads(x, weight, grad_out, fmt)[index]) < 1e-4:
            return hint
    return ("grad_x = g @ W and grad_W = gᵀ @ x, with g in E5M2 and the E4M3 copies of x and W saved in forward"
            if index else "grad_x = g @ W with g quantised to E5M2 and W the E4M3 copy from forward")


_TRAIN_CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=2, d_model=32)


def _train_job(student_class) -> list[float]:
    """9.5 where the student's code runs: a GPT trained 3 steps with their layer; its losses."""
    return list(train_recipe("fp8", _TRAIN_CFG, steps=3, batch_size=4,
                             linear_factory=lambda linear, path: student_class.from_linear(linear)).losses)


def _compare_training(losses: list[float]) -> str:
    ref = train_recipe("fp8", _TRAIN_CFG, steps=3, batch_size=4)
    gap = max(abs(a - b) for a, b in zip(losses, ref.losses))
    if gap > 1e-4:
        raise CheckFailed(f"a GPT with your layer trains differently from the reference FP8 recipe: losses "
                          f"{[round(v, 4) for v in losses]} vs {[round(v, 4) for v in ref.losses]}")
    return f"losses {final_loss(losses, 3):.4f} vs {final_loss(ref.losses, 3):.4f}"


# ---------------------------------------------------------------- the lab's exercises and quiz

_H100_RATIO = PEAK_FLOPS["H100 SXM fp8"] / PEAK_FLOPS["H100 SXM bf16"]

# The boundaries each exercise's text names (harness.Edge; tests/grading/test_reference_seeds.py checks every seed's
# cases hold each): exact ties between codes, subnormals and half the smallest one, -0.0, just above max, max plus
# half its step, inf and NaN in both formats; inf and NaN gradients and growth after growth_interval clean steps; an
# all-zero tile, every block shape in both formats, a spike the history has not seen; row-wise and tensor-wise, E5M2
# operands, K and N off the multiple of 16; a layer with a bias and one without, never square.
_WHATS = ("an exact tie between two codes", "half the smallest subnormal (a tie with 0)", "-0.0", "just above max",
          "max plus half its step", "+inf", "-inf")
EDGES = {
    "9.1": [Edge(f"{fmt}: {what}", lambda c, fmt=fmt, what=what: c["fmt"] == fmt and what in c["whats"])
            for fmt in ("e4m3", "e5m2") for what in _WHATS],
    "9.2": [Edge("an inf gradient", lambda c: any("inf" in p for p in c["poison"])),
            Edge("a NaN gradient", lambda c: "nan" in c["poison"]),
            Edge("growth_interval clean steps in a row", lambda c: c["clean_run"] >= c["interval"])],
    "9.3": [*(Edge(f"{name} blocks", lambda c, name=name: c.get("block") == name)
              for name in ("per-tensor", "per-row", "1×128 tiles", "128×128 blocks")),
            Edge("an all-zero tile", lambda c: c.get("zero_tile")),
            Edge("a tensor that is not square", lambda c: c.get("square") is False),
            Edge("E5M2", lambda c: c.get("fmt") == "e5m2"),
            Edge("a spike the history has not seen", lambda c: c.get("spike")),
            Edge("delayed scaling of an all-zero tensor", lambda c: c.get("all_zero")),
            Edge("delayed scaling of values under 1", lambda c: c.get("below_one"))],
    "9.4": [Edge("row-wise scales", lambda c: c.get("rowwise")), Edge("an E5M2 operand", lambda c: c.get("e5m2")),
            Edge("K off the multiple of 16", lambda c: c.get("k_off")),
            Edge("N off the multiple of 16", lambda c: c.get("n_off")),
            Edge("row-wise scales through auto, M = 2", lambda c: c.get("auto") and c.get("two_rows"))],
    "9.5": [Edge("a bias", lambda c: c["bias"]), Edge("no bias", lambda c: not c["bias"]),
            Edge("in ≠ out features", lambda c: not c["square"])],
}

# Surviving mutants of the solution cells that change nothing the exercises ask for (distlab notebooks
# mutants): key, as benchmarks/results/mutants.txt names it → why it is equivalent.
EQUIVALENT_MUTANTS = {
    '9.1 compare: `math.copysign(1.0, value) < 0` → `math.copysign(1.0, value) <= 0`':
        'math.copysign(1.0, value) is ±1, never 0',
    '9.1 statements-swapped: `if below == largest or decode_fp8(below, fmt) == magnitude: return si…` → `low, high = '
    'decode_fp8(below, fmt), decode_fp8(below + 1, fmt) if bel…`':
        'the two neighbours are decoded before the early return instead of after: decoding a code has no effect, and '
        'the return does not read them',
    '9.1 statements-swapped: `if magnitude > top: if not fmt.ieee_specials: return sign | largest #…` → `below = '
    'max(c for c in finite if decode_fp8(c, fmt) <= magnitude) # l…`':
        'the code below is found before the overflow branch instead of after: that branch returns without reading '
        'it, and a code at or below any non-negative magnitude always exists (0)',
    '9.1 statements-swapped: `if math.isnan(value): return sign | 0x7F magnitude = abs(value)` → `magnitude = '
    'abs(value) if math.isnan(value): return sign | 0x7F`':
        "two statements that do not read each other's names, in the other order",
    '9.1 statements-swapped: `if not fmt.ieee_specials: return sign | largest # E4M3 saturates half…` → `half_step = '
    '(top - decode_fp8(largest - 1, fmt)) / 2 # E4M3 saturates…`':
        "two statements that do not read each other's names, in the other order",
    '9.1 statements-swapped: `sign = -1.0 if code & 0x80 else 1.0 exponent, mantissa = (code >> M) …` → `exponent, '
    'mantissa = (code >> M) & ((1 << E) - 1), code & ((1 << M) -…`':
        "two statements that do not read each other's names, in the other order",
    '9.2 statements-swapped: `self.scale_value *= self.backoff_factor self.good_steps = 0` → `self.good_steps = 0 '
    'self.scale_value *= self.backoff_factor`':
        "two statements that do not read each other's names, in the other order",
    '9.2 statements-swapped: `self.scale_value *= self.growth_factor self.good_steps = 0` → `self.good_steps = 0 '
    'self.scale_value *= self.growth_factor`':
        "two statements that do not read each other's names, in the other order",
    '9.3 call-removed: `x.abs().max().item()` → `x.abs().max()`':
        'the amax kept as a 0-d tensor instead of a float: max, > 0 and the division give the same values, and '
        'torch.tensor copies it into the same scale',
    '9.3 statements-swapped: `self.amax_history.append(current) scale = amax / self.fmt.max if amax…` → `scale = '
    'amax / self.fmt.max if amax > 0 else 1.0 self.amax_history.ap…`':
        "two statements that do not read each other's names, in the other order (the scale uses amax, read from the "
        'history before either)',
    '9.5 arguments-swapped: `fp8_matmul(gq, wq, g_scale, w_scale, out_dtype=grad_out.dtype)` → `fp8_matmul(gq, wq, '
    'w_scale, g_scale, out_dtype=grad_out.dtype)`':
        'quantize gives one scale per tensor, and a product of two dequantised operands is the same whichever scalar '
        'multiplies which (up to rounding, within the tolerance)',
    '9.5 arguments-swapped: `fp8_matmul(gq.t(), xq, g_scale, x_scale, out_dtype=torch.float32)` → '
    '`fp8_matmul(gq.t(), xq, x_scale, g_scale, out_dtype=torch.float32)`':
        'quantize gives one scale per tensor, and a product of two dequantised operands is the same whichever scalar '
        'multiplies which (up to rounding, within the tolerance)',
    '9.5 arguments-swapped: `fp8_matmul(xq, wq.t(), x_scale, w_scale, out_dtype=x.dtype)` → `fp8_matmul(xq, wq.t(), '
    'w_scale, x_scale, out_dtype=x.dtype)`':
        'quantize gives one scale per tensor, and a product of two dequantised operands is the same whichever scalar '
        'multiplies which (up to rounding, within the tolerance)',
    '9.5 statements-swapped: `grad_x = fp8_matmul(gq, wq, g_scale, w_scale, out_dtype=grad_out.dtyp…` → `grad_w = '
    'fp8_matmul(gq.t(), xq, g_scale, x_scale, out_dtype=torch.flo…`':
        "two statements that do not read each other's names, in the other order",
    '9.5 statements-swapped: `xq, x_scale = quantize(x, "e4m3") wq, w_scale = quantize(weight, "e4m…` → `wq, w_scale '
    '= quantize(weight, "e4m3") xq, x_scale = quantize(x, "e4m…`':
        "two statements that do not read each other's names, in the other order",
    '9.5 statements-swapped: `xq, x_scale, wq, w_scale = ctx.saved_tensors gq, g_scale = quantize(g…` → `gq, g_scale '
    '= quantize(grad_out, "e5m2") xq, x_scale, wq, w_scale = c…`':
        "two statements that do not read each other's names, in the other order",
    '9.2 statements-swapped: `for g in grads: g.mul_(1.0 / self.scale_value) self.found_inf = not a…` → '
    '`self.found_inf = not all(bool(torch.isfinite(g).all()) for g in grads…`':
        "the inf/NaN test reads the gradients before unscaling instead of after: multiplying by 1/scale keeps an "
        "inf or NaN what it is, and a finite gradient finite unless it lies within 1/scale of fp32's max (3.4e38; "
        "1/scale is at most 4 here: scales start at 2^4 or more and back off at most 3 times by at most 4), which "
        "no gradient of a small model's loss comes near",
    '9.3 call-removed: `x.float()` → `x`':
        "the exercise's tensors are fp32 (the text names no other dtype), where .float() returns x itself",
    '9.3 call-removed: `x.float()` → `x` #2':
        "the exercise's tensors are fp32 (the text names no other dtype), where .float() returns x itself",
    '9.4 call-removed: `a.contiguous()` → `a`':
        "the operands handed in are row-major quantised tensors, for which .contiguous() returns a itself (and "
        "torch._scaled_mm on CPU converts any layout to fp32 first)",
    '9.4 compare: `scale_a.numel() > 1` → `scale_a.numel() >= 1`':
        "a tensor-wise scale then takes the row-wise branch: it is passed as it is instead of reshaped to (), which "
        "torch._scaled_mm on CPU (torch 2.13) reads as the same tensor-wise scale; the bf16 output the branch "
        "selects applies on CUDA only (a.is_cuda), which this checker's CPU cases never are",
    '9.4 off-by-one: `1` → `0`':
        "scale_a.numel() > 0 is the same slip as >= 1: a tensor-wise scale passed as it is, which torch._scaled_mm "
        "on CPU reads the same, and the bf16 output applies on CUDA only",
    '9.4 compare: `scale_a.numel() == 1` → `scale_a.numel() != 1`':
        "where torch._scaled_mm has row-wise scaling (support.rowwise, true on this CPU's torch 2.13 and on H100) "
        "the `or` is decided before the scale test, so auto picks the same path; the test matters only on a "
        "device without row-wise scaling, which the checker cannot make",
    '9.4 off-by-one: `1` → `0` #2':
        "where torch._scaled_mm has row-wise scaling (support.rowwise, true on this CPU's torch 2.13 and on H100) "
        "the `or` is decided before the scale test, so auto picks the same path; the test matters only on a "
        "device without row-wise scaling, which the checker cannot make",
    '9.4 statements-swapped: `support = scaled_mm_support(a.device) fits = a.shape[1] % 16 == 0 and…` → '
    '`fits = a.shape[1] % 16 == 0 and b.shape[1] % 16 == 0 support = scaled…`':
        "two statements that do not read each other's names, in the other order",
}

EXERCISES = [
    Exercise("9.1", "encode and decode E4M3 and E5M2 by hand", 3, check_codes,
             references=("distlab.fp8.formats.encode", "distlab.fp8.formats.decode")),
    Exercise("9.2", "dynamic loss scaler for FP16", 3, check_loss_scaler,
             references=("distlab.fp8.scaling.DelayedScaling",)),
    Exercise("9.3", "per-tensor, per-row, per-tile and delayed scaling", 3, check_scaling,
             references=("distlab.fp8.scaling.quantize",)),
    Exercise("9.4", "FP8 matmul: torch._scaled_mm or emulated", 3, check_fp8_matmul,
             references=("distlab.fp8.matmul.fp8_matmul", "distlab.fp8.matmul.emulated_scaled_mm")),
    Exercise("9.5", "Float8Linear: E4M3 forward, E5M2 gradients", 4, check_float8_linear,
             references=("distlab.fp8.linear.float8_matmul",)),
    number("Q9.1", "largest finite E4M3 value", answer=FORMATS["e4m3"].max,
           hint="what E4M3's top exponent holds, and which of its codes is NaN: see 'FP8 bit by bit'",
           fixed="a property of the E4M3 format: the question has no number to change"),
    choice("Q9.2", "why BF16 rather than FP16", answer="b", options="abcd",
           hint="see the table of formats and the underflow table in 'BF16 against FP16: where gradients go'"),
    number("Q9.3", "scale after an overflow at scale {scale}", given=dict(scale=65536),
           vary=dict(scale=(1024, 4096, 8192, 16384, 32768, 131072)),
           solve=lambda scale: scale * torch.amp.GradScaler("cpu", init_scale=scale).get_backoff_factor(),
           hint="see the rule of update() in 'Exercise 9.2'"),
    choice("Q9.4", "which FP8 format for gradients", answer="b", options="abcd",
           hint="see the flush-to-zero table in 'Range against precision'"),
    number("Q9.5", "scales of a {rows}×{cols} activation in 1×128 tiles", given=dict(rows=4096, cols=8192),
           vary=dict(rows=(1024, 2048, 8192), cols=(2048, 4096, 16384)),
           solve=lambda rows, cols: quantize(torch.empty(rows, cols, device="meta"), block=(1, 128))[1].numel(),
           hint="see the list of granularities in 'Scaling granularity'"),
    choice("Q9.6", "why promote partial sums to fp32 every 128 products", answer="c", options="abcd",
           hint="see the error curves in 'Accumulation: why DeepSeek-V3 promotes every 128'"),
    number("Q9.7", "step speed-up bound when {percent}% of FLOPs run at H100's FP8/BF16 peak ratio",
           given=dict(percent=90), vary=dict(percent=(50, 60, 70, 80, 95)),
           solve=lambda percent: 1 / (1 - percent / 100 + percent / 100 / _H100_RATIO), rel_tol=0.02,
           hint="see 'The H100 argument in numbers'"),
    choice("Q9.8", "which tokens set a rank's activation-gradient magnitudes", answer="b", options="abcd",
           hint="see where a run divides, in 'BF16 against FP16: where gradients go'"),
    choice("Q9.9", "what 1×128 tiles buy the ordinary channels", answer="c", options="abcd",
           hint="see the split table in 'What an outlier costs'"),
]
