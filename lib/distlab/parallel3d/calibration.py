"""This machine as the planner should see it: every cost the planner's step model needs, measured on the ranks that
will run, at the model's own shapes, and cached per machine and world size.

A planner that assumes 70% of a datasheet peak (:func:`distlab.parallel3d.planner.estimate`'s ``matmul_efficiency``)
is right for the published clusters it was tuned on and wrong by several times for lab 13's small GPT on shared CPU
cores: its matrices are tiny, a layer's softmax, LayerNorms and GELU cost as much as its matmuls, and Python
dispatch, the optimizer and the clipping add a fixed cost per step. :func:`calibrate` measures each of those terms once:

* **compute**, at the model's own shapes while *every* rank computes (so CPU ranks that share cores are priced as
  they run): one transformer block's forward and backward on a rank's tensor-parallel shard (``n_head/tp`` heads,
  ``4·d/tp`` MLP columns, its all-reduces on a real TP group) for every micro-batch size and TP degree the planner
  will try, the output layer with its loss (its ``V/tp`` columns), and the embeddings; and at the reference shape
  the block's GEMMs alone, whose rate (FLOP/s) at those shapes beside the rest of the block (softmax, LayerNorm,
  GELU, dispatch: seconds per token) says where a small model's time goes;
* **sharing**: the same block timed on one rank while the others wait, beside the time while all compute: how many
  cores the ranks really have between them (:attr:`Calibration.cores`). A pipeline's ranks do not all compute at
  once, and a rank that computes while others wait runs faster than one that shares;
* **per step**: the optimizer's update (AdamW and the clipping's squares, per parameter updated) and the gathering of
  gradients into flat buffers (per parameter held), plus a fixed cost;
* **communication**: α (seconds per ring step) and β (bytes/s) of the collectives the layouts use — all-reduce,
  reduce-scatter, all-gather — on groups of each size that divides the world, every group busy at once as in a
  run, at the model's own message sizes (one activation, one shard of the weights); and the send/receive between
  pipeline neighbours: from the send to the bytes' arrival while the sender goes on computing, as a stage does, and
  every other rank computes too (a message moved by threads that wait for a turn on a busy core arrives late).

The planner takes a :class:`Calibration` instead of ``matmul_efficiency``
(:func:`~distlab.parallel3d.planner.estimate`'s ``calibration=``); the published clusters keep their assumed
efficiency, which no calibration on this machine can measure. The cache lives in
``$XDG_CACHE_HOME/distlab/calibration`` (``~/.cache/distlab/calibration`` without it), one file per machine and
world size: another machine (CPU model, cores, host, GPUs, torch, backend, threads per rank) or another world size
reads another file, so a calibration is never reused where it was not measured. ``calibrate(..., refresh=True)``
measures again (a machine that was busy then is quiet now).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.flops import measure_matmul_peak
from distlab.model import GPT, Block, GPTConfig, count_params
from distlab.pipeline_parallel import StageModule
from distlab.runtime.launch import default_threads
from distlab.runtime.rank import device
from distlab.tensor_parallel import TensorParallelGPT, vocab_parallel_cross_entropy
from distlab.tensor_parallel.communication import tp_group

__all__ = ["Link", "ComputeCost", "Calibration", "calibrate", "cache_dir", "machine_fingerprint", "load_cached",
           "COLLECTIVES"]

FORMAT = 2  # bumped when the cached fields change: an old file is then measured again
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
WINDOW = 0.06  # seconds of work each measurement repeats at a core's full speed (longer when ranks share the cores)
PARTS = 3  # the window's parts, each a mean over several scheduler slices; the median over parts is kept


@dataclass(frozen=True)
class Link:
    """The α–β cost of one kind of message: ``steps·alpha + wire_bytes/beta`` seconds.

    ``steps`` and ``wire_bytes`` follow the ring (:mod:`distlab.collectives`): an all-reduce of M bytes over N ranks
    takes 2(N−1) steps and sends 2(N−1)/N·M; a reduce-scatter or all-gather N−1 steps and (N−1)/N·M; a send one step
    and M. Fitted from two message sizes, so α is what a call costs whatever its size (gloo's or NCCL's per-step
    overhead on this machine) and β what each further byte costs."""

    op: str
    size: int  # ranks in the group (2 for a send between neighbours)
    alpha: float
    beta: float

    def steps(self) -> int:
        n = self.size
        return 1 if self.op == "send" else 2 * (n - 1) if self.op == "all_reduce" else n - 1

    def wire_bytes(self, payload: float) -> float:
        n = self.size
        return payload if self.op == "send" else (2 if self.op == "all_reduce" else 1) * (n - 1) / n * payload

    def seconds(self, payload: float, calls: float = 1) -> float:
        """Seconds of ``calls`` messages of ``payload`` bytes each (M: the tensor handed to the collective)."""
        if self.size < 2 or calls == 0:
            return 0.0
        return calls * (self.steps() * self.alpha + self.wire_bytes(payload) / self.beta)

    @classmethod
    def fit(cls, op: str, size: int, payloads: tuple[float, float], seconds: tuple[float, float]) -> "Link":
        """α and β through two measured points (a larger message that came out no slower means the bytes were
        free at this size: β from the larger message alone, α from what remains of the smaller)."""
        probe = cls(op, size, 1.0, 1.0)
        (m1, m2), (t1, t2) = payloads, seconds
        w1, w2 = probe.wire_bytes(m1), probe.wire_bytes(m2)
        per_byte = (t2 - t1) / (w2 - w1) if t2 > t1 else t2 / w2 / 2
        alpha = max(t1 - per_byte * w1, 0.0) / probe.steps()
        return cls(op, size, alpha, 1.0 / per_byte)


@dataclass(frozen=True)
class ComputeCost:
    """Seconds one rank spends on one micro-batch of ``rows`` tokens at TP degree ``tp``, measured while every rank
    ran the same: a block's forward and backward as a stage runs it (lab 05's tensor-parallel block, its all-reduces
    included), the output layer with the vocabulary-parallel loss, and the embeddings. ``collectives_*`` are the
    TP all-reduces' share of each, priced from the calibrated all-reduce (two of an activation each way per block;
    the loss's three of one value per token and the output layer's one backward; the embedding's one), at most the
    piece itself. At the reference shape (the smallest TP degree and micro-batch) the block's and the output layer's
    GEMMs are also timed alone (``matmul``, ``head_matmul``, with their FLOPs): the matmul rate at the model's own
    shapes; ``None`` elsewhere."""

    tp: int
    rows: int
    forward: float
    backward: float
    head_forward: float
    head_backward: float
    embedding_forward: float
    embedding_backward: float
    collectives_forward: float = 0.0
    collectives_backward: float = 0.0
    head_collectives: float = 0.0
    embedding_collectives: float = 0.0
    matmul: float | None = None
    matmul_flops: float | None = None
    head_matmul: float | None = None
    head_matmul_flops: float | None = None

    @property
    def matmul_rate(self) -> float | None:
        """FLOP/s the block's GEMMs reach at these shapes (measured at the reference shape only)."""
        return self.matmul_flops / self.matmul if self.matmul else None

    @property
    def other_per_token(self) -> float | None:
        """Seconds per token of a block's work outside its GEMMs and collectives: attention's softmax, LayerNorms,
        GELU, the residual adds and Python's dispatch of each op (what 6·N FLOPs do not count)."""
        if self.matmul is None:
            return None
        work = self.forward + self.backward - self.collectives_forward - self.collectives_backward
        return max(0.0, work - self.matmul) / self.rows


def _key(tp: int, rows: int) -> str:
    return f"tp{tp}-rows{rows}"


@dataclass
class Calibration:
    """What :func:`calibrate` measured; see the module's docstring. Times are seconds, rates FLOP/s and bytes/s."""

    machine: dict
    world_size: int
    model: dict  # the shapes measured: d_model, n_head, seq_len, vocab_size, n_layer, n_params
    peak_flops: float  # square fp32 matmuls (MFU's denominator), each rank's while every rank multiplied
    compute: dict  # _key(tp, rows) -> ComputeCost
    links: dict  # "op/size" -> Link
    alone: float  # seconds of the reference block (the smallest TP and micro-batch) on one rank while the rest wait
    together: float  # the same while every rank computes
    step_fixed: float  # seconds a step costs whatever its size (Python, the loader, bookkeeping)
    per_param_updated: float  # AdamW and the clipping's squares, per parameter this rank updates
    per_param_held: float  # gathering a gradient into a flat buffer, per parameter this rank holds
    seconds: float = 0.0  # how long the calibration took
    measured: str = ""  # when (local time)
    source: str = "measured"  # or "cache"
    format: int = FORMAT
    notes: list = field(default_factory=list)

    # ---- what the planner reads

    def compute_at(self, tp: int, rows: int) -> ComputeCost:
        try:
            return self.compute[_key(tp, rows)]
        except KeyError:
            have = ", ".join(sorted(self.compute))
            raise ValueError(f"the calibration has no compute at TP {tp} with {rows} tokens per micro-batch (it "
                             f"measured {have}): calibrate with the micro-batches and TP degrees you plan") from None

    def link(self, op: str, size: int) -> Link:
        if size < 2:
            return Link(op, 1, 0.0, math.inf)
        try:
            return self.links[f"{op}/{size}"]
        except KeyError:
            raise ValueError(f"the calibration has no {op} on groups of {size} ranks (world size "
                             f"{self.world_size}): calibrate on the ranks that will run") from None

    @property
    def cores(self) -> float:
        """How many ranks' worth of compute the machine gives at once: the world size when a rank computes as fast
        beside the others as alone (GPUs, or a core per rank), fewer when they share cores (4 ranks on 2 cores: 2),
        never below one rank's worth."""
        return min(float(self.world_size), max(1.0, self.world_size * self.alone / self.together))

    def summary(self) -> str:
        """What was measured, in a few lines (rates at the smallest TP degree and micro-batch)."""
        first = min(self.compute.values(), key=lambda c: (c.tp, c.rows))
        lines = [f"calibrated {self.machine.get('cpu', '?')} ({self.machine.get('cores', '?')} cores), "
                 f"{self.world_size} {self.machine.get('backend', '?')} ranks × {self.machine.get('threads', '?')} "
                 f"thread(s), {'from the cache' if self.source == 'cache' else f'in {self.seconds:.1f} s'}",
                 f"  matmul peak per rank while all compute {self.peak_flops / 1e9:.1f} GFLOP/s; the model's block "
                 f"GEMMs at TP {first.tp}, {first.rows} tokens: {first.matmul_rate / 1e9:.1f} GFLOP/s; the rest of "
                 f"a block {first.other_per_token * 1e6:.2f} µs per token; the ranks share {self.cores:.1f} "
                 f"device(s)' worth of compute",
                 f"  per step {self.step_fixed * 1e3:.2f} ms + {self.per_param_updated * 1e9:.2f} ns per parameter "
                 f"updated + {self.per_param_held * 1e9:.2f} ns per parameter held"]
        for name, link in sorted(self.links.items()):
            lines.append(f"  {link.op} on {link.size} ranks: α {link.alpha * 1e6:.0f} µs per step, "
                         f"β {link.beta / 1e9:.2f} GB/s")
        return "\n".join(lines)

    # ---- the cache

    def to_json(self) -> dict:
        out = asdict(self)
        out["compute"] = {k: asdict(v) for k, v in self.compute.items()}
        out["links"] = {k: asdict(v) for k, v in self.links.items()}
        return out

    @classmethod
    def from_json(cls, data: dict) -> "Calibration":
        data = dict(data)
        data["compute"] = {k: ComputeCost(**v) for k, v in data["compute"].items()}
        data["links"] = {k: Link(**v) for k, v in data["links"].items()}
        return cls(**data)


# ---------------------------------------------------------------- the machine and its cache

def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/distlab/calibration``, or ``~/.cache/distlab/calibration`` (the XDG default)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "distlab" / "calibration"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_fingerprint(backend: str, threads: int) -> dict:
    """What makes one machine's calibration another's: the host, CPU model and cores this process may use, the GPUs,
    torch's version, the ranks' backend and threads per rank."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() \
        else []
    return {"host": platform.node(), "cpu": _cpu_model(), "cores": cores, "gpus": gpus, "torch": torch.__version__,
            "backend": backend, "threads": threads}


def _cache_file(machine: dict, world_size: int) -> Path:
    digest = hashlib.sha1(json.dumps(machine, sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir() / f"{digest}-world{world_size}.json"


def _model_key(model: dict, micro_batch, tp) -> str:
    return json.dumps({"model": model, "micro_batch": sorted(micro_batch), "tp": sorted(tp)}, sort_keys=True)


def load_cached(machine: dict, world_size: int, model: dict, micro_batch, tp) -> Calibration | None:
    """The cached calibration of this machine, world size, model shape and planned shapes; ``None`` when there is
    none (never measured here, or measured on another machine or world size, or by an older distlab)."""
    path = _cache_file(machine, world_size)
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    data = entries.get(_model_key(model, micro_batch, tp))
    if not data or data.get("format") != FORMAT or data.get("machine") != machine or \
            data.get("world_size") != world_size:
        return None
    calibration = Calibration.from_json(data)
    calibration.source = "cache"
    return calibration


def _store(calibration: Calibration, micro_batch, tp) -> None:
    path = _cache_file(calibration.machine, calibration.world_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        entries = {}
    entries[_model_key(calibration.model, micro_batch, tp)] = calibration.to_json()
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(entries, indent=1, sort_keys=True), encoding="utf-8")
    partial.replace(path)  # whole or not at all: a calibration killed mid-write leaves the old file


# ---------------------------------------------------------------- measuring, inside every rank

def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _agreed_count(count: int, dev: torch.device) -> int:
    """The largest of every rank's ``count``, on every rank: ranks that call collectives inside a repetition must
    make the same calls, and the rank whose probe ran at a whole core's speed sets the count, so that every part of
    the window outlasts several scheduler slices even at that speed (the smallest count would let a part fit in one
    slice, each rank running it alone in turn, and every rank would measure a core to itself)."""
    agreed = torch.tensor([min(count, 1000)], device=dev)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return int(agreed.item())


def _windowed(phases, dev: torch.device, window: float, agree: bool = True, busy=None) -> list[float]:
    """Seconds of each of ``phases`` (callables run in turn, each taking the previous one's result) per repetition,
    over a window of about ``window`` seconds (at a whole core's speed) in which every rank repeats the same.

    Means over a stretch of time, not medians of single calls: ranks that share cores take turns in slices of
    milliseconds, so a single short call mostly runs at a whole core's speed or waits a whole slice, and its median
    is the speed of a core alone; the mean over many slices is the speed a rank gets while the others compute too.
    The window is cut into :data:`PARTS` parts and the median of their means is kept, so a burst of someone else's
    work in one part does not move the figure (a run's step time is a median over steps for the same reason).
    Every rank makes the same number of repetitions, and one that is done early keeps the others company with
    ``busy`` (work with no collectives) until all are done: the last ranks to finish must not get the cores to
    themselves, which no rank of a run does. ``agree=False``: this rank alone (the others wait), its own count."""
    def once() -> list[float]:
        times, value = [], None
        for phase in phases:
            t0 = time.perf_counter()
            value = phase(value)
            _sync(dev)
            times.append(time.perf_counter() - t0)
        return times

    once()  # allocation, kernel selection, lazily made groups
    probe = sum(once())
    per_part = max(2, math.ceil(window / PARTS / max(probe, 1e-7)))
    if agree:
        per_part = _agreed_count(per_part, dev)
        dist.barrier()
    parts = []
    for _ in range(PARTS):
        totals = [0.0] * len(phases)
        for _ in range(per_part):
            for i, seconds in enumerate(once()):
                totals[i] += seconds
        parts.append([total / per_part for total in totals])
    if agree and busy is not None:
        everyone = dist.barrier(async_op=True)
        while not everyone.is_completed():
            busy()
        everyone.wait()
    return [statistics.median(part[i] for part in parts) for i in range(len(phases))]


def _forward_backward(forward, dev: torch.device, window: float, busy=None) -> tuple[float, float]:
    """Mean seconds of ``forward()`` (a scalar to differentiate) and of its backward (:func:`_windowed`)."""
    fwd, bwd = _windowed([lambda _: forward(), lambda out: out.backward()], dev, window, busy=busy)
    return fwd, bwd


def _gemms(shapes, dev: torch.device, window: float, busy=None) -> tuple[float, float]:
    """Mean seconds of a linear's three GEMMs (forward, input gradient, weight gradient) for each
    ``(rows, in, out)``, and their FLOPs."""
    operands = [(torch.randn(rows, n_in, device=dev), torch.randn(n_out, n_in, device=dev),
                 torch.randn(rows, n_out, device=dev)) for rows, n_in, n_out in shapes]

    def run(_):
        for x, w, g in operands:
            x @ w.t()
            g @ w
            g.t() @ x

    (seconds,) = _windowed([run], dev, window, busy=busy)
    return seconds, sum(3 * 2 * rows * n_in * n_out for rows, n_in, n_out in shapes)


def _measure_compute(cfg: GPTConfig, tp: int, rows: int, dev: torch.device, window: float, gemms: bool,
                     busy) -> dict:
    """One shape's costs (the fields of :class:`ComputeCost` this rank measures): lab 05's tensor-parallel GPT of one
    block on this rank's TP group (the world cut into groups of ``tp`` consecutive ranks, all working at once), cut
    into a block, an output layer and embeddings as lab 06's stages cut it; with ``gemms``, the GEMMs alone too."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    batch, d = rows // cfg.seq_len, cfg.d_model
    x = torch.randn(batch, cfg.seq_len, d, generator=generator).to(dev).requires_grad_()
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=generator).to(dev)
    group = tp_group(tp)
    model = TensorParallelGPT(GPT(cfg, seed=0).to(dev), group)
    block = StageModule(model, range(0, 1), first=False, last=False)
    head = StageModule(model, range(0, 0), first=False, last=True)
    embedding = StageModule(model, range(0, 0), first=True, last=False)
    out = {"tp": tp, "rows": rows}
    busy = busy if group is not None else None  # the async barrier and the TP group's collectives share no group
    out["forward"], out["backward"] = _forward_backward(lambda: block(x).square().mean(), dev, window, busy)
    out["head_forward"], out["head_backward"] = _forward_backward(
        lambda: vocab_parallel_cross_entropy(head(x), ids, group), dev, window, busy)
    out["embedding_forward"], out["embedding_backward"] = _forward_backward(
        lambda: embedding(ids).square().mean(), dev, window, busy)
    if gemms:
        hidden, v = cfg.mlp_ratio * d, cfg.vocab_size // tp
        out["matmul"], out["matmul_flops"] = _gemms([(rows, d, 3 * d // tp), (rows, d // tp, d),
                                                     (rows, d, hidden // tp), (rows, hidden // tp, d)], dev, window,
                                                    busy)
        out["head_matmul"], out["head_matmul_flops"] = _gemms([(rows, d, v)], dev, window, busy)
    return out


def _shard_block(cfg: GPTConfig, tp: int, dev: torch.device) -> nn.Module:
    """A block as one TP rank computes it, without its collectives: ``n_head/tp`` heads (attention reads its head
    count from ``qkv``'s width) and ``4·d/tp`` MLP columns, the LayerNorms whole (the reference of the sharing
    measurement: a rank's own work, no peer to wait for)."""
    block = Block(cfg, device=dev)
    d, hidden = cfg.d_model, cfg.mlp_ratio * cfg.d_model
    block.attn.qkv = nn.Linear(d, 3 * d // tp, bias=cfg.bias, device=dev)
    block.attn.proj = nn.Linear(d // tp, d, bias=cfg.bias, device=dev)
    block.mlp.fc = nn.Linear(d, hidden // tp, bias=cfg.bias, device=dev)
    block.mlp.proj = nn.Linear(hidden // tp, d, bias=cfg.bias, device=dev)
    return block


def _measure_step(n_held: int, dev: torch.device, window: float, busy) -> dict:
    """Mean seconds of the per-step work at two sizes: AdamW and the clipping's float64 squares over ``n``
    parameters (the update), and gathering ``n`` gradients into a flat buffer (the bookkeeping)."""
    out = {}
    for n in (max(1024, n_held // 8), n_held):
        weights = nn.Parameter(torch.randn(n, device=dev) * 0.02)
        weights.grad = torch.randn(n, device=dev) * 1e-3
        optimizer = torch.optim.AdamW([weights], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
        pieces = [torch.randn(k, device=dev) for k in _split(n, 16)]

        def update(_):
            norm = weights.grad.double().pow(2).sum().sqrt()
            weights.grad.mul_(min(1.0, 1.0 / (float(norm) + 1e-6)))
            optimizer.step()

        out[f"update/{n}"], out[f"held/{n}"] = _windowed([update, lambda _: torch.cat(pieces).div_(2)], dev, window,
                                                         busy=busy)
    return out


def _split(n: int, parts: int) -> list[int]:
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def _time_collective(op: str, group, payload: int, dev: torch.device, window: float) -> float:
    """Mean seconds of one ``op`` of ``payload`` bytes (fp32) on ``group``, every group of the world at once."""
    size = dist.get_world_size(group)
    numel = max(size, payload // 4 // size * size)
    full = torch.ones(numel, device=dev)
    part = torch.ones(numel // size, device=dev)
    call = {"all_reduce": lambda _: dist.all_reduce(full, group=group),
            "reduce_scatter": lambda _: dist.reduce_scatter_tensor(part, full, group=group),
            "all_gather": lambda _: dist.all_gather_into_tensor(full, part, group=group)}[op]
    (seconds,) = _windowed([call], dev, window)
    return seconds


def _time_handoff(payload: int, dev: torch.device, window: float, work) -> float:
    """Seconds from pipeline rank 0 posting a send of ``payload`` bytes to rank 1 holding them, while rank 0 goes on
    computing (``work``, a stage's forward and backward) and every other rank computes too: the median over
    :data:`PARTS` parts of a window.

    That is a message's life in a pipeline: the sender posts it and computes its next micro-batch, and the bytes move
    on gloo's (or NCCL's) own threads, which on cores shared with busy ranks wait for a turn — a ping-pong, whose
    sender waits idle, would see less. Both ranks read the same monotonic clock; rank 0 writes the time it posted the
    send into the message (float64, so its microseconds survive), rank 1 subtracts it from its own on arrival and
    answers with a one-value acknowledgement, so rank 0 never has two messages in flight. Rank 0 also says in the
    message when the window is over, so the two make the same number of exchanges without another collective."""
    rank = dist.get_rank()
    buffer = torch.zeros(max(2, payload // 8), dtype=torch.float64, device=dev)
    ack = torch.zeros(1, device=dev)
    dist.barrier()
    start, latencies = time.perf_counter(), []
    if rank == 0:
        while True:
            last = time.perf_counter() - start >= window
            buffer[1] = 0.0 if last else 1.0  # 0: this is the last exchange
            buffer[0] = time.perf_counter()
            request = dist.isend(buffer, 1)
            work()
            request.wait()
            dist.recv(ack, 1)
            if last:
                break
    elif rank == 1:
        while True:
            dist.recv(buffer, 0)
            _sync(dev)
            latencies.append(time.perf_counter() - buffer[0].item())
            dist.send(ack, 0)
            if buffer[1].item() == 0.0:
                break
    else:
        while time.perf_counter() - start < window:
            work()
    dist.barrier()
    if not latencies:
        return 0.0
    chunk = max(1, len(latencies) // PARTS)
    return statistics.median(statistics.fmean(latencies[i:i + chunk]) for i in range(0, len(latencies), chunk))


def _measure_on_rank(cfg: GPTConfig, tps, rows_list, n_held: int, payloads: dict, window: float) -> dict:
    """Everything :func:`calibrate` measures, on this rank, in step with the others."""
    dev = device()
    torch.manual_seed(0)
    out = {"compute": {}, "collectives": {}, "send": {}}
    dist.barrier()
    peak = measure_matmul_peak(sizes=(128, 256) if dev.type == "cpu" else (2048, 4096), device=dev,
                               min_seconds=window)
    out["peak"] = peak.flops
    reference = _shard_block(cfg, 1, dev)
    x = torch.randn(min(rows_list) // cfg.seq_len, cfg.seq_len, cfg.d_model, device=dev).requires_grad_()

    def busy():  # a rank's own work, no collective: what a rank done early computes while the others finish
        reference(x).square().mean().backward()

    for tp in tps:
        for rows in rows_list:
            reference_shape = tp == min(tps) and rows == min(rows_list)
            out["compute"][_key(tp, rows)] = _measure_compute(cfg, tp, rows, dev, window, reference_shape, busy)
    out["together"] = sum(_forward_backward(lambda: reference(x).square().mean(), dev, window, busy))
    dist.barrier()
    if dist.get_rank() == 0:  # rank 0 alone, the others waiting at the barrier (we measured: a rank waiting there in
        #                       gloo used under 1% of a core, so the waiting ranks leave the cores to rank 0)
        out["alone"] = sum(_windowed([lambda _: busy()], dev, window, agree=False))
    dist.barrier()
    out["step"] = _measure_step(n_held, dev, window, busy)
    world = dist.get_world_size()
    for size in (s for s in range(2, world + 1) if world % s == 0):
        group = tp_group(size)
        for op in COLLECTIVES:
            for payload in payloads["collective"]:
                out["collectives"][f"{op}/{size}/{payload}"] = _time_collective(op, group, payload, dev, window)
    if world > 1:
        for payload in payloads["send"]:
            out["send"][payload] = _time_handoff(payload, dev, window, busy)
    return out


# ---------------------------------------------------------------- the entry point

def _model_dims(model) -> tuple[dict, GPTConfig]:
    """The shapes that decide the costs, from a :class:`~distlab.parallel3d.planner.ModelShape` or a
    :class:`~distlab.model.GPTConfig`, and a config to build the measured modules from."""
    if isinstance(model, GPTConfig):
        dims = {"d_model": model.d_model, "n_head": model.n_head, "seq_len": model.seq_len,
                "vocab_size": model.vocab_size, "n_layer": model.n_layer, "n_params": count_params(model)}
    else:
        dims = {"d_model": model.d_model, "n_head": model.n_head, "seq_len": model.seq_len,
                "vocab_size": model.vocab_size, "n_layer": model.n_layer, "n_params": model.n_params}
    cfg = GPTConfig(vocab_size=dims["vocab_size"], seq_len=dims["seq_len"], n_layer=1, n_head=dims["n_head"],
                    d_model=dims["d_model"], tied_embeddings=False)
    return dims, cfg


def calibrate(ranks, model, *, micro_batch=(1, 2), tp=None, refresh: bool = False, cache: bool = True,
              window: float = WINDOW) -> Calibration:
    """Measure this machine for the planner on ``ranks`` (a :class:`distlab.Ranks`, the group that will train), at
    ``model``'s shapes (a ``ModelShape`` or ``GPTConfig``) for micro-batches of ``micro_batch`` sequences and the TP
    degrees ``tp`` (default: every divisor of the world size that divides the heads); or read it from the cache.

    Takes a few seconds on a CPU (the block at each shape, the collectives at two message sizes on every group
    size, the optimizer at two sizes). ``refresh=True`` measures again and replaces the cached one;
    ``cache=False`` neither reads nor writes the cache; ``window``: the seconds each measurement repeats for.
    """
    dims, cfg = _model_dims(model)
    world = ranks.world_size
    tps = tuple(sorted(tp)) if tp is not None else tuple(t for t in range(1, world + 1)
                                                         if world % t == 0 and dims["n_head"] % t == 0)
    micro = tuple(sorted(micro_batch))
    bad = [t for t in tps if world % t or dims["n_head"] % t] + [b for b in micro if b < 1]
    if bad or not tps or not micro:
        raise ValueError(f"calibrate: TP degrees {tps} must divide the world size {world} and the {dims['n_head']} "
                         f"heads, micro-batches {micro} be positive sequence counts")
    machine = machine_fingerprint(ranks.backend, ranks.threads or default_threads(world))
    if cache and not refresh:
        cached = load_cached(machine, world, dims, micro, tps)
        if cached is not None:
            return cached
    rows_list = [b * dims["seq_len"] for b in micro]
    activation = 4 * min(rows_list) * dims["d_model"]
    weights = 4 * dims["n_params"] // max(1, world // 2)  # a stage's gradients, the DP messages' size
    payloads = {"collective": (activation, max(weights, 8 * activation)), "send": (activation, 4 * activation)}
    started = time.perf_counter()
    run = ranks.run(_measure_on_rank, args=(cfg, tps, rows_list, dims["n_params"], payloads, window),
                    show_output=False)
    per_rank = list(run)
    calibration = _assemble(per_rank, machine, world, dims, payloads)
    calibration.seconds = time.perf_counter() - started
    calibration.measured = time.strftime("%Y-%m-%d %H:%M:%S")
    if cache:
        _store(calibration, micro, tps)
    return calibration


def _with_collectives(measured: dict, links: dict, d_model: int) -> ComputeCost:
    """A shape's :class:`ComputeCost` with its TP all-reduces' share priced from the calibrated all-reduce on groups
    of its TP degree, each at most the piece it is part of."""
    tp, rows = measured["tp"], measured["rows"]
    if tp == 1:
        return ComputeCost(**measured)
    reduce = links[f"all_reduce/{tp}"]
    activation = rows * d_model * 4  # fp32
    return ComputeCost(**measured,
                       collectives_forward=min(measured["forward"], reduce.seconds(activation, 2)),
                       collectives_backward=min(measured["backward"], reduce.seconds(activation, 2)),
                       head_collectives=min(measured["head_forward"] + measured["head_backward"],
                                            reduce.seconds(rows * 4, 3) + reduce.seconds(activation)),
                       embedding_collectives=min(measured["embedding_forward"], reduce.seconds(activation)))


def _line(sizes: list[int], seconds: list[float]) -> tuple[float, float]:
    """(fixed seconds, seconds per element) through the smallest and the largest size; when the larger came out no
    slower (noise at this size), every second is taken as per element, none as fixed."""
    (n1, t1), (n2, t2) = (sizes[0], seconds[0]), (sizes[-1], seconds[-1])
    if t2 <= t1:
        return 0.0, t2 / n2
    per = (t2 - t1) / (n2 - n1)
    return max(0.0, t1 - per * n1), per


def _assemble(per_rank: list[dict], machine: dict, world: int, dims: dict, payloads: dict) -> Calibration:
    """One calibration from every rank's measurements: medians over ranks for compute (what a typical rank gets),
    the slowest rank for a message (it is done when its last rank is)."""
    links = {}
    small, large = payloads["collective"]
    for size in (s for s in range(2, world + 1) if world % s == 0):
        for op in COLLECTIVES:
            t = [max(r["collectives"][f"{op}/{size}/{p}"] for r in per_rank) for p in (small, large)]
            links[f"{op}/{size}"] = Link.fit(op, size, (small, large), tuple(t))
    compute = {}
    for key, fields in per_rank[0]["compute"].items():
        merged = {name: statistics.median(r["compute"][key][name] for r in per_rank) if isinstance(value, float)
                  else value for name, value in fields.items()}
        compute[key] = _with_collectives(merged, links, dims["d_model"])
    if world > 1:
        s1, s2 = payloads["send"]
        t = [per_rank[1]["send"][p] for p in (s1, s2)]  # rank 1 measured it
        links["send/2"] = Link.fit("send", 2, (s1, s2), tuple(t))
    steps = {k: statistics.median(r["step"][k] for r in per_rank) for k in per_rank[0]["step"]}
    sizes = sorted({int(k.split("/")[1]) for k in steps})
    (fixed_update, per_updated), (fixed_held, per_held) = (_line(sizes, [steps[f"{kind}/{n}"] for n in sizes])
                                                           for kind in ("update", "held"))
    fixed = fixed_update + fixed_held
    return Calibration(machine=machine, world_size=world, model=dims,
                       peak_flops=statistics.median(r["peak"] for r in per_rank), compute=compute, links=links,
                       alone=next(r["alone"] for r in per_rank if "alone" in r),
                       together=statistics.median(r["together"] for r in per_rank), step_fixed=fixed,
                       per_param_updated=per_updated, per_param_held=per_held)
