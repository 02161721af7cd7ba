"""Traces of real runs (issue 28): Trace Event Format validity, and the numbers read off a trace against the
comm log and ``timeline.idle_fraction`` of the same run.

One warm 2-rank and one warm 4-rank group serve every test (``Ranks.shared``); the models are tiny.
"""

import json
import pickle
import warnings

import pytest
import torch
import torch.distributed as dist

import distlab
from distlab import pipeline_parallel as pp
from distlab.data_parallel import train_worker
from distlab.model import GPTConfig
from distlab.runtime import trace
from distlab.runtime.timeline import idle_fraction

pytestmark = [pytest.mark.timeout(300)]

TINY = GPTConfig(vocab_size=64, seq_len=16, n_layer=4, n_head=2, d_model=32)


# ---------------------------------------------------------------- an independent reading of the format

def check_trace_format(tr: dict) -> dict:
    """Trace Event Format rules Perfetto and chrome://tracing rely on; returns counts per phase."""
    assert isinstance(tr["traceEvents"], list) and tr["traceEvents"]
    json.loads(json.dumps(tr))  # plain JSON all the way down
    counts: dict[str, int] = {}
    tracks: dict[tuple, list[dict]] = {}
    flows: dict[object, dict[str, dict]] = {}
    last_ts: dict[tuple, float] = {}
    for e in tr["traceEvents"]:
        ph = e["ph"]
        counts[ph] = counts.get(ph, 0) + 1
        assert isinstance(e["pid"], int), e
        if ph == "M":
            assert e["name"] in ("process_name", "process_sort_index", "thread_name", "thread_sort_index"), e
            assert isinstance(e["args"], dict), e
            continue
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        assert isinstance(e["name"], str) and e["name"], e
        if ph == "C":
            assert all(isinstance(v, (int, float)) for v in e["args"].values()), e
            continue
        track = (e["pid"], e["tid"])
        assert e["ts"] >= last_ts.get(track, 0.0), f"timestamps go back on track {track}: {e}"
        last_ts[track] = e["ts"]
        if ph == "X":
            assert e["dur"] >= 0 and "cat" in e, e
            tracks.setdefault(track, []).append(e)
        elif ph in ("s", "f"):
            assert ph not in flows.setdefault(e["id"], {}), f"flow {e['id']} has two {ph!r} events"
            flows[e["id"]][ph] = e
        else:
            assert ph in ("i", "I"), f"unexpected phase {ph!r}"
    for track, slices in tracks.items():  # on one track, X slices nest or follow one another, never cross
        open_ends: list[float] = []
        for e in slices:
            end = e["ts"] + e["dur"]
            while open_ends and open_ends[-1] <= e["ts"] + 1e-3:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1] + 1e-3, f"slices cross on track {track}: {e}"
            open_ends.append(end)
    for flow_id, ends in flows.items():
        assert set(ends) == {"s", "f"}, f"flow {flow_id} has only {sorted(ends)}"
        for e in ends.values():  # each end lies inside a slice of its track
            assert any(s["ts"] <= e["ts"] <= s["ts"] + s["dur"] for s in tracks[(e["pid"], e["tid"])]), e
    return counts


def covered(intervals) -> list[tuple[float, float]]:
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def overlap(xs, ys) -> float:
    return sum(max(0.0, min(b, d) - max(a, c)) for a, b in covered(xs) for c, d in covered(ys))


# ---------------------------------------------------------------- runs

@pytest.fixture(scope="module", autouse=True)
def warm_groups():
    """The shared warm groups live for this module; ended at its end."""
    yield
    distlab.shutdown()


@pytest.fixture(scope="module")
def ddp_run():
    return distlab.Ranks.shared(2).run(train_worker, kwargs=dict(
        variant="overlapped", cfg=TINY, steps=2, batch_size=4, bucket_cap_bytes=20_000, return_state=False),
        show_output=False)


@pytest.fixture(scope="module")
def pipeline_run():
    return distlab.Ranks.shared(4).run(pp.pipeline_worker, kwargs=dict(
        schedule="1f1b", cfg=TINY, m=4, steps=2, return_state=False, track_memory=True), show_output=False)


def test_ddp_trace_is_valid_and_its_numbers_match_the_comm_log(ddp_run, tmp_path):
    path = ddp_run.save_trace(tmp_path / "ddp.json")
    tr = trace.load(path)
    counts = check_trace_format(tr)
    assert counts["X"] > 0 and tr["otherData"]["dropped_events"] == 0
    assert tr["otherData"]["clock_violation_us"] == 0.0  # no collective ends on a rank before every rank called it
    names = {e["args"]["name"] for e in tr["traceEvents"] if e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1", "launcher"}
    times = trace.rank_times(tr)
    assert [t.rank for t in times] == [0, 1]
    for t, log in zip(times, ddp_run.comm):
        rank_slices = [s for s in trace.slices(tr) if s.rank == t.rank]
        comm = [s for s in rank_slices if s.cat == "comm"]
        # every op of the comm log is on the trace, with its bytes
        for op, stats in log.ops.items():
            mine = [s for s in comm if s.args["op"] == op]
            assert len(mine) == stats.calls and sum(s.args["bytes"] for s in mine) == stats.payload_bytes, op
        t0 = tr["otherData"]["t0_seconds"]  # the trace counts from its first event; the run from the job's send
        log_comm = [(start - t0, end - t0) for _, _, start, end in log.events]
        compute = [(s.start - t0, s.end - t0) for s in ddp_run.spans if s.rank == t.rank and s.kind == "compute"]
        assert t.comm == pytest.approx(sum(b - a for a, b in covered(log_comm)), abs=1e-6)
        assert t.hidden == pytest.approx(overlap(log_comm, compute), abs=1e-6)
        assert 0.0 <= t.hidden_share <= 1.0 and t.compute > 0
        assert t.idle_fraction == pytest.approx(idle_fraction(ddp_run.spans, t.rank), abs=1e-6)
        reduces = [(start - t0, end - t0) for op, _, start, end in log.events if op == "all_reduce"]
        only = trace.rank_times(tr, ops={"all_reduce"})[t.rank]
        assert only.comm == pytest.approx(sum(b - a for a, b in covered(reduces)), abs=1e-6) and only.comm < t.comm
        assert only.hidden == pytest.approx(overlap(reduces, compute), abs=1e-6)


def test_1f1b_trace_flows_bubble_and_memory_counters(pipeline_run):
    tr = pipeline_run.trace()
    counts = check_trace_format(tr)
    sends = sum(log.ops["isend"].calls for log in pipeline_run.comm)
    assert counts["s"] == counts["f"] == sends > 0  # an arrow from every send to the receive that took it
    for t in trace.rank_times(tr):
        assert t.idle_fraction == pytest.approx(idle_fraction(pipeline_run.spans, t.rank), abs=1e-6)
    measured = pp.measured_bubble(pp.step_spans(pipeline_run.spans, 1), ranks=4)
    read = pp.trace_bubble(tr, step=1)
    assert read.per_rank == pytest.approx(measured.per_rank, abs=1e-6)
    assert read.bottleneck == measured.bottleneck
    held = [e for e in tr["traceEvents"] if e["ph"] == "C" and e["name"] == "activation bytes held"]
    assert {e["pid"] for e in held} == {1, 2, 3, 4}
    assert max(e["args"]["value"] for e in held) == max(r["peak_activation_bytes"] for r in pipeline_run)
    assert tr["otherData"]["clock_violation_us"] == 0.0


def test_simulation_trace_opens_beside_the_measured_one(pipeline_run):
    sim = pp.simulate(pp.one_f_one_b(4, 4))
    predicted = sim.trace(slot=1e-3)
    check_trace_format(predicted)
    assert trace.bubble(predicted, select=pp.STAGE_WORK).mean_idle == pytest.approx(sim.bubble, abs=1e-9)
    both = trace.merge([pipeline_run.trace(), predicted], ["measured", "predicted"])
    check_trace_format(both)
    assert trace.bubble(both, select=pp.STAGE_WORK, source="predicted").mean_idle == pytest.approx(sim.bubble,
                                                                                                 abs=1e-9)
    assert pp.trace_bubble(both, step=1, source="measured").per_rank == pytest.approx(
        pp.trace_bubble(pipeline_run.trace(), step=1).per_rank, abs=1e-6)
    with pytest.raises(ValueError, match="not one of this trace's sources"):
        trace.slices(both, source="simulated")


def test_a_capped_trace_stays_valid_and_says_what_it_left_out(pipeline_run):
    full = pipeline_run.trace()
    with pytest.warns(trace.TraceTruncated, match="max_events=50 and left out"):
        cut = pipeline_run.trace(max_events=50)
    check_trace_format(cut)
    kept = sum(1 for e in cut["traceEvents"] if e["ph"] in ("X", "C") and e.get("cat") != "launcher")
    assert kept <= 50 and cut["otherData"]["dropped_events"] > 0
    assert len(cut["traceEvents"]) < len(full["traceEvents"])
    with pytest.raises(ValueError, match="max_events must be a positive integer"):
        pipeline_run.trace(max_events=0)


def _fails_on_rank_1():
    import torch

    with distlab.span("work"):
        dist.all_reduce(torch.ones(4))
    if dist.get_rank() == 1:
        raise ValueError("rank 1 gives up")
    return dist.get_rank()


def test_a_failed_run_saves_what_happened_up_to_the_failure(tmp_path):
    with pytest.raises(distlab.RankFailed) as caught:
        distlab.Ranks.shared(2).run(_fails_on_rank_1, show_output=False)
    run = caught.value.run
    assert distlab.last_run() is run and run.failure is caught.value
    tr = trace.load(run.save_trace(tmp_path / "failed.json"))
    check_trace_format(tr)
    failure = [e for e in tr["traceEvents"] if e["name"].startswith("failure: RankFailed")]
    assert len(failure) == 1 and "rank 1 gives up" in failure[0]["args"]["message"]
    assert tr["otherData"]["failure"].startswith("RankFailed")
    assert {(s.rank, s.name) for s in trace.slices(tr)} >= {(0, "work"), (1, "work"), (0, "all_reduce"),
                                                             (1, "all_reduce")}


def test_profile_merges_each_ranks_torch_profiler_on_the_run_clock():
    def job():
        import torch

        with distlab.span("matmul"):
            torch.randn(64, 64) @ torch.randn(64, 64)
        dist.all_reduce(torch.ones(8))

    run = distlab.Ranks.shared(2).run(job, profile=True, show_output=False)
    tr = run.trace()
    check_trace_format(tr)
    for pid in (1, 2):
        threads = {e["args"]["name"] for e in tr["traceEvents"] if e["pid"] == pid and e["name"] == "thread_name"}
        assert any(name.startswith("profiler: ") for name in threads), threads
        ranges = [e for e in tr["traceEvents"] if e["pid"] == pid and e.get("cat") == "user_annotation"
                  and e["name"] == "matmul"]
        span = next(s for s in trace.slices(tr) if s.pid == pid and s.name == "matmul")
        assert len(ranges) == 1 and abs(ranges[0]["ts"] / 1e6 - span.start) < 5e-3  # the same moment, both clocks
    assert tr["otherData"]["profile_alignment_us"] < 5000
    assert not any("USDT" in text for text in run.stderr)  # the profiler's start-up chatter is not the user's


def test_build_checks_its_window():
    with pytest.raises(ValueError, match="window must be"):
        trace.build([], window=(2.0, 1.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert trace.build([], world_size=2)["otherData"]["ranks"] == {"1": 0, "2": 1}


def _deadlock():
    import torch

    dist.recv(torch.empty(4), src=1 - dist.get_rank())  # both ranks wait for the other: a deadlock


def test_a_hung_run_shows_where_each_rank_was_blocked(tmp_path):
    with pytest.raises(distlab.CollectiveTimeout) as caught:
        distlab.launch(_deadlock, 2, collective_timeout=1.0, show_output=False)
    tr = trace.load(caught.value.run.save_trace(tmp_path / "hung.json"))
    check_trace_format(tr)
    blocked = {(s.rank, s.name, s.args["peer"]) for s in trace.slices(tr) if s.args.get("blocked")}
    assert blocked == {(0, "blocked in recv", 1), (1, "blocked in recv", 0)}
    assert all(s.end - s.start >= 1.0 for s in trace.slices(tr) if s.args.get("blocked"))  # the timeout, at least
    names = [e["name"] for e in tr["traceEvents"] if e.get("cat") == "launcher"]
    assert "start ranks" in names and "failure: CollectiveTimeout" in names


def _allocate_and_keep(mib: int):
    """One tensor of ``mib`` MiB on the rank's GPU, kept until the job's end; returns its size and address."""
    kept = torch.empty(mib * 2**20, dtype=torch.uint8, device=distlab.device())
    return kept.numel(), kept.data_ptr()


def test_memory_snapshots_are_refused_on_cpu_ranks_before_any_rank_starts():
    before = distlab.last_run()
    for start in (lambda: distlab.launch(_allocate_and_keep, 2, args=(1,), backend="gloo", memory_snapshot=True),
                  lambda: distlab.Ranks(2, backend="gloo").run(_allocate_and_keep, args=(1,), memory_snapshot=True)):
        with pytest.raises(ValueError, match=r"memory_snapshot=True records the CUDA caching allocator, and this "
                                             r"launch runs gloo ranks on the CPU"):
            start()
    assert distlab.last_run() is before  # refused before a job was sent


def test_a_run_without_snapshots_says_how_to_take_them(ddp_run, tmp_path):
    with pytest.raises(ValueError, match="launch it with memory_snapshot=True on GPU ranks"):
        ddp_run.save_memory_snapshots(tmp_path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_ranks_record_their_allocator_history_and_save_it_for_memory_viz(tmp_path):
    run = distlab.launch(_allocate_and_keep, 1, args=(3,), backend="nccl", memory_snapshot=True)
    size, address = run[0]
    snapshot = run.memory_snapshots[0]
    allocs = [e for trace_ in snapshot["device_traces"] for e in trace_ if e["action"] == "alloc"]
    assert any(e["addr"] == address and e["size"] == size for e in allocs), allocs[-5:]
    assert any(f["name"] == "_allocate_and_keep" for e in allocs for f in e.get("frames", [])), "no Python stack"
    held = sum(b["size"] for seg in snapshot["segments"] for b in seg["blocks"] if b["state"] == "active_allocated")
    assert held >= size  # the tensor was still alive when the snapshot was taken
    (path,) = run.save_memory_snapshots(tmp_path)
    assert path.name == "rank0.pickle" and pickle.loads(path.read_bytes())["segments"] == snapshot["segments"]
