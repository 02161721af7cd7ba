"""FP8 matrix multiplication: ``torch._scaled_mm`` where the platform has it, emulated elsewhere.

``fp8_matmul(a, b, scale_a, scale_b)`` computes ``(a · scale_a) @ (b · scale_b)`` for FP8
``a`` (M×K) and ``b`` (K×N) with float32 dequantisation scales of one of three shapes:

* tensor-wise: one scale each (numel 1);
* row-wise: ``scale_a`` (M, 1), ``scale_b`` (1, N);
* block-wise (DeepSeek-V3): ``scale_a`` (M, K/128) for 1×128 tiles of ``a``, ``scale_b``
  (K/128, N/128) for 128×128 blocks of ``b``.

Two paths with the same interface, chosen automatically and reported:

* ``"torch._scaled_mm"`` — FP8 tensor cores on CUDA compute capability 8.9+ (Ada, Hopper,
  Blackwell), and a CPU kernel in recent PyTorch (oneDNN's on a CPU with AMX, else one that
  converts both operands to fp32: ``_scaled_mm_out_cpu`` in aten's ``Blas.cpp``; a CPU has no
  FP8 units). Block-wise scales run as one ``_scaled_mm`` per 128-wide slice of K with
  the scales applied while the partial sums are accumulated in float32 — DeepSeek-V3's
  promotion scheme.
* ``"emulated"`` — dequantise to float32 and multiply: same numbers up to accumulation
  order, no speed-up; for T4, A100, old PyTorch, or shapes the kernels refuse.

Bad input fails here with one line naming the constraint, never inside torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from distlab.fp8.formats import FP8_FORMATS
from distlab.fp8.scaling import TILE, expand_scale

__all__ = ["ScaledMMSupport", "scaled_mm_support", "fp8_matmul", "emulated_scaled_mm", "scale_kind", "MULTIPLE",
           "FP8_DTYPES"]

MULTIPLE = 16  # cuBLASLt's FP8 GEMMs need K and N to be multiples of 16
FP8_DTYPES = tuple(f.dtype for f in FP8_FORMATS)
_NAMES = {f.dtype: f.name.upper() for f in FP8_FORMATS}


@dataclass(frozen=True)
class ScaledMMSupport:
    """What this device can do natively: ``tensorwise``/``rowwise`` scales through ``torch._scaled_mm``."""

    device: str
    tensorwise: bool
    rowwise: bool
    reason: str  # one line: why this path, for the notebook to print

    @property
    def path(self) -> str:
        return "torch._scaled_mm" if self.tensorwise else "emulated"


def _probe(device: torch.device, rowwise: bool) -> bool:
    """Run a 16×16 ``_scaled_mm``: whether this PyTorch has a kernel for it on this device."""
    a = torch.zeros(MULTIPLE, MULTIPLE, device=device).to(torch.float8_e4m3fn)
    b = torch.zeros(MULTIPLE, MULTIPLE, device=device).to(torch.float8_e4m3fn).t()
    shape_a, shape_b = ((MULTIPLE, 1), (1, MULTIPLE)) if rowwise else ((), ())
    try:
        torch._scaled_mm(a, b, scale_a=torch.ones(shape_a, device=device), scale_b=torch.ones(shape_b, device=device),
                         out_dtype=torch.bfloat16)
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


@lru_cache(maxsize=None)
def _support(device: str) -> ScaledMMSupport:
    dev = torch.device(device)
    version = torch.__version__.split("+")[0]
    if not hasattr(torch, "_scaled_mm"):
        return ScaledMMSupport(device, False, False, f"emulated: torch {version} has no torch._scaled_mm")
    if dev.type == "cuda":
        major, minor = torch.cuda.get_device_capability(dev)
        name = torch.cuda.get_device_name(dev)
        if (major, minor) < (8, 9):
            return ScaledMMSupport(device, False, False,
                                   f"emulated: {name} (compute capability {major}.{minor}) has no FP8 tensor cores; "
                                   f"they need 8.9+ (Ada, Hopper, Blackwell)")
        where = f"{name} (compute capability {major}.{minor}): FP8 tensor cores"
    else:  # aten's _scaled_mm_out_cpu: oneDNN's kernel on a CPU with AMX, else both operands converted to fp32
        amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
        kernel = "oneDNN's kernel (this CPU has AMX)" if amx else "a kernel that converts both operands to fp32 first"
        where = f"{dev.type.upper()} (torch {version}): {kernel}; no FP8 units"
    tensorwise = _probe(dev, rowwise=False)
    if not tensorwise:
        return ScaledMMSupport(device, False, False,
                               f"emulated: torch {version} has no _scaled_mm kernel for {dev.type}")
    rowwise = _probe(dev, rowwise=True)
    note = "" if rowwise else "; row-wise scales emulated (no row-wise kernel here)"
    return ScaledMMSupport(device, True, rowwise, f"torch._scaled_mm on {where}{note}")


def scaled_mm_support(device: str | torch.device = "cpu") -> ScaledMMSupport:
    """Which FP8 matmul path ``device`` gets and why (probed once per device)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return _support(str(dev))


def scale_kind(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor) -> str:
    """``"tensorwise"``, ``"rowwise"`` or ``"blockwise"`` for these operands; ValueError naming what fits."""
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"fp8_matmul multiplies 2-D matrices; got a {tuple(a.shape)} and b {tuple(b.shape)}")
    (m, k), (k2, n) = a.shape, b.shape
    if k != k2:
        raise ValueError(f"inner dimensions differ: a is {m}×{k}, b is {k2}×{n}")
    for name, t in (("a", a), ("b", b)):
        if t.dtype not in FP8_DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; fp8_matmul takes float8_e4m3fn or float8_e5m2 "
                             f"(quantize it first)")
    if a.dtype == b.dtype == torch.float8_e5m2:
        raise ValueError("E5M2 × E5M2 is not an FP8 GEMM the tensor cores run: one operand must be E4M3 "
                         "(E5M2 is for gradients, E4M3 for activations and weights)")
    for name, s in (("scale_a", scale_a), ("scale_b", scale_b)):
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32:
            kind = s.dtype if isinstance(s, torch.Tensor) else type(s).__name__
            raise ValueError(f"{name} is {kind}; FP8 matmul scales are float32 tensors")
        if s.device != a.device:
            raise ValueError(f"{name} is on {s.device} but the operands are on {a.device}")
    shape_a, shape_b = tuple(scale_a.shape), tuple(scale_b.shape)
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        return "tensorwise"
    if shape_a == (m, 1) and shape_b == (1, n):
        return "rowwise"
    if k % TILE == 0 and n % TILE == 0 and shape_a == (m, k // TILE) and shape_b == (k // TILE, n // TILE):
        return "blockwise"
    blockwise = (f"; block-wise ({m}, {k // TILE}) and ({k // TILE}, {n // TILE})" if k % TILE == 0 and n % TILE == 0
                 else "; block-wise needs K and N multiples of 128")
    raise ValueError(f"scale shapes {shape_a} and {shape_b} fit no scaling for a {m}×{k} @ {k}×{n} matmul: "
                     f"tensor-wise takes one scale each; row-wise ({m}, 1) and (1, {n}){blockwise}")


def emulated_scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                       out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantise both operands (each element times its block's scale) and multiply in float32 (autocast off)."""
    def dequantized(q, scale):
        return q.float() * (scale.reshape(()) if scale.numel() == 1 else expand_scale(scale, tuple(q.shape)))

    with torch.autocast(a.device.type, enabled=False):
        return (dequantized(a, scale_a) @ dequantized(b, scale_b)).to(out_dtype)


def _native(a, b, scale_a, scale_b, out_dtype, kind):
    a = a.contiguous()
    b = b.t().contiguous().t()  # the second operand column-major, as cuBLASLt wants it
    if kind == "tensorwise":
        return torch._scaled_mm(a, b, scale_a=scale_a.reshape(()), scale_b=scale_b.reshape(()), out_dtype=out_dtype)
    if kind == "rowwise":  # CUDA's row-wise kernels write bf16 only
        written = torch.bfloat16 if a.is_cuda else out_dtype
        out = torch._scaled_mm(a, b, scale_a=scale_a.contiguous(), scale_b=scale_b.contiguous(), out_dtype=written)
        return out.to(out_dtype)
    # block-wise: one FP8 GEMM per 128-wide slice of K, scaled and summed in float32 (promotion every 128)
    one = torch.ones((), device=a.device)
    col_scales = scale_b.repeat_interleave(TILE, 1)  # (K/128, N)
    out = torch.zeros(a.shape[0], b.shape[1], device=a.device)
    for j in range(a.shape[1] // TILE):
        cols = slice(j * TILE, (j + 1) * TILE)
        partial = torch._scaled_mm(a[:, cols].contiguous(), b[cols, :], scale_a=one, scale_b=one,
                                   out_dtype=torch.float32)
        out += partial * scale_a[:, j:j + 1] * col_scales[j]
    return out.to(out_dtype)


def fp8_matmul(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
               out_dtype: torch.dtype = torch.bfloat16, path: str = "auto", notes: list | None = None) -> torch.Tensor:
    """``(a · scale_a) @ (b · scale_b)`` on the best path for this device and these shapes.

    ``path="auto"`` takes ``torch._scaled_mm`` where the device has it and the shapes fit
    (K and N multiples of 16 — the rule of cuBLASLt's FP8 GEMMs, checked on every device
    so a laptop run takes the path an H100 would), else the emulated path, appending why to
    ``notes`` if given. ``path="torch._scaled_mm"`` raises ValueError when that cannot run;
    ``path="emulated"`` always emulates.
    """
    kind = scale_kind(a, b, scale_a, scale_b)
    if path == "emulated":
        return emulated_scaled_mm(a, b, scale_a, scale_b, out_dtype)
    if path not in ("auto", "torch._scaled_mm"):
        raise ValueError(f"path={path!r}; expected 'auto', 'torch._scaled_mm' or 'emulated'")
    support = scaled_mm_support(a.device)
    k, n = a.shape[1], b.shape[1]
    why = None
    if not support.tensorwise:
        why = support.reason
    elif k % MULTIPLE or n % MULTIPLE:
        why = (f"emulated: a {a.shape[0]}×{k} @ {k}×{n} matmul; torch._scaled_mm needs K and N to be multiples "
               f"of {MULTIPLE} (pad the layer, or keep it in BF16)")
    elif kind == "rowwise" and not support.rowwise:
        why = "emulated: this device has no row-wise scaled kernel"
    if why is None:
        return _native(a, b, scale_a, scale_b, out_dtype, kind)
    if path == "torch._scaled_mm":
        raise ValueError(why.replace("emulated: ", "cannot use torch._scaled_mm: ", 1))
    if notes is not None and why not in notes:
        notes.append(why)
    return emulated_scaled_mm(a, b, scale_a, scale_b, out_dtype)
