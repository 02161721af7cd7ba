"""Lab 09: FP8 formats, scaling, the FP8 matmul paths, Float8Linear, precision recipes, and the checkers."""

import copy
import functools
import math
import random

import pytest
import torch
import torch.nn as nn

import distlab
from distlab import fp8
from distlab.fp8 import FORMATS, Float8Linear, decode, encode, fp8_matmul, quantize
from distlab.fp8 import matmul as fp8_matmul_module
from distlab.grading import CheckFailed, lab09
from distlab.model import GPT, GPTConfig, synthetic_batch

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_thread")]

TINY = GPTConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=2, d_model=32)
E4M3, E5M2 = FORMATS["e4m3"], FORMATS["e5m2"]


# ---------------------------------------------------------------- formats


def test_formats_come_from_finfo():
    assert (E4M3.exponent_bits, E4M3.mantissa_bits, E4M3.bias, E4M3.max) == (4, 3, 7, 448.0)
    assert (E5M2.exponent_bits, E5M2.mantissa_bits, E5M2.bias, E5M2.max) == (5, 2, 15, 57344.0)
    assert E4M3.min_subnormal == 2.0**-9 and E5M2.min_subnormal == 2.0**-16
    assert not E4M3.ieee_specials and E5M2.ieee_specials and FORMATS["bf16"].bias == 127
    assert (E4M3.max_code, E5M2.max_code) == (0x7E, 0x7B)
    assert fp8.binades(E5M2) - fp8.binades(E4M3) == pytest.approx(14.0, abs=0.1)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_decode_encode_match_torch_on_every_code_and_random_values(fmt):
    torch_values = fp8.all_codes(fmt).float().tolist()
    for code, value in enumerate(torch_values):
        mine = decode(code, fmt)
        assert (math.isnan(mine) and math.isnan(value)) or (mine == value and math.copysign(1, mine) ==
                                                             math.copysign(1, value)), code
        if not math.isnan(value):
            assert encode(value, fmt) == code
    rng = random.Random(0)
    values = torch.tensor([rng.uniform(-1, 1) * 2.0 ** rng.uniform(-20, math.log2(fmt.max)) for _ in range(3000)],
                          dtype=torch.float32).tolist()  # float32 values: PyTorch casts them without double rounding
    finite = sorted(v for v in torch_values if math.isfinite(v) and v >= 0)
    values += [(a + b) / 2 for a, b in zip(finite, finite[1:])]  # every tie
    expected = torch.tensor(values, dtype=torch.float32).to(fmt.dtype).view(torch.uint8).tolist()
    assert [encode(v, fmt) for v in values] == expected


def test_overflow_conventions():
    assert encode(1e6, E4M3) == 0x7E and encode(-math.inf, E4M3) == 0xFE  # E4M3 saturates
    assert encode(61440.0, E5M2) == 0x7C and encode(61439.0, E5M2) == 0x7B  # the tie at max + half a step -> inf
    assert math.isnan(decode(encode(math.nan, E4M3), E4M3)) and math.isnan(decode(encode(math.nan, E5M2), E5M2))
    assert fp8.round_to(torch.tensor([1e9]), E4M3).item() == 448.0
    with pytest.raises(ValueError, match="8-bit pattern"):
        decode(256, E4M3)
    with pytest.raises(ValueError, match="unknown format"):
        encode(1.0, "e3m4")


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_decode_and_encode_are_generic_over_16_bit_formats(name):
    fmt = FORMATS[name]
    codes = list(range(0, 65536, 97))
    torch_values = torch.tensor(codes, dtype=torch.int32).to(torch.int16).view(fmt.dtype).float().tolist()
    for code, value in zip(codes, torch_values):
        assert math.isnan(value) or decode(code, fmt) == value
        assert math.isnan(value) or encode(value, fmt) == code


def test_relative_error_is_bounded_by_unit_roundoff_in_the_normal_range():
    x = torch.logspace(-20, 20, 4001, base=2, dtype=torch.float64)
    for fmt in FORMATS.values():
        normal = (x >= fmt.min_normal) & (x <= fmt.max)
        assert fp8.relative_error(x[normal], fmt).max() <= fmt.unit_roundoff
    assert fp8.relative_error(torch.tensor([2.0**-30]), E4M3).item() == 1.0  # flushed to zero


def test_round_mantissa_rounds_to_nearest_even():
    one = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, -(1 + 3 * 2**-11), 1 + 2**-10 + 2**-12])
    assert fp8.round_mantissa(one, 10).tolist() == [1.0, 1 + 2**-9, -(1 + 2**-9), 1 + 2**-10]
    assert torch.equal(fp8.round_mantissa(one, 23), one)
    with pytest.raises(ValueError, match="23 explicit"):
        fp8.round_mantissa(one, 24)


# ---------------------------------------------------------------- scaling


@pytest.mark.parametrize("block", [None, (1, 256), (1, 128), (128, 128)])
def test_quantize_block_scales_and_error(block):
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    x[:, 5] *= 300
    x[:128, :128] = 0.0  # an all-zero tile
    q, scale = quantize(x, "e4m3", block)
    br, bc = block or x.shape
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (256 // br, 256 // bc) and scale.dtype == torch.float32
    assert torch.isfinite(scale).all() and (scale > 0).all()
    grid = x.reshape(256 // br, br, 256 // bc, bc).abs().amax(dim=(1, 3))
    assert torch.allclose(scale[grid > 0], grid[grid > 0] / 448)
    back = fp8.dequantize(q, scale)
    normal = x.abs() >= fp8.expand_scale(scale, x.shape) * E4M3.min_normal
    assert ((back - x).abs() / x.abs())[normal].max() <= E4M3.unit_roundoff * 1.0001
    assert q.float().abs().max() == 448.0


def test_finer_scales_beat_outliers():
    x = torch.randn(128, 1024, generator=torch.Generator().manual_seed(1)) * torch.exp(
        torch.randn(1, 1024, generator=torch.Generator().manual_seed(2)))
    x[:, 3] *= 500
    snr = {b: fp8.snr_db(x, fp8.dequantize(*quantize(x, "e4m3", b))) for b in (None, (1, 128))}
    assert snr[(1, 128)] > snr[None] + 6
    assert fp8.snr_db(x, x) == math.inf


def test_quantize_rejects_blocks_that_do_not_tile():
    with pytest.raises(ValueError, match="does not tile a 4×130"):
        quantize(torch.ones(4, 130), "e4m3", (1, 128))
    with pytest.raises(ValueError, match="2-D"):
        quantize(torch.ones(4), "e4m3")


def test_the_quantisers_passes_and_bytes_are_counted_as_it_runs():
    """fp8.quantize is unfused: each of its PyTorch ops reads or writes the whole operand, and the count says how many
    bytes per element that moves against a fused cast's read for the amax, read to cast and one-byte write."""
    x = torch.randn(64, 128).to(torch.bfloat16)
    passes = fp8.quantize_passes(x)
    assert "amax" in passes["ops"] and passes["ops"][-1] == "_to_copy" and len(passes["ops"]) >= 5, passes
    assert passes["fused_bytes_per_element"] == 2 + 2 + 1
    assert passes["bytes_per_element"] > 5 * passes["fused_bytes_per_element"], passes
    assert fp8.quantize_passes(x.float())["fused_bytes_per_element"] == 4 + 4 + 1
    cost = fp8.quantize_cost(64, 128, min_seconds=0.0)
    assert cost["passes"]["ops"] == passes["ops"] and set(cost["seconds"]) == {"quantize", "one cast kernel"}
    assert all(seconds > 0 for seconds in cost["seconds"].values())


def test_delayed_scaling_uses_history_and_clips_a_new_outlier():
    delayed = fp8.DelayedScaling("e4m3", history=2)
    ones = torch.ones(4, 4)
    _, s0 = delayed.quantize(ones)  # empty history: the tensor's own amax
    assert s0.item() == pytest.approx(1 / 448) and delayed.saturated == 0
    spike = ones.clone()
    spike[0, 0] = 10.0
    q, s1 = delayed.quantize(spike)
    assert s1.item() == pytest.approx(1 / 448) and delayed.saturated == 1 and q.float().max() == 448.0
    _, s2 = delayed.quantize(ones)  # the spike is now in the history
    assert s2.item() == pytest.approx(10 / 448)
    delayed.quantize(ones)
    _, s4 = delayed.quantize(ones)  # ... and has left it
    assert s4.item() == pytest.approx(1 / 448)


def test_accumulation_error_grows_with_k_and_promotion_bounds_it():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(8, 1024, generator=gen).to(torch.float8_e4m3fn).float()
    b = torch.randn(1024, 8, generator=gen).to(torch.float8_e4m3fn).float()
    narrow = fp8.accumulation_error(a, b, 13)
    promoted = fp8.accumulation_error(a, b, 13, promote_every=128)
    wide = fp8.accumulation_error(a, b, 23)
    assert narrow[-1] > 2 * narrow[127] and narrow[-1] > 2 * promoted[-1]
    assert torch.equal(narrow[:128], promoted[:128]) and wide[-1] < 1e-6


def test_gradient_underflow_fp16_against_bf16():
    model = GPT(TINY, seed=0)
    x, y = synthetic_batch(TINY, 4, step=0)
    hooks_before = sum(len(m._backward_hooks) for m in model.modules())
    lost = fp8.gradient_underflow(model, x, y, (torch.float16, torch.bfloat16), (1.0, 2.0**-20))
    h_plain, h_small, b_small = lost[torch.float16, 1.0], lost[torch.float16, 2.0**-20], lost[torch.bfloat16, 2.0**-20]
    assert h_small["activation_lost"] > 0.5 > h_plain["activation_lost"]
    assert h_small["median_activation_grad"] == pytest.approx(h_plain["median_activation_grad"] * 2.0**-20)
    assert b_small["activation_lost"] < 0.01 and 0 <= h_small["weight_lost"] <= 1
    assert sum(len(m._backward_hooks) for m in model.modules()) == hooks_before
    assert all(p.grad is None for p in model.parameters())


def test_fp16_loses_more_as_a_rank_averages_over_more_tokens():
    """The lab's per-rank divisors (4096 and 131072 tokens over 512): FP16's loss grows, BF16's does not."""
    model = GPT(TINY, seed=0)
    x, y = synthetic_batch(TINY, 4, step=0)
    scales = (1.0, 1 / 8, 1 / 256)
    lost = fp8.gradient_underflow(model, x, y, (torch.float16, torch.bfloat16), scales)
    fp16 = [lost[torch.float16, s]["activation_lost"] for s in scales]
    assert fp16[0] < fp16[1] < fp16[2] < 0.9  # a share that grows, not everything
    assert max(lost[torch.bfloat16, s]["activation_lost"] for s in scales) < 0.01


# ---------------------------------------------------------------- FP8 matmul


def _operands(m, k, n, seed=0, dtype_b=torch.float8_e4m3fn):
    gen = torch.Generator().manual_seed(seed)
    a, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) * 0.1
    return a, w


@pytest.mark.parametrize("kind,blocks", [("tensorwise", (None, None)), ("rowwise", ("row", "row")),
                                         ("blockwise", ((1, 128), (128, 128)))])
def test_both_paths_compute_the_dequantised_product(kind, blocks):
    a, w = _operands(64, 256, 128)
    ba = (1, a.shape[1]) if blocks[0] == "row" else blocks[0]
    bw = (1, w.shape[1]) if blocks[1] == "row" else blocks[1]
    (aq, sa), (wq, sw) = quantize(a, "e4m3", ba), quantize(w, "e4m3", bw)
    b, sb = wq.t(), sw.t()
    assert fp8.scale_kind(aq, b, sa, sb) == kind
    reference = fp8.dequantize(aq, sa) @ fp8.dequantize(wq, sw).t()
    emulated = fp8_matmul(aq, b, sa, sb, torch.float32, path="emulated")
    assert torch.allclose(emulated, reference, rtol=1e-5, atol=1e-5)
    if fp8.scaled_mm_support("cpu").tensorwise:
        native = fp8_matmul(aq, b, sa, sb, torch.float32, path="torch._scaled_mm")
        assert torch.allclose(native, reference, rtol=1e-4, atol=1e-4)
    assert ((emulated - a @ w.t()).norm() / (a @ w.t()).norm()) < 0.06  # E4M3: a few percent


def test_e5m2_gradient_times_e4m3_weight():
    g, w = _operands(32, 64, 48)
    (gq, sg), (wq, sw) = quantize(g, "e5m2"), quantize(w.t().contiguous(), "e4m3")
    out = fp8_matmul(gq, wq, sg, sw, torch.float32, path="emulated")
    assert torch.allclose(out, fp8.dequantize(gq, sg) @ fp8.dequantize(wq, sw), rtol=1e-5, atol=1e-6)


def test_bad_input_is_one_clear_line():
    aq, sa = quantize(torch.randn(17, 40), "e4m3")
    wq, sw = quantize(torch.randn(24, 40), "e4m3")
    cases = [
        (lambda: fp8_matmul(aq, wq.t(), sa, sw, path="torch._scaled_mm"), "multiples of 16"),
        (lambda: fp8_matmul(aq, wq.t(), sa.double(), sw), "scale_a is torch.float64; FP8 matmul scales are float32"),
        (lambda: fp8_matmul(aq, wq.t(), torch.ones(17, 2), sw), r"row-wise \(17, 1\) and \(1, 24\)"),
        (lambda: fp8_matmul(aq.float(), wq.t(), sa, sw), "quantize it first"),
        (lambda: fp8_matmul(aq, wq, sa, sw), "inner dimensions differ: a is 17×40, b is 24×40"),
        (lambda: fp8_matmul(aq.float().to(torch.float8_e5m2), wq.t().float().to(torch.float8_e5m2), sa, sw),
         "E5M2 × E5M2"),
        (lambda: fp8_matmul(aq, wq.t(), sa, sw, path="fast"), "path='fast'"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    notes = []
    out = fp8_matmul(aq, wq.t(), sa, sw, notes=notes)
    assert out.shape == (17, 24) and out.dtype == torch.bfloat16
    assert len(notes) == 1 and notes[0].startswith("emulated: a 17×40 @ 40×24 matmul")


def test_a_device_without_scaled_mm_emulates_and_says_why(monkeypatch):
    unsupported = fp8.ScaledMMSupport("cpu", False, False, "emulated: NVIDIA A100 (compute capability 8.0) has no "
                                                           "FP8 tensor cores")
    monkeypatch.setattr(fp8_matmul_module, "scaled_mm_support", lambda device: unsupported)
    aq, sa = quantize(torch.randn(32, 64), "e4m3")
    wq, sw = quantize(torch.randn(48, 64), "e4m3")
    notes = []
    out = fp8_matmul(aq, wq.t(), sa, sw, torch.float32, notes=notes)
    assert torch.equal(out, fp8.emulated_scaled_mm(aq, wq.t(), sa, sw, torch.float32))
    assert notes == [unsupported.reason]
    with pytest.raises(ValueError, match="cannot use torch._scaled_mm: NVIDIA A100"):
        fp8_matmul(aq, wq.t(), sa, sw, path="torch._scaled_mm")


def test_cpu_support_is_reported():
    support = fp8.scaled_mm_support("cpu")
    assert support.path in ("torch._scaled_mm", "emulated") and support.reason
    if support.tensorwise:
        assert "no FP8 units" in support.reason


# ---------------------------------------------------------------- Float8Linear


def test_float8_linear_forward_and_gradients():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    reference = copy.deepcopy(linear)
    layer = Float8Linear.from_linear(linear)
    assert layer.weight is linear.weight and layer.weight.dtype == torch.float32
    x = torch.randn(32, 64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = layer(x), reference(x_ref)
    assert ((y - y_ref).norm() / y_ref.norm()) < 0.06
    g = torch.randn_like(y) * 1e-4
    y.backward(g)
    y_ref.backward(g)
    assert ((x.grad - x_ref.grad).norm() / x_ref.grad.norm()) < 0.15
    assert layer.weight.grad.dtype == torch.float32
    # exactly the recipe: E4M3 x and W, E5M2 gradient
    xq, sx = quantize(x.detach(), "e4m3")
    wq, sw = quantize(linear.weight.detach(), "e4m3")
    gq, sg = quantize(g, "e5m2")
    dequant = fp8.dequantize
    assert torch.allclose(x.grad, dequant(gq, sg) @ dequant(wq, sw), rtol=1e-5, atol=1e-9)
    assert torch.allclose(layer.weight.grad, dequant(gq, sg).t() @ dequant(xq, sx), rtol=1e-5, atol=1e-9)
    assert torch.allclose(layer.bias.grad, g.sum(0))


def test_float8_linear_under_autocast_and_odd_shapes():
    layer = Float8Linear(40, 24)
    x = torch.randn(2, 5, 40, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.shape == (2, 5, 24) and y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and layer.weight.grad.shape == (24, 40)
    assert any("multiples of 16" in note for note in layer.notes)


def test_convert_to_float8_keeps_head_embeddings_and_norms():
    model = GPT(TINY, seed=0)
    params = {id(p) for p in model.parameters()}
    swapped = fp8.convert_to_float8(model)
    assert swapped == ["blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.fc", "blocks.0.mlp.proj"]
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.tok_emb.weight
    assert {id(p) for p in model.parameters()} == params  # the same master weights
    assert fp8.convert_to_float8(model) == []  # idempotent


def test_recipes_train_and_fp16_needs_a_scaler():
    kwargs = dict(cfg=TINY, steps=12, batch_size=4, lr=1e-2, loss_divisor=2**20)
    runs = {r: fp8.train_recipe(r, **kwargs) for r in ("fp32", "fp16", "fp16+scaler", "fp8")}
    assert runs["fp32"].losses[-1] < runs["fp32"].losses[0] - 0.3
    assert abs(fp8.final_loss(runs["fp8"].losses, 4) - fp8.final_loss(runs["fp32"].losses, 4)) < 0.05
    assert abs(fp8.final_loss(runs["fp16+scaler"].losses, 4) - fp8.final_loss(runs["fp32"].losses, 4)) < 0.05
    assert fp8.final_loss(runs["fp16"].losses, 4) > fp8.final_loss(runs["fp32"].losses, 4) + 0.1
    assert runs["fp8"].converted and runs["fp16+scaler"].scales[0] == 2.0**16
    with pytest.raises(ValueError, match="recipe='int4'"):
        fp8.train_recipe("int4", cfg=TINY, steps=1)


def test_matmul_throughput_reports_every_path():
    r = fp8.matmul_throughput(32, 32, 32, "cpu", min_seconds=0.0)
    assert {"fp32", "bf16", "fp8_emulated"} <= set(r["flops_per_second"]) and r["reason"]
    assert all(v > 0 for v in r["flops_per_second"].values())


def test_half_precision_names_its_reason():
    dtype, why = fp8.half_precision(torch.device("cpu"))
    assert dtype == torch.bfloat16 and "bf16 on CPU" in why


@pytest.mark.usefixtures("no_leftover_ranks")
def test_fp8_all_gather_on_real_ranks_equals_one_process():
    run = distlab.launch(fp8.distributed.demo, world_size=2, kwargs=dict(rows=64, cols=32), collective_timeout=30,
                         show_output=False)
    shared, own = run[0]["shared scale"], run[0]["own scale"]
    assert run[0] == run[1] and shared["codes_equal"] and shared["scales_equal"] and shared["relative_error"] < 0.06
    assert not own["codes_equal"] and own["relative_error"] > 0.5
    assert shared["payload_bytes"] == 64 * 32 + 2 * 4 and run[0]["bf16"]["payload_bytes"] == 2 * 64 * 32
    with pytest.raises(distlab.RankFailed, match="rows=64 must be divisible by the world size 3"):
        distlab.launch(fp8.distributed.demo, world_size=3, kwargs=dict(rows=64), show_output=False)


# ---------------------------------------------------------------- checkers


def _native(a, b, sa, sb, out_dtype):
    return fp8_matmul(a, b, sa, sb, out_dtype, path="torch._scaled_mm")


def _auto(a, b, sa, sb, out_dtype):
    notes = []
    out = fp8_matmul(a, b, sa, sb, out_dtype, notes=notes)
    return out, "emulated" if notes or not fp8.scaled_mm_support(a.device).tensorwise else "torch._scaled_mm"


GradScaler = functools.partial(torch.amp.GradScaler, "cpu")


def test_checkers_pass_the_references():
    assert "all 256 codes" in lab09.check_codes(decode, encode)
    assert "GradScaler" in lab09.check_loss_scaler(GradScaler)
    assert "delayed scaling" in lab09.check_scaling(quantize, fp8.DelayedScaling)
    assert "native calls torch._scaled_mm" in lab09.check_fp8_matmul(fp8.emulated_scaled_mm, _native, _auto)
    assert "a GPT trained with it" in lab09.check_float8_linear(Float8Linear)
    ids = [e.id for e in lab09.EXERCISES]
    assert ids[:5] == ["9.1", "9.2", "9.3", "9.4", "9.5"] and len([i for i in ids if i.startswith("Q")]) >= 5


def test_code_mistakes_are_named():
    def e4m3_with_inf(code, fmt):
        return math.inf if code == 0x78 and not fmt.ieee_specials else decode(code, fmt)

    with pytest.raises(CheckFailed, match=r"decode\(0x78 \(0 1111 000\)\) returned inf.*exponent 1111 holds ordinary"):
        lab09.check_codes(e4m3_with_inf, encode)

    def no_subnormals(code, fmt):
        return 0.0 if (code >> fmt.mantissa_bits) & ((1 << fmt.exponent_bits) - 1) == 0 and code & 0x7F else \
            decode(code, fmt)

    with pytest.raises(CheckFailed, match="subnormal, \\(-1\\)\\^s · 0.m"):
        lab09.check_codes(no_subnormals, encode)

    def ties_away(value, fmt):  # rounds exact ties up, away from zero
        code = encode(value, fmt)
        if math.isfinite(value) and 0 < value < fmt.max:
            up = code + 1 if decode(code, fmt) < value else code
            if up > 0 and decode(up, fmt) - value == value - decode(up - 1, fmt):
                return up
        return code

    with pytest.raises(CheckFailed, match="ties? to the code with an even"):
        lab09.check_codes(decode, ties_away)

    def nan_on_overflow(value, fmt):
        return 0x7F if not fmt.ieee_specials and abs(value) > fmt.max else encode(value, fmt)

    with pytest.raises(CheckFailed, match="E4M3 has no inf: values beyond ±448 saturate"):
        lab09.check_codes(decode, nan_on_overflow)


class _Scaler:
    """A correct from-scratch scaler for the mistakes below to bend."""

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self.s, self.grow, self.back, self.interval = init_scale, growth_factor, backoff_factor, growth_interval
        self.good, self.inf = 0, False

    def scale(self, loss):
        return loss * self.s

    def get_scale(self):
        return self.s

    def unscale(self, grads):
        for g in grads:
            g.mul_(1.0 / self.s)

    def step(self, optimizer):
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        self.unscale(grads)
        self.inf = not all(torch.isfinite(g).all() for g in grads)
        if not self.inf:
            optimizer.step()

    def update(self):
        if self.inf:
            self.s, self.good = self.s * self.back, 0
        else:
            self.good += 1
            if self.good == self.interval:
                self.s, self.good = self.s * self.grow, 0


def test_loss_scaler_mistakes_are_named():
    assert "GradScaler" in lab09.check_loss_scaler(_Scaler)

    class NeverSkips(_Scaler):
        def step(self, optimizer):
            super().step(optimizer)
            if self.inf:
                optimizer.step()

    class GrowsEveryStep(_Scaler):
        def update(self):
            self.s = self.s * self.back if self.inf else self.s * self.grow

    class NoUnscale(_Scaler):
        def unscale(self, grads):
            pass

    class KeepsCountAfterOverflow(_Scaler):
        def update(self):
            if self.inf:
                self.s *= self.back
            else:
                super().update()

    for scaler, message in ((NeverSkips, "updated the weights: skip optimizer.step"),
                            (GrowsEveryStep, "grow it by growth_factor only after growth_interval"),
                            (NoUnscale, "unscale"),
                            (KeepsCountAfterOverflow, "grow it by growth_factor only after growth_interval")):
        with pytest.raises(CheckFailed, match=message):
            lab09.check_loss_scaler(scaler)


def test_scaling_mistakes_are_named():
    def inverse_scale(x, fmt, block=None):
        q, s = quantize(x, fmt, block)
        return q, 1 / s

    with pytest.raises(CheckFailed, match="not its inverse"):
        lab09.check_scaling(inverse_scale, fp8.DelayedScaling)

    def divides_by_zero(x, fmt, block=None):
        q, s = quantize(x, fmt, block)
        br, bc = block or x.shape
        amax = x.reshape(x.shape[0] // br, br, x.shape[1] // bc, bc).abs().amax(dim=(1, 3))
        return q, amax / fmt.max

    with pytest.raises(CheckFailed, match="all-zero block has amax 0"):
        lab09.check_scaling(divides_by_zero, fp8.DelayedScaling)

    def ignores_block(x, fmt, block=None):
        return quantize(x, fmt, None)

    with pytest.raises(CheckFailed, match="1 scales, expected"):
        lab09.check_scaling(ignores_block, fp8.DelayedScaling)

    class CurrentNotDelayed(fp8.DelayedScaling):
        def quantize(self, x):
            return quantize(x, self.fmt)

    with pytest.raises(CheckFailed, match="largest amax of the previous steps"):
        lab09.check_scaling(quantize, CurrentNotDelayed)


def test_matmul_mistakes_are_named():
    def divides(a, b, sa, sb, out_dtype):
        return ((a.float() / sa) @ (b.float() / sb)).to(out_dtype)

    with pytest.raises(CheckFailed, match="you divided by the scales"):
        lab09.check_fp8_matmul(divides, _native, _auto)

    def emulates_instead(a, b, sa, sb, out_dtype):
        return fp8.emulated_scaled_mm(a, b, sa, sb, out_dtype)

    if fp8.scaled_mm_support("cpu").tensorwise:
        with pytest.raises(CheckFailed, match="torch._scaled_mm was never called"):
            lab09.check_fp8_matmul(fp8.emulated_scaled_mm, emulates_instead, _auto)

    def always_native(a, b, sa, sb, out_dtype):
        return fp8.emulated_scaled_mm(a, b, sa, sb, out_dtype), "torch._scaled_mm"

    with pytest.raises(CheckFailed, match="multiples of 16"):
        lab09.check_fp8_matmul(fp8.emulated_scaled_mm, _native, always_native)


class _FromLinear(nn.Linear):
    """The given half of the notebook's MyFloat8Linear: parameters shared, autocast handled, ``FUNCTION`` applied."""

    FUNCTION = None

    @classmethod
    def from_linear(cls, linear):
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        new.weight, new.bias = linear.weight, linear.bias
        return new

    def forward(self, x):
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        with torch.autocast(device, enabled=False):
            y = self.FUNCTION.apply(x.to(dtype).reshape(-1, x.shape[-1]), self.weight).reshape(*x.shape[:-1], -1)
            return y if self.bias is None else y + self.bias.to(dtype)


def _linear_variant(grad_format):
    """A Float8Linear whose backward quantises the gradient to ``grad_format`` (None: not at all)."""

    class Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight):
            xq, sx = quantize(x, "e4m3")
            wq, sw = quantize(weight, "e4m3")
            ctx.save_for_backward(xq, sx, wq, sw)
            return fp8_matmul(xq, wq.t(), sx, sw, x.dtype)

        @staticmethod
        def backward(ctx, g):
            xq, sx, wq, sw = ctx.saved_tensors
            if grad_format is None:
                return g @ fp8.dequantize(wq, sw), g.t().float() @ fp8.dequantize(xq, sx)
            gq, sg = quantize(g, grad_format)
            return fp8_matmul(gq, wq, sg, sw, g.dtype, path="emulated"), fp8_matmul(gq.t(), xq, sg, sx, torch.float32,
                                                                                     path="emulated")

    class Layer(_FromLinear):
        FUNCTION = Function

    return Layer


def test_float8_linear_mistakes_are_named():
    assert "equal the reference" in lab09.check_float8_linear(_linear_variant("e5m2"))
    with pytest.raises(CheckFailed, match="gradients use E5M2"):
        lab09.check_float8_linear(_linear_variant("e4m3"))
    with pytest.raises(CheckFailed, match="the gradient was not quantised"):
        lab09.check_float8_linear(_linear_variant(None))

    class HighPrecision(_FromLinear):
        def forward(self, x):
            return nn.functional.linear(x, self.weight, self.bias)

    with pytest.raises(CheckFailed, match="quantise x and the weight to E4M3"):
        lab09.check_float8_linear(HighPrecision)


def test_stubs_are_not_attempted_and_quiz_answers_check():
    def stub(*args, **kwargs):
        raise NotImplementedError("Exercise 9.1: replace this line with your solution")

    class StubScaler(_Scaler):
        def step(self, optimizer):
            raise NotImplementedError("Exercise 9.2: replace this line with your solution")

    assert distlab.check("9.1", stub, stub, quiet=True).status == "not attempted"
    assert distlab.check("9.2", StubScaler, quiet=True).status == "not attempted"
    assert distlab.check("9.4", stub, stub, stub, quiet=True).status == "not attempted"
    answers = {"Q9.1": 448, "Q9.2": "b", "Q9.3": 32768, "Q9.4": "b", "Q9.5": 262144, "Q9.6": "c",
               "Q9.7": 1 / (0.1 + 0.9 / 2), "Q9.8": "b", "Q9.9": "c"}
    for question, answer in answers.items():
        assert distlab.check(question, answer, quiet=True).status == "passed", question
    assert distlab.check("Q9.1", 240, quiet=True).status == "failed"
    assert distlab.check("Q9.1", ..., quiet=True).status == "not attempted"
