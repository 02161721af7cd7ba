"""Tensor-parallel communication: autograd functions that put a collective at each edge of a TP region.

Megatron-LM (Shoeybi et al. 2019) splits a layer's matmuls over the ``t`` ranks of a
tensor-parallel group. Inside the region every rank holds a slice of the hidden features;
at its edges two *conjugate* operators keep forward and backward exact:

* ``f`` = :func:`copy_to_tp`: identity forward (every rank already has the full input),
  all-reduce backward (each rank computed the input's gradient from its slice only);
* ``g`` = :func:`reduce_from_tp`: all-reduce forward (each rank holds a partial sum of the
  output), identity backward (the output's gradient is the same on every rank).

Sequence parallelism (Korthikanti et al. 2022) keeps the activations *between* TP regions
sharded along the sequence, so the edges become an all-gather and a reduce-scatter of the
same bytes: :func:`gather_sequence` (all-gather forward, reduce-scatter backward) and
:func:`reduce_scatter_sequence` (reduce-scatter forward, all-gather backward).
:func:`all_gather_linear` fuses the entering all-gather with the column-parallel matmul and
saves only the sequence shard for backward, gathering it again there: Megatron's trade of
one extra all-gather for 1/t of the activation memory.

Every function takes the TP ``group`` (``None``: the default group) and does nothing at
``t = 1``. Collectives go through ``torch.distributed``, so distlab's comm log counts them.
Activations are ``[batch, seq, hidden]``: the sequence is dimension 1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab.runtime import comm
from distlab.runtime.subgroups import own_subgroup

__all__ = [
    "tp_size", "tp_rank", "tp_group", "copy_to_tp", "reduce_from_tp", "gather_from_tp", "gather_sequence",
    "reduce_scatter_sequence", "all_gather_linear", "all_gather_sequence", "reduce_scatter_along_sequence",
    "CopyToTensorParallel", "ReduceFromTensorParallel", "GatherFromTensorParallel", "GatherSequence",
    "ReduceScatterSequence", "AllGatherLinear", "comm_snapshot", "comm_since",
]


def tp_size(group=None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def tp_rank(group=None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def tp_group(tp: int):
    """This rank's TP group when the world is cut into ``world/tp`` groups of consecutive ranks.

    ``tp == world`` is the default group (``None``). Otherwise every rank must call this (the groups
    are made on first use, and ``new_group`` is collective); a warm rank reuses them between jobs.
    """
    world = dist.get_world_size()
    if world % tp:
        raise ValueError(f"world size {world} is not divisible by tp={tp}")
    if tp == world:
        return None
    return own_subgroup(range(start, start + tp) for start in range(0, world, tp))


# ---------------------------------------------------------------- raw collectives along a dimension

def _all_gather_first(x: torch.Tensor, group) -> torch.Tensor:
    """``[t, *x.shape]``: every rank's ``x``, stacked in group-rank order."""
    t = tp_size(group)
    out = torch.empty((t * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch >= 2.13 name first
    gather(out, x.contiguous(), group=group)
    return out.view(t, *x.shape)


def _reduce_scatter_first(stacked: torch.Tensor, group) -> torch.Tensor:
    """The sum over ranks of ``stacked[my rank]``, for ``stacked`` of shape ``[t, ...]``."""
    out = torch.empty(stacked.shape[1:], dtype=stacked.dtype, device=stacked.device)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, stacked.reshape(-1, *stacked.shape[2:]), group=group)  # ranks' parts concatenated on dim 0
    return out


def all_gather_sequence(x: torch.Tensor, group=None) -> torch.Tensor:
    """``[B, T/t, H]`` shards → ``[B, T, H]``, rank r's shard at positions r·T/t … (r+1)·T/t."""
    t = tp_size(group)
    if t == 1:
        return x
    stacked = _all_gather_first(x, group)  # [t, B, T/t, H]
    return stacked.transpose(0, 1).reshape(x.shape[0], t * x.shape[1], *x.shape[2:])


def reduce_scatter_along_sequence(x: torch.Tensor, group=None) -> torch.Tensor:
    """``[B, T, H]`` partial sums → this rank's ``[B, T/t, H]`` slice of their sum."""
    t = tp_size(group)
    if t == 1:
        return x
    if x.shape[1] % t:
        raise ValueError(f"sequence length {x.shape[1]} is not divisible by the tensor-parallel degree {t}")
    stacked = x.reshape(x.shape[0], t, x.shape[1] // t, *x.shape[2:]).transpose(0, 1)  # [t, B, T/t, H]
    return _reduce_scatter_first(stacked, group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """A summed copy: never reduce in place a tensor autograd may share with another branch."""
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


# ---------------------------------------------------------------- the conjugate pairs

class CopyToTensorParallel(torch.autograd.Function):
    """``f``: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad if tp_size(ctx.group) == 1 else _all_reduce(grad, ctx.group)), None


class ReduceFromTensorParallel(torch.autograd.Function):
    """``g``: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group=None):
        return x.view_as(x) if tp_size(group) == 1 else _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherFromTensorParallel(torch.autograd.Function):
    """All-gather along the last dimension forward; keep this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        if tp_size(group) == 1:
            return x.view_as(x)
        return torch.cat(_all_gather_first(x, group).unbind(0), dim=-1)

    @staticmethod
    def backward(ctx, grad):
        t = tp_size(ctx.group)
        if t == 1:
            return grad, None
        return grad.chunk(t, dim=-1)[tp_rank(ctx.group)].contiguous(), None


class GatherSequence(torch.autograd.Function):
    """Enter a TP region from sequence-sharded activations: all-gather forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        return all_gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_along_sequence(grad, ctx.group), None


class ReduceScatterSequence(torch.autograd.Function):
    """Leave a TP region into sequence-sharded activations: reduce-scatter forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        return reduce_scatter_along_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_sequence(grad, ctx.group), None


class AllGatherLinear(torch.autograd.Function):
    """``F.linear(all_gather_sequence(x), weight, bias)`` that saves the shard ``x``, not the gathered input.

    Backward gathers ``x`` again (issued asynchronously, so it runs while the input
    gradient is computed) and reduce-scatters the input gradient (issued asynchronously
    while the weight gradient is computed): the Megatron-LM sequence-parallel linear.
    Under autocast the backward matmuls run in the incoming gradient's dtype, as forward did.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group=None):
        ctx.group, ctx.bias_dtype = group, None if bias is None else bias.dtype
        ctx.save_for_backward(x, weight)
        return F.linear(all_gather_sequence(x, group), weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        group, t, dtype = ctx.group, tp_size(ctx.group), grad_out.dtype
        if t > 1:
            full = torch.empty((t * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            gathering = gather(full, x.contiguous(), group=group, async_op=True)
        grad_full = grad_out @ weight.to(dtype)  # overlaps with the all-gather
        grad_x = scattering = None
        if ctx.needs_input_grad[0]:
            if t > 1:
                stacked = grad_full.reshape(x.shape[0], t, *x.shape[1:]).transpose(0, 1).reshape(-1, *x.shape[1:])
                grad_x = torch.empty(x.shape, dtype=dtype, device=x.device)
                scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
                scattering = scatter(grad_x, stacked, group=group, async_op=True)
            else:
                grad_x = grad_full
        if t > 1:
            gathering.wait()
            full = full.view(t, *x.shape).transpose(0, 1).reshape(x.shape[0], t * x.shape[1], *x.shape[2:])
        else:
            full = x
        grad_2d = grad_out.reshape(-1, grad_out.shape[-1])
        grad_w = grad_2d.t() @ full.reshape(-1, full.shape[-1]).to(dtype)  # overlaps with the reduce-scatter
        grad_b = None if ctx.bias_dtype is None else grad_2d.sum(0).to(ctx.bias_dtype)
        if scattering is not None:
            scattering.wait()
        return (None if grad_x is None else grad_x.to(x.dtype)), grad_w.to(weight.dtype), grad_b, None


def copy_to_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """``f``: identity forward, all-reduce backward."""
    return CopyToTensorParallel.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """``g``: all-reduce forward, identity backward."""
    return ReduceFromTensorParallel.apply(x, group)


def gather_from_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate the ranks' last-dimension slices (a column-parallel layer's ``gather_output``)."""
    return GatherFromTensorParallel.apply(x, group)


def gather_sequence(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sequence shards → full sequence; the gradient is reduce-scattered back to the shards."""
    return GatherSequence.apply(x, group)


def reduce_scatter_sequence(x: torch.Tensor, group=None) -> torch.Tensor:
    """Partial sums of the full sequence → this rank's summed shard; the gradient is all-gathered."""
    return ReduceScatterSequence.apply(x, group)


def all_gather_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group=None) -> torch.Tensor:
    """Column-parallel matmul of a sequence-sharded input, saving only the shard (:class:`AllGatherLinear`)."""
    return AllGatherLinear.apply(x, weight, bias, group)


# ---------------------------------------------------------------- reading the comm log

comm_snapshot = comm.snapshot  # this rank's counts now, for :func:`comm_since`
_TP_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")  # what a TP edge may issue


def comm_since(before: comm.Snapshot) -> dict[str, tuple[int, int]]:
    """The TP collectives issued since ``before`` (a :func:`comm_snapshot`): ``{kind: (calls, payload bytes)}``,
    one kind per collective whichever API issued it (``all_gather_into_tensor``, DTensor's …)."""
    return {op: (c.calls, c.payload_bytes) for op, c in comm.since(before).ops.items() if op in _TP_COLLECTIVES}
