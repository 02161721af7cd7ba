"""Lab 06 targets: the pipeline bubble measured on real ranks against theory, and the
from-scratch 1F1B against ``torch.distributed.pipelining``'s ``Schedule1F1B``.

1. For p ∈ {2, 4} stages and m ∈ {1, 2, 4, 8, 16} micro-batches, GPipe and 1F1B run the
   lab's GPT (real compute, one thread per rank) for a few steps; each step's bubble is
   read off the recorded timeline (:func:`distlab.pipeline_parallel.measured_bubble`)
   and the median over steps is compared with (p-1)/(m+p-1). The bubble is the idle share of
   the busiest stage — the one that never waits for a slower neighbour — so the faster stages'
   wait for it (imbalance) is reported beside it as the mean idle, not mixed into it. Interleaved 1F1B (v = 2)
   is compared with (p-1)/(v·m+p-1). A single point on a shared machine can miss by a few
   hundredths while the grid follows theory, so the targets are about what the code controls:
   - **executor overhead**: each step's own forward and backward durations (per rank) are replayed
     through :func:`simulate`; measured minus replayed bubble is what the executor adds (waits on
     point-to-point messages, posting late, Python). Target: its median over steps ≤ 0.02 at every point;
   - **against the closed form**: median |measured - theory| over the grid ≤ 0.03 and at least 90% of
     the points within ±0.05, in every one of ``--runs`` consecutive runs (each run's line is saved).
   Only points measured on at least p cores count. With more ranks than cores the ranks take turns, the
   fill and drain run faster than the steady state and the bubble reads low: those points are printed
   and saved, flagged, and not held to the targets.
2. The same stages under distlab's 1F1B and PyTorch's ``Schedule1F1B`` in one job,
   alternating, median step times. Target: ours ≤ 1.2 × torch's.

    python benchmarks/bench_pipeline.py            # a few minutes on 16 cores, longer on 2
    python benchmarks/bench_pipeline.py --quick    # a smoke run

Results go to ``benchmarks/results/pipeline.{json,txt}`` (the notebook loads them).
Exit status 1 when a target is missed on the points that could be measured faithfully.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import distlab
from distlab import results
from distlab.model import GPTConfig
from distlab.pipeline_parallel import (
    bubble_fraction,
    interleaved_bubble_fraction,
    make_schedule,
    measured_bubble,
    pipeline_worker,
    replay,
    step_spans,
    steps_bubble,
    torch_pipelining_worker,
)

TOLERANCE = 0.05  # a point within this of theory counts as close
CLOSE_SHARE = 0.9  # the share of points that must be close
MEDIAN_TARGET = 0.03  # median |measured - theory| over the grid
OVERHEAD_TARGET = 0.02  # median (measured - replayed) bubble over the steps of every point
RATIO_TARGET = 1.2


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    p.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--rows", type=int, default=2, help="sequences (of 64 tokens) per micro-batch")
    p.add_argument("--steps", type=int, default=15, help="measured steps per point (after one warm-up step)")
    p.add_argument("--ratio-steps", type=int, default=12, help="steps of each 1F1B implementation for the ratio")
    p.add_argument("--ratio-m", type=int, default=8)
    p.add_argument("--runs", type=int, default=3, help="consecutive runs of the whole grid, each held to the targets")
    p.add_argument("--quick", action="store_true", help="a smoke run: fewer points and steps, not a measurement")
    p.add_argument("--results-dir", type=Path, default=None, help="where to save (default benchmarks/results)")
    args = p.parse_args(argv)
    if args.quick:
        args.stages, args.microbatches, args.steps, args.ratio_steps, args.runs = [2], [1, 4], 2, 2, 1
        args.n_layer, args.d_model = 4, 64
    return args


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def replayed_bubble(spans, schedule: str, p: int, m: int, v: int, bottleneck: int) -> float:
    """The bubble an ideal executor would have had in one step at that step's own stage times
    (:func:`~distlab.pipeline_parallel.replay`), read off the bottleneck rank as the measurement is."""
    return measured_bubble(replay(spans, make_schedule(schedule, p, m, v), m, v).spans, p).per_rank[bottleneck]


def measure_point(ranks, schedule: str, cfg: GPTConfig, p: int, m: int, v: int, rows: int, steps: int) -> dict:
    run = ranks.run(pipeline_worker, kwargs=dict(schedule=schedule, cfg=cfg, m=m, v=v, batch_size=rows * m,
                                                 steps=steps, warmup=1, return_state=False), show_output=False)
    bubble = steps_bubble(run.spans, range(1, steps + 1), p)
    theory = interleaved_bubble_fraction(p, m, v) if schedule == "interleaved" else bubble_fraction(p, m)
    replayed = [replayed_bubble(step_spans(run.spans, k), schedule, p, m, v, bubble.bottleneck)
                for k in range(1, steps + 1)]
    overhead = statistics.median(b - r for b, r in zip(bubble.per_step, replayed))
    return {"schedule": schedule, "p": p, "m": m, "v": v, "theory": theory, "measured": bubble.fraction,
            "mean_idle": bubble.mean_idle, "bottleneck": bubble.bottleneck,
            "per_step": [round(b, 4) for b in bubble.per_step], "replayed": statistics.median(replayed),
            "overhead": overhead,
            "step_s": statistics.median(max(r["step_times"][i] for r in run) for i in range(steps)),
            "faithful": p <= cores()}


def measure_grid(args, cfg: GPTConfig, label: str, started: float) -> list[dict]:
    """Every (schedule, p, m, v) point once, on warm ranks with one thread each."""
    grid = []
    for p in args.stages:
        ranks = distlab.Ranks(p, backend="gloo", collective_timeout=120, threads=1)
        try:
            points = [(s, m, 1) for s in ("gpipe", "1f1b") for m in args.microbatches]
            points += [("interleaved", m, 2) for m in args.microbatches if m % p == 0 and p * 2 <= args.n_layer]
            for schedule, m, v in points:
                point = measure_point(ranks, schedule, cfg, p, m, v, args.rows, args.steps)
                grid.append(point)
                print(f"{label} p={p} {schedule:<11} m={m:>2}{f' v={v}' if v > 1 else '    '}  bubble "
                      f"{point['measured']:.3f}  theory {point['theory']:.3f}  replayed {point['replayed']:.3f}  "
                      f"step {point['step_s'] * 1e3:7.1f} ms{'' if point['faithful'] else '  (oversubscribed)'}  "
                      f"[{time.perf_counter() - started:.0f} s]", flush=True)
        finally:
            ranks.close()
    return grid


def judge(grid: list[dict]) -> dict:
    """One run against the targets, on its faithful points: the median |measured - theory|, the share of points
    within the tolerance, the largest per-point executor overhead, and one line that says all three."""
    faithful = [g for g in grid if g["faithful"]]
    if not faithful:
        return {"points": 0, "met": False, "line": "no point could be measured faithfully"}
    diffs = [abs(g["measured"] - g["theory"]) for g in faithful]
    median_diff = statistics.median(diffs)
    close = sum(d <= TOLERANCE for d in diffs) / len(diffs)
    overhead = max(g["overhead"] for g in faithful)
    worst = max(faithful, key=lambda g: g["overhead"])
    met = {"median": median_diff <= MEDIAN_TARGET, "close": close >= CLOSE_SHARE,
           "overhead": overhead <= OVERHEAD_TARGET}
    line = (f"{len(faithful)} faithful points: median |measured - theory| {median_diff:.3f} (≤ {MEDIAN_TARGET}: "
            f"{'met' if met['median'] else 'MISSED'}), {close:.0%} within ±{TOLERANCE} (≥ {CLOSE_SHARE:.0%}: "
            f"{'met' if met['close'] else 'MISSED'}); executor overhead at most {overhead:+.3f} per step, median over "
            f"steps, at {worst['schedule']} p={worst['p']} m={worst['m']} (≤ {OVERHEAD_TARGET}: "
            f"{'met' if met['overhead'] else 'MISSED'})")
    return {"points": len(faithful), "median_diff": median_diff, "close_share": close, "max_overhead": overhead,
            "targets": met, "met": all(met.values()), "line": line}


def main(argv=None) -> int:
    args = parse(argv)
    n_cores = cores()
    cfg = GPTConfig(vocab_size=128, seq_len=64, n_layer=args.n_layer, n_head=4, d_model=args.d_model,
                    tied_embeddings=False)
    started = time.perf_counter()
    runs = [measure_grid(args, cfg, f"run {i + 1}/{args.runs}", started) for i in range(args.runs)]
    verdicts = [judge(grid) for grid in runs]
    grid = runs[-1]

    p_ratio = min(max(args.stages), n_cores) if n_cores >= 2 else 2
    ranks = distlab.Ranks(p_ratio, backend="gloo", collective_timeout=120, threads=max(1, n_cores // p_ratio))
    try:
        run = ranks.run(torch_pipelining_worker, kwargs=dict(schedule="1f1b", cfg=cfg, m=args.ratio_m,
                                                             batch_size=args.rows * args.ratio_m,
                                                             steps=args.ratio_steps, warmup=1), show_output=False)
    finally:
        ranks.close()
    ours = statistics.median(max(r["ours_times"][i] for r in run) for i in range(args.ratio_steps))
    theirs = statistics.median(max(r["torch_times"][i] for r in run) for i in range(args.ratio_steps))
    grad_diff = max(r["grad_diff"] for r in run)
    ratio = ours / theirs

    flagged = sorted({g["p"] for g in grid if not g["faithful"]})
    lines = [
        f"GPT n_layer={cfg.n_layer} d_model={cfg.d_model} seq_len={cfg.seq_len}, {args.rows} sequences per "
        f"micro-batch; gloo ranks, one thread each, {n_cores} CPU cores; torch {torch.__version__}",
        f"bubble = idle share of the busiest rank (the slowest stage) between the pipeline's first and last "
        f"compute; mean idle = all ranks, waiting for the slowest stage included; replayed = the same step's own "
        f"forward and backward durations run through simulate (overhead = bubble - replayed); medians of "
        f"{args.steps} steps; the table is run {args.runs} of {args.runs}",
        f"{'schedule':<12}{'p':>3}{'m':>4}{'v':>3}{'theory':>9}{'bubble':>9}{'diff':>8}{'replayed':>10}"
        f"{'overhead':>10}{'mean idle':>11}{'step ms':>10}",
    ]
    for g in grid:
        lines.append(f"{g['schedule']:<12}{g['p']:>3}{g['m']:>4}{g['v']:>3}{g['theory']:>9.3f}{g['measured']:>9.3f}"
                     f"{g['measured'] - g['theory']:>+8.3f}{g['replayed']:>10.3f}{g['overhead']:>+10.3f}"
                     f"{g['mean_idle']:>11.3f}{g['step_s'] * 1e3:>10.1f}"
                     + ("" if g["faithful"] else "  oversubscribed"))
    lines += [f"run {i + 1}: {v['line']}" for i, v in enumerate(verdicts)]
    bubble_met = all(v["met"] for v in verdicts)
    lines.append(f"bubble targets in {sum(v['met'] for v in verdicts)} of {args.runs} consecutive runs: "
                 f"{'met' if bubble_met else 'MISSED'}")
    if flagged:
        lines.append(f"p = {', '.join(map(str, flagged))} exceeds the {n_cores} cores here: those points are "
                     f"oversubscribed (ranks take turns on the cores) and not held to the targets")
    ratio_met = ratio <= RATIO_TARGET
    lines.append(f"1F1B on p={p_ratio}, m={args.ratio_m}: distlab {ours * 1e3:.1f} ms, torch Schedule1F1B "
                 f"{theirs * 1e3:.1f} ms per step (medians of {args.ratio_steps}); ratio {ratio:.3f} "
                 f"(target ≤ {RATIO_TARGET}): {'met' if ratio_met else 'MISSED'}; gradients equal to {grad_diff:.1e}")
    summary = "\n".join(lines)
    print("\n" + summary)
    data = {"ran_on": f"{len(os.sched_getaffinity(0))} CPU cores (gloo ranks, one thread each)",
            "grid": grid, "runs": runs, "verdicts": verdicts, "tolerance": TOLERANCE, "median_target": MEDIAN_TARGET,
            "close_share": CLOSE_SHARE, "overhead_target": OVERHEAD_TARGET, "bubble_target_met": bubble_met,
            "ratio": {"p": p_ratio, "m": args.ratio_m, "ours_s": ours, "torch_s": theirs, "ratio": ratio,
                      "target": RATIO_TARGET, "met": ratio_met, "grad_diff": grad_diff},
            "config": {"n_layer": cfg.n_layer, "d_model": cfg.d_model, "seq_len": cfg.seq_len, "rows": args.rows,
                       "steps": args.steps, "runs": args.runs, "quick": args.quick}}
    if not args.quick or args.results_dir:
        results.save("pipeline", data, summary, directory=args.results_dir, ranks=max(g["p"] for g in grid),
                     threads_per_rank=1)
    any_faithful = any(v["points"] for v in verdicts)
    return 0 if (bubble_met or not any_faithful) and ratio_met else 1


if __name__ == "__main__":
    sys.exit(main())
