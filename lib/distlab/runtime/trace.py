"""A run as a trace: Trace Event Format JSON that opens in ui.perfetto.dev and chrome://tracing, and the
numbers a trace answers (compute, communication, how much of it hid under compute, idle time, the bubble).

``run.save_trace("step.json")`` on what ``distlab.launch`` or ``Ranks.run`` returned writes the file;
drop it on https://ui.perfetto.dev (nothing to install) or open chrome://tracing and load it. A failed
run saves what happened up to the failure: ``error.run.save_trace(...)`` on the exception, or
``distlab.last_run().save_trace(...)`` in the notebook cell after the one that raised.

**Layout.** One process per rank (``pid = rank + 1``, named ``rank r``) and one for the launcher
(:data:`LAUNCHER_PID`). In a rank's process:

* ``compute``: the rank's ``distlab.span`` blocks (``X`` slices, nested as the blocks were);
* ``communication``: every collective and point-to-point op from the comm log, from issue to completion,
  args ``op``, ``group`` (``world`` or its ranks), ``bytes`` (the message size M) and ``peer`` (point-to-point).
  Async ops can overlap each other; a slice never overlaps another on its track, so overlapping ops go to
  ``communication (2)``, ``(3)`` … (the same rule gives nested-but-crossing compute spans their own lanes);
* ``steps and other``: spans of kind ``other``/``idle`` (a pipeline's ``step3`` marker);
* an arrow (flow event) from each send to the receive that took it: the k-th send from rank a to rank b
  in a group meets the k-th receive on b from a in that group, the order gloo and NCCL match them in;
* counter tracks for what was measured: ``distlab.counter(name, value)`` samples (a pipeline's activation
  bytes) and, on GPU ranks, the allocator's ``memory_allocated`` at every span's end;
* with ``launch(..., profile=True)``, the rank's ``torch.profiler`` threads (``profiler: …``), on the same clock.

The launcher's process shows its own phases: starting the ranks (a group's first job) and each rank
joining, the job, each rank's report, and for a failure the report (its text in the args) and, on the
rank's communication track, how long each rank that never reported had sat blocked in which op.

**One clock.** The launcher stamps the job with its ``time.perf_counter()`` when it sends it; every rank
records its spans and ops as ``time.perf_counter()`` minus that stamp. ``perf_counter`` is the host's
``CLOCK_MONOTONIC`` on Linux (``mach_absolute_time`` on macOS, ``QueryPerformanceCounter`` on Windows): one
counter for every process of the machine, so the ranks' times differ by no offset at all, and the error of
any one timestamp is the cost of reading the clock (well under a microsecond) plus the 1 ns rounding of the
file's microsecond times. Nothing is synchronised after the fact, which is why this holds only for ranks on
one host — all of a ``launch``'s ranks. The trace checks it rather than assuming it: no receive can end
before its send began and no collective can end on any rank before every rank of its group has called it;
:func:`clock_violation` is the largest breach of either in a trace (``otherData.clock_violation_us``, 0 on
every run the tests make). The profiler (kineto) stamps its own clock; each rank's profile is shifted onto
distlab's by pairing the ends of its ``record_function`` ranges with the spans' (median offset), and
``otherData.profile_alignment_us`` is the largest disagreement left among those pairs.

**Bounded.** A trace keeps at most ``max_events`` of the ranks' events (default :data:`DEFAULT_MAX_EVENTS`,
about 15 MB of JSON): past it the latest are left out, a warning says how many and from when, and
``otherData.dropped_events`` records it; ``window=(start, end)`` keeps one part of a long run instead.

**Numbers.** :func:`rank_times` (per rank: compute, communication, the share of communication hidden
under compute, idle) and :func:`bubble` (a pipeline's idle share over the step) are pure functions of the
trace dict, so they read a file saved last week as well as a live run, and the simulated schedule
(:meth:`distlab.pipeline_parallel.Simulation.trace`) as well as the measured one. Holistic Trace Analysis
(``HolisticTraceAnalysis`` on PyPI), the field's tool for distributed PyTorch traces, reads only kineto
traces with GPU kernels; it cannot read CPU-only traces like these (gloo ranks have no device streams),
so distlab computes the same figures itself and does not depend on it.
"""

from __future__ import annotations

import json
import re
import statistics
import warnings
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from distlab.runtime.rank import CLOCK_MARK

__all__ = ["build", "from_run", "save", "load", "merge", "slices", "Slice", "RankTime", "rank_times", "bubble",
           "TraceBubble", "clock_violation", "DEFAULT_MAX_EVENTS", "LAUNCHER_PID", "TraceTruncated"]

DEFAULT_MAX_EVENTS = 100_000  # about 15 MB of JSON: a long run is cut, never a multi-gigabyte surprise
LAUNCHER_PID = 100_000  # the launcher's process in a trace; rank r is pid r + 1
_TRACK_TID = {"compute": 100, "comm": 200, "other": 300}  # first lane of each track; lane k is tid + k
_TRACK_NAME = {"compute": "compute", "comm": "communication", "other": "steps and other"}
_PROFILER_TID = 1000  # the profiler's threads follow
_DISTLAB_CATS = ("compute", "comm", "other", "idle")
_SENDS, _RECVS = ("send", "isend"), ("recv", "irecv")
# Collectives no rank can finish before every rank of the group has called them (each needs every input).
_SYNCHRONISING = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
                  "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single", "barrier")
_MERGE_PID_STRIDE = 1_000_000


class TraceTruncated(UserWarning):
    """A trace reached its cap on events and left the rest out."""


# ---------------------------------------------------------------- building

def _lanes(intervals: list[tuple[float, float, int]], nest: bool) -> dict[int, int]:
    """Lane of each interval (keyed by its index) such that a lane's slices never cross: each either
    ends before the next starts or, with ``nest``, encloses it."""
    lanes: list[list[float]] = []  # per lane: the ends of its open slices (a stack)
    out = {}
    for start, end, key in sorted(intervals, key=lambda x: (x[0], -x[1])):
        for k, stack in enumerate(lanes):
            while stack and stack[-1] <= start:
                stack.pop()
            if not stack or (nest and end <= stack[-1]):
                stack.append(end)
                out[key] = k
                break
        else:
            lanes.append([end])
            out[key] = len(lanes) - 1
    return out


def _comm_slices(rank: int, log, failed_at: float | None) -> list[dict]:
    """The rank's communication ops with their details; an op still in flight when a run failed ends then."""
    rows = []
    peers = getattr(log, "peers", [])
    for i, (op, size, start, end) in enumerate(log.events):
        completed = end == end
        if not completed and failed_at is None:
            continue
        peer, group = peers[i] if i < len(peers) else (-1, "world")
        args = {"op": op, "group": group, "bytes": int(size)}
        name = op
        if op in _SENDS or op in _RECVS:
            args["peer"] = peer
            name = f"{op} {'→' if op in _SENDS else '←'} {peer}"
        if not completed:
            args["completed"] = False
        rows.append({"rank": rank, "track": "comm", "cat": "comm", "name": name, "start": start,
                     "end": end if completed else max(failed_at, start), "args": args})
    return rows


def _profile_events(rank: int, profile: dict, spans) -> tuple[list[tuple[float, dict]], dict, float | None]:
    """A rank's torch.profiler events on distlab's clock, as (seconds since the job was sent, event without
    pid and ts); the names of its threads by new tid; and the largest disagreement among the clock pairings."""
    events = profile.get("events") or []
    # A range's end is the pairing: a span's end is stamped just before its range exits, while its start
    # is stamped after the range's (slow, the first time) entry.
    wanted: dict[str, list[float]] = defaultdict(list)  # label -> distlab end times, in order
    if profile.get("mark") is not None:
        wanted[CLOCK_MARK].append(profile["mark"])
    for s in sorted((s for s in spans if s.rank == rank and s.kind != "comm"), key=lambda s: s.start):
        wanted[s.label].append(s.end)
    seen: dict[str, int] = defaultdict(int)
    offsets = []
    for e in sorted((e for e in events if e.get("cat") == "user_annotation" and e.get("ph") == "X"),
                    key=lambda e: e["ts"]):
        times = wanted.get(e.get("name"))
        k = seen[e.get("name")]
        if times is not None and k < len(times):
            offsets.append(e["ts"] + e.get("dur", 0.0) - times[k] * 1e6)
            seen[e.get("name")] = k + 1
    if not offsets:
        return [], {}, None
    offset = statistics.median(offsets)
    names = {(e.get("pid"), e.get("tid")): e["args"].get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name" and isinstance(e.get("args"), dict)}
    tids: dict[tuple, int] = {}
    out = []
    for e in events:
        if e.get("ph") not in ("X", "i", "I") or "ts" not in e:
            continue
        key = (e.get("pid"), e.get("tid"))
        if key not in tids:
            tids[key] = _PROFILER_TID + len(tids)
        moved = {k: v for k, v in e.items() if k not in ("pid", "tid", "ts")}
        moved["tid"] = tids[key]
        out.append(((e["ts"] - offset) / 1e6, moved))
    thread_names = {tid: f"profiler: {names.get(key) or key[1]}" for key, tid in tids.items()}
    return out, thread_names, max(abs(o - offset) for o in offsets)


def build(spans: Sequence, *, comm: Sequence | None = None, counters: Iterable = (), phases: Iterable = (),
          profiles: Sequence | None = None, world_size: int | None = None, meta: dict | None = None,
          max_events: int = DEFAULT_MAX_EVENTS, window: tuple[float, float] | None = None,
          failed_at: float | None = None) -> dict:
    """The Trace Event Format dict of a run's record (times in seconds since the job was sent).

    ``spans``: :class:`~distlab.runtime.timeline.Span` (comm spans are taken from ``comm``, the ranks'
    :class:`~distlab.runtime.comm.CommLog`, where it has events: they carry bytes, peer and group);
    ``counters``: :class:`~distlab.runtime.timeline.Counter`; ``phases``: the launcher's
    :class:`~distlab.runtime.group.Phase`; ``profiles``: per rank, what a profiled job returned.
    """
    if not isinstance(max_events, int) or isinstance(max_events, bool) or max_events < 1:
        raise ValueError(f"max_events must be a positive integer, got {max_events!r}")
    if window is not None and (len(window) != 2 or not window[0] < window[1]):
        raise ValueError(f"window must be (start, end) seconds with start < end, got {window!r}")
    comm = list(comm or [])
    ranks = sorted({s.rank for s in spans} | {log.rank for log in comm} | set(range(world_size or 0)))
    logged = {log.rank for log in comm if log.events}
    rows = [{"rank": s.rank, "track": "comm" if s.kind == "comm" else "compute" if s.kind == "compute" else "other",
             "cat": s.kind, "name": s.label, "start": s.start, "end": s.end, "args": {}}
            for s in spans if not (s.kind == "comm" and s.rank in logged)]
    for log in comm:
        rows += _comm_slices(log.rank, log, failed_at)
    phases = list(phases)
    for ph in phases:
        if ph.rank is not None:
            rows.append({"rank": ph.rank, "track": "comm", "cat": "comm", "name": ph.name, "start": ph.start,
                         "end": ph.end, "args": {"blocked": True, **(ph.args or {})}})
    counters = list(counters)
    profiled: list[tuple[int, float, dict]] = []  # (rank, seconds, event)
    thread_names: dict[int, dict[int, str]] = {}
    profile_error = None
    for r, profile in enumerate(profiles or []):
        if profile:
            moved, thread_names[r], error = _profile_events(r, profile, spans)
            profiled += [(r, t, e) for t, e in moved]
            if error is not None:
                profile_error = max(profile_error or 0.0, error)
    if window is not None:
        rows = [r for r in rows if window[0] <= r["start"] <= window[1]]
        counters = [c for c in counters if window[0] <= c.time <= window[1]]
        profiled = [p for p in profiled if window[0] <= p[1] <= window[1]]

    # The cap: the earliest events are kept, every rank's alike, so a cut trace is the start of the run.
    dropped, dropped_from = 0, None
    total = len(rows) + len(counters) + len(profiled)
    if total > max_events:
        cut = sorted([r["start"] for r in rows] + [c.time for c in counters] + [p[1] for p in profiled])[max_events - 1]
        kept = ([r for r in rows if r["start"] < cut], [c for c in counters if c.time < cut],
                [p for p in profiled if p[1] < cut])
        dropped, dropped_from = total - sum(map(len, kept)), cut
        rows, counters, profiled = kept
    t0 = min([r["start"] for r in rows] + [c.time for c in counters] + [ph.start for ph in phases]
             + [p[1] for p in profiled], default=0.0)

    events: list[dict] = []
    meta_events: list[dict] = []

    def name_process(pid: int, name: str, order: int) -> None:
        meta_events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}})
        meta_events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                            "args": {"sort_index": order}})

    def name_thread(pid: int, tid: int, name: str) -> None:
        meta_events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
        meta_events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                            "args": {"sort_index": tid}})

    for r in ranks:
        name_process(r + 1, f"rank {r}", r + 1)
    by_track: dict[tuple[int, str], list[int]] = defaultdict(list)
    for i, row in enumerate(rows):
        by_track[(row["rank"], row["track"])].append(i)
    for (rank, track), indices in sorted(by_track.items()):
        lanes = _lanes([(rows[i]["start"], rows[i]["end"], i) for i in indices], nest=track != "comm")
        for lane in sorted(set(lanes.values())):
            name_thread(rank + 1, _TRACK_TID[track] + lane, _TRACK_NAME[track] + (f" ({lane + 1})" if lane else ""))
        for i in indices:
            rows[i]["tid"] = _TRACK_TID[track] + lanes[i]
    for row in rows:
        start = row["start"]
        events.append({"ph": "X", "cat": row["cat"], "name": row["name"], "pid": row["rank"] + 1, "tid": row["tid"],
                       "ts": round((start - t0) * 1e6, 3), "dur": round(max(row["end"] - start, 0.0) * 1e6, 3),
                       "args": row["args"]})
    for c in counters:
        events.append({"ph": "C", "name": c.name, "pid": c.rank + 1, "ts": round((c.time - t0) * 1e6, 3),
                       "args": {"value": c.value}})

    # Flows: the k-th send from a to b in a group meets the k-th receive on b from a in that group.
    sends: dict[tuple, list[dict]] = defaultdict(list)
    recvs: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        args = row["args"]
        op, peer = args.get("op"), args.get("peer", -1)
        if peer >= 0 and op in _SENDS:
            sends[(row["rank"], peer, args["group"])].append(row)
        elif peer >= 0 and op in _RECVS:
            recvs[(peer, row["rank"], args["group"])].append(row)
    flow_id = 0
    for key, sent in sorted(sends.items()):
        for send, recv in zip(sent, recvs.get(key, [])):
            flow_id += 1
            for phase, row in (("s", send), ("f", recv)):
                flow = {"ph": phase, "id": flow_id, "name": "message", "cat": "p2p", "pid": row["rank"] + 1,
                        "tid": row["tid"], "ts": round(((row["start"] + row["end"]) / 2 - t0) * 1e6, 3)}
                if phase == "f":
                    flow["bp"] = "e"
                events.append(flow)

    # The launcher's own phases; never cut by the cap (a failure's report is what a failed run is read for).
    launcher = [ph for ph in phases if ph.rank is None]
    if launcher:
        name_process(LAUNCHER_PID, "launcher", 0)
        lanes = _lanes([(ph.start, ph.end, i) for i, ph in enumerate(launcher)], nest=True)
        for lane in sorted(set(lanes.values())):
            name_thread(LAUNCHER_PID, 1 + lane, "launcher" + (f" ({lane + 1})" if lane else ""))
        for i, ph in enumerate(launcher):
            event = {"cat": "launcher", "name": ph.name, "pid": LAUNCHER_PID, "tid": 1 + lanes[i],
                     "ts": round((ph.start - t0) * 1e6, 3), "args": dict(ph.args or {})}
            event.update({"ph": "X", "dur": round((ph.end - ph.start) * 1e6, 3)} if ph.end > ph.start
                         else {"ph": "i", "s": "t"})
            events.append(event)

    for r, t, e in profiled:
        events.append(dict(e, pid=r + 1, ts=round((t - t0) * 1e6, 3)))
    for r, names in sorted(thread_names.items()):
        for tid, name in sorted(names.items()):
            name_thread(r + 1, tid, name)

    if dropped:
        warnings.warn(f"the trace reached its cap of max_events={max_events:,} and left out the {dropped:,} events "
                      f"from {dropped_from:.3f} s after the job started on; pass a larger max_events, or "
                      "window=(start, end) in seconds to save another part of the run", TraceTruncated, stacklevel=3)
    events.sort(key=lambda e: e["ts"])
    other = {"generator": "distlab", "clock": "time.perf_counter (CLOCK_MONOTONIC), one clock for every rank",
             "t0_seconds": t0, "ranks": {str(r + 1): r for r in ranks}, "max_events": max_events,
             "dropped_events": dropped, **(meta or {})}
    if profile_error is not None:
        other["profile_alignment_us"] = round(profile_error, 3)
    comm_rows = [(r["rank"], r["args"]["op"], r["args"].get("peer", -1), r["args"].get("group", "world"), r["start"],
                  r["end"]) for r in rows if r["cat"] == "comm" and "op" in r["args"]]
    other["clock_violation_us"] = round(_violation(comm_rows) * 1e6, 3)
    return {"traceEvents": meta_events + events, "displayTimeUnit": "ms", "otherData": other}


def from_run(run, **options) -> dict:
    """The trace of a :class:`~distlab.runtime.launch.Run` (``options``: ``max_events``, ``window``)."""
    failure = getattr(run, "failure", None)
    meta = {"backend": run.backend, "world_size": run.world_size, "wall_time_s": run.wall_time}
    failed_at = None
    if failure is not None:
        meta["failure"] = f"{type(failure).__name__}: {str(failure).strip().splitlines()[0] if str(failure) else ''}"
        failed_at = run.wall_time
    return build(run.spans, comm=run.comm, counters=run.counters, phases=run.phases, profiles=run.profiles,
                 world_size=run.world_size, meta=meta, failed_at=failed_at, **options)


def save(trace: dict, path) -> Path:
    """Write ``trace`` as compact JSON; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(trace, separators=(",", ":")), encoding="utf-8")  # one C call: json.dump streams
    return path


def load(path) -> dict:
    with Path(path).open(encoding="utf-8") as f:
        return json.load(f)


def merge(traces: Sequence[dict], names: Sequence[str], align: bool = True) -> dict:
    """Several traces in one file, one above the other (``names[i]: rank r``): a measured run and its
    simulation, say. With ``align``, each trace is shifted so its first compute slice starts when the
    first trace's does."""
    if len(traces) != len(names) or not traces:
        raise ValueError(f"give one name per trace: {len(traces)} trace(s), {len(names)} name(s)")
    firsts = [min((e["ts"] for e in t["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "compute"),
                  default=0.0) for t in traces]
    events, ranks = [], {}
    for i, (trace, name) in enumerate(zip(traces, names)):
        shift = firsts[0] - firsts[i] if align else 0.0
        base = i * _MERGE_PID_STRIDE
        for e in trace["traceEvents"]:
            e = dict(e, pid=e["pid"] + base)
            if e["ph"] == "M":
                e["args"] = dict(e["args"])
                if e["name"] == "process_name":
                    e["args"]["name"] = f"{name}: {e['args']['name']}"
                elif e["name"] == "process_sort_index":
                    e["args"]["sort_index"] += base
            else:
                e["ts"] = round(e["ts"] + shift, 3)
                if e["ph"] in ("s", "t", "f"):
                    e["id"] = f"{i}:{e['id']}"
            events.append(e)
        for pid, rank in trace.get("otherData", {}).get("ranks", {}).items():
            ranks[str(int(pid) + base)] = rank
    events.sort(key=lambda e: (e["ph"] != "M", e.get("ts", 0.0)))
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"generator": "distlab", "sources": list(names), "ranks": ranks,
                          "source_pids": {name: i * _MERGE_PID_STRIDE for i, name in enumerate(names)}}}


# ---------------------------------------------------------------- reading the numbers

@dataclass(frozen=True)
class Slice:
    """One distlab slice of a trace, back in seconds (since the trace's start) and with its rank."""

    pid: int
    rank: int
    cat: str
    name: str
    start: float
    end: float
    args: dict


def slices(trace: dict, source: str | None = None) -> list[Slice]:
    """The trace's distlab slices (compute, comm, other), of one ``source`` of a merged trace if given."""
    other = trace.get("otherData", {})
    ranks = {int(pid): rank for pid, rank in other.get("ranks", {}).items()}
    lo, hi = 0, float("inf")
    if source is not None:
        pids = other.get("source_pids")
        if not pids or source not in pids:
            raise ValueError(f"source {source!r} is not one of this trace's sources: {sorted(pids or [])}")
        lo, hi = pids[source], pids[source] + _MERGE_PID_STRIDE
    out = []
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") in _DISTLAB_CATS and e["pid"] in ranks and lo <= e["pid"] < hi:
            start = e["ts"] / 1e6
            out.append(Slice(e["pid"], ranks[e["pid"]], e["cat"], e["name"], start, start + e["dur"] / 1e6,
                             e.get("args", {})))
    return sorted(out, key=lambda s: (s.pid, s.start, -s.end))


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two unions of disjoint sorted intervals."""
    total, j = 0.0, 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            total += max(0.0, min(end, b[k][1]) - max(start, b[k][0]))
            k += 1
    return total


@dataclass(frozen=True)
class RankTime:
    """Where one rank's time went, over its own window (first slice start to last slice end), in seconds.

    A communication slice lasts from the op's issue to its completion, so a rank blocked in ``wait()`` on a
    posted ``irecv`` is in a communication slice, not idle: the time it waited for a message is in
    :attr:`exposed_comm` (communication with no compute under it). :attr:`idle` is only what no slice
    covers — and a marker slice such as a training step's covers its whole step — so it reads near zero
    on a pipeline even when its bubble is large: a pipeline rank's time not computing is
    ``window - compute``, and its bubble is read by :func:`bubble`.
    """

    rank: int
    window: float
    compute: float  # covered by compute slices
    comm: float  # covered by communication slices, waiting for a message in a posted irecv included
    hidden: float  # communication covered by compute at the same time
    idle: float  # covered by no slice at all: neither computing nor in a communication op

    @property
    def hidden_share(self) -> float:
        """Share of the communication time that compute hid (1: fully overlapped; 0: none)."""
        return self.hidden / self.comm if self.comm > 0 else 0.0

    @property
    def idle_fraction(self) -> float:
        """As :func:`distlab.runtime.timeline.idle_fraction`: idle share of the rank's window."""
        return self.idle / self.window if self.window > 0 else 0.0

    @property
    def exposed_comm(self) -> float:
        """Communication no compute hid: what it added to the step — for a receive, the wait for its message."""
        return self.comm - self.hidden


def rank_times(trace: dict, source: str | None = None, ops: Iterable[str] | None = None) -> list[RankTime]:
    """Per rank: compute, communication, the part of it hidden under compute, and idle time.

    ``ops`` (``{"all_reduce"}``, say) counts only those ops as communication — a DDP step's gradient
    all-reduces without the barrier that ends it; the other slices still count as busy for ``idle``."""
    wanted = None if ops is None else set(ops)
    by_rank: dict[int, list[Slice]] = defaultdict(list)
    for s in slices(trace, source):
        by_rank[s.rank].append(s)
    out = []
    for rank, own in sorted(by_rank.items()):
        compute = _union((s.start, s.end) for s in own if s.cat == "compute")
        comm = _union((s.start, s.end) for s in own
                      if s.cat == "comm" and (wanted is None or s.args.get("op") in wanted))
        busy = _union((s.start, s.end) for s in own)
        window = max(s.end for s in own) - min(s.start for s in own)
        out.append(RankTime(rank, window, _length(compute), _length(comm), _overlap(comm, compute),
                            window - _length(busy)))
    return out


@dataclass(frozen=True)
class TraceBubble:
    """Each rank's idle share between the first and the last selected compute slice of any rank."""

    per_rank: tuple[float, ...]
    window: float  # seconds

    @property
    def bottleneck(self) -> int:
        """The busiest rank (the least idle): it never waits for a slower stage, so its idle is the bubble."""
        return min(range(len(self.per_rank)), key=self.per_rank.__getitem__)

    @property
    def fraction(self) -> float:
        return self.per_rank[self.bottleneck]

    @property
    def mean_idle(self) -> float:
        return statistics.fmean(self.per_rank)


def bubble(trace: dict, within: str | None = None, select: str | Callable[[str], bool] | None = None,
           source: str | None = None) -> TraceBubble:
    """A pipeline's bubble read off a trace: every rank's idle share over one window common to all ranks.

    ``select``: which compute slices are stage work (a regex on the name, or a predicate; default all);
    ``within``: only slices that start inside the rank's slice of that name (``"step3"``). The window runs
    from the first selected slice of any rank to the last, as in :func:`distlab.pipeline_parallel.measured_bubble`.
    """
    pick = (lambda name: re.match(select, name) is not None) if isinstance(select, str) else select
    everything = slices(trace, source)
    work = [s for s in everything if s.cat == "compute" and (pick is None or pick(s.name))]
    if within is not None:
        markers = {s.rank: s for s in everything if s.name == within}
        if not markers:
            raise KeyError(f"no slice named {within!r} in this trace")
        work = [s for s in work if s.rank in markers and markers[s.rank].start <= s.start <= markers[s.rank].end]
    if not work:
        raise ValueError("no compute slices to measure a bubble on (check select= and within=)")
    start, end = min(s.start for s in work), max(s.end for s in work)
    ranks = sorted({s.rank for s in everything})
    window = end - start
    per_rank = tuple(1.0 - _length(_union((s.start, s.end) for s in work if s.rank == r)) / window
                     if window > 0 else 0.0 for r in ranks)
    return TraceBubble(per_rank, window)


def clock_violation(trace: dict) -> float:
    """The largest breach of causality between ranks, in seconds (0 when every rank's clock agrees).

    A receive cannot end before its send began, and a collective that needs every rank's input (all-reduce,
    all-gather, reduce-scatter, all-to-all, barrier) cannot end on a rank before every rank of its group
    called it (the k-th such call in a group on one rank is the k-th on the others).
    """
    return _violation([(s.rank, s.args["op"], s.args.get("peer", -1), s.args.get("group", "world"), s.start, s.end)
                       for s in slices(trace) if s.cat == "comm" and "op" in s.args])


def _violation(ops: list[tuple[int, str, int, str, float, float]]) -> float:
    """:func:`clock_violation` over (rank, op, peer, group, start, end) rows."""
    worst = 0.0
    sends: dict[tuple, list[tuple]] = defaultdict(list)
    recvs: dict[tuple, list[tuple]] = defaultdict(list)
    calls: dict[tuple[str, int], list[tuple]] = defaultdict(list)
    for rank, op, peer, group, start, end in sorted(ops, key=lambda row: row[4]):
        if op in _SENDS:
            sends[(rank, peer, group)].append((start, end))
        elif op in _RECVS:
            recvs[(peer, rank, group)].append((start, end))
        elif op in _SYNCHRONISING:
            calls[(group, rank)].append((start, end))
    for key, sent in sends.items():
        for send, recv in zip(sent, recvs.get(key, [])):
            worst = max(worst, send[0] - recv[1])
    ranks = sorted({row[0] for row in ops})
    for group in {g for g, _ in calls}:
        members = ranks if group == "world" else [int(r) for r in group.split(",")]
        sequences = [calls.get((group, r), []) for r in members]
        for k in range(min(map(len, sequences), default=0)):
            worst = max(worst, max(seq[k][0] for seq in sequences) - min(seq[k][1] for seq in sequences))
    return worst
