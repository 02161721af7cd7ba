"""Subgroups of the default process group, made once and reused: the one place distlab calls ``new_group``.

``dist.new_group`` is collective: every rank of the default group must call it, in the same order,
even for groups it is not in (torch numbers groups by call order, and the members meet under that
number). A warm rank runs job after job; making a job's groups anew each time costs a rendezvous
per group and leaks the old ones. So a group is kept under its ranks, its backend and a purpose
(two groups over the same ranks whose ops must not queue behind each other: a channel per
direction, checkpointing beside training) for as long as the default group lives.

The cache belongs to one default group object: once it is destroyed and another initialised, the
groups made under it are dropped, never handed out. Caches stay equal on every rank because every
rank makes the same calls in the same order, so ask on every rank for every group of a partition
(:func:`own_subgroup`), never only for this rank's. The cache owns its groups: destroying one would
leave a dead group to hand out, and remaking it on its members alone would break the call order.
"""

from __future__ import annotations

import weakref
from typing import Iterable

import torch.distributed as dist

__all__ = ["subgroup", "own_subgroup"]

_groups: dict[tuple, object] = {}
_world: "weakref.ref | None" = None  # the default group the cached groups were made under


def subgroup(ranks: Iterable[int], *, backend: str | None = None, purpose: str = ""):
    """The process group of ``ranks``: made by ``dist.new_group`` on first use under this default group.

    Collective on first use: every rank calls it with the same arguments, in the same order, members
    or not (a non-member gets torch's ``GroupMember.NON_GROUP_MEMBER``). ``backend``: as for
    ``new_group`` (default: the default group's). ``purpose``: groups over the same ranks for
    different purposes are different groups.
    """
    global _world
    world = dist.group.WORLD
    if world is None:
        raise RuntimeError("no default process group: run under distlab.launch or call dist.init_process_group")
    if _world is None or _world() is not world:
        _groups.clear()
        _world = weakref.ref(world)
    key = (tuple(sorted(ranks)), backend, purpose)
    if key not in _groups:
        _groups[key] = dist.new_group(list(key[0]), backend=backend)
    return _groups[key]


def own_subgroup(partition: Iterable[Iterable[int]], *, backend: str | None = None, purpose: str = ""):
    """This rank's group of ``partition`` (the ranks cut into disjoint groups), once every group of it exists.

    Every rank asks for every group, in order (``new_group`` is collective), and keeps the one it is in.
    """
    rank, mine, partition = dist.get_rank(), None, [list(ranks) for ranks in partition]
    for ranks in partition:
        made = subgroup(ranks, backend=backend, purpose=purpose)
        if rank in ranks:
            mine = made
    if mine is None:
        raise ValueError(f"rank {rank} is in none of the groups {partition}")
    return mine
