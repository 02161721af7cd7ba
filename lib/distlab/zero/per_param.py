"""Per-parameter sharding, FSDP2's design, from scratch: every parameter split on dim 0, any optimizer over the shards.

The FlatParam design (:mod:`~distlab.zero.flat`, :class:`~distlab.zero.fsdp.ZeRO3`) lays a unit's parameters end
to end in one buffer and cuts that: a shard is a slice of a flat vector, so only distlab's own
:class:`~distlab.zero.optim.ShardedOptimizer`, which knows the layout, can step it. :class:`PerParamFSDP` shards
**every parameter on its own**, along dim 0, as PyTorch's FSDP2 (``fully_shard``) does:

* rank ``r`` of ``N`` keeps rows ``r·c … min((r+1)·c, d₀)`` of a parameter with ``d₀`` rows, ``c = ⌈d₀/N⌉``
  (:func:`dim0_chunk`: ``torch.chunk``'s sizes, so the last ranks may hold fewer rows, or none); the shard lives
  in a zero-padded ``(c, …)`` buffer so that every rank's all-gather input has the same size;
* the module's parameters *are* the shards (``nn.Parameter`` s of shape ``(rows, …)``): ``module.parameters()``
  yields them, so **any** ``torch.optim`` optimizer steps them unchanged, with param groups per tensor (weight decay
  on the matrices only): each sees whole rows of one tensor, never a slice across two. Elementwise updates (SGD,
  Adam, AdamW) then equal one process; an update that needs a whole tensor (a norm) sees only this rank's rows;
* around each chosen module's forward (default: every ``nn.Linear`` and ``nn.Embedding``) its parameters are
  all-gathered (cast to ``compute_dtype`` first: half the bytes on the wire) into full-size leaves that replace
  the shards for the call, then freed; before its backward they are gathered again; once their gradients are in,
  the gradients are **reduce-scattered in fp32** into shard-shaped ``.grad`` s of the fp32 shards — the masters;
* parameters of no chosen module stay whole on every rank (replicated); their gradients are all-reduced in fp32
  when backward ends.

Each chosen module's parameters travel together: one all-gather and one reduce-scatter per module and pass
(``torch.cat`` of every parameter's chunk ``r`` into row ``r`` of one buffer — FSDP2's ``chunk_cat``), so the
per-parameter layout costs no extra collectives; it costs a copy in and out of the communication buffers and
padding per tensor instead of per unit. A tied weight used by two chosen modules is gathered by each, and the
two gradients it receives are reduce-scattered and added into its one shard.
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.data_parallel import broadcast_parameters
from distlab.memory import tensor_bytes
from distlab.model import GPT, Block, GPTConfig, synthetic_batch
from distlab.reference import make_optimizer
from distlab.runtime.rank import device as rank_device
from distlab.zero.flat import flat_params_of, free_storage
from distlab.zero.fsdp import is_inside, plan_units, tensors_in
from distlab.zero.train import comm_per_step, comm_snapshot, device_mesh, make_engine, state_bytes
from distlab.zero.zero2 import queue_after_backward

__all__ = ["DEFAULT_SHARDED", "dim0_chunk", "reduce_scatter_dim0", "ShardedParam", "PerParamFSDP",
           "apply_fully_shard", "shuffled_rows", "cast_reference", "train_per_param", "compare_designs"]

DEFAULT_SHARDED = (nn.Linear, nn.Embedding)


# ---------------------------------------------------------------- the layout of one parameter

def dim0_chunk(rows: int, world_size: int, rank: int) -> tuple[int, int, int]:
    """``(start, length, chunk)``: rank ``rank`` holds rows ``start … start + length`` of ``rows``.

    ``chunk = ⌈rows / N⌉`` rows per rank (the size ``torch.chunk`` gives, which FSDP2 uses), so rank ``r`` starts at
    ``r·chunk`` and the last ranks get what is left: fewer rows, or none. Every rank's padded shard has ``chunk``
    rows, the equal sizes ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` need.
    """
    chunk = -(-rows // world_size)
    start = min(rank * chunk, rows)
    return start, min(chunk, rows - start), chunk


def _world() -> tuple[int, int]:
    return dist.get_world_size(), dist.get_rank()


@torch.no_grad()
def reduce_scatter_dim0(grads: Sequence[torch.Tensor], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """This rank's dim-0 shard of the mean over all ranks of each gradient in ``grads``, in ``dtype``: one collective.

    Each gradient is cast to ``dtype`` (fp32: a bf16 sum drops small gradients next to large ones of the other
    sign) and padded on dim 0 to ``N·chunk`` rows; row ``r`` of the send buffer is chunk ``r`` of every gradient
    in turn (rank-major), so one ``reduce_scatter_tensor`` hands rank ``r`` its chunk of all of them. The sum is
    divided by ``N`` and each shard returned without its padding rows: shaped like the parameter's shard.
    """
    world, rank = _world()
    blocks, splits = [], []
    for g in grads:
        _, length, chunk = dim0_chunk(g.shape[0], world, rank)
        padded = g.new_zeros((world * chunk, *g.shape[1:]), dtype=dtype)
        padded[:g.shape[0]].copy_(g)
        blocks.append(padded.view(world, -1))
        splits.append((chunk, length, g.shape[1:]))
    send = torch.cat(blocks, dim=1)  # [N, Σ chunk numel]: row r is what rank r receives
    if world == 1:
        mine = send[0].clone()
    else:
        mine = torch.empty(send.shape[1], dtype=dtype, device=send.device)
        dist.reduce_scatter_tensor(mine, send.view(-1))
    mine.div_(world)
    out, offset = [], 0
    for chunk, length, rest in splits:
        numel = chunk * rest.numel()
        out.append(mine[offset:offset + numel].view(chunk, *rest)[:length])
        offset += numel
    return out


# ---------------------------------------------------------------- one sharded parameter

class ShardedParam:
    """One parameter split on dim 0: ``shard`` is this rank's rows, an ``nn.Parameter`` the optimizer steps.

    ``shard`` is a view of ``padded`` (``chunk`` rows, zeros past the parameter's end), so an optimizer's
    in-place update is what the next all-gather sends, padding included, with no copy.
    """

    def __init__(self, name: str, param: nn.Parameter, world_size: int, rank: int):
        self.name, self.shape, self.dtype = name, param.shape, param.dtype
        start, self.length, self.chunk = dim0_chunk(param.shape[0], world_size, rank)
        with torch.no_grad():
            self.padded = param.new_zeros((self.chunk, *param.shape[1:]))
            self.padded[:self.length].copy_(param[start:start + self.length])
        self.shard = nn.Parameter(self.padded[:self.length], requires_grad=param.requires_grad)

    def __repr__(self) -> str:
        return f"ShardedParam({self.name}: {tuple(self.shape)} -> {tuple(self.shard.shape)}, chunk {self.chunk})"


def _pack(params: Sequence[ShardedParam], dtype: torch.dtype) -> torch.Tensor:
    """Every parameter's padded shard end to end, in ``dtype``: this rank's all-gather input."""
    return torch.cat([sp.padded.reshape(-1) for sp in params]).to(dtype)


def _unpack(gathered: torch.Tensor, params: Sequence[ShardedParam], world_size: int):
    """``(param, full tensor)`` for each parameter, from the all-gather of every rank's :func:`_pack`: row ``r`` of
    the buffer is rank ``r``'s shards, so a parameter's rows are one column block (views, padding dropped)."""
    rows, offset = gathered.view(world_size, -1), 0
    for sp in params:
        numel = sp.padded.numel()
        yield sp, rows[:, offset:offset + numel].reshape(world_size * sp.chunk, *sp.shape[1:])[:sp.shape[0]]
        offset += numel


class _Group:
    """A chosen module's parameters: gathered together, freed together, their gradients reduced together."""

    def __init__(self, name: str, module: nn.Module, params: list[ShardedParam],
                 holders: list[list[tuple[nn.Module, str]]], compute_dtype: torch.dtype | None):
        self.name, self.module, self.params, self.holders = name or "root", module, params, holders
        self.leaves = []  # the full-size parameters the module computes with, storage freed between uses
        for sp in params:
            leaf = nn.Parameter(torch.empty(sp.shape, dtype=compute_dtype or sp.dtype, device=sp.padded.device),
                                requires_grad=sp.shard.requires_grad)
            free_storage(leaf)
            self.leaves.append(leaf)
        self.trainable = [i for i, leaf in enumerate(self.leaves) if leaf.requires_grad]
        self.gathered = False
        self.pending = None  # (work, buffer) of an all-gather in flight (prefetch)
        self.arrived = 0  # leaves whose gradient is complete in this backward
        self.reduced = False

    def use(self, full: bool) -> None:
        """Point every module that holds a parameter at its full leaf (``full``) or back at the shard."""
        for sp, leaf, holders in zip(self.params, self.leaves, self.holders):
            for module, attr in holders:
                module._parameters[attr] = leaf if full else sp.shard


def _innermost(name: str, groups: Sequence[str]) -> str | None:
    inside = [g for g in groups if is_inside(name, g)]
    return max(inside, key=len) if inside else None


# ---------------------------------------------------------------- the wrapper

class PerParamFSDP(nn.Module):
    """FSDP2's design around ``module``: ``model = PerParamFSDP(gpt)``, ``opt = torch.optim.AdamW(model.parameters())``.

    ``sharded``: the module classes whose parameters are sharded and gathered around their forward (default
    ``nn.Linear`` and ``nn.Embedding``; include the root's class to shard what is left too); the rest is
    replicated. ``compute_dtype`` (``torch.bfloat16``/``float16``): gathered weights and replicated weights are cast
    for compute, the shards stay fp32 masters and gradients are reduced in fp32. ``prefetch``: start the next
    module's all-gather (in the previous forward's order; in backward, the one before) while this one computes.
    ``reduce_fn(grads) -> shards`` replaces :func:`reduce_scatter_dim0` (an exercise's answer). Broadcasts rank 0's
    parameters first. ``peak_param_bytes``: the most parameter memory (shards, replicated, gathered) held.
    """

    def __init__(self, module: nn.Module, sharded: Sequence[type] = DEFAULT_SHARDED, *,
                 compute_dtype: torch.dtype | None = None, prefetch: bool = True, broadcast: bool = True,
                 reduce_fn: Callable | None = None):
        super().__init__()
        sharded = tuple(sharded)
        if compute_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"compute_dtype={compute_dtype!r}: expected None, torch.bfloat16 or torch.float16")
        try:
            chosen = [(name, m) for name, m in plan_units(module, sharded) if name or isinstance(m, sharded)]
        except ValueError as error:  # plan_units speaks of FlatParam's wrap=; here the argument is sharded=
            if not isinstance(module, sharded) or "contains no module" not in str(error):
                raise ValueError(str(error).replace("wrap", "sharded", 1)) from None
            chosen = [("", module)]  # only the root's class: the whole model is one group
        group_names = [name for name, _ in chosen]
        holders: dict[int, list[tuple[str, nn.Module, str]]] = {}
        for mod_name, m in module.named_modules(remove_duplicate=False):
            for attr, p in m._parameters.items():
                if p is not None:
                    holders.setdefault(id(p), []).append((mod_name, m, attr))
        members: dict[str, list[tuple[nn.Parameter, list]]] = {name: [] for name in group_names}
        replicated: list[tuple[nn.Parameter, list]] = []
        for name, p in module.named_parameters():
            places = holders[id(p)]
            owners = [_innermost(mod_name, group_names) for mod_name, _, _ in places]
            if p.dim() == 0 or all(o is None for o in owners):  # a 0-dim parameter has no dim 0 to split
                replicated.append((p, [(m, attr) for _, m, attr in places]))
                continue
            if any(o is None for o in owners):
                outside = next(mod_name for (mod_name, _, _), o in zip(places, owners) if o is None)
                raise ValueError(f"parameter {name} is used by a sharded module and by {outside or 'the root'}, "
                                 f"which is not: add its class to sharded=, or untie the parameter")
            for owner in dict.fromkeys(owners):
                members[owner].append((p, [(m, attr) for (mod_name, m, attr), o in zip(places, owners)
                                           if o == owner]))
        if not dist.is_initialized():
            raise RuntimeError("PerParamFSDP needs torch.distributed: run it inside distlab.launch/Ranks or torchrun")
        if broadcast:
            broadcast_parameters(module)
        self.module = module
        self.compute_dtype = None if compute_dtype == torch.float32 else compute_dtype
        self.prefetch, self.reduce_fn = prefetch, reduce_fn or reduce_scatter_dim0
        self.world_size, self.rank = _world()
        names = {id(p): n for n, p in module.named_parameters()}
        self.replicated = replicated
        self.params: dict[int, ShardedParam] = {}
        for owner in group_names:
            for p, _ in members[owner]:
                if id(p) not in self.params:
                    self.params[id(p)] = ShardedParam(names[id(p)], p, self.world_size, self.rank)
        for key, sp in self.params.items():  # the module holds shards now: parameters() yields what the optimizer steps
            for _, m, attr in holders[key]:
                m._parameters[attr] = sp.shard
        self.groups = [_Group(owner, m, [self.params[id(p)] for p, _ in members[owner]],
                              [places for _, places in members[owner]], self.compute_dtype)
                       for owner, m in chosen if members[owner]]
        # the root's hooks first: its pre-forward starts a new forward order before a root group joins it
        module.register_forward_pre_hook(self._root_pre_forward)
        module.register_forward_hook(self._root_post_forward)
        for group in self.groups:
            group.module.register_forward_pre_hook(functools.partial(self._pre_forward, group))
            group.module.register_forward_hook(functools.partial(self._post_forward, group))
            for i in group.trainable:
                group.leaves[i].register_post_accumulate_grad_hook(functools.partial(self._grad_ready, group))
        # in mixed precision the replicated weights compute through low-precision copies too
        self.replicated_leaves = [nn.Parameter(torch.empty_like(p, dtype=self.compute_dtype),
                                               requires_grad=p.requires_grad) if self.compute_dtype else None
                                  for p, _ in self.replicated]
        self._order: list[_Group] = []  # this forward's groups, in call order: backward reduces them in reverse
        self._last_order: list[_Group] = []  # the previous forward's, which forward prefetch follows
        self._next_reduce = -1  # index in _order of the next group to reduce
        self._queued = False
        self._stash: dict[int, torch.Tensor] = {}  # replicated gradients of earlier micro-batches (fp32)
        self.peak_param_bytes = 0
        self._track()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # ---- what a rank holds

    def _param_tensors(self) -> list[torch.Tensor]:
        """Every parameter tensor this rank holds: padded shards, replicated weights and their compute copies,
        gathered parameters (0 bytes while freed) and all-gather buffers in flight."""
        tensors = [sp.padded for sp in self.params.values()] + [p for p, _ in self.replicated]
        tensors += [leaf for leaf in self.replicated_leaves if leaf is not None]
        tensors += [leaf for g in self.groups for leaf in g.leaves]
        return tensors + [g.pending[1] for g in self.groups if g.pending is not None]

    def param_bytes(self) -> int:
        """Parameter bytes this rank holds now, each storage once."""
        return tensor_bytes(self._param_tensors())

    def _track(self) -> None:
        self.peak_param_bytes = max(self.peak_param_bytes, self.param_bytes())

    # ---- gathering and freeing

    def _gather(self, group: _Group, async_op: bool = False) -> None:
        """Start (``async_op``) or finish gathering ``group``: one all-gather of every parameter's padded shard."""
        if group.gathered:
            return
        if group.pending is None:
            send = _pack(group.params, group.leaves[0].dtype)
            if self.world_size == 1:
                group.pending = (None, send)
            else:
                buffer = torch.empty(self.world_size * send.numel(), dtype=send.dtype, device=send.device)
                work = dist.all_gather_into_tensor(buffer, send, async_op=async_op)
                group.pending = (work, buffer)
            self._track()
            if async_op:
                return
        work, buffer = group.pending
        if work is not None:
            work.wait()
        for (_, full), leaf in zip(_unpack(buffer, group.params, self.world_size), group.leaves):
            leaf.untyped_storage().resize_(leaf.numel() * leaf.element_size())
            leaf.data.copy_(full)  # through .data: autograd's saved views of the leaf stay valid
        self._track()  # the copy-out's moment: the all-gather buffer and the full parameters both exist
        group.pending, group.gathered = None, True

    def _free(self, group: _Group) -> None:
        if group.pending is not None:  # never leave a collective writing into memory nobody waits for
            work, _ = group.pending
            if work is not None:
                work.wait()
            group.pending = None
        for leaf in group.leaves:
            free_storage(leaf)
        group.gathered = False

    # ---- hooks

    def _root_pre_forward(self, module, args):
        self._order = []
        with torch.no_grad():
            for (p, holders), leaf in zip(self.replicated, self.replicated_leaves):
                if leaf is not None:
                    leaf.data.copy_(p)
                    for m, attr in holders:
                        m._parameters[attr] = leaf
                elif torch.is_grad_enabled() and p.grad is not None:  # an earlier micro-batch's, already reduced
                    self._stash[id(p)] = p.grad
                    p.grad = None
        return None

    def _root_post_forward(self, module, args, output):
        for (p, holders), leaf in zip(self.replicated, self.replicated_leaves):
            if leaf is not None:
                for m, attr in holders:
                    m._parameters[attr] = p
        if torch.is_grad_enabled():
            for t in tensors_in(output):
                if t.requires_grad:
                    t.register_hook(self._backward_starts)
        return None

    def _pre_forward(self, group: _Group, module, args):
        self._gather(group)
        group.use(full=True)
        if torch.is_grad_enabled() and group not in self._order:
            self._order.append(group)
        if self.prefetch and group in self._last_order:
            following = self._last_order.index(group) + 1
            if following < len(self._last_order):
                self._gather(self._last_order[following], async_op=True)
        return None

    def _post_forward(self, group: _Group, module, args, output):
        group.use(full=False)
        if torch.is_grad_enabled():
            for t in tensors_in(output):
                if t.requires_grad:
                    t.register_hook(functools.partial(self._pre_backward, group))
        self._free(group)
        return None

    def _backward_starts(self, grad=None):
        if not self._queued:
            self._queued = True
            self._next_reduce = len(self._order) - 1
            queue_after_backward(self._finish_backward)
        return None

    def _pre_backward(self, group: _Group, grad=None):
        self._backward_starts()
        if group.reduced:
            return None
        self._gather(group)
        if self.prefetch and group in self._order:
            before = self._order.index(group) - 1
            if before >= 0 and not self._order[before].reduced:
                self._gather(self._order[before], async_op=True)
        return None

    def _grad_ready(self, group: _Group, leaf) -> None:
        group.arrived += 1
        self._reduce_in_order()

    def _reduce_in_order(self) -> None:
        """Reduce, in reverse forward order, every group whose gradients are all in: the same collectives in the
        same order on every rank, whatever order autograd finishes them in."""
        while self._next_reduce >= 0:
            group = self._order[self._next_reduce]
            if group.arrived < len(group.trainable):
                return
            self._reduce(group)
            self._next_reduce -= 1

    @torch.no_grad()
    def _reduce(self, group: _Group) -> None:
        if group.trainable:
            grads = [group.leaves[i].grad if group.leaves[i].grad is not None else torch.zeros_like(group.leaves[i])
                     for i in group.trainable]
            shards = self.reduce_fn(grads)
            for i, g in zip(group.trainable, shards):
                shard = group.params[i].shard
                g = g.to(shard.dtype)
                shard.grad = g if shard.grad is None else shard.grad + g
                group.leaves[i].grad = None
        group.reduced = True
        self._free(group)

    @torch.no_grad()
    def _reduce_replicated(self) -> None:
        """All-reduce (mean, fp32) the gradients of the replicated parameters: one collective for all of them.

        A count of the ranks that produced each gradient travels with them: a parameter no rank used keeps no
        gradient (an optimizer then skips it, as it would on one process)."""
        trainable = [(p, leaf) for (p, _), leaf in zip(self.replicated, self.replicated_leaves) if p.requires_grad]
        if not trainable:
            return
        local = [(leaf if leaf is not None else p).grad for p, leaf in trainable]
        flat = torch.cat([g.float().reshape(-1) if g is not None else torch.zeros(p.numel(), device=p.device)
                          for (p, _), g in zip(trainable, local)]
                         + [torch.tensor([float(g is not None) for g in local], device=trainable[0][0].device)])
        if self.world_size > 1:
            dist.all_reduce(flat)
        counts = flat[-len(trainable):]
        offset = 0
        for k, (p, leaf) in enumerate(trainable):
            mean = flat[offset:offset + p.numel()].view_as(p).div_(self.world_size).to(p.dtype)
            offset += p.numel()
            earlier = self._stash.pop(id(p), None)
            if leaf is not None:
                earlier, leaf.grad = p.grad, None
            p.grad = None if counts[k] == 0 else mean
            if earlier is not None:
                p.grad = earlier if p.grad is None else earlier + p.grad

    def _finish_backward(self) -> None:
        while self._next_reduce >= 0:  # groups whose gradients never all arrived, still in reverse forward order
            self._reduce(self._order[self._next_reduce])
            self._next_reduce -= 1
        for group in self.groups:
            self._free(group)
            group.arrived, group.reduced = 0, False
        self._reduce_replicated()
        self._last_order, self._order = self._order, []
        self._queued = False

    # ---- the whole model

    @torch.no_grad()
    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The whole model's ``state_dict`` in fp32 on the CPU, gathered from the shards: collective, every rank calls.

        ``rank0_only``: gather to rank 0 only (``dist.gather``; the other ranks return ``{}`` and never hold a full
        tensor), as a checkpoint writer wants; otherwise every rank gets it (``all_gather_into_tensor``), as
        evaluation does. One collective for the whole model.
        """
        params = list(self.params.values())
        send = _pack(params, torch.float32) if params else torch.zeros(0)
        if self.world_size == 1:
            received = send
        elif rank0_only:  # one collective for the whole model, into rank 0 only
            pieces = [torch.empty_like(send) for _ in range(self.world_size)] if self.rank == 0 else None
            dist.gather(send, pieces, dst=0)
            received = torch.cat(pieces) if pieces is not None else None
        else:
            received = torch.empty(self.world_size * send.numel(), dtype=send.dtype, device=send.device)
            dist.all_gather_into_tensor(received, send)
        if received is None:
            return {}
        full = {id(sp.shard): t.cpu().clone() for sp, t in _unpack(received, params, self.world_size)}
        return {name: full[id(t)] if id(t) in full else t.detach().float().cpu().clone()
                for name, t in self.module.state_dict(keep_vars=True).items()}

    def held_bytes(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes this rank holds of parameters (:meth:`param_bytes`), gradients and optimizer state, each storage
        once."""
        params = self._param_tensors()
        grads = [p.grad for p in self.module.parameters()]
        state = [v for s in optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor)] if optimizer is not None else []
        p, g = tensor_bytes(params), tensor_bytes(params + grads) - tensor_bytes(params)
        return {"parameters": p, "gradients": g, "optimizer": tensor_bytes(params + grads + state) - p - g}

    def __repr__(self) -> str:
        dtype = str(self.compute_dtype or "fp32").replace("torch.", "")
        return (f"PerParamFSDP({type(self.module).__name__}: {len(self.params)} parameters sharded on dim 0 in "
                f"{len(self.groups)} groups, {len(self.replicated)} replicated, {self.world_size} ranks, "
                f"compute {dtype})")


# ---------------------------------------------------------------- PyTorch's own, on the same policy

def apply_fully_shard(module: nn.Module, sharded: Sequence[type] = DEFAULT_SHARDED,
                      compute_dtype: torch.dtype | None = None) -> nn.Module:
    """FSDP2 on the same modules: ``fully_shard`` each chosen module, then the root (which takes what is left).

    Modules that share a parameter (tied embeddings) go into one ``fully_shard([a, b])`` call: FSDP2 refuses a
    parameter managed by two groups (``FSDPState._validate_no_duplicate_params``).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: PLC0415  heavy; only this path

    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) if compute_dtype else \
        MixedPrecisionPolicy()
    mesh = device_mesh(None)
    chosen = [m for name, m in plan_units(module, tuple(sharded)) if name]
    groups: list[list[nn.Module]] = []
    for m in chosen:
        ids = {id(p) for p in m.parameters()}
        tied = [g for g in groups if any(id(p) in ids for other in g for p in other.parameters())]
        for g in tied:
            groups.remove(g)
        groups.append([x for g in tied for x in g] + [m])
    for g in groups:
        fully_shard(g if len(g) > 1 else g[0], mesh=mesh, mp_policy=policy)
    fully_shard(module, mesh=mesh, mp_policy=policy)
    return module


# ---------------------------------------------------------------- data, references, and a training worker

def shuffled_rows(cfg: GPTConfig, batch_size: int, step: int, data_seed: int = 0):
    """The step's global batch with its rows in a fresh order (a permutation per step and seed): each rank's
    slice is different rows every step, as a shuffling data loader gives it."""
    x, y = synthetic_batch(cfg, batch_size, step, seed=data_seed)
    order = torch.randperm(batch_size, generator=torch.Generator().manual_seed(data_seed * 7919 + step))
    return x[order], y[order]


def cast_reference(cfg: GPTConfig, steps: int = 3, batch_size: int = 8, world_size: int = 1,
                   compute_dtype: torch.dtype | None = None, optimizer: str = "sgd", lr: float = 0.1, seed: int = 0,
                   data_seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """One process that applies the same casts as :class:`PerParamFSDP`: the weights after each step.

    fp32 masters; each step a ``compute_dtype`` copy of the model runs forward and backward on each of the
    ``world_size`` ranks' rows in turn; each gradient is cast to fp32 and they are averaged (sum, then divide by
    ``world_size``) into the masters' ``.grad``, which the optimizer steps. With ``compute_dtype=None`` and
    ``world_size=1`` it is plain single-process training on the whole batch.
    """
    master = GPT(cfg, seed=seed)
    opt = make_optimizer(master.parameters(), optimizer, lr=lr)
    states = []
    for step in range(steps):
        x, y = shuffled_rows(cfg, batch_size, step, data_seed)
        compute = GPT(cfg, seed=seed)
        compute.load_state_dict(master.state_dict())
        if cfg.tied_embeddings:
            compute.lm_head.weight = compute.tok_emb.weight
        compute.to(compute_dtype or torch.float32)
        grads = [torch.zeros_like(p) for p in master.parameters()]
        rows = batch_size // world_size
        for r in range(world_size):
            compute.zero_grad(set_to_none=True)
            compute(x[r * rows:(r + 1) * rows], y[r * rows:(r + 1) * rows])[1].backward()
            for total, p in zip(grads, compute.parameters()):
                total += p.grad.float()
        for p, total in zip(master.parameters(), grads):
            p.grad = total / world_size
        opt.step()
        opt.zero_grad(set_to_none=True)
        states.append({name: t.detach().clone() for name, t in master.state_dict().items()})
    return states


def train_per_param(impl: str = "scratch", cfg: GPTConfig | None = None, steps: int = 3, batch_size: int = 8,
                    optimizer: str = "sgd", lr: float = 0.1, compute_dtype: torch.dtype | None = None,
                    sharded: Sequence[type] = DEFAULT_SHARDED, seed: int = 0, data_seed: int = 0,
                    prefetch: bool = True, reduce_fn: Callable | None = None, inspect: bool = False,
                    reference: dict | None = None) -> dict:
    """Train the lab's GPT on this rank's rows of reshuffled batches with :class:`PerParamFSDP` (``impl="scratch"``)
    or PyTorch's ``fully_shard`` on the same modules (``"torch"``); every rank starts from rank 0's seed.

    Returns the full weights after every step (``states``), the loss of each step, the traffic per step, and with
    ``inspect``: what the optimizer sees (name, shape, dtype per parameter), the gradients after the first
    backward (shape and dtype per shard; the replicated ones whole), the bytes held after the last step and the
    peak parameter bytes. ``reference`` (:func:`cast_reference`'s ``world_size``/``compute_dtype``): rank 0 also trains
    that single-process reference, in its own process, so that its kernels run with the rank's threads (a kernel's
    own reductions, a LayerNorm's sum over rows, round differently with another thread count).
    """
    cfg = cfg or GPTConfig()
    world, rank = _world()
    if batch_size % world:
        raise ValueError(f"global batch {batch_size} is not divisible by world_size={world}")
    if impl not in ("scratch", "torch"):
        raise ValueError(f"impl={impl!r}: expected 'scratch' or 'torch'")
    dev = rank_device()
    module = GPT(cfg, seed=seed).to(dev)
    with warnings.catch_warnings():
        # FSDP2 warns that nn.Linear returned a view (a 3-D input's matmul output); nothing here writes into it
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
        if impl == "scratch":
            net = PerParamFSDP(module, sharded, compute_dtype=compute_dtype, prefetch=prefetch, reduce_fn=reduce_fn)
        else:
            net = apply_fully_shard(module, sharded, compute_dtype)
        opt = make_optimizer(net.parameters(), optimizer, lr=lr)
        out: dict = {"rank": rank, "states": [], "losses": [], "comm": {}}
        if inspect:
            out["optimizer_sees"] = [(name, tuple(_local(p).shape), str(p.dtype).replace("torch.", ""),
                                      "DTensor" if _local(p) is not p else type(p).__name__)
                                     for name, p in net.named_parameters()]
        rows = batch_size // world
        for step in range(steps):
            x, y = shuffled_rows(cfg, batch_size, step, data_seed)
            before = comm_snapshot()
            _, loss = net(x[rank * rows:(rank + 1) * rows].to(dev), y[rank * rows:(rank + 1) * rows].to(dev))
            loss.backward()
            if inspect and step == 0:
                out["grads"] = {name: None if p.grad is None else _local(p.grad).detach().cpu().clone()
                                for name, p in net.named_parameters()}
            if inspect and step == steps - 1 and impl == "scratch":
                out["held"] = net.held_bytes(opt)
            opt.step()
            opt.zero_grad(set_to_none=True)
            for op, row in comm_per_step(before, comm_snapshot(), steps).items():  # the steps', not the gathers below
                total = out["comm"].setdefault(op, dict.fromkeys(row, 0.0))
                for key, value in row.items():
                    total[key] += value
            out["losses"].append(loss.item())
            out["states"].append(_full_state(net, module))
    if inspect and impl == "scratch":
        out["peak_param_bytes"] = net.peak_param_bytes
    if reference is not None and rank == 0:
        out["reference"] = cast_reference(cfg, steps, batch_size, optimizer=optimizer, lr=lr, seed=seed,
                                          data_seed=data_seed, **reference)
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's parameters and gradients); any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _full_state(net, module: nn.Module) -> dict[str, torch.Tensor]:
    if isinstance(net, PerParamFSDP):
        return net.full_state_dict()
    return {name: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().cpu().clone()
            for name, t in module.state_dict().items()}


def compare_designs(cfg: GPTConfig, steps: int = 2, batch_size: int = 8, lr: float = 1e-3) -> dict[str, dict]:
    """ZeRO-3 both ways on the same GPT, the same groups (one per block, the root for the rest) and AdamW, on this
    rank: the FlatParam design (:class:`~distlab.zero.fsdp.ZeRO3` and distlab's ``ShardedOptimizer``) and the
    per-parameter one (:class:`PerParamFSDP` and ``torch.optim.AdamW``). For each: bytes held after the last
    step, the peak parameter bytes, padding elements, the collectives of a step, and what the optimizer steps."""
    world, rank = _world()
    dev = rank_device()
    out = {}
    for design in ("FlatParam", "per-parameter"):
        module = GPT(cfg, seed=0).to(dev)
        if design == "FlatParam":
            net, opt = make_engine(3, module, "adamw", lr, wrap="block")
            stepped = [t for group in opt.param_groups for t in group["params"]]
            padding = sum(f.layout.padding for f in flat_params_of(module))
        else:
            net = PerParamFSDP(module, (Block, GPT), prefetch=False)  # as ZeRO3's default: one group at a time
            opt = make_optimizer(net.parameters(), "adamw", lr=lr)
            stepped = list(net.parameters())
            padding = sum((world * sp.chunk - sp.shape[0]) * sp.shape[1:].numel() for sp in net.params.values())
        traffic: dict = {}
        for step in range(steps):
            x, y = shuffled_rows(cfg, batch_size, step)
            rows = batch_size // world
            before = comm_snapshot()
            net(x[rank * rows:(rank + 1) * rows].to(dev), y[rank * rows:(rank + 1) * rows].to(dev))[1].backward()
            opt.step()
            if step == steps - 1:
                held = state_bytes(module, opt) if design == "FlatParam" else net.held_bytes(opt)
            opt.zero_grad(set_to_none=True)
            for op, row in comm_per_step(before, comm_snapshot(), steps).items():
                total = traffic.setdefault(op, dict.fromkeys(row, 0.0))
                for key, value in row.items():
                    total[key] += value
        inner = getattr(opt, "optim", opt)
        out[design] = {"held": held, "peak_param_bytes": net.peak_param_bytes, "padding": padding, "comm": traffic,
                       "optimizer": type(opt).__name__ + (f"({type(inner).__name__})" if inner is not opt else ""),
                       "stepped": [tuple(t.shape) for t in stepped]}
    return out
