"""Killed ranks and exact resumption: fault injection, a resumable DDP job, and the restart loop.

A restart is only as good as what the checkpoint remembers. Weights alone are not
enough: Adam's moments and step count change every later update, and the data order
decides which batch comes next. :class:`ShuffledOrder` is a seeded, epoch-wise shuffled
order over a fixed pool of sequences whose position is part of the checkpoint, so a
resumed job sees exactly the batches the uninterrupted one would have, and its loss
curve continues bit for bit.

:func:`resumable_train` is the job (every rank runs it); :func:`run_with_restarts`
runs in the notebook process, as a cluster's job supervisor would: it launches the
job, and when a rank dies (:class:`~distlab.runtime.launch.RankCrashed`) or the ranks hang
(:class:`~distlab.runtime.launch.CollectiveTimeout`) it launches it again, which resumes
from the last committed checkpoint. Faults are real: :class:`Fault` makes a rank
SIGKILL itself at a chosen step, or in the middle of writing its checkpoint shard.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from distlab.data_parallel import BucketedDDP
from distlab.fault_tolerance.checkpoint import (
    TrainState,
    async_save_checkpoint,
    flat_state,
    latest_checkpoint,
    load_checkpoint,
    partial_checkpoints,
    save_checkpoint,
    verify_checkpoint,
)
from distlab.fault_tolerance.faults import Fault
from distlab.flops import step_report
from distlab.model import GPT, GPTConfig, synthetic_batch
from distlab.runtime.launch import CollectiveTimeout, RankCrashed, launch
from distlab.runtime.rank import device

__all__ = ["ShuffledOrder", "MetricsLog", "TrainSetup", "make_training", "train_step_ddp",
           "resumable_train", "Attempt", "RestartReport", "run_with_restarts", "train"]


# ---------------------------------------------------------------- data order

class ShuffledOrder:
    """A seeded shuffle of ``n_items`` sequences, epoch after epoch, that remembers where it is.

    Epoch ``e``'s order is ``randperm(n_items)`` from a generator seeded with
    ``(seed, e)``, so it depends on nothing but the seed and the epoch: no RNG state
    has to be saved, only ``(epoch, position)``. Each call to :meth:`next_batch`
    returns the next ``batch_size`` indices (wrapping into the next epoch), the global
    batch of one step; rank r trains on its contiguous slice of it.
    """

    def __init__(self, n_items: int, batch_size: int, seed: int = 0):
        if batch_size < 1 or n_items < batch_size:
            raise ValueError(f"need 1 <= batch_size <= n_items, got batch_size={batch_size}, n_items={n_items}")
        self.n_items, self.batch_size, self.seed = n_items, batch_size, seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.n_items, generator=generator)

    def next_batch(self) -> torch.Tensor:
        chunks, count = [], 0
        while count < self.batch_size:
            if self.position == self.n_items:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            take = min(self.batch_size - count, self.n_items - self.position)
            chunks.append(self._order[self.position:self.position + take])
            self.position += take
            count += take
        return torch.cat(chunks)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "n_items": self.n_items}

    def load_state_dict(self, state: dict) -> None:
        if (state["seed"], state["n_items"]) != (self.seed, self.n_items):
            raise ValueError(f"the checkpoint's data order (seed {state['seed']}, {state['n_items']} items) is not "
                             f"this job's (seed {self.seed}, {self.n_items} items)")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)


# ---------------------------------------------------------------- metrics that survive a crash

class MetricsLog:
    """One JSON line per step, flushed at once: what a crashed attempt trained is still on disk."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def append(self, **record) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text(encoding="utf-8").splitlines() if line.strip()]

    def curves(self) -> dict[int, dict[int, float]]:
        """``{attempt: {step: loss}}``."""
        out: dict[int, dict[int, float]] = {}
        for record in self.read():
            out.setdefault(record["attempt"], {})[record["step"]] = record["loss"]
        return out


# ---------------------------------------------------------------- the job

@dataclass
class TrainSetup:
    """One rank's training objects; ``state`` is what a checkpoint holds."""

    model: torch.nn.Module
    ddp: object
    optimizer: torch.optim.Optimizer
    order: ShuffledOrder
    pool: tuple[torch.Tensor, torch.Tensor]
    state: TrainState
    cfg: GPTConfig


def make_training(cfg: GPTConfig | None = None, batch_size: int = 8, lr: float = 3e-3, seed: int = 0,
                  data_seed: int = 0, n_items: int = 64) -> TrainSetup:
    """The lab's GPT under bucketed DDP with AdamW, over a pool of ``n_items`` synthetic sequences.

    Every rank builds the same model (seed) and the same pool (data seed); the optimizer
    and the data order start fresh: resuming is the checkpoint's job.
    """
    cfg = cfg or GPTConfig()
    world = dist.get_world_size() if dist.is_initialized() else 1
    if batch_size % world:
        raise ValueError(f"global batch {batch_size} is not divisible by world_size {world}")
    model = GPT(cfg, seed=seed).to(device())  # this rank's GPU under NCCL, else the CPU
    ddp = BucketedDDP(model, bucket_cap_bytes=2**20) if dist.is_initialized() else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    order = ShuffledOrder(n_items, batch_size, seed=data_seed)
    pool = synthetic_batch(cfg, n_items, step=0, seed=data_seed)
    return TrainSetup(model, ddp, optimizer, order, pool, TrainState(model, optimizer, order), cfg)


def local_rows(setup: TrainSetup, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's contiguous slice of a global batch of pool indices, on this rank's device."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    local = len(indices) // world
    mine = indices[rank * local:(rank + 1) * local]
    x, y = setup.pool
    dev = device()
    return x[mine].to(dev), y[mine].to(dev)


def train_step_ddp(setup: TrainSetup, indices: torch.Tensor) -> float:
    """One DDP step on the global batch ``indices``; returns the loss averaged over all ranks."""
    x, y = local_rows(setup, indices)
    _, loss = setup.model(x, y)
    loss.backward()
    if setup.ddp is not None:
        setup.ddp.finish_gradient_sync()
    setup.optimizer.step()
    setup.optimizer.zero_grad(set_to_none=True)
    mean = loss.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
    return float(mean)


def resumable_train(ckpt_dir: str, steps: int, save_every: int, *, attempt: int = 0, fault: Fault | None = None,
                    async_save: bool = False, cfg: GPTConfig | None = None, batch_size: int = 8, lr: float = 3e-3,
                    seed: int = 0, data_seed: int = 0, n_items: int = 64, on_step: Callable | None = None,
                    on_resume: Callable[[TrainSetup], None] | None = None) -> dict:
    """Train to ``steps``, resuming from the latest committed checkpoint in ``ckpt_dir``; save every ``save_every``.

    Runs on every rank. Rank 0 appends each step's loss to ``ckpt_dir/metrics.jsonl``
    tagged with ``attempt``. A checkpoint named ``step_k`` holds the state after ``k``
    updates, so a resumed job starts with step ``k``. Returns where it started and the
    losses it computed, by step. ``on_step(step, loss, seconds)`` is called after every step;
    ``on_resume(setup)`` once a checkpoint is loaded, before the first step trained from it.
    """
    setup = make_training(cfg, batch_size, lr, seed, data_seed, n_items)
    rank = dist.get_rank()
    log = MetricsLog(Path(ckpt_dir) / "metrics.jsonl")
    latest = latest_checkpoint(ckpt_dir)
    if latest is not None:
        load_checkpoint({"train": setup.state}, latest)
        if on_resume is not None:
            on_resume(setup)
    start = setup.state.step
    losses, pending = {}, None
    for step in range(start, steps):
        if fault is not None:
            fault.maybe_kill(rank, step)
        started = time.perf_counter()
        losses[step] = train_step_ddp(setup, setup.order.next_batch())
        if on_step is not None:
            on_step(step, losses[step], time.perf_counter() - started)
        if rank == 0:
            log.append(attempt=attempt, step=step, loss=losses[step])
        setup.state.step = step + 1
        if (step + 1) % save_every == 0:
            if async_save:
                pending = async_save_checkpoint({"train": setup.state}, ckpt_dir, step + 1, previous=pending)
            else:
                save_checkpoint({"train": setup.state}, ckpt_dir, step + 1, fault=fault)
    if pending is not None:
        pending.wait()
    return {"start": start, "losses": losses,
            "weights": {k: v.detach().cpu().clone() for k, v in setup.model.state_dict().items()}}


# ---------------------------------------------------------------- the supervisor

@dataclass
class Attempt:
    number: int
    resumed_from: str | None  # the checkpoint directory it loaded, None for a fresh start
    outcome: str  # "finished", or the failure's first line
    failed_rank: int | None = None
    seconds: float = 0.0
    partial: list[str] = field(default_factory=list)  # partial checkpoints on disk when it started (never loaded)


@dataclass
class RestartReport:
    attempts: list[Attempt] = field(default_factory=list)
    run: object = None  # the successful launch's Run (values in rank order)

    @property
    def restarts(self) -> int:
        return len(self.attempts) - 1

    def summary(self) -> str:
        lines = []
        for a in self.attempts:
            where = f"resumed from {Path(a.resumed_from).name}" if a.resumed_from else "started fresh"
            if a.partial:
                where += f" (ignored the partial {', '.join(a.partial)})"
            lines.append(f"attempt {a.number}: {where}; {a.outcome}")
        return "\n".join(lines)


def run_with_restarts(worker: Callable, world_size: int, ckpt_dir: str, *, kwargs: dict | None = None,
                      faults: dict[int, Fault] | None = None, max_restarts: int = 3, ranks=None,
                      collective_timeout: float = 10.0, timeout: float | None = None) -> RestartReport:
    """Launch ``worker(ckpt_dir, attempt=…, fault=…, **kwargs)`` until it finishes; relaunch after a crash or hang.

    Runs in the launching (notebook) process. ``faults[attempt]`` is injected into that
    attempt only. A rank that *raised* is a bug, not an infrastructure failure: its
    :class:`~distlab.runtime.launch.RankFailed` propagates instead of being retried.
    ``ranks`` (a :class:`distlab.Ranks`) is reused when given; a failure ends its
    processes and the next attempt gets fresh ones.
    """
    faults = dict(faults or {})
    report = RestartReport()
    for attempt in range(max_restarts + 1):
        latest = latest_checkpoint(ckpt_dir)
        partial = [p.name for p in partial_checkpoints(ckpt_dir)]
        job_kwargs = dict(kwargs or {}, attempt=attempt, fault=faults.get(attempt))
        started = time.perf_counter()
        try:
            if ranks is not None:
                run = ranks.run(worker, args=(ckpt_dir,), kwargs=job_kwargs, show_output=False, timeout=timeout)
            else:
                run = launch(worker, world_size, args=(ckpt_dir,), kwargs=job_kwargs, show_output=False,
                                     collective_timeout=collective_timeout, timeout=timeout)
        except (RankCrashed, CollectiveTimeout) as failure:
            first = str(failure).strip().splitlines()[0]
            rank = getattr(failure, "rank", None)
            if rank is None and getattr(failure, "waiting", None):
                rank = min(failure.waiting)
            report.attempts.append(Attempt(attempt, str(latest) if latest else None, first, rank,
                                           time.perf_counter() - started, partial))
            continue
        report.attempts.append(Attempt(attempt, str(latest) if latest else None, "finished", None,
                                       time.perf_counter() - started, partial))
        report.run = run
        return report
    raise RuntimeError(f"the job failed {max_restarts + 1} times in a row; last: {report.attempts[-1].outcome}")


# ---------------------------------------------------------------- under torchrun, which is the supervisor

def train(ckpt_dir: str = "checkpoints", steps: int = 20, save_every: int = 5, batch_size: int = 8, n_layer: int = 2,
          d_model: int = 64, n_head: int = 4, vocab_size: int = 256, seq_len: int = 64, lr: float = 3e-3,
          seed: int = 0, async_save: bool = False, kill_rank: int = -1, kill_step: int = -1, resumed_state: str = "",
          log_every: int = 0, peak: float | str = "measured") -> dict:
    """The resumable job under torchrun, whose agent restarts the group after a rank dies::

        torchrun --nproc-per-node=4 --max-restarts=3 -m distlab.torchrun distlab.fault_tolerance:train \\
            ckpt_dir=/shared/ckpt steps=1000 save_every=50

    The attempt is torchrun's ``TORCHELASTIC_RESTART_COUNT``; every attempt resumes from the latest
    committed checkpoint in ``ckpt_dir`` (a directory every node sees), so losses continue bit for bit.
    ``kill_rank``/``kill_step``: a :class:`Fault` SIGKILLs that rank at that step of the first attempt (a
    rehearsal of the real thing). ``batch_size`` is the global batch, whatever the world size: an elastic
    launch (``--nnodes=1:2``) that comes back with fewer ranks after losing a node splits the same batches
    over them (a larger share each) and loads the checkpoint the larger world wrote (DCP reshards it), so
    the optimizer sees the same data in the same order. ``resumed_state=FILE``: after loading a checkpoint,
    rank 0 writes the state it holds there (``torch.save`` of :func:`flat_state`: weights, Adam's moments,
    step and data position, keyed as :func:`read_checkpoint` keys the checkpoint), so a resharded restart
    can be checked tensor by tensor. ``log_every=k`` (torchrun's default is 1): rank 0 says at which world
    size it starts and from where, and prints every k-th step (loss, tokens/s, MFU against ``peak``).
    """
    cfg = GPTConfig(vocab_size=int(vocab_size), seq_len=int(seq_len), n_layer=int(n_layer), n_head=int(n_head),
                    d_model=int(d_model))
    world, rank = dist.get_world_size(), dist.get_rank()
    if int(save_every) < 1:
        raise ValueError(f"save_every={save_every} must be at least 1 step")
    if int(batch_size) % world:
        raise ValueError(f"global batch {batch_size} is not divisible by world_size {world}")
    if int(kill_step) >= 0 and not 0 <= int(kill_rank) < world:
        raise ValueError(f"kill_rank={kill_rank} is not one of the {world} ranks")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    fault = Fault(int(kill_rank), int(kill_step)) if int(kill_step) >= 0 and attempt == 0 else None
    latest = latest_checkpoint(ckpt_dir)
    report = step_report(f"resumable dp-{world}", cfg, int(steps), int(batch_size) * cfg.seq_len, log_every, peak)
    if report and rank == 0:
        where = "starting fresh"
        if latest is not None:
            writers = verify_checkpoint(latest, checksums=False)["world_size"]
            where = f"resuming from {latest.name}" + (f" (written by {writers} ranks, resharded to {world})"
                                                       if writers != world else "")
        print(f"[resumable dp-{world}] attempt {attempt}: {where} in {ckpt_dir}", flush=True)

    def write_resumed(setup: TrainSetup) -> None:
        if rank == 0:  # DDP: every rank holds the whole state, so rank 0's is all of it
            torch.save(flat_state({"train": setup.state}), resumed_state)

    out = resumable_train(ckpt_dir, int(steps), int(save_every), attempt=attempt, fault=fault,
                          async_save=bool(async_save), cfg=cfg, batch_size=int(batch_size), lr=float(lr),
                          seed=int(seed), on_step=report.step if report else None,
                          on_resume=write_resumed if resumed_state else None)
    result = {"rank": rank, "world_size": world, "attempt": attempt, "start": out["start"],
              "losses": [out["losses"][k] for k in sorted(out["losses"])]}
    if report:
        result["mfu"] = report.finish()["mfu"]
    return result
