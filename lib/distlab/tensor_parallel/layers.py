"""Megatron-style tensor-parallel layers, each built from the dense layer it replaces.

Every layer takes the dense module (its weights) and the TP group, and keeps this rank's
slice, so a TP model can be compared with the dense one on the same inputs: its local
outputs and gradients must equal the matching slices of the dense ones.

* :class:`ColumnParallelLinear` keeps a block of *output* features (rows of ``weight``):
  ``Y_i = X·A_iᵀ``, no communication forward; its input enters through ``f`` (or, with
  sequence parallelism, the all-gather of :func:`all_gather_linear`).
* :class:`RowParallelLinear` keeps a block of *input* features (columns of ``weight``): each
  rank's ``X_i·B_iᵀ`` is a partial sum, reduced by ``g`` (or reduce-scattered along the
  sequence); the bias is added once, after the reduction.
* :class:`TensorParallelMLP` = column, local GELU, row: one all-reduce forward, one backward.
* :class:`TensorParallelAttention`: column-parallel QKV that keeps whole heads
  (:func:`qkv_rows`), attention per local head, row-parallel output projection.
* :class:`VocabParallelEmbedding` and :func:`vocab_parallel_cross_entropy`: the vocabulary
  split over ranks; the loss all-reduces a max, a sum of exponentials and the target's logit
  per token, never the ``[tokens, vocab]`` logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from distlab.model import MLP, CausalSelfAttention
from distlab.tensor_parallel.communication import (
    all_gather_linear,
    copy_to_tp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_sequence,
    tp_rank,
    tp_size,
)

__all__ = ["shard_range", "qkv_rows", "ColumnParallelLinear", "RowParallelLinear", "TensorParallelMLP",
           "TensorParallelAttention", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
           "column_parallel_linear"]


def shard_range(size: int, tp: int, rank: int, what: str = "size") -> slice:
    """Rank ``rank``'s contiguous block of ``size`` features split ``tp`` ways."""
    if size % tp:
        raise ValueError(f"{what}={size} is not divisible by the tensor-parallel degree tp={tp}")
    per = size // tp
    return slice(rank * per, (rank + 1) * per)


def qkv_rows(d_model: int, n_head: int, tp: int, rank: int) -> torch.Tensor:
    """Rows of the packed ``[q | k | v]`` projection that hold rank ``rank``'s heads.

    ``qkv.weight`` stacks q, k and v, each ``d_model`` rows with the heads contiguous. A rank
    keeping heads ``r·a/t … (r+1)·a/t`` needs those heads' rows *in each of the three* parts,
    in the order q, k, v, so that the local output is again a packed ``[q | k | v]``.
    """
    if n_head % tp:
        raise ValueError(f"n_head={n_head} is not divisible by the tensor-parallel degree tp={tp}")
    heads = shard_range(d_model, tp, rank, "d_model")  # the rows of this rank's heads inside q (or k, or v)
    return torch.cat([torch.arange(heads.start, heads.stop) + part * d_model for part in range(3)])


def column_parallel_linear(x, weight, bias, group=None, *, sequence_parallel: bool = False):
    """The column-parallel matmul: enter the TP region (``f``, or the fused all-gather), multiply locally."""
    if sequence_parallel:
        return all_gather_linear(x, weight, bias, group)
    return F.linear(copy_to_tp(x, group), weight, bias)


class ColumnParallelLinear(nn.Module):
    """``dense`` with its output features split over the TP group (rows of the weight).

    ``rows`` picks which rows this rank keeps (default: its contiguous block);
    ``gather_output`` all-gathers the full output; ``sequence_parallel``: the input is a
    sequence shard, all-gathered inside (:func:`all_gather_linear`).
    """

    def __init__(self, dense: nn.Linear, group=None, *, rows: torch.Tensor | None = None,
                 gather_output: bool = False, sequence_parallel: bool = False):
        super().__init__()
        t, r = tp_size(group), tp_rank(group)
        if rows is None:
            block = shard_range(dense.out_features, t, r, "out_features")
            rows = torch.arange(block.start, block.stop)
        elif gather_output:
            raise ValueError("gather_output concatenates contiguous blocks: it cannot be used with custom rows")
        self.group, self.gather_output, self.sequence_parallel = group, gather_output, sequence_parallel
        self.in_features, self.out_features = dense.in_features, dense.out_features
        self.rows = rows
        index = rows.to(dense.weight.device)
        self.weight = nn.Parameter(dense.weight.detach()[index].clone())
        self.bias = None if dense.bias is None else nn.Parameter(dense.bias.detach()[index].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = column_parallel_linear(x, self.weight, self.bias, self.group, sequence_parallel=self.sequence_parallel)
        return gather_from_tp(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features} ({self.weight.shape[0]} on this rank)"


class RowParallelLinear(nn.Module):
    """``dense`` with its input features split over the TP group (columns of the weight).

    The input is this rank's slice of the features (a column-parallel layer's output).
    The partial products are all-reduced (``g``), or reduce-scattered along the sequence
    with ``sequence_parallel``; the full bias is added once, after the reduction.
    """

    def __init__(self, dense: nn.Linear, group=None, *, sequence_parallel: bool = False):
        super().__init__()
        t, r = tp_size(group), tp_rank(group)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.in_features, self.out_features = dense.in_features, dense.out_features
        self.cols = shard_range(dense.in_features, t, r, "in_features")
        self.weight = nn.Parameter(dense.weight.detach()[:, self.cols].clone())
        self.bias = None if dense.bias is None else nn.Parameter(dense.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_sequence(partial, self.group)
        else:
            y = reduce_from_tp(partial, self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features} ({self.weight.shape[1]} on this rank), out={self.out_features}"


class TensorParallelMLP(nn.Module):
    """Column-parallel ``fc``, GELU on the local slice, row-parallel ``proj``."""

    def __init__(self, mlp: MLP, group=None, *, sequence_parallel: bool = False):
        super().__init__()
        self.fc = ColumnParallelLinear(mlp.fc, group, sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear(mlp.proj, group, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class TensorParallelAttention(nn.Module):
    """Causal self-attention with the heads split over the TP group.

    Heads are independent: each rank projects its heads' q, k, v (column-parallel with
    :func:`qkv_rows`), attends within them and multiplies by its columns of the output
    projection; one all-reduce (row-parallel) adds the heads' contributions.
    """

    def __init__(self, attn: CausalSelfAttention, group=None, *, sequence_parallel: bool = False):
        super().__init__()
        t, r = tp_size(group), tp_rank(group)
        d_model, self.head_dim = attn.proj.in_features, attn.head_dim
        self.n_head = d_model // self.head_dim
        rows = qkv_rows(d_model, self.n_head, t, r)
        self.qkv = ColumnParallelLinear(attn.qkv, group, rows=rows, sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear(attn.proj, group, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # [B, T, 3·d_model/t]: this rank's heads of q, k and v (T: the full sequence)
        B, T, width = qkv.shape
        local_heads = width // 3 // self.head_dim
        q, k, v = (part.view(B, T, local_heads, self.head_dim).transpose(1, 2) for part in qkv.split(width // 3, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, width // 3))


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split over the TP group.

    Rank r holds rows ``r·V/t … (r+1)·V/t``. A token outside them looks up zeros; the
    ranks' lookups are summed (``g``), or reduce-scattered along the sequence with
    ``sequence_parallel`` so each rank keeps its shard of the summed embeddings.
    """

    def __init__(self, embedding: nn.Embedding, group=None, *, sequence_parallel: bool = False):
        super().__init__()
        t, r = tp_size(group), tp_rank(group)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.num_embeddings = embedding.num_embeddings
        block = shard_range(embedding.num_embeddings, t, r, "vocab_size")
        self.vocab_start, self.vocab_end = block.start, block.stop
        self.weight = nn.Parameter(embedding.weight.detach()[block].clone())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.vocab_start) | (idx >= self.vocab_end)
        local = F.embedding((idx - self.vocab_start).masked_fill(outside, 0), self.weight)
        local = local.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_sequence(local, self.group)
        return reduce_from_tp(local, self.group)


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor, group=None,
                                 vocab_start: int | None = None) -> torch.Tensor:
    """Mean cross-entropy over all tokens from vocabulary-sharded logits ``[..., V/t]``.

    ``loss = log Σ_v exp(z_v − m) − (z_target − m)`` with ``m`` the max over the full
    vocabulary: three all-reduces of one value per token (the max, the sum of exponentials,
    the target logit, which only its owner rank holds). The max carries no gradient (any
    constant shift gives the same loss); the two sums go through ``g``, whose identity
    backward hands every rank the gradient of its own terms: ``softmax − one_hot`` on its
    slice of the vocabulary. Computed in fp32 whatever the logits' dtype.
    """
    per_rank = local_logits.shape[-1]
    start = tp_rank(group) * per_rank if vocab_start is None else vocab_start
    logits = local_logits.float()
    global_max = logits.detach().amax(dim=-1)
    if tp_size(group) > 1:
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - global_max.unsqueeze(-1)
    sum_exp = reduce_from_tp(shifted.exp().sum(dim=-1), group)
    mine = (targets >= start) & (targets < start + per_rank)
    local_target = (targets - start).masked_fill(~mine, 0)
    target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) * mine
    target_logit = reduce_from_tp(target_logit, group)
    return (sum_exp.log() - target_logit).mean()

