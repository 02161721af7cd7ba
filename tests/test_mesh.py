"""The process-group grid and DP × PP × TP training on real gloo ranks, against one process."""

import re
import time

import pytest
import torch

import distlab
from distlab.grading import CheckFailed, lab11
from distlab.model import GPTConfig
from distlab.parallel3d.grid import (
    AXES,
    MEGATRON_ORDER,
    Grid,
    check_3d_setup,
    compare_with_reference,
    group_ranks_worker,
    measured_bytes_per_axis,
    order_table,
    parallel3d_worker,
)
from distlab.parallel3d.planner import Layout, ModelShape, bytes_per_axis
from distlab.runtime import progress

from processes import rank_processes

pytestmark = [pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def ranks8():
    """One warm group of 8 for the module, the checkers' own (same key); the module ends by proving
    that closing it leaves no rank process behind (instead of the per-test ``no_leftover_ranks``)."""
    yield distlab.Ranks.shared(8, "auto", lab11.COLLECTIVE_TIMEOUT)
    distlab.shutdown()
    deadline = time.monotonic() + 5
    while rank_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not rank_processes(), f"rank processes left behind: {rank_processes()}"

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, tied_embeddings=False)


def test_grid_coordinates_and_groups_follow_the_dp_pp_tp_layout():
    grid = Grid(2, 2, 2)
    assert grid.ranks().squeeze(2).tolist() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert grid.axes == ("dp", "pp", "tp")
    assert grid.coords(5) == {"dp": 1, "pp": 0, "cp": 0, "tp": 1}
    assert grid.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for rank in range(grid.world):
        c = grid.coords(rank)
        assert grid.ranks()[c["dp"], c["pp"], c["cp"], c["tp"]] == rank
        for axis in grid.axes:  # a group varies exactly one coordinate
            group = grid.group_of(rank, axis)
            assert len(group) == grid.shape[axis]
            others = [a for a in AXES if a != axis]
            assert all(grid.coords(r)[a] == c[a] for r in group for a in others)


def test_megatron_lms_default_order_puts_pp_outermost():
    """The example in Megatron-LM's initialize_model_parallel docstring (megatron/core/parallel_state.py): 16 GPUs,
    TP 2, PP 4 (so DP 2) under its default order="tp-cp-ep-dp-pp"."""
    grid = Grid(dp=2, pp=4, tp=2, order=MEGATRON_ORDER)
    assert grid.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert sorted(grid.groups("tp")) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert grid.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert grid.coords(6) == {"dp": 1, "pp": 1, "cp": 0, "tp": 0} and grid.ranks()[1, 1, 0, 0] == 6
    table = order_table(Grid(2, 2, 2)).splitlines()
    assert table[1] == "rank 0 dp [0, 4]  pp [0, 2]  tp [0, 1] | dp [0, 2]  pp [0, 4]  tp [0, 1]"
    assert 'order="tp-cp-ep-dp-pp"' in table[-1]
    with pytest.raises(ValueError, match="must name each of"):
        Grid(2, 2, 2, order=("dp", "pp", "tp"))


def test_tp_stays_inside_a_node_and_dp_crosses_nodes():
    llama = Grid(dp=128, pp=16, tp=8)
    assert llama.world == 16384
    assert llama.inside_node(8) == {"dp": False, "pp": False, "cp": True, "tp": True}
    assert llama.nodes_spanned("pp", 8) == 16
    assert Grid(dp=2, pp=1, tp=16).nodes_spanned("tp", 8) == 2
    with_cp = Grid(dp=2, pp=2, tp=4, cp=2)  # Llama 3's [TP, CP, PP, DP]: TP × CP fill a node
    assert with_cp.groups("cp")[:2] == [[0, 4], [1, 5]] and with_cp.inside_node(8)["cp"]
    assert with_cp.coords(13) == {"dp": 0, "pp": 1, "cp": 1, "tp": 1}


def test_bad_sizes_are_one_line_errors():
    with pytest.raises(ValueError, match=r"world size 6 is not dp × pp × tp = 2 × 2 × 2 = 8"):
        Grid(2, 2, 2).check_world(6)
    with pytest.raises(ValueError, match="tp=0 must be a positive integer"):
        Grid(2, 2, 0)
    with pytest.raises(ValueError, match="untied embeddings"):
        check_3d_setup(GPTConfig(), Grid(1, 2, 1), m=2, batch_size=4)
    with pytest.raises(ValueError, match="does not split over dp=2"):
        check_3d_setup(CFG, Grid(2, 1, 1), m=1, batch_size=3)
    with pytest.raises(ValueError, match="tp=4 does not divide n_head=2"):
        check_3d_setup(CFG, Grid(1, 1, 4), m=1, batch_size=4)


def test_3d_runs_equal_one_process_and_groups_match_device_mesh(ranks8):
    steps, batch = 2, 8
    layouts = ranks8.run(group_ranks_worker, args=(Grid(2, 2, 2),))
    for r in layouts:
        grid = Grid(2, 2, 2)
        assert r["coords"] == grid.coords(r["rank"])
        assert r["ours"] == r["device_mesh"] == {a: grid.group_of(r["rank"], a) for a in grid.axes}
    megatron = Grid(2, 2, 2, order=MEGATRON_ORDER)  # init_device_mesh with its dimensions in Megatron's order agrees
    for r in ranks8.run(group_ranks_worker, args=(megatron,)):
        assert r["ours"] == r["device_mesh"] == {a: megatron.group_of(r["rank"], a) for a in megatron.axes}
    for dp, pp, tp in [(2, 2, 2), (4, 1, 2)]:
        grid = Grid(dp, pp, tp)
        run = ranks8.run(parallel3d_worker, args=(CFG, dp, pp, tp), kwargs=dict(m=2, batch_size=batch, steps=steps))
        result = compare_with_reference(list(run), CFG, grid, batch, steps)
        assert result["loss_diff"] < 1e-5, (grid, result)
        assert result["worst_param"][2] < 1e-5, (grid, result["worst_param"])
        sent = measured_bytes_per_axis(list(run))
        predicted = bytes_per_axis(ModelShape.from_config(CFG), Layout(dp=dp, tp=tp, pp=pp, zero=0, m=2,
                                                                       micro_batch=batch // dp // 2),
                                   sequence_parallel=False, bytes_per_value=4)
        assert (sent["tp"], sent["pp"]) == (predicted["tp"], predicted["pp"]), (sent, predicted)
        # the planner splits every parameter over TP; LayerNorms, biases and pos_emb are replicated
        assert predicted["dp"] <= sent["dp"] <= 1.1 * predicted["dp"], (sent, predicted)


def test_the_3d_steps_show_one_bar_for_the_job_where_a_person_watches_and_none_headless(ranks8, monkeypatch,
                                                                                         capfd):
    kw = dict(m=2, batch_size=8, steps=2)
    ranks8.run(parallel3d_worker, args=(CFG, 2, 2, 2), kwargs=kw)
    assert capfd.readouterr() == ("", "")  # pytest is headless, as nbval and CI
    monkeypatch.setattr(progress, "audience", lambda: "terminal")
    ranks8.run(parallel3d_worker, args=(CFG, 2, 2, 2), kwargs=kw)
    drawn = capfd.readouterr().err.replace("\r", "\n")
    assert re.search(r"3D steps: 100%\|.*\| 2/2 \[", drawn), drawn
    assert "[rank" not in drawn  # the launcher's one bar, no rank's own
    ranks8.run(parallel3d_worker, args=(CFG, 2, 2, 2), kwargs=dict(kw, progress=False))
    assert "3D steps" not in capfd.readouterr().err


def _summed(params, group, dp):
    for p in params:
        torch.distributed.all_reduce(p.grad, group=group)


def _grid_groups(world, dp, pp, tp):
    Grid(dp, pp, tp).check_world(world)
    return {axis: Grid(dp, pp, tp).groups(axis) for axis in ("dp", "pp", "tp")}


def _mfu(n, n_layer, d_model, seq_len, tokens_per_second, gpus, peak):
    return (6 * n + 12 * n_layer * d_model * seq_len) * tokens_per_second / (gpus * peak)


def _stub(*args):
    raise NotImplementedError("Exercise 11.1: build the groups")


def test_checkers_pass_the_reference_and_name_the_usual_mistakes(ranks8):
    from distlab.parallel3d.grid import average_gradients

    assert "6 grids" in lab11.check_grid_groups(_grid_groups)
    with pytest.raises(CheckFailed, match=r"rank 0's pp group is \[0, 1\], expected \[0, 2\]: PP ranks are tp apart"):
        lab11.check_grid_groups(lambda world, dp, pp, tp: {"dp": _grid_groups(world, dp, pp, tp)["dp"],
                                                           "pp": _grid_groups(world, dp, pp, tp)["tp"],
                                                           "tp": _grid_groups(world, dp, pp, tp)["pp"]})
    assert distlab.check("11.1", _stub, quiet=True).status == "not attempted"
    assert "2 × 2 × 2 on 8 ranks" in lab11.check_sync_gradients(average_gradients)
    with pytest.raises(CheckFailed, match="summed over the DP group, not averaged"):
        lab11.check_sync_gradients(_summed)
    assert "3 runs" in lab11.check_mfu(_mfu)
    with pytest.raises(CheckFailed, match="attention FLOPs .* are missing"):
        lab11.check_mfu(lambda n, L, d, s, tps, gpus, peak: 6 * n * tps / (gpus * peak))
    from distlab.parallel3d.planner import bytes_per_axis as planner_bytes

    def predicted(cfg, dp, pp, tp, m, micro_batch):
        return planner_bytes(ModelShape.from_config(cfg), Layout(dp=dp, tp=tp, pp=pp, zero=0, m=m,
                                                                 micro_batch=micro_batch),
                             sequence_parallel=False, bytes_per_value=4)

    assert "7 layouts" in lab11.check_predicted_bytes(predicted)

    def without_loss(cfg, dp, pp, tp, m, micro_batch):
        out = predicted(cfg, dp, pp, tp, m, micro_batch)
        return {"tp": out["tp"] - (m * 3 * micro_batch * cfg.seq_len * 4 if tp > 1 else 0), "pp": out["pp"]}

    with pytest.raises(CheckFailed, match="the loss's three all-reduces"):
        lab11.check_predicted_bytes(without_loss)
    assert len([e for e in lab11.EXERCISES if e.is_quiz]) >= 5
