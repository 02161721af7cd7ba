"""The parallelism planner: published layouts, infeasible ones with their reasons, and the seeds' arithmetic."""

import math
import re
from dataclasses import replace

import pytest

import distlab
from distlab.memory import PRESETS
from distlab.model import GPTConfig, flops_per_token
from distlab.parallel3d.calibration import COLLECTIVES, Calibration, ComputeCost, Link, calibrate, load_cached
from distlab.parallel3d.planner import (
    Cluster,
    Layout,
    ModelShape,
    bytes_per_axis,
    calibrated_cluster,
    estimate,
    gradient_all_reduce_seconds,
    h100_cluster,
    plan,
    plot_plan,
    prediction_lines,
    run_cost,
)
from distlab.pipeline_parallel import bubble_fraction, make_schedule, peak_in_flight, simulate


@pytest.mark.parametrize("p,m,v", [(4, 16, 1), (4, 2, 1), (8, 8, 1), (4, 8, 2), (4, 4, 4), (8, 16, 2)])
def test_peak_in_flight_is_what_the_simulated_schedule_holds(p, m, v):
    sim = simulate(make_schedule("interleaved" if v > 1 else "1f1b", p, m, v), m, v)
    assert peak_in_flight(p, m, v) == sim.peak_in_flight[0]


def test_model_shape_uses_the_one_flops_formula():
    cfg = GPTConfig(n_layer=3, d_model=64, tied_embeddings=False)
    assert ModelShape.from_config(cfg).flops_per_token == flops_per_token(cfg)
    shape = ModelShape.from_preset("70B")
    assert shape.n_params == PRESETS["70B"].n_params


def test_llama3_405b_layout_is_the_best_with_its_fp32_gradients_and_tp_inside_a_node():
    # Llama 3's 8K stage: no CP; gradients accumulated and reduce-scattered in fp32 (Dubey et al. 2024, §3.3.2)
    result = plan("405B", h100_cluster(16384), 2048, cp=(1,), precision="mixed_fp32_grads")
    best = result.best.layout
    assert (best.tp, best.pp, best.dp, best.zero) == (8, 16, 128, 1)
    assert all(e.layout.tp == 8 for e in result.feasible[:5])
    pp4 = result.find(tp=8, pp=4, dp=512, zero=1)  # the fastest with bf16 gradients no longer fits
    assert not pp4.feasible and any("over the 72 GB usable" in r for r in pp4.reasons)
    bf16 = plan("405B", h100_cluster(16384), 2048, cp=(1,))
    assert bf16.find(tp=8, pp=4, dp=512, zero=1).feasible
    assert bf16.find(tp=8, pp=16, dp=128, zero=1).step_time <= 1.03 * bf16.best.step_time
    tp16 = estimate(result.model, result.cluster, Layout(dp=64, tp=16, pp=16, zero=1, m=32), 2048)
    assert any("TP 16 spans 2 nodes" in r for r in tp16.reasons)


def test_fp32_gradients_double_gradient_memory_and_zero1_reduce_scatter_traffic():
    model, cluster = ModelShape.from_preset("70B"), h100_cluster(1024)
    layout = Layout(dp=64, tp=4, pp=4, zero=1, m=32, v=4)
    bf16 = estimate(model, cluster, layout, 2048)
    fp32 = estimate(model, cluster, layout, 2048, precision="mixed_fp32_grads")
    assert fp32.memory["grads"] == pytest.approx(2 * bf16.memory["grads"])
    assert fp32.memory["params"] == bf16.memory["params"]
    # ZeRO-1 reduce-scatters the gradients (now 4 bytes a value) and all-gathers the bf16 parameters
    assert fp32.bytes["dp"] - bf16.bytes["dp"] == pytest.approx(bf16.memory["grads"])
    assert bf16.bytes["dp"] == pytest.approx(bf16.memory["grads"] + bf16.memory["params"])
    assert fp32.seconds["dp exposed"] > bf16.seconds["dp exposed"]


def test_zero2_and_zero3_under_a_pipeline_are_priced_not_rejected():
    """Llama 3 ran FSDP over PP 16 and torchtitan composes FSDP2 with PP: what a pipeline's micro-batches
    cost ZeRO-2/3 is traffic (per-micro-batch messages) or memory (what is kept whole), never impossibility."""
    model, cluster = ModelShape.from_preset("405B"), h100_cluster(16384)
    base = Layout(dp=128, tp=8, pp=16, zero=1, m=16, v=4, checkpointing=True)
    zero1 = estimate(model, cluster, base, 2048, precision="mixed_fp32_grads")
    by_stage = {(z, kw, kg): estimate(model, cluster, replace(base, zero=z, keep_weights=kw, keep_grads=kg), 2048,
                                      precision="mixed_fp32_grads")
                for z, kw, kg in [(2, False, False), (3, False, False), (3, False, True), (3, True, False),
                                  (3, True, True), (2, False, True)]}
    assert all(e.feasible for e in by_stage.values()), [e.reasons for e in by_stage.values()]
    params, grads = zero1.memory["params"], zero1.memory["grads"]  # whole: bf16 weights, fp32 gradients
    zero2, zero3 = by_stage[(2, False, False)], by_stage[(3, False, False)]
    assert zero2.bytes["dp"] == pytest.approx(16 * grads + params)  # a reduce-scatter per micro-batch
    assert zero3.bytes["dp"] == pytest.approx(16 * grads + 2 * 16 * params)  # + gathers forward and backward
    assert by_stage[(3, False, True)].bytes["dp"] == pytest.approx(grads + 2 * 16 * params)
    assert zero1.memory["total"] > zero2.memory["total"] > zero3.memory["total"]
    assert by_stage[(3, False, True)].memory["grads"] == grads  # kept whole over the micro-batches
    assert zero1.step_time < zero2.step_time < zero3.step_time
    # keeping both is Llama 3's FSDP and holds and sends what ZeRO-1 does; keeping the weights only is ZeRO-2
    for kept, same in [((3, True, True), zero1), ((2, False, True), zero1), ((3, True, False), zero2)]:
        e = by_stage[kept]
        assert (e.memory, e.bytes, e.step_time) == (same.memory, same.bytes, same.step_time), kept
    bad = estimate(model, cluster, replace(base, keep_grads=True), 2048)
    assert any("ZeRO-1 shards no gradients" in r for r in bad.reasons)


def test_the_published_layouts_need_overlap_to_cost_something():
    """With overlapped DP traffic free, per-micro-batch reduce-scatters look free and win; from a modest
    overlap cost on, the published layouts come out: the planner says which assumption decides."""
    for cost in (0.1, 0.3):
        llama = plan("405B", h100_cluster(16384), 2048, cp=(1,), precision="mixed_fp32_grads", overlap_cost=cost)
        seeds = plan("70B", h100_cluster(1024), 2048, cp=(1,), overlap_cost=cost)
        assert (llama.best.layout.tp, llama.best.layout.pp, llama.best.layout.dp) == (8, 16, 128), cost
        assert (seeds.best.layout.tp, seeds.best.layout.pp, seeds.best.layout.dp) == (4, 4, 64), cost
    free = plan("70B", h100_cluster(1024), 2048, cp=(1,), overlap_cost=0.0).best.layout
    assert free.zero >= 2 and free.keep_grads is False


def test_hfu_counts_the_recomputed_forward():
    model, cluster = ModelShape.from_preset("70B"), h100_cluster(1024)
    layout = Layout(dp=64, tp=4, pp=4, zero=1, m=32, v=4)
    plain = estimate(model, cluster, layout, 2048)
    assert plain.hfu == pytest.approx(plain.mfu)
    recomputing = estimate(model, cluster, replace(layout, checkpointing=True), 2048)
    assert recomputing.hfu == pytest.approx(4 / 3 * recomputing.mfu)
    assert recomputing.mfu < plain.mfu and "HFU" in recomputing.summary()


def test_70b_on_1024_h100s_picks_the_seeds_layout():
    result = plan("70B", h100_cluster(1024), 2048, cp=(1,))
    best = result.best.layout
    assert (best.tp, best.pp, best.dp) == (4, 4, 64)
    ddp = result.find(tp=1, pp=1, dp=1024, zero=0)
    assert not ddp.feasible and any("over the 72 GB usable" in r for r in ddp.reasons)
    fsdp = result.find(tp=1, pp=1, dp=1024, zero=3)  # fits, but its gathers cross the network every micro-batch
    assert fsdp.feasible and fsdp.step_time > 1.2 * result.best.step_time


def test_70b_on_one_node_does_not_fit_and_says_why():
    result = plan("70B", h100_cluster(8), 64)
    assert not result.feasible
    with pytest.raises(ValueError, match="no layout of 70B fits 8 H100s"):
        result.best
    zero3 = result.find(dp=8, zero=3, checkpointing=True)
    assert zero3.memory["states"] == pytest.approx(PRESETS["70B"].memory(8, 3).states)
    assert any("states" in r and "over the 72 GB usable" in r for r in zero3.reasons)
    assert plan("70B", h100_cluster(16), 64).feasible  # two nodes do


def test_bad_planner_input_is_one_line():
    with pytest.raises(ValueError, match="global_batch must be a positive number"):
        plan("7B", h100_cluster(8), 0)


def test_bytes_per_axis_for_the_lab_run_counts_every_collective():
    cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, tied_embeddings=False)
    got = bytes_per_axis(ModelShape.from_config(cfg), Layout(dp=2, tp=2, pp=2, zero=0, micro_batch=2, m=2),
                         sequence_parallel=False, bytes_per_value=4)
    # measured on 8 gloo ranks in tests/test_mesh.py: tp 41,728 and pp 8,192 exactly
    assert (got["tp"], got["pp"]) == (41728, 8192)


def test_the_seeds_cost_arithmetic():
    cost = run_cost("70B", 1.4e12, h100_cluster(1024), 0.5, tokens_per_step=2048 * 4096)
    assert cost["steps"] == pytest.approx(1.4e12 / (2048 * 4096))
    assert 10 < cost["days"] < 20  # the seeds' "30–40 days" is 2–3× too long
    nvlink = gradient_all_reduce_seconds("7B", 8, 450e9)
    infiniband = gradient_all_reduce_seconds("7B", 8, 50e9)
    assert infiniband / nvlink == pytest.approx(9.0)
    assert 0.04 < nvlink < 0.06


def test_plot_plan_draws_every_estimate_and_the_highlight():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = plan("70B", h100_cluster(1024), 2048, cp=(1,))
    fig, ax = plt.subplots()
    plot_plan(ax, result, highlight=result.best.layout)
    drawn = sum(len(c.get_offsets()) for c in ax.collections)
    assert drawn == len(result.feasible) + len([e for e in result.near_misses if e.mfu > 0]) + 1
    plt.close(fig)


def test_tp_groups_that_straddle_a_node_boundary_are_rejected():
    six_per_node = Cluster("24 GPUs, 6 per node", 24, gpus_per_node=6)
    straddling = estimate(ModelShape.from_preset("70B"), six_per_node, Layout(dp=6, tp=4, zero=3, m=1), 6)
    assert any("TP 4 spans 2 nodes" in r for r in straddling.reasons), straddling.reasons  # ranks 4-7 cross 5|6
    inside = estimate(ModelShape.from_preset("70B"), six_per_node, Layout(dp=4, tp=6, zero=3, m=1), 4)
    assert not any("spans" in r for r in inside.reasons), inside.reasons


def test_a_budget_below_a_gigabyte_is_said_in_megabytes_not_as_zero_gigabytes():
    """Lab 13 plans CPU ranks against an 8 MB budget: whole GB would print every figure of the reason as 0."""
    tiny = ModelShape.from_config(GPTConfig(vocab_size=512, seq_len=64, n_layer=4, n_head=4, d_model=64), "toy")
    cpu = Cluster("4 CPU ranks", 4, gpus_per_node=4, hbm_bytes=1e6, peak_flops=5e10)
    (reason,) = [r for r in estimate(tiny, cpu, Layout(dp=4, m=2), 8).reasons if "usable" in r]
    assert re.fullmatch(r"needs [\d.]+ MB per GPU \([\d.]+ MB states \+ [\d.]+ MB activations\), over the 0\.90 MB "
                        r"usable of 1\.00 MB HBM", reason), reason


# ---------------------------------------------------------------- the planner calibrated on the machine it runs on

def _calibration(world: int, cores: float, links: float = 1e-4, **compute) -> Calibration:
    """A hand-made calibration of ``world`` ranks with ``cores`` devices' worth of compute between them (the time of
    a rank alone over its time among busy ranks is cores/world), every block piece costing 1 ms unless given."""
    pieces = dict(forward=1e-3, backward=2e-3, collectives_forward=0.0, collectives_backward=0.0, matmul=1e-3,
                  matmul_flops=1e6, head_forward=1e-3, head_backward=2e-3, head_collectives=0.0, head_matmul=1e-3,
                  head_matmul_flops=1e6, embedding_forward=0.0, embedding_backward=0.0, embedding_collectives=0.0)
    pieces.update(compute)
    sizes = [s for s in range(2, world + 1) if world % s == 0]
    beta = 1e9 if links else math.inf  # free messages: no latency, no bytes
    return Calibration(machine={"cpu": "test"}, world_size=world, model={}, peak_flops=1e10,
                       compute={f"tp{t}-rows16": ComputeCost(t, 16, **pieces) for t in (1, 2)},
                       links={**{f"{op}/{s}": Link(op, s, links, beta) for op in COLLECTIVES for s in sizes},
                              "send/2": Link("send", 2, links, beta)},
                       alone=cores / world, together=1.0, step_fixed=0.0, per_param_updated=0.0, per_param_held=0.0)


TINY = GPTConfig(vocab_size=64, seq_len=16, n_layer=4, n_head=2, d_model=32, tied_embeddings=False)


def test_a_calibrated_step_adds_up_and_a_balanced_pipeline_has_the_textbook_bubble():
    model = ModelShape.from_config(TINY)
    even = _calibration(4, cores=4.0, links=0.0, head_forward=0.0, head_backward=0.0)  # equal stages, free messages
    est = estimate(model, calibrated_cluster(even, 1e9), Layout(dp=1, pp=4, m=8), 8, precision="fp32",
                   calibration=even)
    assert est.calibrated and est.feasible and est.step_time == pytest.approx(sum(est.seconds.values()))
    assert sum(est.terms().values()) == pytest.approx(est.step_time)
    assert est.bubble == pytest.approx(bubble_fraction(4, 8))  # unequal stages are what moves it
    heavy_head = _calibration(4, cores=4.0, links=0.0)  # the last stage also runs the output layer and the loss
    skewed = estimate(model, calibrated_cluster(heavy_head, 1e9), Layout(dp=1, pp=4, m=8), 8, precision="fp32",
                      calibration=heavy_head)
    assert skewed.bubble < est.bubble  # the busiest rank (the last) waits only for the fill and the drain


def test_ranks_sharing_cores_run_faster_when_the_schedule_leaves_some_idle():
    model = ModelShape.from_config(TINY)
    full, shared = _calibration(4, cores=4.0, links=0.0), _calibration(4, cores=2.0, links=0.0)
    dp4, pipe = Layout(dp=4, m=2), Layout(dp=2, pp=2, m=4)
    times = {(name, layout.pp): estimate(model, calibrated_cluster(c, 1e9), layout, 8, precision="fp32",
                                         calibration=c).seconds["compute"]
             for name, c in (("full", full), ("shared", shared)) for layout in (dp4, pipe)}
    # every rank busy (DP 4): the speed measured while all computed, whatever the cores
    assert times[("shared", 1)] == pytest.approx(times[("full", 1)])
    # a pipeline's light first stage idles, and its busy last stage gets more than its share of 2 cores for 4 ranks
    assert times[("full", 2)] * 0.5 < times[("shared", 2)] < times[("full", 2)]


@pytest.mark.parametrize("m", [1, 8])
def test_each_compute_is_priced_by_the_ranks_computing_during_it(m):
    """2 ranks on 1 core, a balanced 2-stage pipeline: a compute alone runs at a whole core's speed, one beside the
    other rank's at half. With one micro-batch nothing overlaps (half the time of 2 ranks on 2 cores); with eight,
    most of the work overlaps, so it runs nearer the shared speed than the step's mean demand (1 - bubble) says,
    and the fill and the drain, computed alone, shrink the bubble."""
    model = ModelShape.from_config(TINY)
    own_core, one_core = (_calibration(2, cores=c, links=0.0, head_forward=0.0, head_backward=0.0) for c in (2.0, 1.0))
    own, shared = (estimate(model, calibrated_cluster(c, 1e9), Layout(dp=1, pp=2, m=m), m, precision="fp32",
                            calibration=c) for c in (own_core, one_core))
    ratio = shared.seconds["compute"] / own.seconds["compute"]
    if m == 1:
        assert ratio == pytest.approx(0.5) and shared.bubble == pytest.approx(own.bubble)
    else:
        assert 1 - own.bubble + 0.03 < ratio < 1.0, ratio
        assert shared.bubble < own.bubble - 0.03, (shared.bubble, own.bubble)


def test_a_calibration_prices_what_it_measured_and_refuses_the_rest():
    model = ModelShape.from_config(TINY)
    cal = _calibration(4, cores=4.0)
    cluster = calibrated_cluster(cal, 1e9)
    with pytest.raises(ValueError, match="no compute at TP 1 with 32 tokens per micro-batch"):
        estimate(model, cluster, Layout(dp=4, micro_batch=2, m=1), 8, precision="fp32", calibration=cal)
    assert "calibrated model prices DP × PP × TP only" in estimate(model, cluster, Layout(dp=2, cp=2, m=4), 8,
                                                                    calibration=cal).reasons[-1]
    with pytest.raises(ValueError, match="the calibration measured 4 ranks, the cluster has 8"):
        plan(model, h100_cluster(8), 8, calibration=cal)


def test_calibrate_on_two_ranks_then_plan_and_the_cache_is_per_machine_and_world_size(tmp_path, monkeypatch):
    """The whole loop on real ranks, fast (short measuring windows): measured, cached, read back; another world
    size or another machine measures again."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with distlab.Ranks(2, threads=1) as ranks:
        cal = calibrate(ranks, TINY, micro_batch=(1,), window=0.02)
        assert cal.source == "measured" and cal.world_size == 2 and sorted(cal.compute) == ["tp1-rows16",
                                                                                            "tp2-rows16"]
        assert list((tmp_path / "distlab" / "calibration").glob("*-world2.json"))
        assert cal.peak_flops > 0 and 0 < cal.cores <= 2 and cal.per_param_updated > 0
        assert cal.compute["tp2-rows16"].collectives_forward > 0 and cal.compute["tp1-rows16"].matmul_rate > 0
        assert {"all_reduce/2", "reduce_scatter/2", "all_gather/2", "send/2"} <= set(cal.links)
        again = calibrate(ranks, TINY, micro_batch=(1,), window=0.02)
        assert again.source == "cache" and again.compute == cal.compute and again.links == cal.links
        model = ModelShape.from_config(TINY)
        result = plan(model, calibrated_cluster(cal, 1e9), 4, precision="fp32", cp=(1,), micro_batch=(1,),
                      zero=(1,), calibration=cal)
        assert {(e.layout.dp, e.layout.pp, e.layout.tp) for e in result.feasible} == {(2, 1, 1), (1, 2, 1), (1, 1, 2)}
        for e in result.feasible:
            assert e.calibrated and e.step_time == pytest.approx(sum(e.seconds.values())) and 0 < e.mfu < 1
        assert result.find(tp=2).seconds["tp"] > 0 and result.find(dp=2).seconds["dp exposed"] > 0
        lines = prediction_lines(result.best, model)
        assert lines[0] == f"predicted for {result.best.layout} (calibrated on this machine):"
        shapes = (cal.model, (1,), (1, 2))
        assert load_cached(cal.machine, 2, *shapes).compute == cal.compute
        assert load_cached({**cal.machine, "cpu": "another CPU"}, 2, *shapes) is None  # another machine
        assert load_cached(cal.machine, 2, cal.model, (1, 2), (1, 2)) is None  # other shapes planned
    with distlab.Ranks(1, threads=1) as one:
        fresh = calibrate(one, TINY, micro_batch=(1,), window=0.02)
    assert fresh.source == "measured" and fresh.world_size == 1 and not fresh.links  # another world size
    assert len(list((tmp_path / "distlab" / "calibration").glob("*.json"))) == 2
