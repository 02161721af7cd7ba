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

from distlab.context_parallel.blocks import (
    LAYOUTS,
    SEQ_DIM,
    TILE,
    Work,
    attention_block,
    attention_block_backward,
    blockwise_attention,
    layout_positions,
    measure_work,
    merge_attention,
    online_softmax_attention,
    shard,
    unshard,
)
from distlab.context_parallel.cost import LINK_BANDWIDTH, hidden_transfer_tokens, ring_bytes, ulysses_bytes
from distlab.context_parallel.measure import PeakMemory, verify
from distlab.context_parallel.ring import (
    RingAttention,
    ring_attention,
    ring_attention_backward,
    ring_attention_forward,
    ring_pass,
)
from distlab.context_parallel.train import train
from distlab.context_parallel.ulysses import (
    heads_to_seq,
    seq_to_heads,
    ulysses_attention,
    usp_attention,
    usp_groups,
    usp_positions,
)

__all__ = [
    "SEQ_DIM", "LAYOUTS", "TILE", "layout_positions", "shard", "unshard", "Work", "measure_work", "attention_block",
    "attention_block_backward", "merge_attention", "online_softmax_attention", "blockwise_attention", "ring_pass",
    "ring_attention_forward", "ring_attention_backward", "RingAttention", "ring_attention", "seq_to_heads",
    "heads_to_seq", "ulysses_attention", "usp_groups", "usp_positions", "usp_attention", "PeakMemory", "verify",
    "ring_bytes", "ulysses_bytes", "hidden_transfer_tokens", "LINK_BANDWIDTH", "train",
]
