"""Detectors that name the bad rank: replica hashes and gradient norms for SDC, and a hang's odd one out.

Silent data corruption (SDC) is a wrong result with no error: a flipped bit in a
GPU's memory or arithmetic. Data parallelism gives a free witness. Every DP replica
must hold bit-identical weights (DDP averages gradients, so every replica applies the
same update), hence:

* **replica hashes** — each rank fingerprints its parameters' *bits*, the
  fingerprints are all-gathered, and a rank that disagrees with the majority is
  corrupted. Weights are never re-synchronised, so a flipped bit stays visible until
  it is repaired; a float comparison would miss a flip in the last mantissa bit,
  the bits do not.
* **gradient norms** — a replica with a large wrong weight computes a gradient far
  larger than the others' on the same kind of data; all-gather each rank's local
  norm (before averaging) and flag the outlier. A sudden 10x norm with a normal loss
  is a classic SDC signature.

A hang is named from the launcher's :class:`~distlab.runtime.launch.CollectiveTimeout`: the
rank that is not where the others are.
"""

from __future__ import annotations

import statistics
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.runtime.rank import device

__all__ = ["fingerprint", "parameter_fingerprints", "find_divergent_replicas", "local_grad_norm",
           "grad_norm_outliers", "hang_suspects"]

_PRIME = 65_521  # positions are weighted 1..65521, so a swap of two bytes also changes the fingerprint
_CHUNK = 1 << 24  # bytes hashed at a time: the int64 copy stays small for a big tensor


@torch.no_grad()
def fingerprint(tensor: torch.Tensor) -> int:
    """An integer hash of the tensor's bits, computed where the tensor lives (GPU or CPU).

    ``sum(byte_i · (i mod 65521 + 1))`` over its raw bytes in int64: flipping any single
    bit changes one byte by ±2^k and so changes the sum. Cheap enough to run every few
    hundred steps on every replica; no copy to the host.
    """
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    total = torch.zeros((), dtype=torch.int64, device=raw.device)
    for start in range(0, raw.numel(), _CHUNK):
        chunk = raw[start:start + _CHUNK].to(torch.int64)
        weights = torch.arange(start, start + chunk.numel(), device=raw.device) % _PRIME + 1
        total += (chunk * weights).sum()
    return int(total)


def parameter_fingerprints(model: nn.Module) -> torch.Tensor:
    """One fingerprint per parameter, in ``named_parameters`` order (int64)."""
    return torch.tensor([fingerprint(p) for _, p in model.named_parameters()], dtype=torch.int64)


def find_divergent_replicas(model: nn.Module, group=None) -> dict[int, list[str]]:
    """On every DP rank: ``{rank: [parameter names]}`` of replicas whose bits differ from the majority.

    Collective (one all-gather of one int64 per parameter). Needs 3 or more replicas:
    with 2, a mismatch shows that one is corrupted but not which. The majority is the
    most common fingerprint of each parameter (a tie is reported as an error).
    """
    world = dist.get_world_size(group)
    if world < 3:
        raise ValueError(f"a majority needs at least 3 replicas, got {world}: with 2 a mismatch shows corruption "
                         "but not which replica has it")
    names = [name for name, _ in model.named_parameters()]
    mine = parameter_fingerprints(model).to(_comm_device(group))
    gathered = torch.zeros(world * len(names), dtype=torch.int64, device=mine.device)
    dist.all_gather_into_tensor(gathered, mine, group=group)
    gathered = gathered.view(world, len(names)).cpu()
    suspects: dict[int, list[str]] = {}
    for j, name in enumerate(names):
        column = gathered[:, j].tolist()
        counts = Counter(column).most_common(2)
        majority, votes = counts[0]
        if len(counts) > 1 and counts[1][1] == votes:
            raise RuntimeError(f"no majority for {name}: fingerprints {column}; too many replicas disagree to tell "
                               "which are corrupted")
        for rank, value in enumerate(column):
            if value != majority:
                suspects.setdefault(rank, []).append(name)
    return suspects


def _comm_device(group) -> torch.device:
    return device() if dist.get_backend(group) == "nccl" else torch.device("cpu")


@torch.no_grad()
def local_grad_norm(model: nn.Module) -> float:
    """This rank's gradient norm *before* DDP averages it (call between backward and the all-reduce)."""
    norms = [p.grad.detach().float().norm() for p in model.parameters() if p.grad is not None]
    return float(torch.stack(norms).norm()) if norms else 0.0


def grad_norm_outliers(local_norm: float, factor: float = 10.0, group=None) -> tuple[list[int], list[float]]:
    """All-gather every rank's local gradient norm; return the ranks above ``factor`` × the median, and the norms.

    Collective. A non-finite norm is always an outlier.
    """
    world = dist.get_world_size(group)
    norms = torch.zeros(world, dtype=torch.float64, device=_comm_device(group))
    mine = torch.tensor([local_norm], dtype=torch.float64, device=norms.device)
    dist.all_gather_into_tensor(norms, mine, group=group)
    values = norms.cpu().tolist()
    finite = [v for v in values if v == v and abs(v) != float("inf")]
    median = statistics.median(finite) if finite else float("nan")
    outliers = [r for r, v in enumerate(values) if not (v == v and abs(v) != float("inf")) or v > factor * median]
    return outliers, values


def hang_suspects(error, world_size: int) -> list[int]:
    """The ranks a :class:`~distlab.runtime.launch.CollectiveTimeout` points at: not in the op most ranks wait in.

    ``error.waiting`` maps each blocked rank to its op; a rank missing from it was not
    in any collective (still computing: the classic hung rank); a rank in another op
    than the majority's is stuck somewhere the others never go.
    """
    waiting = dict(getattr(error, "waiting", {}) or {})
    if not waiting:
        return []
    ops = Counter(_base(op) for op in waiting.values())
    majority, votes = ops.most_common(1)[0]
    if votes * 2 <= world_size:
        return sorted(waiting)  # no majority: every waiting rank is a suspect
    absent = [r for r in range(world_size) if r not in waiting]
    odd = [r for r, op in waiting.items() if _base(op) != majority]
    return sorted(absent + odd)


def _base(op: str) -> str:
    return op[5:-1] if op.startswith("wait(") else op
