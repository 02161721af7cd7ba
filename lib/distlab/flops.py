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
import torch.distributed as dist

from distlab.model import GPTConfig, count_params, flops_per_token
from distlab.runtime.rank import device as rank_device

__all__ = ["FlopsBreakdown", "model_flops_per_token", "MatmulPeak", "measure_matmul_peak", "mfu", "hfu",
           "PEAK_FLOPS", "tokens_per_second", "format_flops", "resolve_peak", "StepReport", "step_report"]

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


# ---------------------------------------------------------------- what a training job prints per step

def resolve_peak(peak: float | str = "measured", device: str | torch.device = "cpu") -> tuple[float, str]:
    """The per-device peak an MFU is taken against, and how it was found.

    ``peak`` is a number of FLOP/s (a datasheet you trust), a key of :data:`PEAK_FLOPS`, or
    ``"measured"``: :func:`measure_matmul_peak` on ``device`` now (bf16 on a GPU, fp32 on a CPU, short
    sizes on a CPU so a job starts at once) — the ceiling this machine really reaches.
    """
    if isinstance(peak, (int, float)) and not isinstance(peak, bool):
        if peak <= 0:
            raise ValueError(f"peak must be a positive number of FLOP/s, got {peak!r}")
        return float(peak), f"stated {format_flops(peak)}/s"
    if peak in PEAK_FLOPS:
        return PEAK_FLOPS[peak], f"{peak} datasheet"
    if peak != "measured":
        raise ValueError(f"peak must be FLOP/s, 'measured' or one of {', '.join(PEAK_FLOPS)}; got {peak!r}")
    device = torch.device(device)
    if device.type == "cuda":
        found = measure_matmul_peak(sizes=(2048, 4096, 8192), dtype=torch.bfloat16, device=device, min_seconds=0.1)
    else:
        found = measure_matmul_peak(sizes=(128, 256, 512), device=device, min_seconds=0.02)
    return found.flops, f"measured {found.dtype} matmul peak {format_flops(found.flops)}/s"


def _unfaithful(mfu_value: float | None) -> str:
    """A step cannot beat the peak its MFU is taken against: above 100%, the timing is not to be trusted."""
    return "  (unfaithful: above 100% of the peak)" if mfu_value is not None and mfu_value > 1 else ""


class StepReport:
    """One line per optimizer step and a final summary: what someone watching a cluster job reads.

    ``tokens_per_step`` counts every rank's tokens; ``flops_per_token`` is the model's
    (:func:`model_flops_per_token`), so MFU = FLOPs/token · tokens/s / (``peak_flops`` · ``devices``).
    ``every`` prints every k-th step and the last (0 prints nothing: a notebook's default); only
    the process with ``show`` prints (rank 0). Steps below ``warmup`` are printed but not counted
    in the summary's medians. ``peak_flops=None`` (a rank that prints nothing) reports no MFU.
    """

    def __init__(self, name: str, steps: int, tokens_per_step: int, flops_per_token: float, peak_flops: float | None,
                 peak_name: str, devices: int, every: int = 1, warmup: int = 0, show: bool = True):
        self.name, self.steps, self.tokens, self.flops_per_token = name, steps, tokens_per_step, flops_per_token
        self.peak_flops, self.peak_name, self.devices = peak_flops, peak_name, devices
        self.every, self.warmup, self.show = int(every), warmup, show and int(every) > 0
        self.losses: list[float] = []
        self.seconds: list[float] = []

    def line(self, step: int, loss: float, seconds: float) -> str:
        rate = self.tokens / seconds
        value = mfu(self.flops_per_token, rate, self.peak_flops * self.devices)
        tag = " (warm-up)" if step < self.warmup else ""
        return (f"[{self.name}] step {step + 1}/{self.steps}  loss {loss:.4f}  {rate:,.0f} tokens/s  "
                f"MFU {100 * value:.2f}%  {1000 * seconds:.1f} ms{tag}{_unfaithful(value)}")

    def step(self, step: int, loss: float, seconds: float) -> None:
        self.losses.append(float(loss))
        self.seconds.append(float(seconds))
        if self.show and (step % self.every == 0 or step == self.steps - 1):
            print(self.line(step, loss, seconds), flush=True)

    def summary(self) -> dict:
        if not self.seconds:  # a resumed job that found its last step already done
            return {"steps": 0, "mfu": None, "peak": self.peak_name}
        timed = self.seconds[self.warmup:] or self.seconds
        median = sorted(timed)[len(timed) // 2]
        rate = self.tokens / median
        return {"steps": len(self.losses), "loss_first": round(self.losses[0], 4),
                "loss_last": round(self.losses[-1], 4), "step_time_s": round(median, 4),
                "tokens_per_s": round(rate, 1),
                "mfu": round(mfu(self.flops_per_token, rate, self.peak_flops * self.devices), 6)
                if self.peak_flops else None, "peak": self.peak_name}

    def finish(self) -> dict:
        """Print the final summary line (when showing) and return it as a dict."""
        out = self.summary()
        if self.show and out["steps"]:
            print(f"[{self.name}] done: {out['steps']} steps, loss {out['loss_first']:.4f} → {out['loss_last']:.4f}, "
                  f"median {1000 * out['step_time_s']:.1f} ms/step, {out['tokens_per_s']:,.0f} tokens/s, "
                  f"MFU {100 * out['mfu']:.2f}% of {self.devices} × {out['peak']}{_unfaithful(out['mfu'])}", flush=True)
        return out


def step_report(name: str, cfg: GPTConfig, steps: int, tokens_per_step: int, every: int = 0,
                peak: float | str = "measured", warmup: int = 0) -> StepReport | None:
    """A :class:`StepReport` for this rank's training job, or None when ``every`` is 0 (nothing to print).

    Only rank 0 prints, so only rank 0 resolves the peak (a measurement takes a fraction of a second).
    """
    if not int(every):
        return None
    rank = dist.get_rank() if dist.is_initialized() else 0
    devices = dist.get_world_size() if dist.is_initialized() else 1
    peak_flops, peak_name = resolve_peak(peak, rank_device()) if rank == 0 else (None, "not measured off rank 0")
    return StepReport(name, steps, tokens_per_step, model_flops_per_token(cfg).total, peak_flops, peak_name,
                      devices, every=every, warmup=warmup, show=rank == 0)
