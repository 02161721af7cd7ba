"""How long a checkpoint stalls training: synchronous ``dcp.save`` against ``dcp.async_save``.

The stall is the time the training loop is blocked, not the time the save takes. A
synchronous save blocks for all of it: collect the state, plan, write every shard,
fsync, commit. An async save blocks only while it copies the state into host memory
(staging) — and while it waits for the previous async save, if that one is still
writing when the next is due — and then writes on a background thread while training
goes on. What the background write still costs shows up as slower steps while it
runs: on GPUs little (the GPU keeps computing), on a CPU that the write shares, more.
:func:`timed_training` measures both: the blocked time of every save, and every
step's compute time, with a timeline of both.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from distlab.fault_tolerance.checkpoint import async_save_checkpoint, save_checkpoint
from distlab.fault_tolerance.resume import make_training, train_step_ddp
from distlab.memory import model_state_bytes
from distlab.model import GPTConfig
from distlab.runtime.timeline import span

__all__ = ["MODES", "timed_training", "state_bytes", "stall_summary"]

MODES = ("none", "sync", "async")


def state_bytes(setup) -> int:
    """Bytes of the weights and optimizer state this rank checkpoints (a replica: all of them)."""
    counted = model_state_bytes(setup.model, setup.optimizer)
    return counted["parameters"] + counted["optimizer"]


def timed_training(ckpt_dir: str, mode: str, steps: int = 8, save_every: int = 2, *, cfg: GPTConfig | None = None,
                   batch_size: int = 4, seed: int = 0) -> dict:
    """Train ``steps`` DDP steps, checkpointing every ``save_every`` with ``mode`` (none, sync, async).

    Runs on every rank. Spans: ``step`` (compute), ``checkpoint (blocked)`` (the loop
    waits) and, for async saves, ``background write`` from the save's start to its commit.
    Returns per-step compute seconds, per-save blocked seconds, per-save background
    seconds (async) and the bytes each rank checkpoints.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    setup = make_training(cfg or GPTConfig(), batch_size=batch_size, seed=seed, n_items=max(64, 2 * batch_size))
    train_step_ddp(setup, setup.order.next_batch())  # warm-up: allocations, optimizer state, first-call costs
    step_seconds, blocked, background, pending = [], [], [], None
    dist.barrier()
    for step in range(steps):
        start = time.perf_counter()
        with span("step"):
            train_step_ddp(setup, setup.order.next_batch())
        step_seconds.append(time.perf_counter() - start)
        setup.state.step = step + 1
        if mode != "none" and (step + 1) % save_every == 0:
            start = time.perf_counter()
            with span("checkpoint (blocked)", kind="idle"):
                if mode == "sync":
                    save_checkpoint({"train": setup.state}, ckpt_dir, step + 1)
                else:
                    # if the previous save is still writing, waiting for it is part of this save's stall
                    previous, pending = pending, async_save_checkpoint({"train": setup.state}, ckpt_dir, step + 1,
                                                                       previous=pending)
                    if previous is not None:
                        background.append(previous.finished - previous.started)
            blocked.append(time.perf_counter() - start)
    if pending is not None:
        pending.wait()
        background.append(pending.finished - pending.started)
    return {"mode": mode, "step_seconds": step_seconds, "blocked_seconds": blocked, "background_seconds": background,
            "state_bytes": state_bytes(setup), "threads": torch.get_num_threads()}


def stall_summary(runs: dict[str, list[dict]]) -> dict:
    """Medians over repeats and ranks: ``{mode: {"blocked": s, "step": s}}`` and the async/sync stall ratio.

    A save's stall is the slowest rank's blocked time (the others wait for it at the
    next collective); ``runs[mode]`` is a list of launches (each a list of rank results).
    """
    out = {}
    for mode, launches in runs.items():
        blocked = [max(per_rank) for launch in launches for per_rank in zip(*(r["blocked_seconds"] for r in launch))]
        steps = [max(per_rank) for launch in launches for per_rank in zip(*(r["step_seconds"] for r in launch))]
        writes = [s for launch in launches for r in launch for s in r["background_seconds"]]
        out[mode] = {"blocked": statistics.median(blocked) if blocked else 0.0, "step": statistics.median(steps),
                     "background": statistics.median(writes) if writes else 0.0, "saves": len(blocked)}
    if "sync" in out and "async" in out and out["sync"]["blocked"] > 0:
        out["ratio"] = out["async"]["blocked"] / out["sync"]["blocked"]
    return out
