"""Context parallelism: attention over a sequence split across ranks, exact, load-balanced, on gloo and NCCL.

At 128k tokens a transformer's activations no longer fit one GPU, whatever tensor or
pipeline parallelism does to the weights. Context parallelism (CP) splits the *sequence*:
each of N ranks holds 1/N of the tokens, and every layer but attention works on its own
tokens alone. Attention needs every key for every query, so the ranks exchange keys and values:

* **Ring attention** (Liu, Zaharia & Abbeel 2023): K/V blocks travel around a ring of ranks
  with point-to-point messages. Each rank combines its queries' attention over each block it
  sees through the log-sum-exp (the online softmax of FlashAttention), so no rank ever holds
  more than two K/V blocks, and the next block's transfer, posted before the current block's
  compute, is hidden behind it. Backward sends K/V around again, and dK/dV travel with them.
* **DeepSpeed-Ulysses** (Jacobs et al. 2023): an all-to-all turns sequence shards into head
  shards, each rank runs ordinary attention over the whole sequence for H/N heads, and a second
  all-to-all turns the output back. Fewer bytes than the ring, nothing to overlap, and N ≤ heads.
* **USP** (Fang & Zhao 2024): Ulysses inside a group of ranks, ring across the groups.

With a causal mask a rank whose tokens come early sees few keys: the contiguous layout leaves
the last rank with N times the first one's work. The zig-zag layout (rank r holds chunks r and
2N-1-r of 2N) gives every rank the same work; the striped layout (token t on rank t mod N)
balances it too, but every block it computes is half masked.

Everything here runs inside a rank (``distlab.launch``, a warm ``distlab.Ranks``, torchrun) on
gloo or NCCL unchanged: tensors live on ``distlab.device()``, messages are ``batch_isend_irecv``
point-to-point ops and ``all_to_all_single``, which distlab's comm log counts. Blocks are
computed explicitly (scores materialised, fp32 softmax statistics) so that their memory and work
can be measured; tensors are ``[batch, heads, tokens, head_dim]`` as in
``F.scaled_dot_product_attention``, and a layout's positions say which tokens a shard holds.
"""

from __future__ import annotations

import math
import statistics
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from distlab import timeline
from distlab.collectives import _ring_peers

__all__ = [
    "SEQ_DIM", "LAYOUTS", "layout_positions", "shard", "unshard", "Work", "measure_work", "attention_block",
    "attention_block_backward", "merge_attention", "online_softmax_attention", "blockwise_attention", "ring_pass",
    "ring_attention_forward", "ring_attention_backward", "RingAttention", "ring_attention", "seq_to_heads",
    "heads_to_seq", "ulysses_attention", "usp_groups", "usp_positions", "usp_attention", "PeakMemory", "verify",
    "ring_bytes", "ulysses_bytes", "hidden_transfer_tokens", "LINK_BANDWIDTH",
]

SEQ_DIM = 2  # [batch, heads, tokens, head_dim]
LAYOUTS = ("contiguous", "zigzag", "striped")
TILE = 64  # smallest side of a tile the causal planner still cuts in four (see _plan)
_KV_TAG, _GRAD_TAG = 7, 8  # gloo matches p2p messages by tag: K/V and dK/dV never mix (NCCL keeps order)

# Peak one-direction bandwidth per GPU, bytes/s: what a ring's neighbour transfer gets.
LINK_BANDWIDTH = {
    "NVLink 4 (H100 SXM, in a node)": 450e9,
    "InfiniBand NDR 400 Gb/s (across nodes)": 50e9,
}


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
    with timeline.span("attention") if dist.is_initialized() else _nothing():
        for qs, ks, mask in pairs:
            p, block_lse = _probabilities(q[:, :, qs], k[:, :, ks], None, mask, scale)
            block_out = torch.matmul(p.to(v.dtype), v[:, :, ks]).float()  # p is normalised by the block's lse
            out[:, :, qs], lse[:, :, qs] = merge_attention(out[:, :, qs], lse[:, :, qs], block_out, block_lse)
            _count(q, qs, ks, mask)
    if _work is not None:
        _work.blocks += 1
        _work.seconds += time.thread_time() - started
    return out, lse


@contextmanager
def _nothing():
    yield


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
    with timeline.span("attention backward") if pairs and dist.is_initialized() else _nothing():
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

    Keeps, per query, the running max ``m`` of its scores, the running sum ``l`` of ``exp(s - m)``
    and the running ``acc = Σ exp(s - m)·v``. When a block raises the max, ``l`` and ``acc`` are
    rescaled by ``exp(m_old - m_new)``. At the end ``out = acc / l`` and ``lse = m + log l``.
    No score matrix wider than one block ever exists.
    """
    scale = _scale(q, scale)
    m = l = acc = None
    for k, v in zip(k_blocks, v_blocks):
        s = torch.matmul(q, k.transpose(-2, -1)).float() * scale
        block_max = s.amax(dim=-1)
        m_new = block_max if m is None else torch.maximum(m, block_max)
        p = torch.exp(s - m_new.unsqueeze(-1))
        rescale = 1.0 if m is None else torch.exp(m - m_new)
        l = p.sum(-1) if l is None else l * rescale + p.sum(-1)
        acc_block = torch.matmul(p, v.float())
        acc = acc_block if acc is None else acc * rescale.unsqueeze(-1) + acc_block
        m = m_new
    return acc / l.unsqueeze(-1), m + torch.log(l)


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


# ---------------------------------------------------------------- ring attention

def ring_pass(send: torch.Tensor, recv: torch.Tensor, group=None, tag: int = _KV_TAG) -> list:
    """Post ``send`` to the right neighbour and ``recv`` from the left one; return the handles to wait on.

    One ``batch_isend_irecv`` for both: NCCL runs the pair as one group (a ring of plain sends
    could deadlock there), gloo progresses both on its I/O threads while this thread computes.
    """
    _, _, right, left = _ring_peers(group)
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, right, group, tag),
                                   dist.P2POp(dist.irecv, recv, left, group, tag)])


def _wait(requests) -> None:
    for request in requests:
        request.wait()


def _positions(causal: bool, seq_len: int, world: int, rank: int, layout: str):
    return layout_positions(seq_len, world, rank, layout) if causal else None


def ring_attention_forward(q, k, v, causal: bool = False, layout: str = "contiguous", group=None,
                           overlap: bool = True):
    """Ring attention forward on this rank's shard (tokens in ``layout``): ``(out, lse)`` in fp32.

    Step i computes the block that came from rank ``(rank - i) mod N`` while the next one is on
    the wire; a block this rank's queries cannot see (causal) is passed on, never computed.
    ``overlap=False`` posts each transfer only after the block's compute (the serial baseline).
    """
    rank, world, _, _ = _ring_peers(group)
    seq_len = q.shape[SEQ_DIM] * world
    _check_layout(seq_len, world, layout)
    q_pos = _positions(causal, seq_len, world, rank, layout)
    kv = torch.stack([k, v]).contiguous()  # one message per step
    out = lse = None
    for step in range(world):
        last = step == world - 1
        if overlap and not last:
            incoming = torch.empty_like(kv)
            requests = ring_pass(kv, incoming, group)
        k_pos = _positions(causal, seq_len, world, (rank - step) % world, layout)
        block = attention_block(q, kv[0], kv[1], q_pos, k_pos)
        out, lse = block if out is None else merge_attention(out, lse, *block)
        if not last:
            if not overlap:
                incoming = torch.empty_like(kv)
                requests = ring_pass(kv, incoming, group)
            _wait(requests)
            kv = incoming
    return out, lse


def ring_attention_backward(dout, q, k, v, out, lse, causal: bool = False, layout: str = "contiguous", group=None):
    """Ring attention backward: ``(dq, dk, dv)`` for this rank's shard, in fp32.

    K/V go around the ring again; each block's dK/dV accumulator travels with it, collecting
    every rank's contribution, and one last pass brings it home to the block's owner. dQ stays.
    """
    rank, world, _, _ = _ring_peers(group)
    seq_len = q.shape[SEQ_DIM] * world
    q_pos = _positions(causal, seq_len, world, rank, layout)
    delta = (dout.float() * out.float()).sum(-1)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = torch.stack([k, v]).contiguous()
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)  # the accumulator of the block in hand
    grad_requests = []
    for step in range(world):
        if step < world - 1:
            incoming = torch.empty_like(kv)
            requests = ring_pass(kv, incoming, group, _KV_TAG)
        k_pos = _positions(causal, seq_len, world, (rank - step) % world, layout)
        dq_part, dk_part, dv_part = attention_block_backward(q, kv[0], kv[1], dout, lse, delta, q_pos, k_pos)
        dq += dq_part
        if step > 0:  # this block's accumulator, from the left neighbour
            _wait(grad_requests)
            dkv = dkv_incoming
        dkv[0] += dk_part
        dkv[1] += dv_part
        if world > 1:
            dkv_incoming = torch.empty_like(dkv)
            grad_requests = ring_pass(dkv, dkv_incoming, group, _GRAD_TAG)
        if step < world - 1:
            _wait(requests)
            kv = incoming
    if world > 1:
        _wait(grad_requests)  # the N-th pass: our own block's accumulator, complete
        dkv = dkv_incoming
    return dq, dkv[0], dkv[1]


class RingAttention(torch.autograd.Function):
    """Ring attention as an autograd function: forward and backward both go around the ring."""

    @staticmethod
    def forward(ctx, q, k, v, causal=False, layout="contiguous", group=None):
        out, lse = ring_attention_forward(q, k, v, causal, layout, group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.layout, ctx.group = causal, layout, group
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_attention_backward(dout, q, k, v, out, lse, ctx.causal, ctx.layout, ctx.group)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def ring_attention(q, k, v, causal: bool = False, layout: str = "contiguous", group=None) -> torch.Tensor:
    """Differentiable ring attention of this rank's shard; equals full attention on the unsharded sequence."""
    return RingAttention.apply(q, k, v, causal, layout, group)


# ---------------------------------------------------------------- DeepSpeed-Ulysses and USP

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
    (a node's fast links carry the all-to-all), ring across the groups. Every rank must call this."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if ulysses_size < 1 or world % ulysses_size:
        raise ValueError(f"world size {world} is not divisible by the Ulysses degree {ulysses_size}")
    rings = world // ulysses_size
    ulysses = [dist.new_group(list(range(i * ulysses_size, (i + 1) * ulysses_size))) for i in range(rings)]
    ring = [dist.new_group(list(range(j, world, ulysses_size))) for j in range(ulysses_size)]
    return ulysses[rank // ulysses_size], ring[rank % ulysses_size]


def usp_positions(seq_len: int, world_size: int, ulysses_size: int, rank: int, layout: str = "contiguous"):
    """Token positions of a rank under USP: its ring group's ``layout`` shard, split among the Ulysses group."""
    rings = world_size // ulysses_size
    ring_shard = layout_positions(seq_len, rings, rank // ulysses_size, layout)
    if ring_shard.numel() % ulysses_size:
        raise ValueError(f"a ring shard of {ring_shard.numel()} tokens does not split among {ulysses_size} Ulysses ranks")
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


# ---------------------------------------------------------------- measuring

class PeakMemory(TorchDispatchMode):
    """Peak bytes of the tensors allocated inside a ``with PeakMemory(device) as peak:`` block.

    On CUDA the caching allocator's own statistics. On a CPU, which keeps none, every tensor an
    operator creates in the block is counted until its storage is freed (a dispatch mode sees
    each op's outputs): the peak of what was alive at once, like ``torch.cuda.max_memory_allocated``.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        super().__init__()
        self.device = torch.device(device)
        self.bytes = 0
        self._live: dict[int, int] = {}
        self._current = 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._baseline = torch.cuda.memory_allocated(self.device)
            return self
        return super().__enter__()

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self._baseline
            return None
        return super().__exit__(*exc)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """Leave our ``__torch_dispatch__`` unwrapped: torch >= 2.10 wraps it in ``torch._disable_dynamo``,
        whose first call imports dynamo (seconds per rank) for a mode that is never compiled."""
        return False

    def _freed(self, key: int) -> None:
        self._current -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in tree_leaves(result):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self._live:
                    self._live[key] = storage.nbytes()
                    self._current += storage.nbytes()
                    self.bytes = max(self.bytes, self._current)
                    weakref.finalize(storage, self._freed, key)
        return result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def verify(method: str = "ring", batch: int = 1, heads: int = 4, seq_len: int = 256, head_dim: int = 16,
           causal: bool = True, layout: str = "zigzag", ulysses_size: int = 2, dtype: str = "float32",
           seed: int = 0, repeats: int = 1, check: bool = True) -> dict:
    """Run one context-parallel attention forward and backward on every rank; the torchrun entry point.

        torchrun --nproc-per-node=8 -m distlab.torchrun distlab.context_parallel:verify method=ring seq_len=65536

    Every rank draws the same full Q, K, V and output gradient from ``seed``, keeps its shard and
    runs ``method`` (ring, ulysses or usp). With ``check`` it compares its output and gradients with
    ``F.scaled_dot_product_attention`` on the full sequence (max abs error). Returns this rank's
    errors, the median seconds of forward + backward, and bytes sent per forward + backward.
    """
    from distlab import comm
    from distlab.rank import device as rank_device

    if method not in ("ring", "ulysses", "usp"):
        raise ValueError(f"method must be ring, ulysses or usp, got {method!r}")
    rank, world, dev = dist.get_rank(), dist.get_world_size(), rank_device()
    if method == "ulysses":
        layout = "contiguous"
        _check_heads(heads, world)
    torch_dtype = getattr(torch, dtype)
    generator = torch.Generator().manual_seed(seed)
    full = [torch.randn(batch, heads, seq_len, head_dim, generator=generator) for _ in range(4)]
    full = [t.to(dev, torch_dtype) for t in full]
    groups = usp_groups(ulysses_size) if method == "usp" else ()
    try:
        if method == "usp":
            positions = usp_positions(seq_len, world, ulysses_size, rank, layout).to(dev)
        else:
            positions = layout_positions(seq_len, world, rank, layout).to(dev)
        q, k, v, dout = (t.index_select(SEQ_DIM, positions) for t in full)
        times, sent = [], []
        for _ in range(repeats):
            q_, k_, v_ = (t.detach().clone().requires_grad_() for t in (q, k, v))
            before = comm.current_log().total()
            dist.barrier()
            start = time.perf_counter()
            if method == "ring":
                out = ring_attention(q_, k_, v_, causal, layout)
            elif method == "ulysses":
                out = ulysses_attention(q_, k_, v_, causal)
            else:
                out = usp_attention(q_, k_, v_, causal, layout, *groups)
            out.backward(dout)
            _sync(dev)
            times.append(time.perf_counter() - start)
            sent.append(comm.current_log().total() - before)
        result = {"rank": rank, "world_size": world, "method": method, "causal": causal, "layout": layout,
                  "device": str(dev), "dtype": dtype, "seconds": statistics.median(times), "bytes_sent": sent[-1]}
        if check:
            ref = [t.detach().clone().requires_grad_() for t in full[:3]]
            ref_out = F.scaled_dot_product_attention(*ref, is_causal=causal)
            ref_out.backward(full[3])
            pick = lambda t: t.detach().index_select(SEQ_DIM, positions).float()  # noqa: E731
            result["forward_error"] = (out.detach().float() - pick(ref_out)).abs().max().item()
            result["grad_error"] = max((mine.grad.float() - pick(theirs.grad)).abs().max().item()
                                       for mine, theirs in zip((q_, k_, v_), ref))
        return result
    finally:
        for group in groups:
            dist.destroy_process_group(group)


# ---------------------------------------------------------------- cost model

def ring_bytes(batch: int, heads: int, seq_len: int, head_dim: int, world_size: int, bytes_per_value: int = 4,
               backward: bool = False) -> int:
    """Bytes one rank sends in ring attention: N-1 K/V blocks forward; backward N-1 more plus N dK/dV passes.

    (The gradient accumulators are fp32 here, as in FlashAttention; count them at ``bytes_per_value``.)
    """
    block = 2 * batch * heads * (seq_len // world_size) * head_dim * bytes_per_value  # K and V
    if world_size == 1:
        return 0
    return (world_size - 1) * block + ((world_size - 1) * block + world_size * block if backward else 0)


def ulysses_bytes(batch: int, heads: int, seq_len: int, head_dim: int, world_size: int, bytes_per_value: int = 4,
                  backward: bool = False) -> float:
    """Bytes one rank sends in Ulysses: 4 all-to-alls (Q, K, V in, output back) of its ``T/N`` shard,
    each sending (N-1)/N of it; backward the same 4 again (dOut in; dQ, dK, dV back)."""
    shard_bytes = batch * heads * (seq_len // world_size) * head_dim * bytes_per_value
    once = 4 * (world_size - 1) / world_size * shard_bytes
    return once * (2 if backward else 1)


def hidden_transfer_tokens(flops_per_second: float, link_bytes_per_second: float, bytes_per_value: int = 2) -> float:
    """Tokens per rank from which ring attention hides its K/V transfer behind the block's compute.

    Per head and step a rank computes ``4·t²·d`` FLOPs (QKᵀ and P·V over its ``t`` queries and the
    block's ``t`` keys) while ``2·t·d·bytes`` of K and V cross the link: hidden when
    ``4t²d/F ≥ 2td·bytes/β``, i.e. ``t ≥ bytes·F / (2β)`` — independent of head size and count.
    """
    return bytes_per_value * flops_per_second / (2 * link_bytes_per_second)
