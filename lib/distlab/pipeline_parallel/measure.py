"""Reading the bubble off a real timeline, and drawing it.

Every rank's idle share is measured over one window common to all ranks — from the first
compute of any rank to the last compute of any rank — because the bubble *is* the time the
last stage waits before its first forward and the first stage waits after its last
backward; measuring each rank from its own first to its own last span would hide exactly that.

Real stages are never exactly equal (the last one also runs the LM head and the loss, and
two cores never run at quite the same speed), and a pipeline moves at the pace of its
slowest stage: the faster stages also wait for it on every micro-batch. That waiting is
*imbalance*, not bubble. The busiest stage never waits for a slower one, so its idle share
is the fill and drain alone — the bubble the schedule costs, the quantity
``(p-1)/(m+p-1)`` predicts. :class:`Bubble` reports both.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

from distlab.pipeline_parallel.schedules import COMPUTE, Action, Simulation, simulate
from distlab.runtime import trace as trace_format
from distlab.runtime.timeline import Span, idle_fraction

__all__ = ["PHASE_COLORS", "compute_spans", "step_spans", "Bubble", "measured_bubble", "StepsBubble", "steps_bubble",
           "plot_pipeline", "STAGE_WORK", "trace_bubble", "measured_stage_times", "replay"]

PHASE_COLORS = {"F": "#4C72B0", "B": "#55A868", "I": "#55A868", "W": "#8C9E3F"}


def compute_spans(spans: Sequence[Span]) -> list[Span]:
    """The executor's forward/backward spans (labels ``F3``, ``B3``, ``I3``, ``W3``, ``F3.1`` …)."""
    return [s for s in spans if s.kind == "compute" and s.label[:1] in PHASE_COLORS and s.label[1:2].isdigit()]


def step_spans(spans: Sequence[Span], step: int) -> list[Span]:
    """Compute spans of step ``step``: those inside each rank's ``step{step}`` marker span."""
    markers = {s.rank: s for s in spans if s.label == f"step{step}"}
    if not markers:
        raise KeyError(f"no span labelled 'step{step}' in this run")
    return [s for s in compute_spans(spans)
            if s.rank in markers and markers[s.rank].start <= s.start <= markers[s.rank].end]


def measured_stage_times(spans: Sequence[Span], ranks: int, v: int = 1) -> dict[str, list[float]]:
    """Each rank's median forward (``"F"``) and backward (``"B"``; ``"I"`` and ``"W"`` too where the backward
    was split) span, in seconds, as whole-rank work: a rank's span is one of its ``v`` stages, so its work per
    micro-batch is ``v`` times that span. Medians, so one span stretched by the operating system does not move
    the figure. Only the kinds the spans hold are reported."""
    work = compute_spans(spans)
    kinds = [k for k in "FBIW" if any(s.label[0] == k for s in work)]
    return {kind: [v * statistics.median(s.duration for s in work if s.rank == r and s.label[0] == kind)
                   for r in range(ranks)] for kind in kinds}


def replay(spans: Sequence[Span], schedule: Sequence[Sequence[Action]], m: int, v: int = 1,
           message_cost: float = 0.0) -> Simulation:
    """The step an ideal executor would have run with these spans' own compute: every forward and backward of
    one step (``spans``, e.g. :func:`step_spans`) takes the time it took, and starts as soon as its rank is free
    and its input there, messages costing nothing (:func:`~distlab.pipeline_parallel.schedules.simulate` with
    ``durations``). Its bubble is what the schedule costs at the measured, unequal and jittery compute; a
    measured bubble above it is the executor's own cost (Python between actions, messages in flight, a
    receive posted late), not the schedule's; ``message_cost`` (seconds per message, a measured transfer
    time) charges the wire, so what remains above that replay is the executor's alone. Each rank's spans,
    in time order, are its schedule's computes."""
    durations = {}
    for r, ops in enumerate(schedule):
        computes = [a for a in ops if a.kind in COMPUTE]
        own = sorted((s for s in compute_spans(spans) if s.rank == r), key=lambda s: s.start)
        if len(own) != len(computes):
            raise ValueError(f"rank {r} has {len(own)} compute spans in this step but its schedule {len(computes)} "
                             f"computes: give one step's spans (step_spans) of a run of this schedule")
        for a, s in zip(computes, own):
            if s.label.split(".")[0] != f"{a.kind}{a.microbatch}":
                raise ValueError(f"rank {r}: span {s.label!r} is where the schedule runs {a!r}: these spans are not "
                                 f"this schedule's")
            durations[tuple(a)] = s.duration
    return simulate(schedule, m, v, durations=durations, message_cost=message_cost)


# Each rank's idle share over one window common to all ranks; ``bottleneck``, ``fraction`` (the bubble) and
# ``mean_idle`` (bubble plus imbalance). One class for spans and traces alike.
Bubble = trace_format.TraceBubble


def measured_bubble(spans: Sequence[Span], ranks: int | None = None) -> Bubble:
    """Idle share of every rank between the first and the last compute span of any rank.

    Uses :func:`distlab.runtime.timeline.idle_fraction` on each rank's compute spans plus two
    zero-length marks at the common window's ends (so "the rank's wall time" is the
    pipeline's, not the rank's own).
    """
    work = compute_spans(spans)
    if not work:
        raise ValueError("no forward/backward spans to measure: did the executor record spans?")
    start, end = min(s.start for s in work), max(s.end for s in work)
    ranks = ranks if ranks is not None else 1 + max(s.rank for s in work)
    per_rank = []
    for r in range(ranks):
        marks = [Span(r, "window", "idle", start, start), Span(r, "window", "idle", end, end)]
        per_rank.append(idle_fraction([s for s in work if s.rank == r] + marks, r))
    return Bubble(tuple(per_rank), end - start)


STAGE_WORK = r"^[FBIW]\d"  # the executor's compute spans (F3, B3, I3, W3, F3.1 …), as a regex on slice names


def trace_bubble(trace: dict, step: int | None = None, source: str | None = None) -> trace_format.TraceBubble:
    """The bubble read off a trace (a run's, a saved file's, or a :class:`Simulation`'s): forward and backward
    slices only, inside each rank's ``step{step}`` slice when ``step`` is given. The same quantity as
    :func:`measured_bubble` of the run's spans (one common window; the busiest rank's idle share)."""
    return trace_format.bubble(trace, within=None if step is None else f"step{step}", select=STAGE_WORK,
                               source=source)


@dataclass(frozen=True)
class StepsBubble:
    """The bubble of a run over several steps: medians, with one bottleneck rank for all steps."""

    fraction: float  # median over steps of the bottleneck rank's idle share: the bubble
    mean_idle: float  # median over steps of the idle share averaged over ranks: bubble + imbalance
    bottleneck: int  # the rank that computed the most over all steps
    per_step: tuple[float, ...]  # the bottleneck rank's idle share in each step


def steps_bubble(spans: Sequence[Span], steps: Sequence[int], ranks: int) -> StepsBubble:
    """Measure the bubble over ``steps`` (``step{k}`` markers), choosing the bottleneck once.

    Picking the least idle rank in each step separately would pick noise: the minimum of
    several jittery values is biased low. The rank that computed the most over all the
    steps is the slowest stage; its idle share in each step is that step's bubble.
    """
    bubbles = [measured_bubble(step_spans(spans, k), ranks) for k in steps]
    busy = [sum((1 - b.per_rank[r]) * b.window for b in bubbles) for r in range(ranks)]
    bottleneck = max(range(ranks), key=busy.__getitem__)
    per_step = tuple(b.per_rank[bottleneck] for b in bubbles)
    return StepsBubble(statistics.median(per_step), statistics.median(b.mean_idle for b in bubbles), bottleneck,
                       per_step)


def plot_pipeline(spans: Sequence[Span], ax=None, title: str | None = None, unit: str = "ms", label_bars: bool = True):
    """Pipeline Gantt chart: a row per rank, forwards blue, backwards green, idle grey.

    Each bar is labelled with its micro-batch (``3``, or ``3.1`` for micro-batch 3 on the
    rank's second virtual stage). ``unit="slots"`` for simulated timelines in unit time.
    """
    import matplotlib.pyplot as plt  # noqa: PLC0415  matplotlib is heavy and only the plot needs it
    from matplotlib.patches import Patch  # noqa: PLC0415  matplotlib is heavy and only the plot needs it

    work = compute_spans(spans)
    ranks = sorted({s.rank for s in work})
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.6 + 0.5 * len(ranks)))
    scale = 1e3 if unit == "ms" else 1.0
    t0 = min(s.start for s in work)
    t1 = max(s.end for s in work)
    for r in ranks:
        ax.barh(r, (t1 - t0) * scale, left=0, height=0.8, color="#E6E6E6", edgecolor="none")
    for s in work:
        left, width = (s.start - t0) * scale, s.duration * scale
        ax.barh(s.rank, width, left=left, height=0.8, color=PHASE_COLORS[s.label[0]], edgecolor="white", linewidth=0.5)
        if label_bars and width > 0.025 * (t1 - t0) * scale:
            ax.text(left + width / 2, s.rank, s.label[1:], ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(ranks)
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlim(0, (t1 - t0) * scale)
    ax.set_xlabel("time (ms)" if unit == "ms" else "time (forward slots)")
    kinds = sorted({s.label[0] for s in work}, key="FBIW".index)
    names = {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad"}
    handles = [Patch(color=PHASE_COLORS[k], label=names[k]) for k in kinds] + [Patch(color="#E6E6E6", label="idle")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    if title:
        ax.set_title(title, fontsize=10)
    return ax
