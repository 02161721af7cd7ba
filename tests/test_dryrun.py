"""Dry runs (distlab.parallel3d.dryrun): a rank stepped on the meta device over a fake process group sends and holds
exactly what the same rank of a real gloo job does; bad layouts fail in one line before anything starts."""

import time

import pytest
import torch

import distlab
from distlab.grading import lab11
from distlab.model import GPT, GPTConfig, count_params, synthetic_batch
from distlab.parallel3d.dryrun import (
    DryRunSpec,
    LiveBytes,
    compare,
    dry_run,
    explain,
    lab_config,
    rank_roles,
    rank_step,
)
from distlab.parallel3d.grid import Grid
from distlab.parallel3d.planner import Layout, ModelShape, estimate, h100_cluster

pytestmark = [pytest.mark.timeout(240)]

# the lab's GPT on DP 2 × PP 2 × TP 2 with every feature the 405B layout uses: sequence parallelism, interleaved
# 1F1B (two stages a rank), checkpointed blocks, ZeRO-1 in mixed precision
CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=4, n_head=2, d_model=32, tied_embeddings=False)
LAYOUT = Layout(dp=2, pp=2, tp=2, m=2, v=2, zero=1, checkpointing=True)


@pytest.fixture(scope="module")
def ranks8():
    yield distlab.Ranks.shared(8, "auto", lab11.COLLECTIVE_TIMEOUT)
    distlab.shutdown()


def test_a_dry_run_sends_and_holds_what_the_real_8_rank_run_does(ranks8):
    start = time.perf_counter()
    real = list(ranks8.run(rank_step, args=(DryRunSpec(CFG, LAYOUT, tuple(range(8))),)))
    real_seconds = time.perf_counter() - start
    dry = dry_run(CFG, LAYOUT, ranks=range(8))
    print(f"real 8-rank gloo step {real_seconds:.1f} s; dry run of the 8 ranks {dry.wall_seconds:.1f} s")
    assert all(r["loss"] is None or r["loss"] != r["loss"] for r in dry.ranks)  # no values dry: the loss is NaN
    for mine, theirs in zip(dry.ranks, real):
        assert mine["rank"] == theirs["rank"] and mine["role"] == theirs["role"]
        assert mine["comm"] == theirs["comm"], f"rank {mine['rank']}: the dry run's comm log differs from gloo's"
        assert any(axis == "dp" for _, axis, _ in mine["comm"]) and any(op == "isend" for op, _, _ in mine["comm"])
        for key in ("params", "grads", "optimizer", "activations", "peak"):
            a, b = mine["memory"][key], theirs["memory"][key]
            assert b > 0 and abs(a - b) <= 0.02 * b, f"rank {mine['rank']} {key}: dry run {a} B, gloo {b} B"
        for phase, measured in theirs["memory"]["phases"].items():  # each phase's peak and what made it, by kind
            ours, peak = mine["memory"]["phases"][phase], measured["peak"]
            for kind, b in dict(measured["kinds"], peak=peak).items():  # within 2% of the peak they make up
                a = ours["peak"] if kind == "peak" else ours["kinds"].get(kind, 0)
                assert abs(a - b) <= 0.02 * peak, f"rank {mine['rank']}, {phase}, {kind}: dry run {a} B, gloo {b} B"


def test_the_dry_runs_composition_computes_what_one_process_does(ranks8):
    """Sequence-parallel stages (the rank's position shard, the shard-shaped receive) with interleaving and
    checkpointing: in fp32 each replica's loss equals the dense GPT's on that replica's batch. (A position
    embedding restarted on each shard moves this loss by ~5e-3; bf16 rounding alone by ~3e-2, hence fp32.)"""
    real = ranks8.run(rank_step, args=(DryRunSpec(CFG, LAYOUT, tuple(range(8)), precision="fp32"),))
    gpt, rows = GPT(CFG), LAYOUT.m * LAYOUT.micro_batch
    last = [r for r in real if r["loss"] is not None]
    assert len(last) == LAYOUT.dp * LAYOUT.tp  # the last stage's ranks
    for r in last:
        expected = gpt(*synthetic_batch(CFG, rows, 0, seed=r["coords"]["dp"]))[1].item()
        assert abs(r["loss"] - expected) < 1e-5, f"rank {r['rank']}: loss {r['loss']}, one process {expected}"


def test_bad_layouts_fail_in_one_line_before_anything_starts():
    for layout, words in [(Layout(dp=2, pp=2, tp=2, cp=2), "cp=2"), (Layout(dp=2, pp=2, tp=2, zero=3), "zero=3"),
                          (Layout(dp=2, pp=2, tp=3), "tp=3"), (Layout(dp=2, pp=8, tp=2, m=8), "stages")]:
        with pytest.raises(ValueError, match=words) as error:
            dry_run(CFG, layout)
        assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="ranks"):
        dry_run(CFG, LAYOUT, ranks=[8])


def test_live_bytes_counts_new_storages_once_until_freed():
    kept = torch.ones(1000)
    with LiveBytes() as live:
        a = torch.empty(256)  # 1 KiB
        view, same = a[:10], a.add_(1)  # a view and an in-place result: no new memory
        b = kept * 2  # a new 4000 B
        del view, same, a
        assert live.live == 4000 and live.peak == 5024
        del b
    assert live.live == 0 and live.peak == 5024


def test_a_meta_gpt_has_the_shapes_and_no_storage():
    cfg = lab_config("405B")
    gpt = GPT(cfg, device="meta")
    assert all(p.device.type == "meta" for p in gpt.parameters())
    assert gpt.num_params() == count_params(cfg)
    assert abs(count_params(cfg) / ModelShape.from_preset("405B").n_params - 1) < 0.02  # the stand-in's size


def test_roles_and_the_planner_comparison_name_every_off_term():
    """A 1B-shaped job on 16 GPUs with checkpointing: each term against the planner's, and every term beyond the
    tolerance named by a known cause that accounts for it within 5%."""
    grid = Grid(dp=2, pp=4, tp=2)
    assert rank_roles(grid) == {"first stage": 0, "middle stage": 4, "last stage": 6}
    layout = Layout(dp=2, pp=4, tp=2, m=4, v=2, zero=1, checkpointing=True)
    cfg = lab_config("1B", seq_len=512)
    run = dry_run(cfg, layout)
    planned = estimate(ModelShape.from_config(cfg), h100_cluster(16), layout, 2 * 4, precision="mixed")
    terms = {t.name: t for t in compare(run, planned)}
    assert terms["PP bytes"].ratio == 1 and not terms["activations"].off
    assert terms["DP bytes"].off and terms["TP bytes"].off  # fp32 gradient reduction; no recomputed closing RS
    for term in terms.values():
        if term.off:
            why, accounted = explain(term, run, planned)
            assert accounted is not None and abs(accounted - 1) < 0.05, (term.name, term.ratio, why, accounted)
