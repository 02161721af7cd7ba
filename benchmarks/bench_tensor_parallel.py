"""Lab 05: step time of the tensor-parallel GPT against the TP degree, and the share spent in collectives.

Trains :class:`distlab.tensor_parallel.TensorParallelGPT` at TP = 1, 2, 4 (and 8 where the
machine has the cores) on one warm group of ranks; a job at TP = t runs on ranks 0…t-1 only
(``first_group_only``), so no more than t processes compete for the cores. Repeats are
interleaved (the TP order rotates) so a shared machine's drift hits every degree alike.
Per degree: the median step time, the median share of the step rank 0 spends inside
collectives (comm spans, barriers excluded), the bytes rank 0 sends per step (distlab's comm
log) and the effective bandwidth those bytes saw. A degree above the core count is recorded
as not faithful: its ranks take turns on the cores, which no real TP group does.

    python benchmarks/bench_tensor_parallel.py          # a few minutes on 2 cores
    python benchmarks/bench_tensor_parallel.py --quick  # a smoke run, results not saved

Saves ``benchmarks/results/tensor_parallel.json`` and ``.txt`` (lab 05 loads them).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import distlab
from distlab import results
from distlab.model import GPTConfig
from distlab.tensor_parallel.workers import train_worker


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="sequences per step (every TP rank sees all of them)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per job")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per job")
    p.add_argument("--repeats", type=int, default=4, help="jobs per TP degree, interleaved")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (CONTRIBUTING: threads per rank)")
    p.add_argument("--max-tp", type=int, default=8)
    p.add_argument("--quick", action="store_true", help="1 repeat of 2 steps, nothing saved: a smoke test")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.steps = 1, 2
    return args


def comm_seconds(run, warmup: int) -> float:
    """Seconds rank 0 spent inside collectives (barriers excluded) during the timed steps."""
    forwards = sorted(s.start for s in run.spans if s.rank == 0 and s.label == "forward")
    start = forwards[warmup]
    return sum(s.duration for s in run.spans
               if s.rank == 0 and s.kind == "comm" and s.label != "barrier" and s.start >= start)


def main(argv=None) -> int:
    args = parse(argv)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    degrees = [t for t in (1, 2, 4, 8) if t <= max(4, min(args.max_tp, cpus))]
    cfg = GPTConfig(vocab_size=256, seq_len=args.seq_len, n_layer=args.n_layer, n_head=8, d_model=args.d_model)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    ranks = distlab.Ranks(max(degrees), collective_timeout=120, threads=args.threads)
    times = {t: [] for t in degrees}
    shares = {t: [] for t in degrees}
    wire = {}
    started = time.perf_counter()
    try:
        for rep in range(args.repeats):
            for t in degrees[rep % len(degrees):] + degrees[:rep % len(degrees)]:
                run = ranks.run(train_worker, args=(cfg, t, False, args.steps, args.batch),
                                kwargs=dict(warmup=args.warmup, first_group_only=True), show_output=False)
                step_times = [max(out["step_times"][i] for out in run[:t]) for i in range(args.steps)]
                times[t] += step_times
                shares[t].append(comm_seconds(run, args.warmup) / sum(run[0]["step_times"]))
                total = sum(s.wire_bytes for name, s in run.comm[0].ops.items() if name != "barrier")
                wire[t] = total / (args.steps + args.warmup)
            print(f"repeat {rep + 1}/{args.repeats} done ({time.perf_counter() - started:.0f} s)", flush=True)
    finally:
        ranks.close()

    if hasattr(os, "getloadavg"):
        load = max(load, os.getloadavg()[0])
    step_ms = {t: statistics.median(times[t]) * 1e3 for t in degrees}
    share = {t: statistics.median(shares[t]) for t in degrees}
    gpus = ranks.backend == "nccl"  # one GPU per rank: every degree runs side by side
    faithful = {t: gpus or t <= cpus for t in degrees}
    lines = [f"TP GPT d_model={cfg.d_model} n_layer={cfg.n_layer} n_head={cfg.n_head} seq_len={cfg.seq_len}, "
             f"batch {args.batch}, fp32, AdamW; {ranks.backend} ranks ({args.threads} thread(s) each), {cpus} CPU "
             f"cores; "
             f"{args.repeats} interleaved repeats x {args.steps} steps, medians",
             f"{'TP':>3}{'step ms':>10}{'vs TP=1':>9}{'in collectives':>16}{'sent/step MiB':>15}{'effective GB/s':>16}"]
    for t in degrees:
        comm_s = share[t] * step_ms[t] / 1e3
        bandwidth = f"{wire[t] / comm_s / 1e9:.2f}" if t > 1 and comm_s > 0 else "-"
        note = "" if faithful[t] else f"   ({t} ranks on {cpus} cores: not faithful)"
        lines.append(f"{t:>3}{step_ms[t]:>10.1f}{step_ms[1] / step_ms[t]:>8.2f}x{share[t]:>16.0%}"
                     f"{wire[t] / 2**20:>15.2f}{bandwidth:>16}{note}")
    top = max([t for t in degrees if faithful[t] and t > 1] or [max(degrees)])
    summary_line = (f"TP={top} ran {step_ms[1] / step_ms[top]:.2f}x as fast as TP=1 (ideal {top}x); collectives took "
                    f"{share[top]:.0%} of its step")
    # the summary's own degree judged by the one rule every saved result is judged by (the load while it ran)
    faithful_top, why = results.faithfulness({"faithful": {str(top): True}, "load_average": load, "machine": {
        "cpus": cpus, "ranks": max(degrees), "gpus": gpus}})
    if not faithful_top:
        summary_line += f"; not faithful: {why}: other programs took turns with the ranks"
    lines.append(summary_line)
    summary = "\n".join(lines)
    print()
    print(summary)
    if not args.quick:
        data = {"step_ms": {str(t): step_ms[t] for t in degrees}, "comm_share": {str(t): share[t] for t in degrees},
                "faithful": {str(t): faithful[t] for t in degrees},
                "wire_bytes_per_step": {str(t): wire[t] for t in degrees}, "summary_line": summary_line,
                "load_average": load, "ran_on": None if gpus else f"{cpus} CPU cores, gloo ranks",
                "config": {"d_model": cfg.d_model, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
                           "seq_len": cfg.seq_len, "batch": args.batch, "steps": args.steps, "repeats": args.repeats}}
        saved = results.save("tensor_parallel", data, summary, ranks=max(degrees), threads_per_rank=args.threads)
        print(f"saved {saved}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
