"""The math every context-parallel method shares: layouts, one attention block, merging blocks.

A layout says which token positions each rank holds. :func:`attention_block` computes attention
over one block of keys as ``(out, lse)``, normalised within the block, and :func:`merge_attention`
combines two such results exactly: that pair is all ring attention needs to split attention over
ranks. With token positions a causal mask applies, and the blocks and tiles it hides are skipped
(:func:`_plan`), which :func:`measure_work` counts. :func:`online_softmax_attention` and
:func:`blockwise_attention` are the same ideas in one process.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distlab.runtime import timeline

SEQ_DIM = 2  # [batch, heads, tokens, head_dim]
LAYOUTS = ("contiguous", "zigzag", "striped")
TILE = 64  # smallest side of a tile the causal planner still cuts in four (see _plan)


# ---------------------------------------------------------------- layouts

def _check_layout(seq_len: int, world_size: int, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    parts = 2 * world_size if layout == "zigzag" else world_size
    if world_size < 1 or seq_len % parts:
        what = f"2·world_size = {parts}" if layout == "zigzag" else f"world_size = {world_size}"
        raise ValueError(f"sequence length {seq_len} is not divisible by {what} for the {layout} layout: "
                         f"pad the sequence to a multiple of {parts} (padded keys masked out) or change the world size")


def layout_positions(seq_len: int, world_size: int, rank: int, layout: str = "contiguous") -> torch.Tensor:
    """The token positions rank ``rank`` holds, in its local order (int64, CPU).

    contiguous: ``[r·T/N, (r+1)·T/N)``. zigzag: chunks ``r`` and ``2N-1-r`` of ``2N`` equal chunks,
    so an early chunk (little causal work) pairs with a late one (much). striped: ``r, r+N, r+2N, …``.
    """
    _check_layout(seq_len, world_size, layout)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not one of the {world_size} ranks")
    if layout == "contiguous":
        size = seq_len // world_size
        return torch.arange(rank * size, (rank + 1) * size)
    if layout == "striped":
        return torch.arange(rank, seq_len, world_size)
    half = seq_len // (2 * world_size)
    late = 2 * world_size - 1 - rank
    return torch.cat([torch.arange(rank * half, (rank + 1) * half), torch.arange(late * half, (late + 1) * half)])


def shard(x: torch.Tensor, world_size: int, rank: int, layout: str = "contiguous", dim: int = SEQ_DIM) -> torch.Tensor:
    """Rank ``rank``'s tokens of the full tensor ``x`` (a copy, in the layout's local order)."""
    positions = layout_positions(x.shape[dim], world_size, rank, layout).to(x.device)
    return x.index_select(dim, positions)


def unshard(shards: list[torch.Tensor], layout: str = "contiguous", dim: int = SEQ_DIM) -> torch.Tensor:
    """The full tensor from every rank's shard (in rank order): the inverse of :func:`shard`."""
    world = len(shards)
    seq_len = sum(s.shape[dim] for s in shards)
    order = torch.cat([layout_positions(seq_len, world, r, layout) for r in range(world)]).to(shards[0].device)
    full = torch.empty_like(torch.cat(shards, dim))
    return full.index_copy_(dim, order, torch.cat(shards, dim))


# ---------------------------------------------------------------- one block: the math every method shares

@dataclass
class Work:
    """What the attention blocks of a ``measure_work()`` region did on this rank."""

    computed: int = 0  # query·key scores computed (masked ones included: a dense kernel pays for them)
    useful: int = 0  # scores a causal mask keeps: the work an ideal tile-skipping kernel would do
    blocks: int = 0  # attention_block calls that computed anything
    seconds: float = 0.0  # CPU time of this thread inside them (on a GPU: launch time only)


_work: Work | None = None


@contextmanager
def measure_work():
    """Count the scores every :func:`attention_block` computes inside the block: ``with measure_work() as w``."""
    global _work
    previous, _work = _work, Work()
    try:
        yield _work
    finally:
        _work = previous


def _runs(positions: torch.Tensor) -> list[tuple[int, int]]:
    """Index ranges of equally spaced positions: one for contiguous and striped shards, two for zigzag."""
    n = positions.numel()
    if n <= 2:
        return [(0, n)]
    steps = positions[1:] - positions[:-1]
    breaks = (torch.nonzero(steps != steps[0]).flatten() + 1).tolist()
    edges = [0] + breaks + [n]
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]


def _plan(q_pos, k_pos, q_len: int, k_len: int):
    """The (query slice, key slice, mask or None) tiles worth computing under a causal mask by positions.

    A pair of runs whose every key comes after every query is skipped, one whose every key comes
    at or before every query needs no mask. A partly masked pair (a diagonal) is cut into quarters
    and classified again, down to :data:`TILE` tokens a side, as a tiled kernel skips its fully
    masked tiles (FlashAttention, 64-128 tokens); a tile still partly masked is masked element-wise.
    """
    if q_pos is None:
        return [(slice(0, q_len), slice(0, k_len), None)]
    q_pos, k_pos = q_pos.cpu(), k_pos.cpu()
    tiles = []

    def visit(qa, qb, ka, kb):
        q_run, k_run = q_pos[qa:qb], k_pos[ka:kb]
        if int(k_run.min()) > int(q_run.max()):
            return
        if int(k_run.max()) <= int(q_run.min()):
            tiles.append((slice(qa, qb), slice(ka, kb), None))
        elif qb - qa > TILE and kb - ka > TILE:
            q_mid, k_mid = (qa + qb) // 2, (ka + kb) // 2
            for q_half in ((qa, q_mid), (q_mid, qb)):
                for k_half in ((ka, k_mid), (k_mid, kb)):
                    visit(*q_half, *k_half)
        else:
            tiles.append((slice(qa, qb), slice(ka, kb), k_run[None, :] <= q_run[:, None]))

    for q_run in _runs(q_pos):
        for k_run in _runs(k_pos):
            visit(*q_run, *k_run)
    return tiles


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def _probabilities(q, k, lse_or_none, mask, scale):
    """Scores of one pair in fp32 (masked ones -inf), and their exp against ``lse`` (or their own lse)."""
    scores = torch.matmul(q, k.transpose(-2, -1)).float() * scale
    if mask is not None:
        scores.masked_fill_(~mask.to(scores.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1) if lse_or_none is None else lse_or_none
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # a row that sees nothing: p = 0
    return torch.exp(scores - finite.unsqueeze(-1)), lse


def attention_block(q, k, v, q_pos=None, k_pos=None, scale=None):
    """Attention of ``q`` over one block of keys and values: ``(out, lse)``, both fp32.

    ``out`` is normalised within the block and ``lse`` (``[batch, heads, q_tokens]``) is each
    query's log-sum-exp of scores over the block, which is all :func:`merge_attention` needs to
    combine blocks exactly. With token positions ``q_pos``/``k_pos`` the causal mask
    ``k_pos <= q_pos`` applies: fully masked parts are skipped, a query that sees no key gets
    ``out = 0`` and ``lse = -inf``. Records an "attention" span on a rank's timeline and its work
    in an active :func:`measure_work`.
    """
    scale = _scale(q, scale)
    out = q.new_zeros(q.shape, dtype=torch.float32)
    lse = q.new_full(q.shape[:-1], float("-inf"), dtype=torch.float32)
    pairs = _plan(q_pos, k_pos, q.shape[SEQ_DIM], k.shape[SEQ_DIM])
    if not pairs:
        return out, lse
    started = time.thread_time()
    with timeline.span("attention") if dist.is_initialized() else nullcontext():
        for qs, ks, mask in pairs:
            p, block_lse = _probabilities(q[:, :, qs], k[:, :, ks], None, mask, scale)
            block_out = torch.matmul(p.to(v.dtype), v[:, :, ks]).float()  # p is normalised by the block's lse
            out[:, :, qs], lse[:, :, qs] = merge_attention(out[:, :, qs], lse[:, :, qs], block_out, block_lse)
            _count(q, qs, ks, mask)
    if _work is not None:
        _work.blocks += 1
        _work.seconds += time.thread_time() - started
    return out, lse


def _count(q, qs: slice, ks: slice, mask) -> None:
    if _work is None:
        return
    heads = q.shape[0] * q.shape[1]
    area = (qs.stop - qs.start) * (ks.stop - ks.start)
    _work.computed += heads * area
    _work.useful += heads * (area if mask is None else int(mask.sum()))


def merge_attention(out_a, lse_a, out_b, lse_b):
    """Combine attention over two disjoint sets of keys into attention over their union.

    Each part is softmax-normalised over its own keys; their true weights are ``exp(lse_part)``:
    ``lse = log(e^lse_a + e^lse_b)`` and ``out = out_a·e^(lse_a-lse) + out_b·e^(lse_b-lse)``.
    A part that saw no key (``lse = -inf``) gets weight 0; if neither saw one, ``out = 0``.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    weight_a = torch.exp(lse_a - finite).unsqueeze(-1)
    weight_b = torch.exp(lse_b - finite).unsqueeze(-1)
    return out_a * weight_a + out_b * weight_b, lse


def attention_block_backward(q, k, v, dout, lse, delta, q_pos=None, k_pos=None, scale=None):
    """This block's share of ``(dq, dk, dv)``, given the *final* ``lse`` and ``delta = rowsum(dout·out)``.

    With the final statistics every block's probabilities ``p = exp(s - lse)`` are the true ones, so
    blocks need no merging in backward: ``dv = pᵀ·dout``, ``ds = p·(dout·vᵀ - delta)``,
    ``dq = ds·k·scale``, ``dk = dsᵀ·q·scale``, summed over blocks (FlashAttention-2's backward).
    """
    scale = _scale(q, scale)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    pairs = _plan(q_pos, k_pos, q.shape[SEQ_DIM], k.shape[SEQ_DIM])
    started = time.thread_time()
    with timeline.span("attention backward") if pairs and dist.is_initialized() else nullcontext():
        for qs, ks, mask in pairs:
            qb, kb, vb, gb = q[:, :, qs].float(), k[:, :, ks].float(), v[:, :, ks].float(), dout[:, :, qs].float()
            p, _ = _probabilities(qb, kb, lse[:, :, qs], mask, scale)
            dv[:, :, ks] += torch.matmul(p.transpose(-2, -1), gb)
            ds = p * (torch.matmul(gb, vb.transpose(-2, -1)) - delta[:, :, qs].unsqueeze(-1))
            dq[:, :, qs] += torch.matmul(ds, kb) * scale
            dk[:, :, ks] += torch.matmul(ds.transpose(-2, -1), qb) * scale
            _count(q, qs, ks, mask)
    if _work is not None and pairs:
        _work.blocks += 1
        _work.seconds += time.thread_time() - started
    return dq, dk, dv


# ---------------------------------------------------------------- one process: the two ideas ring attention rests on

def online_softmax_attention(q, k_blocks, v_blocks, scale=None):
    """Attention in one pass over a stream of key/value blocks, FlashAttention's inner loop.

    Keeps, per query, the running max ``m`` of its scores, the running sum ``row_sum`` of ``exp(s - m)``
    and the running ``acc = Σ exp(s - m)·v``. When a block raises the max, ``row_sum`` and ``acc`` are
    rescaled by ``exp(m_old - m_new)``. At the end ``out = acc / row_sum`` and ``lse = m + log row_sum``.
    No score matrix wider than one block ever exists.
    """
    scale = _scale(q, scale)
    m = row_sum = acc = None
    for k, v in zip(k_blocks, v_blocks):
        s = torch.matmul(q, k.transpose(-2, -1)).float() * scale
        block_max = s.amax(dim=-1)
        m_new = block_max if m is None else torch.maximum(m, block_max)
        p = torch.exp(s - m_new.unsqueeze(-1))
        rescale = 1.0 if m is None else torch.exp(m - m_new)
        row_sum = p.sum(-1) if row_sum is None else row_sum * rescale + p.sum(-1)
        acc_block = torch.matmul(p, v.float())
        acc = acc_block if acc is None else acc * rescale.unsqueeze(-1) + acc_block
        m = m_new
    return acc / row_sum.unsqueeze(-1), m + torch.log(row_sum)


def blockwise_attention(q, k, v, block_size: int, causal: bool = False):
    """Attention in tiles of ``block_size`` queries × ``block_size`` keys, merged by log-sum-exp, in one process.

    The computation ring attention spreads over ranks (a query block per rank, key blocks passing
    by); under a causal mask a key block that starts after a query block ends is skipped.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    outs, lses = [], []
    for q_start in range(0, q.shape[SEQ_DIM], block_size):
        q_stop = min(q_start + block_size, q.shape[SEQ_DIM])
        q_pos = torch.arange(q_start, q_stop) if causal else None
        out = lse = None
        for k_start in range(0, k.shape[SEQ_DIM], block_size):
            if causal and k_start >= q_stop:
                break
            k_stop = min(k_start + block_size, k.shape[SEQ_DIM])
            k_pos = torch.arange(k_start, k_stop) if causal else None
            block = attention_block(q[:, :, q_start:q_stop], k[:, :, k_start:k_stop], v[:, :, k_start:k_stop],
                                    q_pos, k_pos)
            out, lse = block if out is None else merge_attention(out, lse, *block)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, SEQ_DIM), torch.cat(lses, SEQ_DIM)
