"""ZeRO stage 3 / FSDP: parameters sharded per wrap unit, gathered only while the unit computes.

Each wrap unit (by default every transformer block, plus the root for everything left over:
embeddings, final LayerNorm, the tied output projection) becomes a
:class:`~distlab.zero.flat.FlatParam` whose ``full`` buffer has no memory between uses. Hooks
on the unit's module drive the FSDP dance:

* **before forward**: all-gather the unit (``unshard``); with ``prefetch`` also start the
  next unit's all-gather asynchronously, so it travels while this one computes;
* **after forward**: free the gathered parameters (``reshard``) and hook the outputs' gradients;
* **before backward** (the outputs' gradient hook fires): all-gather the unit again;
* **after backward** (an identity autograd function on the unit's *inputs* runs its backward
  once the whole unit is differentiated): reduce-scatter the gradients into this rank's
  ``grad_shard``, free them, reshard;
* **end of backward** (a callback queued on the autograd engine): units never reached (the root,
  whose inputs are token ids) are reduced and resharded, in a fixed order on every rank.

Per step every parameter is all-gathered twice and its gradient reduce-scattered once, each
costing ``(N−1)/N·M`` per rank: 1.5× DDP's all-reduce (``2(N−1)/N·M``). In exchange a rank holds
``16/N`` bytes per parameter plus the one or two units being gathered — which is why FSDP wraps
per layer: wrapping the whole model as one unit gathers all of it at once.

A parameter used by modules in different units (a tied embedding) belongs to their lowest
common unit, whose gathered window encloses both uses.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from distlab.data_parallel import broadcast_parameters
from distlab.runtime.timeline import span
from distlab.zero.flat import Axis, FlatParam, alloc_storage, free_storage, gather_flat
from distlab.zero.optim import ShardedOptimizer
from distlab.zero.zero2 import queue_after_backward, reduce_accumulating, reduce_scatter_grads

__all__ = ["plan_units", "is_inside", "tensors_in", "assign_params", "FSDPUnit", "ZeRO3", "unshard", "reshard",
           "checkpoint_module", "attention_core", "unfused_attention"]

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


# ---------------------------------------------------------------- planning (no ranks needed)

def plan_units(module: nn.Module, wrap: Sequence[type] = ()) -> list[tuple[str, nn.Module]]:
    """The wrap units in forward order: the root, then every submodule whose class is in ``wrap``.

    Raises ``ValueError`` for a policy that cannot work, before any rank communicates: a class
    the model does not contain, or a container (``nn.ModuleList`` …) that is never called, so
    its hooks would never gather its parameters.
    """
    wrap = tuple(wrap)
    for cls in wrap:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ValueError(f"wrap must list nn.Module classes, got {cls!r}")
        if issubclass(cls, _CONTAINERS):
            raise ValueError(f"wrap={cls.__name__}: a {cls.__name__} is a container that is never called, so its "
                             f"forward hooks would never gather its parameters; wrap the modules it holds instead")
    units = [("", module)] + [(name, m) for name, m in module.named_modules() if name and isinstance(m, wrap)]
    if wrap and len(units) == 1:
        present = sorted({type(m).__name__ for m in module.modules()})
        raise ValueError(f"wrap={[c.__name__ for c in wrap]}: {type(module).__name__} contains no module of that "
                         f"class (it has: {', '.join(present)})")
    return units


def is_inside(child: str, parent: str) -> bool:
    """Whether module ``child`` (a dotted name) is ``parent`` or inside it; ``""`` is the root."""
    return parent == "" or child == parent or child.startswith(parent + ".")


def assign_params(module: nn.Module, unit_names: Sequence[str]) -> list[list[nn.Parameter]]:
    """Each parameter to the innermost unit containing every module that uses it (tied → common unit)."""
    def unit_of(module_name: str) -> int:
        return max((i for i, u in enumerate(unit_names) if is_inside(module_name, u)), key=lambda i: len(unit_names[i]))

    owners: dict[int, set[int]] = {}
    for name, m in module.named_modules(remove_duplicate=False):
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(unit_of(name))
    out: list[list[nn.Parameter]] = [[] for _ in unit_names]
    for p in module.parameters():
        units = owners[id(p)]
        common = [i for i, u in enumerate(unit_names) if all(is_inside(unit_names[j], u) for j in units)]
        out[max(common, key=lambda i: len(unit_names[i]))].append(p)
    return out


# ---------------------------------------------------------------- the unit operations

def unshard(flat: FlatParam) -> None:
    """Gather the unit: allocate ``full`` and all-gather every rank's ``local`` shard into it."""
    alloc_storage(flat.full)
    gather_flat(flat.full, flat.local, flat.shard_axis)


def reshard(flat: FlatParam) -> None:
    """Free the gathered parameters; only this rank's shard stays."""
    free_storage(flat.full)


class FSDPUnit:
    """One wrap unit: its module and up to two flat buffers (trainable, frozen), with backward bookkeeping."""

    def __init__(self, index: int, name: str, module: nn.Module, params: Sequence[nn.Parameter], shard: Axis,
                 replicate: Axis, dtype: torch.dtype | None):
        self.index, self.name, self.module = index, name or "root", module
        trainable = [p for p in params if p.requires_grad]
        frozen = [p for p in params if not p.requires_grad]
        self.flats = [FlatParam(ps, shard, replicate, dtype=dtype, sharded=True, name=self.name + suffix)
                      for ps, suffix in ((trainable, ""), (frozen, " (frozen)")) if ps]
        self.backward_started = False
        self.reduced = False
        self.trace = None


class _RunAfterBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once the whole unit has been differentiated."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


def tensors_in(obj) -> list[torch.Tensor]:
    """Every tensor in a module's output (nested lists, tuples and dicts), where backward hooks can go."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in tensors_in(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in tensors_in(item)]
    return []


# ---------------------------------------------------------------- the wrapper

class ZeRO3(nn.Module):
    """ZeRO-3 / FSDP around ``module``: ``model = ZeRO3(gpt, wrap=(Block,))``, ``opt = model.optimizer(AdamW, lr=…)``.

    ``wrap``: module classes that become units (``()``: one unit, the whole model).
    ``dtype=torch.bfloat16``: mixed precision (bf16 shards gathered in bf16, fp32 masters,
    gradients reduced in fp32). ``prefetch``: start the next unit's all-gather early.
    ``unshard_fn``/``reshard_fn``/``reduce_fn`` replace the unit operations (an exercise's answers).
    ``peak_param_bytes`` is the most parameter memory (shards plus gathered units) this rank held.
    ``trace=True`` records a timeline span per unit forward/backward.
    """

    def __init__(self, module: nn.Module, wrap: Sequence[type] = (), *, shard: Axis | None = None,
                 replicate: Axis | None = None, dtype: torch.dtype | None = None, prefetch: bool = False,
                 broadcast: bool = True, unshard_fn: Callable | None = None, reshard_fn: Callable | None = None,
                 reduce_fn: Callable | None = None, trace: bool = False):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("ZeRO3 needs torch.distributed: run it inside distlab.launch/Ranks or torchrun")
        plan = plan_units(module, wrap)
        self.module = module
        if broadcast:
            broadcast_parameters(module)
        shard, replicate = shard or Axis.world(), replicate or Axis.single()
        owned = assign_params(module, [name for name, _ in plan])
        self.units = [FSDPUnit(i, name, m, ps, shard, replicate, dtype)
                      for i, ((name, m), ps) in enumerate(zip(plan, owned))]
        self.unshard_fn, self.reshard_fn = unshard_fn or unshard, reshard_fn or reshard
        self.reduce_fn = reduce_fn or reduce_scatter_grads
        self.prefetch, self.trace = prefetch, trace
        self._in_backward = False
        for unit in self.units:
            unit.module.register_forward_pre_hook(functools.partial(self._pre_forward, unit))
            unit.module.register_forward_hook(functools.partial(self._post_forward, unit))
        self.peak_param_bytes = 0
        self._track()

    @property
    def flat_params(self) -> list[FlatParam]:
        return [flat for unit in self.units for flat in unit.flats]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def optimizer(self, optimizer_class: Callable = torch.optim.AdamW, **defaults) -> ShardedOptimizer:
        """ZeRO-1's optimizer over the units' shards: it reads ``grad_shard`` and writes ``local``."""
        return ShardedOptimizer.from_flat_params(self.flat_params, optimizer_class, **defaults)

    def param_bytes(self) -> int:
        """Parameter bytes this rank holds now: every shard, plus the units currently gathered."""
        return sum(f.local.untyped_storage().nbytes() + f.full.untyped_storage().nbytes() for f in self.flat_params)

    def _track(self) -> None:
        self.peak_param_bytes = max(self.peak_param_bytes, self.param_bytes())

    # ---- gathering and freeing

    def _unshard(self, unit: FSDPUnit, async_op: bool = False) -> None:
        for flat in unit.flats:
            if flat.pending is not None:
                if not async_op:
                    flat.pending.wait()
                    flat.pending = None
            elif not flat.gathered:
                if async_op:
                    alloc_storage(flat.full)
                    flat.pending = gather_flat(flat.full, flat.local, flat.shard_axis, async_op=True)
                else:
                    self.unshard_fn(flat)
        self._track()

    def _reshard(self, unit: FSDPUnit) -> None:
        for flat in unit.flats:
            if flat.pending is not None:  # never free memory a collective is still writing
                flat.pending.wait()
                flat.pending = None
            self.reshard_fn(flat)

    # ---- hooks

    def _pre_forward(self, unit: FSDPUnit, module, args):
        self._unshard(unit)
        if self._in_backward:  # a checkpointed unit recomputing its forward: gathered, nothing else
            return None
        if self.trace and unit.index:
            unit.trace = span(f"forward {unit.name}")
            unit.trace.__enter__()
        if self.prefetch and unit.index + 1 < len(self.units):  # travels while this unit computes
            self._unshard(self.units[unit.index + 1], async_op=True)
        if not torch.is_grad_enabled():
            return None
        positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        if not positions:
            return None
        wrapped = _RunAfterBackward.apply(functools.partial(self._post_backward, unit), *(args[i] for i in positions))
        args = list(args)
        for i, t in zip(positions, wrapped):
            args[i] = t
        return tuple(args)

    def _post_forward(self, unit: FSDPUnit, module, args, output):
        if self._in_backward:
            return None
        if unit.trace is not None:
            unit.trace.__exit__(None, None, None)
            unit.trace = None
        if torch.is_grad_enabled():
            for t in tensors_in(output):
                if t.requires_grad:
                    t.register_hook(functools.partial(self._pre_backward, unit))
        self._reshard(unit)
        return None

    def _pre_backward(self, unit: FSDPUnit, grad: torch.Tensor | None = None):
        if not self._in_backward:
            self._in_backward = True
            queue_after_backward(self._finish_backward)
        if unit.backward_started:
            return None
        unit.backward_started = True
        self._unshard(unit)
        if self.trace and unit.index:
            unit.trace = span(f"backward {unit.name}")
            unit.trace.__enter__()
        if self.prefetch and unit.index > 1:
            self._unshard(self.units[unit.index - 1], async_op=True)
        return None

    def _post_backward(self, unit: FSDPUnit) -> None:
        if unit.reduced:
            return
        if unit.trace is not None:
            unit.trace.__exit__(None, None, None)
            unit.trace = None
        for flat in unit.flats:
            if flat.requires_grad:
                reduce_accumulating(self.reduce_fn, flat)
        unit.reduced = True
        self._reshard(unit)

    def _finish_backward(self) -> None:
        for unit in reversed(self.units):  # the same order on every rank
            self._post_backward(unit)
        for unit in self.units:
            unit.backward_started = unit.reduced = False
        self._in_backward = False


# ---------------------------------------------------------------- activation checkpointing

def checkpoint_module(module: nn.Module) -> nn.Module:
    """Make ``module`` keep only its inputs for backward and recompute its forward there.

    Its ``forward`` is replaced (same module, same parameter names, hooks fire once) by
    ``torch.utils.checkpoint.checkpoint(forward, …, use_reentrant=False)`` while gradients are on.
    """
    forward = module.forward

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed
    return module


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal ``softmax(QKᵀ/√d)·V`` written out, as an unfused kernel runs it: the s×s scores and their
    softmax are tensors autograd keeps — the ``5·a·s²·b`` of :func:`distlab.memory.activation_bytes_per_layer`."""
    t = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    return scores.masked_fill(~causal, float("-inf")).softmax(dim=-1) @ v


def unfused_attention(attn: nn.Module, recompute: bool = False) -> nn.Module:
    """Make a :class:`~distlab.model.CausalSelfAttention` run :func:`attention_core` instead of the fused
    ``scaled_dot_product_attention``; ``recompute=True`` checkpoints only that core: **selective
    recomputation** (Korthikanti et al. 2022) — the projections' inputs stay saved, the scores are
    recomputed in backward. Same module, same parameters (the layer Megatron-LM ran before FlashAttention).
    """

    def forward(x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = attn.qkv(x)
        width = qkv.shape[-1] // 3
        q, k, v = (z.view(b, t, width // attn.head_dim, attn.head_dim).transpose(1, 2)
                   for z in qkv.split(width, dim=-1))
        if recompute and torch.is_grad_enabled():
            y = checkpoint(attention_core, q, k, v, use_reentrant=False)
        else:
            y = attention_core(q, k, v)
        return attn.proj(y.transpose(1, 2).contiguous().view(b, t, width))

    attn.forward = forward
    return attn
