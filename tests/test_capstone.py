"""The capstone's own pieces: the resumable DP-sharded loader and the document split (distlab.data.loader), the
end-to-end worker on real ranks against one process and across a killed rank, and the run card's arithmetic."""

import math
import re
from pathlib import Path

import matplotlib
import nbformat
import numpy as np
import pytest
import torch

import distlab
from distlab.capstone import (
    BAND,
    RunCard,
    capstone_worker,
    checkpoint_weights,
    dense_state,
    derive_report,
    lr_at,
    measured_terms,
    reference_losses,
    replica_losses,
    responsible_term,
    runnable,
    runnable_best,
)
from distlab.data.loader import (
    ResumableTokenLoader,
    compact_vocabulary,
    split_documents,
    unigram_loss,
    window_order,
)
from distlab.data.shards import read_index, read_shard, write_shard
from distlab.fault_tolerance import latest_checkpoint
from distlab.model import GPTConfig, synthetic_batch
from distlab.parallel3d.grid import Grid
from distlab.parallel3d.planner import Cluster, Layout, ModelShape, plan
from distlab.runtime import progress
from wrong_answers import solution_namespace

pytestmark = pytest.mark.timeout(300)

SOLUTION = Path(__file__).resolve().parents[1] / "solutions" / "13_capstone.ipynb"
CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32, tied_embeddings=False)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    """A learnable token stream (the course's Markov chain) as one uint16 shard of 40 documents."""
    x, _ = synthetic_batch(CFG, 40, 0, seed=3)
    path = tmp_path_factory.mktemp("tokens") / "shard_00000.bin"
    spans = [row.numpy().astype(np.uint16) for row in x]
    write_shard(path, spans, [{"id": f"doc{i}", "offset": i * CFG.seq_len, "length": CFG.seq_len}
                              for i in range(len(spans))])
    return path


@pytest.fixture(scope="module")
def ranks():
    group = distlab.Ranks(4, collective_timeout=60)
    yield group
    group.close()


# ---------------------------------------------------------------- data

def test_split_puts_each_document_wholly_on_one_side(tokens, tmp_path):
    split = split_documents([tokens], tmp_path, val_fraction=0.25, seed=1)
    ids = {side: [d["id"] for d in read_index(getattr(split, side))["documents"]] for side in ("train", "val")}
    assert not set(ids["train"]) & set(ids["val"]) and len(ids["train"]) + len(ids["val"]) == 40
    assert 0 < len(ids["val"]) < 40 and split.documents == {k: len(v) for k, v in ids.items()}
    stream = read_shard(tokens)
    for side in ("train", "val"):
        for doc in read_index(getattr(split, side))["documents"]:
            original = int(doc["id"][3:]) * CFG.seq_len
            got = read_shard(getattr(split, side))[doc["offset"]:doc["offset"] + doc["length"]]
            assert np.array_equal(got, stream[original:original + CFG.seq_len]), doc
    assert split_documents([tokens], tmp_path / "again", val_fraction=0.25, seed=1).documents == split.documents
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        split_documents([tokens], tmp_path, val_fraction=1.0)


def test_dp_ranks_share_no_window_and_an_epoch_reads_each_window_once(tokens):
    loaders = [ResumableTokenLoader(tokens, 8, 6, d, 3, seed=5) for d in range(3)]
    whole = ResumableTokenLoader(tokens, 8, 6, seed=5)
    seen = []
    for _ in range(whole.steps_per_epoch):
        rows = [loader.next_batch() for loader in loaders]
        x, y = whole.next_batch()
        assert torch.equal(torch.cat([r[0] for r in rows]), x) and torch.equal(torch.cat([r[1] for r in rows]), y)
        assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one
        seen += [tuple(row.tolist()) for row in x]
    assert len(seen) == len(set(seen)) == whole.steps_per_epoch * 6  # none twice within the epoch
    assert whole.tokens_seen == whole.steps_per_epoch * 6 * 8
    whole.next_batch()
    assert whole.epoch == 1 and torch.equal(whole.order, window_order(whole.windows, 5, 1))


def test_a_restored_loader_continues_exactly_at_any_dp_size(tokens):
    straight = ResumableTokenLoader(tokens, 8, 4, seed=0)
    for _ in range(straight.steps_per_epoch - 1):
        straight.next_batch()
    state = straight.state_dict()
    expected = [straight.next_batch()[0] for _ in range(3)]  # across the epoch boundary
    halves = [ResumableTokenLoader(tokens, 8, 4, d, 2, seed=0) for d in range(2)]
    for loader in halves:
        loader.load_state_dict(state)
    got = [torch.cat([loader.next_batch()[0] for loader in halves]) for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    with pytest.raises(ValueError, match="its position would name other tokens"):
        ResumableTokenLoader(tokens, 4, 4, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="must split evenly over dp=3"):
        ResumableTokenLoader(tokens, 8, 4, 0, 3)


def test_compact_vocabulary_and_the_unigram_baseline():
    train = np.array([7, 7, 9, 50000])
    mapping, vocab = compact_vocabulary(train, multiple_of=8)
    assert vocab == 8 and mapping[7] == 0 and mapping[9] == 1 and mapping[50000] == 2 and mapping[11] == 3
    counts = np.bincount(mapping[train], minlength=vocab) + 1.0
    val = mapping[np.array([7, 9, 11, 7])]
    want = -np.log(counts[val[1:]] / counts.sum()).mean()
    assert unigram_loss(mapping[train], val, vocab) == pytest.approx(want)


def test_the_learning_rate_warms_up_then_decays_by_a_cosine_to_the_floor():
    rates = [lr_at(step, 1.0, 4, 20) for step in range(20)]
    assert rates[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(rates[3:], rates[4:])) and lr_at(20, 1.0, 4, 20) == pytest.approx(0.1)
    assert lr_at(12, 1.0, 4, 20) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))


# ---------------------------------------------------------------- the worker on real ranks

def test_tensor_parallel_zero1_with_clipping_equals_one_process(ranks, tokens, tmp_path):
    """DP 2 × TP 2 with ZeRO-1: the clipped norm sums ZeRO shards and TP slices, a replicated tensor once."""
    kw = dict(cfg=CFG, dp=2, pp=1, tp=2, m=2, batch_size=4, steps=4, train_path=str(tokens), lr=3e-2, warmup=1,
              save_every=100)
    run = ranks.run(capstone_worker, args=(str(tmp_path),), kwargs=kw)
    losses = replica_losses(run)
    reference = reference_losses(CFG, str(tokens), 4, 4, lr=3e-2, warmup=1)
    assert max(abs(losses[k] - reference[k]) for k in losses) < 1e-5
    assert max(run[0]["norms"].values()) > 1.0  # clipping was active
    assert [r["coords"]["tp"] for r in run] == [0, 1, 0, 1]


def test_bf16_autocast_trains_close_to_fp32_and_auto_keeps_fp32_on_a_cpu(ranks, tokens, tmp_path):
    kw = dict(cfg=CFG, dp=2, pp=2, tp=1, m=2, batch_size=4, steps=3, train_path=str(tokens), lr=1e-2, warmup=1,
              save_every=100)
    bf16 = ranks.run(capstone_worker, args=(str(tmp_path / "bf16"),), kwargs=dict(kw, precision="bf16"))
    auto = ranks.run(capstone_worker, args=(str(tmp_path / "auto"),), kwargs=dict(kw, precision="auto"))
    assert bf16[0]["precision"] == "bf16" and auto[0]["precision"] == "fp32"
    reference = reference_losses(CFG, str(tokens), 4, 3, lr=1e-2, warmup=1)
    close = [abs(a - b) for a, b in zip(replica_losses(bf16).values(), reference)]
    exact = [abs(a - b) for a, b in zip(replica_losses(auto).values(), reference)]
    assert max(exact) < 1e-5 and 0 < max(close) < 0.05  # bf16 rounds, by a few hundredths of a nat at most


def test_fp8_swaps_each_block_linear_and_trains_close_to_fp32(ranks, tokens, tmp_path):
    """Lab 09's Float8Linear in every block linear of each stage (the head stays fp32), emulated on a CPU."""
    kw = dict(cfg=CFG, dp=2, pp=2, tp=1, m=2, batch_size=4, steps=3, train_path=str(tokens), lr=1e-2, warmup=1,
              save_every=100)
    fp8 = ranks.run(capstone_worker, args=(str(tmp_path),), kwargs=dict(kw, precision="fp8"))
    assert {r["precision"] for r in fp8} == {"fp8 (emulated)"}
    for r in fp8:
        block = f"blocks.{r['coords']['pp']}"  # one block per stage
        assert r["fp8_layers"] == [f"{block}.attn.qkv", f"{block}.attn.proj", f"{block}.mlp.fc", f"{block}.mlp.proj"]
    reference = reference_losses(CFG, str(tokens), 4, 3, lr=1e-2, warmup=1)  # the fp32 grid equals it to 1e-5
    gaps = [abs(a - b) for a, b in zip(replica_losses(fp8).values(), reference)]
    # measured: at most 3.1e-3 nats, 7.6e-4 relative; the fp32 grid's rounding is below 1e-5
    assert max(gaps) > 1e-4 and max(g / b for g, b in zip(gaps, reference)) < 1e-2


def test_the_steps_show_one_bar_for_the_job_where_a_person_watches_and_none_headless(ranks, tokens, tmp_path,
                                                                                     monkeypatch, capfd):
    kw = dict(cfg=CFG, dp=2, pp=2, tp=1, m=2, batch_size=4, steps=3, train_path=str(tokens), save_every=2)
    ranks.run(capstone_worker, args=(str(tmp_path / "headless"),), kwargs=kw)
    assert capfd.readouterr() == ("", "")  # pytest is headless, as nbval and CI
    monkeypatch.setattr(progress, "audience", lambda: "terminal")
    run = ranks.run(capstone_worker, args=(str(tmp_path / "resumed"),), kwargs=dict(kw, steps=2))
    resumed = ranks.run(capstone_worker, args=(str(tmp_path / "resumed"),), kwargs=kw)  # from the step-2 checkpoint
    assert [r["start"] for r in (run[0], resumed[0])] == [0, 2]
    drawn = capfd.readouterr().err.replace("\r", "\n")
    for last in ("2/2", "3/3"):  # the resumed run's bar starts at step 2 of 3
        assert re.search(rf"capstone steps: 100%\|.*\| {last} \[", drawn), drawn
    assert "[rank" not in drawn  # the launcher's one bar, no rank's own
    ranks.run(capstone_worker, args=(str(tmp_path / "off"),), kwargs=dict(kw, progress=False))
    assert "capstone steps" not in capfd.readouterr().err


def test_an_unknown_precision_or_fp8_with_tensor_parallelism_fails_in_one_line(tokens, tmp_path):
    kw = dict(cfg=CFG, dp=1, pp=1, m=1, batch_size=4, steps=1, train_path=str(tokens))
    with pytest.raises(ValueError, match="precision='fp16': choose 'fp32', 'bf16', 'fp8' or 'auto'"):
        capstone_worker(str(tmp_path), tp=1, precision="fp16", **kw)
    with pytest.raises(ValueError, match="precision='fp8' needs tp=1, got tp=2: the tensor-parallel layers"):
        capstone_worker(str(tmp_path), tp=2, precision="fp8", **kw)


def test_the_notebooks_kill_cell_runs_twice_in_a_row_resuming_bit_for_bit_and_the_report_reads_the_run(
        ranks, tokens, tmp_path, capsys):
    """Lab 13's "Break it" cell, as the notebook has it, run twice in a row (a student re-running it after fixing
    13.3): each time a fresh job, killed and resumed, equal to the uninterrupted run bit for bit, no traceback."""
    matplotlib.use("Agg")
    namespace = solution_namespace("13_capstone.ipynb", 13, only=("13.3",))  # 13.3 passed: an error propagates
    kill_cell = next(c.source for c in nbformat.read(SOLUTION, as_version=4).cells
                     if c.cell_type == "code" and "KILL = Fault(" in c.source)
    steps, every = 12, 2  # the cell kills rank 1 at step 2·every + 7
    kw = dict(cfg=CFG, dp=2, pp=2, tp=1, m=2, batch_size=4, steps=steps, train_path=str(tokens), lr=1e-2, warmup=2,
              save_every=every)
    clean = ranks.run(capstone_worker, args=(str(tmp_path / "clean"),), kwargs=kw)
    namespace.update(ranks=ranks, WORLD=4, RUN=kw, WORK=tmp_path, clean=clean, losses=replica_losses(clean),
                     STEPS=steps, SAVE_EVERY=every)
    for _ in range(2):
        exec(kill_cell, namespace)  # noqa: S102  the solution notebook's own cell
    printed = capsys.readouterr().out
    assert printed.count("equal the uninterrupted run bit for bit") == 2, printed
    # from the newest committed checkpoint (step 10's, or an earlier one if rank 1 died before an async save ended)
    assert len(re.findall(r"rank 1 died at step 11; the relaunch resumed at step \d+ ", printed)) == 2, printed
    assert "✗" not in printed, printed
    assert len(list(tmp_path.glob("broken-*"))) == 2

    grid = Grid(dp=2, pp=2, tp=1)
    saved = checkpoint_weights(latest_checkpoint(tmp_path / "clean"), CFG, grid)
    assert all(torch.equal(saved[k], v) for k, v in dense_state(clean, CFG, 1).items())
    trace = clean.trace()
    figures = derive_report(list(clean), trace, 1e6, 4 * CFG.seq_len, 1e9)
    later = range(1, steps)
    assert figures["bytes"]["pp"] == sorted(max(r["bytes"][k]["pp"] for r in clean) for k in later)[5] > 0
    assert figures["bytes"]["tp"] == 0 and figures["bytes"]["dp"] > 0 and 0 < figures["bubble"] < 1
    assert figures["mfu"] == pytest.approx(1e6 * figures["tokens_per_second"] / 4 / 1e9)
    terms = measured_terms(list(clean), trace)
    assert set(terms) == {"forward and backward", "bubble", "after the schedule"} and all(t >= 0 for t in
                                                                                          terms.values())


# ---------------------------------------------------------------- the planner's side and the run card

def test_the_layout_is_the_fastest_feasible_one_the_worker_runs_or_a_one_line_error():
    model = ModelShape.from_config(GPTConfig(vocab_size=4096, seq_len=64, n_layer=4, n_head=4, d_model=64,
                                             tied_embeddings=False))
    machine = Cluster("8 ranks", 8, gpus_per_node=8, hbm_bytes=8e6, intra_node_bandwidth=1e9,
                      inter_node_bandwidth=1e9, peak_flops=3e10, intra_node_latency=1e-4, inter_node_latency=1e-4)
    result = plan(model, machine, 8, precision="fp32", cp=(1,))
    best = runnable_best(result)
    assert runnable(best.layout) and best.feasible
    assert all(e.step_time >= best.step_time for e in result.feasible if runnable(e.layout))
    every = runnable_best(result, axes=("dp", "pp", "tp"))
    assert min(every.layout.dp, every.layout.pp, every.layout.tp) >= 2 and every.step_time >= best.step_time
    assert not runnable(Layout(dp=4, zero=3)) and not runnable(Layout(dp=2, pp=2, v=2))
    tiny = Cluster("8 small ranks", 8, gpus_per_node=8, hbm_bytes=1e5)
    with pytest.raises(ValueError, match="no layout the capstone runs fits 8 small ranks"):
        runnable_best(plan(model, tiny, 8, precision="fp32", cp=(1,)))
    with pytest.raises(ValueError, match="no layout the capstone runs with DP and PP and TP at least 2 fits"):
        runnable_best(plan(model, machine, 8, precision="fp32", cp=(1,), tp=(1,)), axes=("dp", "pp", "tp"))


def test_the_run_card_ratio_one_rule_and_the_term_it_blames():
    row = RunCard("step time", 0.03, 0.02, "ms")
    assert row.ratio == pytest.approx(1.5) and not row.within and "OFF" in str(row)
    assert RunCard("bytes", 99.0, 100.0, "bytes").within and RunCard("bytes", 0, 0, "bytes").within
    assert BAND == (0.75, pytest.approx(4 / 3))  # a third either way, for every figure
    assert RunCard("pipeline bubble", 0.26, 0.2, "").within and not RunCard("pipeline bubble", 0.32, 0.2, "").within
    measured = {"forward and backward": 0.05, "bubble": 0.01, "after the schedule": 0.02}
    predicted = {"forward and backward": 0.01, "bubble": 0.01, "after the schedule": 0.015}
    blamed = responsible_term(measured, predicted)
    assert blamed.startswith("forward and backward (50.0 ms measured against 10.0 ms predicted)") and "5.00×" in blamed
    assumed = responsible_term(measured, predicted, calibrated=False, matmul_efficiency=0.7)
    assert "14%" in assumed and "calibrate the machine" in assumed
