"""Lab 04 targets: from-scratch ZeRO-3 against PyTorch's FSDP2, side by side, and a scaling run.

1. **Step time**: ``distlab.zero`` ZeRO-3 (with and without prefetch) and FSDP2 ``fully_shard``
   train the same GPT (per-block units, AdamW, fp32) on the same warm group of gloo ranks.
   Repeats are interleaved (the order rotates every repeat) so drift of a shared machine hits
   every variant alike; a variant's step time is the median over all its timed steps, each the
   slowest rank's. Target: ZeRO-3 ≤ 1.3 × FSDP2.
2. **Peak memory per rank** of one training step, both implementations: on the CPU, bytes of
   live tensors followed by PyTorch's ``MemTracker``; on GPUs ``torch.cuda.max_memory_allocated``.
   Target: within 10 % of FSDP2's.
3. **Scaling**: the torchrun entry point ``distlab.zero:train`` at 1, 2 and 4 ranks with a fixed
   per-rank batch and one thread per rank: tokens/s over all ranks and model-state bytes per rank.
   More ranks than cores means the ranks take turns: the results say so.
4. With a CUDA GPU: the same ZeRO-3 and FSDP2 step on one GPU (NCCL, bf16 compute), timed with
   ``torch.cuda.max_memory_allocated`` beside it.

    python benchmarks/bench_zero.py            # a few minutes on 2 cores
    python benchmarks/bench_zero.py --quick    # a smoke run (results not saved)

Writes ``benchmarks/results/zero.json`` and ``zero.txt``. Exit status 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import distlab
from distlab import results
from distlab.model import GPT, GPTConfig
from distlab.runtime.launch import default_threads
from distlab.zero import train, train_worker

TIME_TARGET = 1.3
MEMORY_TARGET = 0.10
VARIANTS = {"zero3": dict(stage=3), "zero3+prefetch": dict(stage=3, prefetch=True),
            "fsdp2": dict(stage=3, impl="torch")}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences of 64 tokens) per step")
    p.add_argument("--steps", type=int, default=6, help="timed steps per job")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per job")
    p.add_argument("--repeats", type=int, default=5, help="jobs per variant, interleaved")
    p.add_argument("--quick", action="store_true", help="2 repeats of 2 steps, results not saved")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.steps, args.warmup = 2, 2, 1
    return args


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def step_times(ranks, job: dict, repeats: int) -> tuple[dict, dict]:
    times = {v: [] for v in VARIANTS}
    comm = {}
    names = list(VARIANTS)
    for rep in range(repeats):
        for v in names[rep % len(names):] + names[:rep % len(names)]:
            run = ranks.run(train_worker, kwargs=dict(job, **VARIANTS[v]), show_output=False)
            times[v] += [max(r["step_times"][i] for r in run) for i in range(job["steps"])]
            comm[v] = {op: row["wire"] for op, row in run[0]["comm"].items()}
        print(f"  repeat {rep + 1}/{repeats}", flush=True)
    return times, comm


def peak_memory(ranks, job: dict) -> dict:
    out = {}
    for v in ("zero3", "fsdp2"):
        run = ranks.run(train_worker, kwargs=dict(job, steps=1, warmup=1, measure_peak=True, **VARIANTS[v]),
                        show_output=False)
        out[v] = {"bytes": max(r["peak_memory"][0] for r in run), "how": run[0]["peak_memory"][1]}
    return out


def scaling(cfg: GPTConfig, per_rank_batch: int, steps: int, warmup: int) -> list[dict]:
    rows = []
    for n in (1, 2, 4):
        with distlab.Ranks(n, backend="gloo", collective_timeout=120, threads=1) as group:  # one core each
            run = group.run(train, kwargs=dict(steps=steps, warmup=warmup, stage=3, batch_size=per_rank_batch,
                                               n_layer=cfg.n_layer, d_model=cfg.d_model, n_head=cfg.n_head,
                                               vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, prefetch=False),
                            show_output=False)
        state = run[0]["state_bytes"]
        rows.append({"world_size": n, "tokens_per_s": run[0]["tokens_per_s"], "step_time_s": run[0]["step_time_s"],
                     "state_bytes_per_rank": sum(state.values()), "oversubscribed": n > _cores()})
    return rows


def _gpu_worker(impl: str, dtype: str | None, cfg: GPTConfig, steps: int) -> dict:
    out = train_worker(stage=3, impl=impl, cfg=cfg, steps=steps, warmup=2, batch_size=8, optimizer="adamw", lr=1e-3,
                       dtype=dtype, return_state=False, measure_peak=True)
    return {"step_s": statistics.median(out["step_times"]), "peak": out["peak_memory"][0]}


def gpu(cfg: GPTConfig, steps: int) -> dict | None:
    if not torch.cuda.is_available():
        return None
    out = {"device": torch.cuda.get_device_name(0)}
    for impl in ("scratch", "torch"):
        for dtype in (None, "bf16"):
            run = distlab.launch(_gpu_worker, 1, args=(impl, dtype, cfg, steps), backend="nccl", show_output=False)
            out[f"{impl}/{dtype or 'fp32'}"] = run[0]
    return out


def main(argv=None) -> int:
    args = parse(argv)
    cfg = GPTConfig(vocab_size=256, seq_len=64, n_layer=args.n_layer, n_head=4, d_model=args.d_model)
    job = dict(cfg=cfg, steps=args.steps, warmup=args.warmup, batch_size=args.batch, optimizer="adamw", lr=1e-3,
               return_state=False)
    started = time.perf_counter()
    print(f"step time, {args.world_size} gloo ranks on {_cores()} cores", flush=True)
    with distlab.Ranks(args.world_size, backend="gloo", collective_timeout=120) as ranks:
        times, comm = step_times(ranks, job, args.repeats)
        memory = peak_memory(ranks, job)
    print("scaling", flush=True)
    scale = scaling(cfg, args.batch // args.world_size, args.steps, args.warmup)
    print("gpu", flush=True)
    on_gpu = gpu(cfg, args.steps)

    med = {v: statistics.median(ts) for v, ts in times.items()}
    ratio = med["zero3"] / med["fsdp2"]
    mem_ratio = memory["zero3"]["bytes"] / memory["fsdp2"]["bytes"]
    n, cores = args.world_size, _cores()
    params = GPT(cfg).num_params()
    lines = [
        f"GPT d_model={cfg.d_model} n_layer={cfg.n_layer} seq_len={cfg.seq_len}: {params / 1e6:.2f}M parameters; "
        f"{n} gloo ranks on {cores} CPU cores{' (oversubscribed: ranks take turns)' if n > cores else ''}, "
        f"global batch {args.batch}x{cfg.seq_len} tokens, AdamW, fp32, one unit per block; torch {torch.__version__}",
        f"{args.repeats} interleaved repeats x {args.steps} timed steps per variant; medians (p25-p75)",
    ]
    for v in VARIANTS:
        ts = sorted(times[v])
        sent = sum(comm[v].values())
        lines.append(f"  {v:<15}{med[v] * 1e3:8.1f} ms/step ({ts[len(ts) // 4] * 1e3:.1f}-"
                     f"{ts[3 * len(ts) // 4] * 1e3:.1f})   sent/rank/step {sent / 2**20:6.2f} MiB")
    time_met, mem_met = ratio <= TIME_TARGET, abs(mem_ratio - 1) <= MEMORY_TARGET
    lines.append(f"from-scratch ZeRO-3 / FSDP2 step time = {ratio:.2f} (target <= {TIME_TARGET}): "
                 f"{'met' if time_met else 'MISSED'}")
    lines.append(f"peak memory per rank: ZeRO-3 {memory['zero3']['bytes'] / 2**20:.2f} MiB, FSDP2 "
                 f"{memory['fsdp2']['bytes'] / 2**20:.2f} MiB, ratio {mem_ratio:.3f} (target within "
                 f"{MEMORY_TARGET:.0%}): {'met' if mem_met else 'MISSED'}; {memory['zero3']['how']}")
    lines.append(f"scaling of distlab.zero:train (ZeRO-3), {args.batch // n} sequences per rank, one thread per rank:")
    for row in scale:
        lines.append(f"  {row['world_size']} rank(s): {row['tokens_per_s']:9.0f} tokens/s   model state "
                     f"{row['state_bytes_per_rank'] / 2**20:6.2f} MiB per rank"
                     + ("   (oversubscribed: more ranks than cores)" if row["oversubscribed"] else ""))
    if on_gpu:
        lines.append(f"one {on_gpu['device']} (NCCL, world size 1), peak from torch.cuda.max_memory_allocated:")
        for key in ("scratch/fp32", "torch/fp32", "scratch/bf16", "torch/bf16"):
            row = on_gpu[key]
            lines.append(f"  {key:<14}{row['step_s'] * 1e3:8.1f} ms/step   peak {row['peak'] / 2**20:7.1f} MiB")
    summary = "\n".join(lines)
    print()
    print(summary)
    print(f"({time.perf_counter() - started:.0f} s)")
    if not args.quick:
        data = {"median_step_s": med, "step_times_s": times, "ratio_zero3_fsdp2": ratio, "time_target": TIME_TARGET,
                "peak_memory": memory, "memory_ratio": mem_ratio, "memory_target": MEMORY_TARGET,
                "comm_wire_bytes_per_step": comm, "scaling": scale, "gpu": on_gpu, "world_size": n,
                "oversubscribed": n > cores, "n_params": params, "config": vars(args)}
        path = results.save("zero", data, summary, ranks=n, threads_per_rank=default_threads(n))
        print(f"saved {path}")
    return 0 if time_met and mem_met else 1


if __name__ == "__main__":
    sys.exit(main())
