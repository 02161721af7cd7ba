"""A parallelism planner: which DP × TP × PP × CP (× EP) layout, ZeRO stage, micro-batching and
activation checkpointing trains a model fastest on a cluster, and why the others lose or do not fit.

Nothing here is a new formula. Each number comes from the module that teaches it:

* memory per GPU — :func:`distlab.memory.bytes_per_param` (ZeRO), :func:`distlab.memory.activation_bytes_per_layer`
  (checkpointing) and :func:`distlab.tensor_parallel.activation_bytes_per_layer_tp` (TP + sequence
  parallelism, no dropout masks), times the micro-batches rank 0 of the pipeline holds
  (:func:`distlab.pipeline_parallel.peak_in_flight`);
* communication per step — :func:`distlab.tensor_parallel.collectives_per_block` (TP),
  :func:`distlab.context_parallel.cost.ring_bytes` (CP), one activation per micro-batch and
  stage boundary (PP), and the ring formulas of :mod:`distlab.collectives` (DP, ZeRO), on the
  link the axis's groups use (:meth:`distlab.parallel3d.grid.Grid.nodes_spanned`);
* time — FLOPs per token from :func:`distlab.model.training_flops_per_token`, the pipeline
  bubble from :func:`distlab.pipeline_parallel.bubble_fraction` / ``interleaved_bubble_fraction``,
  and MFU from :func:`distlab.flops.mfu`.

The time model for a published cluster is deliberately simple — compute at a fixed fraction of peak
(``matmul_efficiency``, an assumption no measurement here can check), TP/CP/PP traffic on the critical path, a DP
reduction made once per step hidden behind the last micro-batch's backward, per-micro-batch reduce-scatters behind
every backward, per-micro-batch gathers behind all the compute — so every term can be read and argued with. It ranks
layouts; it does not promise a step time to the millisecond.

On the machine it runs on, the planner can do better: given a :class:`~distlab.parallel3d.calibration.Calibration`
(``calibration=``, measured by :func:`~distlab.parallel3d.calibration.calibrate`), it prices a layout as distlab's
grid worker runs it (fp32, TP without sequence parallelism, DP after the schedule) from measured costs: each stage's
forward and backward per micro-batch from the calibrated block, output layer and embeddings at the layout's own
shapes, with its TP all-reduces on the calibrated links; the schedule replayed with those unequal stage times
(:func:`~distlab.pipeline_parallel.simulate`), the ranks sharing the machine's cores by how busy the schedule keeps
each of them; the messages between stages on the fill and drain; then the DP collectives, the clipping's
all-reduces and the optimizer, none hidden (:func:`calibrated_times`).

ZeRO-2/3 compose with a pipeline (Llama 3 405B ran FSDP over PP 16; torchtitan composes FSDP2 with PP).
What the ``m`` micro-batches of a step cost depends on two choices, and the planner prices both ways
(:attr:`Layout.keep_weights`, :attr:`Layout.keep_grads`): gradients reduce-scattered as each micro-batch's
backward makes them (sharded in HBM, ``m`` messages), or accumulated unsharded and reduce-scattered once
(full gradients in HBM, one message); ZeRO-3's weights gathered for every micro-batch's forward and again
for its backward (``2m`` gathers), or gathered once per step and kept (full weights in HBM). Keeping both
is what Llama 3 did, and at the peak of a step it holds and sends exactly what ZeRO-1 does.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from dataclasses import dataclass, field

from distlab.collectives import all_reduce_cost, ring_all_gather_bytes, ring_all_reduce_bytes
from distlab.context_parallel.cost import ring_bytes
from distlab.flops import PEAK_FLOPS, hfu, mfu, tokens_per_second
from distlab.memory import PRESETS, Preset, activation_bytes_per_layer, bytes_per_param
from distlab.model import GPTConfig, count_params, training_flops_per_token
from distlab.parallel3d.calibration import Calibration
from distlab.parallel3d.grid import Grid
from distlab.pipeline_parallel import (
    COMPUTE,
    bubble_fraction,
    even_partition,
    interleaved_bubble_fraction,
    make_schedule,
    peak_in_flight,
    simulate,
)
from distlab.tensor_parallel import (
    LINKS,
    activation_bytes_per_layer_tp,
    activation_message_bytes,
    collectives_per_block,
    collectives_per_step,
)

__all__ = ["ModelShape", "Cluster", "Layout", "Estimate", "Plan", "h100_cluster", "calibrated_cluster", "estimate",
           "calibrated_times", "prediction_lines", "enumerate_layouts", "plan", "bytes_per_axis", "dp_messages",
           "run_cost", "gradient_all_reduce_seconds", "plot_plan"]

GB = 1e9
OVERLAP_COST = 0.2  # share of overlapped DP traffic that still costs time: NCCL's kernels share the SMs (assumed)


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs to know about a model."""

    name: str
    n_params: int
    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int
    vocab_size: int
    seq_len: int
    embedding_params: int  # parameters only looked up (no matmul): the token (and position) embeddings

    @classmethod
    def from_preset(cls, preset: Preset | str) -> "ModelShape":
        """A Llama-shaped :data:`distlab.memory.PRESETS` entry ("7B", "70B", "405B")."""
        p = PRESETS[preset] if isinstance(preset, str) else preset
        return cls(p.name, p.n_params, p.n_layer, p.d_model, p.n_head, p.n_kv_head, p.vocab_size, p.seq_len,
                   p.vocab_size * p.d_model)

    @classmethod
    def from_config(cls, cfg: GPTConfig, name: str = "lab GPT") -> "ModelShape":
        """The lab's :class:`~distlab.model.GPT`."""
        return cls(name, count_params(cfg), cfg.n_layer, cfg.d_model, cfg.n_head, cfg.n_head, cfg.vocab_size,
                   cfg.seq_len, (cfg.vocab_size + cfg.seq_len) * cfg.d_model)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def layer_params(self) -> float:
        """Parameters of one transformer layer (the rest: embeddings, output layer, final norm)."""
        return (self.n_params - self.embedding_params - self.vocab_size * self.d_model) / self.n_layer

    @property
    def flops_per_token(self) -> int:
        return training_flops_per_token(self.n_params - self.embedding_params, self.n_layer, self.d_model,
                                        self.seq_len)


@dataclass(frozen=True)
class Cluster:
    """GPUs, how they are wired, and what one can do. Bandwidths: one direction, per GPU."""

    name: str
    gpus: int
    gpus_per_node: int = 8
    hbm_bytes: float = 80 * GB
    intra_node_bandwidth: float = 450e9  # NVLink 4 (distlab.tensor_parallel.LINKS)
    inter_node_bandwidth: float = 50e9  # InfiniBand NDR 400 Gb/s, one NIC per GPU
    peak_flops: float = PEAK_FLOPS["H100 SXM bf16"]
    intra_node_latency: float = 2e-6  # α per ring step, seconds
    inter_node_latency: float = 5e-6
    dollars_per_gpu_hour: float = 2.0


def h100_cluster(gpus: int) -> Cluster:
    """H100 SXM nodes of 8 GPUs, NVLink inside a node, one 400 Gb/s InfiniBand NIC per GPU."""
    return Cluster(f"{gpus:,} H100s", gpus, intra_node_bandwidth=LINKS["NVLink 4 (H100, 900 GB/s both ways)"],
                   inter_node_bandwidth=LINKS["InfiniBand NDR (400 Gb/s)"])


def calibrated_cluster(calibration: Calibration, memory_per_rank: float, name: str | None = None) -> Cluster:
    """The calibrated machine as a :class:`Cluster`: one node of ``world_size`` devices with ``memory_per_rank``
    bytes each, its peak the square-matmul rate each rank measured while all multiplied (MFU's denominator), its
    links the world's measured all-reduce. Pass it with ``calibration=`` to :func:`plan` or :func:`estimate`."""
    n = calibration.world_size
    world = calibration.link("all_reduce", n) if n > 1 else None
    bandwidth, latency = (world.beta, world.alpha) if world else (math.inf, 0.0)
    return Cluster(name or f"this machine ({n} ranks, calibrated)", n, gpus_per_node=n, hbm_bytes=memory_per_rank,
                   intra_node_bandwidth=bandwidth, inter_node_bandwidth=bandwidth, peak_flops=calibration.peak_flops,
                   intra_node_latency=latency, inter_node_latency=latency)


@dataclass(frozen=True)
class Layout:
    """One way to run: the degrees, the ZeRO stage, micro-batching and recomputation.

    ``m`` micro-batches of ``micro_batch`` sequences per pipeline per step; ``v`` pipeline
    stages per rank (interleaved 1F1B when ``v > 1``). ``keep_grads`` (ZeRO-2/3): accumulate the
    micro-batches' gradients unsharded and reduce-scatter them once, instead of once per micro-batch;
    ``keep_weights`` (ZeRO-3): gather the weights once per step and keep them until the step ends
    (FSDP's ``reshard_after_forward=False``), instead of for every micro-batch's forward and backward.
    """

    dp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 1
    micro_batch: int = 1
    m: int = 1
    v: int = 1
    checkpointing: bool = False
    keep_grads: bool = False
    keep_weights: bool = False

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def dp_schedule(self) -> str:
        """What the DP axis does over a step's micro-batches, in words (:func:`dp_messages`)."""
        grads, weights = dp_messages(self)
        if self.zero == 0:
            return "gradients accumulated and all-reduced once"
        held = "weights gathered for every micro-batch's forward and backward" if weights > 1 else (
            "whole weights kept over the step, gathered once")
        reduced = ("gradients reduce-scattered after every micro-batch's backward" if grads > 1 else
                   "gradients accumulated whole and reduce-scattered once")
        return f"{held}; {reduced}"

    def __str__(self) -> str:
        axes = " × ".join(f"{name} {value}" for name, value in (("TP", self.tp), ("CP", self.cp), ("PP", self.pp),
                                                                 ("EP", self.ep), ("DP", self.dp))
                          if value > 1 or name in ("TP", "PP", "DP"))
        extras = [f"ZeRO-{self.zero}" if self.zero else "DDP"]
        kept = [what for what, flag in (("weights", self.keep_weights), ("grads", self.keep_grads)) if flag]
        if kept:
            extras.append(f"kept {'+'.join(kept)}")
        extras.append(f"m={self.m}")
        if self.micro_batch > 1:
            extras.append(f"mb={self.micro_batch}")
        if self.v > 1:
            extras.append(f"v={self.v}")
        if self.checkpointing:
            extras.append("ckpt")
        return f"{axes} ({', '.join(extras)})"


@dataclass
class Estimate:
    """What one layout costs: per-GPU memory (bytes), time per step (s), MFU, and why it cannot run.

    ``hfu`` counts the recomputed forward too (:func:`distlab.flops.hfu`): with checkpointing the hardware
    is busier than the model's progress shows, so HFU is above MFU by the recomputed third. ``calibrated``: the
    times come from a :class:`~distlab.parallel3d.calibration.Calibration` (:func:`calibrated_times`), and
    ``seconds`` then also holds ``"step overhead"`` (the optimizer, the clipping's and the loss's all-reduces)."""

    layout: Layout
    reasons: list[str] = field(default_factory=list)
    memory: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    bytes: dict[str, float] = field(default_factory=dict)
    bubble: float = 0.0
    step_time: float = math.inf
    mfu: float = 0.0
    hfu: float = 0.0
    calibrated: bool = False

    @property
    def feasible(self) -> bool:
        return not self.reasons

    def terms(self) -> dict[str, float]:
        """The step in the three terms a run's trace can measure (:func:`distlab.capstone.measured_terms`), adding up
        to :attr:`step_time`: ``"forward and backward"`` (the busiest rank's stage work, its TP and CP collectives
        inside), ``"bubble"`` (what it waits for in the schedule, the messages between stages included) and
        ``"after the schedule"`` (the DP collectives not hidden, and with a calibration the clipping and the
        optimizer)."""
        s = self.seconds
        return {"forward and backward": s["compute"] + s["tp"] + s["cp"], "bubble": s["bubble"] + s["pp"],
                "after the schedule": s["dp exposed"] + s.get("step overhead", 0.0)}

    def summary(self) -> str:
        mem = f"{self.memory.get('total', 0) / GB:6.1f} GB"
        if not self.feasible:
            return f"{self.layout}: {mem}/GPU — " + "; ".join(self.reasons)
        used = f"MFU {self.mfu:.0%}" + (f" (HFU {self.hfu:.0%})" if self.hfu > self.mfu else "")
        return f"{self.layout}: {mem}/GPU, bubble {self.bubble:.0%}, step {self.step_time:.2f} s, {used}"


def _link(cluster: Cluster, layout: Layout, axis: str) -> tuple[float, int]:
    """Bandwidth of ``axis``'s groups and the nodes they span, ranks laid out as Llama 3's [TP, CP, PP, DP]."""
    nodes = _nodes_spanned(layout.dp, layout.pp, layout.tp, layout.cp, axis, cluster.gpus_per_node)
    return (cluster.intra_node_bandwidth if nodes == 1 else cluster.inter_node_bandwidth), nodes


@functools.lru_cache(maxsize=4096)
def _nodes_spanned(dp: int, pp: int, tp: int, cp: int, axis: str, gpus_per_node: int) -> int:
    return Grid(dp=dp, pp=pp, tp=tp, cp=cp).nodes_spanned(axis, gpus_per_node)


def _layers_per_rank(model: ModelShape, layout: Layout) -> int:
    """Layers on the fullest rank: uneven splits put the extra layers somewhere (Llama 3: 126 over 16)."""
    return math.ceil(model.n_layer / (layout.pp * layout.v)) * layout.v


def bytes_per_axis(model: ModelShape, layout: Layout, sequence_parallel: bool = True, bytes_per_value: int = 2,
                   grad_bytes_per_value: int | None = None) -> dict[str, float]:
    """Payload bytes (the message sizes M, as distlab's comm log counts them) the busiest rank
    sends along each axis in one step.

    * tp — :func:`~distlab.tensor_parallel.collectives_per_block` for each of its layers and
      micro-batches, plus the model's edges on the last stage (the output layer's ``f`` and
      the loss's three one-value-per-token all-reduces; :func:`~distlab.tensor_parallel.collectives_per_step`);
    * pp — one activation of a micro-batch per forward and one gradient per backward, except at the ends;
    * cp — :func:`~distlab.context_parallel.cost.ring_bytes`, forward and backward, per layer;
    * dp — this rank's gradients, reduced once per step or (ZeRO-2/3 without ``keep_grads``) once per
      micro-batch, plus the parameters ZeRO's all-gathers return (:func:`dp_messages`).
    """
    t, mb, seq = layout.tp, layout.micro_batch, model.seq_len // layout.cp
    layers = _layers_per_rank(model, layout)
    out = {"tp": 0.0, "pp": 0.0, "cp": 0.0, "dp": 0.0}
    if t > 1:
        if layout.pp == 1:  # every edge of the model on this rank
            shape = GPTConfig(vocab_size=model.vocab_size, seq_len=seq, n_layer=layers, n_head=model.n_head,
                              d_model=model.d_model)
            table = collectives_per_step(shape, mb, t, sequence_parallel, bytes_per_value)
            per_micro = sum(payload for phase in table.values() for _, payload in phase.values())
        else:  # the last stage: its blocks, the output layer's f and the loss; the embedding is on stage 0
            block = collectives_per_block(mb, seq, model.d_model, t, sequence_parallel, bytes_per_value)
            edges = collectives_per_step(GPTConfig(vocab_size=model.vocab_size, seq_len=seq, n_layer=1,
                                                   n_head=model.n_head, d_model=model.d_model),
                                         mb, t, sequence_parallel, bytes_per_value)
            # the embedding's collectives: an all-reduce forward, or with SP a reduce-scatter and an all-gather
            embedding = (2 if sequence_parallel else 1) * activation_message_bytes(mb, seq, model.d_model,
                                                                                   bytes_per_value)
            per_block = sum(payload for phase in block.values() for _, payload in phase.values())
            per_micro = layers * per_block + sum(payload for phase in edges.values()
                                                 for _, payload in phase.values()) - per_block - embedding
        recompute = 0
        if layout.checkpointing:  # the forward runs again in backward, with its collectives
            recompute = layers * sum(payload for _, payload in collectives_per_block(
                mb, seq, model.d_model, t, sequence_parallel, bytes_per_value)["forward"].values())
        out["tp"] = layout.m * (per_micro + recompute)
    if layout.pp > 1:
        activation = activation_message_bytes(mb, seq, model.d_model, bytes_per_value)
        if sequence_parallel:
            activation /= t  # Megatron sends the sequence shard and all-gathers it on arrival
        # forward from each of its stages but the model's last, gradients back from each but the first:
        # a middle rank sends both ways for all v stages; with two ranks, each holds one end
        out["pp"] = layout.m * (2 * layout.v - 1 if layout.pp == 2 else 2 * layout.v) * activation
    if layout.cp > 1:
        out["cp"] = layout.m * layers * ring_bytes(mb, model.n_head, model.seq_len, model.head_dim, layout.cp,
                                                   bytes_per_value, backward=True, kv_heads=model.n_kv_head)
    params = _params_per_rank(model, layout)
    if layout.dp * layout.cp > 1:
        grads, weights = dp_messages(layout)
        out["dp"] = params * (grads * (grad_bytes_per_value or bytes_per_value) + weights * bytes_per_value)
    return out


def _calls_per_axis(model: ModelShape, layout: Layout) -> dict[str, float]:
    """Collective calls per step on each axis, each paying the ring's per-step latency α: TP's per
    block (:func:`~distlab.tensor_parallel.collectives_per_block`), the DP messages bucketed one per
    layer, and CP's ring steps (N-1 forward, 2N-1 backward) per layer."""
    layers = _layers_per_rank(model, layout)
    block = collectives_per_block(1, model.seq_len, model.d_model, layout.tp, sequence_parallel=True)
    forward = sum(c for c, _ in block["forward"].values())
    per_block = forward * (2 if layout.checkpointing else 1) + sum(c for c, _ in block["backward"].values())
    return {"tp": layout.m * layers * per_block,
            "cp": layout.m * layers * (3 * layout.cp - 2) if layout.cp > 1 else 0,
            "dp": layers * sum(dp_messages(layout)) if layout.dp * layout.cp > 1 else 0}


def dp_messages(layout: Layout) -> tuple[int, int]:
    """(gradient reductions, parameter all-gathers) per step on the DP axis, each of the rank's whole
    shard of the model. DDP/ZeRO-1 accumulate the ``m`` micro-batches' gradients locally and reduce once
    (ZeRO-1 then all-gathers the updated parameters); ZeRO-2/3 hold only a shard of the gradients, so each
    micro-batch's are reduce-scattered as backward makes them — or, with ``keep_grads``, accumulated
    unsharded and reduce-scattered once. ZeRO-2 all-gathers the parameters after the step; ZeRO-3 gathers
    them for each micro-batch's forward and again for its backward — or, with ``keep_weights``, once."""
    grads = layout.m if layout.zero >= 2 and not layout.keep_grads else 1
    weights = {0: 0, 1: 1, 2: 1, 3: 1 if layout.keep_weights else 2 * layout.m}[layout.zero]
    return grads, weights


def _params_per_rank(model: ModelShape, layout: Layout) -> float:
    """Parameters on the fullest rank: its layers and the larger end (embedding or output), split by TP."""
    layers = _layers_per_rank(model, layout)
    ends = model.vocab_size * model.d_model if layout.pp > 1 else model.n_params - model.n_layer * model.layer_params
    return (layers * model.layer_params + ends) / layout.tp


def _check(model: ModelShape, cluster: Cluster, layout: Layout, global_batch: int) -> list[str]:
    reasons = []
    if layout.world != cluster.gpus:
        reasons.append(f"uses {layout.world:,} GPUs, the cluster has {cluster.gpus:,}")
    tp_nodes = _nodes_spanned(layout.dp, layout.pp, layout.tp, layout.cp, "tp", cluster.gpus_per_node)
    if tp_nodes > 1:  # more TP ranks than a node has, or TP groups that straddle a node boundary
        reasons.append(f"TP {layout.tp} spans {tp_nodes} nodes: its per-layer collectives would cross the "
                       f"{cluster.inter_node_bandwidth / GB:.0f} GB/s network")
    if model.n_kv_head % layout.tp or model.n_head % layout.tp:
        reasons.append(f"TP {layout.tp} does not divide the {model.n_kv_head} KV heads")
    if layout.ep > 1:
        reasons.append(f"EP {layout.ep} needs experts; {model.name} is dense")
    if model.seq_len % (2 * layout.cp) and layout.cp > 1:
        reasons.append(f"CP {layout.cp} does not split the {model.seq_len}-token sequence into 2·CP chunks")
    if layout.pp * layout.v > model.n_layer:
        reasons.append(f"{layout.pp * layout.v} pipeline stages for {model.n_layer} layers")
    if layout.dp * layout.micro_batch * layout.m != global_batch:
        reasons.append(f"DP {layout.dp} × micro-batch {layout.micro_batch} × m {layout.m} ≠ the global batch of "
                       f"{global_batch} sequences")
    if layout.keep_grads and layout.zero < 2 or layout.keep_weights and layout.zero < 3:
        reasons.append(f"ZeRO-{layout.zero} shards no {'weights' if layout.keep_weights else 'gradients'} "
                       f"to keep unsharded")
    if layout.v > 1 and layout.m % layout.pp:
        reasons.append(f"interleaving needs m={layout.m} to be a multiple of PP {layout.pp}")
    return reasons


def _sizes_of(cluster: Cluster):
    """Memory in the unit of the cluster's HBM, so one line compares like with like: whole GB on GPUs, MB with two
    decimals for a budget below a GB (lab 13's CPU ranks), where whole GB would print every figure as 0."""
    if cluster.hbm_bytes >= GB:
        return lambda n: f"{n / GB:.0f} GB"
    return lambda n: f"{n / 1e6:.2f} MB"


def estimate(model: ModelShape, cluster: Cluster, layout: Layout, global_batch: int,
             matmul_efficiency: float = 0.7, headroom: float = 0.1, precision: str = "mixed",
             overlap_cost: float = OVERLAP_COST, calibration: Calibration | None = None) -> Estimate:
    """Memory, time and MFU of ``layout``, and every reason it cannot run.

    ``matmul_efficiency``: the share of peak FLOP/s the matmuls reach (an assumption, stated; a published
    cluster's planner keeps it, and a ``calibration`` replaces it);
    ``headroom``: the share of HBM kept free for buffers and fragmentation; ``precision``: a
    :func:`distlab.memory.bytes_per_param` precision — ``"mixed_fp32_grads"`` accumulates and
    reduces the gradients in fp32 (Llama 3), doubling their memory and their DP traffic;
    ``overlap_cost``: the share of the DP traffic hidden behind compute that still slows it (an assumption);
    ``calibration``: this machine measured (:func:`~distlab.parallel3d.calibration.calibrate`, with
    :func:`calibrated_cluster` as ``cluster``): the time is then :func:`calibrated_times`'s.
    """
    est = Estimate(layout, reasons=_check(model, cluster, layout, global_batch), calibrated=calibration is not None)
    if calibration is not None and layout.cp > 1:
        est.reasons.append(f"CP {layout.cp}: the calibrated model prices DP × PP × TP only")
    if any("does not divide" in r or "stages for" in r or "interleaving" in r or "global batch" in r
           or "to keep unsharded" in r or "calibrated model" in r for r in est.reasons):
        return est  # the shapes do not work: nothing to estimate
    seq, mb = model.seq_len // layout.cp, layout.micro_batch
    layers = _layers_per_rank(model, layout)
    per_param = bytes_per_param(layout.zero, layout.dp * layout.cp, precision)
    unsharded = bytes_per_param(0, 1, precision)
    params = _params_per_rank(model, layout)
    # Llama trains without dropout (torchtitan's Llama 3 has no dropout layer): no masks to keep
    full_layer = activation_bytes_per_layer_tp(seq, mb, model.d_model, model.n_head, layout.tp,
                                               sequence_parallel=True, flash_attention=True, dropout=False)
    if layout.checkpointing:  # keep each layer's input (a sequence shard), recompute one layer at a time
        per_layer = activation_bytes_per_layer(seq, mb, model.d_model, model.n_head, checkpointing=True) / layout.tp
        working = full_layer
    else:
        per_layer, working = full_layer, 0
    in_flight = peak_in_flight(layout.pp, layout.m, layout.v) if layout.pp > 1 else 1
    # what a step holds at its peak: kept weights or gradients are whole, as without ZeRO
    est.memory = {"params": params * (unsharded.params if layout.keep_weights else per_param.params),
                  "grads": params * (unsharded.grads if layout.keep_grads else per_param.grads),
                  "optimizer": params * per_param.optimizer,
                  "activations": in_flight * layers * per_layer + working}
    est.memory["states"] = est.memory["params"] + est.memory["grads"] + est.memory["optimizer"]
    est.memory["total"] = est.memory["states"] + est.memory["activations"]
    usable = cluster.hbm_bytes * (1 - headroom)
    if est.memory["total"] > usable:
        size = _sizes_of(cluster)
        est.reasons.append(f"needs {size(est.memory['total'])} per GPU ({size(est.memory['states'])} states + "
                           f"{size(est.memory['activations'])} activations), over the {size(usable)} usable of "
                           f"{size(cluster.hbm_bytes)} HBM")
    # time
    tokens = global_batch * model.seq_len
    if calibration is not None:
        est.bytes = bytes_per_axis(model, layout, sequence_parallel=False, bytes_per_value=int(unsharded.params),
                                   grad_bytes_per_value=int(unsharded.grads))
        est.seconds, est.bubble = calibrated_times(model, layout, calibration, int(unsharded.params))
        est.step_time = sum(est.seconds.values())
        est.mfu = mfu(model.flops_per_token, tokens / est.step_time / cluster.gpus, cluster.peak_flops)
        recomputed = model.flops_per_token / 3 if layout.checkpointing else 0.0
        est.hfu = hfu(model.flops_per_token, tokens / est.step_time / cluster.gpus, cluster.peak_flops, recomputed)
        return est
    flops = model.flops_per_token * tokens
    compute = flops / cluster.gpus / (cluster.peak_flops * matmul_efficiency)
    if layout.checkpointing:
        compute *= 4 / 3  # one more forward (2N of the 6N), counted by HFU, not MFU
    est.bytes = bytes_per_axis(model, layout, grad_bytes_per_value=int(unsharded.grads))
    seconds = {"compute": compute}
    links = {axis: _link(cluster, layout, axis) for axis in ("tp", "cp", "pp", "dp")}
    calls = _calls_per_axis(model, layout)

    def on_link(axis: str, wire_bytes: float, latencies: float) -> float:  # the α–β model
        bandwidth, nodes = links[axis]
        alpha = cluster.intra_node_latency if nodes == 1 else cluster.inter_node_latency
        return latencies * alpha + wire_bytes / bandwidth

    # TP with SP: all-gathers and reduce-scatters, (t-1)/t of each payload in t-1 ring steps; the
    # ring-attention and point-to-point bytes are already what a rank sends
    seconds["tp"] = on_link("tp", ring_all_gather_bytes(est.bytes["tp"], layout.tp), calls["tp"] * (layout.tp - 1))
    seconds["cp"] = on_link("cp", est.bytes["cp"], calls["cp"])
    seconds["pp"] = on_link("pp", est.bytes["pp"], 0)
    seconds["dp exposed"] = _dp_exposed(layout, est.bytes["dp"], calls["dp"], compute, on_link, overlap_cost,
                                        unsharded.grads / unsharded.params)
    est.bubble = (bubble_fraction(layout.pp, layout.m) if layout.v == 1 else
                  interleaved_bubble_fraction(layout.pp, layout.m, layout.v))
    slot_work = compute + seconds["tp"] + seconds["cp"] + seconds["pp"]
    seconds["bubble"] = slot_work * est.bubble / (1 - est.bubble)
    est.seconds = seconds
    est.step_time = slot_work + seconds["bubble"] + seconds["dp exposed"]
    est.mfu = mfu(model.flops_per_token, tokens / est.step_time / cluster.gpus, cluster.peak_flops)
    recomputed = model.flops_per_token / 3 if layout.checkpointing else 0.0  # the forward, once more
    est.hfu = hfu(model.flops_per_token, tokens / est.step_time / cluster.gpus, cluster.peak_flops, recomputed)
    return est


def calibrated_times(model: ModelShape, layout: Layout, calibration: Calibration,
                     bytes_per_value: int = 4) -> tuple[dict[str, float], float]:
    """The step of ``layout`` on the calibrated machine, as distlab's grid worker runs it: ``(seconds, bubble)``.

    ``seconds`` splits the step into terms that add up to it: ``compute`` (the busiest rank's forward and backward
    work), ``tp`` (its TP all-reduces, inside that work, as the calibration measured them: two per block each way,
    the embedding's, the output layer's and the loss's three), ``pp`` (what the messages between stages add to the
    schedule, each arriving a calibrated hand-off after both ends posted it), ``bubble`` (what the busiest rank waits
    for in the schedule besides those), ``dp exposed``
    (the DP reduce-scatter and all-gather — or DDP's all-reduce — after the schedule) and ``step overhead`` (the
    clipping's and the loss's all-reduces and the optimizer). ``bubble`` in the return is the busiest rank's idle
    share of the schedule, as :func:`~distlab.pipeline_parallel.trace_bubble` reads it off a run.

    The ranks share the machine: the calibration measured each shape while every rank computed, and each rank alone
    (:attr:`~distlab.parallel3d.calibration.Calibration.cores`). A pipeline keeps its stages idle part of the time,
    and then the busy ones run faster, but only while the others wait: each compute of the schedule runs at a rank's
    speed alone, slowed by the ranks computing during it over the cores (:func:`_replay_sharing_cores`). The step's
    mean demand would not do: the work happens mostly while the others work too, so priced by the mean a pipeline's
    compute comes out faster than it runs.
    """
    t, p, v, m = layout.tp, layout.pp, layout.v, layout.m
    cost = calibration.compute_at(t, layout.micro_batch * model.seq_len)
    activation = activation_message_bytes(layout.micro_batch, model.seq_len, model.d_model, bytes_per_value)
    again = 1.0 if layout.checkpointing else 0.0  # recomputation runs each block's forward again in backward
    stages = even_partition(model.n_layer, p * v)
    work, comm = [], []  # per rank: (forward, backward) seconds, and the TP collectives' share of them
    for r in range(p):
        chunks = [r + k * p for k in range(v)]
        layers = sum(len(stages[c]) for c in chunks)
        f, b = layers * cost.forward, layers * (cost.backward + again * cost.forward)
        collectives = layers * (cost.collectives_forward * (1 + again) + cost.collectives_backward)
        if 0 in chunks:
            f, b = f + cost.embedding_forward, b + cost.embedding_backward
            collectives += cost.embedding_collectives
        if p * v - 1 in chunks:
            f, b = f + cost.head_forward, b + cost.head_backward
            collectives += cost.head_collectives
        work.append((f, b))
        comm.append(collectives)
    alone = calibration.cores / calibration.world_size  # a rank's time alone over its time among busy ranks
    if p == 1:  # every rank computes all the time: the speed measured while all computed
        makespan = without_messages = m * sum(work[0]) * alone * max(1.0, calibration.world_size / calibration.cores)
        busy = [makespan]
    else:
        schedule = make_schedule("interleaved" if v > 1 else "1f1b", p, m, v)
        handoff = calibration.link("send", 2).seconds(activation)
        share = dict(schedule=schedule, m=m, v=v, work=[(f * alone, b * alone) for f, b in work],
                     ranks_per_stage=calibration.world_size // p, cores=calibration.cores)
        sim = _replay_sharing_cores(**share, message=handoff)
        makespan, busy = sim.makespan, sim.busy
        without_messages = _replay_sharing_cores(**share, message=0.0).makespan
    busiest = max(range(len(busy)), key=busy.__getitem__)
    f, b = work[busiest]
    tp_seconds = busy[busiest] * comm[busiest] / (f + b) if f + b > 0 else 0.0  # their share of the rank's work
    # after the schedule, on the fullest rank: the DP messages, the clipping's and the loss's all-reduces, the update
    held = _params_per_rank(model, layout)
    grad_bytes = 4  # the worker reduces gradients in fp32
    n = layout.dp
    if n > 1 and layout.zero >= 1:
        grads, weights = dp_messages(layout)
        dp = (calibration.link("reduce_scatter", n).seconds(held * grad_bytes, grads)
              + calibration.link("all_gather", n).seconds(held * bytes_per_value, weights))
    else:
        dp = calibration.link("all_reduce", n).seconds(held * grad_bytes) if n > 1 else 0.0
    norm_axes = [size for size in ((n if layout.zero >= 1 else 1), p, t) if size > 1]
    small = sum(calibration.link("all_reduce", size).seconds(8) for size in norm_axes)
    small += calibration.link("all_reduce", calibration.world_size).seconds(16) if calibration.world_size > 1 else 0.0
    updated = held / n if layout.zero >= 1 else held
    flattened = held * (1 if layout.zero >= 1 else 2)  # ZeRO-1 flattens the gradients; DDP also copies them back
    optimizer = (calibration.step_fixed + calibration.per_param_updated * updated
                 + calibration.per_param_held * flattened)
    busy_max = busy[busiest]
    seconds = {"compute": busy_max - tp_seconds, "tp": tp_seconds, "cp": 0.0, "pp": makespan - without_messages,
               "bubble": without_messages - busy_max, "dp exposed": dp, "step overhead": small + optimizer}
    return seconds, (makespan - busy_max) / makespan if p > 1 else 0.0


def _replay_sharing_cores(schedule, m: int, v: int, work: list[tuple[float, float]], ranks_per_stage: int,
                          cores: float, message: float, tolerance: float = 1e-3, rounds: int = 60):
    """The pipeline ``schedule`` replayed (:func:`~distlab.pipeline_parallel.simulate`) with each compute slowed by
    the ranks computing while it runs: ``work`` is each pipeline rank's (forward, backward) seconds per micro-batch
    at a rank's speed alone, and a compute during which ``n`` ranks compute on average takes ``max(1, n / cores)``
    times that. Each pipeline rank stands for ``ranks_per_stage`` ranks (its TP peers and its DP replicas run the
    same schedule at the same time). The slowdowns depend on the timeline they shape, so the replay is repeated,
    each time priced by the last one's overlaps (half-way, to settle rather than swing), until no compute's slowdown
    moves by ``tolerance``. Returns the last :class:`~distlab.pipeline_parallel.Simulation`."""
    cost = [{"F": f / v, "B": b / v, "I": b / (2 * v), "W": b / (2 * v)} for f, b in work]
    computes = [[a for a in ops if a.kind in COMPUTE] for ops in schedule]
    base = {tuple(a): cost[r][a.kind] for r, actions in enumerate(computes) for a in actions}
    slowdown = dict.fromkeys(base, 1.0)
    for _ in range(rounds):
        sim = simulate(schedule, m, v, durations={key: base[key] * slowdown[key] for key in base},
                       message_cost=message)
        computing = _ranks_computing(sim.spans, ranks_per_stage)
        moved = 0.0
        for r, actions in enumerate(computes):  # a rank's spans come in the order of its computes
            for a, span in zip(actions, [s for s in sim.spans if s.rank == r]):
                target = max(1.0, computing(span.start, span.end) / cores)
                moved = max(moved, abs(target - slowdown[tuple(a)]))
                slowdown[tuple(a)] = (slowdown[tuple(a)] + target) / 2
        if moved < tolerance:
            break
    return sim


def _ranks_computing(spans, ranks_per_stage: int):
    """A function of ``(start, end)``: how many ranks compute, on average over that interval, in a timeline of
    compute ``spans`` where each span stands for ``ranks_per_stage`` ranks."""
    events = sorted([(s.start, 1) for s in spans] + [(s.end, -1) for s in spans])
    times, area, level = [events[0][0]], [0.0], 0  # area: rank-seconds computed up to each event
    for t, step in events:
        area.append(area[-1] + level * (t - times[-1]))
        times.append(t)
        level += step

    def integral(t: float) -> float:
        i = bisect.bisect_right(times, t) - 1
        if i >= len(times) - 1:
            return area[-1]
        width = times[i + 1] - times[i]
        return area[i] + (area[i + 1] - area[i]) * ((t - times[i]) / width if width > 0 else 0.0)

    def computing(start: float, end: float) -> float:
        return ranks_per_stage * (integral(end) - integral(start)) / (end - start) if end > start else ranks_per_stage

    return computing


def _dp_exposed(layout: Layout, dp_bytes: float, dp_calls: float, compute: float, on_link, overlap_cost: float,
                grad_width: float = 1.0) -> float:
    """Seconds of DP traffic the compute does not hide. Each kind of message has a window it must fit in:
    a reduction or gather made once per step, the last micro-batch's backward (2/3 of its compute); the
    reduce-scatters of every micro-batch, every backward (2/3 of all compute); the gathers of every
    micro-batch, all the compute. The windows nest, so the link is late by the most that any window's
    traffic (its own and that of the narrower windows) overruns it. The part that is hidden is not free:
    ``overlap_cost`` of it is charged too (the collectives' kernels take SMs and memory bandwidth from the
    matmuls they overlap). ``grad_width``: a gradient value's bytes over a parameter's (2 for fp32 gradients
    of bf16 weights), to split the time between the two kinds of message."""
    n = layout.dp * layout.cp
    if n == 1:
        return 0.0
    grads, weights = dp_messages(layout)
    if layout.zero >= 1:  # reduce-scatters and all-gathers: (N-1)/N of each payload in N-1 ring steps
        total = on_link("dp", ring_all_gather_bytes(dp_bytes, n), dp_calls * (n - 1))
    else:  # DDP's all-reduce
        latencies, wire = all_reduce_cost("ring", dp_bytes, n)
        total = on_link("dp", wire, latencies * dp_calls)
    per_gradient = total * grad_width / (grads * grad_width + weights)  # the time of one message of each kind
    per_gather = total / (grads * grad_width + weights)
    once = per_gradient * (grads == 1) + per_gather * (weights == 1)
    grads_each_micro = per_gradient * grads if grads > 1 else 0.0
    backward = compute * 2 / 3
    late = max(0.0, once - backward / layout.m, once + grads_each_micro - backward, total - compute)
    return late + overlap_cost * (total - late)


def prediction_lines(estimate: Estimate, model: ModelShape) -> list[str]:
    """The planner's prediction for a run of ``estimate.layout``, in the figures a run card measures: the step time
    and its terms (:meth:`Estimate.terms`), MFU, the pipeline bubble, the payload each axis sends per step (the
    message sizes, :func:`bytes_per_axis`) and the memory of the model states per rank. Printed before the run it
    predicts (lab 13), and by lab 11's planner for a calibrated machine."""
    terms = ", ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in estimate.terms().items())
    payload = ", ".join(f"{axis.upper()} {estimate.bytes.get(axis, 0) / 1e6:.3f} MB" for axis in ("dp", "pp", "tp"))
    states = estimate.memory["params"] + estimate.memory["grads"] + estimate.memory["optimizer"]
    how = "calibrated on this machine" if estimate.calibrated else "at the assumed matmul efficiency"
    return [f"predicted for {estimate.layout} ({how}):",
            f"  step time {estimate.step_time * 1e3:.1f} ms = {terms}",
            f"  MFU {estimate.mfu:.1%}; pipeline bubble {estimate.bubble:.3f}" + (" (no pipeline)"
                                                                                if estimate.layout.pp == 1 else ""),
            f"  payload per step (message sizes): {payload}",
            f"  memory per rank (weights, gradients, optimizer state): {states / 1e6:.3f} MB"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(model: ModelShape, cluster: Cluster, global_batch: int, tp=(1, 2, 4, 8, 16), cp=(1, 2),
                      zero=(0, 1, 2, 3), micro_batch=(1, 2), v=(1, 2, 4), checkpointing=(False, True),
                      max_pp: int = 64):
    """Every layout that uses all the GPUs and splits the batch: TP and CP as given, PP any
    divisor (up to ``max_pp``), DP the rest, ``m`` = batch / (DP × micro-batch).

    With ``m > 1`` ZeRO-3 is tried with and without ``keep_grads`` as well. The other two ways of keeping
    are not enumerated because they are stages already here: ZeRO-3 keeping its weights over the step holds
    and sends what ZeRO-2 does, and ZeRO-2 (or ZeRO-3 keeping both) accumulating its gradients what ZeRO-1
    does — :func:`estimate` prices them the same."""
    for t, c in itertools.product(tp, cp):
        for p in _divisors(cluster.gpus // (t * c)) if cluster.gpus % (t * c) == 0 else []:
            if p > max_pp or p > model.n_layer:
                continue
            d = cluster.gpus // (t * c * p)
            for mb in micro_batch:
                if global_batch % (d * mb):
                    continue
                m = global_batch // (d * mb)
                stages = [(z, False) for z in zero] + ([(3, True)] if 3 in zero and m > 1 else [])
                for (z, keep), vv, ck in itertools.product(stages, v if p > 1 else (1,), checkpointing):
                    yield Layout(dp=d, tp=t, pp=p, cp=c, zero=z, micro_batch=mb, m=m, v=vv, checkpointing=ck,
                                 keep_grads=keep)


@dataclass
class Plan:
    """Feasible layouts, fastest first, and the near-misses (infeasible, best first) with their reasons."""

    model: ModelShape
    cluster: Cluster
    global_batch: int
    feasible: list[Estimate]
    near_misses: list[Estimate]

    @property
    def best(self) -> Estimate:
        if not self.feasible:
            why = "\n".join("  " + e.summary() for e in self.near_misses[:3])
            raise ValueError(f"no layout of {self.model.name} fits {self.cluster.name} with a batch of "
                             f"{self.global_batch} sequences; the nearest:\n{why}")
        return self.feasible[0]

    def rank_of(self, layout: Layout) -> int | None:
        """1-based place of ``layout`` among the feasible ones (None: not feasible)."""
        return next((i + 1 for i, e in enumerate(self.feasible) if e.layout == layout), None)

    def find(self, **degrees) -> Estimate:
        """The fastest estimate (feasible first) whose layout has these fields, e.g. ``find(tp=4, pp=4)``."""
        for e in self.feasible + self.near_misses:
            if all(getattr(e.layout, k) == val for k, val in degrees.items()):
                return e
        raise KeyError(f"no enumerated layout has {degrees}")

    def table(self, n: int = 5) -> str:
        lines = [f"{self.model.name} on {self.cluster.name}, {self.global_batch} sequences × "
                 f"{self.model.seq_len} tokens"]
        lines += [f"{i + 1:2d}. {e.summary()}" for i, e in enumerate(self.feasible[:n])]
        if not self.feasible:
            lines.append("no feasible layout; the nearest:")
            lines += ["    " + e.summary() for e in self.near_misses[:n]]
        return "\n".join(lines)


def plan(model: ModelShape | str, cluster: Cluster, global_batch: int, matmul_efficiency: float = 0.7,
         headroom: float = 0.1, precision: str = "mixed", overlap_cost: float = OVERLAP_COST,
         calibration: Calibration | None = None, **choices) -> Plan:
    """Estimate every layout of :func:`enumerate_layouts` and rank them by step time
    (``precision``, ``overlap_cost`` and ``calibration`` as in :func:`estimate`)."""
    model = ModelShape.from_preset(model) if isinstance(model, str) else model
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global_batch must be a positive number of sequences, got {global_batch!r}")
    if calibration is not None and calibration.world_size != cluster.gpus:
        raise ValueError(f"the calibration measured {calibration.world_size} ranks, the cluster has {cluster.gpus}: "
                         f"plan with calibrated_cluster(calibration, memory_per_rank)")
    estimates = [estimate(model, cluster, layout, global_batch, matmul_efficiency, headroom, precision, overlap_cost,
                          calibration)
                 for layout in enumerate_layouts(model, cluster, global_batch, **choices)]
    feasible = sorted((e for e in estimates if e.feasible), key=lambda e: (e.step_time, e.memory["total"]))
    # near-misses: the shapes work, only a resource is short; least over the limit first
    near = sorted((e for e in estimates if not e.feasible and e.memory),
                  key=lambda e: (len(e.reasons), e.memory["total"], e.step_time))
    return Plan(model, cluster, global_batch, feasible, near)


def run_cost(model: ModelShape | str, tokens: float, cluster: Cluster, mfu_value: float,
             tokens_per_step: float) -> dict[str, float]:
    """The seeds' arithmetic for a whole run: steps, days and dollars to train on ``tokens`` at ``mfu_value``."""
    model = ModelShape.from_preset(model) if isinstance(model, str) else model
    rate = tokens_per_second(mfu_value, model.flops_per_token, cluster.peak_flops, cluster.gpus)
    seconds = tokens / rate
    return {"steps": tokens / tokens_per_step, "days": seconds / 86400, "tokens_per_second": rate,
            "dollars": seconds / 3600 * cluster.gpus * cluster.dollars_per_gpu_hour,
            "six_n_d_flops": 6 * model.n_params * tokens}


def gradient_all_reduce_seconds(model: ModelShape | str, gpus: int, bandwidth: float,
                                bytes_per_value: int = 2) -> float:
    """One DDP gradient all-reduce of the whole model over a ring of ``gpus`` at ``bandwidth`` (bytes/s)."""
    model = ModelShape.from_preset(model) if isinstance(model, str) else model
    return ring_all_reduce_bytes(model.n_params * bytes_per_value, gpus) / bandwidth


def plot_plan(ax, result: Plan, highlight: Layout | None = None, hbm_headroom: float = 0.1):
    """Every estimated layout as memory per GPU against MFU: feasible ones coloured by PP,
    those over the memory limit grey; ``highlight`` (a published layout, say) starred."""
    import matplotlib  # noqa: PLC0415  matplotlib is heavy and only the plot needs it

    usable = result.cluster.hbm_bytes * (1 - hbm_headroom) / GB
    over = [e for e in result.near_misses if e.mfu > 0]
    if over:
        ax.scatter([e.memory["total"] / GB for e in over], [e.mfu for e in over], s=8, c="0.8",
                   label="does not fit or not allowed")
    depths = sorted({e.layout.pp for e in result.feasible})
    cmap = matplotlib.colormaps["viridis"]
    for i, pp in enumerate(depths):
        group = [e for e in result.feasible if e.layout.pp == pp]
        ax.scatter([e.memory["total"] / GB for e in group], [e.mfu for e in group], s=14,
                   color=cmap(i / max(1, len(depths) - 1)), label=f"PP {pp}")
    if highlight is not None:
        e = next((e for e in result.feasible + result.near_misses if e.layout == highlight), None)
        if e is not None:
            ax.scatter([e.memory["total"] / GB], [e.mfu], marker="*", s=220, color="crimson", zorder=5,
                       label=str(highlight).split(" (")[0])
    ax.axvline(usable, color="crimson", lw=1, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("memory per GPU (GB, log)")
    ax.set_ylabel("estimated MFU")
    ax.set_title(f"{result.model.name} on {result.cluster.name}: {len(result.feasible)} feasible layouts", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return ax
