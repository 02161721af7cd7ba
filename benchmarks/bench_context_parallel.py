"""Lab 07 target: context-parallel attention timed on ranks that each have their own cores.

For each world size, on one warm group of ranks, with repeats interleaved (the order rotates
every repeat) so that drift of a shared machine hits every variant alike:

* causal ring attention, forward + backward, in the contiguous, zig-zag and striped layouts:
  the slowest rank sets the step time; contiguous shards give it up to (2N-1)/N times the mean
  work, zig-zag the mean (target: zig-zag faster);
* the ring forward with each K/V transfer overlapped with the block's compute against the serial
  ring that posts it after the compute (target: overlapped not slower);
* DeepSpeed-Ulysses, causal, forward + backward, and the bytes each method sends per rank.

Each time is the median over repeats of the slowest rank's time. The machine's core count is
recorded: with fewer cores than ranks the ranks take turns on the cores and the wall-clock
comparison is not faithful (the summary says so).

    python benchmarks/bench_context_parallel.py              # a few minutes on 2 cores
    python benchmarks/bench_context_parallel.py --quick      # a smoke run

Exit status 1 when zig-zag is not faster than contiguous on a machine with a core per rank.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import distlab
from distlab import context_parallel as cp
from distlab import results
from distlab.runtime.launch import default_threads

CAUSAL_LAYOUTS = ("contiguous", "zigzag", "striped")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[4, 8])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="short sequence, 2 repeats: a smoke test, not a measurement")
    p.add_argument("--no-save", action="store_true", help="print only; keep benchmarks/results as they are")
    args = p.parse_args(argv)
    if args.quick:
        args.seq_len, args.repeats = 512, 2
    return args


def forward_seconds(seq_len: int, heads: int, head_dim: int, overlap: bool) -> float:
    """On a rank: one non-causal ring forward, overlapped or serial; wall seconds."""
    generator = torch.Generator().manual_seed(0)
    world, rank, device = dist.get_world_size(), dist.get_rank(), distlab.device()
    q, k, v = (cp.shard(torch.randn(1, heads, seq_len, head_dim, generator=generator), world, rank).to(device)
               for _ in range(3))
    dist.barrier()
    start = time.perf_counter()
    cp.ring_attention_forward(q, k, v, overlap=overlap)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def variants(world: int, heads: int) -> list[str]:
    names = [f"ring causal {layout}" for layout in CAUSAL_LAYOUTS] + ["ring forward overlapped", "ring forward serial"]
    return names + (["ulysses causal"] if heads % world == 0 else [])


def run_variant(ranks, name: str, args) -> tuple[float, float]:
    """(slowest rank's seconds, bytes rank 0 sent) for one repeat of a variant."""
    shape = dict(batch=1, heads=args.heads, seq_len=args.seq_len, head_dim=args.head_dim)
    if name.startswith("ring forward"):
        run = ranks.run(forward_seconds, args=(args.seq_len, args.heads, args.head_dim, name.endswith("overlapped")),
                        show_output=False)
        return max(run), run.comm[0].total()
    method, layout = name.split()[0], name.split()[-1]  # "ring causal zigzag", "ulysses causal"
    run = ranks.run(cp.verify, kwargs=dict(shape, method=method, causal=True, layout=layout if method == "ring" else
                                           "contiguous", check=False), show_output=False)
    return max(r["seconds"] for r in run), run[0]["bytes_sent"]


def measure(world: int, args) -> dict:
    ranks = distlab.Ranks(world, collective_timeout=120)
    names = variants(world, args.heads)
    times: dict[str, list[float]] = {name: [] for name in names}
    sent: dict[str, float] = {}
    try:
        run_variant(ranks, names[0], args)  # warm-up: first-call costs of gloo and the allocator
        for rep in range(args.repeats):
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                seconds, sent[name] = run_variant(ranks, name, args)
                times[name].append(seconds)
    finally:
        ranks.close()
    return {"world_size": world, "median_s": {n: statistics.median(t) for n, t in times.items()}, "times": times,
            "bytes_sent": sent}


def summarise(rows: list[dict], args, cpus: int) -> str:
    lines = [f"causal attention, forward + backward, {args.seq_len} tokens, {args.heads} heads of {args.head_dim}, "
             f"fp32; medians of {args.repeats} repeats (slowest rank)"]
    for row in rows:
        n, median = row["world_size"], row["median_s"]
        faithful = cpus >= n
        lines.append(f"N={n} on {cpus} cores" + ("" if faithful else
                     f" (too few cores for {n} ranks: they take turns, wall-clock ratios are not faithful)"))
        for name, seconds in median.items():
            lines.append(f"  {name:<26}{seconds * 1e3:9.1f} ms   {row['bytes_sent'][name] / 2**20:8.2f} MiB sent/rank")
        lines.append(f"  zig-zag vs contiguous: {median['ring causal contiguous'] / median['ring causal zigzag']:.2f}x "
                     f"faster; striped vs contiguous: "
                     f"{median['ring causal contiguous'] / median['ring causal striped']:.2f}x; overlapped vs serial "
                     f"forward: {median['ring forward serial'] / median['ring forward overlapped']:.2f}x")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse(argv)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    started = time.perf_counter()
    rows = [measure(world, args) for world in args.world_sizes]
    summary = summarise(rows, args, cpus)
    print(summary)
    print(f"({time.perf_counter() - started:.0f} s)")
    if not args.no_save and not args.quick:
        results.save("context_parallel", {"rows": rows, "summary": summary, "seq_len": args.seq_len,
                                          "heads": args.heads, "head_dim": args.head_dim, "repeats": args.repeats,
                                          "ran_on": f"{cpus} CPU cores (gloo ranks)"},
                     summary, ranks=max(args.world_sizes), threads_per_rank=default_threads(max(args.world_sizes)))
    missed = [row["world_size"] for row in rows if cpus >= row["world_size"]
              and row["median_s"]["ring causal zigzag"] >= row["median_s"]["ring causal contiguous"]]
    if missed:
        print(f"target missed: zig-zag not faster than contiguous at N={missed}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
