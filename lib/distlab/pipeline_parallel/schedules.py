"""Pipeline schedules as data: each rank's ordered list of actions, checked and simulated before any rank runs.

A schedule for ``p`` ranks is ``list[list[Action]]``: ``schedule[r]`` is what rank ``r``
does in one optimizer step, in order. Stages are numbered globally, ``0 … S-1`` with
``S = p·v`` (``v`` virtual stages per rank, 1 unless interleaved); stage ``s`` lives on
rank ``s % p``. Keeping the schedule a pure function of ``(p, m, v)`` is what lets us

* print it and draw it before running anything (:func:`simulate` replays it in unit time);
* prove it cannot deadlock and that each message meets its receiver in order
  (:func:`validate`) — NCCL pairs the messages of a channel by position, so order matters;
* compute its bubble and its peak in-flight micro-batches exactly, then compare those with
  what a real run measures.

Actions (``Action(kind, microbatch, stage)``, printed like PyTorch's ``1F3``: stage 1, forward, micro-batch 3):

``F``  forward; ``B`` full backward; ``I``/``W`` the backward split into input gradient and
weight gradient (zero-bubble schedules); ``SEND_F``/``RECV_F`` the activation between stage
``s`` and ``s+1``; ``SEND_B``/``RECV_B`` the gradient of that activation travelling back.
Sends and receives are posted without waiting; each direction between two ranks is
its own channel, so a message never queues behind one going the other way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

from distlab.runtime import trace as trace_format
from distlab.runtime.timeline import Span

__all__ = [
    "Action", "COMPUTE", "COMMUNICATION", "ScheduleError", "bubble_fraction", "interleaved_bubble_fraction",
    "peak_in_flight", "interleaved_warmup",
    "gpipe", "one_f_one_b", "interleaved_1f1b", "zero_bubble_h1", "SCHEDULES", "make_schedule", "with_p2p",
    "compute_order", "num_stages_of", "validate", "Simulation", "simulate", "format_schedule",
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

    ``v ≥ 2``: Megatron-LM's ``2(p-r-1) + (v-1)·p`` (one warm-up per rank fewer, ``(p-r-1) + (v-1)·p``, has
    the same unit-time bubble but :func:`validate` finds its sends and receives out of order at ``p = 2``).
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


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b, "zb-h1": zero_bubble_h1}


def make_schedule(name: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """``name`` ∈ gpipe | 1f1b | interleaved | zb-h1; ``v`` only for interleaved."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {name!r}")
    if name == "interleaved":
        return interleaved_1f1b(p, m, v)
    if v != 1:
        raise ValueError(f"schedule {name!r} has one stage per rank; v={v} is only for 'interleaved'")
    return SCHEDULES[name](p, m)


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
    """
    p = len(order) if p is None else p
    stages = num_stages_of(order)
    out = []
    for r, ops in enumerate(order):
        actions = []
        for a in ops:
            if a.kind not in COMPUTE:
                raise ScheduleError(f"rank {r}: with_p2p takes compute actions only, got {a!r}")
            if a.kind == "F" and a.stage > 0 and (a.stage - 1) % p != r:
                actions.append(Action("RECV_F", a.microbatch, a.stage))
            if a.kind in ("B", "I") and a.stage < stages - 1 and (a.stage + 1) % p != r:
                actions.append(Action("RECV_B", a.microbatch, a.stage))
            actions.append(a)
            if a.kind == "F" and a.stage < stages - 1 and (a.stage + 1) % p != r:
                actions.append(Action("SEND_F", a.microbatch, a.stage))
            if a.kind in ("B", "I") and a.stage > 0 and (a.stage - 1) % p != r:
                actions.append(Action("SEND_B", a.microbatch, a.stage))
        out.append(actions)
    return out


def compute_order(schedule: Sequence[Sequence[Action]]) -> list[list[Action]]:
    """The schedule without its communication actions."""
    return [[a for a in ops if a.kind in COMPUTE] for ops in schedule]


def _message(a: Action) -> tuple[str, int, int]:
    """Which tensor a send or receive carries: ("act", mb, receiving stage) or ("grad", mb, receiving stage)."""
    if a.kind == "SEND_F":
        return ("act", a.microbatch, a.stage + 1)
    if a.kind == "RECV_F":
        return ("act", a.microbatch, a.stage)
    if a.kind == "SEND_B":
        return ("grad", a.microbatch, a.stage - 1)
    return ("grad", a.microbatch, a.stage)  # RECV_B


def _peer(a: Action, p: int) -> int:
    """The rank at the other end of a send or receive."""
    return (a.stage + (1 if a.kind in ("SEND_F", "RECV_B") else -1)) % p


# ---------------------------------------------------------------- validation

def validate(schedule: Sequence[Sequence[Action]], m: int, v: int = 1) -> None:
    """Raise :class:`ScheduleError` (naming the rank and action) unless the schedule can run.

    Checks: ``len(schedule)`` ranks own stages ``r, r+p, …``; every stage runs ``F`` and
    either ``B`` or ``I`` + ``W`` exactly once per micro-batch, in dependency order on its
    rank; every cross-rank activation and gradient is sent once and received once, the
    sends and receives between two ranks in the same order (NCCL matches them by order);
    and :func:`simulate` finishes (no deadlock).
    """
    p = len(schedule)
    if p < 1:
        raise ScheduleError("the schedule has no ranks")
    stages = p * v
    seen: dict[tuple[str, int, int], int] = {}
    for r, ops in enumerate(schedule):
        position: dict[tuple[str, int, int], int] = {}
        for i, a in enumerate(ops):
            if not isinstance(a, Action):
                raise ScheduleError(f"rank {r}, position {i}: {a!r} is not an Action")
            if a.kind not in COMPUTE + COMMUNICATION:
                raise ScheduleError(f"rank {r}: unknown action kind {a.kind!r} in {a!r}")
            if not 0 <= a.microbatch < m:
                raise ScheduleError(f"rank {r}: {a!r} names micro-batch {a.microbatch}, outside 0..{m - 1}")
            if not 0 <= a.stage < stages:
                raise ScheduleError(f"rank {r}: {a!r} names stage {a.stage}, outside 0..{stages - 1}")
            if a.stage % p != r:
                raise ScheduleError(f"rank {r}: {a!r} runs stage {a.stage}, which lives on rank {a.stage % p}")
            key = tuple(a)
            if key in seen:
                raise ScheduleError(f"rank {r}: {a!r} appears twice")
            seen[key] = r
            position[key] = i
        _check_dependencies(r, ops, position, p, stages)
    for s in range(stages):
        for mb in range(m):
            if ("F", mb, s) not in seen:
                raise ScheduleError(f"rank {s % p} never runs {Action('F', mb, s)!r}")
            split = ("I", mb, s) in seen or ("W", mb, s) in seen
            needed = ("I", "W") if split else ("B",)
            for kind in needed:
                if (kind, mb, s) not in seen:
                    raise ScheduleError(f"rank {s % p} never runs {Action(kind, mb, s)!r}")
            if split and ("B", mb, s) in seen:
                raise ScheduleError(f"rank {s % p} runs both B and I/W for micro-batch {mb} of stage {s}")
    _check_messages(schedule, p)
    simulate(schedule, m=m, v=v)  # raises on deadlock


def _check_dependencies(r: int, ops, position: dict, p: int, stages: int) -> None:
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
            peer = _peer(a, p)
            if peer == r:
                raise ScheduleError(f"rank {r}: {a!r} would send to itself: stages {s} and its neighbour share "
                                    f"rank {r}, so no message is needed")
            if (a.kind in ("SEND_F", "RECV_B") and s == stages - 1) or (a.kind in ("SEND_B", "RECV_F") and s == 0):
                raise ScheduleError(f"rank {r}: {a!r} has no neighbouring stage to talk to")
    for a in ops:  # a cross-rank neighbour must be talked to explicitly
        mb, s = a.microbatch, a.stage
        if a.kind == "F" and s > 0 and (s - 1) % p != r and ("RECV_F", mb, s) not in position:
            raise ScheduleError(f"rank {r}: {a!r} has no RECV_F: its input comes from rank {(s - 1) % p}")
        if a.kind == "F" and s < stages - 1 and (s + 1) % p != r and ("SEND_F", mb, s) not in position:
            raise ScheduleError(f"rank {r}: {a!r} is never sent on (no SEND_F): rank {(s + 1) % p} waits for it")
        if a.kind in ("B", "I") and s < stages - 1 and (s + 1) % p != r and ("RECV_B", mb, s) not in position:
            raise ScheduleError(f"rank {r}: {a!r} has no RECV_B: its output gradient comes from rank {(s + 1) % p}")
        if a.kind in ("B", "I") and s > 0 and (s - 1) % p != r and ("SEND_B", mb, s) not in position:
            raise ScheduleError(f"rank {r}: the input gradient of {a!r} is never sent (no SEND_B): rank "
                                f"{(s - 1) % p} waits for it")


def _check_messages(schedule, p: int) -> None:
    sends: dict[tuple[int, int], list] = {}
    recvs: dict[tuple[int, int], list] = {}
    for r, ops in enumerate(schedule):
        for a in ops:
            if a.kind in ("SEND_F", "SEND_B"):
                sends.setdefault((r, _peer(a, p)), []).append((_message(a), a))
            elif a.kind in ("RECV_F", "RECV_B"):
                recvs.setdefault((_peer(a, p), r), []).append((_message(a), a))
    for pair in sorted(set(sends) | set(recvs)):
        sent, received = sends.get(pair, []), recvs.get(pair, [])
        for i in range(max(len(sent), len(received))):
            s_msg = sent[i] if i < len(sent) else None
            r_msg = received[i] if i < len(received) else None
            if s_msg is None or r_msg is None or s_msg[0] != r_msg[0]:
                src, dst = pair
                what = (f"rank {src}'s send #{i + 1} to rank {dst} is {s_msg[1]!r}" if s_msg else
                        f"rank {src} sends only {len(sent)} message(s) to rank {dst}")
                got = (f"rank {dst}'s receive #{i + 1} from rank {src} is {r_msg[1]!r}" if r_msg else
                       f"rank {dst} receives only {len(received)}")
                raise ScheduleError(f"{what} but {got}: two ranks must post their sends and receives to each "
                                    f"other in the same order (NCCL pairs them by position)")


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
             message_cost: float = 0.0) -> Simulation:
    """Replay the schedule in unit time and return its timeline, bubble and peak memory.

    The rules are the executor's: a rank runs its actions in order; a send or a receive is
    posted without waiting; a compute that consumes a message waits until the message has
    arrived, which is ``message_cost`` after both the send and the receive are posted and every
    earlier message on the same channel (one per direction between two ranks) has arrived. Costs
    are per stage, so an interleaved rank's stage costs ``1/v`` of its whole-rank work; give
    one cost per rank (measured ones, say) to replay unequal stages. Raises :class:`ScheduleError`
    when no rank can move (a deadlock), saying where each waits.
    """
    p = len(schedule)
    m = m if m is not None else 1 + max((a.microbatch for ops in schedule for a in ops), default=0)
    fwd = [float(forward_cost)] * p if isinstance(forward_cost, (int, float)) else [float(c) for c in forward_cost]
    bwd = [float(backward_cost)] * p if isinstance(backward_cost, (int, float)) else [float(c) for c in backward_cost]
    if len(fwd) != p or len(bwd) != p:
        raise ValueError(f"give one forward and one backward cost per rank ({p}), got {len(fwd)} and {len(bwd)}")
    cost = [{"F": f / v, "B": b / v, "I": b / (2 * v), "W": b / (2 * v)} for f, b in zip(fwd, bwd)]
    pointer, clock = [0] * p, [0.0] * p
    posted: dict[tuple, float] = {}  # (SEND|RECV, message) -> when it was posted
    arrived: dict[tuple, float] = {}  # message -> when the receiver has it
    queue: dict[tuple[int, int], list[tuple]] = {}  # channel (src, dst) -> messages posted by the receiver, in order
    channel_clock: dict[tuple[int, int], float] = {}  # channel -> when its last delivered message arrived
    sim = Simulation(p, m, v, busy=[0.0] * p, peak_in_flight=[0.0] * p)
    in_flight, held = [0.0] * p, {}

    def deliver(channel: tuple[int, int]) -> None:
        """Deliver, in order, the receiver's posted messages whose send is posted too."""
        pending = queue.get(channel, [])
        while pending and ("SEND", pending[0]) in posted:
            message = pending.pop(0)
            ready = max(posted[("SEND", message)], posted[("RECV", message)], channel_clock.get(channel, 0.0))
            t = ready + message_cost
            arrived[message] = channel_clock[channel] = t

    def needed(r: int, a: Action):
        if a.kind == "F" and a.stage > 0 and (a.stage - 1) % p != r:
            return ("act", a.microbatch, a.stage)
        if a.kind in ("B", "I") and a.stage < p * v - 1 and (a.stage + 1) % p != r:
            return ("grad", a.microbatch, a.stage)
        return None

    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pointer[r] < len(schedule[r]):
                a = schedule[r][pointer[r]]
                if a.kind in COMMUNICATION:
                    message, peer = _message(a), _peer(a, p)
                    side = "SEND" if a.kind.startswith("SEND") else "RECV"
                    posted[(side, message)] = clock[r]
                    channel = (r, peer) if side == "SEND" else (peer, r)
                    if side == "RECV":
                        queue.setdefault(channel, []).append(message)
                    deliver(channel)
                else:
                    message = needed(r, a)
                    if message is not None and message not in arrived:
                        break
                    start = max(clock[r], arrived[message] if message is not None else 0.0)
                    clock[r] = start + cost[r][a.kind]
                    sim.busy[r] += cost[r][a.kind]
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
        where = "; ".join(f"rank {r} waits to run {schedule[r][pointer[r]]!r}" for r in stuck)
        raise ScheduleError(f"the schedule deadlocks: {where}, and no rank can move")
    sim.makespan = max(clock)
    return sim


def format_schedule(schedule: Sequence[Sequence[Action]], compute_only: bool = True) -> str:
    """One line per rank, e.g. ``rank 0: 0F0 0F1 0B0 0F2 …``."""
    rows = []
    for r, ops in enumerate(schedule):
        shown = [a for a in ops if a.kind in COMPUTE] if compute_only else list(ops)
        rows.append(f"rank {r}: " + " ".join(map(repr, shown)))
    return "\n".join(rows)
