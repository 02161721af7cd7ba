"""Lab 11: the planner's layouts dry-run with the course's own code, at the scale the planner prices.

Two parts, each a set of dry runs (``distlab.parallel3d.dryrun``: one rank of the job, built and stepped on the meta
device over a fake process group of the job's size, in a fresh interpreter):

* **published**: the planner's best layout for Llama 3 405B on 16,384 H100s (2,048 sequences of 8,192 tokens, fp32
  gradients, as lab 11 plans it) and for the 70B preset on 1,024 (2,048 × 4,096, bf16 gradients), each dry-run at
  its first, a middle and its last pipeline stage; the notebook puts them beside the planner term by term. The
  405B's first-stage rank is also timed alone, with its peak resident memory: the laptop claim.
* **heatmap**: for Llama-shaped models of 1B, 8B, 70B and 405B parameters on 1–64 nodes of 8 H100s (4,096-token
  sequences, 256 per step: 1M tokens), the planner's best layout among those the dry run composes (DP × PP × TP,
  ZeRO-0/1, checkpointing or not; no CP) with its predicted MFU, dry-run at its first and last stage for memory
  against the 72 GB usable of an 80 GB H100; where its busier rank is over, the planner's next layouts in turn
  until one fits (``--tries``). Beside it the planner's best when CP and ZeRO-2/3 are allowed too.

Nothing here is timed but the dry runs themselves (no kernel runs on the meta device: the figures are bytes, which do
not depend on the machine or its load).

    python benchmarks/bench_dryrun.py            # about an hour on 2 busy cores
    python benchmarks/bench_dryrun.py --quick    # the 1B and 8B on 1-2 nodes: a smoke run, nothing saved

Writes ``benchmarks/results/dryrun.json`` and ``dryrun.txt`` (``distlab.results``), which
``solutions/11_3d_parallelism.ipynb`` loads. Exit status 1 when no layout of a heatmap cell among the planner's first
``--tries`` fits the dry run, or the 405B rank's dry run takes a minute or more, or 2 GiB or more.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from distlab import results
from distlab.parallel3d.dryrun import LLAMA, comparison_table, dry_run, rank_roles
from distlab.parallel3d.grid import Grid
from distlab.parallel3d.planner import GB, ModelShape, estimate, h100_cluster, plan

PUBLISHED = {  # lab 11's two plans: model, GPUs, sequences per step, precision
    "405B": ("405B", 16384, 2048, "mixed_fp32_grads"),
    "70B": ("70B", 1024, 2048, "mixed"),
}
SIZES = ("1B", "8B", "70B", "405B")
NODES = (1, 2, 4, 8, 16, 32, 64)
SEQ_LEN, SEQUENCES = 4096, 256  # 1,048,576 tokens a step
COMPOSED = dict(cp=(1,), zero=(0, 1))  # what the dry run (the course's 3D composition) can build
LAPTOP = {"seconds": 60.0, "bytes": 2 * 2**30}  # the 405B rank's dry run: under a minute, under 2 GiB


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1B and 8B on 1-2 nodes, no published layouts; not saved")
    p.add_argument("--tries", type=int, default=4, help="planner's layouts dry-run per cell until one fits")
    p.add_argument("--parts", nargs="+", choices=("published", "heatmap"), default=["published", "heatmap"],
                   help="run these parts and keep the saved results of the other")
    return p.parse_args(argv)


def say(lines: list[str], *texts: str) -> None:
    """Keep the summary's lines and show them as they come (a run takes minutes)."""
    lines.extend(texts)
    print("\n".join(texts), flush=True)


def published(lines: list[str]) -> dict:
    out = {}
    for name, (model, gpus, batch, precision) in PUBLISHED.items():
        best = plan(model, h100_cluster(gpus), batch, precision=precision, **COMPOSED).best
        run = dry_run(model, best.layout)
        stand_in = estimate(ModelShape.from_config(run.spec.cfg), h100_cluster(gpus), best.layout, batch,
                            precision=precision)
        out[name] = {"gpus": gpus, "batch": batch, "precision": precision, "layout": dataclasses.asdict(best.layout),
                     "run": run.to_dict()}
        say(lines, f"{name} on {gpus:,} H100s, planner's best: {best.summary()}",
            f"  dry run of {len(run.ranks)} ranks: {run.wall_seconds:.1f} s wall, {run.cpu_seconds:.1f} s CPU, "
            f"peak RSS {run.peak_rss_bytes / 2**20:.0f} MiB",
            *("  " + line for line in comparison_table(run, stand_in).splitlines()))
    best = plan("405B", h100_cluster(16384), 2048, precision="mixed_fp32_grads", **COMPOSED).best
    first = rank_roles(Grid(dp=best.layout.dp, pp=best.layout.pp, tp=best.layout.tp))["first stage"]
    alone = dry_run("405B", best.layout, ranks=[first])
    out["405B rank"] = {"rank": first, "wall_seconds": alone.wall_seconds, "cpu_seconds": alone.cpu_seconds,
                        "peak_rss_bytes": alone.peak_rss_bytes, "memory": alone.ranks[0]["memory"],
                        "bytes": alone.ranks[0]["bytes"]}
    say(lines, f"405B's first-stage rank alone: {alone.wall_seconds:.1f} s wall ({alone.cpu_seconds:.1f} s CPU), "
        f"peak RSS {alone.peak_rss_bytes / 2**30:.2f} GiB (laptop target: under {LAPTOP['seconds']:.0f} s and "
        f"{LAPTOP['bytes'] / 2**30:.0f} GiB)")
    return out


def memory_check(name: str, layout, usable: float) -> dict:
    """Dry-run the first and last stage of ``layout`` (the fullest ranks: the embedding and the most micro-batches
    in flight, or the output layer and the loss) and say whether the busier fits."""
    roles = rank_roles(Grid(dp=layout.dp, pp=layout.pp, tp=layout.tp))
    ranks = sorted({roles["first stage"], roles.get("last stage", roles["first stage"])})
    start = time.perf_counter()
    run = dry_run(name, layout, ranks=ranks, seq_len=SEQ_LEN, timeout=3600)
    busiest = max(run.ranks, key=lambda r: r["memory"]["peak"])
    return {"dry_peak": busiest["memory"]["peak"], "dry_role": busiest["role"],
            "peak_phase": busiest["memory"]["peak_phase"], "memory": busiest["memory"],
            "fits": busiest["memory"]["peak"] <= usable, "seconds": time.perf_counter() - start,
            "peak_rss_bytes": run.peak_rss_bytes}


def heatmap(sizes, nodes, lines: list[str], tries: int) -> list[dict]:
    """Per cell: the planner's best composed layout, dry-run-checked for memory; when its busiest rank is over
    the usable HBM, the planner's next layouts in turn (up to ``tries`` in all) until one fits."""
    cells = []
    usable = h100_cluster(8).hbm_bytes * 0.9
    for name in sizes:
        shape = ModelShape.from_preset(dataclasses.replace(LLAMA[name], seq_len=SEQ_LEN))
        for n in nodes:
            cluster = h100_cluster(8 * n)
            composed = plan(shape, cluster, SEQUENCES, **COMPOSED)
            anything = plan(shape, cluster, SEQUENCES)
            cell = {"model": name, "nodes": n, "gpus": 8 * n, "checked": [],
                    "any": str(anything.feasible[0].layout) if anything.feasible else None,
                    "any_mfu": anything.feasible[0].mfu if anything.feasible else None}
            for place, candidate in enumerate(composed.feasible[:tries], 1):
                check = memory_check(name, candidate.layout, usable)
                check.update(place=place, layout=dataclasses.asdict(candidate.layout), label=str(candidate.layout),
                             mfu=candidate.mfu, step_time=candidate.step_time,
                             planner_memory=candidate.memory["total"])
                cell["checked"].append(check)
                say(lines, f"{name:>5} on {n:2d} nodes, planner's #{place}: {candidate.layout}, MFU "
                    f"{candidate.mfu:.0%}; planner {candidate.memory['total'] / GB:5.1f} GB, dry run "
                    f"{check['dry_peak'] / GB:5.1f} GB ({check['dry_peak'] / candidate.memory['total']:.2f}x, "
                    f"{check['dry_role']}, {check['peak_phase']}): {'fits' if check['fits'] else 'OVER'} "
                    f"[{check['seconds']:.0f} s]")
                if check["fits"]:
                    cell["chosen"] = check
                    break
            if not composed.feasible:
                say(lines, f"{name:>5} on {n:2d} nodes: no layout fits the planner's memory model")
            elif "chosen" not in cell:
                say(lines, f"{name:>5} on {n:2d} nodes: none of the planner's first {tries} layouts fits the dry run")
            cells.append(cell)
    return cells


def main(argv=None) -> int:
    args = parse(argv)
    saved = {} if args.quick or set(args.parts) == {"published", "heatmap"} else results.load("dryrun")
    lines = {"published": [], "heatmap": []}
    if args.quick:
        out, cells = {}, heatmap(SIZES[:2], NODES[:2], lines["heatmap"], args.tries)
    else:
        out = published(lines["published"]) if "published" in args.parts else saved["published"]
        cells = heatmap(SIZES, NODES, lines["heatmap"], args.tries) if "heatmap" in args.parts else saved["heatmap"]
        lines = {part: lines[part] if part in args.parts else saved["lines"][part] for part in lines}
    failed = [f"{c['model']} on {c['nodes']} nodes" for c in cells if c["checked"] and "chosen" not in c]
    if not args.quick:
        rank = out["405B rank"]
        if rank["wall_seconds"] >= LAPTOP["seconds"] or rank["peak_rss_bytes"] >= LAPTOP["bytes"]:
            failed.append("the 405B rank's dry run")
        path = results.save("dryrun", {"published": out, "heatmap": cells, "lines": lines, "seq_len": SEQ_LEN,
                                       "sequences": SEQUENCES, "composed": {k: list(v) for k, v in COMPOSED.items()},
                                       "usable_hbm": h100_cluster(8).hbm_bytes * 0.9},
                            "\n".join(lines["published"] + lines["heatmap"]), ranks=1)
        print(f"saved {path}")
    if failed:
        print("over the target: " + ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
