"""The end-to-end run: real tokens through a DP × PP × TP grid with AdamW, warm-up and cosine decay, clipping at
1.0, ZeRO-1 over DP and async checkpoints that a killed rank resumes from bit for bit.

Nothing here is a new implementation of a parallelism. The model side is lab 11's composition
(:func:`distlab.parallel3d.grid.process_groups`, lab 05's :class:`~distlab.tensor_parallel.TensorParallelGPT` cut
by lab 06's :class:`~distlab.pipeline_parallel.StageModule`, run by :func:`~distlab.pipeline_parallel.run_schedule`),
the DP axis is lab 04's :class:`~distlab.zero.ShardedOptimizer` (or lab 11's gradient average), the checkpoints
are lab 12's committed DCP saves and the data is lab 10's shards read by
:class:`~distlab.data.loader.ResumableTokenLoader`. What this module adds is what a real run needs around them
and lab 11's worker leaves out:

* **the seeds' optimizer defaults** — AdamW (β = 0.9, 0.95; weight decay 0.1), a linear warm-up then a cosine
  decay to a tenth of the peak (:func:`lr_at`), and the gradient clipped to a global norm of 1.0. On a grid
  that norm is global over shards: every DP shard, pipeline stage and TP slice holds a piece of the gradient,
  and a replicated tensor (a LayerNorm on every TP rank) must be counted once (:func:`clip_global_norm`);
* **a checkpoint of the grid** (:class:`GridTrainState`): every rank saves its own shards under its rank — its
  stage's weights, its ZeRO shard of the Adam moments, the loader's position and the step — so a relaunch
  of the same layout continues exactly. (Loading into another layout is resharding: lab 12's FSDP2 path.)
"""

from __future__ import annotations

import functools
import math
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.data.loader import ResumableTokenLoader, compact_vocabulary
from distlab.data_parallel import allreduce_buckets
from distlab.fault_tolerance.checkpoint import (
    async_save_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
)
from distlab.fault_tolerance.faults import Fault
from distlab.fault_tolerance.resume import MetricsLog
from distlab.flops import step_report
from distlab.fp8 import Float8Linear, convert_to_float8, scaled_mm_support
from distlab.model import GPT, GPTConfig
from distlab.parallel3d.grid import Grid, check_3d_setup, process_groups
from distlab.pipeline_parallel import StageModule, even_partition, make_schedule, run_schedule
from distlab.pipeline_parallel.train import keep_freed_memory
from distlab.runtime import comm
from distlab.runtime.progress import progress as progress_bar
from distlab.runtime.rank import device, native_bf16
from distlab.runtime.timeline import span
from distlab.tensor_parallel import TensorParallelGPT, shard_of, vocab_parallel_cross_entropy
from distlab.tensor_parallel.gpt import is_replicated
from distlab.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from distlab.zero.flat import Axis
from distlab.zero.optim import ShardedOptimizer

__all__ = ["lr_at", "GridTrainState", "resume_from_latest", "clip_global_norm", "capstone_worker", "dense_state",
           "checkpoint_weights", "replica_losses", "evaluate", "reference_losses", "train"]

BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1
CLIP = 1.0


def lr_at(step: int, peak: float, warmup: int, total: int, floor: float = 0.1) -> float:
    """The learning rate of update ``step`` (0-based): linear warm-up to ``peak`` over ``warmup`` steps, then a
    cosine from ``peak`` down to ``floor · peak`` at ``total``. Adam's first updates use moment estimates of a
    handful of gradients; the warm-up keeps those noisy steps small."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def _adamw(lr: float, weight_decay: float = WEIGHT_DECAY):
    return functools.partial(torch.optim.AdamW, lr=lr, betas=BETAS, weight_decay=weight_decay)


def _adam_state(optimizer: torch.optim.Optimizer) -> dict:
    """Adam's per-parameter state by position, created (as zeros, exactly as Adam creates it at its first step) for
    a fresh optimizer: DCP loads into existing tensors, so the target must hold them before a resume."""
    out = {}
    for i, p in enumerate(q for group in optimizer.param_groups for q in group["params"]):
        state = optimizer.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        out[str(i)] = state
    return out


class GridTrainState:
    """What one rank of the grid saves: its stage's weights, its optimizer state (its ZeRO shard), the loader's
    position and the step. :attr:`checkpoint` is the entry ``save_checkpoint``/``load_checkpoint`` take, keyed by
    the rank (``rank<r>``), so ranks holding other shards of a tensor of the same name (TP slices, ZeRO shards)
    never collide, DCP writes each rank's own, and a rank's load checks only its own keys."""

    def __init__(self, stage: torch.nn.Module, optimizer, loader: ResumableTokenLoader, rank: int, step: int = 0):
        self.stage, self.optimizer, self.loader, self.rank, self.step = stage, optimizer, loader, rank, step

    @property
    def checkpoint(self) -> dict:
        return {f"rank{self.rank}": self}

    def _inner(self) -> torch.optim.Optimizer:
        return getattr(self.optimizer, "optim", None) or self.optimizer  # ShardedOptimizer wraps a torch optimizer

    def state_dict(self) -> dict:
        return {"model": self.stage.state_dict(), "optim": _adam_state(self._inner()), "data": self.loader.state_dict(),
                "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        mine = state
        with torch.no_grad():
            for name, tensor in self.stage.state_dict().items():
                tensor.copy_(mine["model"][name])
            for key, saved in mine["optim"].items():
                for field, value in _adam_state(self._inner())[key].items():
                    value.copy_(saved[field])
        self.loader.load_state_dict(mine["data"])
        self.step = int(mine["step"])


def resume_from_latest(ckpt_dir: str, state: GridTrainState) -> int:
    """Load the newest *committed* checkpoint into ``state`` and return the step to run next (0: none yet).

    ``step_k`` holds the state after ``k`` updates, so ``k`` is the next step's index. Partial checkpoints (a
    rank died while writing) are never candidates (:func:`~distlab.fault_tolerance.checkpoint.latest_checkpoint`)."""
    latest = latest_checkpoint(ckpt_dir)
    if latest is None:
        return 0
    load_checkpoint(state.checkpoint, latest)
    return state.step


def _group_sum(value: torch.Tensor, groups, grid: Grid, axes) -> None:
    for axis in axes:
        if getattr(grid, axis) > 1:
            dist.all_reduce(value, group=groups.groups[axis])


def clip_global_norm(gradients: list[tuple[torch.Tensor, torch.Tensor | float]], groups, grid: Grid, axes,
                     max_norm: float = CLIP) -> float:
    """Scale this rank's pieces of the gradient so the norm of the whole model's gradient is at most ``max_norm``;
    return that norm before clipping.

    ``gradients`` pairs each piece with the weight of its squares: 1, or ``1/tp`` for a tensor TP replicates
    (LayerNorms, biases after a row-parallel matmul, the position embedding), so the sum over the TP group counts
    it once (a tensor of weights where one flat ZeRO shard mixes both kinds, 0 on padding). The sum over ``axes``
    (the groups whose ranks hold *different* pieces) is the squared global norm. The scale is
    ``torch.nn.utils.clip_grad_norm_``'s, ``max_norm / (norm + 1e-6)`` capped at 1, so one process clipping the
    whole gradient takes the same step.
    """
    squares = torch.zeros((), dtype=torch.float64, device=device())
    for grad, weight in gradients:
        squares += (grad.double().pow(2) * weight).sum()
    _group_sum(squares, groups, grid, axes)
    norm = math.sqrt(squares.item())
    scale = min(1.0, max_norm / (norm + 1e-6))
    if scale < 1.0:
        for grad, _ in gradients:
            grad.mul_(scale)
    return norm


def _tp_weight(name: str, tp: int) -> float:
    return 1.0 / tp if is_replicated(name) else 1.0


def _shard_weights(optimizer: ShardedOptimizer, names: dict[int, str], tp: int, d: int) -> list[torch.Tensor]:
    """Per flat buffer, the weight of each element of this rank's ZeRO shard in the squared norm (:func:`_tp_weight`,
    0 on padding): fixed for the run, so built once rather than every step."""
    return [flat.layout.shard(flat.layout.flatten([torch.full_like(p, _tp_weight(names[id(p)], tp),
                                                                   dtype=torch.float64) for p in flat.params],
                                                  dtype=torch.float64), d)
            for flat in optimizer.flat_params]


def _sharded_gradients(optimizer: ShardedOptimizer, weights: list[torch.Tensor]
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """ZeRO-1's reduce-scatter, done before the update so the shards can be clipped: this rank's shard of each flat
    buffer's DP-averaged gradient, set as its optimizer parameter's gradient, with the weight of each element."""
    out = []
    for flat, weight in zip(optimizer.flat_params, weights):
        shard = optimizer.gradient_shard(flat)
        flat.optimizer_param().grad = shard
        out.append((shard, weight))
    return out


def _float8_stage(stage: StageModule) -> list[str]:
    """Lab 09's :func:`~distlab.fp8.convert_to_float8` on a ``tp == 1`` stage; the names of the layers swapped.

    The stage's linears are lab 05's :class:`~distlab.tensor_parallel.ColumnParallelLinear` and
    :class:`~distlab.tensor_parallel.RowParallelLinear`, not ``nn.Linear``: their matmul is an ``F.linear``
    between the TP collectives, so the swap would find nothing. With one TP rank those collectives are identities
    and each layer *is* an ``nn.Linear``: it is replaced by one holding the same parameters (same names, so
    checkpoints and the optimizer are unchanged), which lab 09's swap then turns into a
    :class:`~distlab.fp8.Float8Linear` — except the output head, which lab 09 keeps out of FP8."""
    for module in list(stage.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, (ColumnParallelLinear, RowParallelLinear)):
                linear = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
                linear.weight, linear.bias = child.weight, child.bias
                setattr(module, name, linear)
    return convert_to_float8(stage)


def _fp8_ran(stage: nn.Module, dev: torch.device) -> str:
    """``"fp8 (native)"`` when every FP8 matmul ran on FP8 tensor cores, else ``"fp8 (emulated)"``: a CPU has no
    FP8 units (its ``torch._scaled_mm`` converts to a wider type first), nor a GPU below compute capability 8.9, and a
    layer whose shape cuBLASLt refuses noted that it was emulated (:func:`~distlab.fp8.fp8_matmul`)."""
    emulated = any(m.notes for m in stage.modules() if isinstance(m, Float8Linear))
    native = dev.type == "cuda" and scaled_mm_support(dev).tensorwise and not emulated
    return f"fp8 ({'native' if native else 'emulated'})"


def capstone_worker(ckpt_dir: str, *, attempt: int = 0, fault: Fault | None = None, cfg: GPTConfig, dp: int,
                    pp: int, tp: int, m: int, batch_size: int, steps: int, train_path: str,
                    mapping: np.ndarray | None = None, lr: float = 3e-3, warmup: int = 5, save_every: int = 10,
                    async_save: bool = True, zero: int = 1, seed: int = 0,
                    resume: Callable[[str, GridTrainState], int] = resume_from_latest,
                    on_step: Callable | None = None, precision: str = "fp32", progress: bool = True) -> dict:
    """Train ``GPT(cfg, seed)`` on a ``dp × pp × tp`` grid for ``steps`` updates over ``train_path``'s tokens,
    resuming with ``resume(ckpt_dir, state)`` and checkpointing every ``save_every`` steps into ``ckpt_dir``.

    The signature is lab 12's resumable job's (:func:`~distlab.fault_tolerance.run_with_restarts` passes
    ``attempt`` and ``fault``). Rank 0 appends each step (loss, learning rate, gradient norm, tokens seen) to
    ``ckpt_dir/metrics.jsonl``. Every step runs inside a ``step<k>`` span, so
    :func:`~distlab.pipeline_parallel.trace_bubble` reads its bubble off the run's trace. Returns this rank's
    ``rank``, ``coords``, ``start`` (the step it resumed at), per step ``losses`` (the global batch's mean loss,
    on every rank), ``step_times``, ``bytes`` (payload sent along each axis) and ``norms``, the ``state`` of its
    shards, and ``memory``: the bytes of its weights, gradients and optimizer state. ``on_step(step, loss,
    seconds)`` is called on every rank after every step. ``progress``: a bar of the steps (rate, ETA) where a person
    watches — one for the job, drawn by the launcher (:mod:`distlab.runtime.progress`), none under nbval or CI;
    ``False`` for none (a benchmark's timed runs; :func:`train`, when rank 0 prints a line per step).

    ``precision``: ``"fp32"``; ``"bf16"``, the forward and backward under ``torch.autocast`` in bfloat16 (weights,
    gradients, Adam and every reduction stay fp32: gloo has no bf16 reduction for every op, and the stages still
    exchange fp32 activations); or ``"auto"``, bf16 where the rank's device computes it natively (a GPU of
    compute capability 8.0+; a T4 has fp16 only, a CPU emulates it slowly) and fp32 elsewhere; or ``"fp8"``,
    lab 09's :class:`~distlab.fp8.Float8Linear` in place of every linear of the stage's blocks (E4M3 operands
    forward, E5M2 gradients, a fresh per-tensor scale each; the output head and everything else in fp32, with the
    same fp32 weights, gradients, Adam and reductions), run by ``torch._scaled_mm`` on FP8 tensor cores (compute
    capability 8.9+) and emulated elsewhere (a T4 or an A100 dequantise and multiply in fp32; a CPU's
    ``torch._scaled_mm`` does the same inside) — :func:`~distlab.fp8.fp8_matmul`'s ``path="auto"``. ``"fp8"``
    needs ``tp == 1``: the TP layers multiply with ``F.linear`` between their collectives, where lab 09's module
    swap cannot reach (:func:`_float8_stage`). ``precision`` in the result says what ran (``"fp8 (emulated)"``,
    ``"fp8 (native)"``), and ``fp8_layers`` names the layers converted.
    """
    if precision not in ("fp32", "bf16", "auto", "fp8"):
        raise ValueError(f"precision={precision!r}: choose 'fp32', 'bf16', 'fp8' or 'auto'")
    if precision == "fp8" and tp > 1:
        raise ValueError(f"precision='fp8' needs tp=1, got tp={tp}: the tensor-parallel layers multiply with F.linear "
                         f"between their collectives, which lab 09's Float8Linear swap does not reach")
    grid = Grid(dp, pp, tp)
    world, rank = dist.get_world_size(), dist.get_rank()
    check_3d_setup(cfg, grid, m, batch_size, world, zero=zero)
    if save_every < 1:
        raise ValueError(f"save_every={save_every} must be at least 1 step")
    dev = device()
    has_bf16 = native_bf16(dev)
    if precision == "bf16" and dev.type == "cuda" and not has_bf16:
        raise ValueError(f"precision='bf16' on {torch.cuda.get_device_name(dev)}, which has no bf16: use 'auto' "
                         f"(fp32 there) or 'fp32'")
    precision = ("bf16" if has_bf16 else "fp32") if precision == "auto" else precision
    keep_freed_memory()
    groups = process_groups(grid)
    d, s = groups.coords["dp"], groups.coords["pp"]
    stage = StageModule(TensorParallelGPT(GPT(cfg, seed=seed).to(dev), groups.tp), even_partition(cfg.n_layer, pp)[s],
                        s == 0, s == pp - 1)
    fp8_layers = _float8_stage(stage) if precision == "fp8" else []
    named = list(stage.named_parameters())
    params = [p for _, p in named]
    if zero:
        optimizer = ShardedOptimizer(params, _adamw(lr), shard=Axis(groups.dp if dp > 1 else None, dp, d))
    else:
        optimizer = _adamw(lr)(params)
    loader = ResumableTokenLoader(train_path, cfg.seq_len, batch_size, d, dp, mapping)
    state = GridTrainState(stage, optimizer, loader, rank)
    start = resume(ckpt_dir, state)
    actions = make_schedule("1f1b", pp, m)[s]
    log = MetricsLog(Path(ckpt_dir) / "metrics.jsonl")
    names = {id(p): name for name, p in named}

    def loss_fn(local_logits, targets):
        return vocab_parallel_cross_entropy(local_logits, targets, groups.tp)

    shard_weights = _shard_weights(optimizer, names, tp, d) if zero else None
    out = {"rank": rank, "coords": groups.coords, "start": start, "losses": {}, "step_times": {}, "bytes": {},
           "norms": {}, "precision": precision, "fp8_layers": fp8_layers}
    pending, grad_bytes = None, 0
    for step in progress_bar(range(start, steps), initial=start, desc="capstone steps", unit="step",
                             disable=not progress):
        if fault is not None:
            fault.maybe_kill(rank, step)
        with span(f"step{step}", kind="other"):
            started = time.perf_counter()
            x, y = loader.next_batch()
            micro = list(zip(x.to(dev).chunk(m), y.to(dev).chunk(m)))
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, lr, warmup, steps)
            before = comm.snapshot()
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                stats = run_schedule(actions, {s: stage}, micro, loss_fn=loss_fn, p=pp, num_stages=pp,
                                     chan=groups.pipe)
            traffic = comm.since(before)
            grad_bytes = max(grad_bytes, sum(p.grad.numel() * p.grad.element_size() for p in params
                                             if p.grad is not None))  # held from backward to the update
            sent = {"tp": traffic.total("payload_bytes", "all_reduce"),
                    "pp": traffic.total("payload_bytes", ("isend", "send"))}
            before = comm.snapshot()
            if zero:
                shards = _sharded_gradients(optimizer, shard_weights)
                norm = clip_global_norm(shards, groups, grid, ("dp", "pp", "tp"))
                optimizer.optim.step()
                for flat in optimizer.flat_params:
                    optimizer.publish(flat)
            else:
                if dp > 1:
                    allreduce_buckets([params], groups.dp)
                norm = clip_global_norm([(p.grad, _tp_weight(names[id(p)], tp)) for p in params], groups, grid,
                                        ("pp", "tp"))
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sent["dp"] = comm.since(before).total("payload_bytes", ("all_reduce", "reduce_scatter", "all_gather"))
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            seconds = time.perf_counter() - started
        mine = stats.losses and groups.coords["tp"] == 0  # the replicas' last stages (one TP rank each) hold a loss
        total = torch.tensor([statistics.fmean(stats.losses.values()) if mine else 0.0, float(bool(mine))],
                             dtype=torch.float64, device=dev)
        dist.all_reduce(total)
        loss = (total[0] / total[1]).item()
        out["losses"][step], out["step_times"][step], out["bytes"][step], out["norms"][step] = loss, seconds, sent, norm
        if on_step is not None:
            on_step(step, loss, seconds)
        if rank == 0:
            log.append(attempt=attempt, step=step, loss=loss, lr=lr_at(step, lr, warmup, steps), grad_norm=norm,
                       tokens=loader.tokens_seen, seconds=seconds)
        state.step = step + 1
        if (step + 1) % save_every == 0:
            if async_save:
                pending = async_save_checkpoint(state.checkpoint, ckpt_dir, step + 1, previous=pending)
            else:
                save_checkpoint(state.checkpoint, ckpt_dir, step + 1, fault=fault)
    if pending is not None:
        pending.wait()
    if precision == "fp8":
        out["precision"] = _fp8_ran(stage, dev)
    inner = optimizer.optim if zero else optimizer
    out["memory"] = {"params": sum(p.numel() * p.element_size() for p in params),
                     "grads": grad_bytes,
                     "optimizer": sum(t.numel() * t.element_size() for st in inner.state.values()
                                      for k, t in st.items() if k != "step")}
    out["state"] = {name: t.detach().to("cpu", copy=True) for name, t in stage.state_dict().items()}
    return out


def replica_losses(results) -> dict[int, float]:
    """The global batch's loss per step (every rank returns the same; rank 0's)."""
    return dict(next(r for r in results if r["rank"] == 0)["losses"])


def dense_state(results, cfg: GPTConfig, tp: int) -> dict[str, torch.Tensor]:
    """The whole model's weights from every rank's shards: each TP slice put back where
    :func:`~distlab.tensor_parallel.shard_of` took it from (it is applied to the tensor of positions, so the
    inverse never restates which dimension each layer splits)."""
    dense = {name: torch.empty_like(t) for name, t in GPT(cfg).state_dict().items()}
    for r in results:
        for name, shard in r["state"].items():
            where = shard_of(name, torch.arange(dense[name].numel()).view_as(dense[name]), cfg, tp, r["coords"]["tp"])
            dense[name].view(-1)[where.reshape(-1)] = shard.reshape(-1).to(dense[name].dtype)
    return dense


def checkpoint_weights(path, cfg: GPTConfig, grid: Grid) -> dict[str, torch.Tensor]:
    """The whole model's weights in a checkpoint the grid saved, read in this process
    (:func:`~distlab.fault_tolerance.read_checkpoint`) and put together by :func:`dense_state`."""
    flat = read_checkpoint(path)
    shards = []
    for r in range(grid.world):
        prefix = f"rank{r}.model."
        shards.append({"coords": grid.coords(r),
                       "state": {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)}})
    return dense_state(shards, cfg, grid.tp)


@torch.no_grad()
def evaluate(cfg: GPTConfig, state: dict[str, torch.Tensor], tokens: torch.Tensor, batch: int = 32) -> float:
    """Mean cross-entropy (nats per token) of ``GPT(cfg)`` with ``state`` over every whole window of ``tokens``."""
    model = GPT(cfg)
    model.load_state_dict(state)
    model.eval()
    windows = (len(tokens) - 1) // cfg.seq_len
    if windows < 1:
        raise ValueError(f"{len(tokens)} validation tokens make no window of {cfg.seq_len} + 1")
    rows = torch.stack([tokens[k * cfg.seq_len:(k + 1) * cfg.seq_len + 1] for k in range(windows)])
    total = 0.0
    for chunk in rows.split(batch):
        _, loss = model(chunk[:, :-1], chunk[:, 1:])
        total += loss.item() * len(chunk)
    return total / windows


def reference_losses(cfg: GPTConfig, train_path: str, batch_size: int, steps: int, mapping=None, lr: float = 3e-3,
                     warmup: int = 5, seed: int = 0) -> list[float]:
    """One process training ``GPT(cfg, seed)`` on the same global batches with ``torch.optim.AdamW`` and
    ``clip_grad_norm_``: what the grid must reproduce (to rounding: its sums run in another order)."""
    model = GPT(cfg, seed=seed)
    optimizer = _adamw(lr)(model.parameters())
    loader = ResumableTokenLoader(train_path, cfg.seq_len, batch_size, mapping=mapping)
    losses = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, lr, warmup, steps)
        x, y = loader.next_batch()
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def train(train_path: str, ckpt_dir: str = "checkpoints", dp: int = 2, pp: int = 2, tp: int = 1,
          microbatches: int = 4, steps: int = 40, batch_size: int = 8, seq_len: int = 64, n_layer: int = 4,
          d_model: int = 64, n_head: int = 4, lr: float = 3e-3, warmup: int = 5, save_every: int = 10,
          zero: int = 1, compact: bool = True, seed: int = 0, kill_rank: int = -1, kill_step: int = -1,
          log_every: int = 0, peak: float | str = "measured") -> dict:
    """The capstone under torchrun, whose agent restarts the group after a rank dies::

        torchrun --nproc-per-node=4 --max-restarts=3 -m distlab.torchrun distlab.capstone:train \\
            train_path=/shared/split/train.bin ckpt_dir=/shared/ckpt dp=2 pp=2 steps=2000

    ``train_path``: a uint16 token shard (``distlab.data.loader.split_documents``'s ``train.bin``, or any of lab
    10's shards) every node can read; ``ckpt_dir`` a directory every node sees. ``compact=True`` renumbers the
    tokens the shard uses (every rank computes the same mapping from the same file); ``compact=False`` keeps GPT-2's
    vocabulary, padded to 50,304. Every attempt (torchrun's ``TORCHELASTIC_RESTART_COUNT``) resumes from the newest
    committed checkpoint; ``kill_rank``/``kill_step`` SIGKILL that rank at that step of the first attempt.
    ``log_every=k`` (torchrun's default is 1): rank 0 prints every k-th step (loss, tokens/s, MFU against ``peak``);
    ``log_every=0``: no step lines, a progress bar of the steps on rank 0's terminal instead.
    Each rank returns one short line's worth (torchrun prints every rank's): the attempt, the step it resumed at,
    how many steps it trained and its last loss — the curve is rank 0's step lines and ``ckpt_dir/metrics.jsonl``.
    """
    stream = np.fromfile(train_path, dtype=np.uint16).astype(np.int64)
    mapping, vocab = compact_vocabulary(stream) if compact else (None, 50304)
    cfg = GPTConfig(vocab_size=vocab, seq_len=int(seq_len), n_layer=int(n_layer), n_head=int(n_head),
                    d_model=int(d_model), tied_embeddings=False)
    world = dist.get_world_size()
    if int(kill_step) >= 0 and not 0 <= int(kill_rank) < world:
        raise ValueError(f"kill_rank={kill_rank} is not one of the {world} ranks")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    fault = Fault(int(kill_rank), int(kill_step)) if int(kill_step) >= 0 and attempt == 0 else None
    report = step_report(f"capstone dp{dp}·pp{pp}·tp{tp}", cfg, int(steps), int(batch_size) * cfg.seq_len,
                         log_every, peak)
    out = capstone_worker(ckpt_dir, attempt=attempt, fault=fault, cfg=cfg, dp=int(dp), pp=int(pp), tp=int(tp),
                          m=int(microbatches), batch_size=int(batch_size), steps=int(steps), train_path=train_path,
                          mapping=mapping, lr=float(lr), warmup=int(warmup), save_every=int(save_every),
                          zero=int(zero), seed=int(seed), on_step=report.step if report else None,
                          progress=report is None)
    trained = sorted(out["losses"])
    result = {"rank": out["rank"], "attempt": attempt, "start": out["start"], "steps": len(trained),
              "loss": round(out["losses"][trained[-1]], 4) if trained else None}
    if report:
        result["mfu"] = report.finish()["mfu"]
    return result
