"""Lab 09: mixed precision and FP8 — formats bit by bit, loss scaling, FP8 scaling, FP8 matmuls and layers.

* :mod:`~distlab.fp8.formats` — E4M3, E5M2, FP16, BF16 from ``torch.finfo``; encode/decode by hand.
* :mod:`~distlab.fp8.scaling` — FP16 gradient underflow, per-tensor/row/tile
  quantisation, delayed scaling, SNR, narrow accumulators and fp32 promotion.
* :mod:`~distlab.fp8.matmul` — ``fp8_matmul``: ``torch._scaled_mm`` or the emulated path, chosen and reported.
* :mod:`~distlab.fp8.linear` — ``Float8Linear`` and ``convert_to_float8``.
* :mod:`~distlab.fp8.training` — the GPT trained under fp32/bf16/fp16/fp8 recipes; GEMM throughput.
* :mod:`~distlab.fp8.distributed` — one FP8 scale for a sharded weight, and the FP8 all-gather.
"""

from distlab.fp8 import distributed
from distlab.fp8.formats import (
    FORMATS,
    FP8_FORMATS,
    Format,
    all_codes,
    binades,
    bit_fields,
    decode,
    encode,
    relative_error,
    round_mantissa,
    round_to,
)
from distlab.fp8.linear import Float8Linear, convert_to_float8, float8_matmul
from distlab.fp8.matmul import ScaledMMSupport, emulated_scaled_mm, fp8_matmul, scale_kind, scaled_mm_support
from distlab.fp8.scaling import (
    TILE,
    DelayedScaling,
    accumulation_error,
    dequantize,
    expand_scale,
    gradient_underflow,
    quantize,
    quantize_passes,
    snr_db,
)
from distlab.fp8.training import (
    HBM_BYTES_PER_SECOND,
    RECIPES,
    TrainResult,
    compute_device,
    final_loss,
    half_precision,
    matmul_throughput,
    quantize_cost,
    train,
    train_recipe,
)

__all__ = [
    "distributed", "FORMATS", "FP8_FORMATS", "Format", "all_codes", "binades", "bit_fields", "decode", "encode",
    "relative_error",
    "round_mantissa", "round_to", "Float8Linear", "convert_to_float8", "float8_matmul", "ScaledMMSupport",
    "emulated_scaled_mm", "fp8_matmul", "scale_kind", "scaled_mm_support", "TILE", "DelayedScaling",
    "accumulation_error", "dequantize", "expand_scale", "gradient_underflow", "quantize", "quantize_passes",
    "snr_db", "RECIPES", "TrainResult", "compute_device", "final_loss", "half_precision", "matmul_throughput",
    "quantize_cost", "HBM_BYTES_PER_SECOND", "train_recipe", "train",
]
