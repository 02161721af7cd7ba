"""The run card: what the run measured, beside what the planner predicted for it before it ran, and who is to blame
where they disagree.

A planner is only worth its predictions, and a prediction only worth the measurement it was checked against. So
the machine is calibrated first (:func:`distlab.parallel3d.calibration.calibrate`: each stage's pieces at the model's
shapes while every rank computes, the collectives' α and β, the optimizer), the planner
(:mod:`distlab.parallel3d.planner`) predicts the chosen layout on it, and after the run :func:`derive_report` reads
the same quantities off the run's own records and trace. :func:`card_rows` puts each pair side by side with its
ratio, under one rule for every figure (:data:`OFF_BY`); where the step time misses, :func:`responsible_term`
compares the step's terms (forward and backward, bubble, after the schedule) measured against predicted and names
the one that moved most — a term of the model, not "noise".
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass

from distlab.flops import mfu
from distlab.parallel3d.planner import Estimate, Layout, Plan, bytes_per_axis
from distlab.pipeline_parallel import STAGE_WORK, trace_bubble
from distlab.runtime import trace as trace_format

__all__ = ["runnable", "runnable_best", "stage_trace", "derive_report", "measured_terms", "responsible_term", "RunCard",
           "card_rows", "OFF_BY", "BAND"]

OFF_BY = 0.25  # a measurement below (1 − OFF_BY) × or above 1/(1 − OFF_BY) × its prediction is OFF: within a third
BAND = (1 - OFF_BY, 1 / (1 - OFF_BY))  # 0.75 … 1.33, the same for every figure of the card


def runnable(layout: Layout) -> bool:
    """Whether the capstone's worker runs ``layout``: DP × PP × TP, DDP or ZeRO-1, plain 1F1B, no recomputation."""
    return (layout.cp == layout.ep == layout.v == 1 and layout.zero <= 1 and not layout.checkpointing
            and not layout.keep_grads and not layout.keep_weights)


def runnable_best(result: Plan, axes: tuple[str, ...] = ()) -> Estimate:
    """The planner's fastest feasible layout among those the worker runs — with each of ``axes`` (``"dp"``, ``"pp"``,
    ``"tp"``) at least 2 when given; a one-line error with the nearest misses' reasons when none fits."""
    def wanted(layout: Layout) -> bool:
        return runnable(layout) and all(getattr(layout, axis) >= 2 for axis in axes)

    for estimate in result.feasible:
        if wanted(estimate.layout):
            return estimate
    misses = [e for e in result.near_misses if wanted(e.layout)][:2]
    why = "; ".join(f"{e.layout}: {'; '.join(e.reasons)}" for e in misses) or "no layout splits the batch"
    with_axes = f" with {' and '.join(a.upper() for a in axes)} at least 2" if axes else ""
    raise ValueError(f"no layout the capstone runs{with_axes} fits {result.cluster.name} with {result.global_batch} "
                     f"sequences: {why}")


_CARD_SLICES = re.compile(rf"step\d+$|{STAGE_WORK[1:]}")


def stage_trace(trace: dict) -> dict:
    """The part of a run's trace the card reads: each rank's ``step<k>`` slices and its forward and backward slices,
    with the trace's metadata. :func:`~distlab.pipeline_parallel.trace_bubble` reads the whole trace it is given on
    every call, once per step, and the communication slices are most of a run's trace: given this instead, the card
    of a 40-step run on 8 ranks is read in a fraction of the time, with the same figures."""
    keep = [e for e in trace["traceEvents"] if e.get("ph") == "M" or (e.get("ph") == "X"
                                                                      and _CARD_SLICES.match(e.get("name", "")))]
    return {**trace, "traceEvents": keep}


def _median_over_steps(records, steps, value) -> float:
    """Median over ``steps`` of the slowest rank's ``value(record, step)``: a step ends when its last rank does."""
    return statistics.median(max(value(r, k) for r in records) for k in steps)


def _steps(records, skip: int) -> list[int]:
    steps = sorted(records[0]["step_times"])
    if len(steps) <= skip:
        raise ValueError(f"{len(steps)} step(s) recorded: nothing left after skipping the first {skip}")
    return steps[skip:]


def derive_report(records, trace: dict, flops_per_token: float, tokens_per_step: int, peak_flops: float,
                  skip: int = 1) -> dict:
    """The run's figures from its own records (what every rank's worker returned) and its trace, over the steps
    after the first ``skip`` (the first pays for allocation and warm-up): the step time (median over steps of the
    slowest rank), tokens/s of the whole job, MFU against every rank's peak, the bubble (median over steps of the
    busiest rank's idle share, :func:`~distlab.pipeline_parallel.trace_bubble`) and the payload each axis carries per
    step (the message sizes handed to the collectives and sends: median over steps of the most any rank handed)."""
    steps = _steps(records, skip)
    trace = stage_trace(trace)
    step_time = _median_over_steps(records, steps, lambda r, k: r["step_times"][k])
    rate = tokens_per_step / step_time
    return {"step_time": step_time, "tokens_per_second": rate,
            "mfu": mfu(flops_per_token, rate / len(records), peak_flops),
            "bubble": statistics.median(trace_bubble(trace, step=k).fraction for k in steps),
            "bytes": {axis: _median_over_steps(records, steps, lambda r, k, a=axis: r["bytes"][k][a])
                      for axis in ("dp", "pp", "tp")}}


def measured_terms(records, trace: dict, skip: int = 1) -> dict[str, float]:
    """The step split as :meth:`~distlab.parallel3d.planner.Estimate.terms` splits the prediction, in seconds, from
    the trace: ``forward and backward`` (the busiest rank's forward and backward spans in a step, its TP collectives
    inside), ``bubble`` (its idle share of the step's stage work, times the step) and ``after the schedule`` (what
    remains of the step time: the DP collectives, the clipping, the optimizer)."""
    steps = _steps(records, skip)
    trace = stage_trace(trace)
    step_time = _median_over_steps(records, steps, lambda r, k: r["step_times"][k])
    everything = trace_format.slices(trace)
    work = [s for s in everything if s.cat == "compute" and re.match(STAGE_WORK, s.name)]
    marks = {(s.rank, s.name): s for s in everything if s.name.startswith("step")}
    compute = []
    for k in steps:
        busy = {}
        for s in work:
            mark = marks.get((s.rank, f"step{k}"))
            if mark is not None and mark.start <= s.start <= mark.end:
                busy[s.rank] = busy.get(s.rank, 0.0) + (s.end - s.start)
        compute.append(max(busy.values()))
    bubble = statistics.median(trace_bubble(trace, step=k).fraction for k in steps)
    work_time = statistics.median(compute)
    bubble_time = work_time * bubble / (1 - bubble)
    return {"forward and backward": work_time, "bubble": bubble_time,
            "after the schedule": max(0.0, step_time - work_time - bubble_time)}


_WHY = {
    "forward and backward": "the busiest rank computed at {speed:.2f}× the time the calibration measured for its "
                            "pieces (the block, the output layer and the loss, the embeddings, each while every rank "
                            "computed): the machine's load moved since it was calibrated — calibrate(..., "
                            "refresh=True) measures it again — or its ranks shared the cores otherwise than the "
                            "schedule's replay assumed",
    "bubble": "the busiest rank waited {speed:.2f}× what the replayed schedule makes it wait: a message between "
              "stages, or a neighbour stage slowed by the cores it shares, arrived later than predicted",
    "after the schedule": "the DP collectives, the clipping's all-reduces and the optimizer took {speed:.2f}× their "
                          "calibrated time: gloo's α and β at these sizes, measured while every group sent at once, "
                          "or the optimizer's per-parameter cost",
}

_WHY_ASSUMED = {
    "forward and backward": "the planner assumed {assumed:.0%} of the peak for every matmul (matmul_efficiency), and "
                            "the run reached {achieved:.0%}: small matrices, and the rest of a layer's work "
                            "(softmax, LayerNorm, the loss) that the 6·N FLOPs do not count — calibrate the machine",
    "bubble": "the stages are not equal (the last one also computes the output layer and the loss), so the busiest "
              "rank waits less or more than (p−1)/(m+p−1) of an even split",
    "after the schedule": "gloo's per-call overhead, the optimizer and the clipping, which the α–β model of the "
                          "collectives alone does not price",
}


def responsible_term(measured: dict[str, float], predicted: dict[str, float], calibrated: bool = True,
                     matmul_efficiency: float = 0.7) -> str:
    """The term whose measured seconds differ most from the predicted ones, with its likely cause in words
    (``calibrated=False``: a prediction at an assumed ``matmul_efficiency``)."""
    term = max(measured, key=lambda k: abs(measured[k] - predicted[k]))
    speed = measured[term] / predicted[term] if predicted[term] else float("inf")
    key = "forward and backward"
    achieved = matmul_efficiency * predicted[key] / measured[key] if measured[key] else 0.0
    what = (_WHY if calibrated else _WHY_ASSUMED)[term].format(speed=speed, achieved=achieved,
                                                               assumed=matmul_efficiency)
    return (f"{term} ({measured[term] * 1e3:.1f} ms measured against {predicted[term] * 1e3:.1f} ms predicted): "
            f"{what}")


@dataclass(frozen=True)
class RunCard:
    """One figure of the run card: measured, predicted, their ratio, and whether it is within :data:`BAND`."""

    figure: str
    measured: float
    predicted: float
    unit: str

    @property
    def ratio(self) -> float:
        return self.measured / self.predicted if self.predicted else float("inf")

    @property
    def within(self) -> bool:
        return BAND[0] <= self.ratio <= BAND[1] if self.predicted else self.measured == 0

    def __str__(self) -> str:
        return self.line()

    def line(self, ratio: float | None = None) -> str:
        """The row as the card prints it; ``ratio``: another ratio to show and judge (a median over runs)."""
        scale, unit = {"ms": (1e3, "ms"), "bytes": (1, "B"), "MB": (1e-6, "MB"), "": (1, "")}[self.unit]
        ratio = self.ratio if ratio is None else ratio
        within = BAND[0] <= ratio <= BAND[1] if self.predicted else self.within
        shown = f"{ratio:5.2f}" if self.predicted else "    -"
        return (f"{self.figure:<36s} {self.measured * scale:>12,.4g} {unit:<3s} {self.predicted * scale:>12,.4g} "
                f"{unit:<3s} {shown}  {'ok' if within else 'OFF'}")


def card_rows(report: dict, memory: dict, estimate: Estimate, model, bytes_per_value: int = 4) -> list[RunCard]:
    """The run card's rows: step time, MFU, the pipeline bubble (with a pipeline), the payload of each axis per
    step and the memory of the model states per rank, measured (``report`` from :func:`derive_report`, ``memory`` the
    worker's byte counts of the busiest rank) against ``estimate``. Payload is the message sizes, as the comm log
    counts them and :func:`~distlab.parallel3d.planner.bytes_per_axis` predicts them, for the worker as it runs
    (fp32 values, no sequence parallelism): a ZeRO-1 step hands its DP group the gradients (reduce-scatter) and the
    weights (all-gather), so the DP payload is twice the weights' bytes while each rank *sends* (N−1)/N of each."""
    predicted_bytes = bytes_per_axis(model, estimate.layout, sequence_parallel=False, bytes_per_value=bytes_per_value)
    rows = [RunCard("step time", report["step_time"], estimate.step_time, "ms"),
            RunCard("MFU", report["mfu"], estimate.mfu, "")]
    if estimate.layout.pp > 1:
        rows.append(RunCard("pipeline bubble", report["bubble"], estimate.bubble, ""))
    rows += [RunCard(f"{axis.upper()} payload per step (message sizes)", report["bytes"][axis], predicted_bytes[axis],
                     "bytes") for axis in ("dp", "pp", "tp")]
    states = estimate.memory["params"] + estimate.memory["grads"] + estimate.memory["optimizer"]
    rows.append(RunCard("memory per rank (states)", sum(memory.values()), states, "MB"))
    return rows
