"""Training with a pipeline: the worker every lab cell, checker and benchmark runs, its
single-process reference, PyTorch's ``torch.distributed.pipelining`` on the same stages,
and the torchrun entry point.

    torchrun --nproc-per-node=4 -m distlab.torchrun distlab.pipeline_parallel:train \
        steps=20 schedule=1f1b microbatches=8
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from distlab.flops import step_report
from distlab.model import GPTConfig, synthetic_batch
from distlab.pipeline_parallel.executor import (
    SavedActivations,
    StepStats,
    build_stages,
    lm_loss,
    run_schedule,
    split_microbatches,
    sync_tied_gradients,
)
from distlab.pipeline_parallel.partition import even_partition
from distlab.pipeline_parallel.schedules import (
    SCHEDULES,
    V_SCHEDULES,
    Action,
    make_schedule,
    placement_of,
    placement_style,
    stage_placement,
    validate,
)
from distlab.reference import make_optimizer, train_reference
from distlab.runtime.rank import device as rank_device
from distlab.runtime.rank import native_bf16
from distlab.runtime.timeline import span

__all__ = [
    "check_setup", "keep_freed_memory", "pipeline_worker", "reference_states", "TORCH_SCHEDULES",
    "torch_pipelining_worker", "train",
]


def check_setup(p: int, m: int, n_layer: int, batch_size: int, schedule: str | Sequence = "1f1b", v: int = 1) -> None:
    """One-line ``ValueError`` for a pipeline that cannot run, before any rank starts work. A schedule given
    as data (``schedule[r]``: rank ``r``'s actions) is validated wherever it places its stages, and its
    first problem named (:class:`~distlab.pipeline_parallel.ScheduleError`, a ``ValueError``); it shows its
    own ``v``."""
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"m (micro-batches) must be a positive integer, got {m!r}")
    if isinstance(schedule, str):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
        make_schedule(schedule, p, m, v)  # interleaved: m a multiple of p; V schedules: v = 2; DualPipeV: m >= 2p
    else:
        if len(schedule) != p:
            raise ValueError(f"the schedule has {len(schedule)} ranks' actions but the pipeline has p={p} ranks")
        v = len(placement_of(schedule)) // p
        validate(schedule, m, v, placement=None)
    if batch_size % m:
        raise ValueError(f"the batch of {batch_size} sequences does not split into m={m} equal micro-batches")
    if p * v > n_layer:
        raise ValueError(f"{p * v} stages (p={p} ranks x v={v}) need at least {p * v} layers; the model has {n_layer}")


_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # glibc mallopt parameters


def keep_freed_memory() -> bool:
    """Make this process's C allocator keep freed memory instead of handing it back to the OS.

    PyTorch on the CPU allocates every activation with ``malloc``. By default glibc serves
    blocks over 128 KiB with a fresh ``mmap`` and trims the heap after frees, so each new
    activation page-faults its way into memory: a real share of a small stage's compute,
    and different on every micro-batch — the jitter that makes one stage wait for another.
    Keeping freed memory (as the CUDA caching allocator does on GPUs) makes stage
    times steady. glibc only (Linux); elsewhere a no-op that returns False.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return all([libc.mallopt(_M_MMAP_THRESHOLD, 32 * 2**20), libc.mallopt(_M_TRIM_THRESHOLD, 2**30),
                    libc.mallopt(_M_TOP_PAD, 64 * 2**20)])
    except (OSError, AttributeError):  # not glibc (musl, …)
        return False


def _merged_state(stages) -> dict[str, torch.Tensor]:
    state = {}
    for stage in stages.values():
        state.update({k: t.detach().to("cpu", copy=True) for k, t in stage.state_dict().items()})
    return state


def pipeline_worker(schedule: str | Sequence[Sequence[Action]] = "1f1b", cfg: GPTConfig | None = None, m: int = 4,
                    v: int = 1, batch_size: int | None = None, steps: int = 1, warmup: int = 0,
                    optimizer: str = "sgd", lr: float = 0.1, seed: int = 0, data_seed: int = 0,
                    partition: Sequence[range] | None = None, return_state: bool = True, track_memory: bool = False,
                    executor: Callable | None = None, dtype: torch.dtype | None = None,
                    on_step: Callable | None = None) -> dict:
    """Train ``steps`` optimizer steps with a pipeline of ``p = world size`` ranks; report this rank.

    ``schedule`` is a name (gpipe | 1f1b | interleaved | zb-h1 | zb-v | dualpipev, ``v`` stages per rank:
    any for interleaved, 2 for the V schedules) or a full schedule (``schedule[r]`` = rank ``r``'s actions,
    validated first; it shows its own placement and ``v``). ``batch_size`` sequences per step (default
    ``m``), split into ``m`` micro-batches. ``executor(actions, stages, micro_batches, p,
    num_stages)`` replaces :func:`run_schedule` (a student's, for looped placements; it returns the losses).
    Every step runs inside a ``step{k}`` span, so :func:`~distlab.pipeline_parallel.step_spans`
    finds its forwards and backwards.

    Returns ``rank``, ``stages`` (global indices held), ``losses`` (the batch loss per step,
    on the rank holding the last stage; else None), ``step_times`` (after ``warmup``),
    ``peak_in_flight`` (micro-batches' activations, a stage of ``v`` per rank counting ``1/v``),
    ``peak_activation_bytes`` (with ``track_memory``), ``sent_bytes``
    per step and ``state`` (this rank's parameters after training). ``on_step(step, loss, seconds)``
    is called on every rank after every step (``loss`` None off the last stage).
    """
    cfg = cfg or GPTConfig()
    p, rank = dist.get_world_size(), dist.get_rank()
    batch_size = batch_size or m
    check_setup(p, m, cfg.n_layer, batch_size, schedule, v)
    keep_freed_memory()
    if isinstance(schedule, str):
        actions_all, placement = make_schedule(schedule, p, m, v), stage_placement(p, v, placement_style(schedule))
    else:
        actions_all, placement = schedule, placement_of(schedule)
    S = len(placement)
    partition = list(partition) if partition is not None else even_partition(cfg.n_layer, S)
    dev = rank_device()
    stages = build_stages(cfg, partition, rank, p, seed, dev, placement)
    if dtype is not None:
        stages = {s: stage.to(dtype) for s, stage in stages.items()}
    # each tensor once: a tied embedding whose two ends share this rank (a V's rank 0) is one parameter
    params = list({id(q): q for stage in stages.values() for q in stage.parameters()}.values())
    opt = make_optimizer(params, optimizer, lr=lr)
    out = {"rank": rank, "stages": sorted(stages), "layers": {s: list(stages[s].layers) for s in stages},
           "losses": [], "step_times": [], "peak_in_flight": 0, "peak_activation_bytes": 0, "sent_bytes": 0}
    for step in range(warmup + steps):
        x, y = synthetic_batch(cfg, batch_size, step, seed=data_seed)
        micro = split_microbatches(x.to(dev), y.to(dev), m)
        memory = SavedActivations(stages.values()) if track_memory else None
        dist.barrier()
        start = time.perf_counter()
        with span(f"step{step}", kind="other"):
            if executor is None:
                stats = run_schedule(actions_all[rank], stages, micro, p=p, num_stages=S, memory=memory,
                                     placement=placement)
            else:
                stats = StepStats(losses=dict(executor(actions_all[rank], stages, micro, p, S) or {}))
        sync_tied_gradients(stages, p, S, placement)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        elapsed = time.perf_counter() - start
        dist.barrier()
        if step >= warmup:
            out["step_times"].append(elapsed)
        out["losses"].append(statistics.fmean(stats.losses.values()) if stats.losses else None)
        out["peak_in_flight"] = max(out["peak_in_flight"], stats.peak_in_flight)
        out["peak_activation_bytes"] = max(out["peak_activation_bytes"], stats.peak_activation_bytes)
        out["sent_bytes"] = stats.sent_bytes
        if on_step is not None:
            on_step(step, out["losses"][-1], elapsed)
    if float(out["peak_in_flight"]).is_integer():  # whole micro-batches (any looped v = 1 schedule) print as such
        out["peak_in_flight"] = int(out["peak_in_flight"])
    out["state"] = _merged_state(stages) if return_state else None
    return out


def reference_states(cfg: GPTConfig, steps: int = 1, batch_size: int = 4, optimizer: str = "sgd", lr: float = 0.1,
                     seed: int = 0, data_seed: int = 0):
    """The single-process run a pipeline must reproduce: ``GPT(cfg, seed)``, one step per whole batch."""
    batches = [synthetic_batch(cfg, batch_size, step, seed=data_seed) for step in range(steps)]
    return train_reference(cfg, batches, lr=lr, optimizer=optimizer, seed=seed)


TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "zb-v": "ScheduleZBVZeroBubble",
                   "dualpipev": "ScheduleDualPipeV"}  # ours -> torch.distributed.pipelining's class of the same name


def torch_pipelining_worker(schedule: str = "1f1b", cfg: GPTConfig | None = None, m: int = 4,
                            batch_size: int | None = None, steps: int = 1, seed: int = 0, data_seed: int = 0,
                            ours: bool = True, warmup: int = 1) -> dict:
    """The same stages under ``torch.distributed.pipelining`` and under ours: ``ScheduleGPipe``,
    ``Schedule1F1B``, and for the V schedules ``ScheduleZBVZeroBubble`` / ``ScheduleDualPipeV`` (two
    ``PipelineStage`` s per rank, placed in a V).

    Each step runs PyTorch's schedule on one copy of this rank's stages and :func:`run_schedule`
    on an identical copy, on the same batch, alternating which goes first; returns both losses,
    the largest gradient difference between the copies, both step times (after ``warmup``) and,
    for the V schedules, the compute order PyTorch's schedule gave this rank next to ours. No
    optimizer step: the gradients are compared.
    """
    import torch.distributed.pipelining as pipelining  # noqa: PLC0415  heavy, and only this comparison needs it

    cfg = cfg or GPTConfig()
    if schedule not in TORCH_SCHEDULES:
        raise ValueError(f"torch.distributed.pipelining comparison supports {sorted(TORCH_SCHEDULES)}, got "
                         f"{schedule!r}")
    p, rank = dist.get_world_size(), dist.get_rank()
    v = 2 if schedule in V_SCHEDULES else 1
    batch_size = batch_size or m
    check_setup(p, m, cfg.n_layer, batch_size, schedule, v)
    if schedule == "1f1b" and m < p:
        raise ValueError(f"torch's Schedule1F1B needs m >= p (it refuses m={m} < p={p}); distlab's 1F1B runs it")
    keep_freed_memory()
    dev = rank_device()
    S, placement = p * v, stage_placement(p, v, placement_style(schedule))
    partition = even_partition(cfg.n_layer, S)
    theirs = build_stages(cfg, partition, rank, p, seed, dev, placement)
    mine = build_stages(cfg, partition, rank, p, seed, dev, placement)
    pipes = [pipelining.PipelineStage(theirs[s], s, S, dev) for s in sorted(theirs)]
    schedule_class = getattr(pipelining, TORCH_SCHEDULES[schedule])
    sched = schedule_class(pipes[0] if v == 1 else pipes, n_microbatches=m, loss_fn=lm_loss)
    actions = make_schedule(schedule, p, m, v)[rank]
    out = {"rank": rank, "ours_times": [], "torch_times": [], "ours_losses": [], "torch_losses": [], "grad_diff": 0.0,
           "grad_name": ""}
    if v > 1:  # PyTorch's order of this rank's computes (an overlapped F&B pair is its two actions), and ours
        out["torch_order"] = [repr(sub) for a in sched.pipeline_order[rank] if a is not None
                              for sub in (a.sub_actions or (a,))]
        out["ours_order"] = [repr(a) for a in actions if a.kind in ("F", "B", "I", "W")]

    def run_torch(x, y):
        losses: list = []
        first, last = 0 in theirs, S - 1 in theirs
        args = (x,) if first else ()
        sched.step(*args, **({"target": y, "losses": losses} if last else {}))
        return statistics.fmean(t.item() for t in losses) if losses else None

    def run_ours(x, y):
        stats = run_schedule(actions, mine, split_microbatches(x, y, m), p=p, num_stages=S, placement=placement)
        return statistics.fmean(stats.losses.values()) if stats.losses else None

    for step in range(warmup + steps):
        x, y = synthetic_batch(cfg, batch_size, step, seed=data_seed)
        x, y = x.to(dev), y.to(dev)
        order = [("torch", run_torch), ("ours", run_ours)] if step % 2 else [("ours", run_ours), ("torch", run_torch)]
        for name, fn in order:
            if name == "ours" and not ours:
                continue
            dist.barrier()
            start = time.perf_counter()
            loss = fn(x, y)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            elapsed = time.perf_counter() - start
            dist.barrier()
            if step >= warmup:
                out[f"{name}_times"].append(elapsed)
            out[f"{name}_losses"].append(loss)
        if ours:
            for s in mine:
                theirs_grads = dict(theirs[s].named_parameters())
                for name, q in mine[s].named_parameters():
                    diff = (q.grad - theirs_grads[name].grad).abs().max().item()
                    if diff >= out["grad_diff"]:
                        out["grad_diff"], out["grad_name"] = diff, name
        for q in [q for stage in (*theirs.values(), *mine.values()) for q in stage.parameters()]:
            q.grad = None
    return out


def train(steps: int = 20, schedule: str = "1f1b", microbatches: int = 8, virtual: int = 1, rows: int = 2,
          n_layer: int = 8, d_model: int = 128, n_head: int = 4, vocab_size: int = 256, seq_len: int = 64,
          optimizer: str = "adamw", lr: float = 1e-3, seed: int = 0, warmup: int = 1, log_every: int = 0,
          peak: float | str = "measured") -> dict:
    """Train the lab's GPT with a pipeline over all ranks; the entry point for torchrun.

    ``rows`` sequences per micro-batch, ``microbatches`` per step. On GPUs the stages run
    in bf16 where the GPU supports it (compute capability 8.0+), else fp32. Returns this
    rank's summary: its stages and layers, the loss before and after (from the last stage),
    the median step time, tokens/s and the bytes it sent to its neighbours per step.
    ``log_every=k`` (torchrun's default is 1): rank 0 prints every k-th step (the last stage's loss,
    sent to it each step, tokens/s, MFU against ``peak``) and a summary.
    """
    steps, microbatches, virtual, rows = int(steps), int(microbatches), int(virtual), int(rows)
    cfg = GPTConfig(vocab_size=int(vocab_size), seq_len=int(seq_len), n_layer=int(n_layer), n_head=int(n_head),
                    d_model=int(d_model), tied_embeddings=False)
    p = dist.get_world_size()
    check_setup(p, microbatches, cfg.n_layer, microbatches * rows, schedule, virtual)
    dev = rank_device()
    last = stage_placement(p, virtual, placement_style(schedule))[-1]  # the rank holding the last stage knows the loss
    report = step_report(f"pp-{p}", cfg, int(warmup) + steps, microbatches * rows * cfg.seq_len, log_every, peak,
                         int(warmup))

    def on_step(step, loss, seconds):
        value = torch.tensor([loss or 0.0], dtype=torch.float64, device=dev)
        dist.broadcast(value, src=last)
        report.step(step, value.item(), seconds)

    dtype = torch.bfloat16 if native_bf16(dev) else None
    if dist.get_rank() == 0:
        print(f"pipeline of {dist.get_world_size()} ranks on {dev.type}, "
              f"{'bf16' if dtype is not None else 'fp32'} stages, schedule {schedule}", flush=True)
    result = pipeline_worker(schedule, cfg, m=microbatches, v=virtual, batch_size=microbatches * rows, steps=steps,
                             warmup=int(warmup), optimizer=optimizer, lr=float(lr), seed=int(seed),
                             return_state=False, dtype=dtype, on_step=on_step if report else None)
    losses = torch.tensor([result["losses"][0] or 0.0, result["losses"][-1] or 0.0], dtype=torch.float64, device=dev)
    dist.broadcast(losses, src=last)
    step_time = statistics.median(result["step_times"]) if result["step_times"] else float("nan")
    return {"rank": result["rank"], "schedule": schedule, "stages": result["stages"],
            "layers": {s: f"{r[0]}-{r[-1]}" for s, r in result["layers"].items()},
            "loss_first": round(losses[0].item(), 4), "loss_last": round(losses[1].item(), 4),
            "step_time_s": round(step_time, 4), "tokens_per_s": round(microbatches * rows * seq_len / step_time, 1),
            "sent_bytes_per_step": result["sent_bytes"], "losses": result["losses"],
            **({"mfu": report.finish()["mfu"]} if report else {})}
