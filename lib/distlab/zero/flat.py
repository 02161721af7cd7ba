"""Flat, padded, sharded parameter buffers and the collectives on them: what every ZeRO stage shares.

ZeRO never shards a tensor along one of its dimensions. It lays the parameters of a unit
(a param group, a gradient bucket, a transformer block) end to end in one flat buffer,
pads it to a multiple of the ``N`` ranks it is sharded over, and gives rank ``r`` the
elements ``r·S … (r+1)·S`` (``S = ceil(numel / N)``). A parameter may straddle two shards, a
bias smaller than ``N`` elements may sit in one rank's shard and padding in the others':
none of that matters, because every operation ZeRO applies to a shard (averaging
gradients, an elementwise optimizer step, copying into a compute dtype) is elementwise.
The padding makes every shard the same size, which is what ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` need.

A :class:`FlatParam` is that buffer for one unit. Its parameters are re-pointed at views of
``full`` (``p.data = view``: the module, its hooks and autograd keep working unchanged), so
an all-gather into ``full`` updates every parameter at once. For ZeRO-1/2 ``full`` stays
allocated and ``local`` is a view of this rank's slice. For ZeRO-3 ``local`` owns its
storage and ``full``'s storage is allocated only while the unit computes (see
:func:`alloc_storage`/:func:`free_storage`).

Two :class:`Axis` objects describe where a unit lives on the device mesh: ``shard`` (the
ranks that split it) and ``replicate`` (the ranks that hold the same shard and average
gradients with an all-reduce). DDP is shard size 1, ZeRO is replicate size 1, HSDP is both.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.runtime.subgroups import own_subgroup

__all__ = ["Axis", "mesh_axes", "check_shard_size", "FlatLayout", "FlatParam", "flat_params_of", "alloc_storage",
           "free_storage", "gather_flat", "reduce_scatter_mean", "unique_params"]


# ---------------------------------------------------------------- the device mesh

@dataclass(frozen=True)
class Axis:
    """The ranks a unit is sharded (or replicated) over: a process group, its size, our index in it.

    A size-1 axis has no group and its collectives become local copies, so DDP (no sharding)
    and ZeRO (no replication) are the two ends of one HSDP code path.
    """

    group: object | None
    size: int
    rank: int

    @classmethod
    def world(cls) -> "Axis":
        return cls(None, dist.get_world_size(), dist.get_rank())

    @classmethod
    def single(cls) -> "Axis":
        return cls(None, 1, 0)


def mesh_axes(shard_size: int | None = None) -> tuple[Axis, Axis]:
    """``(shard, replicate)`` axes for a ``world = replicate × shard`` mesh.

    Ranks ``k·S … (k+1)·S − 1`` form shard group ``k`` (a "node": neighbouring ranks, fast
    links); ranks with the same ``r mod S`` form a replicate group (one per node, slow
    links). ``shard_size=None`` or the world size is plain ZeRO/FSDP, 1 is DDP. Every rank
    must call this, in the same order (the groups are made on first use, and ``new_group`` is collective).
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    shard_size = world if shard_size is None else shard_size
    check_shard_size(world, shard_size)
    if shard_size == world:
        return Axis.world(), Axis.single()
    if shard_size == 1:
        return Axis.single(), Axis.world()
    shard = own_subgroup(range(k * shard_size, (k + 1) * shard_size) for k in range(world // shard_size))
    replicate = own_subgroup(range(j, world, shard_size) for j in range(shard_size))
    return (Axis(shard, shard_size, rank % shard_size),
            Axis(replicate, world // shard_size, rank // shard_size))


def check_shard_size(world_size: int, shard_size: int) -> None:
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1 or world_size % shard_size:
        raise ValueError(f"shard_size={shard_size!r} must be a positive divisor of world_size={world_size}: the "
                         f"mesh is (world_size / shard_size) replicas × shard_size shards")


# ---------------------------------------------------------------- layout

def unique_params(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """``params`` in order, each tensor once (a tied weight is one parameter)."""
    seen: set[int] = set()
    out = []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


class FlatLayout:
    """Where each parameter sits in one flat buffer of ``padded_numel`` elements cut into ``world_size`` shards."""

    def __init__(self, params: Sequence[torch.Tensor], world_size: int):
        if not params:
            raise ValueError("a flat buffer needs at least one parameter")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size={world_size!r} must be a positive integer")
        self.params = list(params)
        self.shapes = [p.shape for p in self.params]
        self.numels = [p.numel() for p in self.params]
        self.offsets = list(itertools.accumulate([0] + self.numels[:-1]))
        self.numel = sum(self.numels)
        self.world_size = world_size
        self.shard_numel = -(-self.numel // world_size)  # ceil: every shard the same size
        self.padded_numel = self.shard_numel * world_size

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def flatten(self, tensors: Sequence[torch.Tensor | None], dtype: torch.dtype | None = None) -> torch.Tensor:
        """One new padded flat tensor of ``tensors`` (shaped like the parameters; ``None`` → zeros)."""
        like = self.params[0]
        dtype = dtype or like.dtype
        flat = torch.zeros(self.padded_numel, dtype=dtype, device=like.device)
        for t, offset, n in zip(tensors, self.offsets, self.numels):
            if t is not None:
                flat[offset:offset + n].copy_(t.detach().reshape(-1))
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` shaped like each parameter."""
        return [flat[o:o + n].view(shape) for o, n, shape in zip(self.offsets, self.numels, self.shapes)]

    def shard(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s slice of a padded flat tensor (a view)."""
        return flat[rank * self.shard_numel:(rank + 1) * self.shard_numel]


# ---------------------------------------------------------------- storage and collectives

def free_storage(t: torch.Tensor) -> None:
    """Release ``t``'s memory but keep the tensor (and every view of it, i.e. the parameters)."""
    if t.untyped_storage().nbytes():
        t.untyped_storage().resize_(0)


def alloc_storage(t: torch.Tensor) -> None:
    """Give ``t`` back the memory it needs (contents undefined until written)."""
    nbytes = t.numel() * t.element_size()
    if t.untyped_storage().nbytes() != nbytes:
        t.untyped_storage().resize_(nbytes)


def gather_flat(full: torch.Tensor, local: torch.Tensor, axis: Axis, async_op: bool = False):
    """All-gather every rank's ``local`` shard into ``full`` (rank i's at ``i·len(local)``)."""
    if axis.size == 1:
        full.copy_(local)
        return None
    return dist.all_gather_into_tensor(full, local, group=axis.group, async_op=async_op)


def reduce_scatter_mean(flat: torch.Tensor, shard: Axis, replicate: Axis) -> torch.Tensor:
    """This rank's shard of the mean over all ranks of ``flat`` (padded to a multiple of the shard size).

    Reduce-scatter over the shard axis, then all-reduce that shard over the replicate axis
    (HSDP), then divide by the number of ranks. Sum-then-divide rather than ``ReduceOp.AVG``,
    which not every backend has.
    """
    if shard.size == 1:
        out = flat
    else:
        out = torch.empty(flat.numel() // shard.size, dtype=flat.dtype, device=flat.device)
        dist.reduce_scatter_tensor(out, flat, group=shard.group)
    if replicate.size > 1:
        dist.all_reduce(out, group=replicate.group)
    return out.div_(shard.size * replicate.size)


# ---------------------------------------------------------------- the unit of sharding

class FlatParam:
    """The parameters of one unit as one flat, padded buffer, sharded over ``shard``.

    * ``full`` — the padded flat buffer in ``dtype`` (the compute dtype); every parameter is
      a view of it. ZeRO-3 (``sharded=True``) frees its storage between uses.
    * ``local`` — this rank's shard: a view of ``full`` (ZeRO-1/2) or its own tensor (ZeRO-3).
    * ``master`` — an fp32 copy of ``local`` when ``dtype`` is lower precision (mixed
      precision), else ``None``: the optimizer then updates ``local`` itself.
    * ``grad_shard`` — this rank's shard of the averaged gradient once it is reduced
      (ZeRO-2/3), in ``dtype``; ``None`` before.

    Built from the parameters' current values, which become views of ``full`` cast to ``dtype``.
    """

    def __init__(self, params: Sequence[nn.Parameter], shard: Axis, replicate: Axis | None = None, *,
                 dtype: torch.dtype | None = None, sharded: bool = False, name: str = ""):
        self.params = unique_params(params)
        self.layout = FlatLayout(self.params, shard.size)
        self.shard_axis, self.replicate_axis = shard, replicate or Axis.single()
        self.name = name
        self.dtype = dtype or self.params[0].dtype
        self.sharded = sharded
        self.requires_grad = self.params[0].requires_grad
        if any(p.requires_grad != self.requires_grad for p in self.params):
            raise ValueError(f"{name or 'a flat buffer'} mixes trainable and frozen parameters: build one for each")
        with torch.no_grad():
            exact = self.layout.flatten([p.detach() for p in self.params], dtype=torch.float32)
            self.full = exact.to(self.dtype)
            own = self.layout.shard(exact, shard.rank)
            self.master = own.clone() if self.dtype != torch.float32 and self.requires_grad else None
            self.local = self.layout.shard(self.full, shard.rank)
            if sharded:
                self.local = self.local.clone()
        for p, view in zip(self.params, self.layout.views(self.full)):
            p.data = view  # the module computes with our buffer from now on
            p._distlab_flat_param = weakref.ref(self)  # so measurements can find the shards from the module
        self.grad_shard: torch.Tensor | None = None
        self.pending = None  # an async all-gather in flight (ZeRO-3 prefetch)
        if sharded:
            free_storage(self.full)

    @property
    def gathered(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def optimizer_param(self) -> torch.Tensor:
        """The tensor the optimizer updates: the fp32 master shard, or the shard itself."""
        return self.master if self.master is not None else self.local

    def __repr__(self) -> str:
        return (f"FlatParam({self.name or '?'}: {len(self.params)} tensors, {self.layout.numel:,} elements + "
                f"{self.layout.padding} padding in {self.shard_axis.size} shards of {self.layout.shard_numel:,}, "
                f"{str(self.dtype).replace('torch.', '')})")


def flat_params_of(module: nn.Module) -> list[FlatParam]:
    """The flat buffers ``module``'s parameters live in, each once, in parameter order."""
    found: dict[int, FlatParam] = {}
    for p in module.parameters():
        ref = getattr(p, "_distlab_flat_param", None)
        flat = ref() if ref is not None else None
        if flat is not None:
            found.setdefault(id(flat), flat)
    return list(found.values())
