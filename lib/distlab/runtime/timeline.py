"""Timelines: labelled spans recorded in each rank, merged in the notebook, drawn as a Gantt chart.

Inside a rank, ``with distlab.span("backward"):`` marks compute; every
collective is recorded automatically by :mod:`distlab.runtime.comm` as a "comm" span
(async ops last from issue to completion, so overlap with compute is visible).
All ranks on one machine read the same monotonic clock, so spans line up.

``distlab.counter("activation bytes", n)`` records one sample of a quantity that changes over the
job (memory, mostly); :mod:`distlab.runtime.trace` draws each name as a counter track. While a
job is profiled (``launch(..., profile=True)``) every span is also a ``torch.profiler``
``record_function`` range, so the profiler's own trace shows distlab's labels.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

KIND_COLORS = {"compute": "#4C72B0", "comm": "#DD8452", "idle": "#BBBBBB", "other": "#55A868"}


@dataclass(frozen=True)
class Span:
    rank: int
    label: str
    kind: str  # compute | comm | idle | other
    start: float  # seconds since the job started
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Counter:
    """One sample of a named quantity on a rank (``time`` in seconds since the job started)."""

    rank: int
    name: str
    time: float
    value: float


_spans: list[tuple[str, str, float, float]] = []
_counters: list[tuple[str, float, float]] = []
_clock_origin = 0.0
_annotate = None  # torch.profiler.record_function while the job is profiled, else None
_memory = None  # () -> (name, bytes) sampled at every span's end (a GPU rank's allocator), else None


def reset(clock_origin: float, annotate=None, memory=None) -> None:
    """Start a new job's timeline. ``annotate(label)``: a context manager each span also enters (the
    profiler's ``record_function``); ``memory()``: ``(name, bytes)`` sampled as a counter at each span's end."""
    global _clock_origin, _annotate, _memory
    _spans.clear()
    _counters.clear()
    _clock_origin = clock_origin
    _annotate, _memory = annotate, memory


def counter(name: str, value: float) -> None:
    """Record one sample of ``name`` (bytes held, say) now, for the trace's counter track of this rank."""
    _counters.append((str(name), time.perf_counter() - _clock_origin, float(value)))


def collect_counters(rank: int) -> list[Counter]:
    """This rank's counter samples for the job, in time order."""
    return [Counter(rank, name, t, value) for name, t, value in _counters]


@contextmanager
def span(label: str, kind: str = "compute"):
    """Record the enclosed block as one span of this rank's timeline."""
    if kind not in KIND_COLORS:
        raise ValueError(f"kind must be one of {sorted(KIND_COLORS)}, not {kind!r}")
    annotation = _annotate(label) if _annotate is not None else None
    if annotation is not None:
        annotation.__enter__()
    start = time.perf_counter() - _clock_origin
    try:
        yield
    finally:
        end = time.perf_counter() - _clock_origin
        _spans.append((label, kind, start, end))
        if annotation is not None:
            annotation.__exit__(None, None, None)
        if _memory is not None:
            name, value = _memory()
            _counters.append((name, end, float(value)))


def collect(rank: int, comm_events) -> list[Span]:
    """This rank's spans for the job: the user's plus one per communication op."""
    spans = [Span(rank, label, kind, start, end) for label, kind, start, end in _spans]
    spans += [Span(rank, op, "comm", start, end) for op, _, start, end in comm_events if end == end]
    return sorted(spans, key=lambda s: (s.start, s.end))


def idle_fraction(spans: list[Span], rank: int) -> float:
    """Share of the rank's wall time (first start to last end) covered by no span at all."""
    own = sorted((s.start, s.end) for s in spans if s.rank == rank)
    if not own:
        return 0.0
    busy, cursor = 0.0, own[0][0]
    for start, end in own:
        start = max(start, cursor)
        if end > start:
            busy += end - start
            cursor = end
    total = max(end for _, end in own) - own[0][0]
    return 1.0 - busy / total if total > 0 else 0.0


def plot(spans: list[Span], ax=None, title: str | None = None, kinds: tuple[str, ...] | None = None,
         labels: dict[str, str] | None = None):
    """Gantt chart: one row per rank, one bar per span, coloured by kind.

    ``labels`` renames kinds in the legend (``{"comm": "background write"}``) where a kind's
    spans are not what its name says: the colours stay the kinds'.
    """
    import matplotlib.pyplot as plt  # noqa: PLC0415  matplotlib is heavy and only the plot needs it
    from matplotlib.patches import Patch  # noqa: PLC0415  as above

    if ax is None:
        ranks = sorted({s.rank for s in spans}) or [0]
        _, ax = plt.subplots(figsize=(10, 0.5 + 0.6 * len(ranks)))
    for s in spans:
        if kinds is not None and s.kind not in kinds:
            continue
        height = 0.35 if s.kind == "comm" else 0.7
        offset = 0.2 if s.kind == "comm" else 0.0
        ax.barh(s.rank + offset, s.duration * 1e3, left=s.start * 1e3, height=height,
                color=KIND_COLORS[s.kind], edgecolor="black", linewidth=0.3)
    ax.set_xlabel("time since job start (ms)")
    ax.set_ylabel("rank")
    ax.set_yticks(sorted({s.rank for s in spans}))
    ax.invert_yaxis()
    shown = sorted({s.kind for s in spans if kinds is None or s.kind in kinds})
    names = labels or {}
    ax.legend(handles=[Patch(color=KIND_COLORS[k], label=names.get(k, k)) for k in shown], loc="upper right",
              fontsize=8)
    if title:
        ax.set_title(title)
    return ax
