"""Routing, capacity and load balancing: the decisions an MoE layer makes before any expert runs.

Everything here is local to one rank's tokens (expert parallelism, in :mod:`distlab.moe.layer`,
only moves the tokens these functions chose): the router's top-k and gates, the capacity rule
that decides which assignments are dropped, and the two ways to keep the experts evenly
loaded, the Switch loss (with the router z-loss) and DeepSeek-V3's selection bias.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from distlab.model import _mix

__all__ = ["Routing", "route", "noisy_route", "skewed_tokens", "expert_capacity", "assign_capacity",
           "load_balancing_loss", "router_z_loss", "update_expert_bias", "imbalance"]


# ---------------------------------------------------------------- routing

@dataclass
class Routing:
    """What the router decided for ``T`` tokens and ``E`` experts."""

    logits: torch.Tensor  # [T, E] router logits
    probs: torch.Tensor  # [T, E] softmax of the logits (fp32)
    experts: torch.Tensor  # [T, k] chosen experts, best first
    gates: torch.Tensor  # [T, k] weight of each choice in the output

    @property
    def k(self) -> int:
        return self.experts.shape[1]

    @property
    def num_experts(self) -> int:
        return self.probs.shape[1]


def route(x: torch.Tensor, weight: torch.Tensor, k: int, bias: torch.Tensor | None = None) -> Routing:
    """Linear → softmax → top-k for ``x`` [T, d] and a router ``weight`` [E, d].

    The softmax runs in fp32 (bf16 logits round the probabilities of close experts to the
    same value). ``bias`` [E] is added to the probabilities for choosing only.
    """
    num_experts = weight.shape[0]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= num_experts:
        raise ValueError(f"k={k!r} experts per token, but the router has {num_experts} experts: "
                         f"need 1 <= k <= {num_experts}")
    logits = x @ weight.t()
    probs = torch.softmax(logits.float(), dim=-1)
    scores = probs if bias is None else probs + bias.to(probs.dtype)
    experts = scores.topk(k, dim=-1).indices
    gates = probs.gather(-1, experts)
    if k > 1:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    return Routing(logits, probs, experts, gates)


def noisy_route(x: torch.Tensor, weight: torch.Tensor, k: int, noise_std: float = 1.0,
                noise_weight: torch.Tensor | None = None, generator: torch.Generator | None = None) -> Routing:
    """Noisy top-k gating (Shazeer et al. 2017), used in training only: Gaussian noise on the router logits
    before the top-k, ``H = x·Wᵀ + ε·σ`` with ``ε ~ N(0, 1)``.

    ``σ`` is ``softplus(x·W_noiseᵀ)`` per token and expert when ``noise_weight`` [E, d] is given (learned, as in
    the paper, whose ``W_noise`` starts at zero: σ = softplus(0) ≈ 0.69), else the constant ``noise_std``.
    Gates as in :func:`route`, from the softmax of the noisy logits (for k > 1 the paper's
    softmax over the k kept logits). The noise spreads tokens only by overriding the router's preference;
    in the paper it also makes the load a smooth function of the router, for its load loss.
    """
    num_experts = weight.shape[0]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= num_experts:
        raise ValueError(f"k={k!r} experts per token, but the router has {num_experts} experts: "
                         f"need 1 <= k <= {num_experts}")
    clean = x @ weight.t()
    std = F.softplus(x @ noise_weight.t()) if noise_weight is not None else noise_std
    noise = torch.randn(clean.shape, generator=generator, dtype=clean.dtype).to(clean.device)
    logits = clean + noise * std
    probs = torch.softmax(logits.float(), dim=-1)
    experts = probs.topk(k, dim=-1).indices
    gates = probs.gather(-1, experts)
    if k > 1:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    return Routing(logits, probs, experts, gates)


def skewed_tokens(tokens: int, d_model: int, num_experts: int, skew: float = 1.0, seed: int = 0,
                  rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x [tokens, d], router weight [E, d])``: hidden states that share a mean direction, as a
    real model's do, and a random router. The experts whose router rows point along that
    direction get more than their share; ``skew=0`` gives isotropic tokens and near-even loads.
    The router depends on ``seed`` only, the tokens on ``(seed, rank)``: one router, each rank its own tokens."""
    g = torch.Generator().manual_seed(_mix(seed, 0x5EED))
    direction = torch.randn(d_model, generator=g)
    weight = torch.randn(num_experts, d_model, generator=g) / math.sqrt(d_model)
    noise = torch.Generator().manual_seed(_mix(seed, rank, 0x70C))
    x = torch.randn(tokens, d_model, generator=noise) + skew * math.sqrt(d_model) * direction / direction.norm()
    return x, weight


# ---------------------------------------------------------------- capacity

def expert_capacity(tokens: int, num_experts: int, k: int, capacity_factor: float) -> int:
    """Assignments one expert may take: ⌈capacity_factor · tokens · k / E⌉ (Switch, GShard)."""
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor={capacity_factor!r} must be positive")
    return math.ceil(capacity_factor * tokens * k / num_experts)


def assign_capacity(experts: torch.Tensor, num_experts: int, capacity: int | None) -> torch.Tensor:
    """Which of the ``[T, k]`` assignments fit: a bool mask, True = kept.

    Slots are handed out choice-major: all first choices in token order, then all second
    choices, … (GShard), so a token's second choice never displaces another's first. With
    ``capacity=None`` every assignment is kept.
    """
    if capacity is None:
        return torch.ones_like(experts, dtype=torch.bool)
    choice_major = experts.t().reshape(-1)
    one_hot = F.one_hot(choice_major, num_experts)
    position = (one_hot.cumsum(0) * one_hot).sum(-1) - 1  # 0-based arrival order at its expert
    return (position < capacity).view(experts.shape[1], experts.shape[0]).t()


# ---------------------------------------------------------------- balancing

def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss, ``E · Σ_i f_i · P_i``.

    ``f_i``: the share of the T·k choices that went to expert i (a count: no gradient).
    ``P_i``: expert i's mean router probability (differentiable). 1.0 when both are uniform;
    E when every token goes, with certainty, to one expert.
    """
    counts = torch.bincount(experts.reshape(-1), minlength=num_experts).to(probs.dtype)
    fraction = counts / experts.numel()
    return num_experts * (fraction * probs.mean(dim=0)).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's z-loss, the mean of ``logsumexp(logits)²``: keeps router logits small so the
    softmax stays out of the range where bf16 rounding flips the choice."""
    return torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


@torch.no_grad()
def update_expert_bias(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's auxiliary-loss-free step: ``b_i + rate · sign(mean load − load_i)``.

    An overloaded expert's bias falls, an underloaded one's rises, by ``rate`` each step;
    the bias only steers selection, so the loss never sees it. Returns the new bias.
    """
    load = load.to(bias.dtype)
    return bias + rate * torch.sign(load.mean() - load)


def imbalance(load) -> float:
    """Busiest expert's load over the mean load: 1.0 is perfect balance, E is total collapse.
    Under expert parallelism the busiest expert sets the layer's time."""
    load = torch.as_tensor(load, dtype=torch.float64)
    return float(load.max(dim=-1).values.mean() / load.mean(dim=-1).mean())
