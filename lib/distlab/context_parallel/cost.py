"""What context parallelism costs on the wire, and when a ring step hides behind compute."""

from __future__ import annotations

# Peak one-direction bandwidth per GPU, bytes/s: what a ring's neighbour transfer gets.
LINK_BANDWIDTH = {
    "NVLink 4 (H100 SXM, in a node)": 450e9,
    "InfiniBand NDR 400 Gb/s (across nodes)": 50e9,
}


def ring_bytes(batch: int, heads: int, seq_len: int, head_dim: int, world_size: int, bytes_per_value: int = 4,
               backward: bool = False, kv_heads: int | None = None) -> int:
    """Bytes one rank sends in ring attention: N-1 K/V blocks forward; backward N-1 more plus N dK/dV passes.

    Only K and V travel, so with grouped-query attention (``kv_heads`` < ``heads``) the ring sends
    ``kv_heads/heads`` of what it would for full multi-head K/V. (The lab's dK/dV accumulators are fp32;
    count them at ``bytes_per_value``.)
    """
    if world_size == 1:
        return 0
    kv = heads if kv_heads is None else kv_heads
    block = 2 * batch * kv * (seq_len // world_size) * head_dim * bytes_per_value  # K and V of one shard
    return (world_size - 1) * block + ((world_size - 1) * block + world_size * block if backward else 0)


def ulysses_bytes(batch: int, heads: int, seq_len: int, head_dim: int, world_size: int, bytes_per_value: int = 4,
                  backward: bool = False, kv_heads: int | None = None) -> float:
    """Bytes one rank sends in Ulysses: all-to-alls of its ``T/N`` shards of Q, K, V in and the output back,
    each sending (N-1)/N of the shard; backward the same again (dOut in; dQ, dK, dV back).

    Q and the output have ``heads`` heads, K and V ``kv_heads`` (grouped-query attention).
    """
    kv = heads if kv_heads is None else kv_heads
    shard_values = batch * (seq_len // world_size) * head_dim * (2 * heads + 2 * kv)
    once = (world_size - 1) / world_size * shard_values * bytes_per_value
    return once * (2 if backward else 1)


def hidden_transfer_tokens(flops_per_second: float, link_bytes_per_second: float, bytes_per_value: int = 2,
                           heads: int = 1, kv_heads: int | None = None) -> float:
    """Tokens per rank from which ring attention hides its K/V transfer behind the block's compute.

    Per step a rank computes ``4·t²·d`` FLOPs per *query* head (QKᵀ and P·V over its ``t`` queries and
    the block's ``t`` keys) while ``2·t·d·bytes`` per *K/V* head cross the link: hidden when
    ``4t²d·H/F ≥ 2td·H_kv·bytes/β``, i.e. ``t ≥ bytes·F·H_kv / (2β·H)``. Independent of the head size;
    with grouped-query attention (``kv_heads`` < ``heads``: a 70B Llama has 8 K/V heads for 64 query
    heads) the block carries ``H_kv/H`` as many bytes per FLOP and the threshold falls by that factor.
    Below it each step waits for the rest of its transfer: the exposed time is the bandwidth term
    ``bytes/β`` minus the compute, not a per-message latency.
    """
    kv = heads if kv_heads is None else kv_heads
    if heads < 1 or not 1 <= kv <= heads or heads % kv:
        raise ValueError(f"kv_heads={kv} must divide heads={heads} (each K/V head serves heads/kv_heads query heads)")
    return bytes_per_value * flops_per_second * kv / (2 * link_bytes_per_second * heads)
