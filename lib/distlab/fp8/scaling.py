"""Keeping numbers inside a narrow format: FP16 gradient underflow, scaling factors for FP8.

* :func:`gradient_underflow` — measures what FP16 does to a real model's gradients, with
  and without loss scaling (the lab's exercise 9.2 builds the scaler; ``torch.amp.GradScaler``
  is the reference).
* :func:`quantize` / :func:`dequantize` — FP8 with one scale per block: the whole tensor,
  each row, 1×128 tiles (DeepSeek-V3's activations) or 128×128 blocks (its weights).
  A scale is the *dequantisation* factor ``amax / fp8_max``, the one ``torch._scaled_mm``
  takes: ``x ≈ q · scale``. :func:`quantize_passes` lists what it costs: it is written with
  PyTorch ops, each a pass over memory, where a fused cast makes one.
* :class:`DelayedScaling` — the scale from the amax of *previous* steps (Transformer
  Engine's recipe): no extra pass over the tensor, but a sudden outlier saturates.
* :func:`accumulation_error` — a matmul whose accumulator keeps few mantissa bits, with and
  without promoting partial sums to fp32 every 128 products (DeepSeek-V3, §3.3.2).
"""

from __future__ import annotations

import math
from collections import deque

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from distlab.fp8.formats import FORMATS, Format, round_mantissa

__all__ = ["gradient_underflow", "quantize", "quantize_passes", "dequantize", "expand_scale", "DelayedScaling",
           "snr_db", "accumulation_error", "TILE"]

TILE = 128  # DeepSeek-V3's tile: 1×128 for activations, 128×128 for weights, fp32 promotion every 128 products


# --------------------------------------------------------------------------- FP16 gradient underflow


def gradient_underflow(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                       dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16),
                       loss_scales: tuple[float, ...] = (1.0,)) -> dict[tuple[torch.dtype, float], dict]:
    """What autocast to each of ``dtypes`` does to this batch's gradients, against a float32 backward.

    For each loss multiplier S (1: no loss scaling): backward through ``S · loss`` under
    ``torch.autocast(dtype)`` and count, at every ``nn.Linear`` output (the activation
    gradients that flow backward in that dtype), the elements that are non-zero in float32
    but zero in ``dtype``, and the weight-gradient elements lost the same way. A multiplier
    below 1 gives this batch the per-token magnitudes of a rank that averages its loss over
    1/S times as many tokens per step (its micro-batch times its accumulation steps);
    data-parallel averaging is not among them: it divides the parameter gradients after
    backward. The float32 backward runs once, at S = 1; multiplying its
    gradients by S is exact while S is a power of two. Returns ``{(dtype, S): {...}}`` with the
    lost fractions and the median magnitude of the float32 activation gradients at S.
    """
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    captured: list[torch.Tensor] = []
    hooks = [m.register_full_backward_hook(lambda mod, gin, gout: captured.append(gout[0].detach().float()))
             for m in linears]

    def backward(dtype: torch.dtype | None, scale: float):
        captured.clear()
        model.zero_grad(set_to_none=True)
        with torch.autocast(x.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            _, loss = model(x, y)
        (loss * scale).backward()
        return list(captured), [p.grad.detach().float().clone() for p in model.parameters() if p.grad is not None]

    try:
        act32, w32 = backward(None, 1.0)
        magnitude = torch.cat([a.flatten().abs() for a in act32])
        median = float(magnitude[magnitude > 0].median())
        act_nonzero = sum(int((a != 0).sum()) for a in act32)
        w_nonzero = sum(int((w != 0).sum()) for w in w32)
        results = {}
        for dtype in dtypes:
            for scale in loss_scales:
                act, w = backward(dtype, scale)
                results[dtype, scale] = {
                    "activation_lost": sum(int(((a != 0) & (b == 0)).sum()) for a, b in zip(act32, act)) / act_nonzero,
                    "weight_lost": sum(int(((a != 0) & (b == 0)).sum()) for a, b in zip(w32, w)) / w_nonzero,
                    "median_activation_grad": median * scale}
        model.zero_grad(set_to_none=True)
        return results
    finally:
        for h in hooks:
            h.remove()


# --------------------------------------------------------------------------- FP8 scaling factors


def _as_format(fmt: Format | str) -> Format:
    return fmt if isinstance(fmt, Format) else FORMATS[fmt]


def _block_shape(x: torch.Tensor, block: tuple[int, int] | None) -> tuple[int, int]:
    if x.dim() != 2:
        raise ValueError(f"quantize works on 2-D tensors (rows × columns); got shape {tuple(x.shape)}")
    if block is None:
        return tuple(x.shape)
    rows, cols = block
    if rows < 1 or cols < 1 or x.shape[0] % rows or x.shape[1] % cols:
        raise ValueError(f"a {rows}×{cols} block does not tile a {x.shape[0]}×{x.shape[1]} tensor: "
                         f"both sizes must be multiples of the block")
    return rows, cols


def expand_scale(scale: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Blow a (rows/br, cols/bc) grid of block scales up to one scale per element of ``shape``."""
    grid = scale.reshape(scale.shape[0] if scale.dim() else 1, -1)
    return grid.repeat_interleave(shape[0] // grid.shape[0], 0).repeat_interleave(shape[1] // grid.shape[1], 1)


def quantize(x: torch.Tensor, fmt: Format | str = "e4m3", block: tuple[int, int] | None = None,
             amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``x`` in FP8 with one float32 scale per ``block`` (None: the whole tensor).

    Each block's scale is ``amax / fp8_max``, so its largest element lands on the format's
    largest value; ``q = clamp(x / scale)`` cast to FP8. ``(1, cols)`` is per-row scaling,
    ``(1, 128)`` and ``(128, 128)`` DeepSeek-V3's tiles. ``scale`` has shape
    (rows/br, cols/bc); per-tensor it is (1, 1). ``amax`` overrides the measured amax
    (delayed scaling): elements beyond it saturate at ±fp8_max.
    """
    fmt = _as_format(fmt)
    rows, cols = _block_shape(x, block)
    x32 = x.float()
    if amax is None:
        grid = x32.reshape(x.shape[0] // rows, rows, x.shape[1] // cols, cols)
        amax = grid.abs().amax(dim=(1, 3))
    amax = torch.as_tensor(amax, dtype=torch.float32, device=x.device).reshape(x.shape[0] // rows, x.shape[1] // cols)
    scale = torch.where(amax > 0, amax / fmt.max, torch.ones_like(amax))
    q = (x32 / expand_scale(scale, tuple(x.shape))).clamp(-fmt.max, fmt.max).to(fmt.dtype)
    return q, scale


class _WholeOperandOps(TorchDispatchMode):
    """Records each aten op that reads or writes a tensor of ``numel`` elements, with the bytes it moves: every
    tensor it reads or writes, at most its storage (a broadcast scale is read once, not per element). Views move
    no memory and are left out."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.ops = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        is_view = any(r.alias_info is not None for r in func._schema.returns)
        if not is_view and any(t.numel() == self.numel for t in tensors):
            moved = sum(min(t.numel() * t.element_size(), t.untyped_storage().nbytes()) for t in tensors)
            self.ops.append((func.overloadpacket.__name__, moved))
        return out


def quantize_passes(x: torch.Tensor, fmt: Format | str = "e4m3") -> dict:
    """What :func:`quantize` (one scale for the tensor) does to ``x``, counted op by op as it runs.

    ``ops``: the aten ops that read or write the whole operand, in order — each a separate pass over memory in
    eager PyTorch; ``bytes_per_element``: what they read and write together per element of ``x``;
    ``fused_bytes_per_element``: what a fused cast moves instead, reading ``x`` once for its amax and once to
    cast it and writing one byte (delayed scaling, whose amax is known before, skips the first read)."""
    counter = _WholeOperandOps(x.numel())
    with counter:
        quantize(x, fmt)
    return {"ops": [name for name, _ in counter.ops], "bytes_per_element": sum(b for _, b in counter.ops) / x.numel(),
            "fused_bytes_per_element": 2 * x.element_size() + _as_format(fmt).dtype.itemsize}


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q · scale`` in float32, each block times its own scale."""
    return q.float() * expand_scale(scale, tuple(q.shape))


class DelayedScaling:
    """Per-tensor scaling from the largest amax of the last ``history`` steps (Transformer Engine's recipe).

    ``quantize(x)`` scales with the history's amax — known before ``x`` is read, so a fused
    kernel can cast in one pass — then records ``x``'s own amax. The first call, with an
    empty history, uses ``x``'s amax. ``saturated`` counts the elements of the last call that
    were beyond the delayed amax and clipped to ±fp8_max: the price of a sudden outlier.
    """

    def __init__(self, fmt: Format | str = "e4m3", history: int = 16):
        if history < 1:
            raise ValueError(f"history={history}: keep at least one past amax")
        self.fmt = _as_format(fmt)
        self.amax_history: deque[float] = deque(maxlen=history)
        self.saturated = 0

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        current = float(x.detach().abs().max())
        amax = max(self.amax_history) if self.amax_history else current
        self.saturated = int((x.detach().abs() > amax).sum())
        self.amax_history.append(current)
        return quantize(x, self.fmt, amax=torch.tensor(amax))


def snr_db(x: torch.Tensor, approximation: torch.Tensor) -> float:
    """Signal-to-quantisation-noise ratio, 10·log10(Σx² / Σ(x - x̂)²): +6 dB per bit of precision."""
    x = x.double()
    noise = (x - approximation.double()).pow(2).sum()
    return math.inf if noise == 0 else float(10 * torch.log10(x.pow(2).sum() / noise))


# --------------------------------------------------------------------------- accumulation precision


def accumulation_error(a: torch.Tensor, b: torch.Tensor, mantissa_bits: int = 13,
                       promote_every: int | None = None) -> torch.Tensor:
    """Relative error of ``a @ b`` summed by an accumulator with ``mantissa_bits``, after each prefix of K.

    Products are exact (FP8 × FP8 fits in float32); each is added to an accumulator rounded
    to ``mantissa_bits`` after every addition, as a tensor core with a narrow accumulator
    does. With ``promote_every=n`` the narrow partial sum is added to a float32 total and
    restarted every n products. Returns, for every k, ‖C_k − C_k*‖ / ‖C_k*‖ where C_k* is
    the float64 sum of the first k products.
    """
    a, b = a.float(), b.float()
    exact = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64)
    total = torch.zeros(a.shape[0], b.shape[1])
    partial = torch.zeros_like(total)
    errors = torch.empty(a.shape[1], dtype=torch.float64)
    for k in range(a.shape[1]):
        product = a[:, k, None] * b[None, k, :]
        exact += product.double()
        partial = round_mantissa(partial + product, mantissa_bits)
        if promote_every and (k + 1) % promote_every == 0:
            total, partial = total + partial, torch.zeros_like(partial)
        errors[k] = (total + partial - exact).norm() / exact.norm()
    return errors
