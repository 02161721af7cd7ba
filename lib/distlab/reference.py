"""The single-process reference trainer every distributed lab is checked against.

A lab's DDP / ZeRO / TP / PP run must reproduce, step for step, the losses and final
weights of this plain loop on the same global batches. Keeping it tiny and deterministic
(CPU, fixed seed, no data shuffling of its own) is what makes "bit-for-bit" or
"to 1e-6" comparisons meaningful.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from distlab.model import GPT, GPTConfig

__all__ = ["ReferenceRun", "train_reference", "make_optimizer", "max_abs_diff"]


@dataclass
class ReferenceRun:
    """Per-step losses (before each update) and the final weights (detached CPU clones)."""

    losses: list[float] = field(default_factory=list)
    state_dict: dict[str, torch.Tensor] = field(default_factory=dict)


def make_optimizer(params, optimizer: str = "adamw", lr: float = 1e-3, weight_decay: float = 0.0):
    """The optimizer the reference uses; distributed labs build theirs with this too."""
    if optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"optimizer={optimizer!r}; expected 'adamw' or 'sgd'")


def train_reference(
    cfg: GPTConfig,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    lr: float = 1e-3,
    optimizer: str = "adamw",
    seed: int = 0,
    weight_decay: float = 0.0,
) -> ReferenceRun:
    """Train ``GPT(cfg, seed)`` one step per ``(x, y)`` in ``batches`` (each the *global* batch)."""
    model = GPT(cfg, seed=seed)
    opt = make_optimizer(model.parameters(), optimizer, lr=lr, weight_decay=weight_decay)
    run = ReferenceRun()
    for x, y in batches:
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        run.losses.append(loss.item())
    run.state_dict = {name: t.detach().clone() for name, t in model.state_dict().items()}
    return run


def max_abs_diff(state_a: Mapping[str, torch.Tensor], state_b: Mapping[str, torch.Tensor]) -> tuple[str, float]:
    """``(name, value)`` of the entry with the largest absolute difference, so a failing
    check can say *which* parameter differs and by how much. Raises if names or shapes differ."""
    missing = sorted(set(state_a) ^ set(state_b))
    if missing:
        raise KeyError(f"state dicts hold different names: {', '.join(missing[:5])}")
    worst_name, worst = "", 0.0
    for name in state_a:
        a, b = state_a[name], state_b[name]
        if a.shape != b.shape:
            raise ValueError(f"{name}: shape {tuple(a.shape)} vs {tuple(b.shape)}")
        if a.numel() == 0:
            continue
        diff = (a.detach().cpu().double() - b.detach().cpu().double()).abs().max().item()
        if diff > worst or not worst_name:
            worst_name, worst = name, diff
    return worst_name, worst
