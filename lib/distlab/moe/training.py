"""A GPT whose MLPs are MoE layers, trained expert-parallel inside data parallelism.

Experts are spread over the ranks; embeddings, attention, routers and shared experts are
replicated and averaged like DDP's gradients. :func:`train_moe` is the loop every rank
runs (inside ``distlab.launch`` or under torchrun), :func:`train_moe_reference` the same
training in one process with every expert, which it must equal.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.data_parallel import allreduce_buckets
from distlab.flops import step_report
from distlab.model import GPT, GPTConfig, _mix
from distlab.moe.layer import MoEConfig, MoELayer
from distlab.moe.routing import imbalance, update_expert_bias
from distlab.reference import make_optimizer
from distlab.runtime import comm
from distlab.runtime.rank import device
from distlab.runtime.timeline import span
from distlab.workload import local_batches

__all__ = ["MoEGPT", "sync_gradients", "global_loads", "train_moe", "merge_expert_states", "train_moe_reference",
           "train"]


class MoEGPT(GPT):
    """The lab's :class:`~distlab.model.GPT` with every block's MLP replaced by a :class:`MoELayer`."""

    def __init__(self, cfg: GPTConfig, moe: MoEConfig, seed: int = 0, expert_parallel: bool = False):
        super().__init__(cfg, seed=seed)
        self.moe = moe
        for i, block in enumerate(self.blocks):
            block.mlp = MoELayer(cfg.d_model, moe, seed=_mix(seed, i), expert_parallel=expert_parallel,
                                 bias=cfg.bias)

    @property
    def moe_layers(self) -> list[MoELayer]:
        return [block.mlp for block in self.blocks]

    def balancing_loss(self) -> torch.Tensor:
        return sum(layer.balancing_loss() for layer in self.moe_layers)

    def expert_parameters(self) -> list[nn.Parameter]:
        return [p for layer in self.moe_layers for p in layer.experts.parameters()]

    def replicated_parameters(self) -> list[nn.Parameter]:
        """Everything but the routed experts: what data parallelism averages."""
        routed = {id(p) for p in self.expert_parameters()}
        return [p for p in self.parameters() if id(p) not in routed]

    def loads(self) -> torch.Tensor:
        """[layers, E] assignments chosen per expert in the last forward (this rank's tokens)."""
        return torch.stack([layer.result.load for layer in self.moe_layers])

    @torch.no_grad()
    def update_bias(self, loads: torch.Tensor) -> None:
        for layer, load in zip(self.moe_layers, loads):
            layer.expert_bias.copy_(update_expert_bias(layer.expert_bias, load, self.moe.bias_rate))


@torch.no_grad()
def sync_gradients(model: MoEGPT) -> None:
    """Expert parallelism inside data parallelism: replicated parameters are averaged over the
    ranks (one bucket); an expert's gradient already sums every rank's tokens (they came to
    it through the all-to-all), so it is only divided by N — the global loss is the ranks' mean."""
    allreduce_buckets([model.replicated_parameters()])
    world = dist.get_world_size()
    for p in model.expert_parameters():
        if p.grad is not None:
            p.grad.div_(world)


def global_loads(model: MoEGPT) -> torch.Tensor:
    """[layers, E] assignments per expert summed over every rank's tokens (one all-reduce)."""
    loads = model.loads()
    dist.all_reduce(loads)
    return loads


def _train_config(cfg: GPTConfig | None, moe: MoEConfig | None, balancing: str | None) -> tuple[GPTConfig, MoEConfig]:
    cfg = cfg or GPTConfig()
    moe = moe or MoEConfig()
    return cfg, dataclasses.replace(moe, balancing=balancing) if balancing is not None else moe


def train_moe(steps: int = 20, balancing: str | None = None, cfg: GPTConfig | None = None, moe: MoEConfig | None = None,
              batch_size: int = 8, optimizer: str = "adamw", lr: float = 3e-3, seed: int = 0, data_seed: int = 0,
              return_state: bool = False, on_step: Callable | None = None) -> dict:
    """Train :class:`MoEGPT` expert-parallel over every rank (inside ``distlab.launch`` or torchrun).

    ``batch_size`` is the global batch; rank r trains on its slice. Per step: forward (two
    all-to-alls per layer), backward (two more), :func:`sync_gradients`, optimizer step,
    then the global expert loads (one small all-reduce) and, with ``balancing='bias'``, the
    bias update they drive. Returns the global mean losses (cross-entropy, before each
    update), the loads per step ``[steps][layers][E]`` and the dropped assignments.
    ``on_step(step, loss, seconds)`` is called after every step (a torchrun job's per-step line).
    """
    steps = int(steps)
    cfg, moe = _train_config(cfg, moe, balancing)
    rank, world, dev = dist.get_rank(), dist.get_world_size(), device()
    model = MoEGPT(cfg, moe, seed=seed, expert_parallel=True).to(dev)
    opt = make_optimizer(model.parameters(), optimizer, lr=lr)
    losses, loads, dropped = [], [], []
    for step in range(steps):
        (x, y), = local_batches(cfg, batch_size, step, rank, world, data_seed=data_seed)
        start = time.perf_counter()
        with span("forward"):
            _, ce = model(x.to(dev), y.to(dev))
            loss = ce + model.balancing_loss()
        opt.zero_grad(set_to_none=True)
        with span("backward"):
            loss.backward()
        sync_gradients(model)
        opt.step()
        step_stats = torch.cat([ce.detach().reshape(1) / world,
                                torch.tensor([sum(layer.result.dropped for layer in model.moe_layers)], device=dev,
                                             dtype=ce.dtype)])
        dist.all_reduce(step_stats)
        load = global_loads(model)
        if moe.balancing == "bias":
            model.update_bias(load)
        losses.append(float(step_stats[0]))
        dropped.append(int(step_stats[1]))
        loads.append(load.cpu().tolist())
        if on_step is not None:
            on_step(step, losses[-1], time.perf_counter() - start)
    out = {"rank": rank, "losses": losses, "loads": loads, "dropped": dropped,
           "assignments_per_step": batch_size * cfg.seq_len * moe.k * cfg.n_layer}
    if return_state:
        out["state"] = {name: t.detach().cpu().clone() for name, t in model.state_dict().items()}
        out["expert_ids"] = [list(layer.expert_ids) for layer in model.moe_layers]
    return out


def merge_expert_states(outputs: Sequence[dict]) -> dict[str, torch.Tensor]:
    """The ranks' ``state`` (from ``train_moe(return_state=True)``) as one single-device state dict:
    rank r's ``experts.j`` is the model's ``experts.{expert_ids[j]}``; replicated tensors from rank 0."""
    merged = {}
    for out in outputs:
        for name, tensor in out["state"].items():
            parts = name.split(".")
            if "experts" in parts:  # blocks.{layer}.mlp.experts.{j}.…
                at = parts.index("experts") + 1
                parts[at] = str(out["expert_ids"][int(parts[1])][int(parts[at])])
                merged[".".join(parts)] = tensor
            elif out is outputs[0]:
                merged[name] = tensor
    return merged


def train_moe_reference(steps: int = 20, balancing: str | None = None, cfg: GPTConfig | None = None,
                        moe: MoEConfig | None = None, batch_size: int = 8, world_size: int = 4,
                        optimizer: str = "adamw", lr: float = 3e-3, seed: int = 0, data_seed: int = 0) -> dict:
    """:func:`train_moe` in one process with every expert: each step runs the ``world_size``
    ranks' slices one after another (capacity is per slice, as on the ranks), averages their
    losses and takes one step. Returns losses, loads and the final ``state`` (all experts)."""
    cfg, moe = _train_config(cfg, moe, balancing)
    model = MoEGPT(cfg, moe, seed=seed, expert_parallel=False)
    opt = make_optimizer(model.parameters(), optimizer, lr=lr)
    losses, loads = [], []
    for step in range(int(steps)):
        total, ce_sum, load = 0.0, 0.0, 0
        for r in range(world_size):
            (x, y), = local_batches(cfg, batch_size, step, r, world_size, data_seed=data_seed)
            _, ce = model(x, y)
            total = total + (ce + model.balancing_loss()) / world_size
            ce_sum += ce.item() / world_size
            load = load + model.loads()
        opt.zero_grad(set_to_none=True)
        total.backward()
        opt.step()
        if moe.balancing == "bias":
            model.update_bias(load)
        losses.append(ce_sum)
        loads.append(load.tolist())
    return {"losses": losses, "loads": loads,
            "state": {name: t.detach().clone() for name, t in model.state_dict().items()}}


def train(steps: int = 20, balancing: str = "bias", num_experts: int = 8, k: int = 2,
          capacity_factor: float | None = 1.25, d_model: int = 64, n_layer: int = 2, n_head: int = 4,
          vocab_size: int = 256, seq_len: int = 64, batch_size: int = 4, lr: float = 3e-3, seed: int = 0,
          log_every: int = 0, peak: float | str = "measured") -> dict:
    """Train the MoE GPT expert-parallel over every rank; the entry point for torchrun::

        torchrun --nproc-per-node=4 -m distlab.torchrun distlab.moe:train steps=50 balancing=aux

    ``batch_size`` is per rank (the global batch is ``batch_size · world_size``). Returns this
    rank's summary: first and last loss, the busiest expert's load over the mean at the last
    step, the share of assignments dropped, and the all-to-all payload per step.
    ``log_every=k`` (torchrun's default is 1): rank 0 prints every k-th step (the global loss, tokens/s,
    MFU of the dense model's FLOPs per token against ``peak``: a top-k MoE does about k experts' worth) and
    a summary.
    """
    world = dist.get_world_size()
    cfg = GPTConfig(vocab_size=int(vocab_size), seq_len=int(seq_len), n_layer=int(n_layer), n_head=int(n_head),
                    d_model=int(d_model))
    moe = MoEConfig(num_experts=int(num_experts), k=int(k), capacity_factor=capacity_factor, balancing=balancing)
    report = step_report(f"moe-{world}", cfg, int(steps), int(batch_size) * world * cfg.seq_len, log_every, peak)
    before = comm.snapshot()
    out = train_moe(int(steps), cfg=cfg, moe=moe, batch_size=int(batch_size) * world, lr=float(lr), seed=int(seed),
                    on_step=report.step if report else None)
    all_to_all = comm.since(before).total("payload_bytes", "all_to_all")
    return {"rank": out["rank"], "world_size": world, "balancing": balancing,
            "loss_first": round(out["losses"][0], 4), "loss_last": round(out["losses"][-1], 4),
            "busiest_over_mean": round(imbalance(out["loads"][-1]), 3),
            "dropped_share": round(sum(out["dropped"]) / (len(out["dropped"]) * out["assignments_per_step"]), 4),
            "all_to_all_bytes_per_step": all_to_all / int(steps), "losses": out["losses"],
            **({"mfu": report.finish()["mfu"]} if report else {})}
