"""Training cases several checkers share: a small GPT trained for a few SGD steps on ranks, every rank's weights
compared after every step with the single-process run on the whole batch.

Lab 03's DDP checkers built this; lab 04's ZeRO and FSDP checkers grade the same way (their :class:`Case` adds a
wrap unit), and lab 06's pipeline checker reads a wrong update the same way (:func:`update_factor`). It lives
here, not in one lab's checker, so that editing one lab's checks changes no other lab's grading.

On a mismatch :func:`compare_with_reference` names the parameter, the step and the rank, and, since one plain
SGD step moves a weight by ``-lr·grad``, the factor between the student's update and the reference's, with the
usual cause ("summed but not divided by world size?", :func:`describe_factor`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from distlab.grading.contract import CheckFailed
from distlab.grading.harness import WEIGHT_ATOL, max_difference
from distlab.model import GPTConfig
from distlab.workload import reference_run

__all__ = ["STEPS", "Case", "describe_factor", "update_factor", "compare_with_reference"]

STEPS = 3  # SGD steps a case trains unless it says otherwise


@dataclass
class Case:
    """One hidden case: the ranks, the model and its seeds, the batch split and the SGD steps it trains."""

    world_size: int
    seed: int
    data_seed: int
    cfg: GPTConfig
    model: str = "gpt"  # "gpt" or "edge" (frozen, unused and sometimes-unused parameters)
    rows: int = 2  # rows per rank and micro-step
    accum: int = 1
    bucket_cap_bytes: int = 25 * 2**20
    lr: float = 0.1
    steps: int = STEPS
    extra: dict = field(default_factory=dict)

    @property
    def batch(self) -> int:
        return self.world_size * self.accum * self.rows

    def __str__(self) -> str:
        what = {"gpt": "GPT" + (" (tied embeddings)" if self.cfg.tied_embeddings else ""),
                "edge": "GPT with frozen/unused parameters"}[self.model]
        bits = [f"world_size={self.world_size}", what]
        if self.accum > 1:
            bits.append(f"{self.accum} micro-steps")
        return ", ".join(bits)


def describe_factor(factor: float, world_size: int, accum: int = 1) -> str:
    """Name the usual mistake behind a scaled update ('' when the factor is no telltale one)."""
    def near(x: float, target: float) -> bool:
        return abs(x - target) <= 0.02 * max(abs(target), 1e-3)

    hints = []
    if world_size > 1:
        hints += [(world_size, "gradients summed but not divided by world size?"),
                  (1 / world_size, "gradients divided by world size twice (or divided without summing)?"),
                  (world_size**2, "gradients multiplied by the world size instead of divided by it?")]
        hints += [(world_size / k, f"gradients divided by {k}, not by the world size ({world_size})?")
                  for k in range(2, 9) if k != world_size and world_size / k not in (1.0, accum)]
    if accum > 1:
        hints += [(accum, f"gradients of the {accum} micro-steps summed, but the loss not divided by {accum}?"),
                  (world_size * accum, f"summed over ranks and micro-steps: divide by world size and by {accum}"),
                  (1 / accum, f"loss divided by {accum} twice?"),
                  (accum**2, f"loss multiplied by {accum} instead of divided by it?")]
    hints += [(0.0, "the parameter was not updated: its gradient was lost (not written back to p.grad, or zeroed)?"),
              (-1.0, "the update has the wrong sign?")]
    return " Or ".join(hint[0].upper() + hint[1:] if i else hint
                       for i, hint in enumerate(h for target, h in hints if near(factor, target)))


def update_factor(got: torch.Tensor, ref: torch.Tensor, before: torch.Tensor) -> float | None:
    """``got - before ≈ factor·(ref - before)``: the factor, when the update is a clean multiple."""
    d_got = (got.double() - before.double()).flatten()
    d_ref = (ref.double() - before.double()).flatten()
    denom = float(d_ref @ d_ref)
    if denom == 0.0:
        return None
    factor = float(d_got @ d_ref) / denom
    residual = float((d_got - factor * d_ref).norm()) / math.sqrt(denom)
    return factor if residual < 1e-2 else None


def _worst(a: dict, b: dict) -> tuple[str, float]:
    """The entry of two state dicts that differs most, and by how much."""
    return max(((name, max_difference(a[name], b[name])[0]) for name in a), key=lambda item: item[1],
               default=("", -1.0))


def compare_with_reference(run, case: Case, reference: dict | None = None) -> dict:
    """Raise :class:`CheckFailed` unless every rank's weights match the single-process run after
    every step (1e-6); the message names rank, step, parameter and the factor of its update."""
    ref = reference or reference_run(case.cfg, steps=case.steps, batch_size=case.batch, seed=case.seed,
                                     data_seed=case.data_seed, optimizer="sgd", lr=case.lr, model=case.model,
                                     keep_states=True)
    names = list(ref["initial"])
    for rank, out in enumerate(run):
        if not isinstance(out, dict) or set(out.get("initial", {})) != set(names):
            raise CheckFailed(f"{case}: rank {rank} returned an unexpected state_dict")
        name, diff = _worst(out["initial"], ref["initial"])
        if diff > 0:
            frozen = " (requires_grad=False)" if _is_frozen(case, name) else ""
            raise CheckFailed(
                f"{case}: before training, rank {rank}'s {name}{frozen} differs from rank 0's initial weights "
                f"by up to {diff:.3g}: broadcast every parameter (frozen ones too) from rank 0")
    for step in range(case.steps):
        for rank, out in enumerate(run):
            got = out["states"][step]
            name, diff = _worst(got, ref["states"][step])
            if diff <= WEIGHT_ATOL:
                continue
            before = ref["states"][step - 1] if step else ref["initial"]
            factor = update_factor(got[name], ref["states"][step][name], before[name])
            if factor is not None:
                hint = describe_factor(factor, case.world_size, case.accum)
                how = f"by a factor of {factor:.2f}" + (f": {hint}" if hint else "")
            elif diff > 1e6 * max(1.0, ref["states"][step][name].abs().max().item()):  # inf and NaN too
                how = (f"by up to {diff:.3g}, far beyond any update: look for a gradient read from memory nothing "
                       f"wrote (a torch.empty buffer its collective never filled) or a division by zero")
            else:
                how = f"by up to {diff:.3g} (not a simple scaling of the update)"
            other = ""
            if rank == 0 and case.world_size > 1:
                r1_name, r1_diff = _worst(run[1]["states"][step], got)
                if r1_diff > WEIGHT_ATOL:
                    other = f"; the ranks also disagree with each other (rank 1's {r1_name} by {r1_diff:.3g})"
            raise CheckFailed(f"{case}: after step {step + 1}, rank {rank}'s {name} differs from the reference "
                              f"{how}{other}")
    return ref


def _is_frozen(case: Case, name: str) -> bool:
    return case.model == "edge" and name.endswith("pos_emb.weight")
