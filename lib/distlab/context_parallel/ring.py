"""Ring attention (Liu, Zaharia & Abbeel 2023): K/V blocks travel around a ring of ranks.

Forward: step i computes this rank's queries against the block that came from rank
``(rank - i) mod N`` while the next block is already on the wire, and merges the result by
log-sum-exp. Backward: K/V go around again and each block's dK/dV accumulator travels with it.
Messages are ``batch_isend_irecv`` point-to-point ops, so the same code runs on gloo and NCCL.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distlab.collectives import ring_peers
from distlab.context_parallel.blocks import (
    SEQ_DIM,
    _check_layout,
    attention_block,
    attention_block_backward,
    layout_positions,
    merge_attention,
)

_KV_TAG, _GRAD_TAG = 7, 8  # gloo matches p2p messages by tag: K/V and dK/dV never mix (NCCL keeps order)


def ring_pass(send: torch.Tensor, recv: torch.Tensor, group=None, tag: int = _KV_TAG) -> list:
    """Post ``send`` to the right neighbour and ``recv`` from the left one; return the handles to wait on.

    One ``batch_isend_irecv`` for both: NCCL runs the pair as one group (a ring of plain sends
    could deadlock there), gloo progresses both on its I/O threads while this thread computes.
    """
    _, _, right, left = ring_peers(group)
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
    rank, world, _, _ = ring_peers(group)
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
    rank, world, _, _ = ring_peers(group)
    seq_len = q.shape[SEQ_DIM] * world
    q_pos = _positions(causal, seq_len, world, rank, layout)
    delta = (dout.float() * out.float()).sum(-1)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = torch.stack([k, v]).contiguous()
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)  # the accumulator of the block in hand
    grad_requests = []
    dkv_incoming = None  # filled by the previous step's ring_pass, read from step 1 on
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


