"""Training the lab's GPT under a precision recipe, and timing FP8 matmuls against BF16.

Recipes (all keep float32 master weights and AdamW state):

=============== =====================================================================
``fp32``        no autocast: the reference
``bf16``        ``torch.autocast(bfloat16)``: matmuls in bf16, norms and softmax in fp32
``fp16``        ``torch.autocast(float16)`` with no loss scaling
``fp16+scaler`` the same with dynamic loss scaling (``torch.amp.GradScaler`` or yours)
``fp8``         ``bf16`` plus every block linear swapped for :class:`Float8Linear`;
                embeddings, norms and the output head stay in the bf16 recipe
=============== =====================================================================

Each run starts from ``GPT(cfg, seed)`` and sees the same ``synthetic_batch`` stream, so
two recipes differ only in arithmetic. :func:`matmul_throughput` times one GEMM shape in
bf16 and in FP8 on the given device, the comparison ``benchmarks/bench_fp8.py`` runs at
H100 sizes; :func:`quantize_cost` times the library's unfused quantiser against the one pass a fused
cast makes.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from distlab.data_parallel import make_ddp, train_step
from distlab.data_parallel import train as train_data_parallel
from distlab.fp8.formats import FORMATS
from distlab.fp8.linear import Float8Linear, convert_to_float8
from distlab.fp8.matmul import fp8_matmul, scaled_mm_support
from distlab.fp8.scaling import quantize, quantize_passes
from distlab.model import GPT, GPTConfig, synthetic_batch
from distlab.reference import make_optimizer
from distlab.runtime.rank import device as rank_device
from distlab.runtime.rank import native_bf16

__all__ = ["RECIPES", "TrainResult", "train_recipe", "compute_device", "half_precision", "matmul_throughput",
           "quantize_cost", "HBM_BYTES_PER_SECOND", "final_loss", "train"]

RECIPES = ("fp32", "bf16", "fp16", "fp16+scaler", "fp8")
_AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp16+scaler": torch.float16,
             "fp8": torch.bfloat16}


def compute_device() -> torch.device:
    """This notebook's device: the GPU when there is one, else the CPU (a single process, no ranks)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def half_precision(device: torch.device) -> tuple[torch.dtype, str]:
    """The 16-bit dtype to train in on ``device`` and one line saying why."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if native_bf16(device):
            return torch.bfloat16, f"bf16 on {name}: native bf16 tensor cores"
        return torch.float16, f"fp16 + loss scaling on {name}: no bf16 below compute capability 8.0"
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported() if hasattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported") \
        else False
    return torch.bfloat16, ("bf16 on CPU with native bf16 instructions" if native else
                            "bf16 on CPU without bf16 instructions: right numbers, slow kernels")


@dataclass
class TrainResult:
    recipe: str
    losses: list[float] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)  # loss scale used at each step (fp16+scaler)
    skipped: int = 0  # steps the scaler skipped for inf/NaN gradients
    step_seconds: float = 0.0  # median wall time of a step
    converted: list[str] = field(default_factory=list)  # layers swapped to Float8Linear
    notes: list[str] = field(default_factory=list)  # why an FP8 matmul was emulated

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def final_loss(losses: list[float], last: int = 10) -> float:
    """The mean of the last ``last`` losses: one step's loss is noisy, a short mean is not."""
    tail = losses[-last:]
    return sum(tail) / len(tail)


def train_recipe(recipe: str, cfg: GPTConfig | None = None, steps: int = 100, batch_size: int = 8, lr: float = 3e-3,
                 seed: int = 0, device: torch.device | str = "cpu", scaler=None, linear_factory=None,
                 path: str = "auto", loss_divisor: float = 1.0) -> TrainResult:
    """Train ``GPT(cfg, seed)`` for ``steps`` AdamW steps under ``recipe``; losses in float32.

    ``loss_divisor=D`` gives backward the gradient magnitudes of one rank of a run in which
    each rank averages its loss over D times our tokens per step (its micro-batch times its
    accumulation steps; data-parallel averaging divides parameter gradients after backward and
    never reaches the activation gradients): the loss is divided by D, and the gradients are
    multiplied by D before AdamW (standing in for the other micro-batches and ranks), so in
    float32 the run is unchanged and any difference is what the low-precision backward lost.

    ``scaler``: for ``fp16+scaler``, an object with ``scale(loss)``, ``step(opt)``,
    ``update()``, ``get_scale()`` (default: ``torch.amp.GradScaler`` with growth every 100
    steps). ``linear_factory``: for ``fp8``, builds each FP8 layer from an ``nn.Linear``
    (default :meth:`Float8Linear.from_linear`).
    """
    if recipe not in RECIPES:
        raise ValueError(f"recipe={recipe!r}; expected one of {', '.join(RECIPES)}")
    device = torch.device(device)
    cfg = cfg or GPTConfig()
    model = GPT(cfg, seed=seed).to(device)
    result = TrainResult(recipe)
    if recipe == "fp8":
        factory = linear_factory or Float8Linear.from_linear
        result.converted = convert_to_float8(model, path=path, factory=factory)
    if recipe == "fp16+scaler" and scaler is None:
        scaler = torch.amp.GradScaler(device.type, growth_interval=100)
    optimizer = _Rescaled(make_optimizer(model.parameters(), "adamw", lr=lr), loss_divisor)
    dtype = _AUTOCAST[recipe]
    times = []
    for step in range(steps):
        x, y = (t.to(device) for t in synthetic_batch(cfg, batch_size, step, seed=seed))
        started = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        if recipe == "fp16+scaler":
            result.scales.append(float(scaler.get_scale()))
            scaler.scale(loss / loss_divisor).backward()
            scaler.step(optimizer)
            scaler.update()
            result.skipped += float(scaler.get_scale()) < result.scales[-1]  # backed off: this step was skipped
        else:
            (loss / loss_divisor).backward()
            optimizer.step()
        result.losses.append(float(loss.detach()))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    result.step_seconds = statistics.median(times[1:] or times)
    result.notes = sorted({n for m in model.modules() if isinstance(getattr(m, "notes", None), list) for n in m.notes})
    return result


class _Rescaled:
    """An optimizer that multiplies every gradient by ``factor`` before stepping (see ``loss_divisor``).

    It exposes ``param_groups`` and ``step``, all a loss scaler needs, so the multiplication
    happens after the scaler has unscaled and checked the gradients.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, factor: float):
        self.optimizer, self.factor = optimizer, factor
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self):
        if self.factor != 1.0:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(self.factor)
        return self.optimizer.step()


def _seconds(fn, device: torch.device) -> float:
    """One call's wall time, the device's queue drained."""
    started = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def _median_seconds(fn, device: torch.device, min_seconds: float, max_repeats: int = 1000) -> float:
    _seconds(fn, device)  # warm-up: kernel selection, allocations
    times = []
    while (sum(times) < min_seconds or len(times) < 3) and len(times) < max_repeats:
        times.append(_seconds(fn, device))
    return statistics.median(times)


def matmul_throughput(m: int, k: int, n: int, device: torch.device | str = "cpu", min_seconds: float = 0.2,
                      include_quantize: bool = False) -> dict:
    """Median FLOP/s of one (m×k)@(k×n) GEMM in fp32, bf16 and FP8 (E4M3, tensor-wise scales) on ``device``.

    ``fp8`` uses the path :func:`fp8_matmul` picks; ``fp8_emulated`` always dequantises.
    With ``include_quantize`` the FP8 timings include casting both operands from bf16,
    the overhead a real FP8 layer pays on every call. Also returns which path ran and why.
    """
    device = torch.device(device)
    generator = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(m, k, generator=generator).to(device, torch.bfloat16)
    w = torch.randn(n, k, generator=generator).to(device, torch.bfloat16)
    aq, sa = quantize(a, "e4m3")
    wq, sw = quantize(w, "e4m3")
    b = wq.t()
    flops = 2 * m * k * n

    def fp8(path):
        if include_quantize:
            return lambda: fp8_matmul(*_quantized(a, w), out_dtype=torch.bfloat16, path=path)
        return lambda: fp8_matmul(aq, b, sa, sw, out_dtype=torch.bfloat16, path=path)

    support = scaled_mm_support(device)
    a32, w32 = a.float(), w.float()
    seconds = {"fp32": _median_seconds(lambda: a32 @ w32.t(), device, min_seconds),
               "bf16": _median_seconds(lambda: a @ w.t(), device, min_seconds),
               "fp8_emulated": _median_seconds(fp8("emulated"), device, min_seconds)}
    if support.tensorwise and k % 16 == 0 and n % 16 == 0:
        seconds["fp8"] = _median_seconds(fp8("torch._scaled_mm"), device, min_seconds)
    return {"shape": [m, k, n], "device": str(device), "path": support.path, "reason": support.reason,
            "seconds": seconds, "flops_per_second": {name: flops / s for name, s in seconds.items()}}


# HBM bandwidth: the rate of a memory-bound pass over an operand (NVIDIA H100 Tensor Core GPU datasheet, SXM)
HBM_BYTES_PER_SECOND = {"H100 SXM": 3.35e12}


def quantize_cost(rows: int, cols: int, device: torch.device | str = "cpu", min_seconds: float = 0.2) -> dict:
    """Median seconds to cast one ``rows × cols`` bf16 operand to E4M3 on ``device``: with :func:`quantize` (its
    amax, scale and cast as separate PyTorch ops, the cast that ``matmul_throughput(include_quantize=True)`` pays),
    and with one cast kernel, ``x.to(float8_e4m3fn)`` — the single read and write a fused cast makes (a fused cast
    with a current amax reads the operand once more). ``passes``: :func:`quantize_passes` of the operand."""
    device = torch.device(device)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)).to(device, torch.bfloat16)
    e4m3 = FORMATS["e4m3"].dtype
    casts = {"quantize": lambda: quantize(x, "e4m3"), "one cast kernel": lambda: x.to(e4m3)}
    times = {name: [] for name in casts}
    for cast in casts.values():
        _seconds(cast, device)  # warm-up
    while sum(map(sum, times.values())) < min_seconds or len(times["quantize"]) < 5:
        for name, cast in casts.items():  # interleaved, so that a busy machine slows both alike
            times[name].append(_seconds(cast, device))
    return {"shape": [rows, cols], "device": str(device), "passes": quantize_passes(x),
            "seconds": {name: statistics.median(values) for name, values in times.items()}}


def _quantized(a: torch.Tensor, w: torch.Tensor):
    aq, sa = quantize(a, "e4m3")
    wq, sw = quantize(w, "e4m3")
    return aq, wq.t(), sa, sw


def train(steps: int = 10, recipe: str = "fp8", batch_size: int = 4, n_layer: int = 2, d_model: int = 64,
          n_head: int = 4, vocab_size: int = 256, seq_len: int = 64, lr: float = 3e-3, seed: int = 0, warmup: int = 1,
          path: str = "auto", log_every: int = 0, peak: float | str = "measured") -> dict:
    """Train the lab's GPT data-parallel under a precision recipe; the entry point for torchrun::

        torchrun --nproc-per-node=8 -m distlab.torchrun distlab.fp8:train recipe=fp8 steps=100

    Lab 03's overlapped DDP (:func:`distlab.data_parallel.train`) around a GPT whose block linears are
    :class:`Float8Linear` (``recipe="fp8"``), each step's forward and backward under the recipe's autocast;
    gradients and AdamW stay float32, so DDP reduces them as always. ``fp16+scaler`` is left out: a loss
    scaler must skip a step on every rank together. ``batch_size`` is per rank. Returns data_parallel's
    summary with the layers converted; ``log_every=k`` (torchrun's default is 1): rank 0 prints every k-th
    step and a summary, MFU against ``peak`` (measured: bf16 matmuls, FP8's are up to twice as fast).
    """
    if recipe not in RECIPES or recipe == "fp16+scaler":
        runs = ", ".join(r for r in RECIPES if r != "fp16+scaler")
        raise ValueError(f"recipe={recipe!r}; the data-parallel worker runs {runs}")
    dtype = _AUTOCAST[recipe]
    dev = rank_device()
    converted = []

    def make(module, bucket_cap_bytes):
        if recipe == "fp8":
            converted[:] = convert_to_float8(module, path=path)
        return make_ddp("overlapped", module, bucket_cap_bytes)

    def step(ddp, optimizer, micro_batches):
        with torch.autocast(dev.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            return train_step(ddp, optimizer, micro_batches)

    out = train_data_parallel(steps=steps, batch_size=batch_size, n_layer=n_layer, d_model=d_model, n_head=n_head,
                              vocab_size=vocab_size, seq_len=seq_len, lr=lr, seed=seed, warmup=warmup,
                              log_every=log_every, peak=peak, ddp_factory=make, step_fn=step, name=f"{recipe} dp")
    return dict(out, variant=f"overlapped, {recipe}", converted=len(converted))
