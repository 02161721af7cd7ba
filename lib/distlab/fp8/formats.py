"""Floating-point formats bit by bit: FP8 (E4M3, E5M2), FP16, BF16, FP32.

A format is a sign bit, E exponent bits with a bias and M mantissa bits. Everything a
lab says about a format — its largest value, its smallest normal and subnormal, its
relative precision — is read here from ``torch.finfo`` (the one source of truth), so the
numbers on screen are the ones PyTorch computes with.

:func:`decode` and :func:`encode` turn a bit pattern into a value and back with plain
integer arithmetic and round-to-nearest-even, the way the hardware does. They are the
reference the lab's exercise 9.1 is checked against, and they are checked against
PyTorch's own ``float8`` dtypes on all 256 codes.

The special values differ between the two FP8 formats, and that is the point of them:

* **E5M2** is IEEE-like: exponent all ones means ±inf (mantissa 0) or NaN. Overflow
  rounds to inf. Range 2^-16 … 57344: wide, for gradients.
* **E4M3** (``float8_e4m3fn``: *f*inite, *n*o infinities) gives the all-ones exponent to
  ordinary numbers and keeps only S.1111.111 for NaN, buying one more binade: max 448.
  There is no inf to overflow into, so values past the range saturate to ±448 (the
  convention FP8 training recipes use, and what PyTorch ≥ 2.10 does when casting).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Format", "FORMATS", "FP8_FORMATS", "decode", "encode", "bit_fields", "all_codes", "round_to",
           "relative_error", "round_mantissa", "binades"]


@dataclass(frozen=True)
class Format:
    """A binary floating-point format, read off ``torch.finfo(dtype)``."""

    name: str
    dtype: torch.dtype
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max: float  # largest finite value
    min_normal: float  # 2^(1 - bias)
    min_subnormal: float  # 2^(1 - bias - M)
    ieee_specials: bool  # exponent all ones = inf/NaN (E5M2, FP16, BF16); False: only S.1111.111 is NaN (E4M3)

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def unit_roundoff(self) -> float:
        """The largest relative error of round-to-nearest in the normal range: 2^-(M+1)."""
        return 2.0 ** -(self.mantissa_bits + 1)

    @property
    def max_code(self) -> int:
        """The bit pattern of +max: S.1110.11…1 with IEEE specials, S.1111.110 for E4M3 (S.1111.111 is NaN)."""
        ones = (1 << (self.exponent_bits + self.mantissa_bits)) - 1
        return ones - (1 << self.mantissa_bits) if self.ieee_specials else ones - 1

    @classmethod
    def from_dtype(cls, name: str, dtype: torch.dtype) -> "Format":
        info = torch.finfo(dtype)
        mantissa = round(-math.log2(info.eps))
        exponent = info.bits - 1 - mantissa
        bias = 1 - round(math.log2(info.smallest_normal))
        return cls(name, dtype, exponent, mantissa, bias, float(info.max), float(info.smallest_normal),
                   float(info.smallest_normal) * float(info.eps), ieee_specials=not str(dtype).endswith("fn"))


FORMATS: dict[str, Format] = {name: Format.from_dtype(name, dtype) for name, dtype in (
    ("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2), ("fp16", torch.float16),
    ("bf16", torch.bfloat16), ("fp32", torch.float32))}
FP8_FORMATS = (FORMATS["e4m3"], FORMATS["e5m2"])


def _fmt(fmt: Format | str) -> Format:
    if isinstance(fmt, Format):
        return fmt
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    return FORMATS[fmt]


def decode(code: int, fmt: Format | str) -> float:
    """The value of bit pattern ``code``: (-1)^s · 1.m · 2^(e - bias), or 0.m · 2^(1 - bias) when e = 0."""
    fmt = _fmt(fmt)
    E, M = fmt.exponent_bits, fmt.mantissa_bits
    if not 0 <= code < 2 ** fmt.bits:
        raise ValueError(f"code {code} is not a {fmt.bits}-bit pattern")
    sign = -1.0 if code >> (E + M) else 1.0
    exponent = (code >> M) & ((1 << E) - 1)
    mantissa = code & ((1 << M) - 1)
    all_ones = (1 << E) - 1
    if fmt.ieee_specials and exponent == all_ones:
        return sign * math.inf if mantissa == 0 else math.nan
    if not fmt.ieee_specials and exponent == all_ones and mantissa == (1 << M) - 1:
        return math.nan
    if exponent == 0:  # subnormal: no implicit leading 1, exponent fixed at 1 - bias
        return sign * mantissa * 2.0 ** (1 - fmt.bias - M)
    return sign * (1 + mantissa / 2**M) * 2.0 ** (exponent - fmt.bias)


def encode(value: float, fmt: Format | str) -> int:
    """The bit pattern nearest ``value`` (ties to even mantissa).

    Overflow goes to ±inf where the format has it (E5M2) and saturates to ±max where it
    does not (E4M3); NaN becomes the all-ones NaN pattern with the input's sign.
    """
    fmt = _fmt(fmt)
    E, M = fmt.exponent_bits, fmt.mantissa_bits
    sign = (1 << (E + M)) if math.copysign(1.0, value) < 0 else 0
    if math.isnan(value):
        return sign | ((1 << (E + M)) - 1)
    magnitude = abs(value)
    if magnitude == 0:
        return sign
    overflow = sign | (((1 << E) - 1) << M if fmt.ieee_specials else fmt.max_code)
    if math.isinf(magnitude):
        return overflow
    exponent = max(math.frexp(magnitude)[1] - 1, 1 - fmt.bias)  # magnitude = 1.f · 2^exponent (or subnormal)
    quantum = 2.0 ** (exponent - M)  # the spacing of representable values at this exponent
    steps = round(magnitude / quantum)  # exact division by a power of two; round() ties to even
    if steps == 2 ** (M + 1):  # rounding carried into the next binade
        exponent, steps = exponent + 1, 2**M
    if steps * 2.0 ** (exponent - M) > fmt.max:
        return overflow
    if steps < 2**M:  # subnormal (steps may be 0: underflow to ±0)
        return sign | steps
    return sign | ((exponent + fmt.bias) << M) | (steps - 2**M)


def bit_fields(code: int, fmt: Format | str) -> str:
    """``0x7e (0 1111 110)``: a code with its sign, exponent and mantissa fields apart."""
    fmt = _fmt(fmt)
    b = format(code, f"0{fmt.bits}b")
    e = fmt.exponent_bits
    return f"0x{code:0{fmt.bits // 4}x} ({b[0]} {b[1:1 + e]} {b[1 + e:]})"


def all_codes(fmt: Format | str) -> torch.Tensor:
    """Every 8-bit pattern of an FP8 format viewed as that dtype, in code order (0 … 255)."""
    fmt = _fmt(fmt)
    if fmt.bits != 8:
        raise ValueError(f"{fmt.name} has {fmt.bits}-bit codes; all_codes lists the 256 codes of an FP8 format")
    return torch.arange(256, dtype=torch.uint8).view(fmt.dtype)


def round_to(x: torch.Tensor, fmt: Format | str) -> torch.Tensor:
    """``x`` rounded to the format by PyTorch's own cast, back in float32 (saturating for E4M3)."""
    fmt = _fmt(fmt)
    x = x.float()
    if not fmt.ieee_specials:  # older PyTorch casts overflow to NaN: clamp first, as every FP8 recipe does
        x = x.clamp(-fmt.max, fmt.max)
    return x.to(fmt.dtype).float()


def relative_error(x: torch.Tensor, fmt: Format | str) -> torch.Tensor:
    """|round(x) - x| / |x| elementwise: 1 where x underflows to 0; inf where it overflows to inf."""
    x = x.double()
    return ((round_to(x, fmt).double() - x).abs() / x.abs())


def binades(fmt: Format | str, subnormals: bool = True) -> float:
    """How many powers of two the format spans, from its smallest (sub)normal to its max."""
    fmt = _fmt(fmt)
    return math.log2(fmt.max / (fmt.min_subnormal if subnormals else fmt.min_normal))


def round_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """float32 ``x`` rounded to ``bits`` explicit mantissa bits (nearest, ties to even), exponent untouched.

    Emulates an accumulator narrower than float32 (FP8 tensor cores keep about 14 bits)
    by integer arithmetic on the float32 bit pattern.
    """
    if not 0 < bits <= 23:
        raise ValueError(f"bits={bits}: float32 has 23 explicit mantissa bits")
    if bits == 23:
        return x
    drop = 23 - bits
    as_int = x.float().contiguous().view(torch.int32)
    lsb = (as_int >> drop) & 1
    rounded = (as_int + (1 << (drop - 1)) - 1 + lsb) & ~((1 << drop) - 1)
    return rounded.view(torch.float32)
