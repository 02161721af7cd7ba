"""Which layers go to which stage: an even split, and one balanced by measured cost.

A partition is a list of ``range`` objects over the GPT's blocks, one per stage, in
order: stage ``s`` runs blocks ``partition[s]``. The token and position embeddings
always run on the first stage and ``ln_f`` + ``lm_head`` + the loss on the last one.

A pipeline runs at the pace of its slowest stage: every other stage idles for the
difference on every micro-batch. So the split that matters minimises the *largest*
stage cost, and the embedding and the LM head count: with a large vocabulary the head
alone can cost several blocks (Megatron-LM's ``--account-for-loss-in-pipeline-split``
and torchtitan's per-stage layer counts exist for this reason).
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch
import torch.nn.functional as F

from distlab.collectives import chunk_sizes
from distlab.model import GPT, GPTConfig, synthetic_batch

__all__ = ["even_partition", "balanced_partition", "stage_costs", "check_partition", "LayerCosts",
           "measure_layer_costs"]


def even_partition(n_layers: int, n_stages: int) -> list[range]:
    """Contiguous blocks of sizes that differ by at most one, the first stages taking the extra
    layers (the last stage also runs the LM head). 10 layers on 4 stages: 3, 3, 2, 2."""
    _check_counts(n_layers, n_stages)
    bounds = [0]
    for size in chunk_sizes(n_layers, n_stages):
        bounds.append(bounds[-1] + size)
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def stage_costs(partition: Sequence[range], layer_costs: Sequence[float], first_extra: float = 0.0,
                last_extra: float = 0.0) -> list[float]:
    """Cost of each stage: its layers, plus the embedding on the first and the head on the last."""
    costs = [sum(layer_costs[i] for i in stage) for stage in partition]
    costs[0] += first_extra
    costs[-1] += last_extra
    return costs


def balanced_partition(layer_costs: Sequence[float], n_stages: int, first_extra: float = 0.0,
                       last_extra: float = 0.0) -> list[range]:
    """The contiguous split into ``n_stages`` non-empty stages whose largest stage cost (as
    :func:`stage_costs` counts it) is smallest.

    Dynamic programme over (stages used, layers placed): ``best[k][i]`` is the smallest
    possible largest cost of placing the first ``i`` layers on the first ``k`` stages.
    O(n_stages · n_layers²), instant for any real model. Among equally good splits it
    returns the one whose earlier stages are as long as possible.
    """
    costs = [float(c) for c in layer_costs]
    n = len(costs)
    _check_counts(n, n_stages)
    if any(c < 0 for c in costs) or first_extra < 0 or last_extra < 0:
        raise ValueError("layer costs must be non-negative")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(k: int, a: int, b: int) -> float:  # stage k runs layers a..b-1
        extra = (first_extra if k == 0 else 0.0) + (last_extra if k == n_stages - 1 else 0.0)
        return prefix[b] - prefix[a] + extra

    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for i in range(k, n - (n_stages - k) + 1):
            for j in range(i - 1, k - 2, -1):  # stage k-1 runs layers j..i-1; prefer long earlier stages
                value = max(best[k - 1][j], cost(k - 1, j, i))
                if value < best[k][i] - 1e-12 * max(1.0, abs(value)):
                    best[k][i], cut[k][i] = value, j
    bounds = [n]
    for k in range(n_stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    bounds.reverse()
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def check_partition(partition: Sequence[range], n_layers: int, n_stages: int) -> None:
    """Raise ``ValueError`` unless ``partition`` is ``n_stages`` non-empty contiguous ranges covering 0..n_layers-1."""
    stages = list(partition)
    if len(stages) != n_stages:
        raise ValueError(f"returned {len(stages)} stages, expected {n_stages}")
    expected = 0
    for s, stage in enumerate(stages):
        if not isinstance(stage, range) or stage.step != 1:
            raise ValueError(f"stage {s} must be a range of consecutive layers, got {stage!r}")
        if len(stage) == 0:
            raise ValueError(f"stage {s} has no layers; every stage needs at least one")
        if stage.start != expected:
            raise ValueError(f"stage {s} starts at layer {stage.start}, expected {expected}: stages must cover "
                             f"the layers in order, without gaps or overlaps")
        expected = stage.stop
    if expected != n_layers:
        raise ValueError(f"the stages cover layers 0..{expected - 1}, but the model has {n_layers}")


def _check_counts(n_layers: int, n_stages: int) -> None:
    for name, value in (("n_layers", n_layers), ("n_stages", n_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if n_stages > n_layers:
        raise ValueError(f"cannot split {n_layers} layers into {n_stages} stages: every stage needs at least one "
                         f"layer (use at most {n_layers} stages, or a deeper model)")


class LayerCosts(dict):
    """``{"embedding": s, "blocks": [s, …], "head": s}``: seconds of forward + backward per micro-batch."""

    @property
    def blocks(self) -> list[float]:
        return self["blocks"]


def measure_layer_costs(cfg: GPTConfig, rows: int = 2, repeats: int = 5, seed: int = 0) -> LayerCosts:
    """Time forward + backward of the embedding, each block, and ln_f + lm_head + loss, in this process.

    Medians over ``repeats`` after one warm-up; the same input shapes a pipeline stage sees
    (``rows`` sequences per micro-batch). Costs are what a balanced split needs — their
    ratios, not their absolute values, decide the partition.
    """
    model = GPT(cfg, seed=seed)
    x, y = synthetic_batch(cfg, rows, step=0)
    with torch.no_grad():
        hidden = model.tok_emb(x) + model.pos_emb(torch.arange(cfg.seq_len))

    def embed():
        out = model.tok_emb(x) + model.pos_emb(torch.arange(cfg.seq_len))
        out.sum().backward()

    def block_fn(block):
        def run():
            h = hidden.detach().requires_grad_()
            block(h).sum().backward()
        return run

    def head():
        h = hidden.detach().requires_grad_()
        logits = model.lm_head(model.ln_f(h))
        F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)).backward()

    def timed(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    return LayerCosts(embedding=timed(embed), blocks=[timed(block_fn(b)) for b in model.blocks], head=timed(head))
