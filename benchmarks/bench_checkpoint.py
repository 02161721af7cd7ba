"""Lab 12 target: the training stall of an async checkpoint is at most 0.3x a synchronous one's.

The same DDP job (the lab's GPT, AdamW, gloo or NCCL ranks) trains with a checkpoint
every ``--save-every`` steps, three ways on one warm group: no checkpoints, ``dcp.save``
(through :func:`distlab.fault_tolerance.save_checkpoint`: shards, manifest, rename) and
``dcp.async_save`` (:func:`~distlab.fault_tolerance.async_save_checkpoint`). Repeats
are interleaved, the order rotating, so drift of a shared machine hits every mode alike.

* **stall** — the time the training loop is blocked per save: the slowest rank's, the
  median over every save of every repeat. The target is the async/sync ratio.
* **interference** — what the background write still costs: the median step time of
  async runs over that of runs without checkpoints. On GPUs the write uses the host
  while the GPU computes; on a CPU-only machine it competes with the ranks for cores,
  and a machine with fewer cores than ranks + writer threads says so in the summary.

    python benchmarks/bench_checkpoint.py            # a few minutes on 2 cores
    python benchmarks/bench_checkpoint.py --quick    # a smoke run

Writes ``benchmarks/results/checkpoint.json`` and ``.txt``; exit status 1 when the target is missed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import distlab
from distlab import results
from distlab.fault_tolerance.stall import stall_summary, timed_training
from distlab.model import GPTConfig, count_params
from distlab.runtime.launch import default_threads

TARGET = 0.3
MODES = ["none", "sync", "async"]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--d-model", type=int, default=384)
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--batch", type=int, default=4, help="global batch (sequences of 64 tokens)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per job")
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--repeats", type=int, default=4, help="jobs per mode, interleaved")
    p.add_argument("--dir", help="where to write the checkpoints (default: a temporary directory)")
    p.add_argument("--quick", action="store_true", help="2 repeats of a small model: a smoke test")
    p.add_argument("--no-save", action="store_true", help="print only; do not write benchmarks/results")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.d_model, args.n_layer, args.steps = 2, 128, 2, 4
    return args


def main(argv=None) -> int:
    args = parse(argv)
    cfg = GPTConfig(vocab_size=256, seq_len=64, n_layer=args.n_layer, n_head=4, d_model=args.d_model)
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-checkpoint-"))
    ranks = distlab.Ranks(args.world_size, collective_timeout=60)
    runs: dict[str, list] = {mode: [] for mode in MODES}
    started = time.perf_counter()
    try:
        for rep in range(args.repeats):
            for mode in MODES[rep % 3:] + MODES[:rep % 3]:
                directory = root / f"{mode}-{rep}"
                run = ranks.run(timed_training, args=(str(directory), mode), show_output=False,
                                kwargs=dict(steps=args.steps, save_every=args.save_every, cfg=cfg,
                                            batch_size=args.batch))
                runs[mode].append([dict(r) for r in run])
                shutil.rmtree(directory, ignore_errors=True)
            print(f"repeat {rep + 1}/{args.repeats} done ({time.perf_counter() - started:.0f} s)", flush=True)
    finally:
        ranks.close()
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)

    summary = stall_summary(runs)
    sync, asynchronous, none = summary["sync"], summary["async"], summary["none"]
    ratio = summary["ratio"]
    state_mib = runs["sync"][0][0]["state_bytes"] / 2**20
    cpus = results.machine()["cpus"]
    threads_needed = 2 * args.world_size  # a training thread and a writer thread per rank
    met = ratio <= TARGET
    headline = (f"async save stalls training {asynchronous['blocked'] * 1e3:.0f} ms vs synchronous "
                f"{sync['blocked'] * 1e3:.0f} ms per save: ratio {ratio:.2f} (target <= {TARGET:.2f}: "
                f"{'met' if met else 'MISSED'})")
    lines = [
        f"GPT d_model={cfg.d_model} n_layer={cfg.n_layer}: {count_params(cfg) / 1e6:.1f}M parameters, "
        f"{state_mib:.0f} MiB of weights + AdamW state per rank; {args.world_size} ranks, a checkpoint every "
        f"{args.save_every} steps; {args.repeats} interleaved repeats x {args.steps} steps per mode; medians",
        f"{'mode':<7}{'blocked ms/save':>16}{'step ms':>9}{'background write ms':>21}",
    ]
    for mode in MODES:
        s = summary[mode]
        background = f"{s['background'] * 1e3:.0f}" if mode == "async" else "-"
        lines.append(f"{mode:<7}{s['blocked'] * 1e3:>16.1f}{s['step'] * 1e3:>9.1f}{background:>21}")
    lines.append(f"interference: steps run {asynchronous['step'] / none['step']:.2f}x as long during async runs "
                 f"as without checkpoints ({sync['step'] / none['step']:.2f}x during sync runs)")
    if cpus < threads_needed:
        lines.append(f"measured on {cpus} cores for {args.world_size} ranks + {args.world_size} writer threads: the "
                     f"background write competes with training for cores, so the interference is larger than on a "
                     f"machine with a core per thread (or on GPUs)")
    lines.append(f"load average during the run: {os.getloadavg()[0]:.1f} on {cpus} cores")
    lines.append(headline)
    text = "\n".join(lines)
    print()
    print(text)
    if not args.no_save and not args.quick:
        data = {"target": TARGET, "ratio": ratio, "met": met, "headline": headline, "modes": summary,
                "state_mib": state_mib, "world_size": args.world_size, "params": count_params(cfg),
                "load_average": os.getloadavg()[0], "config": vars(args)}
        print("saved", results.save("checkpoint", data, text, ranks=args.world_size,
                                    threads_per_rank=default_threads(args.world_size)))
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
