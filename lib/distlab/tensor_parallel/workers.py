"""Functions that run on every rank (``distlab.launch``, ``Ranks.run`` or torchrun) and report back.

* :func:`tp_step` — one forward and backward of :class:`TensorParallelGPT`: the loss, this
  rank's logits and gradients (to compare with the dense model), the collectives of each
  phase and the activation bytes one block saves.
* :func:`train_worker` — a TP training run: losses and step times.
* :func:`dtensor_step` — our layers and DTensor's ``parallelize_module`` on the same module.
* :func:`train` — the torchrun entry point:
  ``torchrun --nproc-per-node=4 -m distlab.torchrun distlab.tensor_parallel:train steps=20``.

Each takes ``tp`` (the TP degree): with ``tp`` smaller than the world, the ranks form
``world/tp`` TP groups of consecutive ranks that all do the same work.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from distlab.flops import step_report
from distlab.memory import ActivationMeter
from distlab.model import GPT, GPTConfig, synthetic_batch
from distlab.reference import make_optimizer
from distlab.runtime.rank import device, native_bf16
from distlab.runtime.timeline import span
from distlab.tensor_parallel.communication import comm_since, comm_snapshot, tp_group, tp_rank
from distlab.tensor_parallel.gpt import TensorParallelBlock, TensorParallelGPT, check_tp_sizes, is_replicated, shard_of
from distlab.tensor_parallel.layers import TensorParallelAttention, TensorParallelMLP, qkv_rows, shard_range

__all__ = ["tp_step", "train_worker", "choose_precision", "dtensor_step", "train"]


def _device() -> torch.device:
    return device()


def tp_step(cfg: GPTConfig, tp: int, sequence_parallel: bool = False, batch: int = 4, seed: int = 0,
            data_seed: int = 0, step: int = 0) -> dict:
    """One forward + backward of the TP GPT on ``synthetic_batch(cfg, batch, step, data_seed)``.

    Returns the TP rank, the loss, the local logits ``[B, T, V/t]`` and local gradients (CPU),
    the collectives of ``"forward"``, ``"backward"`` and ``"after backward"`` (the sequence-
    parallel gradient all-reduce), and ``block_activation_bytes``: what block 0 saved for backward.
    """
    check_tp_sizes(cfg, tp, sequence_parallel)
    group, dev = tp_group(tp), _device()
    model = TensorParallelGPT(GPT(cfg, seed=seed).to(dev), group, sequence_parallel=sequence_parallel)
    x, y = (t.to(dev) for t in synthetic_batch(cfg, batch, step, seed=data_seed))
    phases = {}
    before = comm_snapshot()
    logits, loss = model(x, y)
    phases["forward"] = comm_since(before)
    before = comm_snapshot()
    loss.backward()
    phases["backward"] = comm_since(before)
    before = comm_snapshot()
    model.sync_sequence_parallel_grads()
    phases["after backward"] = comm_since(before)
    local_seq = cfg.seq_len // tp if sequence_parallel else cfg.seq_len
    block_input = torch.zeros(batch, local_seq, cfg.d_model, device=dev, requires_grad=True)
    with ActivationMeter(model) as meter:
        model.blocks[0](block_input)
    return {"tp_rank": tp_rank(group), "loss": loss.item(), "logits": logits.detach().cpu(),
            "grads": {name: p.grad.detach().cpu() for name, p in model.named_parameters()},
            "collectives": phases, "block_activation_bytes": meter.bytes}


def train_worker(cfg: GPTConfig, tp: int, sequence_parallel: bool = False, steps: int = 20, batch: int = 8,
                 lr: float = 1e-3, seed: int = 0, data_seed: int = 0, warmup: int = 0,
                 first_group_only: bool = False, autocast: torch.dtype | None = None,
                 on_step: Callable | None = None) -> dict | None:
    """Train the TP GPT with AdamW (each rank updates its own slices: Adam is elementwise).

    Returns the losses of every step (equal on every rank of a group) and the step times
    (TP-group barrier to barrier) of the steps after ``warmup``; forward/backward/optimizer
    are timeline spans. ``first_group_only``: only ranks ``0 … tp-1`` train, the others
    return ``None`` at once — to time ``tp`` ranks without more processes than that competing
    for the cores. ``autocast``: a dtype to run forward in on a GPU (fp32 weights and Adam).
    ``on_step(step, loss, seconds)`` is called after every step (a torchrun job's per-step line).
    """
    check_tp_sizes(cfg, tp, sequence_parallel)
    group, dev = tp_group(tp), _device()
    if first_group_only and dist.get_rank() >= tp:
        return None
    model = TensorParallelGPT(GPT(cfg, seed=seed).to(dev), group, sequence_parallel=sequence_parallel)
    opt = make_optimizer(model.parameters(), "adamw", lr=lr)
    losses, times = [], []
    for step in range(warmup + steps):
        x, y = (t.to(dev) for t in synthetic_batch(cfg, batch, step, seed=data_seed))
        dist.barrier(group=group)
        start = time.perf_counter()
        with span("forward"), _autocast(dev, autocast):
            _, loss = model(x, y)
        with span("backward"):
            loss.backward()
            model.sync_sequence_parallel_grads()
        with span("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        dist.barrier(group=group)
        elapsed = time.perf_counter() - start
        if step >= warmup:
            times.append(elapsed)
        if on_step is not None:
            on_step(step, losses[-1], elapsed)
    return {"tp_rank": tp_rank(group), "losses": losses, "step_times": times}


def _autocast(dev: torch.device, dtype: torch.dtype | None):
    return torch.autocast(dev.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def choose_precision(precision: str, dev: torch.device) -> tuple[torch.dtype | None, str]:
    """``"auto"``: bf16 autocast on a GPU that has bf16 (compute capability 8.0+), else fp32; and why."""
    if precision not in ("auto", "bf16", "fp32"):
        raise ValueError(f"precision must be 'auto', 'bf16' or 'fp32', got {precision!r}")
    has_bf16 = native_bf16(dev)
    if precision == "bf16" and not has_bf16:
        raise ValueError("precision='bf16' needs a GPU with bf16 (compute capability 8.0+); on the CPU, gloo "
                         "reduces in fp32: use precision='fp32'")
    if precision == "fp32" or not has_bf16:
        if precision == "fp32":
            why = "as asked"
        elif dev.type != "cuda":
            why = "CPU ranks: gloo reduces in fp32"
        else:
            why = f"{torch.cuda.get_device_name(dev)} has no bf16"
        return None, f"precision: fp32 ({why})"
    return torch.bfloat16, f"precision: bf16 autocast on {torch.cuda.get_device_name(dev)}, fp32 weights and Adam"


def dtensor_step(cfg: GPTConfig, kind: str, tp: int, sequence_parallel: bool = False, batch: int = 2,
                 seed: int = 0) -> dict:
    """Our TP module and DTensor's on the same dense ``kind`` ("mlp", "attention", "block") and input.

    Returns, for ``"ours"`` and ``"dtensor"``: the largest difference from the dense module's
    output, input gradient and parameter gradients, and the collectives of forward and backward.
    """
    from torch.distributed.tensor import DTensor  # noqa: PLC0415  DTensor is heavy and only dtensor_step needs it

    from distlab.tensor_parallel.dtensor import parallelize  # noqa: PLC0415  loads DTensor; only dtensor_step needs it

    if tp != dist.get_world_size():
        raise ValueError(f"dtensor_step runs one TP group over the whole world: tp={tp}, world={dist.get_world_size()}")
    check_tp_sizes(cfg, tp, sequence_parallel)
    dev = _device()
    gpt = GPT(cfg, seed=seed).to(dev)
    dense = {"mlp": gpt.blocks[0].mlp, "attention": gpt.blocks[0].attn, "block": gpt.blocks[0]}[kind]
    generator = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, cfg.seq_len, cfg.d_model, generator=generator).to(dev)
    grad_out = torch.randn(batch, cfg.seq_len, cfg.d_model, generator=generator).to(dev)
    x_dense = x.clone().requires_grad_(True)
    out_dense = dense(x_dense)
    out_dense.backward(grad_out)
    rank = dist.get_rank()
    seq = shard_range(cfg.seq_len, tp, rank, "seq_len") if sequence_parallel else slice(None)
    prefix = {"mlp": "blocks.0.mlp.", "attention": "blocks.0.attn.", "block": "blocks.0."}[kind]
    ours_cls = {"mlp": TensorParallelMLP, "attention": TensorParallelAttention, "block": TensorParallelBlock}[kind]
    mesh = init_device_mesh(dev.type, (tp,))
    report = {}
    for name, module in (("ours", ours_cls(dense, None, sequence_parallel=sequence_parallel)),
                         ("dtensor", parallelize(dense, mesh, kind, sequence_parallel))):
        x_local = x[:, seq].clone().requires_grad_(True)
        before = comm_snapshot()
        out = module(x_local)
        forward = comm_since(before)
        before = comm_snapshot()
        out.backward(grad_out[:, seq])
        backward = comm_since(before)
        worst = {"output": (out - out_dense[:, seq]).abs().max().item(),
                 "input gradient": (x_local.grad - x_dense.grad[:, seq]).abs().max().item()}
        dense_params = dict(dense.named_parameters())
        for pname, p in module.named_parameters():
            full_name, reference = prefix + pname, dense_params[pname].grad
            if isinstance(p.grad, DTensor):  # DTensor: the full gradient, compared with the dense one
                got = p.grad.full_tensor()
                if pname.endswith(("qkv.weight", "qkv.bias")):  # its rows were reordered rank-major
                    got = _undo_rank_major(got, cfg, tp)
            elif is_replicated(full_name):
                got = p.grad.clone()
                if sequence_parallel:  # this rank's tokens only: sum the partial gradients
                    dist.all_reduce(got)
            else:  # ours: this rank's slice
                got, reference = p.grad, shard_of(full_name, reference, cfg, tp, rank)
            worst[pname] = (got - reference).abs().max().item()
        report[name] = {"max_diff": worst, "forward": forward, "backward": backward}
    return report


def _undo_rank_major(rank_major: torch.Tensor, cfg: GPTConfig, tp: int) -> torch.Tensor:
    order = torch.cat([qkv_rows(cfg.d_model, cfg.n_head, tp, r) for r in range(tp)]).to(rank_major.device)
    restored = torch.empty_like(rank_major)
    restored[order] = rank_major
    return restored


def train(steps: int = 20, tp: int | None = None, sequence_parallel: bool = False, batch_size: int = 8,
          n_layer: int = 2, d_model: int = 128, n_head: int = 4, vocab_size: int = 256, seq_len: int = 64,
          lr: float = 1e-3, seed: int = 0, warmup: int = 2, log_every: int = 0, precision: str = "auto",
          peak: float | str = "measured") -> dict:
    """Train the lab's GPT tensor-parallel over all ranks; the entry point for torchrun.

    ``tp`` defaults to the world size (one TP group). Every rank sees the same batch of
    ``batch_size`` sequences. ``precision``: "auto" (bf16 autocast on a bf16 GPU, else fp32),
    "bf16" or "fp32"; rank 0 prints the choice. Returns this rank's summary: first and last
    loss, median step time, tokens/s, and the collectives of one step (calls and payload per kind).
    ``log_every=k`` (torchrun's default is 1): rank 0 prints every k-th step (loss, tokens/s, MFU
    against ``peak``) and a summary.
    """
    world = dist.get_world_size()
    tp = world if tp is None else int(tp)
    if tp != world:
        raise ValueError(f"train runs one tensor-parallel group over all {world} ranks, got tp={tp}: "
                         f"start it with --nproc-per-node={tp}")
    cfg = GPTConfig(vocab_size=int(vocab_size), seq_len=int(seq_len), n_layer=int(n_layer), n_head=int(n_head),
                    d_model=int(d_model))
    check_tp_sizes(cfg, tp, bool(sequence_parallel))
    autocast, said = choose_precision(precision, _device())
    if dist.get_rank() == 0:
        print(said, flush=True)
    report = step_report(f"tp-{tp}", cfg, int(steps) + int(warmup), int(batch_size) * cfg.seq_len, log_every, peak,
                         int(warmup))
    before = comm_snapshot()
    result = train_worker(cfg, tp, bool(sequence_parallel), steps=int(steps), batch=int(batch_size), lr=float(lr),
                          seed=int(seed), warmup=int(warmup), autocast=autocast,
                          on_step=report.step if report else None)
    total = comm_since(before)
    n_steps = int(steps) + int(warmup)
    step_time = statistics.median(result["step_times"]) if result["step_times"] else float("nan")
    return {
        "rank": dist.get_rank(), "tp": tp, "sequence_parallel": bool(sequence_parallel),
        "loss_first": round(result["losses"][0], 4), "loss_last": round(result["losses"][-1], 4),
        "step_time_s": round(step_time, 4), "tokens_per_s": round(int(batch_size) * cfg.seq_len / step_time, 1),
        "collectives_per_step": {kind: (calls // n_steps, payload // n_steps) for kind, (calls, payload) in
                                 sorted(total.items())},
        "losses": result["losses"], **({"mfu": report.finish()["mfu"]} if report else {}),
    }
