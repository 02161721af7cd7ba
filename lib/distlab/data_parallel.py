"""Distributed data parallel (DDP) from scratch: naive, bucketed, and overlapped with backward.

Every rank holds a full copy of the model and trains on its own slice of the
global batch. After backward each rank has the gradient of *its* local mean
loss; averaging those gradients over the N ranks gives exactly the gradient of
the mean loss over the whole batch (the local batches are equal-sized), so
after ``optimizer.step()`` every rank holds the weights a single process would
have after training on the full batch. Three ways to do the averaging:

* :class:`NaiveDDP` — after backward, one blocking ``all_reduce`` per parameter.
* :class:`BucketedDDP` — parameters grouped (in reverse registration order, roughly
  the order backward produces their gradients) into buckets of ``bucket_cap_bytes``;
  one flat ``all_reduce`` per bucket: fewer, larger messages. That is the lab's
  simplified rule; :func:`pytorch_buckets` is the one PyTorch's DDP rebuilds its
  buckets with after the first iteration.
* :class:`OverlappedDDP` — the buckets' all-reduces are launched asynchronously
  from gradient hooks as soon as a bucket is full, so communication runs while
  backward is still computing the earlier layers; ``finish_gradient_sync()``
  waits for them before the optimizer step.

All three (and :class:`TorchDDP`, PyTorch's own, for comparison) share one
interface used by :func:`train_step`: ``ddp(x, y)`` runs the module,
``ddp.no_sync()`` skips communication on gradient-accumulation micro-steps and
``ddp.finish_gradient_sync()`` completes the averaging.

The module-level :func:`train` runs unchanged under ``distlab.launch`` and
under torchrun::

    torchrun --nproc-per-node=4 -m distlab.torchrun distlab.data_parallel:train steps=20 variant=overlapped
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from contextlib import contextmanager, nullcontext
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from distlab import workload
from distlab.flops import step_report
from distlab.model import GPT, GPTConfig, synthetic_batch
from distlab.reference import make_optimizer
from distlab.runtime import comm
from distlab.runtime.rank import device
from distlab.runtime.timeline import span

__all__ = [
    "DEFAULT_BUCKET_CAP_BYTES", "broadcast_parameters", "allreduce_gradients",
    "assign_buckets", "pytorch_buckets", "pytorch_bucket_count", "gradient_arrival_order", "torch_ddp_buckets",
    "allreduce_buckets", "Bucket", "NaiveDDP", "BucketedDDP", "OverlappedDDP", "TorchDDP",
    "VARIANTS", "make_ddp", "train_step", "train_worker", "exposed_sync_times", "train",
]

# The models, batches and single-process run every data-parallel topic trains moved to distlab.workload, below
# the topics. Imports of them from here keep working for a term, with a DeprecationWarning naming the new path.
MOVED_TO_WORKLOAD = ("gradient_params", "gradient_bytes", "EdgeCaseGPT", "build_model", "global_batch",
                     "local_batches", "reference_run")


def __getattr__(name: str):
    if name in MOVED_TO_WORKLOAD:
        warnings.warn(f"distlab.data_parallel.{name} moved to distlab.workload.{name}: import it from there (the old "
                      "path goes after this term)", DeprecationWarning, stacklevel=2)
        return getattr(workload, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

DEFAULT_BUCKET_CAP_BYTES = 25 * 2**20  # PyTorch DDP's default bucket_cap_mb=25


# ---------------------------------------------------------------- helpers shared by every variant

def _require_process_group() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: run this inside distlab.launch(fn, world_size) / "
            "distlab.Ranks(n).run(fn), or under torchrun (python -m distlab.torchrun module:function)")


@torch.no_grad()
def broadcast_parameters(module: nn.Module, src: int = 0) -> None:
    """Copy rank ``src``'s parameters (frozen ones too) and buffers to every rank."""
    _require_process_group()
    for p in module.parameters():
        dist.broadcast(p.data, src=src)
    for b in module.buffers():
        dist.broadcast(b.data, src=src)


@torch.no_grad()
def allreduce_gradients(module: nn.Module) -> None:
    """Naive DDP: average every gradient over the ranks, one blocking all-reduce per parameter.

    A parameter without a gradient on this rank (unused in this step) still joins
    its all-reduce with zeros, so every rank makes the same calls in the same order.
    """
    _require_process_group()
    world = dist.get_world_size()
    for p in workload.gradient_params(module):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad.div_(world)


def _fill_buckets(ordered: Sequence[nn.Parameter], caps: Sequence[int]) -> list[list[nn.Parameter]]:
    """Walk ``ordered``, append each parameter to the open bucket and close it once it holds the
    current cap or more; bucket ``i`` uses ``caps[min(i, len(caps) - 1)]``. A change of
    dtype/device starts a new bucket (one flat buffer holds one dtype on one device)."""
    buckets: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in ordered:
        if current and (p.dtype, p.device) != (current[0].dtype, current[0].device):
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= caps[min(len(buckets), len(caps) - 1)]:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def _unique_grad_params(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    seen: set[int] = set()
    ordered = []
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            ordered.append(p)
    return ordered


def _check_cap(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{name} must be a positive number of bytes, got {value!r}")


def assign_buckets(params: Iterable[nn.Parameter], bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES
                   ) -> list[list[nn.Parameter]]:
    """The lab's simplified bucket rule: walk the parameters in *reverse* registration order
    (roughly the order backward produces their gradients), append each to the open bucket, and
    close the bucket once it holds ``bucket_cap_bytes`` or more. Frozen parameters are skipped,
    a tied weight appears once, and a change of dtype/device starts a new bucket.

    PyTorch's DDP differs in two ways (:func:`pytorch_buckets`): with its default cap the first
    bucket is capped at ``dist._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB), and with
    ``find_unused_parameters=False`` it reduces everything as one bucket in the first iteration,
    then rebuilds the buckets in the order the gradients actually arrived."""
    _check_cap("bucket_cap_bytes", bucket_cap_bytes)
    return _fill_buckets(list(reversed(_unique_grad_params(params))), [bucket_cap_bytes])


def pytorch_buckets(arrival_order: Iterable[nn.Parameter], bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
                    first_bucket_cap_bytes: int | None = None) -> list[list[nn.Parameter]]:
    """The buckets PyTorch's DDP rebuilds after its first iteration (``Reducer::rebuild_buckets``):
    the parameters in the order their gradients arrived, the first bucket closed once it holds
    ``first_bucket_cap_bytes`` or more (by default ``dist._DEFAULT_FIRST_BUCKET_BYTES``, 1 MiB, so
    the first all-reduce starts early), every later one at ``bucket_cap_bytes``. DDP uses the small
    first cap only when ``bucket_cap_mb`` is left at its default; pass the same value for both
    otherwise."""
    first = dist._DEFAULT_FIRST_BUCKET_BYTES if first_bucket_cap_bytes is None else first_bucket_cap_bytes
    _check_cap("bucket_cap_bytes", bucket_cap_bytes)
    _check_cap("first_bucket_cap_bytes", first)
    return _fill_buckets(_unique_grad_params(arrival_order), [first, bucket_cap_bytes])


def pytorch_bucket_count(total_bytes: float, bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
                         first_bucket_cap_bytes: int | None = None) -> int:
    """How many buckets :func:`pytorch_buckets` makes of ``total_bytes`` of gradients in many tensors far smaller
    than a cap (the chapter's case): the first holds ``first_bucket_cap_bytes`` (1 MiB by default), every later
    one ``bucket_cap_bytes``, the last what is left. Larger tensors can fill a bucket past its cap and make one
    fewer (300 tensors of 100 kB in 30 MB do not; 800 in 80 MB give 4, not 5)."""
    first = dist._DEFAULT_FIRST_BUCKET_BYTES if first_bucket_cap_bytes is None else first_bucket_cap_bytes
    _check_cap("bucket_cap_bytes", bucket_cap_bytes)
    _check_cap("first_bucket_cap_bytes", first)
    if total_bytes <= 0:
        return 0
    return 1 + max(0, math.ceil((total_bytes - first) / bucket_cap_bytes))


def gradient_arrival_order(module: nn.Module, *inputs) -> list[nn.Parameter]:
    """The order in which one backward of ``module(*inputs)`` (which returns ``(output, loss)``)
    completes each parameter's gradient, read from ``register_post_accumulate_grad_hook`` — the
    moment DDP's reducer marks a gradient ready. A tied weight is complete only once all its uses
    have been differentiated."""
    arrived: list[nn.Parameter] = []
    hooks = [p.register_post_accumulate_grad_hook(arrived.append) for p in _unique_grad_params(module.parameters())]
    try:
        module(*inputs)[1].backward()
    finally:
        for h in hooks:
            h.remove()
    module.zero_grad(set_to_none=True)
    return arrived


def torch_ddp_buckets(cfg: GPTConfig | None = None, iterations: int = 2, batch_size: int = 2,
                      **ddp_options) -> dict:
    """Run PyTorch's own ``DistributedDataParallel`` on the lab's GPT for ``iterations`` backward
    passes (call on every rank) and record, through a communication hook, the buckets its reducer
    all-reduced in each: per iteration a list of ``(parameter names, bytes)`` in launch order.
    Also returns the caps this torch uses, read from it, and the gradients' arrival order (measured in
    a separate backward before DDP wraps the model)."""
    _require_process_group()
    cfg = cfg or GPTConfig()
    dev = device()
    model = GPT(cfg, seed=0).to(dev)
    names = {id(p): n for n, p in model.named_parameters()}
    x, y = synthetic_batch(cfg, batch_size, step=0)
    arrival = [names[id(p)] for p in gradient_arrival_order(model, x.to(dev), y.to(dev))]
    ddp = DistributedDataParallel(model, **ddp_options)
    launched: list[list[tuple[list[str], int]]] = []

    def record(state, bucket):  # called by the reducer once per bucket, in launch order
        buffer = bucket.buffer()
        launched[-1].append(([names[id(p)] for p in bucket.parameters()], buffer.numel() * buffer.element_size()))
        work = dist.all_reduce(buffer, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0].div_(dist.get_world_size()))

    ddp.register_comm_hook(None, record)
    for it in range(iterations):
        launched.append([])
        xi, yi = synthetic_batch(cfg, batch_size, step=it)
        ddp(xi.to(dev), yi.to(dev))[1].backward()
    config = getattr(ddp, "_bucket_config", None)  # torch >= 2.12 keeps the caps here
    if config is not None:
        first = config.first_bucket_bytes_cap
    else:  # earlier torch: the 1 MiB first cap applies only when bucket_cap_mb is left at its default
        first = dist._DEFAULT_FIRST_BUCKET_BYTES if "bucket_cap_mb" not in ddp_options else ddp.bucket_bytes_cap
    return {"launched": launched, "arrival": arrival, "bucket_cap_bytes": ddp.bucket_bytes_cap,
            "first_bucket_cap_bytes": first}


@torch.no_grad()
def allreduce_buckets(buckets: Sequence[Sequence[nn.Parameter]], group=None) -> None:
    """Bucketed DDP on plain lists of parameters: per bucket, flatten the gradients (zeros
    for a missing one) into one tensor, all-reduce it once over ``group`` (default: the
    world), divide by the group's size, copy back."""
    _require_process_group()
    world = dist.get_world_size(group)
    for bucket in buckets:
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in bucket])
        dist.all_reduce(flat, group=group)
        flat.div_(world)
        offset = 0
        for p in bucket:
            n = p.numel()
            p.grad = flat[offset:offset + n].view_as(p).clone()
            offset += n


class Bucket:
    """One bucket: its parameters and a flat buffer with a view shaped like each of them."""

    def __init__(self, index: int, params: Sequence[nn.Parameter]):
        if not params:
            raise ValueError("a bucket needs at least one parameter")
        self.index = index
        self.params = list(params)
        self.numel = sum(p.numel() for p in self.params)
        self.buffer = torch.zeros(self.numel, dtype=self.params[0].dtype, device=self.params[0].device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in self.params:
            self.views.append(self.buffer[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    @property
    def nbytes(self) -> int:
        return self.numel * self.buffer.element_size()

    @torch.no_grad()
    def load_grad(self, j: int) -> None:
        """Copy parameter ``j``'s gradient into the buffer (zeros when it has none)."""
        p, view = self.params[j], self.views[j]
        if p.grad is None:
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():  # already the view: autograd accumulated in place
            view.copy_(p.grad)

    def load_grads(self) -> None:
        for j in range(len(self.params)):
            self.load_grad(j)

    def store_grads(self) -> None:
        """Make every ``p.grad`` a view of the (reduced) buffer: no copy back, and a next
        backward after ``zero_grad(set_to_none=False)`` accumulates straight into the bucket."""
        for p, view in zip(self.params, self.views):
            p.grad = view

    def __repr__(self) -> str:
        return f"Bucket({self.index}, {len(self.params)} params, {self.nbytes} bytes)"


# ---------------------------------------------------------------- the DDP wrappers

class _DataParallel(nn.Module):
    """What every variant shares: broadcast at construction, forward, no_sync, bookkeeping."""

    def __init__(self, module: nn.Module, *, broadcast: bool = True, find_unused_parameters: bool = False):
        super().__init__()
        _require_process_group()
        self.module = module
        self.world_size = dist.get_world_size()
        self.grad_params = workload.gradient_params(module)
        self.require_backward_grad_sync = True
        self.find_unused_parameters = find_unused_parameters
        if broadcast:
            broadcast_parameters(module)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Inside, backward only accumulates local gradients; the next synced backward averages them."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    @property
    def grad_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.grad_params)

    def _local_usage(self) -> torch.Tensor | None:
        """With ``find_unused_parameters``: 1 for each parameter that has a gradient on this rank."""
        if not self.find_unused_parameters:
            return None
        return torch.tensor([p.grad is not None for p in self.grad_params], dtype=torch.int32,
                            device=self.grad_params[0].device if self.grad_params else None)

    def _global_usage(self) -> torch.Tensor | None:
        """How many ranks produced each gradient this step (one small extra all-reduce;
        call it before missing gradients are zero-filled)."""
        used = self._local_usage()
        if used is not None:
            dist.all_reduce(used)
        return used

    def _drop_unused(self, used: torch.Tensor | None) -> None:
        """A parameter no rank used keeps ``grad=None``, as in single-process training (so an
        optimizer like AdamW skips it instead of decaying its moments with a zero gradient)."""
        if used is None:
            return
        for p, count in zip(self.grad_params, used.tolist()):
            if count == 0:
                p.grad = None

    def finish_gradient_sync(self) -> None:  # pragma: no cover - every variant overrides it
        raise NotImplementedError


class NaiveDDP(_DataParallel):
    """After backward: one blocking all-reduce per parameter (:func:`allreduce_gradients`)."""

    def finish_gradient_sync(self) -> None:
        if self.require_backward_grad_sync:
            used = self._global_usage()
            allreduce_gradients(self.module)
            self._drop_unused(used)


class BucketedDDP(_DataParallel):
    """After backward: one blocking all-reduce per bucket of about ``bucket_cap_bytes``.

    ``self.buckets`` lists :class:`Bucket` objects; ``self.position[p]`` is ``(bucket
    index, slot in that bucket)`` of parameter ``p``.
    """

    def __init__(self, module: nn.Module, bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES, *, broadcast: bool = True,
                 find_unused_parameters: bool = False):
        super().__init__(module, broadcast=broadcast, find_unused_parameters=find_unused_parameters)
        self.bucket_cap_bytes = bucket_cap_bytes
        self.buckets = [Bucket(i, ps) for i, ps in enumerate(assign_buckets(self.grad_params, bucket_cap_bytes))]
        self.position = {p: (i, j) for i, b in enumerate(self.buckets) for j, p in enumerate(b.params)}

    @torch.no_grad()
    def finish_gradient_sync(self) -> None:
        if not self.require_backward_grad_sync:
            return
        used = self._global_usage()
        for bucket in self.buckets:
            bucket.load_grads()
            dist.all_reduce(bucket.buffer)
            bucket.buffer.div_(self.world_size)
            bucket.store_grads()
        self._drop_unused(used)


class OverlappedDDP(BucketedDDP):
    """Bucketed DDP whose all-reduces run during backward.

    A post-accumulate-grad hook on every parameter copies its gradient into its
    bucket; when a bucket is full its flat buffer is divided by the world size and
    all-reduced with ``async_op=True``. Buckets are launched strictly in bucket
    order (a full bucket waits for the earlier ones), so every rank issues the same
    collectives in the same order even when hooks fire in a different order or a
    parameter gets no gradient. ``finish_gradient_sync()`` launches the buckets that
    never filled (missing gradients count as zeros), waits for every handle and
    leaves each ``p.grad`` a view of its reduced bucket.
    """

    def __init__(self, module: nn.Module, bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES, *, broadcast: bool = True,
                 find_unused_parameters: bool = False):
        super().__init__(module, bucket_cap_bytes, broadcast=broadcast, find_unused_parameters=find_unused_parameters)
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self.grad_params]
        self._reset()

    def _reset(self) -> None:
        self._ready: list[set[int]] = [set() for _ in self.buckets]
        self._next = 0  # the next bucket to launch
        self._works: list = []

    def forward(self, *args, **kwargs):
        if self._works or any(self._ready):
            raise RuntimeError("OverlappedDDP: finish_gradient_sync() was not called after the last synced "
                               "backward; call it before optimizer.step() in every step")
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def _grad_ready(self, param: torch.Tensor) -> None:
        if not self.require_backward_grad_sync:
            return
        i, j = self.position[param]
        if j in self._ready[i]:
            raise RuntimeError("OverlappedDDP: a gradient arrived twice before finish_gradient_sync(); run one "
                               "backward per step, or accumulate inside ddp.no_sync()")
        self.buckets[i].load_grad(j)
        self._ready[i].add(j)
        self._launch_ready()

    @torch.no_grad()
    def _launch_ready(self, flush: bool = False) -> None:
        """Launch, in bucket order, every bucket that is full (all of them when ``flush``)."""
        while self._next < len(self.buckets):
            bucket, ready = self.buckets[self._next], self._ready[self._next]
            if len(ready) < len(bucket.params):
                if not flush:
                    return
                for j in range(len(bucket.params)):
                    if j not in ready:  # no gradient this step: its current grad, or zeros
                        bucket.load_grad(j)
            bucket.buffer.div_(self.world_size)
            self._works.append(dist.all_reduce(bucket.buffer, async_op=True))
            self._next += 1

    def finish_gradient_sync(self) -> None:
        if not self.require_backward_grad_sync:
            return
        used = self._local_usage()  # before the flush zero-fills the buckets' missing slots
        self._launch_ready(flush=True)
        if used is not None:  # after every bucket, so all ranks issue their collectives in one order
            dist.all_reduce(used)
        for bucket, work in zip(self.buckets, self._works):
            work.wait()
            bucket.store_grads()
        self._reset()
        self._drop_unused(used)

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


class TorchDDP:
    """``torch.nn.parallel.DistributedDataParallel`` behind the same interface (its C++
    reducer averages during backward; its collectives are not in distlab's comm log)."""

    def __init__(self, module: nn.Module, bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES, **ddp_options):
        _require_process_group()
        self.module = module
        self.ddp = DistributedDataParallel(module, bucket_cap_mb=bucket_cap_bytes / 2**20, **ddp_options)
        self.grad_params = workload.gradient_params(module)

    def __call__(self, *args, **kwargs):
        return self.ddp(*args, **kwargs)

    def no_sync(self):
        return self.ddp.no_sync()

    def finish_gradient_sync(self) -> None:
        pass  # the reducer has already waited for its buckets at the end of backward


VARIANTS: dict[str, Callable] = {"naive": NaiveDDP, "bucketed": BucketedDDP, "overlapped": OverlappedDDP,
                                 "torch": TorchDDP}


def make_ddp(variant: str, module: nn.Module, bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
             find_unused_parameters: bool = False):
    """``variant`` ∈ naive | bucketed | overlapped | torch, wrapped around ``module``."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    if variant == "naive":
        return NaiveDDP(module, find_unused_parameters=find_unused_parameters)
    return VARIANTS[variant](module, bucket_cap_bytes, find_unused_parameters=find_unused_parameters)


# ---------------------------------------------------------------- training

def train_step(ddp, optimizer: torch.optim.Optimizer, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
               *, set_to_none: bool = True) -> float:
    """One optimizer step over ``micro_batches`` (gradient accumulation when there are
    several): communication only on the last micro-step, the loss scaled by 1/A so the
    accumulated gradient is the mean. Records forward/backward/optimizer spans."""
    accum = len(micro_batches)
    total = 0.0
    for a, (x, y) in enumerate(micro_batches):
        with nullcontext() if a == accum - 1 else ddp.no_sync():
            with span("forward"):
                _, loss = ddp(x, y)
            with span("backward"):
                (loss / accum if accum > 1 else loss).backward()
        total += loss.item()
    ddp.finish_gradient_sync()
    with span("optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
    return total / accum


def _device() -> torch.device:
    return device()


def train_worker(variant: str = "overlapped", cfg: GPTConfig | None = None, steps: int = 3, batch_size: int = 8,
                 accum: int = 1, seed: int = 0, data_seed: int = 0, optimizer: str = "sgd", lr: float = 0.1,
                 bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES, model: str = "gpt", warmup: int = 0,
                 return_state: bool = True, ddp_factory: Callable | None = None, step_fn: Callable | None = None,
                 set_to_none: bool = True, find_unused_parameters: bool | None = None,
                 on_step: Callable | None = None) -> dict:
    """Train on this rank (inside ``distlab.launch``/``Ranks.run`` or torchrun) and report.

    Rank 0 builds its model with ``seed``, the others with different seeds, so the
    initial broadcast matters. ``batch_size`` is the *global* batch, split over ranks
    and ``accum`` micro-steps. ``ddp_factory(module, bucket_cap_bytes)`` replaces the
    variant (a student's class), ``step_fn(ddp, optimizer, micro_batches)`` replaces
    :func:`train_step`. ``warmup`` extra steps run first and are not timed.
    ``find_unused_parameters`` defaults to True for torch's DDP on the edge-case model
    (which it needs) and False otherwise. ``on_step(step, loss, seconds)`` is called after
    every step, warm-up included (a torchrun job's per-step line).

    Returns ``losses``, ``step_times`` (seconds, barrier to barrier, after warmup),
    ``state`` (the final ``state_dict``), ``grad_bytes`` and ``n_buckets``.
    """
    _require_process_group()
    cfg = cfg or GPTConfig()
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = _device()  # this rank's GPU under NCCL, else the CPU
    module = workload.build_model(model, cfg, seed=seed if rank == 0 else seed + 1000 * rank + 1).to(dev)
    if ddp_factory is not None:
        ddp = ddp_factory(module, bucket_cap_bytes)
    else:
        if find_unused_parameters is None:
            find_unused_parameters = variant == "torch" and model == "edge"
        ddp = make_ddp(variant, module, bucket_cap_bytes, find_unused_parameters)
    opt = make_optimizer(module.parameters(), optimizer, lr=lr)
    step_fn = step_fn or (lambda d, o, mb: train_step(d, o, mb, set_to_none=set_to_none))
    losses, times = [], []
    for step in range(warmup + steps):
        micro = [(x.to(dev), y.to(dev))
                 for x, y in workload.local_batches(cfg, batch_size, step, rank, world, accum, data_seed)]
        dist.barrier()
        start = time.perf_counter()
        losses.append(float(step_fn(ddp, opt, micro)))
        dist.barrier()
        elapsed = time.perf_counter() - start
        if step >= warmup:
            times.append(elapsed)
        if on_step is not None:
            on_step(step, losses[-1], elapsed)
    buckets = getattr(ddp, "buckets", None)
    return {
        "rank": rank, "variant": variant if ddp_factory is None else "custom", "losses": losses,
        "step_times": times, "state": workload.cpu_state(module) if return_state else None,
        "grad_bytes": workload.gradient_bytes(module), "n_buckets": len(buckets) if buckets is not None else None,
    }


def exposed_sync_times(run, skip: int = 0) -> list[float]:
    """Per step of a :func:`train_worker` run, the communication left exposed after backward.

    It is the time from the end of ``backward`` to the start of ``optimizer`` (where
    ``finish_gradient_sync`` waits), the slowest rank's per step: all of the all-reduce
    for naive and bucketed DDP, only what backward did not hide for overlapped DDP.
    The first ``skip`` steps (warm-up) are left out.
    """
    per_rank: dict[int, list[float]] = {}
    for rank in range(run.world_size):
        spans = sorted((s for s in run.spans if s.rank == rank), key=lambda s: s.start)
        backward_end = None
        gaps = []
        for s in spans:
            if s.label == "backward":
                backward_end = s.end
            elif s.label == "optimizer" and backward_end is not None:
                gaps.append(s.start - backward_end)
                backward_end = None
        per_rank[rank] = gaps[skip:]
    steps = min((len(g) for g in per_rank.values()), default=0)
    return [max(per_rank[r][i] for r in per_rank) for i in range(steps)]


def train(steps: int = 20, variant: str = "overlapped", batch_size: int = 8, accum: int = 1,
          n_layer: int = 2, d_model: int = 128, n_head: int = 4, vocab_size: int = 256, seq_len: int = 64,
          bucket_mb: float = 25.0, optimizer: str = "adamw", lr: float = 1e-3, seed: int = 0,
          warmup: int = 2, log_every: int = 0, peak: float | str = "measured", ddp_factory: Callable | None = None,
          step_fn: Callable | None = None, name: str = "ddp") -> dict:
    """Train the lab's GPT with one DDP variant; the entry point for torchrun.

    ``batch_size`` is per rank and micro-step (as in most torchrun scripts): the global
    batch is ``batch_size · accum · world_size``. Returns this rank's summary: first and
    last loss, median step time, tokens/s over all ranks and all-reduce bytes per step.
    ``log_every=k`` (torchrun's default is 1): rank 0 prints every k-th step's loss (its own
    shard's), tokens/s and MFU against ``peak`` (:func:`distlab.flops.resolve_peak`), then a summary.
    ``ddp_factory``/``step_fn`` as in :func:`train_worker` (the FP8 worker's way in).
    """
    _require_process_group()
    steps, accum, warmup = int(steps), int(accum), int(warmup)
    cfg = GPTConfig(vocab_size=int(vocab_size), seq_len=int(seq_len), n_layer=int(n_layer), n_head=int(n_head),
                    d_model=int(d_model))
    world = dist.get_world_size()
    global_size = int(batch_size) * accum * world
    report = step_report(name, cfg, warmup + steps, global_size * cfg.seq_len, log_every, peak, warmup)
    before = comm.snapshot()
    result = train_worker(variant, cfg, steps=steps, batch_size=global_size, accum=accum, seed=int(seed),
                          optimizer=optimizer, lr=float(lr), bucket_cap_bytes=int(float(bucket_mb) * 2**20),
                          warmup=warmup, return_state=False, ddp_factory=ddp_factory, step_fn=step_fn,
                          on_step=report.step if report else None)
    payload = comm.since(before).total("payload_bytes", "all_reduce")
    step_time = statistics.median(result["step_times"]) if result["step_times"] else float("nan")
    return {
        "rank": result["rank"], "variant": variant, "world_size": world, "loss_first": round(result["losses"][0], 4),
        "loss_last": round(result["losses"][-1], 4), "step_time_s": round(step_time, 4),
        "tokens_per_s": round(global_size * cfg.seq_len / step_time, 1),
        "allreduce_bytes_per_step": payload / (steps + warmup) if variant != "torch" else None,
        "grad_bytes": result["grad_bytes"], "losses": result["losses"],
        **({"mfu": report.finish()["mfu"]} if report else {}),
    }
