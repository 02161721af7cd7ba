"""Lab 13 targets: the planner's predictions for the capstone's run against the run, on this machine.

The capstone's data (lab 10's pipeline on the course's crawl files and its generated crawl, split by document,
the vocabulary compacted), the machine measured as the planner's cluster (:func:`distlab.capstone.measure_cluster`:
the matmul rate each rank gets while all compute, gloo's latency and bandwidth), the planner's fastest layout the
worker runs, and then ``--repeats`` runs of ``--steps`` steps each (no checkpoints: the planner does not price
them). Per run, :func:`distlab.capstone.derive_report` reads the step time off the records (median over steps of
the slowest rank) and the memory of the model states of the fullest rank is counted; each is divided by the
planner's prediction. Targets, on the median over runs:

- **step time / predicted within 0.75–1.33**;
- **memory per rank / predicted within 10%**.

Where the step time misses, the term of the step whose measured seconds differ most from the predicted ones is
named (:func:`distlab.capstone.responsible_term`). On a machine with fewer cores than ranks, or a busy one, the
timings are saved and flagged (:func:`distlab.results.faithfulness`) and not held to the target.

    python benchmarks/bench_capstone.py            # about a minute on 2 cores
    python benchmarks/bench_capstone.py --quick    # a smoke run

Results go to ``benchmarks/results/capstone.{json,txt}``. Exit status 1 when a target is missed faithfully.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

import distlab
from distlab import results
from distlab.capstone import (
    capstone_worker,
    card_rows,
    derive_report,
    measure_cluster,
    measured_terms,
    predicted_terms,
    responsible_term,
    runnable_best,
)
from distlab.data import PipelineConfig, run_pipeline, samples, shard_paths
from distlab.data.loader import compact_vocabulary, split_documents
from distlab.data.shards import read_shard
from distlab.model import GPTConfig, training_flops_per_token
from distlab.parallel3d.planner import ModelShape, plan
from distlab.runtime.launch import default_threads

STEP_BAND = (0.75, 1.33)
MEMORY_TOLERANCE = 0.10
MATMUL_EFFICIENCY = 0.7  # the planner's default assumption, named when compute is the term responsible
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=30, help="steps per run (the first is not measured)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=8, help="global batch, sequences of 64 tokens")
    p.add_argument("--memory-mb", type=float, default=8.0, help="the memory budget per rank the planner is told")
    p.add_argument("--quick", action="store_true", help="2 runs of 8 steps")
    p.add_argument("--out", type=Path, default=None, help="results directory (default benchmarks/results)")
    return p.parse_args(argv)


def data(work: Path):
    """The capstone's training shard and compacted vocabulary, as the notebook makes them."""
    real = sorted(str(p) for p in SHARED.glob("*/*.gz")) if SHARED.is_dir() else []
    generated = samples.generate_sample(work / "generated", seed=0, docs_per_file=60)
    run_pipeline(real + [str(f) for f in generated.files], work / "crawl", PipelineConfig(shard_tokens=1 << 20))
    split = split_documents(shard_paths(work / "crawl"), work / "split", val_fraction=0.1, seed=0)
    mapping, vocab = compact_vocabulary(read_shard(split.train).astype(np.int64))
    return split.train, mapping, vocab


def main(argv=None) -> int:
    args = parse(argv)
    if args.quick:
        args.steps, args.repeats = 8, 2
    work = Path(tempfile.mkdtemp(prefix="bench-capstone-"))
    train_path, mapping, vocab = data(work)
    cfg = GPTConfig(vocab_size=vocab, seq_len=64, n_layer=4, n_head=4, d_model=64, tied_embeddings=False)
    model = ModelShape.from_config(cfg, "the capstone GPT")
    ranks = distlab.Ranks(args.ranks)
    try:
        machine = measure_cluster(ranks, args.memory_mb * 1e6)
        chosen = runnable_best(plan(model, machine, args.batch, precision="fp32", cp=(1,)))
        layout = chosen.layout
        flops = training_flops_per_token(model.n_params - model.embedding_params, cfg.n_layer, cfg.d_model,
                                         cfg.seq_len)
        runs, loads = [], []
        for repeat in range(args.repeats):
            run = ranks.run(capstone_worker, args=(str(work / f"run{repeat}"),), show_output=False, kwargs=dict(
                cfg=cfg, dp=layout.dp, pp=layout.pp, tp=layout.tp, m=layout.m, batch_size=args.batch,
                steps=args.steps, train_path=str(train_path), mapping=mapping, lr=3e-3, warmup=5,
                save_every=args.steps + 1, zero=layout.zero))
            loads.append(os.getloadavg()[0])
            trace = run.trace()
            report = derive_report(list(run), trace, flops, args.batch * cfg.seq_len, machine.peak_flops)
            busiest = max((r["memory"] for r in run), key=lambda m: sum(m.values()))
            rows = {row.figure: row for row in card_rows(report, busiest, chosen, model)}
            runs.append({"step_s": report["step_time"], "step_ratio": rows["step time"].ratio,
                         "memory_ratio": rows["memory per rank (states)"].ratio, "mfu": report["mfu"],
                         "bubble": report["bubble"], "bytes": report["bytes"],
                         "terms": measured_terms(list(run), trace)})
    finally:
        ranks.close()
        shutil.rmtree(work, ignore_errors=True)
    step_ratio = statistics.median(r["step_ratio"] for r in runs)
    memory_ratio = statistics.median(r["memory_ratio"] for r in runs)
    step_met = STEP_BAND[0] <= step_ratio <= STEP_BAND[1]
    memory_met = abs(memory_ratio - 1) <= MEMORY_TOLERANCE
    middle = sorted(runs, key=lambda r: r["step_ratio"])[len(runs) // 2]
    blamed = None if step_met else responsible_term(middle["terms"], predicted_terms(chosen), MATMUL_EFFICIENCY)
    data_out = {"layout": str(layout), "predicted": {"step_s": chosen.step_time, "mfu": chosen.mfu,
                                                     "bubble": chosen.bubble, "memory": chosen.memory},
                "cluster": {"peak_flops": machine.peak_flops, "bandwidth": machine.intra_node_bandwidth,
                            "latency": machine.intra_node_latency},
                "runs": runs, "step_ratio": step_ratio, "memory_ratio": memory_ratio,
                "targets": {"step_band": STEP_BAND, "memory_tolerance": MEMORY_TOLERANCE},
                "met": {"step": step_met, "memory": memory_met}, "responsible": blamed,
                "load_average": max(loads)}
    lines = [f"capstone: {layout} on {args.ranks} ranks, {args.repeats} runs of {args.steps} steps "
             f"(machine: {machine.peak_flops / 1e9:.1f} GFLOP/s per rank, gloo "
             f"{machine.intra_node_bandwidth / 1e9:.2f} GB/s, {machine.intra_node_latency * 1e6:.0f} µs per ring step)"]
    lines += [f"  run {i}: step {r['step_s'] * 1e3:6.1f} ms = {r['step_ratio']:.2f}x predicted, memory "
              f"{r['memory_ratio']:.3f}x, MFU {r['mfu']:.1%}, bubble {r['bubble']:.2f}" for i, r in enumerate(runs)]
    lines.append(f"median step time / predicted {step_ratio:.2f} (target {STEP_BAND[0]}–{STEP_BAND[1]}): "
                 f"{'met' if step_met else 'missed'}")
    lines.append(f"median memory per rank / predicted {memory_ratio:.3f} (target within "
                 f"{MEMORY_TOLERANCE:.0%}): {'met' if memory_met else 'missed'}")
    if blamed:
        lines.append(f"the term responsible for the step time: {blamed}")
    saved = results.save("capstone", data_out, "\n".join(lines), args.out, ranks=args.ranks,
                         threads_per_rank=ranks.threads or default_threads(args.ranks))
    faithful, why = results.faithfulness(results.load("capstone", saved.parent))
    lines.append("timings faithful" if faithful else f"timings not faithful: {why}")
    (saved.parent / "capstone.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0 if memory_met and (step_met or not faithful) else 1


if __name__ == "__main__":
    sys.exit(main())
