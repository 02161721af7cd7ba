"""Lab 09 targets: FP8 against BF16 — GEMM throughput on this machine, and the GPT trained a few hundred steps.

Part 1, matmuls: for each size, the median time of a bf16 GEMM, an FP8 GEMM through
``torch._scaled_mm`` (E4M3, tensor-wise scales) and the emulated FP8 path (dequantise,
fp32 matmul), side by side in one run; on CUDA also FP8 including the cast of both
operands from bf16 (what an FP8 layer pays per call). On CUDA of compute capability 8.9+
these are real FP8 tensor cores; a CPU has no FP8 units (PyTorch's CPU kernel dequantises),
which the summary says.

Part 2, training: the lab's GPT (``GPTConfig()``, batch 8×64 tokens) trained for
``--steps`` AdamW steps under the fp32, bf16, fp16 (no loss scaling), fp16+scaler and
fp8 recipes of :mod:`distlab.fp8.training` on the same data, each loss divided by 8192 as
in a 4M-token global batch; saves the curves, final losses (mean of the last 20 steps)
and median step times. On CUDA it also times a larger GPT step in bf16 against fp8.

Results are saved per device in ``benchmarks/results/fp8.json`` — a CPU run keeps the
saved GPU section and a GPU run the CPU one — so the notebook shows this machine's run
beside saved H100 figures.

    python benchmarks/bench_fp8.py                 # ~3 minutes on 2 CPU cores, ~1 on an H100
    python benchmarks/bench_fp8.py --quick         # a smoke run: small sizes, 40 steps, nothing saved
    python benchmarks/bench_fp8.py --device cpu    # the CPU part only, even on a GPU machine

Exit status 1 when a target is missed: the fp8 and fp16+scaler final losses within 0.05
nats of bf16; on FP8 tensor cores, FP8 GEMM throughput ≥ 1.3× bf16 at the largest size.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from distlab import results
from distlab.flops import PEAK_FLOPS, format_flops
from distlab.fp8.training import RECIPES, compute_device, final_loss, half_precision, matmul_throughput, train_recipe
from distlab.model import GPTConfig

LOSS_TARGET = 0.05  # nats between a recipe's final loss and bf16's
SPEED_TARGET = 1.3  # FP8 / bf16 GEMM throughput on FP8 tensor cores, at the largest size
LOSS_DIVISOR = 8192  # 8 × 64 tokens per step × 8192 = a 4M-token global batch
LAST = 20  # final loss = mean of the last 20 steps


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="training steps per recipe")
    p.add_argument("--device", choices=["auto", "cpu"], default="auto")
    p.add_argument("--quick", action="store_true", help="small sizes and 40 steps, results not saved")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's; 1 keeps a shared machine's "
                                                "timings sane)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps = 40
    return args


def gemm_part(device: torch.device, quick: bool) -> tuple[list[dict], list[str]]:
    if device.type == "cuda":
        sizes = [1024, 4096] if quick else [1024, 2048, 4096, 8192, 16384]
    else:
        sizes = [128] if quick else [256, 512]
    rows, lines = [], []
    for size in sizes:
        row = matmul_throughput(size, size, size, device, min_seconds=0.1 if quick else 0.3)
        if device.type == "cuda":
            with_cast = matmul_throughput(size, size, size, device, min_seconds=0.1 if quick else 0.3,
                                          include_quantize=True)
            row["flops_per_second"]["fp8_with_cast"] = with_cast["flops_per_second"].get("fp8", float("nan"))
        rows.append(row)
        rate = row["flops_per_second"]
        cells = "  ".join(f"{name} {format_flops(value)}/s" for name, value in rate.items())
        ratio = rate["fp8"] / rate["bf16"] if "fp8" in rate else float("nan")
        lines.append(f"  {size}×{size}×{size}: {cells}  fp8/bf16 {ratio:.2f}×")
    return rows, lines


def training_part(device: torch.device, steps: int) -> tuple[dict, list[str]]:
    runs = {}
    for recipe in RECIPES:
        started = time.perf_counter()
        run = train_recipe(recipe, GPTConfig(), steps=steps, batch_size=8, lr=3e-3, device=device,
                           loss_divisor=LOSS_DIVISOR)
        runs[recipe] = dict(run.as_dict(), final=final_loss(run.losses, LAST), seconds=time.perf_counter() - started)
        print(f"  trained {recipe:<12} {runs[recipe]['seconds']:6.1f} s", flush=True)
    base = runs["bf16"]["final"]
    lines = [f"  {name:<12} final loss {r['final']:.3f} ({r['final'] - base:+.3f} vs bf16), "
             f"{r['step_seconds'] * 1e3:.1f} ms/step" + (f", {r['skipped']} steps skipped" if r["skipped"] else "")
             for name, r in runs.items()]
    return runs, lines


def big_step_part(device: torch.device, quick: bool) -> tuple[dict, str]:
    """On a GPU: the step time of a GPT large enough for its matmuls to dominate, bf16 against fp8."""
    cfg = GPTConfig(vocab_size=8192, seq_len=1024, n_layer=4, n_head=16, d_model=2048)
    steps = 6 if quick else 15
    times = {recipe: train_recipe(recipe, cfg, steps=steps, batch_size=8, lr=1e-4, device=device).step_seconds
             for recipe in ("bf16", "fp8")}
    line = (f"  GPT d_model={cfg.d_model} n_layer={cfg.n_layer} seq {cfg.seq_len} batch 8: bf16 "
            f"{times['bf16'] * 1e3:.1f} ms/step, fp8 {times['fp8'] * 1e3:.1f} ms/step "
            f"({times['bf16'] / times['fp8']:.2f}× faster)")
    return {"config": cfg.__dict__, "step_seconds": times}, line


def main(argv=None) -> int:
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = compute_device() if args.device == "auto" else torch.device("cpu")
    key = "cuda" if device.type == "cuda" else "cpu"
    machine = results.machine()
    support_line = half_precision(device)[1]
    print(f"device {device}: {support_line}", flush=True)
    gemms, gemm_lines = gemm_part(device, args.quick)
    print("\n".join(gemm_lines), flush=True)
    runs, train_lines = training_part(device, args.steps)
    big, big_line = big_step_part(device, args.quick) if device.type == "cuda" else ({}, "")

    largest = gemms[-1]["flops_per_second"]
    fp8_units = device.type == "cuda" and gemms[-1]["path"] == "torch._scaled_mm"
    speedup = largest.get("fp8", float("nan")) / largest["bf16"]
    where = (", ".join(machine["gpus"]) if device.type == "cuda" else
             f"{machine['cpus']} CPU cores, {torch.get_num_threads()} torch thread(s)")
    summary = [f"FP8 against BF16 on {where} ({key}), torch {torch.__version__}",
               f"FP8 GEMM path: {gemms[-1]['reason']}", "GEMM throughput (median):", *gemm_lines]
    if not fp8_units:
        fp32 = largest["fp32"]
        summary.append(f"  no FP8 units here: FP8 runs at {largest.get('fp8', largest['fp8_emulated']) / fp32:.2f}× "
                       f"this machine's fp32 matmul speed (it dequantises to fp32); FP8's speed-up needs FP8 tensor "
                       f"cores")
    summary.append(f"GPT trained {args.steps} steps per recipe, batch 8×64 tokens, loss ÷ {LOSS_DIVISOR} "
                   f"(a 4M-token batch), final loss = mean of the last {LAST} steps:")
    summary += train_lines
    if big_line:
        summary.append(big_line)
    peak = PEAK_FLOPS["H100 SXM fp8"] / PEAK_FLOPS["H100 SXM bf16"]
    summary.append(f"H100 SXM datasheet: dense fp8 {format_flops(PEAK_FLOPS['H100 SXM fp8'])}/s vs bf16 "
                   f"{format_flops(PEAK_FLOPS['H100 SXM bf16'])}/s = {peak:.2f}×")
    if key == "cpu" and machine["cpus"] < 4:
        summary.append(f"(measured on {machine['cpus']} cores: a busy machine shifts the timings, not the losses)")

    met = []
    for recipe in ("fp8", "fp16+scaler"):
        gap = abs(runs[recipe]["final"] - runs["bf16"]["final"])
        ok = gap <= LOSS_TARGET
        met.append(ok)
        summary.append(f"{recipe} final loss within {LOSS_TARGET} of bf16: {gap:.3f} -> {'met' if ok else 'MISSED'}")
    if fp8_units:
        ok = speedup >= SPEED_TARGET
        met.append(ok)
        summary.append(f"FP8/bf16 GEMM throughput at {gemms[-1]['shape'][0]}³: {speedup:.2f}× "
                       f"(target ≥ {SPEED_TARGET}) -> {'met' if ok else 'MISSED'}")
    text = "\n".join(summary)
    print("\n" + text)

    if not args.quick:
        try:
            data = results.load("fp8")
        except FileNotFoundError:
            data = {}
        sections = {name: data[name] for name in ("cpu", "cuda") if name in data}
        sections[key] = {"machine": dict(machine, threads=torch.get_num_threads()), "gemm": gemms, "training": runs,
                         "big_step": big, "summary": text, "steps": args.steps, "loss_divisor": LOSS_DIVISOR,
                         "last": LAST, "targets": {"loss": LOSS_TARGET, "speed": SPEED_TARGET}}
        results.save("fp8", sections, "\n\n".join(sections[name]["summary"] for name in ("cpu", "cuda")
                                                  if name in sections))
    return 0 if all(met) else 1


if __name__ == "__main__":
    sys.exit(main())
