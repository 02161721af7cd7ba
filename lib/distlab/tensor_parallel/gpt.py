"""The lab's GPT, tensor-parallel: every block, the embedding and the loss, with or without sequence parallelism.

``TensorParallelGPT(gpt, group)`` keeps this rank's slices of a dense :class:`distlab.model.GPT`
(same parameter names, sharded where Megatron-LM shards them), so its loss, its local
logits and every local gradient can be compared with the dense model's on the same batch.
:func:`shard_of` says which slice of a dense tensor a rank holds — the specification the
checkers and tests compare against.

Without sequence parallelism the residual stream ``[B, T, d]`` is replicated on every
rank; LayerNorms, residual adds and biases run redundantly on each. With it
(``sequence_parallel=True``) the residual stream is a ``[B, T/t, d]`` shard: the embedding
is reduce-scattered, each TP region starts with an all-gather and ends with a
reduce-scatter. A parameter every rank keeps whole (LayerNorms, row-parallel biases, the
position embedding) then sees only its rank's tokens, so its gradient is partial:
:meth:`TensorParallelGPT.sync_sequence_parallel_grads` all-reduces those gradients (one flat
all-reduce per step) before the optimizer runs.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.model import GPT, Block, GPTConfig
from distlab.tensor_parallel.communication import tp_rank, tp_size
from distlab.tensor_parallel.layers import (
    ColumnParallelLinear,
    TensorParallelAttention,
    TensorParallelMLP,
    VocabParallelEmbedding,
    column_parallel_linear,
    qkv_rows,
    shard_range,
    vocab_parallel_cross_entropy,
)

__all__ = ["check_tp_sizes", "is_replicated", "shard_of", "shard_state", "TensorParallelBlock", "TensorParallelGPT"]


def check_tp_sizes(cfg: GPTConfig, tp: int, sequence_parallel: bool = False) -> None:
    """Raise one ``ValueError`` line naming every size that ``tp`` does not divide.

    Call it before launching ranks: a bad shape then fails in the notebook, before any
    rank starts work. (Every TP module checks again, for code started by torchrun.)
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"the tensor-parallel degree must be a positive integer, got tp={tp!r}")
    sizes = [("n_head", cfg.n_head, "each rank keeps whole attention heads"),
             ("d_model", cfg.d_model, "hidden features are split"),
             ("FFN size mlp_ratio·d_model", cfg.mlp_ratio * cfg.d_model, "MLP features are split"),
             ("vocab_size", cfg.vocab_size, "the vocabulary is split")]
    if sequence_parallel:
        sizes.append(("seq_len", cfg.seq_len, "sequence parallelism splits the sequence"))
    bad = [f"{name}={value} ({why})" for name, value, why in sizes if value % tp]
    if bad:
        raise ValueError(f"tp={tp} does not divide " + ", ".join(bad))


def is_replicated(name: str) -> bool:
    """Whether every TP rank holds parameter ``name`` whole (LayerNorms, row-parallel biases, ``pos_emb``)."""
    return not (name.endswith(("attn.qkv.weight", "attn.qkv.bias", "mlp.fc.weight", "mlp.fc.bias",
                               "attn.proj.weight", "mlp.proj.weight")) or name in ("tok_emb.weight", "lm_head.weight"))


def shard_of(name: str, dense: torch.Tensor, cfg: GPTConfig, tp: int, rank: int) -> torch.Tensor:
    """The slice of the dense parameter (or gradient) ``name`` that TP rank ``rank`` of ``tp`` holds."""
    ffn = cfg.mlp_ratio * cfg.d_model
    if is_replicated(name):
        return dense
    if name.endswith(("attn.qkv.weight", "attn.qkv.bias")):  # whole heads, in each of q, k and v
        return dense[qkv_rows(cfg.d_model, cfg.n_head, tp, rank).to(dense.device)]
    if name.endswith(("mlp.fc.weight", "mlp.fc.bias")):  # column-parallel: output features
        return dense[shard_range(ffn, tp, rank, "FFN size")]
    if name.endswith("proj.weight"):  # row-parallel: input features
        return dense[:, shard_range(ffn if ".mlp." in name else cfg.d_model, tp, rank, "input features")]
    return dense[shard_range(cfg.vocab_size, tp, rank, "vocab_size")]  # tok_emb, lm_head: vocabulary rows


def shard_state(dense_state: dict[str, torch.Tensor], cfg: GPTConfig, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """:func:`shard_of` applied to every entry of a dense state (or gradient) dict."""
    return {name: shard_of(name, tensor, cfg, tp, rank) for name, tensor in dense_state.items()}


class TensorParallelBlock(nn.Module):
    """``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``: LayerNorms replicated, attention and MLP split."""

    def __init__(self, block: Block, group=None, *, sequence_parallel: bool = False):
        super().__init__()
        self.ln1 = copy.deepcopy(block.ln1)
        self.attn = TensorParallelAttention(block.attn, group, sequence_parallel=sequence_parallel)
        self.ln2 = copy.deepcopy(block.ln2)
        self.mlp = TensorParallelMLP(block.mlp, group, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TensorParallelGPT(nn.Module):
    """This rank's part of ``gpt`` split over the TP ``group``.

    ``forward(idx)`` → this rank's logits ``[B, T, V/t]`` (vocabulary slice ``r·V/t …``);
    ``forward(idx, targets)`` → ``(local logits, loss)``, the loss equal on every rank.
    """

    def __init__(self, gpt: GPT, group=None, *, sequence_parallel: bool = False):
        super().__init__()
        cfg = gpt.cfg
        check_tp_sizes(cfg, tp_size(group), sequence_parallel)
        self.cfg, self.group, self.sequence_parallel = cfg, group, sequence_parallel
        self.tok_emb = VocabParallelEmbedding(gpt.tok_emb, group, sequence_parallel=sequence_parallel)
        self.pos_emb = copy.deepcopy(gpt.pos_emb)
        self.blocks = nn.ModuleList(TensorParallelBlock(b, group, sequence_parallel=sequence_parallel)
                                    for b in gpt.blocks)
        self.ln_f = copy.deepcopy(gpt.ln_f)
        self.tied = gpt.lm_head.weight is gpt.tok_emb.weight
        self.lm_head = None if self.tied else ColumnParallelLinear(gpt.lm_head, group,
                                                                   sequence_parallel=sequence_parallel)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t, T = tp_size(self.group), idx.shape[1]
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length {T} exceeds cfg.seq_len={self.cfg.seq_len}")
        positions = torch.arange(T, device=idx.device)
        if self.sequence_parallel:
            if T % t:
                raise ValueError(f"sequence parallelism over tp={t} ranks needs a sequence length divisible by {t}, "
                                 f"got {T}")
            positions = positions[shard_range(T, t, tp_rank(self.group), "sequence length")]
        x = self.tok_emb(idx) + self.pos_emb(positions)  # [B, T, d], or this rank's [B, T/t, d] with SP
        for block in self.blocks:
            x = block(x)
        weight = self.tok_emb.weight if self.tied else self.lm_head.weight
        logits = column_parallel_linear(self.ln_f(x), weight, None, self.group,
                                        sequence_parallel=self.sequence_parallel)  # [B, T, V/t]
        if targets is None:
            return logits
        loss = vocab_parallel_cross_entropy(logits, targets, self.group, vocab_start=self.tok_emb.vocab_start)
        return logits, loss

    def replicated_parameters(self) -> list[nn.Parameter]:
        """Parameters every rank holds whole: with sequence parallelism their gradients are partial."""
        return [p for name, p in self.named_parameters() if is_replicated(name)]

    @torch.no_grad()
    def sync_sequence_parallel_grads(self) -> None:
        """With sequence parallelism, sum the replicated parameters' partial gradients over the TP group."""
        if not self.sequence_parallel or tp_size(self.group) == 1:
            return
        params = [p for p in self.replicated_parameters() if p.grad is not None]
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

