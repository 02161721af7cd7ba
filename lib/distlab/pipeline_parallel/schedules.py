"""Pipeline schedules as data: each rank's ordered list of actions, checked and simulated before any rank runs.

A schedule for ``p`` ranks is ``list[list[Action]]``: ``schedule[r]`` is what rank ``r``
does in one optimizer step, in order. Stages are numbered globally, ``0 … S-1`` with
``S = p·v`` (``v`` stages per rank). Where they live is the schedule's *placement*, one rank per
stage (:func:`stage_placement`): *looped* puts stage ``s`` on rank ``s % p`` (GPipe, 1F1B,
interleaved); *V* runs down the ranks and back up, so rank ``r`` holds stages ``r`` and ``2p-1-r``
(ZB-V, DualPipeV: the first and last stage share rank 0, and stages ``p-1`` and ``p`` share rank
``p-1``, so those hand-overs need no message). A schedule written as data shows its placement
(:func:`placement_of` reads it off the actions). Keeping the schedule a pure function of
``(p, m, v)`` is what lets us

* print it and draw it before running anything (:func:`simulate` replays it in unit time);
* prove it cannot deadlock and that each message meets its receiver in order
  (:func:`validate`) — NCCL pairs the messages of a channel by position, so order matters;
* compute its bubble and its peak in-flight micro-batches exactly, then compare those with
  what a real run measures.

Actions (``Action(kind, microbatch, stage)``, printed like PyTorch's ``1F3``: stage 1, forward, micro-batch 3):

``F``  forward; ``B`` full backward; ``I``/``W`` the backward split into input gradient and
weight gradient (zero-bubble schedules); ``SEND_F``/``RECV_F`` the activation between stage
``s`` and ``s+1``; ``SEND_B``/``RECV_B`` the gradient of that activation travelling back.
Sends and receives are posted without waiting. Each direction between two ranks has two
channels, one for activations and one for gradients, so a message never queues behind one going
the other way or of the other kind (a V sends rank 0's activations and the last stage's gradients
the same way, from rank 0 to rank 1).

A schedule can also be written by hand, as Python lists or as text in the spirit of torchtitan's
``pipeline_parallel_schedule_csv`` (one line per rank, comma-separated actions such as ``2I0``):
:func:`parse_schedule` reads it, :func:`validate` names its first problem, :func:`simulate` gives its
bubble and memory, and the executor runs it on real ranks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping, NamedTuple, Sequence

from distlab.runtime import trace as trace_format
from distlab.runtime.timeline import Span

__all__ = [
    "Action", "COMPUTE", "COMMUNICATION", "ScheduleError", "bubble_fraction", "interleaved_bubble_fraction",
    "zero_bubble_h1_bubble", "dualpipe_v_bubble", "peak_in_flight", "interleaved_warmup",
    "gpipe", "one_f_one_b", "interleaved_1f1b", "zero_bubble_h1", "zero_bubble_v", "dualpipe_v", "SCHEDULES",
    "V_SCHEDULES", "make_schedule", "placement_style", "stage_placement", "placement_of", "with_p2p",
    "compute_order", "num_stages_of", "messages_per_rank", "validate", "Simulation", "simulate", "format_schedule",
    "parse_schedule", "schedule_csv",
]

COMPUTE = ("F", "B", "I", "W")
COMMUNICATION = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


class Action(NamedTuple):
    kind: str  # F | B | I | W | SEND_F | RECV_F | SEND_B | RECV_B
    microbatch: int
    stage: int

    def __repr__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


class ScheduleError(ValueError):
    """A schedule that cannot run: a missing or repeated action, a message nobody receives, a deadlock."""


# ---------------------------------------------------------------- theory

def bubble_fraction(p: int, m: int) -> float:
    """Idle share of a GPipe or 1F1B step with ``p`` equal stages and ``m`` micro-batches.

    The last stage starts ``p-1`` forward slots late and the first stage ends ``p-1``
    backward slots early; the step lasts ``(m + p - 1)`` slots of ``(t_f + t_b)`` of which
    each stage computes ``m``: idle share ``(p-1)/(m+p-1)``.
    """
    _check_sizes(p, m)
    return (p - 1) / (m + p - 1)


def interleaved_bubble_fraction(p: int, m: int, v: int) -> float:
    """Interleaved 1F1B with ``v`` stages per rank: the fill and drain still take ``p-1``
    stage slots, but a stage slot is ``1/v`` of a rank's work: idle ``(p-1)/(v·m + p - 1)``."""
    _check_sizes(p, m, v)
    return (p - 1) / (v * m + p - 1)


def zero_bubble_h1_bubble(p: int, m: int) -> float:
    """ZB-H1's idle share when a forward, an input gradient and a weight gradient take the same time and
    ``m >= p``: the drain's ``p-1`` slots of ``(t_F + t_I)`` each lose the ``t_W`` a deferred weight gradient
    fills (Qi et al. 2024, §2.1: a third of 1F1B's bubble in time): ``(p-1)`` slots idle in ``3m + p - 1``."""
    _check_sizes(p, m)
    return (p - 1) / (3 * m + p - 1)


def dualpipe_v_bubble(p: int, m: int, forward: float = 1.0, backward: float = 2.0, weight: float = 1.0,
                      overlapped: float | None = None) -> float:
    """DualPipeV's idle share from the DualPipe README's bubble, ``(PP/2 - 1)(F&B + B - 3W)`` per device with
    ``PP = 2p`` stages on ``p`` ranks: ``F``, ``B``, ``W`` the times of one stage's forward, full backward and
    weight gradient, ``F&B`` of a forward and a backward run as one overlapped pair (default ``F + B``: one CPU
    thread overlaps nothing). Each rank computes ``2m`` stages' ``F + B``, so the share is
    ``idle / (idle + 2m(F + B))``; with ``F = W = B/2``, ``(p-1)/(3m + p - 1)``."""
    _check_sizes(p, m)
    pair = forward + backward if overlapped is None else overlapped
    idle = (p - 1) * (pair + backward - 3 * weight)
    return idle / (idle + 2 * m * (forward + backward))


def peak_in_flight(p: int, m: int, v: int = 1) -> float:
    """Most micro-batches rank 0 holds activations for (in whole-rank micro-batches) under
    1F1B (``v = 1``) or interleaved 1F1B: its warm-up forwards plus the first steady one.

    1F1B (and interleaved with ``v = 1``, which is 1F1B): ``min(p, m)``. Interleaved with ``v ≥ 2``:
    ``(2(p-1) + (v-1)·p + 1) / v = p + (p-1)/v`` stage-forwards of ``1/v`` of the rank's layers each
    (at most ``m``): more than 1F1B's ``p`` at every ``v ≥ 2`` (most at ``v = 2``, tending to ``p`` as
    ``v`` grows), the memory price of the smaller bubble. :func:`simulate` measures the same number.
    """
    _check_sizes(p, m, v)
    return min(interleaved_warmup(p, 0, v) + 1, m * v) / v


def _check_sizes(p: int, m: int, v: int = 1) -> None:
    for name, value in (("p (pipeline ranks)", p), ("m (micro-batches)", m), ("v (stages per rank)", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


# ---------------------------------------------------------------- the schedules (compute order)

def _fb(kind: str, mb: int, stage: int) -> Action:
    return Action(kind, mb, stage)


def gpipe(p: int, m: int) -> list[list[Action]]:
    """GPipe (Huang et al. 2019): every forward, then every backward. Rank ``r`` holds all
    ``m`` micro-batches' activations at once."""
    _check_sizes(p, m)
    order = [[_fb("F", mb, r) for mb in range(m)] + [_fb("B", mb, r) for mb in range(m)] for r in range(p)]
    return with_p2p(order, p)


def one_f_one_b(p: int, m: int) -> list[list[Action]]:
    """1F1B (PipeDream-Flush, Narayanan et al. 2021): rank ``r`` runs ``p-r-1`` warm-up
    forwards, then alternates one forward and one backward, then drains the backwards.
    At most ``p-r`` micro-batches are in flight on rank ``r``; with ``m < p`` the warm-up is
    simply shorter (every rank still runs every micro-batch)."""
    _check_sizes(p, m)
    order = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        ops = [_fb("F", mb, r) for mb in range(warmup)]
        for i in range(m - warmup):
            ops += [_fb("F", warmup + i, r), _fb("B", i, r)]
        ops += [_fb("B", mb, r) for mb in range(m - warmup, m)]
        order.append(ops)
    return with_p2p(order, p)


def interleaved_1f1b(p: int, m: int, v: int) -> list[list[Action]]:
    """Interleaved 1F1B (Narayanan et al. 2021, §2.2): rank ``r`` holds stages ``r, r+p, …,
    r+(v-1)p``. Micro-batches go through a rank's stages in rounds of ``p``: forward ``k``
    (counting every stage's forwards on this rank) is micro-batch ``(k // (p·v))·p + k % p``
    on local chunk ``(k // p) % v``; backward ``k`` the same on the chunks in reverse.
    Warm-up: ``2(p-r-1) + (v-1)·p`` forwards for ``v ≥ 2`` (Megatron-LM's count), then 1F1B, then the
    remaining backwards. With ``v = 1`` there is nothing to interleave and the warm-up is 1F1B's ``p-r-1``
    (Megatron-LM runs its plain 1F1B schedule then): the schedule *is* 1F1B, with its ``p`` micro-batches
    in flight. Like Megatron-LM, it needs ``m`` to be a multiple of ``p``."""
    _check_sizes(p, m, v)
    if m % p:
        raise ValueError(f"interleaved 1F1B needs the micro-batches m={m} to be a multiple of the pipeline "
                         f"ranks p={p} (micro-batches enter in rounds of p); use m={m + p - m % p}")
    total = m * v

    def stage_of(k: int, rank: int, forward: bool) -> Action:
        chunk = (k // p) % v
        if not forward:
            chunk = v - 1 - chunk
        mb = (k // (p * v)) * p + k % p
        return _fb("F" if forward else "B", mb, chunk * p + rank)

    order = []
    for r in range(p):
        warmup = min(interleaved_warmup(p, r, v), total)
        ops = [stage_of(k, r, True) for k in range(warmup)]
        for i in range(total - warmup):
            ops += [stage_of(warmup + i, r, True), stage_of(i, r, False)]
        ops += [stage_of(k, r, False) for k in range(total - warmup, total)]
        order.append(ops)
    return with_p2p(order, p)


def interleaved_warmup(p: int, r: int, v: int) -> int:
    """Warm-up forwards of rank ``r`` under interleaved 1F1B, before the cap at ``m·v``.

    ``v ≥ 2``: Megatron-LM's ``2(p-r-1) + (v-1)·p`` (``megatron/core/pipeline_parallel/schedules.py``,
    ``get_pp_rank_microbatches``). The lab keeps that count, on which
    :func:`peak_in_flight` rests; ``(p-r-1) + (v-1)·p`` has the same unit-time bubble and also validates here,
    where activations and gradients travel on separate channels.
    ``v = 1``: 1F1B's ``p-r-1``, so interleaving with one stage per rank is exactly 1F1B, as in Megatron-LM,
    which runs its plain 1F1B schedule when there is one model chunk.
    """
    return p - r - 1 if v == 1 else 2 * (p - r - 1) + (v - 1) * p


def zero_bubble_h1(p: int, m: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): the 1F1B order with each
    backward split into ``I`` (gradient of the stage's input, which the previous stage is
    waiting for) and ``W`` (weight gradients, which nobody waits for). Rank ``r`` defers
    its first ``r`` weight gradients, so they fill the cool-down where 1F1B idles: the
    bubble shrinks to about a third of 1F1B's at the same activation memory."""
    _check_sizes(p, m)
    order = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        deferred = min(r, m)  # W's held back to fill the drain
        ops = [_fb("F", mb, r) for mb in range(warmup)]
        w_next = 0
        for i in range(m - warmup):
            ops += [_fb("F", warmup + i, r), _fb("I", i, r)]
            if i >= deferred:
                ops.append(_fb("W", w_next, r))
                w_next += 1
        for mb in range(m - warmup, m):
            ops.append(_fb("I", mb, r))
            if w_next < m:
                ops.append(_fb("W", w_next, r))
                w_next += 1
        ops += [_fb("W", mb, r) for mb in range(w_next, m)]
        order.append(ops)
    return with_p2p(order, p)


def zero_bubble_v(p: int, m: int) -> list[list[Action]]:
    """ZB-V (Qi et al. 2024, *Zero Bubble Pipeline Parallelism*, §6): two stages per rank in a V — rank ``r``
    runs stage ``r`` on the way down and stage ``2p-1-r`` on the way back — with each backward split into
    ``I`` and ``W``. With ``t_F = t_I = t_W`` it has (near) zero bubble while holding 1F1B's activations
    (``p`` micro-batches' worth per rank); the price is twice 1F1B's point-to-point traffic (each micro-batch
    crosses every rank twice). Rank ``r``:

    1. ``2(p-r) - 1`` forwards of its first stage (the micro-batches that must reach the V's bottom);
    2. ``r`` pairs: a forward of its second stage, one of its first;
    3. ``p - r`` triples on the second stage, forward, ``I``, ``W``: the first backwards start at once;
    4. steady state, one micro-batch per round: forward, ``I``, ``W`` on the first stage, then on the second;
    5. cool-down: ``r`` pairs of ``I`` (first stage, then second), ``p - r`` pairs of ``I`` and ``W`` on the
       first stage (the gradient the previous rank waits for goes first), then the weight gradients left.

    For ``m < 2p - 1`` the pattern is laid out for ``2p - 1`` micro-batches and the actions of the ones that
    do not exist are dropped (what PyTorch's ``ScheduleZBVZeroBubble`` does); the order stays valid."""
    _check_sizes(p, m)
    n = max(m, 2 * p - 1)
    order = []
    for r in range(p):
        down, up = r, 2 * p - 1 - r
        done = {(kind, stage): 0 for kind in "FIW" for stage in (down, up)}
        ops: list[Action] = []

        def run(kind: str, stage: int) -> None:
            ops.append(Action(kind, done[(kind, stage)], stage))
            done[(kind, stage)] += 1

        for _ in range(2 * (p - r) - 1):
            run("F", down)
        for _ in range(r):
            run("F", up), run("F", down)
        for _ in range(p - r):
            run("F", up), run("I", up), run("W", up)
        while done[("F", down)] < n or done[("F", up)] < done[("F", down)]:
            if done[("F", down)] < n:
                run("F", down)
            run("I", down), run("W", down), run("F", up), run("I", up), run("W", up)
        for _ in range(r):
            run("I", down), run("I", up)
        for _ in range(p - r):
            run("I", down), run("W", down)
        for stage in (up, down):
            while done[("W", stage)] < n:
                run("W", stage)
        order.append([a for a in ops if a.microbatch < m])
    return with_p2p(order)


def dualpipe_v(p: int, m: int) -> list[list[Action]]:
    """DualPipeV: the V-shaped half of DeepSeek-V3's DualPipe (DeepSeek-AI 2024, §3.2.1; the "cut-in-half"
    schedule of the deepseek-ai/DualPipe repository, ``dualpipev.py``). Two stages per rank in a V, as ZB-V;
    in the steady state each rank alternates a forward of one stage with a full backward of the other, the
    pairs DualPipe overlaps with each other's communication (an MoE's all-to-all) on a GPU; here, with
    nothing to overlap, a pair runs one after the other. Only the fill and the drain split backwards into
    ``I`` and ``W``, the ``W`` s queued and run in the order their ``I`` s ran. Rank ``r``:

    1. ``2(p-r-1)`` forwards of its first stage; 2. ``r+1`` pairs of forwards, first stage then second;
    3. ``p-r-1`` rounds of ``I`` (second stage), the oldest queued ``W``, a forward of the second stage;
    4. ``m - 2p + r + 1`` rounds of forward (first stage), backward (second), forward (second), backward (first);
    5. ``p-r-1`` rounds of backward (second), forward (second), backward (first);
    6. ``r+1`` pairs of backwards, second stage then first, switching to ``I`` half-way;
    7. ``p-r-1`` rounds of a queued ``W`` then an ``I`` of the first stage; 8. the ``r+1`` queued ``W`` s left.

    Needs ``m >= 2p`` (its steady state needs every stage busy), as PyTorch's ``ScheduleDualPipeV``."""
    _check_sizes(p, m)
    if m < 2 * p:
        raise ValueError(f"DualPipeV needs at least 2p = {2 * p} micro-batches for p={p} ranks (its two stages per "
                         f"rank must both reach the steady state), got m={m}")
    order = []
    for r in range(p):
        down, up = r, 2 * p - 1 - r
        forwards, backwards = {down: 0, up: 0}, {down: 0, up: 0}
        queued: list[Action] = []  # weight gradients whose I has run, oldest first
        ops: list[Action] = []

        def forward(stage: int) -> None:
            ops.append(Action("F", forwards[stage], stage))
            forwards[stage] += 1

        def backward(stage: int, split: bool = False) -> None:
            mb = backwards[stage]
            backwards[stage] += 1
            ops.append(Action("I" if split else "B", mb, stage))
            if split:
                queued.append(Action("W", mb, stage))

        def weight() -> None:
            if queued:
                ops.append(queued.pop(0))

        for _ in range(2 * (p - r - 1)):
            forward(down)
        for _ in range(r + 1):
            forward(down), forward(up)
        for _ in range(p - r - 1):
            backward(up, split=True), weight(), forward(up)
        for _ in range(m - 2 * p + r + 1):
            forward(down), backward(up), forward(up), backward(down)
        for _ in range(p - r - 1):
            backward(up), forward(up), backward(down)
        split = False
        for i in range(r + 1):  # the drain: from the middle pair on, the W's wait for the last gaps
            if i == (r + 1) // 2 and r % 2 == 1:
                split = True
            backward(up, split)
            if i == (r + 1) // 2 and r % 2 == 0:
                split = True
            backward(down, split)
        for _ in range(p - r - 1):
            weight(), backward(down, split=True)
        for _ in range(r + 1):
            weight()
        order.append(ops)
    return with_p2p(order)


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b, "zb-h1": zero_bubble_h1,
             "zb-v": zero_bubble_v, "dualpipev": dualpipe_v}
V_SCHEDULES = ("zb-v", "dualpipev")  # two stages per rank, placed in a V


def make_schedule(name: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """``name`` ∈ gpipe | 1f1b | interleaved | zb-h1 | zb-v | dualpipev; ``v`` stages per rank: any for
    interleaved, 2 for the V schedules (zb-v, dualpipev), 1 for the others."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {name!r}")
    if name == "interleaved":
        return interleaved_1f1b(p, m, v)
    if name in V_SCHEDULES:
        if v != 2:
            raise ValueError(f"schedule {name!r} places two stages per rank in a V: pass v=2, got v={v}")
        return SCHEDULES[name](p, m)
    if v != 1:
        raise ValueError(f"schedule {name!r} has one stage per rank; v={v} is only for 'interleaved' (and v=2 for "
                         f"the V schedules {', '.join(V_SCHEDULES)})")
    return SCHEDULES[name](p, m)


def placement_style(name: str) -> str:
    """The placement a named schedule runs on: ``"v"`` for ZB-V and DualPipeV, else ``"looped"``."""
    return "v" if name in V_SCHEDULES else "looped"


# ---------------------------------------------------------------- placement

def stage_placement(p: int, v: int = 1, style: str = "looped") -> tuple[int, ...]:
    """The rank of each of the ``p·v`` stages. ``"looped"``: stage ``s`` on rank ``s % p`` (the ring, ``v``
    times round). ``"v"``: down the ranks and back up (``0, 1, …, p-1, p-1, …, 0``, zig-zagging on for
    ``v > 2``), as PyTorch's ``generate_stage_to_rank_mapping(style="v")``: neighbouring stages are always
    on the same or neighbouring ranks, and with ``v = 2`` the first and the last stage share rank 0."""
    _check_sizes(p, 1, v)
    if style == "looped":
        return tuple(s % p for s in range(p * v))
    if style == "v":
        return tuple(s % p if (s // p) % 2 == 0 else p - 1 - s % p for s in range(p * v))
    raise ValueError(f"placement style must be 'looped' or 'v', got {style!r}")


def placement_of(schedule: Sequence[Sequence[Action]]) -> tuple[int, ...]:
    """The placement a schedule shows: for each stage, the rank whose actions name it. Raises
    :class:`ScheduleError` for a stage named on two ranks or a stage no rank runs."""
    where: dict[int, int] = {}
    for r, ops in enumerate(schedule):
        for a in ops:
            stage = getattr(a, "stage", None)
            if not isinstance(stage, int) or stage < 0:
                raise ScheduleError(f"rank {r}: {a!r} is not an Action of a stage 0, 1, …")
            if where.setdefault(stage, r) != r:
                raise ScheduleError(f"stage {stage} appears on rank {where[stage]} and on rank {r} ({a!r}): a stage "
                                    f"lives on one rank")
    missing = [s for s in range(len(where)) if s not in where]
    if missing or not where:
        raise ScheduleError(f"no rank runs stage {missing[0] if missing else 0}: stages are numbered 0, 1, … "
                            f"without gaps")
    return tuple(where[s] for s in range(len(where)))


def _ranks_of(placement, schedule: Sequence[Sequence[Action]], v: int) -> tuple[int, ...]:
    """``placement`` as a tuple of ranks per stage: a style name, an explicit tuple, or None (read off)."""
    if placement is None:
        return placement_of(schedule)
    if isinstance(placement, str):
        return stage_placement(len(schedule), v, placement)
    return tuple(int(r) for r in placement)


# ---------------------------------------------------------------- communication

def num_stages_of(order: Sequence[Sequence[Action]]) -> int:
    return 1 + max((a.stage for ops in order for a in ops), default=-1)


def with_p2p(order: Sequence[Sequence[Action]], p: int | None = None) -> list[list[Action]]:
    """Insert the sends and receives a compute order needs.

    After ``F`` of a stage whose successor lives on another rank: ``SEND_F``; before ``F`` of a
    stage whose predecessor lives elsewhere: ``RECV_F``; the same backwards for gradients
    (``RECV_B`` before ``B``/``I``, ``SEND_B`` after). Receives are posted just before the
    compute that consumes them and sends right after the compute that produces them; the
    executor posts both without waiting, so only a compute ever waits, and only for its input.
    Where each stage lives is read off the order itself (:func:`placement_of`), so a V needs
    nothing more than a looped schedule. ``p``: the number of ranks, if given, must be ``len(order)``.
    """
    if p is not None and p != len(order):
        raise ScheduleError(f"the order has {len(order)} ranks' actions, not p={p}")
    for r, ops in enumerate(order):
        for a in ops:
            if getattr(a, "kind", None) not in COMPUTE:
                raise ScheduleError(f"rank {r}: with_p2p takes compute actions only, got {a!r}")
    rank_of = placement_of(order)
    last = len(rank_of) - 1
    out = []
    for r, ops in enumerate(order):
        actions = []
        for a in ops:
            before, after = a.stage > 0 and rank_of[a.stage - 1] != r, a.stage < last and rank_of[a.stage + 1] != r
            if a.kind == "F" and before:
                actions.append(Action("RECV_F", a.microbatch, a.stage))
            if a.kind in ("B", "I") and after:
                actions.append(Action("RECV_B", a.microbatch, a.stage))
            actions.append(a)
            if a.kind == "F" and after:
                actions.append(Action("SEND_F", a.microbatch, a.stage))
            if a.kind in ("B", "I") and before:
                actions.append(Action("SEND_B", a.microbatch, a.stage))
        out.append(actions)
    return out


def compute_order(schedule: Sequence[Sequence[Action]]) -> list[list[Action]]:
    """The schedule without its communication actions."""
    return [[a for a in ops if a.kind in COMPUTE] for ops in schedule]


def messages_per_rank(schedule: Sequence[Sequence[Action]]) -> list[int]:
    """How many activations and gradients each rank sends in one step (its ``SEND_F`` and ``SEND_B``)."""
    return [sum(a.kind in ("SEND_F", "SEND_B") for a in ops) for ops in schedule]


def _message(a: Action) -> tuple[str, int, int]:
    """Which tensor a send or receive carries: ("act", mb, receiving stage) or ("grad", mb, receiving stage)."""
    if a.kind == "SEND_F":
        return ("act", a.microbatch, a.stage + 1)
    if a.kind == "RECV_F":
        return ("act", a.microbatch, a.stage)
    if a.kind == "SEND_B":
        return ("grad", a.microbatch, a.stage - 1)
    return ("grad", a.microbatch, a.stage)  # RECV_B


def _neighbour(a: Action) -> int:
    """The stage at the other end of a send or receive."""
    return a.stage + (1 if a.kind in ("SEND_F", "RECV_B") else -1)


# ---------------------------------------------------------------- validation

def validate(schedule: Sequence[Sequence[Action]], m: int, v: int = 1,
             placement: str | Sequence[int] | None = "looped") -> None:
    """Raise :class:`ScheduleError` (naming the rank and action) unless the schedule can run.

    Checks: the stages ``0 … p·v-1`` live where ``placement`` says (``"looped"``: stage ``s`` on rank
    ``s % p``; ``"v"``: :func:`stage_placement`'s V; a tuple: the rank of each stage; None: wherever the
    schedule puts them, one rank per stage); every stage runs ``F`` and either ``B`` or ``I`` + ``W``
    exactly once per micro-batch, in dependency order on its rank; every cross-rank activation and
    gradient is sent once and received once, the sends and receives between two ranks in the same order
    (NCCL matches them by order); and :func:`simulate` finishes (no deadlock).
    """
    p = len(schedule)
    if p < 1:
        raise ScheduleError("the schedule has no ranks")
    stages = p * v
    for r, ops in enumerate(schedule):
        for i, a in enumerate(ops):
            if not isinstance(a, Action):
                raise ScheduleError(f"rank {r}, position {i}: {a!r} is not an Action")
            if a.kind not in COMPUTE + COMMUNICATION:
                raise ScheduleError(f"rank {r}: unknown action kind {a.kind!r} in {a!r}")
            if not 0 <= a.stage < stages:
                raise ScheduleError(f"rank {r}: {a!r} names stage {a.stage}, outside 0..{stages - 1}")
    rank_of = _ranks_of(placement, schedule, v)
    if len(rank_of) != stages:
        raise ScheduleError(f"the placement gives ranks for {len(rank_of)} stages; p={p} ranks x v={v} make {stages}")
    where = "" if placement is None else f" ({placement} placement)" if isinstance(placement, str) else ""
    seen: dict[tuple[str, int, int], int] = {}
    for r, ops in enumerate(schedule):
        position: dict[tuple[str, int, int], int] = {}
        for a in ops:
            if not 0 <= a.microbatch < m:
                raise ScheduleError(f"rank {r}: {a!r} names micro-batch {a.microbatch}, outside 0..{m - 1}")
            if rank_of[a.stage] != r:
                raise ScheduleError(f"rank {r}: {a!r} runs stage {a.stage}, which lives on rank "
                                    f"{rank_of[a.stage]}{where}")
            key = tuple(a)
            if key in seen:
                raise ScheduleError(f"rank {r}: {a!r} appears twice")
            seen[key] = r
            position[key] = len(position)
        _check_dependencies(r, ops, position, rank_of)
    for s in range(stages):
        for mb in range(m):
            if ("F", mb, s) not in seen:
                raise ScheduleError(f"rank {rank_of[s]} never runs {Action('F', mb, s)!r}")
            split = ("I", mb, s) in seen or ("W", mb, s) in seen
            needed = ("I", "W") if split else ("B",)
            for kind in needed:
                if (kind, mb, s) not in seen:
                    raise ScheduleError(f"rank {rank_of[s]} never runs {Action(kind, mb, s)!r}")
            if split and ("B", mb, s) in seen:
                raise ScheduleError(f"rank {rank_of[s]} runs both B and I/W for micro-batch {mb} of stage {s}")
    _check_messages(schedule, rank_of)
    simulate(schedule, m=m, v=v)  # raises on deadlock


def _check_dependencies(r: int, ops, position: dict, rank_of: Sequence[int]) -> None:
    stages = len(rank_of)

    def before(first: tuple, then: tuple, why: str) -> None:
        if first in position and then in position and position[first] > position[then]:
            raise ScheduleError(f"rank {r}: {Action(*then)!r} comes before {Action(*first)!r} ({why})")

    for a in ops:
        mb, s = a.microbatch, a.stage
        if a.kind == "F":
            before(("RECV_F", mb, s), ("F", mb, s), "the forward needs the received activation")
            before(("F", mb, s - 1), ("F", mb, s), "stage s needs stage s-1's output")
        elif a.kind in ("B", "I"):
            before(("F", mb, s), (a.kind, mb, s), "backward needs the forward's saved activations")
            before(("RECV_B", mb, s), (a.kind, mb, s), "the backward needs the received gradient")
            for nxt in ("B", "I"):
                before((nxt, mb, s + 1), (a.kind, mb, s), "stage s needs stage s+1's input gradient")
        elif a.kind == "W":
            before(("I", mb, s), ("W", mb, s), "the weight gradient follows the input gradient")
        elif a.kind == "SEND_F":
            before(("F", mb, s), ("SEND_F", mb, s), "a send needs the forward's output")
        elif a.kind == "SEND_B":
            for kind in ("B", "I"):
                before((kind, mb, s), ("SEND_B", mb, s), "a send needs the input gradient")
        if a.kind in COMMUNICATION:
            other = _neighbour(a)
            if not 0 <= other < stages:
                raise ScheduleError(f"rank {r}: {a!r} has no neighbouring stage to talk to")
            if rank_of[other] == r:
                raise ScheduleError(f"rank {r}: {a!r} would send to itself: stages {s} and {other} share rank {r}, "
                                    f"so no message is needed")
    for a in ops:  # a cross-rank neighbour must be talked to explicitly
        mb, s = a.microbatch, a.stage
        prev = rank_of[s - 1] if s > 0 else r
        nxt = rank_of[s + 1] if s < stages - 1 else r
        if a.kind == "F" and prev != r and ("RECV_F", mb, s) not in position:
            raise ScheduleError(f"rank {r}: {a!r} has no RECV_F: its input comes from rank {prev}")
        if a.kind == "F" and nxt != r and ("SEND_F", mb, s) not in position:
            raise ScheduleError(f"rank {r}: {a!r} is never sent on (no SEND_F): rank {nxt} waits for it")
        if a.kind in ("B", "I") and nxt != r and ("RECV_B", mb, s) not in position:
            raise ScheduleError(f"rank {r}: {a!r} has no RECV_B: its output gradient comes from rank {nxt}")
        if a.kind in ("B", "I") and prev != r and ("SEND_B", mb, s) not in position:
            raise ScheduleError(f"rank {r}: the input gradient of {a!r} is never sent (no SEND_B): rank "
                                f"{prev} waits for it")


def _check_messages(schedule, rank_of: Sequence[int]) -> None:
    sends: dict[tuple[int, int], list] = {}
    recvs: dict[tuple[int, int], list] = {}
    for r, ops in enumerate(schedule):
        for a in ops:
            if a.kind in ("SEND_F", "SEND_B"):
                sends.setdefault((r, rank_of[_neighbour(a)], _message(a)[0]), []).append((_message(a), a))
            elif a.kind in ("RECV_F", "RECV_B"):
                recvs.setdefault((rank_of[_neighbour(a)], r, _message(a)[0]), []).append((_message(a), a))
    for pair in sorted(set(sends) | set(recvs)):
        sent, received = sends.get(pair, []), recvs.get(pair, [])
        for i in range(max(len(sent), len(received))):
            s_msg = sent[i] if i < len(sent) else None
            r_msg = received[i] if i < len(received) else None
            if s_msg is None or r_msg is None or s_msg[0] != r_msg[0]:
                src, dst, kind = pair
                what = "activation" if kind == "act" else "gradient"
                sent_text = (f"rank {src}'s {what} send #{i + 1} to rank {dst} is {s_msg[1]!r}" if s_msg else
                             f"rank {src} sends only {len(sent)} {what}(s) to rank {dst}")
                got = (f"rank {dst}'s {what} receive #{i + 1} from rank {src} is {r_msg[1]!r}" if r_msg else
                       f"rank {dst} receives only {len(received)}")
                raise ScheduleError(f"{sent_text} but {got}: two ranks must post the {what}s they send each other "
                                    f"in the same order (one channel carries them, and NCCL pairs them by position)")


# ---------------------------------------------------------------- simulation

@dataclass
class Simulation:
    """A schedule replayed in unit time: forward ``forward_cost``, backward ``backward_cost``
    per stage (``I`` and ``W`` half of it each), messages free."""

    p: int
    m: int
    v: int
    spans: list = field(default_factory=list)  # distlab.runtime.timeline.Span, one per compute action
    makespan: float = 0.0
    busy: list[float] = field(default_factory=list)  # compute time per rank
    peak_in_flight: list[float] = field(default_factory=list)  # per rank, in whole-rank micro-batches

    @property
    def bubble(self) -> float:
        """Mean idle share of the ranks over the step."""
        return 1.0 - sum(self.busy) / (self.p * self.makespan)

    def trace(self, slot: float = 1e-3, start: float = 0.0, max_events: int = trace_format.DEFAULT_MAX_EVENTS) -> dict:
        """The simulated schedule as a Trace Event Format dict, laid out as a measured run's trace.

        One unit of simulated time lasts ``slot`` seconds (give a measured forward's duration to draw the
        prediction at the measured run's scale), starting at ``start`` seconds; merge it with a real run's
        trace (:func:`distlab.runtime.trace.merge`) to open the predicted and the measured schedule one above
        the other in Perfetto. :func:`distlab.runtime.trace.bubble` reads :attr:`bubble` back from it.
        """
        if not slot > 0:
            raise ValueError(f"slot must be a positive number of seconds, got {slot!r}")
        spans = [Span(s.rank, s.label, s.kind, start + s.start * slot, start + s.end * slot) for s in self.spans]
        return trace_format.build(spans, world_size=self.p, max_events=max_events,
                                  meta={"simulated": True, "p": self.p, "m": self.m, "v": self.v, "slot_s": slot})

    def save_trace(self, path, slot: float = 1e-3, start: float = 0.0):
        """Write :meth:`trace` to ``path`` (ui.perfetto.dev, chrome://tracing); returns the path."""
        return trace_format.save(self.trace(slot, start), path)


def simulate(schedule: Sequence[Sequence[Action]], m: int | None = None, v: int = 1,
             forward_cost: float | Sequence[float] = 1.0, backward_cost: float | Sequence[float] = 2.0,
             durations: Mapping[tuple[str, int, int], float] | None = None, fuse_pairs: bool = False,
             message_cost: float = 0.0) -> Simulation:
    """Replay the schedule in unit time and return its timeline, bubble and peak memory.

    The rules are the executor's: a rank runs its actions in order; a send or a receive is
    posted without waiting; a compute that consumes a message waits until the message has
    arrived, which is once both the send and the receive are posted and every earlier
    message on the same channel (per direction between two ranks, activations and gradients
    apart) has arrived. Costs
    are per stage, so a rank with ``v`` stages costs ``1/v`` of its whole-rank work per stage
    (``I`` and ``W`` half a backward each); give one cost per rank (measured ones, say) to replay
    unequal stages, or ``durations`` — each compute action's own time, by ``(kind, micro-batch,
    stage)`` — to replay a measured step exactly. Where each stage lives is read off the schedule.
    ``message_cost``: the time a message takes from the moment both ends are posted (free by default; give
    a measured transfer time to see what the wire alone adds). ``fuse_pairs``: a forward followed by a full
    backward of another stage runs as one unit that starts
    once both inputs are there — DualPipe's overlapped ``F&B`` pair, as a GPU runs it (the executor here
    runs the two one after the other). Raises :class:`ScheduleError` when no rank can move (a deadlock),
    saying where each waits.
    """
    p = len(schedule)
    m = m if m is not None else 1 + max((a.microbatch for ops in schedule for a in ops), default=0)
    fwd = [float(forward_cost)] * p if isinstance(forward_cost, (int, float)) else [float(c) for c in forward_cost]
    bwd = [float(backward_cost)] * p if isinstance(backward_cost, (int, float)) else [float(c) for c in backward_cost]
    if len(fwd) != p or len(bwd) != p:
        raise ValueError(f"give one forward and one backward cost per rank ({p}), got {len(fwd)} and {len(bwd)}")
    cost = [{"F": f / v, "B": b / v, "I": b / (2 * v), "W": b / (2 * v)} for f, b in zip(fwd, bwd)]
    rank_of = placement_of(schedule)
    last = len(rank_of) - 1
    pair_needs: dict[tuple, Action] = {}  # a fused pair's forward -> the backward whose input it also waits for
    if fuse_pairs:
        schedule, pair_needs = _fused_pairs(schedule)
    pointer, clock = [0] * p, [0.0] * p
    posted: dict[tuple, float] = {}  # (SEND|RECV, message) -> when it was posted
    arrived: dict[tuple, float] = {}  # message -> when the receiver has it
    queue: dict[tuple, list[tuple]] = {}  # channel (src, dst, kind) -> messages the receiver posted, in order
    channel_clock: dict[tuple, float] = {}  # channel -> when its last delivered message arrived
    sim = Simulation(p, m, v, busy=[0.0] * p, peak_in_flight=[0.0] * p)
    in_flight, held = [0.0] * p, {}

    def deliver(channel: tuple) -> None:
        """Deliver, in order, the receiver's posted messages whose send is posted too."""
        pending = queue.get(channel, [])
        while pending and ("SEND", pending[0]) in posted:
            message = pending.pop(0)
            both_posted = max(posted[("SEND", message)], posted[("RECV", message)])
            t = max(both_posted, channel_clock.get(channel, 0.0)) + message_cost
            arrived[message] = channel_clock[channel] = t

    def needed(r: int, a: Action):
        if a.kind == "F" and a.stage > 0 and rank_of[a.stage - 1] != r:
            return ("act", a.microbatch, a.stage)
        if a.kind in ("B", "I") and a.stage < last and rank_of[a.stage + 1] != r:
            return ("grad", a.microbatch, a.stage)
        return None

    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pointer[r] < len(schedule[r]):
                a = schedule[r][pointer[r]]
                if a.kind in COMMUNICATION:
                    message, peer = _message(a), rank_of[_neighbour(a)]
                    side = "SEND" if a.kind.startswith("SEND") else "RECV"
                    posted[(side, message)] = clock[r]
                    channel = (r, peer, message[0]) if side == "SEND" else (peer, r, message[0])
                    if side == "RECV":
                        queue.setdefault(channel, []).append(message)
                    deliver(channel)
                else:
                    message = needed(r, a)
                    if message is not None and message not in arrived:
                        break
                    partner = needed(r, pair_needs[tuple(a)]) if tuple(a) in pair_needs else None
                    if partner is not None and partner not in arrived:
                        break
                    start = max(clock[r], arrived[message] if message is not None else 0.0,
                                arrived[partner] if partner is not None else 0.0)
                    took = durations[tuple(a)] if durations is not None else cost[r][a.kind]
                    clock[r] = start + took
                    sim.busy[r] += took
                    label = f"{a.kind}{a.microbatch}" + (f".{a.stage // p}" if v > 1 else "")
                    sim.spans.append(Span(r, label, "compute", start, clock[r]))
                    if a.kind == "F":
                        held[(a.microbatch, a.stage)] = 1.0 / v
                        in_flight[r] += 1.0 / v
                        sim.peak_in_flight[r] = max(sim.peak_in_flight[r], in_flight[r])
                    elif a.kind in ("B", "W"):
                        in_flight[r] -= held.pop((a.microbatch, a.stage), 0.0)
                pointer[r] += 1
                progress = True
    stuck = [r for r in range(p) if pointer[r] < len(schedule[r])]
    if stuck:
        def waiting(r: int) -> str:
            a = schedule[r][pointer[r]]
            what = "activation" if a.kind == "F" else "output gradient"
            source = rank_of[a.stage - 1] if a.kind == "F" else rank_of[a.stage + 1]
            return f"rank {r} waits to run {a!r} (its {what} from rank {source} never arrives)"

        raise ScheduleError(f"the schedule deadlocks: {'; '.join(map(waiting, stuck))}, and no rank can move")
    sim.makespan = max(clock)
    return sim


def _fused_pairs(schedule: Sequence[Sequence[Action]]) -> tuple[list[list[Action]], dict[tuple, Action]]:
    """The schedule with each overlapped pair (``F`` of one stage, then ``B`` of another, only messages between)
    made one unit: the pair's receives move before its forward, which then waits for the backward's input too."""
    out, needs = [], {}
    for ops in schedule:
        ops, i = list(ops), 0
        while i < len(ops):
            a = ops[i]
            j = next((k for k in range(i + 1, len(ops)) if ops[k].kind in COMPUTE), None)
            if a.kind == "F" and j is not None and ops[j].kind == "B" and ops[j].stage != a.stage:
                between = ops[i + 1:j]
                receives = [c for c in between if c.kind.startswith("RECV")]
                ops[i:j] = receives + [a] + [c for c in between if not c.kind.startswith("RECV")]
                needs[tuple(a)] = ops[j]
                i = j + 1
            else:
                i += 1
        out.append(ops)
    return out, needs


def format_schedule(schedule: Sequence[Sequence[Action]], compute_only: bool = True) -> str:
    """One line per rank, e.g. ``rank 0: 0F0 0F1 0B0 0F2 …``."""
    rows = []
    for r, ops in enumerate(schedule):
        shown = [a for a in ops if a.kind in COMPUTE] if compute_only else list(ops)
        rows.append(f"rank {r}: " + " ".join(map(repr, shown)))
    return "\n".join(rows)


_ACTION = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")


def parse_schedule(text: str | Sequence[str]) -> list[list[Action]]:
    """A schedule written as text: one line (or string) per rank, its actions separated by commas or spaces,
    each written as :class:`Action` prints (``2F0``: stage 2, forward, micro-batch 0; ``3I1``, ``1SEND_F4``).

    The format of torchtitan's ``pipeline_parallel_schedule_csv`` (rows of PyTorch's action strings, one per
    rank; empty cells are idle slots and are skipped). A rank given compute actions only gets its sends and
    receives from :func:`with_p2p`; give them yourself to choose where each receive is posted. Raises
    :class:`ScheduleError` naming the rank and the cell it cannot read (FSDP's ``UNSHARD``/``RESHARD``/
    ``REDUCE_GRAD`` and DualPipe's overlapped pairs have no meaning for this executor: write a pair as two
    actions)."""
    lines = text.strip().splitlines() if isinstance(text, str) else list(text)
    schedule = []
    for r, line in enumerate(lines):
        actions = []
        for cell in re.split(r"[,\s]+", line.strip()):
            if not cell:
                continue
            match = _ACTION.match(cell)
            if match is None:
                raise ScheduleError(f"rank {r}: cannot read {cell!r}: write actions as <stage><kind><micro-batch>, "
                                    f"kind one of {', '.join(COMPUTE + COMMUNICATION)} (e.g. 2F0, 3I1, 1SEND_F4)")
            stage, kind, mb = match.groups()
            actions.append(Action(kind, int(mb), int(stage)))
        schedule.append(actions)
    if all(a.kind in COMPUTE for ops in schedule for a in ops):
        return with_p2p(schedule)
    return schedule


def schedule_csv(schedule: Sequence[Sequence[Action]], compute_only: bool = True) -> str:
    """The schedule as :func:`parse_schedule` reads it: one comma-separated line per rank (compute actions only
    by default, as torchtitan's CSV files hold them)."""
    return "\n".join(",".join(repr(a) for a in ops if not compute_only or a.kind in COMPUTE) for ops in schedule)
