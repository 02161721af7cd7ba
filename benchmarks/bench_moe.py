"""Lab 08: how three load-balancing strategies shape an expert-parallel MoE GPT's training.

Trains ``distlab.moe.MoEGPT`` (the lab's GPT, every MLP an MoE layer of 8 experts, top-2,
capacity factor 1.25) with ``distlab.moe.train_moe`` on 4 gloo ranks — experts spread over
the ranks, everything else data-parallel — once per strategy and seed:

* ``none``: the router alone;
* ``aux``: the Switch load-balancing loss (coefficient 0.1) and the router z-loss (1e-3);
* ``bias``: DeepSeek-V3's auxiliary-loss-free bias (step 1e-3).

Per run it records the loss curve, each expert's load per step and the assignments dropped by
the capacity limit. The summary gives, per strategy, the medians over seeds of the final loss,
of the busiest expert's load over the mean (per step, averaged over the last 20 steps) and of
the dropped share; the target is that both balanced strategies bring the busiest expert at
least 10% closer to the mean than no balancing. Routing decisions do not depend on timing, so
the figures are faithful on any number of cores (the ranks just take longer on fewer).

    python benchmarks/bench_moe.py            # about 3 minutes on 2 cores
    python benchmarks/bench_moe.py --quick    # a smoke run; results are not saved

Writes ``benchmarks/results/moe.json`` and ``moe.txt`` (``distlab.results``), which
``solutions/08_moe.ipynb`` loads. Exit status 1 when the target is missed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import distlab
from distlab import results
from distlab.model import GPTConfig
from distlab.moe import MoEConfig, imbalance, train_moe

STRATEGIES = {"none": "no balancing", "aux": "Switch loss + z-loss", "bias": "DeepSeek-V3 bias"}
TARGET = 1.10  # "none" busiest/mean over each balanced strategy's


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seeds", type=int, default=3, help="runs per strategy (model and data seeds 0, 1, …)")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--batch", type=int, default=16, help="global batch, sequences of 64 tokens")
    p.add_argument("--window", type=int, default=20, help="last steps averaged for the summary")
    p.add_argument("--quick", action="store_true", help="1 seed, 30 steps: a smoke test, nothing saved")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.seeds, args.window = 30, 1, 10
    return args


def summarise(run: dict, window: int) -> dict:
    loads = run["loads"][-window:]
    return {"final_loss": statistics.mean(run["losses"][-window:]),
            "busiest_over_mean": statistics.mean(imbalance(load) for load in loads),
            "dropped_share": sum(run["dropped"][-window:]) / (window * run["assignments_per_step"])}


def main(argv=None) -> int:
    args = parse(argv)
    cfg = GPTConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=4, d_model=64)
    moe = MoEConfig(num_experts=8, k=2, expert_ratio=2, capacity_factor=1.25, aux_coef=0.1, z_coef=1e-3,
                    bias_rate=1e-3, router_std=0.3)
    ranks = distlab.Ranks(args.world_size, collective_timeout=60)
    runs: dict[str, list[dict]] = {b: [] for b in STRATEGIES}
    started = time.perf_counter()
    try:
        for seed in range(args.seeds):
            for balancing in STRATEGIES:
                out = ranks.run(train_moe, kwargs=dict(steps=args.steps, balancing=balancing, cfg=cfg, moe=moe,
                                                       batch_size=args.batch, lr=3e-3, seed=seed, data_seed=seed),
                                show_output=False)[0]
                runs[balancing].append(out)
            print(f"seed {seed + 1}/{args.seeds} done ({time.perf_counter() - started:.0f} s)", flush=True)
    finally:
        ranks.close()

    per_seed = {b: [summarise(r, args.window) for r in rs] for b, rs in runs.items()}
    medians = {b: {key: statistics.median(s[key] for s in stats) for key in stats[0]} for b, stats in per_seed.items()}
    ratios = {b: medians["none"]["busiest_over_mean"] / medians[b]["busiest_over_mean"] for b in ("aux", "bias")}
    met = all(r >= TARGET for r in ratios.values())
    lines = [f"MoE GPT (d_model {cfg.d_model}, {cfg.n_layer} MoE layers of {moe.num_experts} experts, top-{moe.k}, "
             f"capacity factor {moe.capacity_factor}) on {args.world_size} gloo ranks, batch {args.batch}x"
             f"{cfg.seq_len}, AdamW 3e-3, {args.steps} steps, {args.seeds} seed(s); medians over seeds of the last "
             f"{args.window} steps",
             f"{'strategy':<22}{'loss':>8}{'busiest/mean':>14}{'dropped':>9}"]
    for b, label in STRATEGIES.items():
        m = medians[b]
        lines.append(f"{label:<22}{m['final_loss']:>8.3f}{m['busiest_over_mean']:>13.2f}x{m['dropped_share']:>9.1%}")
    lines.append(f"no balancing's busiest/mean over the Switch loss's: {ratios['aux']:.2f}, over the bias's: "
                 f"{ratios['bias']:.2f} (target >= {TARGET:.2f}): {'met' if met else 'MISSED'}")
    summary = "\n".join(lines)
    print()
    print(summary)
    if args.quick:
        print("(--quick: not saved)")
    else:
        curves = {b: {"losses": rs[0]["losses"], "loads": rs[0]["loads"][-args.window:],
                      "dropped": rs[0]["dropped"]} for b, rs in runs.items()}
        path = results.save("moe", {"strategies": STRATEGIES, "medians": medians, "per_seed": per_seed,
                                    "ratios": ratios, "target": TARGET, "met": met, "seed0": curves,
                                    "config": dict(vars(args), d_model=cfg.d_model, n_layer=cfg.n_layer,
                                                   num_experts=moe.num_experts, k=moe.k,
                                                   capacity_factor=moe.capacity_factor, aux_coef=moe.aux_coef,
                                                   bias_rate=moe.bias_rate, router_std=moe.router_std)},
                            summary)
        print(f"saved {path}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
