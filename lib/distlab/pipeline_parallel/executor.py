"""Running a schedule on real ranks: stage modules, point-to-point channels, and the executor.

* :class:`StageModule` — a slice of the lab's GPT (blocks ``layers``, plus the embeddings on
  the first stage and ``ln_f`` + ``lm_head`` on the last), with the GPT's own parameter
  names, so its ``state_dict`` compares key by key with a single-process model.
* :class:`Channels` — one process group per direction between two neighbouring ranks of a
  pipeline (lab 11's 3D grid uses it for each of its pipelines). A rank posts sends and
  receives without waiting (``isend``/``irecv``: a blocking ``recv`` costs about five times
  more on gloo); only a compute waits, for its own input. With a group per direction, a
  message never queues behind one going the other way — under NCCL a group's
  point-to-point ops run in order on one stream, so sharing one group between the
  activations going forward and the gradients coming back could deadlock 1F1B.
* :func:`run_schedule` — executes one rank's actions for one optimizer step: forwards
  keep their input and output for the backward, the last stage's loss is divided by
  the number of micro-batches so the accumulated gradient is the full-batch mean, and
  every compute is a span on the rank's timeline (``F3``/``B3``/``I3``/``W3``).
"""

from __future__ import annotations

from bisect import bisect_right
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from distlab.memory import _storage_key_and_bytes
from distlab.model import GPT, GPTConfig
from distlab.pipeline_parallel.partition import check_partition
from distlab.pipeline_parallel.schedules import COMMUNICATION, Action
from distlab.runtime.subgroups import subgroup
from distlab.runtime.timeline import counter, span

__all__ = ["StageModule", "build_stages", "lm_loss", "Channels", "channels", "SavedActivations", "StepStats",
           "run_schedule", "sync_tied_gradients", "split_microbatches"]


class StageModule(nn.Module):
    """Blocks ``layers`` of ``model`` (the embeddings too on the first stage, ``ln_f`` and
    ``lm_head`` on the last). Parameters keep the GPT's names (``blocks.3.attn.qkv.weight``)."""

    def __init__(self, model: GPT, layers: range, first: bool, last: bool):
        super().__init__()
        self.layers, self.first, self.last, self.width = layers, first, last, model.cfg.d_model
        self.tied = model.cfg.tied_embeddings  # tok_emb (first stage) and lm_head (last) are one weight
        if first:
            self.tok_emb, self.pos_emb = model.tok_emb, model.pos_emb
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        if last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:  # token ids [rows, T] -> hidden states [rows, T, d_model]
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        if self.last:
            x = self.lm_head(self.ln_f(x))
        return x


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The GPT's loss on one micro-batch: mean cross-entropy over its tokens."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def build_stages(cfg: GPTConfig, partition: Sequence[range], rank: int, p: int, seed: int = 0,
                 device: torch.device | str = "cpu") -> dict[int, StageModule]:
    """This rank's stages ``{s: StageModule}`` for ``s ≡ rank (mod p)``, cut from ``GPT(cfg, seed)``.

    Every rank builds the whole small model from the same seed and keeps its slices, so
    the stages start exactly where a single-process model does. (At scale one builds on
    the meta device and materialises only the local stages, as torchtitan does.) When the
    first and last stage share a rank, a tied embedding stays one tensor.
    """
    check_partition(partition, cfg.n_layer, len(partition))
    if len(partition) % p:
        raise ValueError(f"{len(partition)} stages cannot be spread evenly over p={p} ranks")
    model = GPT(cfg, seed=seed)
    n = len(partition)
    return {s: StageModule(model, partition[s], s == 0, s == n - 1).to(device) for s in range(rank, n, p)}


def split_microbatches(x: torch.Tensor, y: torch.Tensor, m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``m`` equal micro-batches of rows: equal sizes make the mean of their losses the batch's mean loss."""
    if x.shape[0] % m:
        raise ValueError(f"the batch of {x.shape[0]} sequences does not split into m={m} equal micro-batches")
    return list(zip(x.chunk(m), y.chunk(m)))


# ---------------------------------------------------------------- point-to-point

class Channels:
    """A process group for each direction between neighbouring ranks of this rank's pipeline.

    Peers are addressed by pipeline rank (stage index mod ``p``), which ``pipeline`` maps to
    global ranks. ``pipelines``: the global ranks of every pipeline of the job, ``p`` each
    (default: one pipeline, ranks ``0 … p-1``; a 3D grid has one per DP and TP coordinate).
    ``new_group`` is collective, so every rank asks for the channels of every pipeline, in the
    same order, and keeps its own; the groups are made once per process (warm ranks reuse them).
    """

    def __init__(self, p: int, pipelines: Sequence[Sequence[int]] | None = None):
        self.p, me = p, dist.get_rank()
        self.groups: dict[tuple[int, int], object] = {}
        pairs = sorted({(a, (a + d) % p) for a in range(p) for d in (1, -1) if (a + d) % p != a})
        for pipeline in [list(ranks) for ranks in pipelines or [range(p)]]:
            ours = me in pipeline
            if ours:
                self.pipeline, self.rank = pipeline, pipeline.index(me)
            for src, dst in pairs:
                made = subgroup([pipeline[src], pipeline[dst]], purpose=f"channel {pipeline[src]}->{pipeline[dst]}")
                if ours:
                    self.groups[(src, dst)] = made

    def send(self, tensor: torch.Tensor, dst: int):
        return dist.isend(tensor.contiguous(), self.pipeline[dst], group=self.groups[(self.rank, dst)])

    def recv(self, buffer: torch.Tensor, src: int):
        return dist.irecv(buffer, self.pipeline[src], group=self.groups[(src, self.rank)])


def channels(p: int) -> Channels:
    """This process's :class:`Channels` for one ``p``-rank pipeline over ranks ``0 … p-1``."""
    return Channels(p)


# ---------------------------------------------------------------- memory

class SavedActivations:
    """Live bytes of the tensors autograd keeps for backward, and their peak, while a step runs.

    A ``saved_tensors_hooks`` pack hook sees every tensor a forward saves; it wraps it in a
    small holder whose release (when backward frees the graph) subtracts its bytes. Each
    storage counts once; parameters are not activations and are skipped. Works on any device.
    """

    def __init__(self, modules: Sequence[nn.Module] = ()):
        self.params = {_storage_key_and_bytes(p)[0] for m in modules for p in m.parameters()}
        self.refs: dict[tuple, int] = {}
        self.live = self.peak = 0

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _Held.unpack)

    def _pack(self, t: torch.Tensor):
        if isinstance(t, nn.Parameter) or (t._base is not None and isinstance(t._base, nn.Parameter)):
            return t
        key, nbytes = _storage_key_and_bytes(t)
        if key in self.params:
            return t
        count = self.refs.get(key, 0)
        self.refs[key] = count + 1
        if count == 0:
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        return _Held(t, key, nbytes, self)

    def _release(self, key: tuple, nbytes: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.live -= nbytes


class _Held:
    __slots__ = ("tensor", "key", "nbytes", "owner")

    def __init__(self, tensor, key, nbytes, owner):
        self.tensor, self.key, self.nbytes, self.owner = tensor, key, nbytes, owner

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def __del__(self):
        self.owner._release(self.key, self.nbytes)


# ---------------------------------------------------------------- the executor

@dataclass
class StepStats:
    """What one rank measured while running one step of a schedule."""

    losses: dict[int, float] = field(default_factory=dict)  # micro-batch -> loss (ranks with the last stage)
    peak_in_flight: int = 0  # most (micro-batch, stage) forwards held at once, waiting for their backward
    peak_activation_bytes: int = 0  # most bytes autograd held for backward at once (when tracked)
    sent_bytes: int = 0


def run_schedule(actions: Sequence[Action], stages: Mapping[int, nn.Module], micro_batches, *,
                 loss_fn: Callable = lm_loss, p: int | None = None, num_stages: int | None = None,
                 memory: SavedActivations | None = None, chan: Channels | None = None) -> StepStats:
    """Run this rank's ``actions`` for one optimizer step; gradients accumulate in ``.grad``.

    ``stages`` are this rank's :class:`StageModule` s by global stage index, ``micro_batches``
    the ``(x, y)`` pairs of the whole batch (every rank gets all of them; the first stage
    uses ``x``, the last ``y``). ``F`` of a later stage takes the received activation as a
    leaf that requires grad, so its backward stops there and leaves the gradient to send in
    ``x.grad``. Sends are waited for at the end of the step, receives by the compute that
    needs them. Each receive is posted one compute early: gloo moves a message only into a buffer
    its receiver has posted, so a receive posted just before the compute that needs it would put
    the whole transfer on the critical path; posted before the compute ahead of it, the transfer
    overlaps that compute. Receives stay in schedule order, so each still matches the same send.
    ``chan``: the point-to-point channels, addressed by pipeline rank (default:
    :func:`channels` of a pipeline over the whole world; a 3D grid passes its own).
    """
    p = p or dist.get_world_size()
    S = num_stages or p * len(stages)
    m = len(micro_batches)
    any_param = next(next(iter(stages.values())).parameters())
    device, dtype = any_param.device, any_param.dtype
    rows, T = micro_batches[0][0].shape
    width = next(iter(stages.values())).width
    chan = chan or (channels(p) if p > 1 else None)
    inputs, outputs, grads_out = {}, {}, {}
    received: dict[tuple, tuple] = {}
    sends = []
    stats = StepStats()
    held = 0

    def take(kind: str, mb: int, s: int) -> torch.Tensor:
        work, buffer = received.pop((kind, mb, s))
        work.wait()
        return buffer

    actions = list(actions)
    compute_at = [i for i, a in enumerate(actions) if a.kind not in COMMUNICATION]
    posted = 0  # every receive listed before this index has been posted

    def post_receives_before(stop: int) -> None:
        nonlocal posted
        for a in actions[posted:stop]:
            buffer = torch.empty(rows, T, width, device=device, dtype=dtype)
            if a.kind == "RECV_F":
                received[("act", a.microbatch, a.stage)] = (chan.recv(buffer, (a.stage - 1) % p), buffer)
            elif a.kind == "RECV_B":
                received[("grad", a.microbatch, a.stage)] = (chan.recv(buffer, (a.stage + 1) % p), buffer)
        posted = max(posted, stop)

    for i, a in enumerate(actions):
        mb, s = a.microbatch, a.stage
        key = (mb, s)
        if a.kind not in COMMUNICATION:  # first the receives the next compute needs
            following = bisect_right(compute_at, i)
            post_receives_before(compute_at[following] if following < len(compute_at) else len(actions))
        if a.kind in ("RECV_F", "RECV_B"):
            post_receives_before(i + 1)
        elif a.kind == "SEND_F":
            tensor = outputs[key].detach()
            sends.append((chan.send(tensor, (s + 1) % p), tensor))
            stats.sent_bytes += tensor.numel() * tensor.element_size()
        elif a.kind == "SEND_B":
            tensor = inputs.pop(key).grad
            sends.append((chan.send(tensor, (s - 1) % p), tensor))
            stats.sent_bytes += tensor.numel() * tensor.element_size()
        elif a.kind == "F":
            x, y = micro_batches[mb]
            if s == 0:
                x = x.to(device)
            elif (s - 1) in stages:  # the previous stage is on this rank: hand over directly
                x = outputs[(mb, s - 1)].detach().requires_grad_()
            else:
                x = take("act", mb, s).requires_grad_()
            with span(f"F{mb}"), (memory.hooks() if memory else nullcontext()):
                out = stages[s](x)
                if s == S - 1:
                    loss = loss_fn(out, y.to(device))
                    stats.losses[mb] = loss.detach()
                    out = loss / m
            inputs[key], outputs[key] = x, out
            held += 1
            stats.peak_in_flight = max(stats.peak_in_flight, held)
            if memory is not None:
                counter("activation bytes held", memory.live)  # a counter track in the run's trace
        elif a.kind in ("B", "I", "W"):
            if a.kind != "W":
                if s == S - 1:
                    grads_out[key] = None
                elif (s + 1) in stages:
                    grads_out[key] = inputs.pop((mb, s + 1)).grad
                else:
                    grads_out[key] = take("grad", mb, s)
            with span(f"{a.kind}{mb}"):
                _backward(a.kind, outputs, inputs, grads_out, key, stages[s])
            if a.kind in ("B", "W"):  # this micro-batch's activations on this stage are freed
                outputs.pop(key)
                grads_out.pop(key)
                held -= 1
                if s == 0:
                    inputs.pop(key)  # token ids; later stages' inputs go with their SEND_B or local hand-over
                if memory is not None:
                    counter("activation bytes held", memory.live)
        else:
            raise ValueError(f"unknown action {a!r}")
    for work, _ in sends:
        work.wait()
    stats.losses = {mb: float(loss) for mb, loss in sorted(stats.losses.items())}
    if memory is not None:
        stats.peak_activation_bytes = memory.peak
    return stats


def _backward(kind: str, outputs, inputs, grads_out, key, module: nn.Module) -> None:
    """``B``: the whole backward. ``I``: only the input's gradient, keeping the graph for
    ``W``, which then computes the weights' gradients (this simple split recomputes the
    activation gradients in ``W``; production code keeps them from ``I``)."""
    out, grad, x = outputs[key], grads_out[key], inputs.get(key)
    if kind == "B":
        torch.autograd.backward(out, grad)
    elif kind == "I":
        if x is not None and x.requires_grad:
            (x.grad,) = torch.autograd.grad(out, x, grad, retain_graph=True)
    else:  # W
        params = [p for p in module.parameters() if p.requires_grad]
        torch.autograd.backward(out, grad, inputs=params)


@torch.no_grad()
def sync_tied_gradients(stages: Mapping[int, StageModule], p: int, num_stages: int) -> None:
    """Sum the tied embedding's two gradients when the first and last stage live on different ranks.

    With ``tied_embeddings`` the token embedding (stage 0) and the output projection (last
    stage) are one weight; each end computes part of its gradient. Megatron-LM all-reduces
    them over an "embedding group" of the first and last stage; with two ranks that is one
    exchange. Both ends then take the same optimizer step and the copies stay equal.
    """
    first, last = 0, num_stages - 1
    if first % p == last % p or not next(iter(stages.values())).tied:
        return
    rank = dist.get_rank()
    if rank == first % p and first in stages:
        weight, peer = stages[first].tok_emb.weight, last % p
    elif rank == last % p and last in stages:
        weight, peer = stages[last].lm_head.weight, first % p
    else:
        return
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    other = torch.empty_like(weight.grad)
    works = [dist.isend(weight.grad.clone(), peer), dist.irecv(other, peer)]
    for work in works:
        work.wait()
    weight.grad.add_(other)
