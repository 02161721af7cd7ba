"""DeepSpeed-Ulysses (Jacobs et al. 2023) and USP (Fang & Zhao 2024): all-to-all between sequence and head shards.

Ulysses turns ``[B, H, T/N, D]`` sequence shards into ``[B, H/N, T, D]`` head shards with one
all-to-all, runs ordinary attention, and turns the output back with another. USP runs Ulysses
inside groups of ranks and ring attention across the groups.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab.context_parallel.blocks import layout_positions
from distlab.context_parallel.ring import RingAttention
from distlab.runtime.subgroups import own_subgroup


def _group_size(group) -> int:
    return dist.get_world_size(group)


def _check_heads(heads: int, world: int) -> None:
    if heads % world:
        raise ValueError(f"Ulysses needs the number of heads ({heads}) to be divisible by the number of ranks "
                         f"({world}): each rank computes heads/N whole heads; use N <= heads with heads % N == 0, "
                         f"or ring attention")


def seq_to_heads(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-to-all ``[B, H, T/N, D]`` (sequence-sharded) → ``[B, H/N, T, D]`` (head-sharded).

    Head group j goes to rank j; what arrives from rank j is its sequence shard of our heads,
    concatenated in rank order (the order of the shards' tokens, whatever the layout).
    """
    world = _group_size(group)
    if world == 1:
        return x
    b, h, t, d = x.shape
    _check_heads(h, world)
    send = x.reshape(b, world, h // world, t, d).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // world, world * t, d)


def heads_to_seq(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-to-all ``[B, H/N, T, D]`` → ``[B, H, T/N, D]``: the inverse of :func:`seq_to_heads`."""
    world = _group_size(group)
    if world == 1:
        return x
    b, h, seq, d = x.shape
    send = x.reshape(b, h, world, seq // world, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.transpose(0, 1).reshape(b, world * h, seq // world, d)


class _AllToAll(torch.autograd.Function):
    """seq_to_heads / heads_to_seq with gradients: the gradient of an all-to-all is the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, to_heads: bool, group):
        ctx.to_heads, ctx.group = to_heads, group
        return seq_to_heads(x, group) if to_heads else heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return (heads_to_seq(grad, ctx.group) if ctx.to_heads else seq_to_heads(grad, ctx.group)), None, None


def ulysses_attention(q, k, v, causal: bool = False, group=None) -> torch.Tensor:
    """DeepSpeed-Ulysses on contiguous shards: all-to-all to head shards, full attention, all-to-all back."""
    _check_heads(q.shape[1], _group_size(group))
    q, k, v = (_AllToAll.apply(t, True, group) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return _AllToAll.apply(out, False, group)


def usp_groups(ulysses_size: int):
    """``(ulysses_group, ring_group)`` of this rank for a 2D layout: Ulysses across consecutive ranks
    (a node's fast links carry the all-to-all), ring across the groups. Every rank must call this
    (the groups are made on first use, and ``new_group`` is collective); warm ranks reuse them."""
    world = dist.get_world_size()
    if ulysses_size < 1 or world % ulysses_size:
        raise ValueError(f"world size {world} is not divisible by the Ulysses degree {ulysses_size}")
    rings = world // ulysses_size
    return (own_subgroup(range(i * ulysses_size, (i + 1) * ulysses_size) for i in range(rings)),
            own_subgroup(range(j, world, ulysses_size) for j in range(ulysses_size)))


def usp_positions(seq_len: int, world_size: int, ulysses_size: int, rank: int, layout: str = "contiguous"):
    """Token positions of a rank under USP: its ring group's ``layout`` shard, split among the Ulysses group."""
    rings = world_size // ulysses_size
    ring_shard = layout_positions(seq_len, rings, rank // ulysses_size, layout)
    if ring_shard.numel() % ulysses_size:
        raise ValueError(f"a ring shard of {ring_shard.numel()} tokens does not split among "
                         f"{ulysses_size} Ulysses ranks")
    return ring_shard.chunk(ulysses_size)[rank % ulysses_size]


def usp_attention(q, k, v, causal=False, layout="contiguous", ulysses_group=None, ring_group=None):
    """Unified sequence parallelism: Ulysses all-to-all inside ``ulysses_group``, ring attention across ``ring_group``.

    Shards come from :func:`usp_positions`; after the all-to-all a rank holds its ring group's
    shard for ``heads / ulysses_size`` heads, which the ring then treats like any ring shard.
    """
    _check_heads(q.shape[1], _group_size(ulysses_group))
    q, k, v = (_AllToAll.apply(t, True, ulysses_group) for t in (q, k, v))
    out = RingAttention.apply(q, k, v, causal, layout, ring_group)
    return _AllToAll.apply(out, False, ulysses_group)


