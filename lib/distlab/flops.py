"""FLOPs and model FLOPs utilisation (MFU): how much of the machine a training run really uses.

* :func:`model_flops_per_token` — training FLOPs per token of the lab's GPT, split into
  the ``6·N`` weight matmuls and the attention-score matmuls (from
  :func:`distlab.model.flops_per_token`, the one source of truth).
* :func:`measure_matmul_peak` — a peak finder: times square matmuls of growing size on
  *this* machine and keeps the best FLOP/s, the realistic ceiling for dense math here.
* :func:`mfu` — achieved model FLOP/s divided by that peak.
* :data:`PEAK_FLOPS` — datasheet numbers for accelerators people train on, to translate
  an MFU into tokens per second on, say, a thousand H100s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from distlab.model import GPTConfig, count_params, flops_per_token

__all__ = ["FlopsBreakdown", "model_flops_per_token", "MatmulPeak", "measure_matmul_peak", "mfu", "hfu",
           "PEAK_FLOPS", "tokens_per_second", "format_flops"]

# Dense (no sparsity) datasheet peaks in FLOP/s.
PEAK_FLOPS = {
    "H100 SXM bf16": 989e12,
    "H100 SXM fp8": 1979e12,
    "H100 SXM tf32": 494.5e12,
    "H100 PCIe bf16": 756e12,
    "A100 bf16": 312e12,
}


@dataclass(frozen=True)
class FlopsBreakdown:
    """Training FLOPs per token: ``dense`` = 6·N (N: non-embedding parameters plus the output
    projection), ``attention`` = 12·n_layer·d_model·seq_len (QKᵀ and attention·V)."""

    params: int  # all parameters, a tied weight once
    matmul_params: int  # N in 6·N
    dense: int
    attention: int

    @property
    def total(self) -> int:
        return self.dense + self.attention

    @property
    def attention_share(self) -> float:
        return self.attention / self.total


def model_flops_per_token(cfg: GPTConfig) -> FlopsBreakdown:
    n = count_params(cfg, include_embeddings=False) + cfg.vocab_size * cfg.d_model
    dense = 6 * n
    attention = flops_per_token(cfg) - dense
    return FlopsBreakdown(params=count_params(cfg), matmul_params=n, dense=dense, attention=attention)


@dataclass(frozen=True)
class MatmulPeak:
    flops: float  # best FLOP/s measured
    size: int  # the matmul (size × size @ size × size) that reached it
    dtype: str
    device: str
    threads: int
    by_size: dict  # size -> FLOP/s

    def __str__(self) -> str:
        return (f"{format_flops(self.flops)}/s ({self.dtype} {self.size}×{self.size} matmul on {self.device}, "
                f"{self.threads} thread(s))")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_peak(sizes=(256, 512, 1024, 2048), dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu", min_seconds: float = 0.15,
                        max_seconds_per_size: float = 2.0) -> MatmulPeak:
    """Time ``size×size @ size×size`` for each size (2·size³ FLOPs each) and return the best
    rate. Each size repeats until ``min_seconds`` have elapsed (after one warm-up). On a CPU
    this uses all of torch's intra-op threads, i.e. the whole machine a run shares."""
    device = torch.device(device)
    generator = torch.Generator(device="cpu").manual_seed(0)
    by_size = {}
    for n in sizes:
        a = torch.randn(n, n, generator=generator).to(device=device, dtype=dtype)
        b = torch.randn(n, n, generator=generator).to(device=device, dtype=dtype)
        a @ b  # warm-up: allocations, kernel selection
        _sync(device)
        count, start = 0, time.perf_counter()
        while True:
            a @ b
            count += 1
            if count % 4 == 0 or n >= 1024:
                _sync(device)
                elapsed = time.perf_counter() - start
                if elapsed >= min_seconds:
                    break
        by_size[n] = 2 * n**3 * count / elapsed
        if elapsed / count > max_seconds_per_size:  # bigger sizes would take too long here
            break
    best = max(by_size, key=by_size.get)
    return MatmulPeak(flops=by_size[best], size=best, dtype=str(dtype).replace("torch.", ""), device=str(device),
                      threads=torch.get_num_threads(), by_size=by_size)


def mfu(flops_per_token: float, tokens_per_second: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: the FLOP/s the model's math needs at this throughput, over the peak.

    Counts the model's FLOPs only (no recomputation, no optimizer, no communication), so a
    run that wastes time on anything else scores lower: that is the point of the metric."""
    if peak_flops <= 0:
        raise ValueError(f"peak_flops must be positive, got {peak_flops!r}")
    return flops_per_token * tokens_per_second / peak_flops


def hfu(flops_per_token: float, tokens_per_second: float, peak_flops: float,
        recomputed_flops_per_token: float = 0.0) -> float:
    """Hardware FLOPs utilisation: like :func:`mfu`, but counting the FLOPs the hardware actually ran,
    activation recomputation included (Korthikanti et al. 2022; PaLM reports both). At the same
    throughput HFU/MFU = 1 + recomputed/model FLOPs (≤ 4/3 for full recomputation): a run that
    recomputes more looks busier by HFU while its MFU — the model's progress — is unchanged."""
    return mfu(flops_per_token + recomputed_flops_per_token, tokens_per_second, peak_flops)


def tokens_per_second(mfu_value: float, flops_per_token: float, peak_flops: float, devices: int = 1) -> float:
    """The throughput an MFU buys: ``mfu · devices · peak / flops_per_token``."""
    return mfu_value * devices * peak_flops / flops_per_token


def format_flops(value: float) -> str:
    """``3.2e12`` → ``"3.20 TFLOP"`` (append ``/s`` for rates)."""
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} FLOP"
