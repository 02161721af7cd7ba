"""The run card: what the run measured, beside what the planner predicted for it, and who is to blame where they
disagree.

A planner is only worth its predictions, and a prediction only worth the measurement it was checked against. So
the machine is measured first (:func:`measure_cluster`: the matmul rate each rank gets while all of them compute,
gloo's latency and bandwidth), the planner (:mod:`distlab.parallel3d.planner`, unchanged) predicts the chosen
layout on it, and after the run :func:`derive_report` reads the same quantities off the run's own records and
trace. :func:`card_rows` puts each pair side by side with its ratio; where the step time is off by more than 25%,
:func:`responsible_term` compares the step's terms (compute, pipeline bubble, communication and the rest) measured
against predicted and names the one that moved most — a term of the model, not "noise".
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass

import torch.distributed as dist

from distlab.collectives import bandwidth_sweep
from distlab.flops import measure_matmul_peak, mfu
from distlab.parallel3d.planner import Cluster, Estimate, Layout, Plan, bytes_per_axis
from distlab.pipeline_parallel import STAGE_WORK, trace_bubble
from distlab.runtime import trace as trace_format
from distlab.runtime.rank import device

__all__ = ["runnable", "runnable_best", "measure_cluster", "derive_report", "measured_terms", "predicted_terms",
           "responsible_term", "RunCard", "card_rows", "OFF_BY"]

OFF_BY = 0.25  # a prediction further than this from the measurement (either way) needs a named cause


def runnable(layout: Layout) -> bool:
    """Whether the capstone's worker runs ``layout``: DP × PP × TP, DDP or ZeRO-1, plain 1F1B, no recomputation."""
    return (layout.cp == layout.ep == layout.v == 1 and layout.zero <= 1 and not layout.checkpointing
            and not layout.keep_grads and not layout.keep_weights)


def runnable_best(result: Plan) -> Estimate:
    """The planner's fastest feasible layout among those the worker runs; a one-line error with the nearest
    misses' reasons when none fits."""
    for estimate in result.feasible:
        if runnable(estimate.layout):
            return estimate
    misses = [e for e in result.near_misses if runnable(e.layout)][:2]
    why = "; ".join(f"{e.layout}: {'; '.join(e.reasons)}" for e in misses) or "no layout splits the batch"
    raise ValueError(f"no layout the capstone runs fits {result.cluster.name} with {result.global_batch} sequences: "
                     f"{why}")


def _rank_peak(sizes) -> float:
    dist.barrier()  # every rank multiplies at once: the rate each gets while the others compute too
    dev = device()
    return measure_matmul_peak(sizes=sizes if dev.type == "cpu" else (2048, 4096), device=dev, min_seconds=0.1).flops


def measure_cluster(ranks, memory_per_rank: float, sizes=(128, 256)) -> Cluster:
    """This machine as the planner sees a cluster: ``ranks.world_size`` "GPUs" in one node, each with
    ``memory_per_rank`` bytes and the median matmul rate a rank measured while every rank ran its own (``sizes``
    on a CPU, where the ranks share cores and each gets its share; 2,048 and 4,096 on a GPU), on gloo's measured
    latency (a 4-byte all-reduce's time over its ring's 2(N−1) steps) and bus bandwidth (a 4 MiB all-reduce)."""
    peak = statistics.median(ranks.run(_rank_peak, args=(sizes,), show_output=False))
    rows = bandwidth_sweep({"gloo": dist.all_reduce}, [4, 4 << 20], ranks=ranks, reps=5)
    n = ranks.world_size
    latency = rows[0]["median_s"] / (2 * (n - 1))
    return Cluster(f"this machine ({n} ranks)", n, gpus_per_node=n, hbm_bytes=memory_per_rank,
                   intra_node_bandwidth=rows[1]["busbw"], inter_node_bandwidth=rows[1]["busbw"], peak_flops=peak,
                   intra_node_latency=latency, inter_node_latency=latency)


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
    busiest rank's idle share, :func:`~distlab.pipeline_parallel.trace_bubble`) and the bytes one rank sends per
    step along each axis (median over steps of the most any rank sent)."""
    steps = _steps(records, skip)
    step_time = _median_over_steps(records, steps, lambda r, k: r["step_times"][k])
    rate = tokens_per_step / step_time
    return {"step_time": step_time, "tokens_per_second": rate,
            "mfu": mfu(flops_per_token, rate / len(records), peak_flops),
            "bubble": statistics.median(trace_bubble(trace, step=k).fraction for k in steps),
            "bytes": {axis: _median_over_steps(records, steps, lambda r, k, a=axis: r["bytes"][k][a])
                      for axis in ("dp", "pp", "tp")}}


def measured_terms(records, trace: dict, skip: int = 1) -> dict[str, float]:
    """The step split as the planner splits it, in seconds, from the trace: ``compute`` (the busiest rank's
    forward and backward work in a step), ``bubble`` (its idle share of the step's stage work, times the step),
    and ``communication and the rest`` (what remains of the step time: collectives, the optimizer, Python)."""
    steps = _steps(records, skip)
    step_time = _median_over_steps(records, steps, lambda r, k: r["step_times"][k])
    everything = trace_format.slices(trace)
    work = [s for s in everything if s.cat == "compute" and re.match(STAGE_WORK, s.name)]
    compute = []
    for k in steps:
        marks = {s.rank: s for s in everything if s.name == f"step{k}"}
        busy = {}
        for s in work:
            mark = marks.get(s.rank)
            if mark is not None and mark.start <= s.start <= mark.end:
                busy[s.rank] = busy.get(s.rank, 0.0) + (s.end - s.start)
        compute.append(max(busy.values()))
    bubble = statistics.median(trace_bubble(trace, step=k).fraction for k in steps)
    work_time = statistics.median(compute)
    bubble_time = work_time * bubble / (1 - bubble)
    return {"compute": work_time, "bubble": bubble_time,
            "communication and the rest": max(0.0, step_time - work_time - bubble_time)}


def predicted_terms(estimate: Estimate) -> dict[str, float]:
    """The planner's step split in the same three terms (its TP, CP, PP and exposed DP seconds are the third)."""
    s = estimate.seconds
    return {"compute": s["compute"], "bubble": s["bubble"],
            "communication and the rest": s["tp"] + s["cp"] + s["pp"] + s["dp exposed"]}


_WHY = {
    "compute": "the matmuls of a model this small reach {achieved:.0%} of the measured peak, where the planner "
               "assumes {assumed:.0%} (matmul_efficiency): small matrices, and the rest of a layer's work "
               "(softmax, LayerNorm, the loss) that the 6·N FLOPs do not count",
    "bubble": "the bubble: the stages are not equal (the last one also computes the output layer and the loss), "
              "so the busiest rank waits less or more than (p−1)/(m+p−1) of an even split",
    "communication and the rest": "communication and the rest: gloo's per-call overhead and the Python of the "
                                  "schedule, the optimizer and the clipping, which the α–β model of the "
                                  "collectives does not price",
}


def responsible_term(measured: dict[str, float], predicted: dict[str, float], matmul_efficiency: float) -> str:
    """The term whose measured seconds differ most from the predicted ones, with its likely cause in words."""
    term = max(measured, key=lambda k: abs(measured[k] - predicted[k]))
    achieved = matmul_efficiency * predicted["compute"] / measured["compute"] if measured["compute"] else 0.0
    what = _WHY[term].format(achieved=achieved, assumed=matmul_efficiency)
    return (f"{term} ({measured[term] * 1e3:.1f} ms measured against {predicted[term] * 1e3:.1f} ms predicted): "
            f"{what}")


@dataclass(frozen=True)
class RunCard:
    """One figure of the run card: measured, predicted, their ratio, and whether it is within :data:`OFF_BY`."""

    figure: str
    measured: float
    predicted: float
    unit: str

    @property
    def ratio(self) -> float:
        return self.measured / self.predicted if self.predicted else float("inf")

    @property
    def within(self) -> bool:
        return 1 - OFF_BY <= self.ratio <= 1 / (1 - OFF_BY) if self.predicted else self.measured == 0

    def __str__(self) -> str:
        scale, unit = {"ms": (1e3, "ms"), "bytes": (1, "B"), "MB": (1e-6, "MB"), "": (1, "")}[self.unit]
        ratio = f"{self.ratio:5.2f}" if self.predicted else "    -"
        return (f"{self.figure:<28s} {self.measured * scale:>12,.4g} {unit:<3s} {self.predicted * scale:>12,.4g} "
                f"{unit:<3s} {ratio}  {'ok' if self.within else 'OFF'}")


def card_rows(report: dict, memory: dict, estimate: Estimate, model, bytes_per_value: int = 4) -> list[RunCard]:
    """The run card's rows: step time, MFU, bubble, each axis's bytes and the memory of the model states per rank,
    measured (``report`` from :func:`derive_report`, ``memory`` the worker's byte counts of the busiest rank)
    against ``estimate``. Bytes are predicted for the worker as it runs: fp32 values, no sequence parallelism."""
    predicted_bytes = bytes_per_axis(model, estimate.layout, sequence_parallel=False, bytes_per_value=bytes_per_value)
    rows = [RunCard("step time", report["step_time"], estimate.step_time, "ms"),
            RunCard("MFU", report["mfu"], estimate.mfu, ""),
            RunCard("pipeline bubble", report["bubble"], estimate.bubble, "")]
    rows += [RunCard(f"{axis.upper()} bytes per step", report["bytes"][axis], predicted_bytes[axis], "bytes")
             for axis in ("dp", "pp", "tp")]
    states = estimate.memory["params"] + estimate.memory["grads"] + estimate.memory["optimizer"]
    rows.append(RunCard("memory per rank (states)", sum(memory.values()), states, "MB"))
    return rows
