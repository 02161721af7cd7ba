"""A tiny nanoGPT-style model and a learnable synthetic data stream, shared by every lab.

Why it looks the way it does:

* Module names are short and stable (``tok_emb``, ``blocks[i].attn.qkv`` ...) so later
  labs (tensor parallel, FSDP) can find and shard weights by name.
* ``GPT(cfg, seed=0)`` draws every weight from a *local* ``torch.Generator``: two
  processes that build the same config and seed get bit-identical weights without
  broadcasting, and building a model never disturbs the global RNG a lab relies on.
* ``synthetic_batch`` comes from a fixed random Markov chain with peaked transitions, so
  a loss curve visibly drops from ``ln(vocab)`` towards the chain's entropy in a few
  hundred steps, with no dataset to download.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from distlab.runtime.group import preload

# The GPT is built on the meta device (to count its bytes before any rank allocates them), whose first use
# imports torch._dynamo: about a second of CPU per rank. The forkserver imports it once instead.
preload("torch._dynamo")

__all__ = ["GPTConfig", "GPT", "Block", "CausalSelfAttention", "MLP", "count_params",
           "flops_per_token", "training_flops_per_token", "synthetic_batch"]


@dataclass
class GPTConfig:
    """Shape of a :class:`GPT`. The defaults build a ~0.1M-parameter model that trains on CPU in seconds."""

    vocab_size: int = 256
    seq_len: int = 64
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    tied_embeddings: bool = True
    mlp_ratio: int = 4
    bias: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "mlp_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


class CausalSelfAttention(nn.Module):
    """``qkv`` projects to [q | k | v] (each d_model wide, heads contiguous), then ``proj``.

    The number of heads is read from the width of ``qkv``'s output, so a tensor-parallel
    lab that keeps a slice of heads (and slices ``qkv``/``proj`` to match) needs no change here.
    """

    def __init__(self, cfg: GPTConfig, device=None):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias, device=device)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.qkv(x)
        local_width = qkv.shape[-1] // 3  # d_model, or d_model / tp on a tensor-parallel rank
        n_head = local_width // self.head_dim
        q, k, v = qkv.split(local_width, dim=-1)
        q, k, v = (t.view(B, T, n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, local_width)
        return self.proj(y)


class MLP(nn.Module):
    """Linear (d → mlp_ratio·d), GELU, Linear back: ``fc`` is column-, ``proj`` row-parallel in the TP lab."""

    def __init__(self, cfg: GPTConfig, device=None):
        super().__init__()
        hidden = cfg.mlp_ratio * cfg.d_model
        self.fc = nn.Linear(cfg.d_model, hidden, bias=cfg.bias, device=device)
        self.proj = nn.Linear(hidden, cfg.d_model, bias=cfg.bias, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``."""

    def __init__(self, cfg: GPTConfig, device=None):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias, device=device)
        self.attn = CausalSelfAttention(cfg, device=device)
        self.ln2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias, device=device)
        self.mlp = MLP(cfg, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """nanoGPT-style decoder. ``forward(idx)`` → logits; ``forward(idx, targets)`` → ``(logits, loss)``.

    Set ``model.activation_checkpointing = True`` to recompute each block in backward
    (``torch.utils.checkpoint``): only block inputs are kept between forward and backward.
    """

    def __init__(self, cfg: GPTConfig, seed: int = 0, device: str = "cpu"):
        super().__init__()
        self.cfg = cfg
        self.activation_checkpointing = False
        # Build on the meta device (no storage, no global-RNG draws), then materialise and
        # fill every tensor from our own generator in init_weights().
        meta = torch.device("meta")
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model, device=meta)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model, device=meta)
        self.blocks = nn.ModuleList(Block(cfg, device=meta) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias, device=meta)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False, device=meta)
        if device != "meta":  # device="meta": shapes only, nothing allocated (distlab.parallel3d.dryrun at 405B)
            self.to_empty(device=device)
        if cfg.tied_embeddings:
            self.lm_head.weight = self.tok_emb.weight  # one tensor, two uses
        if device != "meta":
            self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """GPT-2 init from a local generator: N(0, 0.02), zero biases, LayerNorm (1, 0),
        residual projections (``attn.proj``, ``mlp.proj``) scaled by 1/sqrt(2·n_layer)."""
        generator = torch.Generator(device="cpu").manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, p in self.named_parameters():  # fixed order; a tied weight appears once
            if ".ln" in name or name.startswith("ln_"):
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                std = residual_std if name.endswith("proj.weight") else 0.02
                p.copy_(torch.randn(p.shape, generator=generator) * std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        B, T = idx.shape
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length {T} exceeds cfg.seq_len={self.cfg.seq_len}")
        pos = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def num_params(self, include_embeddings: bool = True) -> int:
        """Parameters, a tied weight counted once. Without embeddings: drop ``tok_emb``,
        ``pos_emb`` and the output projection (Kaplan et al.'s "non-embedding" N)."""
        total = sum(p.numel() for p in self.parameters())
        if include_embeddings:
            return total
        total -= self.tok_emb.weight.numel() + self.pos_emb.weight.numel()
        if self.lm_head.weight is not self.tok_emb.weight:
            total -= self.lm_head.weight.numel()
        return total


def count_params(cfg: GPTConfig, include_embeddings: bool = True) -> int:
    """Parameter count of ``GPT(cfg)`` from the config alone (no model built); equals ``GPT.num_params``."""
    d, hidden, b = cfg.d_model, cfg.mlp_ratio * cfg.d_model, int(cfg.bias)
    layer_norm = d * (1 + b)
    attn = d * 3 * d + 3 * d * b + d * d + d * b
    mlp = d * hidden + hidden * b + hidden * d + d * b
    non_embedding = cfg.n_layer * (2 * layer_norm + attn + mlp) + layer_norm
    if not include_embeddings:
        return non_embedding
    embeddings = cfg.vocab_size * d + cfg.seq_len * d
    if not cfg.tied_embeddings:
        embeddings += cfg.vocab_size * d
    return non_embedding + embeddings


def flops_per_token(cfg: GPTConfig) -> int:
    """Training FLOPs per token, Kaplan et al. 2020 / PaLM (Chowdhery et al. 2022, App. B):

        6·N + 12·n_layer·d_model·seq_len

    6·N: each weight does one multiply-add (2 FLOPs) per token forward and two in backward.
    N is the non-embedding parameter count plus the output projection (vocab·d_model): the
    logits matmul does real work even when its weight is tied to the embedding, while the
    embedding lookups do none. 12·L·d·T: the QKᵀ and attention·V matmuls (2·2·T·d forward
    per layer, ×3 for training), with the causal half counted, as PaLM does.
    """
    n = count_params(cfg, include_embeddings=False) + cfg.vocab_size * cfg.d_model
    return training_flops_per_token(n, cfg.n_layer, cfg.d_model, cfg.seq_len)


def training_flops_per_token(matmul_params: int, n_layer: int, d_model: int, seq_len: int) -> int:
    """:func:`flops_per_token` for any transformer shape: ``6·N + 12·n_layer·d_model·seq_len``,
    ``N`` the parameters that do a matmul per token (all but the embedding lookups)."""
    return 6 * matmul_params + 12 * n_layer * d_model * seq_len


def _mix(*values: int) -> int:
    """Mix integers into one 63-bit seed (splitmix64 steps), so (seed, step) pairs never collide trivially."""
    state = 0x9E3779B97F4A7C15
    for value in values:
        state = (state ^ (value & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        state = (state ^ (state >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        state ^= state >> 29
    return state & 0x7FFFFFFFFFFFFFFF


_SUCCESSOR_PROBS = (0.6, 0.2, 0.1, 0.1)  # peaked: entropy ≈ 1.09 nats, far below ln(256) ≈ 5.55


@lru_cache(maxsize=16)
def _markov_chain(vocab_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token gets four fixed successors with probabilities 0.6/0.2/0.1/0.1."""
    generator = torch.Generator().manual_seed(_mix(seed, 0xC4A1))
    successors = torch.randint(vocab_size, (vocab_size, len(_SUCCESSOR_PROBS)), generator=generator)
    return successors, torch.tensor(_SUCCESSOR_PROBS)


def synthetic_batch(cfg: GPTConfig, batch_size: int, step: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic ``(x, y)`` int64 ``[batch_size, seq_len]`` for (seed, step); ``y`` is ``x`` shifted by one.

    Sequences come from a fixed (per seed) first-order Markov chain with peaked transitions,
    so the best achievable loss is ≈1.09 nats: a model that learns shows a clear drop.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be positive")
    successors, probs = _markov_chain(cfg.vocab_size, seed)
    generator = torch.Generator().manual_seed(_mix(seed, step, 0xBA7C))
    tokens = torch.empty(batch_size, cfg.seq_len + 1, dtype=torch.int64)
    tokens[:, 0] = torch.randint(cfg.vocab_size, (batch_size,), generator=generator)
    choices = torch.multinomial(probs, batch_size * cfg.seq_len, replacement=True, generator=generator)
    choices = choices.view(batch_size, cfg.seq_len)
    for t in range(cfg.seq_len):
        tokens[:, t + 1] = successors[tokens[:, t], choices[:, t]]
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
