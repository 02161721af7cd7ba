"""Stragglers: one slow rank sets the pace of every synchronous step, and how to find it.

A rank that is slow but alive (a thermally throttled GPU, a host busy with something
else, a degraded link) raises no error and trips no watchdog. In data parallelism every
step ends in a gradient all-reduce that no rank can leave before every rank has joined,
so each step takes as long as the *slowest* rank's compute plus the collective: the
fast ranks spend the difference waiting inside the all-reduce. Every rank's step time is
then the same, which is why a step-time monitor sees a slow job but not the slow rank;
the per-rank *compute* time (before the collective) names it, and so does the wait (the
straggler is the one rank that hardly waits).

:func:`straggler_steps` runs such steps on every rank, with one rank made slow by a sleep
of a fixed length per step (a GPU that takes longer for the same work, without taking
CPU from the other ranks of a laptop); :func:`pace_by_rank` and :func:`find_stragglers`
turn what each rank measured into medians and a verdict.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from distlab.model import GPT, GPTConfig, synthetic_batch
from distlab.runtime.timeline import span

__all__ = ["straggler_steps", "pace_by_rank", "find_stragglers"]


def straggler_steps(steps: int = 12, *, slow_rank: int | None = None, delay: float = 0.05,
                    cfg: GPTConfig | None = None, batch_size: int = 4, seed: int = 0) -> dict:
    """Run ``steps`` data-parallel steps on every rank; rank ``slow_rank`` takes ``delay`` seconds longer to compute.

    Each step: forward and backward of a GPT on this rank's batch (timed: *compute*), one
    all-reduce of the flattened gradients (timed: *all-reduce*, which includes waiting for
    the last rank to arrive), then an SGD update. The all-reduce is kept apart from the
    backward (no DDP bucket overlap) so the two times separate cleanly. Returns the
    per-step seconds of each phase and of the whole step.
    """
    world = dist.get_world_size()
    if slow_rank is not None and not 0 <= slow_rank < world:
        raise ValueError(f"slow_rank must be a rank of the {world}-rank job or None, got {slow_rank}")
    if delay < 0:
        raise ValueError(f"delay must be at least 0 seconds, got {delay}")
    cfg = cfg or GPTConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=4, d_model=64)
    rank = dist.get_rank()
    model = GPT(cfg, seed=seed)  # the same weights on every rank, as under DDP
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    compute, reduce, step_seconds = [], [], []
    for step in range(steps + 1):  # step 0 warms up allocations and the first collective; it is not recorded
        x, y = synthetic_batch(cfg, batch_size, step=step * world + rank)  # each rank its own data
        dist.barrier()  # every step starts together: what follows is the step's own pace
        start = time.perf_counter()
        with span("compute"):
            _, loss = model(x, y)
            loss.backward()
            if rank == slow_rank:
                time.sleep(delay)
        computed = time.perf_counter()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        dist.all_reduce(grads)  # recorded on the timeline as a "comm" span: the wait is inside it
        reduced = time.perf_counter()
        offset = 0
        for p in model.parameters():
            p.grad.copy_(grads[offset:offset + p.numel()].view_as(p) / world)
            offset += p.numel()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step:
            compute.append(computed - start)
            reduce.append(reduced - computed)
            step_seconds.append(time.perf_counter() - start)
    return {"rank": rank, "compute": compute, "all_reduce": reduce, "step": step_seconds}


def pace_by_rank(results: Sequence[dict]) -> list[dict]:
    """Each rank's median compute, all-reduce and step seconds, from :func:`straggler_steps`'s results."""
    return [{phase: statistics.median(r[phase]) for phase in ("compute", "all_reduce", "step")} | {"rank": r["rank"]}
            for r in results]


def find_stragglers(compute_seconds: Sequence[Sequence[float]], factor: float = 1.5,
                    min_excess: float = 0.0) -> dict[int, float]:
    """``{rank: ratio}`` for each rank whose median compute time exceeds ``factor`` × the median of the others'
    and exceeds it by at least ``min_excess`` seconds.

    ``compute_seconds[r]`` is rank r's per-step compute times (the time before the step's
    collective, where a slow rank is slow; its step time is everyone's step time). Medians
    keep one descheduled step from naming a healthy rank; comparing each rank with the
    others' median keeps the straggler from raising the bar it is measured against. ``min_excess``
    ignores ranks slower by less than is worth acting on (a node is drained for seconds per hour,
    not for the scheduling noise of a few ranks sharing a laptop's cores).
    """
    if len(compute_seconds) < 2:
        raise ValueError(f"finding a straggler needs at least 2 ranks to compare, got {len(compute_seconds)}")
    if factor <= 1:
        raise ValueError(f"factor must be above 1 (a rank slower than its peers), got {factor}")
    medians = [statistics.median(times) for times in compute_seconds]
    found = {}
    for rank, mine in enumerate(medians):
        others = statistics.median(medians[:rank] + medians[rank + 1:])
        if mine > factor * others and mine - others >= min_excess:
            found[rank] = mine / others
    return found
