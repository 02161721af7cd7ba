"""ZeRO stage 1: a sharded optimizer that wraps any elementwise torch optimizer.

DDP gives every rank the whole optimizer state. Adam's is 12 of the 16 bytes per parameter
(fp32 master weights and two moments in mixed precision), so it is the first thing to shard.
:class:`ShardedOptimizer` builds one :class:`~distlab.zero.flat.FlatParam` per param group
(or per bucket); rank ``r``'s inner optimizer only ever sees rank ``r``'s shard of it. A step:

1. **reduce-scatter** the flattened local gradients in fp32: each rank receives the
   average over all ranks of *its* shard — all it needs to update it;
2. the inner optimizer steps the shard (the fp32 master in mixed precision);
3. **all-gather** the updated shards (in the compute dtype) into every rank's full parameters.

Reduce-scatter plus all-gather is exactly the two halves of a ring all-reduce, so ZeRO-1
moves what DDP moves. ``torch.distributed.optim.ZeroRedundancyOptimizer`` shards whole
parameters instead, expects gradients already averaged by DDP and broadcasts every updated
parameter from its owner: same idea, more bytes. With ``shard=Axis.single()`` the same class
is a flat-master DDP optimizer (one all-reduce), and with both axes larger than one it is HSDP.

This works for optimizers that act elementwise (SGD, Adam, AdamW, Adagrad…): a shard of a flat
buffer is then as good as the whole tensor. One difference remains: a flat buffer is stepped whole,
so a parameter that got no gradient this step on any rank is stepped with a zero gradient — with
momentum or weight decay it still moves, where a per-parameter optimizer would skip it. Optimizers
that need a whole matrix (Shampoo, LAMB's per-tensor trust ratio) need a per-tensor partition like
``ZeroRedundancyOptimizer``'s.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from distlab.zero.flat import Axis, FlatParam, gather_flat, reduce_scatter_mean, unique_params

__all__ = ["ShardedOptimizer", "mixed_precision_step"]


class ShardedOptimizer:
    """ZeRO-1: ``ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)``.

    ``step()`` averages the gradients (reduce-scatter), updates this rank's shard and
    all-gathers the parameters; ``zero_grad()`` and ``add_param_group()`` behave as on any
    optimizer, and ``param_groups`` are the inner optimizer's (so LR schedulers work).
    ``dtype=torch.bfloat16`` turns on mixed precision: the parameters become bf16 compute
    copies, the optimizer updates an fp32 master shard. Frozen parameters are left alone.

    ZeRO-2 and ZeRO-3 wrappers hand in ready-made :class:`FlatParam` units whose
    ``grad_shard`` they fill during backward (:meth:`from_flat_params`).
    """

    def __init__(self, params: Iterable, optimizer_class: Callable = torch.optim.AdamW, *,
                 shard: Axis | None = None, replicate: Axis | None = None, dtype: torch.dtype | None = None,
                 **defaults):
        if not dist.is_initialized():
            raise RuntimeError("ShardedOptimizer needs torch.distributed: run it inside distlab.launch/Ranks or "
                               "torchrun")
        self.optimizer_class, self.defaults = optimizer_class, defaults
        self.shard_axis, self.replicate_axis = shard or Axis.world(), replicate or Axis.single()
        self.dtype = dtype
        self.flat_params: list[FlatParam] = []
        self.optim: torch.optim.Optimizer | None = None
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        for group in groups:
            self.add_param_group(group)

    @classmethod
    def from_flat_params(cls, flat_params: Sequence[FlatParam], optimizer_class: Callable = torch.optim.AdamW,
                         **defaults) -> "ShardedOptimizer":
        """An optimizer over units another wrapper built (ZeRO-2 buckets, ZeRO-3 wrap units)."""
        self = cls([], optimizer_class, **defaults)
        for flat in flat_params:
            if flat.requires_grad:
                self._add_flat(flat, {})
        return self

    # ---- the torch.optim.Optimizer surface

    @property
    def param_groups(self) -> list[dict]:
        return self.optim.param_groups if self.optim is not None else []

    @property
    def state(self):
        return self.optim.state if self.optim is not None else {}

    def add_param_group(self, param_group: dict) -> None:
        """Shard a new group: its trainable parameters become one flat buffer, this rank keeps 1/N of its state."""
        params = [p for p in unique_params(param_group["params"]) if p.requires_grad]
        known = {id(p) for flat in self.flat_params for p in flat.params}
        if any(id(p) in known for p in params):
            raise ValueError("some parameters appear in more than one parameter group")
        if not params:
            return
        flat = FlatParam(params, self.shard_axis, self.replicate_axis, dtype=self.dtype,
                         name=f"group {len(self.flat_params)}")
        self._add_flat(flat, {k: v for k, v in param_group.items() if k != "params"})

    def _add_flat(self, flat: FlatParam, options: dict) -> None:
        group = dict(options, params=[flat.optimizer_param()])
        if self.optim is None:
            self.optim = self.optimizer_class([group], **self.defaults)
        else:
            self.optim.add_param_group(group)
        self.flat_params.append(flat)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for flat in self.flat_params:
            flat.grad_shard = None
            flat.optimizer_param().grad = None
            for p in flat.params:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for flat in self.flat_params:
            flat.optimizer_param().grad = self.gradient_shard(flat)
        if self.optim is not None:
            self.optim.step()
        for flat in self.flat_params:
            self.publish(flat)
        return loss

    # ---- the two collectives

    def gradient_shard(self, flat: FlatParam) -> torch.Tensor:
        """This rank's shard of the averaged gradient, in the optimizer's dtype (fp32 in mixed precision).

        ZeRO-2/3 reduced it during backward (``flat.grad_shard``); ZeRO-1 reduce-scatters the
        full local gradients now, in fp32 whatever the parameters' dtype.
        """
        target = flat.optimizer_param().dtype
        if flat.grad_shard is not None:
            return flat.grad_shard.to(target)
        grads = flat.layout.flatten([p.grad for p in flat.params], dtype=torch.float32)
        return reduce_scatter_mean(grads, flat.shard_axis, flat.replicate_axis).to(target)

    def publish(self, flat: FlatParam) -> None:
        """Make the updated shard visible: round the master into the compute copy, then (ZeRO-1/2)
        all-gather every rank's shard into the full parameters. ZeRO-3 gathers before the next forward."""
        if flat.master is not None:
            flat.local.copy_(flat.master)
        if flat.sharded:
            return
        if flat.shard_axis.size == 1:
            return  # DDP: the "shard" is the whole buffer, already updated in place
        gather_flat(flat.full, flat.local.clone(), flat.shard_axis)  # the input may not alias the output

    def state_dict(self) -> dict:
        """This rank's shard of the optimizer state (a sharded checkpoint: every rank saves its own)."""
        return self.optim.state_dict() if self.optim is not None else {}

    def __repr__(self) -> str:
        inner = self.optimizer_class.__name__
        return (f"ShardedOptimizer({inner}, {len(self.flat_params)} flat buffer(s), shard {self.shard_axis.size} × "
                f"replicate {self.replicate_axis.size})")


@torch.no_grad()
def mixed_precision_step(params: Sequence[torch.Tensor], masters: Sequence[torch.Tensor],
                         optimizer: torch.optim.Optimizer) -> None:
    """One mixed-precision update (Micikevicius et al. 2018): the recipe every sharded stage applies to its shard.

    ``params`` are the low-precision compute copies (bf16) holding this step's gradients,
    ``masters`` their fp32 copies, the only tensors ``optimizer`` knows. The gradient is
    upcast into the master, the optimizer steps in fp32 (an update smaller than a bf16
    ulp still accumulates), and the master is rounded back into the compute copy.
    """
    for p, master in zip(params, masters):
        master.grad = None if p.grad is None else p.grad.to(master.dtype)
    optimizer.step()
    for p, master in zip(params, masters):
        p.copy_(master)
        p.grad = None
        master.grad = None
