"""What tensor parallelism costs, in formulas the lab checks against its measurements.

* :func:`collectives_per_block` / :func:`collectives_per_step` — every collective a TP GPT
  issues, with its message size M: without sequence parallelism 2 all-reduces forward and 2
  backward per block, each of the block's activation ``b·s·h`` values; with it all-gathers and
  reduce-scatters of the same M (a ring all-reduce *is* a reduce-scatter plus an all-gather).
* :func:`activation_bytes_per_layer_tp` — Korthikanti et al. 2022, Table 2: per-rank activation
  bytes of one layer under TP, and under TP + SP. At ``tp=1`` it is
  :func:`distlab.memory.activation_bytes_per_layer`.
* :func:`gpt_block_activation_bytes` — the same bookkeeping for *this* lab's block (fp32, no
  dropout, fused attention), exact to the byte on CPU.
* :func:`tp_allreduce_seconds` and :data:`LINKS` — the α–β ring model of
  :mod:`distlab.collectives` applied to one TP all-reduce at real scale: why TP stays
  inside an NVLink domain.
"""

from __future__ import annotations

from fractions import Fraction

from distlab.collectives import ring_all_reduce_time
from distlab.model import GPTConfig

__all__ = ["activation_message_bytes", "collectives_per_block", "collectives_per_step",
           "activation_bytes_per_layer_tp", "gpt_block_activation_bytes", "LINKS", "tp_allreduce_seconds"]

LOSS_BYTES_PER_VALUE = 4  # the vocabulary-parallel loss reduces fp32 values, whatever the logits' dtype


def activation_message_bytes(batch: int, seq_len: int, d_model: int, bytes_per_value: int = 4) -> int:
    """M: bytes of one block's activation ``[b, s, h]``, the message of every TP collective."""
    return batch * seq_len * d_model * bytes_per_value


def _add(table: dict, phase: str, kind: str, calls: int, message: int) -> None:
    old_calls, old_bytes = table[phase].get(kind, (0, 0))
    table[phase][kind] = (old_calls + calls, old_bytes + calls * message)


def collectives_per_block(batch: int, seq_len: int, d_model: int, tp: int, sequence_parallel: bool = False,
                          bytes_per_value: int = 4) -> dict[str, dict[str, tuple[int, int]]]:
    """``{"forward"|"backward": {kind: (calls, payload bytes)}}`` for one transformer block.

    Without SP: attention and MLP each end in ``g`` (an all-reduce forward) and start with
    ``f`` (an all-reduce backward): 2 + 2 all-reduces of M. With SP: each region starts with
    an all-gather and ends with a reduce-scatter forward; backward reverses them and, because
    the column-parallel linears saved only the sequence shard, gathers their inputs again:
    2 all-gathers + 2 reduce-scatters forward, 4 all-gathers + 2 reduce-scatters backward.
    Payload = the gathered output (all-gather), the full input (reduce-scatter), the tensor
    (all-reduce): M in every case. Nothing at ``tp=1``.
    """
    table: dict = {"forward": {}, "backward": {}}
    if tp == 1:
        return table
    m = activation_message_bytes(batch, seq_len, d_model, bytes_per_value)
    if sequence_parallel:
        _add(table, "forward", "all_gather", 2, m)
        _add(table, "forward", "reduce_scatter", 2, m)
        _add(table, "backward", "all_gather", 4, m)
        _add(table, "backward", "reduce_scatter", 2, m)
    else:
        _add(table, "forward", "all_reduce", 2, m)
        _add(table, "backward", "all_reduce", 2, m)
    return table


def collectives_per_step(cfg: GPTConfig, batch: int, tp: int, sequence_parallel: bool = False,
                         bytes_per_value: int = 4, replicated_param_bytes: int = 0
                         ) -> dict[str, dict[str, tuple[int, int]]]:
    """Every collective of one training step of :class:`~distlab.tensor_parallel.TensorParallelGPT`.

    ``n_layer`` × :func:`collectives_per_block`, plus the model's edges: the vocabulary-parallel
    embedding (an all-reduce forward, or a reduce-scatter forward and an all-gather backward with
    SP), the output projection (``f``: an all-reduce backward, or with SP the gather-linear's
    all-gather forward and all-gather + reduce-scatter backward) and the loss (three all-reduces
    of one fp32 value per token forward). With SP, ``"after backward"`` is the one all-reduce of
    the replicated parameters' partial gradients (``replicated_param_bytes``).
    """
    table: dict = {"forward": {}, "backward": {}, "after backward": {}}
    if tp == 1:
        return table
    for phase, kinds in collectives_per_block(batch, cfg.seq_len, cfg.d_model, tp, sequence_parallel,
                                              bytes_per_value).items():
        for kind, (calls, payload) in kinds.items():
            _add(table, phase, kind, cfg.n_layer * calls, payload // calls)
    m = activation_message_bytes(batch, cfg.seq_len, cfg.d_model, bytes_per_value)
    if sequence_parallel:
        _add(table, "forward", "reduce_scatter", 1, m)  # embedding
        _add(table, "backward", "all_gather", 1, m)
        _add(table, "forward", "all_gather", 1, m)  # output projection
        _add(table, "backward", "all_gather", 1, m)
        _add(table, "backward", "reduce_scatter", 1, m)
        _add(table, "after backward", "all_reduce", 1, replicated_param_bytes)
    else:
        _add(table, "forward", "all_reduce", 1, m)  # embedding
        _add(table, "backward", "all_reduce", 1, m)  # output projection's f
    _add(table, "forward", "all_reduce", 3, batch * cfg.seq_len * LOSS_BYTES_PER_VALUE)  # max, Σexp, target logit
    return table


def _exact(value: Fraction) -> int | float:
    return int(value) if value.denominator == 1 else float(value)


def activation_bytes_per_layer_tp(seq_len: int, batch: int, d_model: int, n_head: int, tp: int = 1,
                                  sequence_parallel: bool = False, bytes_per_value: int = 2,
                                  flash_attention: bool = False, dropout: bool = True) -> int | float:
    """Per-rank activation bytes of one layer, no recomputation (Korthikanti et al. 2022, Table 2):

        TP:       s·b·h·(10 + 24/t + 5·a·s/(h·t))
        TP + SP:  s·b·h·(34/t + 5·a·s/(h·t))

    Of the 34·sbh bytes of a layer (:func:`distlab.memory.activation_bytes_per_layer`), TP
    splits the 24 inside attention and the MLP and the attention scores; the 10 of the
    LayerNorms, the QKV and fc inputs and the dropout masks stay whole on every rank — SP
    splits those too (storing the QKV and fc inputs as sequence shards). Written for 16-bit
    values; ``bytes_per_value`` rescales; ``flash_attention`` drops the scores' term, as in
    :func:`distlab.memory.activation_bytes_per_layer`. ``dropout=False``: a model trained without
    dropout (Llama; the lab's GPT) keeps no masks: the two 1-byte masks after attention and the MLP
    (2·sbh of the 10, or of SP's 34) go, and of the scores' ``5·a·s/h`` only the softmax output stays (``2·a·s/h``:
    without a dropout between them, the product with V keeps the same tensor).
    """
    s, b, h, a, t = seq_len, batch, d_model, n_head, tp
    masks = 0 if dropout else 2
    whole = Fraction(0 if sequence_parallel else 10 - masks)
    split = Fraction(34 - masks if sequence_parallel else 24)
    scores = 0 if flash_attention else Fraction((5 if dropout else 2) * a * s, t)
    per_value = Fraction(s * b) * (h * (whole + split / t) + scores)
    return _exact(per_value * bytes_per_value / 2)


def gpt_block_activation_bytes(cfg: GPTConfig, batch: int, tp: int = 1, sequence_parallel: bool = False,
                               bytes_per_value: int = 4) -> int:
    """Bytes one block of the lab's GPT saves for backward on one TP rank.

    The Korthikanti bookkeeping for a block without dropout and with fused attention
    (``F.scaled_dot_product_attention`` keeps no s×s scores), in values of ``s·b·h``:

    * whole on every rank unless SP: the LayerNorm inputs and outputs (= QKV and fc inputs): 4;
    * split over t: q, k, v (3), the attention output (= the output projection's input, 1),
      the GELU's input and output (2·mlp_ratio);

    plus per-token statistics: LayerNorm mean and 1/std (4·s·b, split by SP) and the
    attention's log-sum-exp per head (a·s·b, split with the heads).
    """
    s, b, h, a, t, r = cfg.seq_len, batch, cfg.d_model, cfg.n_head, tp, cfg.mlp_ratio
    whole_values = 4 * s * b * h + 4 * s * b  # LayerNorm inputs, outputs and their statistics
    split_values = (4 + 2 * r) * s * b * h + a * s * b
    if sequence_parallel:
        return bytes_per_value * (whole_values + split_values) // t
    return bytes_per_value * (whole_values + split_values // t)


# Per-direction bandwidth one GPU can put on each link: a ring sends one way.
LINKS = {
    "NVLink 4 (H100, 900 GB/s both ways)": 450e9,
    "InfiniBand NDR (400 Gb/s)": 50e9,
}


def tp_allreduce_seconds(seq_len: int, batch: int, d_model: int, tp: int, bytes_per_second: float,
                         bytes_per_value: int = 2, alpha: float = 0.0) -> float:
    """Time of one TP all-reduce of a layer's activation (``b·s·h`` values) on a ring of ``tp`` GPUs.

    :func:`distlab.collectives.ring_all_reduce_time`: ``2(t−1)·α + 2(t−1)/t · M / β``; α = 0
    keeps only the bandwidth term (a lower bound).
    """
    m = activation_message_bytes(batch, seq_len, d_model, bytes_per_value)
    return ring_all_reduce_time(m, tp, alpha, bytes_per_second)
