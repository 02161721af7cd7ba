"""Training with every stage on real ranks, the same run with PyTorch's own ZeRO/FSDP, and what they cost.

:func:`train_worker` trains the lab's GPT with DDP (stage 0) or ZeRO stage 1/2/3 built from
scratch, or with ``ZeroRedundancyOptimizer`` (stage 1) / FSDP2 ``fully_shard`` (stage 3), on
this rank's slice of each global batch, and reports losses, step times, the full weights
(gathered), bytes of parameters/gradients/optimizer state this rank holds, the bytes each
collective moved per step and the peak memory. :func:`train` is the same for torchrun::

    torchrun --nproc-per-node=4 -m distlab.torchrun distlab.zero:train stage=3 steps=20
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from distlab.data_parallel import DEFAULT_BUCKET_CAP_BYTES, _require_process_group, broadcast_parameters
from distlab.flops import step_report
from distlab.memory import tensor_bytes
from distlab.model import Block, GPTConfig
from distlab.reference import make_optimizer
from distlab.runtime import comm
from distlab.runtime.rank import device as rank_device
from distlab.runtime.rank import native_bf16
from distlab.runtime.timeline import span
from distlab.workload import build_model, local_batches
from distlab.zero.flat import Axis, check_shard_size, flat_params_of, gather_flat, mesh_axes
from distlab.zero.fsdp import ZeRO3, checkpoint_module, plan_units
from distlab.zero.optim import ShardedOptimizer
from distlab.zero.zero2 import ZeRO2

__all__ = ["STAGES", "WRAP_POLICIES", "compute_dtype", "validate", "make_engine", "state_bytes", "full_state_dict",
           "comm_snapshot", "comm_per_step", "device_mesh", "peak_memory", "train_worker", "train", "run_exercise"]

STAGES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
WRAP_POLICIES = {"block": (Block,), "model": ()}  # one unit per transformer block, or one for the whole model
_DTYPES = {None: None, "fp32": None, "bf16": torch.bfloat16}


def compute_dtype(device: torch.device) -> tuple[torch.dtype, str]:
    """The low-precision dtype for compute copies on ``device``, and one line saying why."""
    if device.type == "cuda":
        if native_bf16(device):
            return torch.bfloat16, f"bf16 on {torch.cuda.get_device_name(device)} (compute capability 8.0+)"
        return torch.float32, ("this GPU has no bf16; fp16 would need loss scaling, which this lab does not "
                               "build: computing in fp32")
    return torch.bfloat16, "bf16 on the CPU (emulated by PyTorch's CPU kernels: correct, not fast)"


# ---------------------------------------------------------------- validation (before any rank starts)

def validate(world_size: int, stage: int = 3, impl: str = "scratch", cfg: GPTConfig | None = None,
             batch_size: int = 8, wrap: str = "block", shard_size: int | None = None, dtype: str | None = None,
             model: str = "gpt", micro_batches: int = 1, **_) -> None:
    """Raise a one-line ``ValueError`` for a run that cannot work; call it before launching."""
    if stage not in STAGES:
        raise ValueError(f"stage={stage!r}: expected 0 (DDP), 1, 2 or 3 (ZeRO)")
    if impl not in ("scratch", "torch"):
        raise ValueError(f"impl={impl!r}: expected 'scratch' or 'torch'")
    if impl == "torch" and stage not in (1, 3):
        raise ValueError(f"impl='torch' exists for stage 1 (ZeroRedundancyOptimizer) and 3 (FSDP2), not {stage}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive integer")
    if batch_size % world_size:
        raise ValueError(f"global batch {batch_size} is not divisible by world_size={world_size}: every rank "
                         f"needs an equal slice for the averaged gradient to be the full-batch gradient")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches!r} must be a positive integer")
    if batch_size % (world_size * micro_batches):
        raise ValueError(f"global batch {batch_size} is not divisible by world_size·micro_batches = "
                         f"{world_size}·{micro_batches}: every micro-batch needs the same number of rows")
    if shard_size is not None:
        check_shard_size(world_size, shard_size)
        if stage == 0:
            raise ValueError("shard_size is a ZeRO option; DDP (stage 0) shards nothing")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected 'fp32' or 'bf16'")
    if wrap not in WRAP_POLICIES:
        raise ValueError(f"wrap={wrap!r}: expected one of {sorted(WRAP_POLICIES)}")
    plan_units(build_model(model, cfg or GPTConfig()), WRAP_POLICIES[wrap])


# ---------------------------------------------------------------- building a stage

def _optimizer_factory(name: str, lr: float, **options) -> Callable:
    """``factory(param_groups)`` building the reference's optimizer (one source: ``make_optimizer``)."""
    return functools.partial(make_optimizer, optimizer=name, lr=lr, **options)


def make_engine(stage: int, module: nn.Module, optimizer: str = "sgd", lr: float = 0.1, *, dtype=None,
                wrap: str = "block", shard_size: int | None = None, prefetch: bool = False,
                bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES, trace: bool = False,
                sharded_optimizer: Callable | None = None, reduce_fn: Callable | None = None,
                unshard_fn: Callable | None = None, reshard_fn: Callable | None = None):
    """``(model, optimizer)`` for DDP (stage 0) or ZeRO stage 1/2/3, from scratch, around ``module``.

    Stage 0 is DDP with a flat fp32 master (one all-reduce per step); ``shard_size`` < world
    size makes stages 1-3 hybrid (HSDP). ``sharded_optimizer``, ``reduce_fn``,
    ``unshard_fn``/``reshard_fn`` replace the library's pieces with an exercise's answers.
    """
    factory = _optimizer_factory(optimizer, lr)
    if stage == 0:
        broadcast_parameters(module)
        return module, ShardedOptimizer(module.parameters(), factory, shard=Axis.single(), replicate=Axis.world(),
                                        dtype=dtype)
    shard, replicate = mesh_axes(shard_size)
    if stage == 1:
        broadcast_parameters(module)
        if sharded_optimizer is not None:
            return module, sharded_optimizer(module.parameters(), factory)
        return module, ShardedOptimizer(module.parameters(), factory, shard=shard, replicate=replicate, dtype=dtype)
    if stage == 2:
        model = ZeRO2(module, bucket_cap_bytes, shard=shard, replicate=replicate, dtype=dtype, reduce_fn=reduce_fn)
        return model, model.optimizer(factory)
    model = ZeRO3(module, WRAP_POLICIES[wrap], shard=shard, replicate=replicate, dtype=dtype, prefetch=prefetch,
                  unshard_fn=unshard_fn, reshard_fn=reshard_fn, reduce_fn=reduce_fn, trace=trace)
    return model, model.optimizer(factory)


def _torch_engine(stage: int, module: nn.Module, optimizer: str, lr: float, dtype, wrap: str,
                  shard_size: int | None):
    """PyTorch's own: DDP + ``ZeroRedundancyOptimizer`` (stage 1) or FSDP2 ``fully_shard`` (stage 3)."""
    options = {"lr": lr, "weight_decay": 0.0}
    optimizer_class = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[optimizer]
    if stage == 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: PLC0415  heavy; only impl='torch' needs it

        model = DistributedDataParallel(module)  # broadcasts rank 0's weights
        return model, ZeroRedundancyOptimizer(module.parameters(), optimizer_class, **options)
    from torch.distributed.fsdp import (  # noqa: PLC0415  heavy, and only impl='torch' (FSDP2) needs it
        MixedPrecisionPolicy,
        fully_shard,
    )

    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else MixedPrecisionPolicy()
    mesh = device_mesh(shard_size)
    for m in module.modules():
        if m is not module and isinstance(m, WRAP_POLICIES[wrap]):
            fully_shard(m, mesh=mesh, mp_policy=policy)
    fully_shard(module, mesh=mesh, mp_policy=policy)
    return module, optimizer_class(module.parameters(), **options)


_meshes: dict = {}


def device_mesh(shard_size: int | None):
    """FSDP2's mesh, made once per rank process: 1-D, or (replicate, shard) for HSDP."""
    world = dist.get_world_size()
    shard_size = shard_size or world
    if shard_size not in _meshes:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        shape, names = ((world,), ("shard",)) if shard_size == world else \
            ((world // shard_size, shard_size), ("replicate", "shard"))
        _meshes[shard_size] = init_device_mesh(device_type, shape, mesh_dim_names=names)
    return _meshes[shard_size]


# ---------------------------------------------------------------- measuring

def state_bytes(module: nn.Module, optimizer) -> dict[str, int]:
    """Bytes this rank holds of parameters, gradients and optimizer state, each storage once.

    Parameters: the module's (views of flat buffers; a freed ZeRO-3 buffer holds 0 bytes)
    plus the shards. Gradients: ``p.grad`` plus reduced shards. Optimizer: fp32 masters and
    the inner optimizer's state (Adam's moments), minus anything already counted above.
    """
    flats = flat_params_of(module)
    params = list(module.parameters()) + [f.local for f in flats]
    grads = [p.grad for p in module.parameters()] + [f.grad_shard for f in flats]
    inner = getattr(optimizer, "optim", optimizer)
    state = [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)] if inner else []
    opt = [f.master for f in flats] + state
    p, g = tensor_bytes(params), tensor_bytes(params + grads) - tensor_bytes(params)
    return {"parameters": p, "gradients": g, "optimizer": tensor_bytes(params + grads + opt) - p - g}


@torch.no_grad()
def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every rank's view of the whole model, in fp32 (the masters in mixed precision); collective.

    Sharded buffers are all-gathered; DTensor parameters (FSDP2) are gathered with ``full_tensor()``.
    """
    values: dict[int, torch.Tensor] = {}
    for flat in flat_params_of(module):
        source = (flat.master if flat.master is not None else flat.local).float()
        full = torch.empty(flat.layout.padded_numel, dtype=torch.float32, device=source.device)
        gather_flat(full, source.contiguous(), flat.shard_axis)
        for p, view in zip(flat.params, flat.layout.views(full)):
            values[id(p)] = view.clone()
    out = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) in values:
            out[name] = values[id(t)].cpu()
        elif hasattr(t, "full_tensor"):
            out[name] = t.full_tensor().detach().float().cpu()
        else:
            out[name] = t.detach().float().cpu()
    return out


comm_snapshot = comm.snapshot  # this rank's counts now, for :func:`comm_per_step`


def comm_per_step(before: comm.Snapshot, after: comm.Snapshot, steps: int) -> dict[str, dict[str, float]]:
    """Calls, payload and sent bytes per step of each collective between two :func:`comm_snapshot` s
    (canonical names: ``all_gather`` whichever torch function gathered); the step barriers are left out."""
    traffic = comm.since(before, after)
    return {op: {"calls": c.calls / steps, "payload": c.payload_bytes / steps, "wire": c.wire_bytes / steps}
            for op, c in traffic.ops.items() if op != "barrier"}


def peak_memory(step: Callable[[], None], *tracked) -> tuple[int, str]:
    """Peak bytes of live tensors during ``step()``, and how they were measured.

    On a GPU: ``torch.cuda.max_memory_allocated``. On the CPU there is no allocator
    statistic, so PyTorch's ``MemTracker`` (a dispatch mode that follows every tensor
    storage, including FSDP's storage resizes) counts them; ``tracked`` are the modules,
    optimizers and tensors that exist before the step.
    """
    device = next((t.device for t in _tracked_tensors(tracked)), torch.device("cpu"))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device), "torch.cuda.max_memory_allocated"
    from torch.distributed._tools.mem_tracker import MemTracker  # noqa: PLC0415  heavy, and only the CPU path needs it

    tracker = MemTracker()
    tracker.track_external(*tracked)
    with tracker:
        step()
    peak = tracker.get_tracker_snapshot("peak")
    return int(sum(snap["Total"] for snap in peak.values())), "bytes of live tensors (torch MemTracker, CPU)"


def _tracked_tensors(tracked):
    for item in tracked:
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, nn.Module):
            yield from item.parameters()


# ---------------------------------------------------------------- training

def train_worker(stage: int = 3, impl: str = "scratch", cfg: GPTConfig | None = None, steps: int = 3,
                 batch_size: int = 8, seed: int = 0, data_seed: int = 0, optimizer: str = "sgd", lr: float = 0.1,
                 dtype: str | None = None, wrap: str = "block", shard_size: int | None = None, prefetch: bool = False,
                 checkpointing: bool = False, bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES, model: str = "gpt",
                 warmup: int = 0, return_state: bool = True, measure_state: bool = False, measure_peak: bool = False,
                 trace: bool = False, sharded_optimizer: Callable | None = None, reduce_fn: Callable | None = None,
                 unshard_fn: Callable | None = None, reshard_fn: Callable | None = None,
                 micro_batches: int = 1, on_step: Callable | None = None) -> dict:
    """Train on this rank (inside ``distlab.launch``/``Ranks.run`` or torchrun) and report.

    ``batch_size`` is the global batch, split over the ranks; ``micro_batches`` > 1 splits each
    rank's share into that many forward/backward passes per optimizer step (gradient accumulation,
    the loss scaled by 1/k): DDP and ZeRO-1 accumulate full gradients and communicate once per
    step, ZeRO-2/3 reduce-scatter every micro-batch's gradients (and ZeRO-3 gathers per micro-batch).
    From-scratch stages start each rank from a different seed (the initial broadcast must happen);
    PyTorch's FSDP2 expects equal initial weights, so it gets rank 0's seed everywhere.
    ``dtype="bf16"``: mixed precision. ``measure_state``: bytes held after the last step's optimizer step (before
    ``zero_grad``); ``measure_peak``: peak memory of one more, untimed step. ``comm``: traffic per timed step.
    ``on_step(step, loss, seconds)`` is called after every step (a torchrun job's per-step line).
    """
    _require_process_group()
    validate(dist.get_world_size(), stage, impl, cfg, batch_size, wrap, shard_size, dtype, model, micro_batches)
    cfg = cfg or GPTConfig()
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = rank_device()
    same_seed = impl == "torch" and stage == 3
    module = build_model(model, cfg, seed=seed if rank == 0 or same_seed else seed + 1000 * rank + 1).to(dev)
    if checkpointing:
        for block in getattr(module, "blocks", getattr(getattr(module, "gpt", None), "blocks", [])):
            checkpoint_module(block)
    low = _DTYPES[dtype]
    if impl == "torch":
        net, opt = _torch_engine(stage, module, optimizer, lr, low, wrap, shard_size)
    else:
        net, opt = make_engine(stage, module, optimizer, lr, dtype=low, wrap=wrap, shard_size=shard_size,
                               prefetch=prefetch, bucket_cap_bytes=bucket_cap_bytes, trace=trace,
                               sharded_optimizer=sharded_optimizer, reduce_fn=reduce_fn, unshard_fn=unshard_fn,
                               reshard_fn=reshard_fn)
    losses, times, held, peak = [], [], None, None
    before = after = comm_snapshot()
    total = warmup + steps + int(measure_peak)  # the peak is measured in one extra, untimed step
    for step in range(total):
        micro = [(x.to(dev), y.to(dev)) for x, y in local_batches(cfg, batch_size, step, rank, world,
                                                                  micro_batches, data_seed)]
        last_timed = step == warmup + steps - 1

        def one_step():
            nonlocal held
            total_loss = 0.0
            for x, y in micro:
                with span("forward"):
                    _, loss = net(x, y)
                with span("backward"):
                    (loss / len(micro)).backward()
                total_loss += loss.item() / len(micro)
            with span("optimizer"):
                opt.step()
            if last_timed and measure_state:
                held = state_bytes(module, opt)
            opt.zero_grad(set_to_none=True)
            losses.append(total_loss)

        dist.barrier()
        start = time.perf_counter()
        if step == total - 1 and measure_peak:
            peak = peak_memory(one_step, module, getattr(opt, "optim", opt),
                               *[t for f in flat_params_of(module) for t in (f.local, f.master) if t is not None])
        else:
            one_step()
        dist.barrier()
        elapsed = time.perf_counter() - start
        if warmup <= step < warmup + steps:
            times.append(elapsed)
        if on_step is not None and step < warmup + steps:
            on_step(step, losses[-1], elapsed)
        if step == warmup - 1:  # count the timed steps only
            before = comm_snapshot()
        if last_timed:
            after = comm_snapshot()
    traffic = comm_per_step(before, after, steps)
    zero3 = net if isinstance(net, ZeRO3) else None
    return {
        "rank": rank, "stage": stage, "impl": impl, "world_size": world, "losses": losses, "step_times": times,
        "state": full_state_dict(module) if return_state else None, "state_bytes": held,
        "n_params": sum(p.numel() for p in module.parameters()) if impl == "scratch" else None,
        "comm": traffic, "peak_memory": peak, "peak_param_bytes": zero3.peak_param_bytes if zero3 else None,
    }


def train(steps: int = 20, stage: int = 3, impl: str = "scratch", batch_size: int = 8, n_layer: int = 4,
          d_model: int = 128, n_head: int = 4, vocab_size: int = 256, seq_len: int = 64, dtype: str | None = None,
          optimizer: str = "adamw", lr: float = 1e-3, wrap: str = "block", shard_size: int | None = None,
          prefetch: bool = True, checkpointing: bool = False, warmup: int = 2, seed: int = 0,
          measure_peak: bool = False, micro_batches: int = 1, log_every: int = 0,
          peak: float | str = "measured") -> dict:
    """Train the lab's GPT with one stage; the entry point for torchrun.

    ``batch_size`` is per rank (the global batch is ``batch_size · world_size``), run as ``micro_batches``
    forward/backward passes per step (gradient accumulation). Returns this
    rank's summary: losses, median step time, tokens/s over all ranks, bytes held per rank,
    bytes moved per step by each collective, and (``measure_peak``) peak memory.
    ``log_every=k`` (torchrun's default is 1): rank 0 prints every k-th step (its shard's loss, tokens/s,
    MFU against ``peak``) and a summary.
    """
    _require_process_group()
    cfg = GPTConfig(vocab_size=int(vocab_size), seq_len=int(seq_len), n_layer=int(n_layer), n_head=int(n_head),
                    d_model=int(d_model))
    world = dist.get_world_size()
    report = step_report(f"zero-{int(stage)}", cfg, int(warmup) + int(steps), int(batch_size) * world * cfg.seq_len,
                         log_every, peak, int(warmup))
    out = train_worker(int(stage), impl, cfg, steps=int(steps), batch_size=int(batch_size) * world,
                       seed=int(seed), optimizer=optimizer, lr=float(lr), dtype=dtype, wrap=wrap,
                       shard_size=shard_size, prefetch=bool(prefetch), checkpointing=bool(checkpointing),
                       warmup=int(warmup), return_state=False, measure_state=impl == "scratch",
                       measure_peak=bool(measure_peak), micro_batches=int(micro_batches),
                       on_step=report.step if report else None)
    step_time = statistics.median(out["step_times"])
    return {
        "rank": out["rank"], "stage": STAGES[int(stage)], "impl": impl, "world_size": world,
        "loss_first": round(out["losses"][0], 4), "loss_last": round(out["losses"][-1], 4),
        "step_time_s": round(step_time, 4), "tokens_per_s": round(int(batch_size) * world * cfg.seq_len / step_time, 1),
        "state_bytes": out["state_bytes"], "peak_memory": out["peak_memory"],
        "comm_bytes_per_step": {op: round(row["wire"]) for op, row in out["comm"].items()},
        "losses": out["losses"], **({"mfu": report.finish()["mfu"]} if report else {}),
    }


# ---------------------------------------------------------------- exercises on warm ranks

def run_exercise(ranks, **kwargs):
    """``ranks.run(train_worker, kwargs=kwargs)``, the name lab 04's notebook calls.

    An unfinished exercise's stub raises on every rank at the same point, outside any op, so the
    launcher keeps the warm ranks and raises ``RankFailed`` naming ``NotImplementedError``, which
    ``distlab.needs`` turns into one line.
    """
    return ranks.run(train_worker, kwargs=kwargs)
