"""Timeline spans: idle time between spans and the Gantt chart."""

import matplotlib

matplotlib.use("Agg")

import pytest
import torch.distributed as dist

import distlab
from distlab.runtime.timeline import Span, idle_fraction, plot


def test_idle_fraction_counts_gaps_and_merges_overlaps():
    spans = [Span(0, "fwd", "compute", 0.0, 2.0), Span(0, "bwd", "compute", 1.0, 3.0),  # overlap: busy 0-3
             Span(0, "all_reduce", "comm", 5.0, 6.0),  # gap 3-5 is idle
             Span(1, "fwd", "compute", 0.0, 1.0)]
    assert idle_fraction(spans, rank=0) == pytest.approx(2 / 6)
    assert idle_fraction(spans, rank=1) == 0.0
    assert idle_fraction(spans, rank=7) == 0.0  # a rank with no spans


def test_idle_fraction_of_real_ranks_sees_the_wait():
    def work():
        import time

        with distlab.span("work"):
            time.sleep(0.05)
        if dist.get_rank() == 1:
            time.sleep(0.2)  # rank 0 waits for it in the barrier below: comm, not idle
        dist.barrier()
        time.sleep(0.1)  # outside any span: idle
        with distlab.span("more work"):
            time.sleep(0.05)

    run = distlab.launch(work, 2, collective_timeout=5)
    for rank in range(2):
        assert 0.2 < idle_fraction(run.spans, rank) < 0.8


def test_gantt_draws_one_bar_per_span_and_a_row_per_rank():
    spans = [Span(r, "fwd", "compute", 0.0, 0.01 * (r + 1)) for r in range(3)] + [Span(2, "ar", "comm", 0.01, 0.02)]
    ax = plot(spans, title="t")
    assert len(ax.patches) == 4 and list(ax.get_yticks()) == [0, 1, 2]
    with pytest.raises(ValueError, match="kind must be one of"):
        with distlab.span("x", kind="waiting"):
            pass
