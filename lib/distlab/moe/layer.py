"""The MoE layer: experts, the single-device forward, and expert parallelism with all-to-all.

:func:`moe_forward` runs the whole layer on one device and is the reference;
:func:`expert_parallel_forward` runs the routed part with this rank's experts only,
moving tokens with two uneven all-to-alls (:func:`all_to_all`, differentiable) after an
all-to-all of split sizes (:func:`exchange_counts`). Both sort the kept assignments the
same way (:func:`dispatch_plan`), so rank r's output equals :func:`moe_forward` on its tokens.
:class:`MoELayer` wraps either behind an ``nn.Module`` that replaces a transformer block's MLP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.model import MLP, GPTConfig, _mix
from distlab.moe.routing import Routing, assign_capacity, expert_capacity, load_balancing_loss, route, router_z_loss
from distlab.runtime.timeline import span

__all__ = ["make_experts", "DispatchPlan", "dispatch_plan", "run_experts", "combine", "MoEResult", "moe_forward",
           "check_expert_parallel", "local_expert_ids", "all_to_all", "exchange_counts", "expert_parallel_forward",
           "MoEConfig", "MoELayer"]


# ---------------------------------------------------------------- experts on one device

def make_experts(d_model: int, expert_ratio: int, ids: Sequence[int], seed: int = 0, std: float = 0.02,
                 bias: bool = True, device=None) -> nn.ModuleList:
    """The experts ``ids`` (each a :class:`distlab.model.MLP`), weights drawn from (seed, id).

    Expert i has the same weights whichever rank builds it, so a rank holding experts 4..7
    equals the single-device model's experts 4..7 with no broadcast.
    """
    cfg = GPTConfig(d_model=d_model, n_head=1, mlp_ratio=expert_ratio, bias=bias)
    experts = nn.ModuleList(MLP(cfg, device="meta") for _ in ids).to_empty(device="cpu")
    with torch.no_grad():
        for expert, i in zip(experts, ids):
            generator = torch.Generator().manual_seed(_mix(seed, i, 0xE4))
            for name, p in expert.named_parameters():
                if name.endswith("weight"):
                    p.copy_(torch.randn(p.shape, generator=generator) * std)
                else:
                    p.zero_()
    return experts.to(device) if device is not None else experts


@dataclass
class DispatchPlan:
    """The kept assignments sorted by expert: row ``token[j]``'s choice ``choice[j]`` goes to
    the expert whose block of ``counts`` contains j. Stable order: within an expert, token order."""

    token: torch.Tensor
    choice: torch.Tensor
    counts: torch.Tensor  # [E] assignments per expert

    def gates(self, routing: Routing) -> torch.Tensor:
        return routing.gates[self.token, self.choice].unsqueeze(-1)


def dispatch_plan(routing: Routing, keep: torch.Tensor) -> DispatchPlan:
    token, choice = keep.nonzero(as_tuple=True)
    expert = routing.experts[token, choice]
    order = torch.argsort(expert, stable=True)
    counts = torch.bincount(expert, minlength=routing.num_experts)
    return DispatchPlan(token[order], choice[order], counts)


def run_experts(experts: Sequence[nn.Module], tokens: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """``tokens`` grouped by expert (``counts[i]`` rows for ``experts[i]``) → their outputs, same order."""
    chunks = tokens.split(list(counts))
    return torch.cat([expert(chunk) for expert, chunk in zip(experts, chunks)])


def combine(x: torch.Tensor, plan: DispatchPlan, outputs: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Σ over a token's kept choices of gate · expert output; a token with none gets zeros."""
    weighted = outputs * plan.gates(routing).to(outputs.dtype)
    return torch.zeros_like(x).index_add(0, plan.token, weighted)


@dataclass
class MoEResult:
    """What one MoE forward decided, for losses, balancing and the lab's plots."""

    routing: Routing
    keep: torch.Tensor  # [T, k] assignment kept (within capacity)
    capacity: int | None

    @property
    def load(self) -> torch.Tensor:
        """Assignments chosen per expert, before the capacity limit: what balancing evens out."""
        return torch.bincount(self.routing.experts.reshape(-1), minlength=self.routing.num_experts)

    @property
    def dropped(self) -> int:
        return int((~self.keep).sum())


def moe_forward(x: torch.Tensor, router_weight: torch.Tensor, experts: Sequence[nn.Module], k: int,
                capacity_factor: float | None = None, shared: nn.Module | None = None,
                expert_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, MoEResult]:
    """The MoE layer on one device: ``x`` [T, d] → ``shared(x) + Σ_kept gate · expert(x)``."""
    routing = route(x, router_weight, k, expert_bias)
    capacity = None if capacity_factor is None else expert_capacity(x.shape[0], len(experts), k, capacity_factor)
    keep = assign_capacity(routing.experts, len(experts), capacity)
    plan = dispatch_plan(routing, keep)
    y = combine(x, plan, run_experts(experts, x[plan.token], plan.counts.tolist()), routing)
    if shared is not None:
        y = y + shared(x)
    return y, MoEResult(routing, keep, capacity)


# ---------------------------------------------------------------- expert parallelism

def check_expert_parallel(num_experts: int, world_size: int) -> int:
    """Experts per rank; a one-line ValueError when they cannot be spread evenly."""
    if num_experts % world_size:
        near = sorted({max(world_size, num_experts // world_size * world_size),
                       (num_experts // world_size + 1) * world_size})
        raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel degree {world_size}: "
                         f"every rank must hold the same number of experts (try {' or '.join(map(str, near))})")
    return num_experts // world_size


def local_expert_ids(num_experts: int, rank: int, world_size: int) -> range:
    """Rank r holds the contiguous experts ``r·E/N … (r+1)·E/N - 1``."""
    per_rank = check_expert_parallel(num_experts, world_size)
    return range(rank * per_rank, (rank + 1) * per_rank)


def _all_to_all_raw(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """An all-to-all whose backward is the all-to-all with the splits swapped: the gradient
    of a token goes back to the rank it came from."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _all_to_all_raw(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _all_to_all_raw(grad, input_splits, output_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int],
               group=None) -> torch.Tensor:
    """Rows ``x`` [sum(input_splits), …]: the first ``input_splits[0]`` go to rank 0, the next to
    rank 1, …; returns the rows received, ``output_splits[j]`` from rank j. Differentiable.

    (``torch.distributed.nn.functional.all_to_all_single`` does the same but is deprecated
    from torch 2.13, and its replacement's functional collectives bypass distlab's comm log.)
    """
    return _AllToAll.apply(x, [int(s) for s in output_splits], [int(s) for s in input_splits], group)


def exchange_counts(send_counts: torch.Tensor, group=None) -> torch.Tensor:
    """Tokens per expert this rank sends ([E]) → tokens per (source rank, local expert) it
    receives ([N, E/N]). Every rank takes part, also one with nothing to send."""
    world = dist.get_world_size(group)
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts, group=group)
    return recv.view(world, -1)


def expert_parallel_forward(x: torch.Tensor, routing: Routing, keep: torch.Tensor,
                            local_experts: Sequence[nn.Module], group=None) -> torch.Tensor:
    """The routed part of the MoE layer with this rank's experts only; ``x`` [T, d] are this
    rank's tokens. Returns what :func:`moe_forward` returns without the shared expert."""
    world, num_experts = dist.get_world_size(group), routing.num_experts
    per_rank = check_expert_parallel(num_experts, world)
    if len(local_experts) != per_rank:
        raise ValueError(f"{len(local_experts)} local experts, expected {num_experts} / {world} = {per_rank}")
    plan = dispatch_plan(routing, keep)  # sorted by expert, hence by destination rank
    recv_counts = exchange_counts(plan.counts, group)  # [source rank, local expert]
    input_splits = plan.counts.view(world, per_rank).sum(1).tolist()
    output_splits = recv_counts.sum(1).tolist()
    received = all_to_all(x[plan.token], output_splits, input_splits, group)
    # Received rows: by source rank, each source's block by local expert. Regroup by expert.
    local_expert = torch.repeat_interleave(torch.arange(per_rank, device=x.device).repeat(world),
                                           recv_counts.reshape(-1))
    by_expert = torch.argsort(local_expert, stable=True)
    with span("experts"):
        out = run_experts(local_experts, received[by_expert], recv_counts.sum(0).tolist())
    back = torch.empty_like(out).index_copy(0, by_expert, out)  # undo the regrouping
    returned = all_to_all(back, input_splits, output_splits, group)
    return combine(x, plan, returned, routing)


# ---------------------------------------------------------------- the layer and the model

@dataclass
class MoEConfig:
    """An MoE layer's shape and balancing; ``capacity_factor=None`` drops nothing."""

    num_experts: int = 8
    k: int = 2
    expert_ratio: int = 2  # expert hidden size = expert_ratio · d_model
    capacity_factor: float | None = None
    shared_expert: bool = False
    balancing: str = "none"  # "none" | "aux" (Switch loss + z-loss) | "bias" (DeepSeek-V3)
    aux_coef: float = 1e-2
    z_coef: float = 1e-3
    bias_rate: float = 1e-3
    router_std: float = 0.02  # a larger one starts training with a skewed, confident router

    def __post_init__(self) -> None:
        if self.balancing not in ("none", "aux", "bias"):
            raise ValueError(f"balancing={self.balancing!r}; expected 'none', 'aux' or 'bias'")
        if not 1 <= self.k <= self.num_experts:
            raise ValueError(f"k={self.k} experts per token, but only {self.num_experts} experts")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor={self.capacity_factor!r} must be positive (None: no limit)")


class MoELayer(nn.Module):
    """Router + experts (+ shared expert) in place of a block's MLP; ``[B, T, d] → [B, T, d]``.

    With ``expert_parallel=True`` (inside a process group) this rank builds only its
    ``E/N`` experts and runs :func:`expert_parallel_forward`; router, shared expert and
    ``expert_bias`` are replicated. ``self.result`` keeps the last forward's decisions.
    """

    def __init__(self, d_model: int, moe: MoEConfig, seed: int = 0, expert_parallel: bool = False,
                 std: float = 0.02, bias: bool = True):
        super().__init__()
        self.moe, self.expert_parallel = moe, expert_parallel
        if expert_parallel:
            if not dist.is_initialized():
                raise RuntimeError("expert_parallel=True needs a process group: build the layer inside "
                                   "distlab.launch / distlab.Ranks(n).run, or under torchrun")
            ids = local_expert_ids(moe.num_experts, dist.get_rank(), dist.get_world_size())
        else:
            ids = range(moe.num_experts)
        self.expert_ids = ids
        generator = torch.Generator().manual_seed(_mix(seed, 0x20))
        self.router = nn.Linear(d_model, moe.num_experts, bias=False)
        with torch.no_grad():
            self.router.weight.copy_(torch.randn(self.router.weight.shape, generator=generator) * moe.router_std)
        self.experts = make_experts(d_model, moe.expert_ratio, ids, seed, std, bias)
        self.shared = make_experts(d_model, moe.expert_ratio, [-1], seed, std, bias)[0] if moe.shared_expert else None
        self.register_buffer("expert_bias", torch.zeros(moe.num_experts))
        self.result: MoEResult | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        bias = self.expert_bias if self.moe.balancing == "bias" else None
        if not self.expert_parallel:
            y, self.result = moe_forward(x, self.router.weight, self.experts, self.moe.k, self.moe.capacity_factor,
                                         self.shared, bias)
            return y.view(shape)
        routing = route(x, self.router.weight, self.moe.k, bias)
        capacity = None if self.moe.capacity_factor is None else expert_capacity(
            x.shape[0], self.moe.num_experts, self.moe.k, self.moe.capacity_factor)
        keep = assign_capacity(routing.experts, self.moe.num_experts, capacity)
        y = expert_parallel_forward(x, routing, keep, self.experts)
        if self.shared is not None:
            y = y + self.shared(x)
        self.result = MoEResult(routing, keep, capacity)
        return y.view(shape)

    def balancing_loss(self) -> torch.Tensor:
        """The auxiliary terms of the last forward (0 unless ``balancing='aux'``)."""
        if self.moe.balancing != "aux" or self.result is None:
            return torch.zeros((), device=self.router.weight.device)
        r = self.result.routing
        return (self.moe.aux_coef * load_balancing_loss(r.probs, r.experts, self.moe.num_experts)
                + self.moe.z_coef * router_z_loss(r.logits))
