"""Training the lab's GPT context-parallel: every rank holds a slice of every sequence; the torchrun entry point.

    torchrun --nproc-per-node=4 -m distlab.torchrun distlab.context_parallel.train:train seq_len=256 layout=zigzag

Every rank holds the whole model and the same sequences, but only its tokens of each (the
``layout``'s positions). Embeddings, norms, MLPs and the output layer work token by token, so they
run on the local tokens alone; attention is :func:`~distlab.context_parallel.ring_attention` (or
Ulysses), the only place the ranks exchange activations. Each rank's loss is the mean over its
tokens, so the mean of the ranks' gradients (one all-reduce, as data parallelism does) is the
gradient of the whole batch: the run equals one process training on whole sequences.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab.context_parallel.blocks import LAYOUTS, _check_layout, layout_positions
from distlab.context_parallel.ring import ring_attention
from distlab.context_parallel.ulysses import _check_heads, ulysses_attention
from distlab.data_parallel import allreduce_buckets
from distlab.flops import step_report
from distlab.model import GPT, CausalSelfAttention, GPTConfig, synthetic_batch
from distlab.reference import make_optimizer
from distlab.runtime.rank import device

__all__ = ["METHODS", "check_cp_setup", "cp_loss", "cp_worker", "train"]

METHODS = ("ring", "ulysses")


def check_cp_setup(cfg: GPTConfig, world: int, method: str, layout: str) -> None:
    """Every size the run needs, checked before any rank talks: one ``ValueError`` line."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if method == "ulysses":
        if layout != "contiguous":
            raise ValueError(f"Ulysses works on contiguous shards, got layout={layout!r}")
        _check_heads(cfg.n_head, world)
    _check_layout(cfg.seq_len, world, layout)


def _attention(attn: CausalSelfAttention, x: torch.Tensor, method: str, layout: str) -> torch.Tensor:
    """The block's own ``qkv`` and ``proj``, with the sequence-parallel attention between them."""
    B, T, C = x.shape
    q, k, v = attn.qkv(x).split(C, dim=-1)
    q, k, v = (t.view(B, T, C // attn.head_dim, attn.head_dim).transpose(1, 2) for t in (q, k, v))
    if method == "ring":
        y = ring_attention(q, k, v, causal=True, layout=layout)
    else:
        y = ulysses_attention(q, k, v, causal=True)
    return attn.proj(y.transpose(1, 2).reshape(B, T, C))


def cp_loss(model: GPT, x: torch.Tensor, y: torch.Tensor, positions: torch.Tensor, method: str = "ring",
            layout: str = "contiguous") -> torch.Tensor:
    """This rank's mean loss over its tokens ``x``/``y`` (``[B, T/N]``) at ``positions`` of the sequence."""
    h = model.tok_emb(x) + model.pos_emb(positions)
    for block in model.blocks:
        h = h + _attention(block.attn, block.ln1(h), method, layout)
        h = h + block.mlp(block.ln2(h))
    logits = model.lm_head(model.ln_f(h))
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def cp_worker(cfg: GPTConfig, steps: int = 3, batch_size: int = 2, method: str = "ring", layout: str = "contiguous",
              optimizer: str = "adamw", lr: float = 1e-3, seed: int = 0, data_seed: int = 0,
              on_step: Callable | None = None) -> dict:
    """Train ``GPT(cfg, seed)`` on ``synthetic_batch(cfg, batch_size, step)``, the sequences split over all ranks.

    Returns ``losses`` (the whole batch's, equal on every rank), ``step_times`` and this rank's
    ``positions``. ``on_step(step, loss, seconds)`` is called after every step.
    """
    rank, world, dev = dist.get_rank(), dist.get_world_size(), device()
    check_cp_setup(cfg, world, method, layout)
    positions = layout_positions(cfg.seq_len, world, rank, layout).to(dev)
    model = GPT(cfg, seed=seed).to(dev)
    params = list(model.parameters())
    opt = make_optimizer(params, optimizer, lr=lr)
    out = {"rank": rank, "positions": positions.tolist(), "losses": [], "step_times": []}
    for step in range(steps):
        x, y = (t.to(dev)[:, positions] for t in synthetic_batch(cfg, batch_size, step, seed=data_seed))
        start = time.perf_counter()
        loss = cp_loss(model, x, y, positions, method, layout)
        loss.backward()
        allreduce_buckets([params])  # every rank's gradient covers its tokens: their mean is the batch's
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().reshape(1).double()
        dist.all_reduce(mean)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        out["step_times"].append(time.perf_counter() - start)
        out["losses"].append(mean.item() / world)
        if on_step is not None:
            on_step(step, out["losses"][-1], out["step_times"][-1])
    return out


def train(steps: int = 10, method: str = "ring", layout: str = "zigzag", batch_size: int = 2, n_layer: int = 2,
          d_model: int = 64, n_head: int = 4, vocab_size: int = 256, seq_len: int = 256, lr: float = 1e-3,
          seed: int = 0, log_every: int = 0, peak: float | str = "measured") -> dict:
    """Train the lab's GPT context-parallel over all ranks; the entry point for torchrun.

    ``method``: ring (``layout`` contiguous, zigzag or striped) or ulysses (contiguous; heads
    divisible by the world size). ``log_every=k`` (torchrun's default is 1): rank 0 prints every
    k-th step (the batch's loss, tokens/s, MFU against ``peak``) and a summary.
    """
    cfg = GPTConfig(vocab_size=int(vocab_size), seq_len=int(seq_len), n_layer=int(n_layer), n_head=int(n_head),
                    d_model=int(d_model))
    world = dist.get_world_size()
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    check_cp_setup(cfg, world, method, layout)
    report = step_report(f"cp-{world} {method}", cfg, int(steps), int(batch_size) * cfg.seq_len, log_every, peak)
    out = cp_worker(cfg, int(steps), int(batch_size), method, layout, lr=float(lr), seed=int(seed),
                    on_step=report.step if report else None)
    result = {"rank": out["rank"], "method": method, "layout": layout, "tokens_per_rank": len(out["positions"]),
              "loss_first": round(out["losses"][0], 4), "loss_last": round(out["losses"][-1], 4),
              "losses": out["losses"]}
    if report:
        result["mfu"] = report.finish()["mfu"]
    return result
