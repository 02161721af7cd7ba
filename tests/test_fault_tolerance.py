"""Lab 12: checkpoints are complete or refused, restarts resume bit for bit after a real SIGKILL,
sharded checkpoints load at another world size, hangs and corrupted replicas are named, the
guard skips and rolls back consistently on every rank, and the cadence formulas hold."""

import copy
import math
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

import distlab
from distlab.fault_tolerance import (
    LLAMA3,
    CheckpointError,
    Fault,
    MetricsLog,
    ShuffledOrder,
    SpikeGuard,
    TrainState,
    async_save_checkpoint,
    corrupt_file,
    daly_interval,
    diagnose_nonfinite,
    find_divergent_replicas,
    fingerprint,
    flip_bit,
    grad_norm_outliers,
    guarded_train,
    hang_in_recv,
    hang_suspects,
    job_mtbf_hours,
    latest_checkpoint,
    load_checkpoint,
    local_grad_norm,
    make_training,
    partial_checkpoints,
    plan_cadence,
    read_checkpoint,
    resumable_train,
    run_with_restarts,
    save_checkpoint,
    train_step_ddp,
    verify_checkpoint,
    waste_fraction,
    young_interval,
)
from distlab.fault_tolerance.reshard import fsdp_job
from distlab.fault_tolerance.stall import stall_summary, timed_training
from distlab.fault_tolerance.stragglers import find_stragglers, pace_by_rank, straggler_steps
from distlab.model import GPT, GPTConfig, synthetic_batch
from distlab.runtime.launch import CollectiveTimeout, RankCrashed

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=2, d_model=16)
SMALL = dict(cfg=CFG, batch_size=4, n_items=10)  # 10 sequences, batches of 4: epochs wrap mid-run


# Jobs defined here travel to the ranks by value: a rank need not import pytest and this file.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = [pytest.mark.timeout(180)]


def _ranks(n):
    return distlab.Ranks.shared(n)  # the checkers' (and the notebook's) groups


def _single_process_checkpoint(root, step=3, cfg=CFG):
    """A real DCP checkpoint written without a process group (DCP's no-dist mode)."""
    model = GPT(cfg, seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _, loss = model(*synthetic_batch(cfg, 2, 0))
    loss.backward()
    optimizer.step()
    state = TrainState(model, optimizer, ShuffledOrder(8, 2), step=step)
    return save_checkpoint({"train": state}, root, step), model


# ---------------------------------------------------------------- checkpoints on disk

def test_a_committed_checkpoint_verifies_and_reads_back(tmp_path, one_thread):
    path, model = _single_process_checkpoint(tmp_path)
    assert path.name == "step_00000003" and latest_checkpoint(tmp_path) == path
    manifest = verify_checkpoint(tmp_path)  # a root resolves to its latest
    assert manifest["step"] == 3 and manifest["world_size"] == 1 and ".metadata" in manifest["files"]
    flat = read_checkpoint(path)
    assert flat["train.step"] == 3 and flat["train.data.position"] == 0
    for name, value in model.state_dict().items():
        assert torch.equal(flat[f"train.model.{name}"], value)
    assert "train.optim.state.tok_emb.weight.exp_avg" in flat


def test_missing_partial_corrupted_and_incompatible_checkpoints_are_refused(tmp_path, one_thread):
    with pytest.raises(CheckpointError, match="no checkpoint at .*: the directory does not exist"):
        verify_checkpoint(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match=r"^no complete checkpoint in .*\S$"):
        verify_checkpoint(tmp_path)
    path, _ = _single_process_checkpoint(tmp_path)
    partial = tmp_path / "step_00000009.partial"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half a shard")
    assert partial_checkpoints(tmp_path) == [partial] and latest_checkpoint(tmp_path) == path
    with pytest.raises(CheckpointError, match="step_00000009.partial is a partial checkpoint.*the last complete one "
                                              "is step_00000003"):
        verify_checkpoint(partial)
    other = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=16))
    state = TrainState(other, torch.optim.AdamW(other.parameters()), ShuffledOrder(8, 2))
    with pytest.raises(CheckpointError, match="does not fit this model: it has no train.model.blocks.1"):
        load_checkpoint({"train": state}, path)
    wider = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=2, d_model=32))
    state = TrainState(wider, torch.optim.AdamW(wider.parameters()), ShuffledOrder(8, 2))
    with pytest.raises(CheckpointError, match=r"train.model.tok_emb.weight has shape \(64, 16\) in the checkpoint "
                                              r"but \(64, 32\) here"):
        load_checkpoint({"train": state}, path)
    corrupt_file(path / "__0_0.distcp")
    with pytest.raises(CheckpointError, match="step_00000003 is corrupted: __0_0.distcp has CRC-32"):
        load_checkpoint({"train": TrainState(GPT(CFG), torch.optim.AdamW(GPT(CFG).parameters()))}, tmp_path)


def test_data_order_resumes_exactly_across_epochs():
    order = ShuffledOrder(10, 4, seed=3)
    served = [order.next_batch() for _ in range(3)]  # 12 of 10: the third batch wraps into epoch 1
    assert order.epoch == 1 and sorted(torch.cat(served)[:10].tolist()) == list(range(10))
    saved = order.state_dict()
    ahead = [order.next_batch() for _ in range(4)]
    resumed = ShuffledOrder(10, 4, seed=3)
    resumed.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(ahead, [resumed.next_batch() for _ in range(4)]))
    with pytest.raises(ValueError, match="seed 3, 10 items.*seed 4, 10 items"):
        ShuffledOrder(10, 4, seed=4).load_state_dict(saved)
    with pytest.raises(ValueError, match="batch_size"):
        ShuffledOrder(3, 4)


# ---------------------------------------------------------------- bits, hashes, guards, diagnosis

def test_flip_bit_and_fingerprints():
    t = torch.tensor([0.75, -0.0, 1.0])
    assert flip_bit(t, 0, 0) == (0.75, 0.75 + 2**-24)  # the last mantissa bit: one ulp
    assert flip_bit(t, 2, 31) == (1.0, -1.0)
    assert flip_bit(t, 2, 30) == (-1.0, float("-inf"))  # the top exponent bit of 1.0: all ones, infinity
    with pytest.raises(IndexError):
        flip_bit(t, 3, 0)
    with pytest.raises(ValueError, match="bit 32"):
        flip_bit(t, 0, 32)
    big = torch.randn(100_000)
    twin = big.clone()
    flip_bit(twin, 77_777, 0)
    assert float(big.sum()) == float(twin.sum())  # a float sum cannot see it
    assert fingerprint(big) != fingerprint(twin)  # the bits can
    assert fingerprint(torch.tensor([0.0])) != fingerprint(torch.tensor([-0.0]))


def test_spike_guard_skips_rolls_back_and_keeps_bad_steps_out_of_its_history():
    guard = SpikeGuard(window=4, loss_factor=1.5, patience=2, warmup=3)
    assert [guard.decide(v, 1.0) for v in (4.0, 3.9, 3.8)] == ["ok"] * 3
    assert guard.decide(float("nan"), float("nan")) == "skip" and "non-finite" in guard.reason
    assert guard.decide(9.0, 1.0) == "rollback" and "2 bad steps in a row" in guard.reason
    assert guard.decide(9.0, 1.0) == "skip" and "loss spike" in guard.reason
    assert list(guard.losses) == [4.0, 3.9, 3.8]
    assert guard.decide(3.7, 10.0) == "rollback" and "gradient-norm spike" in guard.reason
    assert guard.decide(3.7, 1.1) == "ok"
    with pytest.raises(ValueError, match="warmup"):
        SpikeGuard(window=2, warmup=3)


def test_diagnosis_names_fp16_overflow_division_by_zero_and_corrupted_weights(one_thread):
    model = GPT(CFG, seed=0)
    x, y = synthetic_batch(CFG, 2, 0)
    assert diagnose_nonfinite(model, x, y).kind == "finite"
    assert diagnose_nonfinite(model, x, y, torch.zeros_like(y)).kind == "loss-division-by-zero"
    grown = copy.deepcopy(model)
    with torch.no_grad():  # grow one layer until its output peaks at twice fp16's largest value
        peak = grown.blocks[0].mlp.fc(grown.blocks[0].ln2(grown.tok_emb(x) + grown.pos_emb.weight[:x.shape[1]]))
        grown.blocks[0].mlp.fc.weight.mul_(2 * 65504 / float(peak.abs().max()))
    assert diagnose_nonfinite(grown, x, y).kind == "finite"  # fp32 holds it
    found = diagnose_nonfinite(grown.half(), x, y)
    assert (found.kind, found.where) == ("fp16-overflow", "blocks.0.mlp.fc") and "65504" in found.detail
    flipped = copy.deepcopy(model)
    flip_bit(flipped.blocks[0].attn.qkv.weight.data, 5, 30)
    found = diagnose_nonfinite(flipped, x, y)
    assert (found.kind, found.where) == ("corrupted-parameter", "blocks.0.attn.qkv.weight")
    assert "element 5" in str(found)


def test_young_daly_and_the_llama3_failure_rate():
    assert LLAMA3.job_mtbf_hours == pytest.approx(54 * 24 / 419)
    assert job_mtbf_hours(16_384) == pytest.approx(3.093, rel=1e-3)
    assert job_mtbf_hours(1024) == pytest.approx(16 * job_mtbf_hours(16_384))
    tau = young_interval(60, 3600)
    assert tau == pytest.approx(math.sqrt(2 * 60 * 3600))
    assert waste_fraction(tau, 60, 3600) < min(waste_fraction(f * tau, 60, 3600) for f in (0.8, 1.25))
    assert young_interval(1, 1e6) == pytest.approx(daly_interval(1, 1e6), rel=1e-3)  # Daly → Young as δ/M → 0
    assert daly_interval(100, 40) == 40  # δ ≥ 2M: checkpoint every MTBF
    plan = plan_cadence(16_384, 60, restart_seconds=600)
    assert plan.interval_minutes == pytest.approx(young_interval(60, plan.mtbf_hours * 3600) / 60)
    assert plan.lost_minutes_per_failure == pytest.approx(plan.interval_minutes / 2 + 10)
    bounded = plan_cadence(16_384, 0.01, write_seconds=120)
    assert bounded.interval_minutes == 2 and bounded.write_bound  # an async write bounds it: back-to-back saves
    assert bounded.young_minutes == pytest.approx(young_interval(0.01, bounded.mtbf_hours * 3600) / 60)
    assert not plan.write_bound and not plan_cadence(8, 0.01, write_seconds=120).write_bound
    with pytest.raises(ValueError, match="checkpoint_cost"):
        young_interval(0, 10)


def test_find_stragglers_compares_each_rank_with_the_others_median():
    healthy = [[0.010, 0.011, 0.030], [0.012, 0.010, 0.011], [0.011, 0.012, 0.010], [0.010, 0.013, 0.011]]
    assert find_stragglers(healthy) == {}  # one slow step (rank 0's 30 ms) is not a slow rank
    slow = [list(t) for t in healthy]
    slow[2] = [0.020, 0.021, 0.019]
    assert find_stragglers(slow) == {2: pytest.approx(0.020 / 0.011)}
    assert find_stragglers(slow, factor=2.0) == {}  # 1.8x: below a stricter margin
    assert find_stragglers(slow, min_excess=0.010) == {}  # 9 ms slower: below what is worth acting on
    with pytest.raises(ValueError, match="at least 2 ranks"):
        find_stragglers([[0.01]])
    with pytest.raises(ValueError, match="factor must be above 1"):
        find_stragglers(slow, factor=1.0)


def test_the_timeline_legend_calls_a_background_write_by_its_name():
    import matplotlib  # noqa: PLC0415  only this test draws

    matplotlib.use("Agg")
    from distlab.runtime.timeline import Span, plot  # noqa: PLC0415  beside the matplotlib backend choice

    spans = [Span(0, "step", "compute", 0.0, 0.1), Span(0, "background write", "comm", 0.1, 0.3)]
    ax = plot(spans, labels={"comm": "background write"})
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["background write", "compute"]


def test_hang_suspects_from_a_collective_timeout():
    mismatch = CollectiveTimeout("x", {0: "all_reduce", 1: "all_reduce", 2: "recv", 3: "all_reduce"}, "mismatch")
    assert hang_suspects(mismatch, 4) == [2]
    computing = CollectiveTimeout("x", {0: "wait(all_reduce)", 2: "all_reduce", 3: "all_reduce"}, "slow")
    assert hang_suspects(computing, 4) == [1]
    assert hang_suspects(CollectiveTimeout("x", {}, "hang"), 4) == []


# ---------------------------------------------------------------- on real ranks (failures that end a group come last)

def test_async_save_writes_what_sync_save_writes_and_both_are_timed(tmp_path):
    def both(root):
        setup = make_training(**SMALL)
        train_step_ddp(setup, setup.order.next_batch())
        setup.state.step = 1
        save_checkpoint({"train": setup.state}, f"{root}/sync", 1)
        pending = async_save_checkpoint({"train": setup.state}, f"{root}/async", 1)
        train_step_ddp(setup, setup.order.next_batch())  # training goes on while it writes
        return str(pending.wait())

    _ranks(2).run(both, args=(str(tmp_path),), show_output=False)
    sync, asynchronous = (read_checkpoint(tmp_path / kind / "step_00000001") for kind in ("sync", "async"))
    assert sync.keys() == asynchronous.keys()
    for key, value in sync.items():
        assert torch.equal(value, asynchronous[key]) if isinstance(value, torch.Tensor) else value == asynchronous[key]
    runs = {mode: [list(_ranks(2).run(timed_training, args=(str(tmp_path / mode), mode),
                                      kwargs=dict(steps=4, save_every=2, cfg=CFG), show_output=False))]
            for mode in ("sync", "async")}
    summary = stall_summary(runs)
    assert summary["sync"]["saves"] == summary["async"]["saves"] == 2
    assert summary["async"]["background"] > 0 and summary["ratio"] > 0
    assert all(r["state_bytes"] > 0 for r in runs["sync"][0])
    assert latest_checkpoint(tmp_path / "async").name == "step_00000004"
    with pytest.raises(ValueError, match="mode must be one of"):
        timed_training(str(tmp_path), "later")


def test_the_guard_decides_alike_on_every_rank_and_rolls_back(tmp_path):
    kwargs = dict(bad={5: ("empty", (1,)), 6: ("empty", (1,)), 7: ("empty", (0,))}, save_every=2, **SMALL)
    run = _ranks(2).run(guarded_train, args=(str(tmp_path), 9, SpikeGuard(warmup=2, patience=3)), kwargs=kwargs,
                        show_output=False)
    decisions = [[r["decision"] for r in out["records"]] for out in run]
    assert decisions[0] == decisions[1] == ["ok"] * 5 + ["skip", "skip", "rollback", "ok"]
    assert run[0]["records"][7]["rolled_back_to"] == 4
    assert all(torch.equal(v, run[1]["weights"][k]) for k, v in run[0]["weights"].items())


def test_fsdp_checkpoint_reshards_from_4_ranks_to_2_and_to_1(tmp_path):
    job = dict(cfg=CFG, batch_size=4)
    four = _ranks(4).run(fsdp_job, args=(str(tmp_path),), kwargs=dict(job, train_steps=1), show_output=False)
    two = _ranks(2).run(fsdp_job, args=(str(tmp_path),), kwargs=dict(job, load=True, train_steps=1),
                        show_output=False)
    assert two[0]["loaded_from"] == {"step": 1, "world_size": 4}
    saved, loaded = four[0]["before_save"], two[0]["after_load"]
    assert saved.keys() == loaded.keys() and any(k.endswith("exp_avg_sq") for k in saved)
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert two[0]["shard_bytes"] == 2 * four[0]["shard_bytes"]
    whole = read_checkpoint(latest_checkpoint(tmp_path))  # the 2-rank shards, read back by one process
    for key, value in two[0]["before_save"].items():
        name = "train." + key.replace("optim.", "optim.state.", 1)
        assert torch.equal(whole[name], value), key


def test_one_slow_rank_paces_every_rank_and_is_found_by_its_compute_time():
    delay = 0.06
    run = _ranks(3).run(straggler_steps, kwargs=dict(steps=6, slow_rank=1, delay=delay, cfg=CFG, batch_size=2),
                        show_output=False)
    pace = pace_by_rank(run)
    assert [p["rank"] for p in pace] == [0, 1, 2] and all(len(r["step"]) == 6 for r in run)
    assert all(p["step"] >= 0.9 * pace[1]["compute"] for p in pace)  # every rank's step lasts the slow compute
    for fast in (0, 2):  # the healthy ranks spend the sleep waiting in the all-reduce; the slow one hardly waits
        assert pace[fast]["all_reduce"] - pace[1]["all_reduce"] >= 0.5 * delay
    assert list(find_stragglers([r["compute"] for r in run], min_excess=delay / 2)) == [1]
    with pytest.raises(distlab.RankFailed, match="ValueError: slow_rank must be a rank of the 3-rank job"):
        _ranks(3).run(straggler_steps, kwargs=dict(steps=1, slow_rank=3, cfg=CFG), show_output=False)


def test_replica_hashes_and_gradient_norms_name_the_corrupted_rank():
    def job():
        setup = make_training(cfg=CFG, batch_size=3, n_items=9)
        if dist.get_rank() == 1:
            flip_bit(setup.model.blocks[0].mlp.fc.weight.data, 3, 30)
        suspects = find_divergent_replicas(setup.model)
        x, y = synthetic_batch(CFG, 1, dist.get_rank())
        _, loss = setup.model(x, y)
        loss.backward()
        return suspects, grad_norm_outliers(local_grad_norm(setup.model))[0]

    assert all(r == ({1: ["blocks.0.mlp.fc.weight"]}, [1]) for r in _ranks(3).run(job, show_output=False))


def test_a_killed_rank_restarts_from_the_last_checkpoint_bit_for_bit(tmp_path):
    reference = _ranks(2).run(resumable_train, args=(str(tmp_path / "reference"), 7, 3), kwargs=SMALL,
                              show_output=False)[0]
    report = run_with_restarts(resumable_train, 2, str(tmp_path / "killed"), kwargs=dict(SMALL, steps=7, save_every=3),
                               faults={0: Fault(rank=1, step=4)}, ranks=_ranks(2))
    first, second = report.attempts
    assert first.failed_rank == 1 and "killed by signal SIGKILL" in first.outcome and first.resumed_from is None
    assert second.outcome == "finished" and second.resumed_from.endswith("step_00000003")
    resumed = report.run[0]
    assert resumed["start"] == 3 and resumed["losses"] == {s: reference["losses"][s] for s in range(3, 7)}
    assert all(torch.equal(v, reference["weights"][k]) for k, v in resumed["weights"].items())
    curves = MetricsLog(tmp_path / "killed" / "metrics.jsonl").curves()
    assert sorted(curves[0]) == [0, 1, 2, 3] and sorted(curves[1]) == [3, 4, 5, 6]


def test_a_rank_killed_while_saving_leaves_a_partial_checkpoint_that_is_never_loaded(tmp_path):
    root = tmp_path / "ckpt"
    with pytest.raises(RankCrashed, match="rank 0 exited without finishing its job"):
        _ranks(2).run(resumable_train, args=(str(root), 7, 3), kwargs=dict(SMALL, fault=Fault(0, 6, "save")),
                      show_output=False)
    assert [p.name for p in partial_checkpoints(root)] == ["step_00000006.partial"]
    assert latest_checkpoint(root).name == "step_00000003"
    with pytest.raises(CheckpointError, match="partial checkpoint"):
        verify_checkpoint(root / "step_00000006.partial")
    resumed = _ranks(2).run(resumable_train, args=(str(root), 7, 3), kwargs=SMALL, show_output=False)[0]
    assert resumed["start"] == 3 and partial_checkpoints(root) == []  # the retried save replaced the debris
    with pytest.raises(distlab.RankFailed, match="a majority needs at least 3 replicas"):
        _ranks(2).run(lambda: find_divergent_replicas(GPT(CFG)), show_output=False)


def test_a_hung_rank_is_named_by_the_watchdog():
    def job():
        setup = make_training(cfg=CFG, batch_size=4, n_items=8)
        for step in range(3):
            if step == 1 and dist.get_rank() == 2:
                hang_in_recv(3)
            train_step_ddp(setup, setup.order.next_batch())

    with pytest.raises(CollectiveTimeout) as info:
        distlab.launch(job, 4, collective_timeout=2, show_output=False)
    assert info.value.kind == "mismatch" and info.value.waiting[2] == "recv"
    assert hang_suspects(info.value, 4) == [2]
