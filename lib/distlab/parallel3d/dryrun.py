"""Dry runs: one rank of a DP × PP × TP job of any size, built and stepped on this machine with the course's code.

Labs 04–11 prove each parallelism on 2–8 real ranks; the planner (:mod:`~distlab.parallel3d.planner`) prices
layouts at 1,024–16,384 GPUs from formulas. A dry run connects the two: rank ``r`` of the full job runs one
training step in this process, through the *same* modules the labs use — lab 05's tensor-parallel GPT
(:class:`~distlab.tensor_parallel.TensorParallelGPT`, with sequence parallelism), cut into lab 06's pipeline stages
(:class:`~distlab.pipeline_parallel.StageModule`, run by :func:`~distlab.pipeline_parallel.run_schedule` under
1F1B or interleaved 1F1B), lab 04's ZeRO-1 optimizer with mixed precision
(:class:`~distlab.zero.ShardedOptimizer`; with ``zero=0`` the same class as a flat-master DDP optimizer) and lab
04's activation checkpointing (:func:`~distlab.zero.checkpoint_module`) — and records what the rank would send
and hold. Two things make that possible without the job's GPUs:

* **a fake process group of the full world size**: torch's ``fake`` backend (``FakeProcessGroup``, registered
  by ``torch.testing._internal.distributed.fake_pg``) accepts every collective and point-to-point call of any
  group and returns at once, moving nothing — "it would produce wrong results for every collective", its
  docstring says. torchtitan validates a 128-GPU configuration on one device the same way
  (``COMM_MODE="fake_backend"``, ``docs/debugging.md``). distlab's comm log (:mod:`distlab.runtime.comm`) wraps
  the Python calls, so every call is counted with its group and message bytes exactly as on real ranks;
* **the meta device**: tensors with shapes and dtypes and no storage. ``GPT(cfg, device="meta")`` builds the
  405B model without allocating it; every op computes only its output's shape, so a layer's forward and backward
  on an 8,192-token micro-batch cost milliseconds of CPU.

What it measures, per rank: every collective and send with its group (the axis) and payload bytes, and the
bytes of parameters, gradients and optimizer state (:func:`distlab.memory.tensor_bytes`), the peak of what
autograd saves for backward (lab 06's :class:`~distlab.pipeline_parallel.SavedActivations`) and the peak of
everything alive during the step (:class:`LiveBytes`: each storage an op creates, until it is freed).
What it cannot: time (no kernel runs, no byte moves) and numerics (a meta tensor has no values: the loss the
executor reads is NaN) — and any path whose *shapes* depend on values, such as lab 08's expert-parallel
all-to-all, sized from routed token counts (``.tolist()``). :data:`NOT_COMPOSED` says, one line each, what a
dry run refuses and why.

:func:`dry_run` runs ranks in a fresh interpreter (the fake group and the comm wrappers are process-wide) and
returns a :class:`DryRun` with its wall time and peak RSS; :func:`rank_step` is the step itself, which a test
also runs on 8 real gloo ranks to prove the dry run's bytes and memory equal theirs; :func:`compare` puts a
dry run beside the planner's :class:`~distlab.parallel3d.planner.Estimate`, term by term.

From Python (three ranks of Llama 3 405B's layout, in about ten seconds of CPU and under half a gigabyte)::

    dry_run("405B", Layout(dp=128, pp=16, tp=8, m=16, v=4, zero=1, checkpointing=True))

which runs ``python -m distlab.parallel3d.dryrun SPEC``, SPEC being :meth:`DryRunSpec.to_json`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import resource
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from distlab.memory import PRESETS, Preset, tensor_bytes
from distlab.model import GPT, GPTConfig, synthetic_batch
from distlab.parallel3d.grid import Grid, check_3d_setup, process_groups
from distlab.parallel3d.planner import Estimate, Layout, ModelShape, bytes_per_axis
from distlab.pipeline_parallel import (
    SavedActivations,
    StageModule,
    check_setup,
    even_partition,
    make_schedule,
    run_schedule,
)
from distlab.reference import make_optimizer
from distlab.runtime import comm
from distlab.runtime.rank import device
from distlab.tensor_parallel import (
    TensorParallelGPT,
    activation_bytes_per_layer_tp,
    check_tp_sizes,
    shard_range,
    tp_rank,
    tp_size,
    vocab_parallel_cross_entropy,
)
from distlab.zero.flat import Axis
from distlab.zero.fsdp import checkpoint_module
from distlab.zero.optim import ShardedOptimizer

__all__ = ["LLAMA", "NOT_COMPOSED", "TOLERANCE", "lab_config", "DryRunSpec", "check_dry_run", "LiveBytes",
           "rank_roles", "flash_attention_on_meta", "rank_step", "DryRun", "dry_run", "Term", "compare", "explain",
           "comparison_table"]

# The Llama shapes a dry run and the heatmap name: two small Llama 3 models beside the planner's presets.
LLAMA: dict[str, Preset] = {
    # Llama 3.2 1B (meta-llama/Llama-3.2-1B config.json; it ties its embeddings, counted untied here as the 3D
    # run needs) and Llama 3 8B (Dubey et al. 2024, Table 3)
    "1B": Preset("1B", n_layer=16, d_model=2048, n_head=32, n_kv_head=8, ffn_dim=8192, vocab_size=128256,
                 seq_len=8192),
    "8B": Preset("8B", n_layer=32, d_model=4096, n_head=32, n_kv_head=8, ffn_dim=14336, vocab_size=128256,
                 seq_len=8192),
    **PRESETS,
}

# What a dry run refuses, one line each: a path of the course's code that the 3D composition does not have, or
# that cannot run on a fake group or the meta device.
NOT_COMPOSED = {
    "cp": "context parallelism: lab 07's ring attention is not composed into the 3D GPT (its attention is lab 05's)",
    "ep": "expert parallelism: lab 08's all-to-all is sized from routed token counts (.tolist()), values a meta "
          "tensor does not have",
    "zero": "ZeRO-2/3 under a pipeline: lab 04's ZeRO2/ZeRO3 wrap a whole model's backward; the 3D run composes "
            "ZeRO-1 (ShardedOptimizer over the DP group) or DDP",
}
TOLERANCE = 0.05  # a term more than 5% off the planner's is named
FORWARD_BACKWARD, OPTIMIZER_STEP = "forward and backward", "optimizer step"  # the measured step's two phases
PEAK_TERMS = {FORWARD_BACKWARD: "peak fwd/bwd", OPTIMIZER_STEP: "peak step"}


def lab_config(model: str | Preset, seq_len: int | None = None) -> GPTConfig:
    """The lab's GPT at a Llama model's shape: its vocabulary, layers, width, heads and sequence length, untied
    embeddings (as Llama). The lab's GPT has no grouped-query attention, no SwiGLU and no RoPE: full multi-head
    attention (4·d² a layer), a GELU MLP of ``mlp_ratio·d`` (2·ratio·d²), biases and a learned position embedding;
    the ratio is the integer that brings a layer's parameters closest to the Llama layer's."""
    preset = LLAMA[model] if isinstance(model, str) else model
    d = preset.d_model
    ratio = max(1, round((preset.layer_params / d**2 - 4) / 2))
    return GPTConfig(vocab_size=preset.vocab_size, seq_len=seq_len or preset.seq_len, n_layer=preset.n_layer,
                     n_head=preset.n_head, d_model=d, mlp_ratio=ratio, tied_embeddings=False)


@dataclass(frozen=True)
class DryRunSpec:
    """One job and the ranks to step: the model (a :class:`~distlab.model.GPTConfig`), the layout, the precision
    (``"mixed"``: bf16 weights, gradients and activations, fp32 master and Adam state, as the planner's
    ``precision="mixed"`` holds them — the gradients are reduced in fp32, :class:`ShardedOptimizer`'s way;
    ``"fp32"``) and sequence parallelism (on wherever TP > 1, as the planner assumes)."""

    cfg: GPTConfig
    layout: Layout
    ranks: tuple[int, ...] = (0,)
    precision: str = "mixed"
    sequence_parallel: bool = True
    name: str = ""

    def to_json(self) -> str:
        return json.dumps({"cfg": dataclasses.asdict(self.cfg), "layout": dataclasses.asdict(self.layout),
                           "ranks": list(self.ranks), "precision": self.precision,
                           "sequence_parallel": self.sequence_parallel, "name": self.name})

    @classmethod
    def from_json(cls, text: str) -> "DryRunSpec":
        raw = json.loads(text)
        return cls(GPTConfig(**raw["cfg"]), Layout(**raw["layout"]), tuple(raw["ranks"]), raw["precision"],
                   raw["sequence_parallel"], raw["name"])

    @property
    def grid(self) -> Grid:
        return Grid(dp=self.layout.dp, pp=self.layout.pp, tp=self.layout.tp)

    @property
    def batch(self) -> int:
        """Sequences per step over the whole job."""
        return self.layout.dp * self.layout.micro_batch * self.layout.m

    @property
    def schedule(self) -> str:
        return "interleaved" if self.layout.v > 1 else "1f1b"

    @property
    def sp(self) -> bool:
        return self.sequence_parallel and self.layout.tp > 1


def check_dry_run(spec: DryRunSpec) -> None:
    """Every size the dry run needs, checked before anything starts: one ``ValueError`` line."""
    layout, cfg = spec.layout, spec.cfg
    for axis in ("cp", "ep"):
        if getattr(layout, axis) > 1:
            raise ValueError(f"{axis}={getattr(layout, axis)}: a dry run cannot compose {NOT_COMPOSED[axis]}")
    if layout.zero not in (0, 1):
        raise ValueError(f"zero={layout.zero}: a dry run cannot compose {NOT_COMPOSED['zero']}")
    if layout.keep_grads or layout.keep_weights:
        raise ValueError("keep_grads/keep_weights describe ZeRO-2/3; the dry run composes ZeRO-1 or DDP")
    if spec.precision not in ("mixed", "fp32"):
        raise ValueError(f"precision={spec.precision!r}; expected 'mixed' (bf16 with fp32 master) or 'fp32'")
    check_3d_setup(cfg, spec.grid, layout.m, spec.batch, zero=layout.zero)
    check_tp_sizes(cfg, layout.tp, spec.sp)
    check_setup(layout.pp, layout.m, cfg.n_layer, layout.m * layout.micro_batch, spec.schedule, layout.v)
    bad = [r for r in spec.ranks if not 0 <= r < spec.grid.world]
    if bad or not spec.ranks:
        raise ValueError(f"ranks {list(spec.ranks)}: choose ranks in 0..{spec.grid.world - 1}")


def rank_roles(grid: Grid) -> dict[str, int]:
    """One rank per pipeline role, in the first replica and TP slice: the first stage (the embedding), a middle
    stage when there is one, the last stage (the output layer and the loss)."""
    at = lambda s: int(grid.ranks()[0, s, 0, 0])  # noqa: E731
    roles = {"first stage": at(0)}
    if grid.pp > 2:
        roles["middle stage"] = at(grid.pp // 2)
    if grid.pp > 1:
        roles["last stage"] = at(grid.pp - 1)
    return roles


# ---------------------------------------------------------------- memory: every storage alive

def _tensors(obj):
    """The tensors in ``obj``, nested tuples and lists of them (what an op takes and returns), depth first."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list, type({}.values()))):
        for item in obj:
            yield from _tensors(item)


_SENDS = {torch.ops.c10d.send.default}  # the op a point-to-point send dispatches (dist.send and dist.isend)


class LiveBytes(TorchDispatchMode):
    """Bytes of every storage an op creates while the mode is on, until it is freed, and their peak, by kind.

    An op's output whose storage is none of its inputs' is a new allocation (a view, an in-place result or a
    collective's output is not, whenever its storage was made); a weak-reference finaliser on the storage subtracts
    its bytes when the last tensor using it goes. Meta tensors have storages with a size and no memory, so the same
    count runs on the meta device and on real tensors.

    ``phase`` names the part of the step running (set by the caller); each storage belongs to the phase that made
    it unless tagged: :meth:`tag` moves a storage to another kind (the caller tags gradients), and a tensor handed
    to a point-to-point send becomes ``"sent"``. ``peaks[phase]`` is the most alive during each phase and
    ``composition[phase]`` what it was made of then, by kind; ``set_by[phase]`` the allocation that reached it;
    ``peak`` and ``peak_phase`` the overall peak.

    A meta tensor has no value to read: ``.item()`` (the loss the executor logs) returns NaN under this mode.
    """

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.phase = self.peak_phase = ""
        self.peaks: dict[str, int] = {}
        self.composition: dict[str, dict[str, int]] = {}
        self.set_by: dict[str, tuple[str, int]] = {}  # the op, and the bytes it allocated, that reached each peak
        self._alive: dict[int, tuple[int, str]] = {}  # storage id -> (bytes, kind)
        self._by_kind: dict[str, int] = {}
        self._op = None  # the op being dispatched

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
            return math.nan
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._op = func
        if func in _SENDS:
            for t in _tensors(args):
                self.tag(t, "sent")
        outputs = [out] if isinstance(out, torch.Tensor) else [t for t in _tensors(out)]
        if outputs:
            inputs = {id(a.untyped_storage()) for a in _tensors((args, kwargs.values()))}
            for t in outputs:
                self._track(t, inputs)
        return out

    def tag(self, t: torch.Tensor, kind: str) -> None:
        """Count ``t``'s storage (if this mode made it) as ``kind`` from now on."""
        key = id(t.untyped_storage())
        if key in self._alive and self._alive[key][1] != kind:
            nbytes, old = self._alive[key]
            self._alive[key] = (nbytes, kind)
            self._by_kind[old] -= nbytes
            self._by_kind[kind] = self._by_kind.get(kind, 0) + nbytes

    def _track(self, t: torch.Tensor, inputs: set[int]) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._alive or key in inputs:  # seen, or a view or in-place result: no new memory
            return
        nbytes = storage.nbytes()
        self._alive[key] = (nbytes, self.phase)
        self._by_kind[self.phase] = self._by_kind.get(self.phase, 0) + nbytes
        weakref.finalize(storage, self._release, key)
        self.live += nbytes
        if self.live > self.peaks.get(self.phase, 0):
            self.peaks[self.phase] = self.live
            self.composition[self.phase] = {kind: n for kind, n in self._by_kind.items() if n}
            self.set_by[self.phase] = (str(self._op), nbytes)
        if self.live > self.peak:
            self.peak, self.peak_phase = self.live, self.phase

    def _release(self, key: int) -> None:
        nbytes, kind = self._alive.pop(key, (0, ""))
        self.live -= nbytes
        if nbytes:
            self._by_kind[kind] -= nbytes


@contextlib.contextmanager
def flash_attention_on_meta():
    """``F.scaled_dot_product_attention`` of meta tensors runs the kernel a device would run, while this is on.

    On the meta device SDPA has no fused kernel to choose and falls back to its math path, which keeps the
    ``s × s`` attention probabilities for backward — 2 GB a layer at 405B's 8,192 tokens. A GPU runs FlashAttention
    and the CPU its flash kernel (``_scaled_dot_product_flash_attention_for_cpu``), both keeping only the output and
    one log-sum-exp per row; on meta tensors this calls that kernel, whose shapes the meta device knows. The
    function itself is replaced in ``torch.nn.functional``: SDPA picks its kernel below the dispatch modes, and a
    torch-function mode is not active in the forward that a checkpointed block recomputes in backward (tried: the
    recompute took the math path and checkpointing refused the mismatch). So only the dry run's own process turns
    it on. Real tensors, masks and dropout pass through unchanged."""
    real = F.scaled_dot_product_attention

    @functools.wraps(real)
    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        if query.device.type == "meta" and attn_mask is None and not dropout_p and set(kwargs) <= {"scale"}:
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, is_causal,
                                                                              **kwargs)[0]
        return real(query, key, value, attn_mask, dropout_p, is_causal, **kwargs)

    F.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = real


# ---------------------------------------------------------------- the step: one rank, any process group

class _SequenceParallelStage(StageModule):
    """Lab 06's stage of a sequence-parallel TP model. Two things differ from :class:`StageModule`: the first
    stage adds the position embedding of its own sequence shard (as :class:`TensorParallelGPT` does), and what
    crosses a stage boundary is a ``[rows, T/t, d]`` shard. ``run_schedule`` sizes its receive buffers
    ``rows × T × width``, so ``width`` is ``d/t`` — the shard's number of values — and the channel
    (:class:`_ShardChannels`) gives the buffer the shard's shape before receiving into it."""

    def __init__(self, model: TensorParallelGPT, layers: range, first: bool, last: bool):
        super().__init__(model, layers, first, last)
        self.group = model.group
        self.width = model.cfg.d_model // tp_size(model.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:  # token ids [rows, T] -> this rank's hidden shard [rows, T/t, d]
            T = x.shape[1]
            positions = torch.arange(T, device=x.device)[shard_range(T, tp_size(self.group), tp_rank(self.group))]
            x = self.tok_emb(x) + self.pos_emb(positions)
        for block in self.blocks.values():
            x = block(x)
        if self.last:
            x = self.lm_head(self.ln_f(x))
        return x


class _ShardChannels:
    """Lab 06's channels, receiving a sequence shard: ``[rows, T, d/t]`` buffers viewed as ``[rows, T/t, d]``."""

    def __init__(self, channels, tp: int):
        self.channels, self.tp = channels, tp

    def send(self, tensor: torch.Tensor, dst: int, kind: str = "act"):
        return self.channels.send(tensor, dst, kind)

    def recv(self, buffer: torch.Tensor, src: int, kind: str = "act"):
        rows, T, width = buffer.shape
        buffer.resize_(rows, T // self.tp, width * self.tp)  # the same number of values: the storage stays
        return self.channels.recv(buffer, src, kind)


def _axis_of_groups(spec: DryRunSpec, rank: int) -> dict[str, str]:
    """The comm log names a group by its ranks ("4,5"): which axis each of this rank's groups is."""
    grid, names = spec.grid, {}
    for axis in grid.axes:
        names[",".join(map(str, grid.group_of(rank, axis)))] = axis
    pipeline = grid.group_of(rank, "pp")
    for a, b in zip(pipeline, pipeline[1:] + pipeline[:1]):  # the pipeline's channels (a pair each way)
        names[",".join(map(str, sorted((a, b))))] = "pp"
    return names


def _optimizer_bytes(opt: ShardedOptimizer) -> int:
    """The optimizer's state: fp32 master shards (mixed precision) and Adam's moments and step counters."""
    masters = [flat.master for flat in opt.flat_params]
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return tensor_bytes(masters + state)


def rank_step(spec: DryRunSpec, dry: bool | None = None) -> dict:
    """Build this rank's part of ``spec``'s job on the current process group and run one training step.

    On a fake group (``dry``, the default there) every parameter, batch and activation is on the meta device;
    on real ranks they are real. Either way the same modules do the same work: the GPT, its TP slice, this
    rank's pipeline stages (``v`` of them when interleaved, each block checkpointed when the layout says so),
    the ZeRO-1 (or DDP) optimizer over the DP group in the spec's precision. A warm-up optimizer step creates the
    optimizer state (it is there in every step but the first); the measured step follows: the schedule, the
    sequence-parallel gradient all-reduce over TP, the optimizer step.

    Returns the rank, its coordinates and role, its layers, the comm log of the measured step as
    ``[op, axis, payload bytes]`` in order, the payload bytes and calls per axis, and memory in bytes:
    ``params``, ``grads``, ``optimizer``, ``activations`` (the peak autograd saved for backward), ``peak``
    (parameters and optimizer state plus the peak of everything the step allocated), ``peak_phase``, and
    ``phases``: for :data:`FORWARD_BACKWARD` and :data:`OPTIMIZER_STEP` the peak within it and what the step's
    allocations were then, by kind (:class:`LiveBytes`: ``"grads"``, ``"sent"``, or the phase that made them);
    and ``loss``, the mean over the micro-batches on the last stage's ranks (NaN dry, None elsewhere).
    """
    rank, start = dist.get_rank(), time.perf_counter()
    dry = dist.get_backend() == "fake" if dry is None else dry
    layout, cfg, grid = spec.layout, spec.cfg, spec.grid
    grid.check_world(dist.get_world_size())
    groups = process_groups(grid)
    d, s0 = groups.coords["dp"], groups.coords["pp"]
    where = torch.device("meta") if dry else device()
    gpt = GPT(cfg, device="meta" if dry else "cpu").to(where)
    tp_model = TensorParallelGPT(gpt, groups.tp, sequence_parallel=spec.sp)
    del gpt
    n_stages = layout.pp * layout.v
    parts = even_partition(cfg.n_layer, n_stages)
    stage_class = _SequenceParallelStage if spec.sp else StageModule
    stages = {s: stage_class(tp_model, parts[s], s == 0, s == n_stages - 1) for s in range(s0, n_stages, layout.pp)}
    if layout.checkpointing:
        for stage in stages.values():
            for block in stage.blocks.values():
                checkpoint_module(block)
    params = [p for stage in stages.values() for p in stage.parameters()]
    dp_axis = Axis(groups.dp if layout.dp > 1 else None, layout.dp, d)
    shard, replicate = (dp_axis, Axis.single()) if layout.zero == 1 else (Axis.single(), dp_axis)
    opt = ShardedOptimizer(params, functools.partial(make_optimizer, optimizer="adamw", lr=1e-4), shard=shard,
                           replicate=replicate, dtype=torch.bfloat16 if spec.precision == "mixed" else None)
    opt.step()  # the warm-up: Adam's state exists from here on, as in every step after the first
    opt.zero_grad(set_to_none=True)

    rows = layout.m * layout.micro_batch
    if dry:
        x = y = torch.empty(rows, cfg.seq_len, dtype=torch.int64, device=where)
    else:
        x, y = (t.to(where) for t in synthetic_batch(cfg, rows, 0, seed=d))
    micro = list(zip(x.chunk(layout.m), y.chunk(layout.m)))
    actions = make_schedule(spec.schedule, layout.pp, layout.m, layout.v)[s0]
    chan = _ShardChannels(groups.pipe, layout.tp) if spec.sp else groups.pipe
    saved = SavedActivations(list(stages.values()))
    live = LiveBytes()
    for p in params:  # gradients are their own kind from the moment .grad holds them
        p.register_post_accumulate_grad_hook(lambda p: live.tag(p.grad, "grads"))
    log = comm.current_log()
    first_event = len(log.events)
    with live:
        live.phase = FORWARD_BACKWARD
        stats = run_schedule(actions, stages, micro, p=layout.pp, num_stages=n_stages, memory=saved, chan=chan,
                             loss_fn=functools.partial(vocab_parallel_cross_entropy, group=groups.tp))
        grads = tensor_bytes(p.grad for p in params)
        live.phase = OPTIMIZER_STEP
        tp_model.sync_sequence_parallel_grads()
        opt.step()
    axis_of = _axis_of_groups(spec, rank)
    events = [[comm.canonical(op), axis_of.get(group, group), size]
              for (op, size, _, _), (_, group) in zip(log.events[first_event:], log.peers[first_event:])]
    sent = [e for e in events if e[0] not in ("recv", "irecv")]
    states = tensor_bytes(params) + _optimizer_bytes(opt)
    memory = {"params": tensor_bytes(params), "grads": grads, "optimizer": _optimizer_bytes(opt),
              "activations": saved.peak, "peak": states + live.peak, "peak_phase": live.peak_phase,
              "phases": {phase: {"peak": states + peak, "kinds": live.composition[phase],
                                 "set_by": list(live.set_by[phase])} for phase, peak in live.peaks.items()}}
    role = next((name for name, r in rank_roles(Grid(dp=1, pp=layout.pp, tp=1)).items() if r == s0), "middle stage")
    return {"rank": rank, "coords": groups.coords, "role": role, "stages": sorted(stages),
            "layers": sum(len(stage.layers) for stage in stages.values()), "comm": events,
            "bytes": {axis: sum(e[2] for e in sent if e[1] == axis) for axis in ("tp", "pp", "dp")},
            "calls": {axis: sum(1 for e in sent if e[1] == axis) for axis in ("tp", "pp", "dp")},
            "memory": memory, "seconds": time.perf_counter() - start,
            "loss": sum(stats.losses.values()) / len(stats.losses) if stats.losses else None}


# ---------------------------------------------------------------- in a fresh interpreter

def _run_ranks(spec: DryRunSpec) -> list[dict]:
    """Each rank of ``spec`` in turn on a fake group of the job's size (this process's only group)."""
    comm.install()
    out = []
    with flash_attention_on_meta():
        for rank in spec.ranks:
            dist.init_process_group("fake", rank=rank, world_size=spec.grid.world)
            try:
                comm.reset(rank, time.perf_counter())
                out.append(rank_step(spec, dry=True))
            finally:
                dist.destroy_process_group()
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m distlab.parallel3d.dryrun SPEC``: the ranks' results, this process's CPU seconds and peak RSS,
    as one JSON line on stdout; a bad spec or a failure as one line on stderr and exit status 2."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        spec = DryRunSpec.from_json(argv[0])
        check_dry_run(spec)
        ranks = _run_ranks(spec)
    except Exception as error:  # one line for the parent, which raises it
        print(f"{type(error).__name__}: {error}", file=sys.stderr)
        sys.exit(2)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"ranks": ranks, "cpu_seconds": usage.ru_utime + usage.ru_stime,
                      "peak_rss_bytes": usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)}))


@dataclass
class DryRun:
    """Ranks of one job, dry-run in one fresh process: per-rank results (:func:`rank_step`), the process's wall
    seconds (interpreter start included), CPU seconds and peak resident memory."""

    spec: DryRunSpec
    ranks: list[dict]
    wall_seconds: float
    cpu_seconds: float
    peak_rss_bytes: int
    roles: dict[str, int] = field(default_factory=dict)

    def to_dict(self, comm_log: bool = False) -> dict:
        """JSON-ready (a benchmark saves it); ``comm_log=False`` drops each rank's call-by-call log, keeping its
        bytes and calls per axis."""
        ranks = [{k: v for k, v in r.items() if comm_log or k != "comm"} for r in self.ranks]
        return {"spec": json.loads(self.spec.to_json()), "ranks": ranks, "wall_seconds": self.wall_seconds,
                "cpu_seconds": self.cpu_seconds, "peak_rss_bytes": self.peak_rss_bytes, "roles": self.roles}

    @classmethod
    def from_dict(cls, data: dict) -> "DryRun":
        return cls(DryRunSpec.from_json(json.dumps(data["spec"])), data["ranks"], data["wall_seconds"],
                   data["cpu_seconds"], data["peak_rss_bytes"], data["roles"])

    def of(self, role: str) -> dict:
        """The result of the rank in ``role`` ("first stage", "middle stage", "last stage")."""
        return next(r for r in self.ranks if r["rank"] == self.roles[role])

    def busiest(self, what: str, key: str) -> dict:
        """The rank with the most ``what`` (``"bytes"`` or ``"memory"``) of ``key``."""
        return max(self.ranks, key=lambda r: r[what][key])


def dry_run(model: str | GPTConfig, layout: Layout, ranks: Sequence[int] | None = None, *, seq_len: int | None = None,
            precision: str = "mixed", sequence_parallel: bool = True, timeout: float = 600) -> DryRun:
    """Dry-run ``ranks`` (default: one per pipeline role, :func:`rank_roles`) of ``layout`` for ``model`` (a
    :data:`LLAMA` name, whose lab-GPT stand-in :func:`lab_config` builds, or a config) in a fresh interpreter.

    Bad sizes raise one ``ValueError`` line here, before anything starts."""
    cfg = lab_config(model, seq_len) if isinstance(model, str) else model
    grid = Grid(dp=layout.dp, pp=layout.pp, tp=layout.tp)
    roles = rank_roles(grid)
    spec = DryRunSpec(cfg, layout, tuple(roles.values()) if ranks is None else tuple(ranks), precision,
                      sequence_parallel, model if isinstance(model, str) else "lab GPT")
    check_dry_run(spec)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(
        os.path.dirname(os.path.abspath(__file__)))), os.environ.get("PYTHONPATH")])))
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "distlab.parallel3d.dryrun", spec.to_json()], capture_output=True,
                          text=True, timeout=timeout, env=env)
    wall = time.perf_counter() - start
    if done.returncode:
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise RuntimeError(f"the dry run of {spec.name} {layout} failed: {why}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return DryRun(spec, out["ranks"], wall, out["cpu_seconds"], out["peak_rss_bytes"],
                  {role: r for role, r in roles.items() if r in spec.ranks})


# ---------------------------------------------------------------- against the planner

@dataclass(frozen=True)
class Term:
    """One planner term beside the dry run's: ``dry / planner`` is the ratio, off when beyond :data:`TOLERANCE`.
    ``result`` is the dry-run rank the term was read from (:func:`rank_step`'s dict)."""

    name: str
    dry: float
    planner: float
    result: dict = field(repr=False, compare=False)
    role: str = ""

    @property
    def ratio(self) -> float:
        return self.dry / self.planner if self.planner else (1.0 if not self.dry else math.inf)

    @property
    def off(self) -> bool:
        return abs(self.ratio - 1) > TOLERANCE


def _role_of(run: DryRun, result: dict) -> str:
    return next((role for role, r in run.roles.items() if r == result["rank"]), f"rank {result['rank']}")


def compare(run: DryRun, estimate: Estimate) -> list[Term]:
    """The planner's terms beside the dry run's, the planner's estimate made for the dry run's own model (its
    :class:`ModelShape` from the config), read where the planner prices them: each byte term on the rank that sent
    the most on that axis, each memory term on the first stage's rank (the planner's fullest rank: the most layers,
    an end of the model, the most micro-batches in flight). ``activations`` is what autograd keeps for backward
    (the planner's count without the one layer recomputed in backward, which only the peak includes). The peak of
    the forward and backward is compared with the planner's total, the optimizer step's with its states (the
    planner prices no step of its own). The other stages' peaks are the dry run's to show
    (:meth:`DryRun.busiest`): the last stage also holds the loss's logits, which the planner leaves out."""
    spec, layout = run.spec, run.spec.layout
    if estimate.layout != layout or spec.precision != "mixed" or not spec.sequence_parallel:
        raise ValueError(f"compare a mixed-precision, sequence-parallel dry run with the planner's estimate of the "
                         f"same layout: {layout} (dry run) against {estimate.layout}")
    terms = []
    for axis in ("tp", "pp", "dp"):
        busiest = run.busiest("bytes", axis)
        terms.append(Term(f"{axis.upper()} bytes", busiest["bytes"][axis], estimate.bytes[axis], busiest,
                          _role_of(run, busiest)))
    held = estimate.memory["activations"] - _recomputed_layer(spec)
    fullest = run.of("first stage") if "first stage" in run.roles else run.busiest("memory", "peak")
    for name, planner in (("params", estimate.memory["params"]), ("grads", estimate.memory["grads"]),
                          ("optimizer", estimate.memory["optimizer"]), ("activations", held)):
        terms.append(Term(name, fullest["memory"][name], planner, fullest, _role_of(run, fullest)))
    phases = fullest["memory"]["phases"]
    terms.append(Term(PEAK_TERMS[FORWARD_BACKWARD], phases[FORWARD_BACKWARD]["peak"], estimate.memory["total"],
                      fullest, _role_of(run, fullest)))
    terms.append(Term(PEAK_TERMS[OPTIMIZER_STEP], phases[OPTIMIZER_STEP]["peak"], estimate.memory["states"],
                      fullest, _role_of(run, fullest)))
    return terms


def _recomputed_layer(spec: DryRunSpec) -> float:
    """The planner's one layer of full activations, recomputed in backward under checkpointing (else 0)."""
    if not spec.layout.checkpointing:
        return 0.0
    cfg, layout = spec.cfg, spec.layout
    return activation_bytes_per_layer_tp(cfg.seq_len, layout.micro_batch, cfg.d_model, cfg.n_head, layout.tp,
                                         sequence_parallel=True, flash_attention=True, dropout=False)


def _size(n: float) -> str:
    """Bytes in the unit that shows them: GB from a GB up, else MB."""
    return f"{n / 1e9:.2f} GB" if abs(n) >= 1e9 else f"{n / 1e6:.1f} MB"


def explain(term: Term, run: DryRun, estimate: Estimate) -> tuple[str, float | None]:
    """Why ``term`` is off: the cause this module knows that accounts for it, in one sentence with the bytes
    involved, and the ratio once those bytes are accounted for (None when no known cause applies).

    The causes, each a difference between the course's code and what the planner prices, not a planner error:
    lab 04's checkpointing stops recomputing at the block's last saved tensor; its ZeRO-1 keeps bf16 gradients
    and reduces them in fp32 through a flat fp32 copy; lab 06's executor keeps every tensor it sent until the step
    ends."""
    spec, layout, r = run.spec, run.spec.layout, term.result
    if term.name == "TP bytes" and layout.checkpointing and layout.tp > 1:
        blocks = layout.m * r["layers"]
        skipped = blocks * layout.micro_batch * spec.cfg.seq_len * spec.cfg.d_model * 2
        return (f"lab 04's checkpoint_module recomputes a block with torch's default early stop "
                f"(torch.utils.checkpoint): the reduce-scatter that closes each block is not repeated in backward, "
                f"{blocks} blocks × {_size(skipped / blocks)} = {_size(skipped)}; torchtitan's full "
                f"recomputation (early_stop=False) and Megatron-LM repeat it, as the planner prices",
                (term.dry + skipped) / term.planner)
    if term.name == "grads":
        code, plan = 2 * term.dry / r["memory"]["params"], 2 * term.planner / estimate.memory["params"]
        return (f"the course's ZeRO-1 (ShardedOptimizer) accumulates {code:.0f}-byte bf16 gradients in .grad; the "
                f"plan's precision accumulates {plan:.0f}-byte ones: the code and the recipe differ, not the count",
                term.dry * plan / code / term.planner)
    if term.name == "DP bytes":
        fp32 = bytes_per_axis(ModelShape.from_config(spec.cfg), layout, grad_bytes_per_value=4)["dp"]
        return ("the course's ZeRO-1 reduce-scatters the gradients in fp32 (ShardedOptimizer.gradient_shard) and "
                "all-gathers bf16 weights; the plan's precision reduces bf16 gradients", term.dry / fp32)
    if term.name in PEAK_TERMS.values():
        phase = FORWARD_BACKWARD if term.name == PEAK_TERMS[FORWARD_BACKWARD] else OPTIMIZER_STEP
        kinds = r["memory"]["phases"][phase]["kinds"]
        sent, grads, made = kinds.get("sent", 0), kinds.get("grads", 0), kinds.get(OPTIMIZER_STEP, 0)
        planned_grads = estimate.memory["grads"]
        parts = []
        if sent > TOLERANCE / 5 * term.planner:
            parts.append(f"lab 06's executor (run_schedule) still holds {_size(sent)} it sent: it keeps every "
                         f"sent tensor until the step ends, where it waits for the sends (Megatron-LM frees a sent "
                         f"output's data at once, deallocate_output_tensor)")
        if made > TOLERANCE / 5 * term.planner:
            parts.append(f"ZeRO-1's step made {_size(made)}: the rank's gradients flattened into a new fp32 "
                         f"buffer to be reduce-scattered (ShardedOptimizer.gradient_shard), its shard and Adam's "
                         f"temporaries, where an fp32 accumulation buffer reduced in place (Megatron-LM's main_grad) "
                         f"adds nothing")
        if abs(grads - planned_grads) > TOLERANCE / 5 * term.planner:
            parts.append(f"{_size(grads)} of gradients exist then, where the planner counts "
                         f"{_size(planned_grads)} throughout")
        op, last = r["memory"]["phases"][phase]["set_by"]
        if phase != FORWARD_BACKWARD or last <= TOLERANCE / 5 * term.planner:
            last = 0
        held = kinds.get(FORWARD_BACKWARD, 0) - last
        if phase == FORWARD_BACKWARD and abs(held - estimate.memory["activations"]) > TOLERANCE / 5 * term.planner:
            parts.append(f"{_size(held)} of activations and working buffers are alive then, where the planner adds "
                         f"its {_size(estimate.memory['activations'])} of activations to all the gradients")
        if last:
            parts.append(f"the peak comes as {op.removesuffix('.default')} allocates {_size(last)}, a transient the "
                         f"planner does not price (in backward: one parameter's gradient for one micro-batch, before "
                         f"it is added to .grad)")
        return ("; ".join(parts) or "none of the executor's sends, the step's buffers or the gradients' timing "
                "accounts for it", (term.dry - sent - made - grads + planned_grads - last) / term.planner)
    return ("no cause this module knows accounts for it: compare the rank's comm log or memory with the planner's "
            "formula for the term", None)


def comparison_table(run: DryRun, estimate: Estimate, unit: float = 1e9, unit_name: str = "GB") -> str:
    """:func:`compare` as aligned lines — dry run, planner, ratio, the rank read — and under each term beyond
    :data:`TOLERANCE` its cause (:func:`explain`) and the ratio once that cause is accounted for."""
    lines = [f"{'term':12s} {'dry run':>12s} {'planner':>12s} {'ratio':>6s}  rank"]
    for t in compare(run, estimate):
        lines.append(f"{t.name:12s} {t.dry / unit:9.2f} {unit_name} {t.planner / unit:9.2f} {unit_name} "
                     f"{t.ratio:6.3f}  {t.role}{'  OFF' if t.off else ''}")
        if t.off:
            why, after = explain(t, run, estimate)
            lines.append(f"    why: {why}" + ("" if after is None else f" (ratio with it accounted for: {after:.3f})"))
    lines.append("peak per rank: " + ", ".join(f"{_role_of(run, r)} {r['memory']['peak'] / unit:.2f} {unit_name}"
                                                for r in run.ranks))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
