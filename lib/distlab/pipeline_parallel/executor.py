"""Running a schedule on real ranks: stage modules, point-to-point channels, and the executor.

* :class:`StageModule` — a slice of the lab's GPT (blocks ``layers``, plus the embeddings on
  the first stage and ``ln_f`` + ``lm_head`` on the last), with the GPT's own parameter
  names, so its ``state_dict`` compares key by key with a single-process model.
* :class:`Channels` — process groups between the ranks of a pipeline that talk: for each
  direction, one for activations and one for gradients (lab 11's 3D grid uses it for each of its
  pipelines). A rank posts sends and receives without waiting (``isend``/``irecv``: a blocking
  ``recv`` costs about five times more on gloo); only a compute waits, for its own input. With a
  group per direction and kind, a message never queues behind one going the other way or of the
  other kind — an NCCL send or receive blocks its stream until its partner has matched it, so
  sharing one group between the activations going forward and the gradients coming back could
  deadlock 1F1B, and a V sends activations and gradients the same way between the same two ranks.
* :func:`run_schedule` — executes one rank's actions for one optimizer step: forwards
  keep their input and output for the backward, the last stage's loss is divided by
  the number of micro-batches so the accumulated gradient is the full-batch mean, a backward
  split into ``I`` and ``W`` computes each part once (:class:`SplitBackward`), and every compute
  is a span on the rank's timeline (``F3``/``B3``/``I3``/``W3``).
"""

from __future__ import annotations

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
from distlab.pipeline_parallel.schedules import COMPUTE, Action, stage_placement
from distlab.runtime.subgroups import subgroup
from distlab.runtime.timeline import counter, span

__all__ = ["StageModule", "build_stages", "lm_loss", "Channels", "channels", "neighbour_pairs", "SavedActivations",
           "SplitBackward", "StepStats", "RECEIVE_AHEAD", "run_schedule", "sync_tied_gradients", "split_microbatches"]


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
                 device: torch.device | str = "cpu",
                 placement: str | Sequence[int] = "looped") -> dict[int, StageModule]:
    """This rank's stages ``{s: StageModule}``, cut from ``GPT(cfg, seed)``: those ``placement`` puts on
    ``rank`` (``"looped"``: ``s ≡ rank (mod p)``; ``"v"``: ``rank`` and ``2p-1-rank``; or a rank per stage).

    Every rank builds the whole small model from the same seed and keeps its slices, so
    the stages start exactly where a single-process model does. (At scale one builds on
    the meta device and materialises only the local stages, as torchtitan does.) When the
    first and last stage share a rank (a V puts both on rank 0), a tied embedding stays one tensor.
    """
    check_partition(partition, cfg.n_layer, len(partition))
    if len(partition) % p:
        raise ValueError(f"{len(partition)} stages cannot be spread evenly over p={p} ranks")
    n = len(partition)
    rank_of = _ranks_of(placement, p, n)
    model = GPT(cfg, seed=seed)
    return {s: StageModule(model, partition[s], s == 0, s == n - 1).to(device) for s in range(n) if rank_of[s] == rank}


def _ranks_of(placement: str | Sequence[int] | None, p: int, num_stages: int) -> tuple[int, ...]:
    """The rank of every stage: a placement style (None: looped) or the ranks themselves."""
    if placement is None or isinstance(placement, str):
        if num_stages % p:
            raise ValueError(f"{num_stages} stages cannot be spread evenly over p={p} ranks")
        return stage_placement(p, num_stages // p, placement or "looped")
    ranks = tuple(int(r) for r in placement)
    if len(ranks) != num_stages or not all(0 <= r < p for r in ranks):
        raise ValueError(f"the placement {ranks} must give one rank in 0..{p - 1} for each of the {num_stages} stages")
    return ranks


def split_microbatches(x: torch.Tensor, y: torch.Tensor, m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``m`` equal micro-batches of rows: equal sizes make the mean of their losses the batch's mean loss."""
    if x.shape[0] % m:
        raise ValueError(f"the batch of {x.shape[0]} sequences does not split into m={m} equal micro-batches")
    return list(zip(x.chunk(m), y.chunk(m)))


# ---------------------------------------------------------------- point-to-point

class Channels:
    """Process groups between the ranks of this rank's pipeline that exchange messages: for each
    direction, one for activations (``kind="act"``) and one for gradients (``kind="grad"``).

    Peers are addressed by pipeline rank, which ``pipeline`` maps to global ranks. ``pipelines``: the
    global ranks of every pipeline of the job, ``p`` each (default: one pipeline, ranks ``0 … p-1``; a
    3D grid has one per DP and TP coordinate). ``pairs``: the ``(src, dst)`` pipeline ranks that talk
    (default: ring neighbours, both ways; :func:`neighbour_pairs` gives a placement's). ``new_group``
    is collective, so every rank asks for the channels of every pipeline, in the same order, and keeps
    its own; the groups are made once per process (warm ranks reuse them).
    """

    KINDS = ("act", "grad")

    def __init__(self, p: int, pipelines: Sequence[Sequence[int]] | None = None,
                 pairs: Sequence[tuple[int, int]] | None = None):
        self.p, me = p, dist.get_rank()
        self.groups: dict[tuple[int, int, str], object] = {}
        if pairs is None:
            pairs = {(a, (a + d) % p) for a in range(p) for d in (1, -1) if (a + d) % p != a}
        pairs = sorted(set(pairs))
        for pipeline in [list(ranks) for ranks in pipelines or [range(p)]]:
            ours = me in pipeline
            if ours:
                self.pipeline, self.rank = pipeline, pipeline.index(me)
            for src, dst in pairs:
                for kind in self.KINDS:
                    made = subgroup([pipeline[src], pipeline[dst]],
                                    purpose=f"{kind} channel {pipeline[src]}->{pipeline[dst]}")
                    if ours:
                        self.groups[(src, dst, kind)] = made

    def send(self, tensor: torch.Tensor, dst: int, kind: str = "act"):
        """``isend`` to pipeline rank ``dst`` on the channel for ``kind`` (code that passes no kind sends
        activations and gradients on one channel per direction, which a looped schedule's order allows)."""
        return dist.isend(tensor.contiguous(), self.pipeline[dst], group=self.groups[(self.rank, dst, kind)])

    def recv(self, buffer: torch.Tensor, src: int, kind: str = "act"):
        return dist.irecv(buffer, self.pipeline[src], group=self.groups[(src, self.rank, kind)])


def channels(p: int) -> Channels:
    """This process's :class:`Channels` for one ``p``-rank pipeline over ranks ``0 … p-1``, ring neighbours."""
    return Channels(p)


def neighbour_pairs(placement: Sequence[int]) -> list[tuple[int, int]]:
    """The ``(src, dst)`` ranks that exchange messages when stage ``s`` lives on ``placement[s]``: the ranks of
    every two consecutive stages on different ranks, both ways."""
    pairs = {(a, b) for a, b in zip(placement, placement[1:]) if a != b}
    return sorted(pairs | {(b, a) for a, b in pairs})


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


# ---------------------------------------------------------------- the backward, split in two

class SplitBackward:
    """A stage's backward in two parts, each computed once: ``I`` (the input's gradient, which the previous
    stage waits for) and ``W`` (the weights' gradients, which nobody waits for until the optimizer step).

    While a forward runs, a hook on every module that owns weights (each linear, layer norm, embedding)
    keeps that module's output ``y``. ``I`` asks autograd for the gradient of the stage's input *and* of each
    ``y``: every one of them lies on the path from the output to the input, so it costs nothing more than
    the input's gradient alone, and no weight gradient is computed. ``W`` then runs, per module, the
    backward of ``y`` into that module's weights only: autograd walks just the node that made ``y``
    (``y = x Wᵀ + b`` gives ``dW = gᵀx``), never the graph between layers again. PyTorch's
    ``stage_backward_input``/``stage_backward_weight`` do the same from the autograd graph's nodes. A
    stage whose input needs no gradient (the first: token ids) has nothing for ``I`` to do; its ``W`` is
    the whole backward, as in PyTorch's schedules.
    """

    def __init__(self, module: nn.Module):
        self.owners = [m for m in module.modules() if any(q.requires_grad for q in m.parameters(recurse=False))]
        self.weights = {m: [q for q in m.parameters(recurse=False) if q.requires_grad] for m in self.owners}
        self.recording: list | None = None
        self.handles = [m.register_forward_hook(self._record) for m in self.owners]

    def _record(self, module, args, output) -> None:
        if self.recording is not None:
            self.recording.append((module, output))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def input_gradient(self, out: torch.Tensor, grad, x: torch.Tensor, outputs: list) -> list:
        """``I``: set ``x.grad``; return what ``W`` needs (each module's output and its gradient)."""
        if not x.requires_grad:
            return []
        wanted = [y for _, y in outputs]
        grads = torch.autograd.grad(out, [x, *wanted], grad, retain_graph=True, allow_unused=True)
        x.grad = grads[0]
        return [(module, y, g) for (module, y), g in zip(outputs, grads[1:]) if g is not None]

    def weight_gradient(self, out: torch.Tensor, grad, pending: list) -> None:
        """``W``: accumulate the weights' gradients from what ``I`` kept; when it kept nothing (the input needs
        no gradient), the whole backward into the weights."""
        if pending:
            for module, y, g in pending:
                torch.autograd.backward(y, g, inputs=self.weights[module])
        elif self.owners:
            torch.autograd.backward(out, grad, inputs=[q for m in self.owners for q in self.weights[m]])


# ---------------------------------------------------------------- the executor

RECEIVE_AHEAD = 2  # receives are posted this many computes before the one that needs them (see run_schedule)


@dataclass
class StepStats:
    """What one rank measured while running one step of a schedule."""

    losses: dict[int, float] = field(default_factory=dict)  # micro-batch -> loss (ranks with the last stage)
    peak_in_flight: float = 0  # most micro-batches' activations held at once (a stage of v per rank counts 1/v)
    peak_activation_bytes: int = 0  # most bytes autograd held for backward at once (when tracked)
    sent_bytes: int = 0


def run_schedule(actions: Sequence[Action], stages: Mapping[int, nn.Module], micro_batches, *,
                 loss_fn: Callable = lm_loss, p: int | None = None, num_stages: int | None = None,
                 memory: SavedActivations | None = None, chan: Channels | None = None,
                 placement: str | Sequence[int] | None = None) -> StepStats:
    """Run this rank's ``actions`` for one optimizer step; gradients accumulate in ``.grad``.

    ``stages`` are this rank's :class:`StageModule` s by global stage index, ``micro_batches``
    the ``(x, y)`` pairs of the whole batch (every rank gets all of them; the first stage
    uses ``x``, the last ``y``). ``placement``: where every stage lives (``"looped"``, the default;
    ``"v"``; or a rank per stage), which says who sends to whom. ``F`` of a later stage takes the
    received activation as a leaf that requires grad, so its backward stops there and leaves the
    gradient to send in ``x.grad``; a stage whose neighbour is on this rank hands over directly.

    Sends are waited for at the end of the step, receives by the compute that needs them. Each
    receive is posted :data:`RECEIVE_AHEAD` computes before the compute that needs it: gloo moves a
    message only into a buffer its receiver has posted (the sender learns of the buffer from a note
    its own I/O thread must read), so a receive posted just before the compute that needs it puts the
    whole exchange on the critical path; posted early, the sender finds the buffer waiting and writes
    the message at once, while the receiver still computes. Receives stay in schedule order, so each
    still matches the same send. ``chan``: the point-to-point channels, addressed by pipeline rank
    (default: :class:`Channels` between the ranks the placement makes neighbours; a 3D grid passes its own).
    """
    p = p or dist.get_world_size()
    S = num_stages or p * len(stages)
    rank_of = _ranks_of(placement, p, S)
    m = len(micro_batches)
    any_param = next(next(iter(stages.values())).parameters())
    device, dtype = any_param.device, any_param.dtype
    rows, T = micro_batches[0][0].shape
    width = next(iter(stages.values())).width
    if chan is None and any(a != b for a, b in zip(rank_of, rank_of[1:])):
        chan = Channels(p, pairs=neighbour_pairs(rank_of))
    actions = list(actions)
    split_keys = {(a.microbatch, a.stage) for a in actions if a.kind == "I"}
    splits = {s: SplitBackward(stages[s]) for s in {s for _, s in split_keys}}
    inputs, outputs, grads_out, recorded, pending_w = {}, {}, {}, {}, {}
    received: dict[tuple, tuple] = {}
    sends = []
    stats = StepStats()
    held = 0.0
    per_stage = p / S  # one stage's share of the rank's work

    # receives, in order, and for each compute how far down the list to have them posted before it runs
    receives = [(i, a) for i, a in enumerate(actions) if a.kind in ("RECV_F", "RECV_B")]
    computes = [i for i, a in enumerate(actions) if a.kind in COMPUTE]
    post_before = {i: computes[c + RECEIVE_AHEAD] if c + RECEIVE_AHEAD < len(computes) else len(actions)
                   for c, i in enumerate(computes)}
    next_receive = 0

    def post_receives(stop: int) -> None:
        nonlocal next_receive
        while next_receive < len(receives) and receives[next_receive][0] < stop:
            a = receives[next_receive][1]
            buffer = torch.empty(rows, T, width, device=device, dtype=dtype)
            if a.kind == "RECV_F":
                received[("act", a.microbatch, a.stage)] = (chan.recv(buffer, rank_of[a.stage - 1], "act"), buffer)
            else:
                received[("grad", a.microbatch, a.stage)] = (chan.recv(buffer, rank_of[a.stage + 1], "grad"), buffer)
            next_receive += 1

    def take(kind: str, mb: int, s: int) -> torch.Tensor:
        work, buffer = received.pop((kind, mb, s))
        work.wait()
        return buffer

    try:
        for i, a in enumerate(actions):
            kind, mb, s = a
            key = (mb, s)
            if kind == "SEND_F":  # first: the next rank may be waiting for it
                tensor = outputs[key].detach()
                sends.append((chan.send(tensor, rank_of[s + 1], "act"), tensor))
                stats.sent_bytes += tensor.numel() * tensor.element_size()
            elif kind == "SEND_B":
                tensor = inputs.pop(key).grad
                sends.append((chan.send(tensor, rank_of[s - 1], "grad"), tensor))
                stats.sent_bytes += tensor.numel() * tensor.element_size()
            elif kind in ("RECV_F", "RECV_B"):
                post_receives(i + 1)
            elif kind == "F":
                post_receives(post_before[i])
                x, y = micro_batches[mb]
                if s == 0:
                    x = x.to(device)
                elif rank_of[s - 1] == rank_of[s]:  # the previous stage is on this rank: hand over directly
                    x = outputs[(mb, s - 1)].detach().requires_grad_()
                else:
                    x = take("act", mb, s).requires_grad_()
                split = splits.get(s) if key in split_keys else None
                if split is not None:
                    split.recording = recorded[key] = []
                with span(f"F{mb}"), (memory.hooks() if memory else nullcontext()):
                    out = stages[s](x)
                    if s == S - 1:
                        loss = loss_fn(out, y.to(device))
                        stats.losses[mb] = loss.detach()
                        out = loss / m
                if split is not None:
                    split.recording = None
                inputs[key], outputs[key] = x, out
                held += per_stage
                stats.peak_in_flight = max(stats.peak_in_flight, held)
                if memory is not None:
                    counter("activation bytes held", memory.live)  # a counter track in the run's trace
            elif kind in ("B", "I", "W"):
                post_receives(post_before[i])
                if kind != "W":
                    if s == S - 1:
                        grads_out[key] = None
                    elif rank_of[s + 1] == rank_of[s]:
                        grads_out[key] = inputs.pop((mb, s + 1)).grad
                    else:
                        grads_out[key] = take("grad", mb, s)
                with span(f"{kind}{mb}"):
                    if kind == "B":
                        torch.autograd.backward(outputs[key], grads_out[key])
                    elif kind == "I":
                        pending_w[key] = splits[s].input_gradient(outputs[key], grads_out[key], inputs[key],
                                                                  recorded.pop(key))
                    else:
                        splits[s].weight_gradient(outputs[key], grads_out[key], pending_w.pop(key))
                if kind in ("B", "W"):  # this micro-batch's activations on this stage are freed
                    outputs.pop(key)
                    grads_out.pop(key)
                    held -= per_stage
                    if s == 0:
                        inputs.pop(key)  # token ids; later stages' inputs go with their SEND_B or local hand-over
                    if memory is not None:
                        counter("activation bytes held", memory.live)
            else:
                raise ValueError(f"unknown action {a!r}")
        for work, _ in sends:
            work.wait()
    finally:
        for split in splits.values():
            split.remove()
    stats.losses = {mb: float(loss) for mb, loss in sorted(stats.losses.items())}
    if memory is not None:
        stats.peak_activation_bytes = memory.peak
    return stats


@torch.no_grad()
def sync_tied_gradients(stages: Mapping[int, StageModule], p: int, num_stages: int,
                        placement: str | Sequence[int] | None = None) -> None:
    """Sum the tied embedding's two gradients when the first and last stage live on different ranks.

    With ``tied_embeddings`` the token embedding (stage 0) and the output projection (last
    stage) are one weight; each end computes part of its gradient. Megatron-LM all-reduces
    them over an "embedding group" of the first and last stage; with two ranks that is one
    exchange. Both ends then take the same optimizer step and the copies stay equal. (A V puts
    both stages on rank 0, where the weight is one tensor and its gradient already the sum.)
    """
    rank_of = _ranks_of(placement, p, num_stages)
    first, last = 0, num_stages - 1
    if rank_of[first] == rank_of[last] or not next(iter(stages.values())).tied:
        return
    rank = dist.get_rank()
    if rank == rank_of[first] and first in stages:
        weight, peer = stages[first].tok_emb.weight, rank_of[last]
    elif rank == rank_of[last] and last in stages:
        weight, peer = stages[last].lm_head.weight, rank_of[first]
    else:
        return
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    other = torch.empty_like(weight.grad)
    works = [dist.isend(weight.grad.clone(), peer), dist.irecv(other, peer)]
    for work in works:
        work.wait()
    weight.grad.add_(other)
