"""Lab 06: schedules are valid and reach their bubble in simulation; every schedule on real
ranks (the V schedules and a hand-written one included) equals single-process training and
PyTorch's pipelining; the edge cases (m < p, layers not divisible by stages, a rank failing
mid-schedule) end cleanly; the checkers pass the reference and explain typical mistakes."""

import itertools
import os
import time

import pytest
import torch

import distlab
from distlab.grading import check, lab06
from distlab.model import GPTConfig
from distlab.pipeline_parallel import (
    RECEIVE_AHEAD,
    Action,
    ScheduleError,
    balanced_partition,
    bubble_fraction,
    check_setup,
    compute_order,
    even_partition,
    gpipe,
    interleaved_1f1b,
    interleaved_bubble_fraction,
    make_schedule,
    measured_bubble,
    measured_stage_times,
    one_f_one_b,
    parse_schedule,
    peak_in_flight,
    pipeline_worker,
    reference_states,
    replay,
    run_schedule,
    simulate,
    stage_costs,
    torch_pipelining_worker,
    train,
    validate,
    with_p2p,
    zero_bubble_h1,
)
from distlab.runtime.launch import RankCrashed, RankFailed
from distlab.runtime.timeline import Span

pytestmark = [pytest.mark.timeout(180)]

CFG = GPTConfig(vocab_size=48, seq_len=8, n_layer=4, n_head=2, d_model=16, tied_embeddings=False)


@pytest.fixture(scope="module")
def ranks2():
    """Two warm ranks for every real-rank test of this module that needs two."""
    with distlab.Ranks(2, collective_timeout=10) as ranks:
        yield ranks


@pytest.fixture
def warm_groups_closed():
    """Checkers launch on shared warm groups; end them before no_leftover_ranks looks."""
    yield
    distlab.shutdown()


def executor(actions, stages, micro_batches, p, num_stages):
    """The reference executor in the student's signature (exercise 6.4)."""
    return run_schedule(actions, stages, micro_batches, p=p, num_stages=num_stages).losses


def assert_equal_to_reference(run, cfg, steps, batch, **kwargs):
    ref = reference_states(cfg, steps=steps, batch_size=batch, **kwargs)
    for out in run:
        for name, tensor in out["state"].items():
            diff = (tensor - ref.state_dict[name]).abs().max().item()
            assert diff <= 1e-6, f"rank {out['rank']}: {name} differs by {diff}"
    last = [out for out in run if out["losses"][0] is not None]
    assert len(last) == 1 and last[0]["losses"] == pytest.approx(ref.losses, abs=1e-5)


# ---------------------------------------------------------------- partitions (no ranks)

def test_even_partition_is_contiguous_and_uneven_splits_differ_by_one():
    assert even_partition(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    assert even_partition(8, 8) == [range(i, i + 1) for i in range(8)]
    with pytest.raises(ValueError, match="cannot split 3 layers into 4 stages"):
        even_partition(3, 4)


def test_balanced_partition_is_optimal_and_counts_embedding_and_head():
    costs = [1.0] * 8
    split = balanced_partition(costs, 2, first_extra=0.2, last_extra=3.0)
    assert [len(s) for s in split] == [5, 3]  # the heavy head takes layers off the last stage
    assert max(stage_costs(split, costs, 0.2, 3.0)) == pytest.approx(6.0)
    for costs in ([3, 1, 1, 1, 1, 3], [1, 9, 1, 1], [2, 2, 2, 2, 2]):  # brute force over every cut
        for n in range(1, len(costs) + 1):
            best = min(max(stage_costs([range(a, b) for a, b in zip((0,) + cuts, cuts + (len(costs),))], costs))
                       for cuts in itertools.combinations(range(1, len(costs)), n - 1))
            assert max(stage_costs(balanced_partition(costs, n), costs)) == pytest.approx(best)


# ---------------------------------------------------------------- schedules (no ranks)

@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
def test_schedules_are_valid_and_simulate_to_their_bubble(name):
    for p, m in itertools.product((1, 2, 3, 4), (1, 2, 3, 4, 8, 16)):
        schedule = make_schedule(name, p, m)
        validate(schedule, m)
        sim = simulate(schedule, m)
        if name == "zb-h1":
            if m >= p:
                assert sim.bubble == pytest.approx((p - 1) / (3 * m + p - 1))
            assert sim.bubble <= bubble_fraction(p, m) + 1e-12 and max(sim.peak_in_flight) <= p
        else:
            assert sim.bubble == pytest.approx(bubble_fraction(p, m))
        if name == "gpipe":
            assert sim.peak_in_flight == [m] * p
        if name == "1f1b":
            assert sim.peak_in_flight == [min(p - r, m) for r in range(p)]


def test_interleaved_reaches_its_bubble_and_needs_m_multiple_of_p():
    for p, v, k in itertools.product((2, 3, 4), (2, 3, 4), (1, 2, 4)):
        m = p * k
        schedule = interleaved_1f1b(p, m, v)
        validate(schedule, m, v)
        assert simulate(schedule, m, v).bubble == pytest.approx(interleaved_bubble_fraction(p, m, v))
    assert interleaved_bubble_fraction(4, 16, 2) == pytest.approx(3 / 35)
    with pytest.raises(ValueError, match="m=6 to be a multiple of the pipeline ranks p=4.*use m=8"):
        interleaved_1f1b(4, 6, 2)


def test_interleaved_with_one_stage_per_rank_is_1f1b_and_its_memory_is_the_warmup_formula():
    """v = 1 is 1F1B (p in flight on rank 0, not 2p - 1); v >= 2 holds p + (p-1)/v, more than 1F1B, as
    :func:`peak_in_flight` says and the simulation measures (issue 26 item 3)."""
    for p, k in itertools.product((2, 3, 4, 6), (1, 2, 3)):
        m = p * k
        assert compute_order(interleaved_1f1b(p, m, 1)) == compute_order(one_f_one_b(p, m))
        for v in (1, 2, 3, 4):
            sim = simulate(interleaved_1f1b(p, m, v), m, v)
            assert sim.peak_in_flight[0] == pytest.approx(peak_in_flight(p, m, v))
            if v > 1 and m > p:
                assert peak_in_flight(p, m, v) == pytest.approx(p + (p - 1) / v) and peak_in_flight(p, m, v) > p
    assert peak_in_flight(4, 16, 1) == 4


def test_validate_names_the_problem():
    good = one_f_one_b(2, 2)
    missing = [good[0], [a for a in good[1] if a != Action("B", 1, 1)]]
    with pytest.raises(ScheduleError, match="rank 1 never runs 1B1"):
        validate(missing, 2)
    swapped = [list(good[0]), list(good[1])]  # rank 1 receives the two activations in the other order
    i, j = swapped[1].index(Action("RECV_F", 0, 1)), swapped[1].index(Action("RECV_F", 1, 1))
    swapped[1][i], swapped[1][j] = swapped[1][j], swapped[1][i]
    with pytest.raises(ScheduleError, match="in the same order|comes before"):
        validate(swapped, 2)
    # rank 0 waits for micro-batch 0's gradient before it sends micro-batch 0's activation
    deadlock = [[Action("F", 0, 0), Action("RECV_B", 0, 0), Action("B", 0, 0), Action("SEND_F", 0, 0)],
                [Action("RECV_F", 0, 1), Action("F", 0, 1), Action("B", 0, 1), Action("SEND_B", 0, 1)]]
    with pytest.raises(ScheduleError, match="deadlocks: rank 0 waits to run 0B0.*rank 1 waits to run 1F0"):
        validate(deadlock, 1)
    assert with_p2p(compute_order(good)) == good


def test_bad_setups_fail_in_one_line_before_work():
    with pytest.raises(ValueError, match="4 stages .* need at least 4 layers; the model has 3"):
        check_setup(4, 8, 3, 8)
    with pytest.raises(ValueError, match="batch of 10 sequences does not split into m=4"):
        check_setup(2, 4, 4, 10)
    with pytest.raises(ValueError, match="schedule must be one of"):
        check_setup(2, 4, 4, 8, schedule="pipedream")
    with pytest.raises(ValueError, match="v=2 is only for 'interleaved'"):
        make_schedule("1f1b", 2, 4, v=2)


def test_measured_bubble_uses_the_common_window_and_the_busiest_stage():
    spans = [Span(0, "F0", "compute", 0.0, 1.0), Span(0, "B0", "compute", 3.0, 5.0),
             Span(1, "F0", "compute", 1.0, 2.5), Span(1, "B0", "compute", 2.5, 3.0),
             Span(1, "irecv", "comm", 0.0, 1.0)]  # waiting is not work
    bubble = measured_bubble(spans, 2)
    assert bubble.window == 5.0 and bubble.per_rank == pytest.approx((0.4, 0.6))
    assert bubble.bottleneck == 0 and bubble.fraction == pytest.approx(0.4)
    assert bubble.mean_idle == pytest.approx(0.5)


# ---------------------------------------------------------------- real ranks

@pytest.mark.usefixtures("no_leftover_ranks")
def test_four_stages_memory_and_uneven_layers():
    cfg = GPTConfig(**{**CFG.__dict__, "n_layer": 6})  # 6 layers on 4 stages: 2, 2, 1, 1
    with distlab.Ranks(4, collective_timeout=10) as ranks:
        peaks = {}
        for schedule in ("gpipe", "1f1b"):
            run = ranks.run(pipeline_worker, kwargs=dict(schedule=schedule, cfg=cfg, m=6, batch_size=6, steps=1,
                                                         track_memory=True))
            assert_equal_to_reference(run, cfg, 1, 6)
            assert [len(r["layers"][r["rank"]]) for r in run] == [2, 2, 1, 1]
            peaks[schedule] = run
        assert [r["peak_in_flight"] for r in peaks["gpipe"]] == [6] * 4
        assert [r["peak_in_flight"] for r in peaks["1f1b"]] == [4, 3, 2, 1]
        ratio = peaks["gpipe"][0]["peak_activation_bytes"] / peaks["1f1b"][0]["peak_activation_bytes"]
        assert 1.3 < ratio <= 6 / 4 + 0.01  # 6 micro-batches' activations against 4
        run = ranks.run(pipeline_worker, kwargs=dict(schedule="1f1b", cfg=cfg, m=2, batch_size=4, steps=1))
        assert_equal_to_reference(run, cfg, 1, 4)  # fewer micro-batches than stages: no hang


def _fail_mid_schedule(how, stamp):
    import torch.distributed as dist

    from distlab.pipeline_parallel import run_schedule as real_run

    def failing(actions, stages, micro_batches, p, num_stages):
        if dist.get_rank() == 1:
            stage = stages[1]
            original = stage.forward

            def forward(x, calls=[0]):
                calls[0] += 1
                if calls[0] == 3:  # the third micro-batch: rank 0 is mid-schedule, waiting on rank 1
                    with open(stamp, "w") as f:
                        f.write(repr(time.time()))
                    if how == "raise":
                        raise RuntimeError("stage 1 failed on micro-batch 2")
                    os._exit(3)
                return original(x)

            stage.forward = forward
        return real_run(actions, stages, micro_batches, p=p, num_stages=num_stages).losses

    return pipeline_worker("1f1b", CFG, m=6, batch_size=6, executor=failing)


@pytest.mark.parametrize("how, error", [("raise", RankFailed), ("exit", RankCrashed)])
@pytest.mark.usefixtures("no_leftover_ranks")
def test_a_rank_failing_mid_schedule_ends_the_launch_within_seconds(how, error, tmp_path):
    stamp = tmp_path / "failed_at"
    with pytest.raises(error, match="rank 1"):
        distlab.launch(_fail_mid_schedule, 2, args=(how, str(stamp)), collective_timeout=60, show_output=False)
    ended_after = time.time() - float(stamp.read_text())
    assert ended_after < 15  # seconds from the failure to every rank gone; rank 0's irecv would wait 60


# ---------------------------------------------------------------- checkers

@pytest.mark.usefixtures("no_leftover_ranks")
def test_checkers_pass_the_reference_and_explain_typical_mistakes(warm_groups_closed):
    assert check("6.1", even_partition, balanced_partition).status == "passed"
    assert check("6.2", gpipe, one_f_one_b).status == "passed"
    assert check("6.3", interleaved_1f1b).status == "passed"
    assert check("6.4", executor).status == "passed"
    assert check("6.5", zero_bubble_h1).status == "passed"

    def ignores_costs(costs, n, first=0.0, last=0.0):
        return even_partition(len(costs), n)

    def ignores_head(costs, n, first=0.0, last=0.0):  # balanced, but the embedding and head count for nothing
        return balanced_partition(costs, n)

    with pytest.raises(AssertionError, match="a split whose largest stage costs .* exists"):
        lab06.check_partitions(even_partition, ignores_costs)
    with pytest.raises(AssertionError, match="add first_extra to the first stage and last_extra to the last"):
        lab06.check_partitions(even_partition, ignores_head)
    with pytest.raises(AssertionError, match="holds .* micro-batches in flight; 1F1B holds at most"):
        lab06.check_schedules(gpipe, gpipe)
    with pytest.raises(AssertionError, match=r"interleaved_1f1b\(4, 6, 2\): returned normally"):
        lab06.check_interleaved(lambda p, m, v: interleaved_1f1b(p, p * (m // p + 1) if m % p else m, v))

    def no_scaling(actions, stages, micro_batches, p, num_stages):  # the loss not divided by m
        out = run_schedule(actions, stages, micro_batches, p=p, num_stages=num_stages)
        for stage in stages.values():
            for q in stage.parameters():
                if q.grad is not None:
                    q.grad.mul_(len(micro_batches))
        return out.losses

    with pytest.raises(AssertionError, match=r"gradient is m=\d times too large: divide each micro-batch's loss by m"):
        lab06.check_executor(no_scaling)


@pytest.mark.usefixtures("no_leftover_ranks")
def test_untouched_stubs_are_not_attempted(warm_groups_closed):
    def stub(*args):
        raise NotImplementedError("Exercise 6.4: replace this line with your solution")

    for exercise, args in (("6.1", (stub, stub)), ("6.2", (stub, stub)), ("6.3", (stub,)), ("6.4", (stub,)),
                           ("6.5", (stub,)), ("6.6", (stub,))):
        assert check(exercise, *args).status == "not attempted"


# ---------------------------------------------------------------- GPU (skipped without CUDA)

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_single_rank_pipeline_matches_the_cpu_reference():
    """On one GPU (NCCL, world size 1): two virtual stages hand over locally; fp32 without TF32
    matches the CPU reference to float rounding, and the bf16 train entry point learns."""
    def worker():
        torch.set_float32_matmul_precision("highest")  # no TF32: fp32 matmuls, as on the CPU
        return pipeline_worker("interleaved", CFG, m=2, v=2, batch_size=4, steps=2)

    run = distlab.launch(worker, 1, backend="nccl")
    assert run.backend == "nccl"
    ref = reference_states(CFG, steps=2, batch_size=4)
    worst = max((t - ref.state_dict[k]).abs().max().item() for k, t in run[0]["state"].items())
    assert worst < 1e-4, worst
    summary = distlab.launch(train, 1, backend="nccl",
                             kwargs=dict(steps=8, microbatches=4, lr=3e-3))[0]
    assert summary["loss_last"] < summary["loss_first"]


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("interleaved", 2)])
def test_replaying_a_timelines_own_stage_times_reproduces_it(schedule, v):
    """``replay`` reads whole-rank work off stage spans (an interleaved span is 1/v of it) and simulates again:
    on a timeline with unequal ranks it must give back every span where it was."""
    sch = make_schedule(schedule, 2, 4, v)
    timeline = simulate(sch, 4, v, forward_cost=[1.0, 1.5], backward_cost=[2.0, 3.5])
    assert measured_stage_times(timeline.spans, 2, v) == {"F": [1.0, 1.5], "B": [2.0, 3.5]}
    again = replay(timeline.spans, sch, 4, v)
    assert [(s.rank, s.label, s.start, s.end) for s in again.spans] == [
        (s.rank, s.label, s.start, s.end) for s in timeline.spans]


# ---------------------------------------------------------------- real ranks, two of them kept warm for the module
# (last in the file: the tests above check that no rank outlives them, which these warm ranks would)

def test_every_schedule_equals_single_process_training_torch_pipelining_and_trains(ranks2):
    tied = GPTConfig(**{**CFG.__dict__, "tied_embeddings": True})
    for schedule, m, v, cfg in [("gpipe", 4, 1, CFG), ("1f1b", 4, 1, tied), ("1f1b", 1, 1, CFG),
                                ("interleaved", 2, 2, tied), ("zb-h1", 3, 1, CFG)]:
        run = ranks2.run(pipeline_worker, kwargs=dict(schedule=schedule, cfg=cfg, m=m, v=v, batch_size=2 * m,
                                                      steps=1, lr=0.1, seed=3, data_seed=5))
        assert_equal_to_reference(run, cfg, 1, 2 * m, lr=0.1, seed=3, data_seed=5)
        activation = 2 * cfg.seq_len * cfg.d_model * 4  # rows x seq x d_model fp32, per micro-batch
        if cfg is CFG and v == 1:  # (a tied embedding adds its gradient exchange)
            assert run.comm[0].ops["isend"].payload_bytes == m * activation  # one activation per micro-batch
            assert "send" not in run.comm[0].ops and "recv" not in run.comm[1].ops
    run = ranks2.run(torch_pipelining_worker, kwargs=dict(schedule="1f1b", cfg=CFG, m=4, batch_size=8, steps=1,
                                                          warmup=0))
    assert max(r["grad_diff"] for r in run) <= 1e-6
    assert run[1]["ours_losses"] == pytest.approx(run[1]["torch_losses"], abs=1e-6)
    summaries = ranks2.run(train, kwargs=dict(steps=6, microbatches=2, rows=2, n_layer=2, d_model=32, n_head=2,
                                              vocab_size=64, seq_len=16, lr=3e-3))  # the torchrun entry point
    assert summaries[0]["loss_first"] == summaries[1]["loss_first"]
    assert summaries[0]["loss_last"] < summaries[0]["loss_first"]
    assert summaries[0]["sent_bytes_per_step"] == 2 * 2 * 16 * 32 * 4  # m activations of rows x seq x d, fp32


def test_receives_are_posted_two_computes_early(ranks2):
    """The last stage's receive of each activation is issued RECEIVE_AHEAD = 2 computes before the forward that
    needs it, so the sender finds the buffer posted and the transfer overlaps those computes (order of issue)."""
    assert RECEIVE_AHEAD == 2
    run = ranks2.run(pipeline_worker, kwargs=dict(schedule="1f1b", cfg=CFG, m=4, batch_size=8, steps=1, warmup=0,
                                                  return_state=False), show_output=False)
    issued = sorted((s for s in run.spans if s.rank == 1 and (s.label == "irecv" or s.kind == "compute")),
                    key=lambda s: s.start)
    assert [s.label for s in issued] == ["irecv", "irecv", "F0", "B0", "irecv", "F1", "B1", "irecv", "F2", "B2",
                                         "F3", "B3"]


def test_v_schedules_and_a_hand_written_one_equal_one_process_and_pytorchs(ranks2):
    """ZB-V and DualPipeV on real ranks: weights equal to one process (a tied embedding whose two ends share rank 0;
    fewer micro-batches than the V's 2p - 1), twice 1F1B's bytes; gradients equal to PyTorch's
    ScheduleZBVZeroBubble / ScheduleDualPipeV on the same stages, which give each rank the same order of computes;
    and a schedule written as text runs."""
    tied = GPTConfig(**{**CFG.__dict__, "tied_embeddings": True})
    activation = 2 * CFG.seq_len * CFG.d_model * 4
    for schedule, m, cfg in [("zb-v", 4, CFG), ("zb-v", 1, tied), ("dualpipev", 4, tied)]:
        run = ranks2.run(pipeline_worker, kwargs=dict(schedule=schedule, cfg=cfg, m=m, v=2, batch_size=2 * m, steps=1,
                                                      lr=0.1, seed=3, data_seed=5))
        assert_equal_to_reference(run, cfg, 1, 2 * m, lr=0.1, seed=3, data_seed=5)
        assert run[0]["stages"] == [0, 3] and run[1]["stages"] == [1, 2]
        assert [r["sent_bytes"] for r in run] == [2 * m * activation] * 2  # 1F1B: m activations per rank
    for schedule in ("zb-v", "dualpipev"):
        run = ranks2.run(torch_pipelining_worker, kwargs=dict(schedule=schedule, cfg=CFG, m=4, batch_size=8, steps=1,
                                                              warmup=0))
        assert max(r["grad_diff"] for r in run) <= 1e-6
        assert run[0]["ours_losses"] == pytest.approx(run[0]["torch_losses"], abs=1e-6)
        assert all(r["torch_order"] == r["ours_order"] for r in run), schedule
    text = "0F0,0F1,0F2,0B0,0B1,0B2\n1F0,1B0,1F1,1B1,1F2,1B2"  # by hand: rank 0 as GPipe, rank 1 as 1F1B
    run = ranks2.run(pipeline_worker, kwargs=dict(schedule=parse_schedule(text), cfg=CFG, m=3, batch_size=6, steps=1))
    assert_equal_to_reference(run, CFG, 1, 6)
