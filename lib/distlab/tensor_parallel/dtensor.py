"""The same MLP, attention and block parallelised by PyTorch: DTensor's ``parallelize_module``.

``ColwiseParallel`` shards a Linear's output features (rows of its weight) in contiguous
blocks, ``RowwiseParallel`` its input features, ``SequenceParallel`` runs a LayerNorm on
sequence shards; DTensor inserts the collectives that the lab writes by hand. One detail
needs care: our attention packs ``[q | k | v]``, so a contiguous block of rows would give
rank 0 all of q. :func:`qkv_for_colwise` reorders the rows rank-major — rank r's q, k and v
heads next to each other, exactly :func:`~distlab.tensor_parallel.layers.qkv_rows` — and
the unchanged :class:`distlab.model.CausalSelfAttention` then runs on each rank's heads.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from distlab.model import Block, CausalSelfAttention
from distlab.tensor_parallel.layers import qkv_rows

__all__ = ["qkv_for_colwise", "tp_plan", "parallelize"]


@torch.no_grad()
def qkv_for_colwise(attn: CausalSelfAttention, tp: int) -> CausalSelfAttention:
    """A copy of ``attn`` whose packed qkv rows are ordered so that contiguous block r holds rank r's heads."""
    d_model = attn.proj.in_features
    order = torch.cat([qkv_rows(d_model, d_model // attn.head_dim, tp, r) for r in range(tp)])
    permuted = copy.deepcopy(attn)
    permuted.qkv.weight.copy_(attn.qkv.weight[order])
    if attn.qkv.bias is not None:
        permuted.qkv.bias.copy_(attn.qkv.bias[order])
    return permuted


def tp_plan(kind: str, sequence_parallel: bool = False) -> dict:
    """The ``parallelize_module`` plan for ``"mlp"``, ``"attention"`` or a whole ``"block"``."""
    if kind == "mlp":
        return {"fc": ColwiseParallel(), "proj": RowwiseParallel()}
    if kind == "attention":
        return {"qkv": ColwiseParallel(), "proj": RowwiseParallel()}
    if kind != "block":
        raise ValueError(f"kind must be 'mlp', 'attention' or 'block', got {kind!r}")
    if not sequence_parallel:
        return {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}
    seq = Shard(1)  # activations are [batch, seq, hidden]
    return {"ln1": SequenceParallel(), "attn.qkv": ColwiseParallel(input_layouts=seq),
            "attn.proj": RowwiseParallel(output_layouts=seq), "ln2": SequenceParallel(),
            "mlp.fc": ColwiseParallel(input_layouts=seq), "mlp.proj": RowwiseParallel(output_layouts=seq)}


def parallelize(module: nn.Module, mesh, kind: str, sequence_parallel: bool = False) -> nn.Module:
    """A TP copy of ``module`` (an MLP, a CausalSelfAttention or a Block) made by ``parallelize_module``."""
    tp = mesh.size()
    module = copy.deepcopy(module)
    if isinstance(module, CausalSelfAttention):
        module = qkv_for_colwise(module, tp)
    elif isinstance(module, Block):
        module.attn = qkv_for_colwise(module.attn, tp)
    return parallelize_module(module, mesh, tp_plan(kind, sequence_parallel))
