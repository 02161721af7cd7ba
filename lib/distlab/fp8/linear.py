"""``Float8Linear``: an ``nn.Linear`` whose three matmuls run in FP8, and the swap that installs it.

Forward ``y = x Wᵀ`` with ``x`` and ``W`` quantised to **E4M3** (precision matters most for
activations and weights). Backward, the incoming gradient is quantised to **E5M2** (its
values span more binades than E4M3 holds) and two more FP8 matmuls give
``grad_x = g W`` and ``grad_W = gᵀ x``. Every tensor gets a fresh per-tensor scale from its
own amax (dynamic scaling). The weight stays a float32 ``nn.Parameter``: the optimizer
updates fp32 **master weights** and only the matmul sees an FP8 copy. Backward keeps the
FP8 ``x`` (1 byte per element, half of BF16) instead of the high-precision input.

:func:`convert_to_float8` swaps the linears of a model except those named in ``skip``:
embeddings, norms and the output head stay in BF16 (the layers whose accuracy a model's
loss is most sensitive to, and which hold few of its FLOPs), as DeepSeek-V3 does.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from distlab.fp8.matmul import fp8_matmul
from distlab.fp8.scaling import quantize

__all__ = ["Float8Linear", "convert_to_float8", "float8_matmul"]


class _Float8Matmul(torch.autograd.Function):
    """``x @ weight.T`` with E4M3 operands forward and an E5M2 gradient backward."""

    @staticmethod
    def forward(ctx, x, weight, path, notes):
        xq, x_scale = quantize(x, "e4m3")
        wq, w_scale = quantize(weight, "e4m3")
        ctx.save_for_backward(xq, x_scale, wq, w_scale)
        ctx.x_dtype, ctx.path, ctx.notes = x.dtype, path, notes
        return fp8_matmul(xq, wq.t(), x_scale, w_scale, x.dtype, path, notes)

    @staticmethod
    def backward(ctx, grad_out):
        xq, x_scale, wq, w_scale = ctx.saved_tensors
        gq, g_scale = quantize(grad_out, "e5m2")
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = fp8_matmul(gq, wq, g_scale, w_scale, ctx.x_dtype, ctx.path, ctx.notes)
        if ctx.needs_input_grad[1]:
            grad_w = fp8_matmul(gq.t(), xq, g_scale, x_scale, torch.float32, ctx.path, ctx.notes)
        return grad_x, grad_w, None, None


def float8_matmul(x: torch.Tensor, weight: torch.Tensor, path: str = "auto", notes: list | None = None) -> torch.Tensor:
    """``x @ weight.T`` for ``x`` of any leading shape, in ``x``'s dtype, differentiable, in FP8 (E4M3
    forward, E5M2 backward)."""
    flat = x.reshape(-1, x.shape[-1])
    return _Float8Matmul.apply(flat, weight, path, notes).reshape(*x.shape[:-1], weight.shape[0])


class Float8Linear(nn.Linear):
    """``nn.Linear`` with FP8 matmuls and float32 master weights; works inside ``torch.autocast``.

    Under autocast the input is cast to autocast's dtype (bf16) first, as ``nn.Linear``'s
    would be, and the output and the bias addition are in that dtype. ``notes`` collects, once each, the reasons a
    matmul took the emulated path; ``path`` forces one (see :func:`fp8_matmul`).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, path: str = "auto"):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=torch.float32)
        self.path = path
        self.notes: list[str] = []

    @classmethod
    def from_linear(cls, linear: nn.Linear, path: str = "auto") -> "Float8Linear":
        """A Float8Linear that shares ``linear``'s parameters (build optimizers after converting)."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta", path=path)
        new.weight = linear.weight
        new.bias = linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device_type = x.device.type
        autocast = torch.is_autocast_enabled(device_type)
        out_dtype = torch.get_autocast_dtype(device_type) if autocast else x.dtype
        with torch.autocast(device_type, enabled=False):
            y = float8_matmul(x.to(out_dtype), self.weight, self.path, self.notes)
            return y if self.bias is None else y + self.bias.to(out_dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8: e4m3 forward, e5m2 gradients, path={self.path}"


def convert_to_float8(model: nn.Module, skip: tuple[str, ...] = ("lm_head",), path: str = "auto",
                      factory=Float8Linear.from_linear) -> list[str]:
    """Swap every ``nn.Linear`` of ``model`` whose name is not in ``skip`` (in place); return the names swapped.

    ``factory(linear, path)`` builds the replacement (a student's class can be passed).
    Embeddings and norms are not linears and stay as they are; so does the output head
    (``lm_head``, tied to the embedding in the lab's GPT).
    """
    swapped = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, nn.Linear) and not isinstance(child, Float8Linear) and full not in skip:
                setattr(module, child_name, factory(child, path))
                swapped.append(full)
    return swapped
