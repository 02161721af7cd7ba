"""Lab 06 past 1F1B, without ranks: the V placement, ZB-V and DualPipeV as data (valid, their bubble and memory
against the closed forms and the literature's figures, twice 1F1B's messages), a schedule written by hand as text
(parsed, written back, its first problem named: a deadlock, a W before its I, a V mirrored the wrong way), and the
exercise's checker on the reference. Real ranks (equal to one process and to PyTorch's schedules) are in
``test_pipeline_parallel.py``, on its warm ranks."""

import itertools

import pytest

from distlab.grading import check, lab06
from distlab.pipeline_parallel import (
    Action,
    ScheduleError,
    bubble_fraction,
    check_setup,
    compute_order,
    dualpipe_v,
    dualpipe_v_bubble,
    make_schedule,
    messages_per_rank,
    one_f_one_b,
    parse_schedule,
    placement_of,
    schedule_csv,
    simulate,
    stage_placement,
    validate,
    with_p2p,
    zero_bubble_h1,
    zero_bubble_h1_bubble,
    zero_bubble_v,
)


def test_placements_looped_and_v():
    assert stage_placement(4, 2, "looped") == (0, 1, 2, 3, 0, 1, 2, 3)
    assert stage_placement(4, 2, "v") == (0, 1, 2, 3, 3, 2, 1, 0)  # rank r holds r and 2p-1-r
    assert stage_placement(2, 3, "v") == (0, 1, 1, 0, 0, 1)  # zig-zag on past two stages per rank
    assert placement_of(zero_bubble_v(3, 5)) == stage_placement(3, 2, "v")
    with pytest.raises(ValueError, match="'looped' or 'v'"):
        stage_placement(2, 2, "w")
    with pytest.raises(ScheduleError, match="stage 1 appears on rank 0 and on rank 1"):
        placement_of([[Action("F", 0, 0), Action("F", 0, 1)], [Action("B", 0, 1)]])


@pytest.mark.parametrize("name", ["zb-v", "dualpipev"])
def test_v_schedules_are_valid_with_1f1b_memory_or_half_a_micro_batch_more(name):
    """ZB-V at t_F = t_I = t_W: (p-1)/(6m+p-1) for m >= 2p (the sail-sg README's "0" is this, up to O(1/m)),
    p micro-batches in flight like 1F1B; DualPipeV (m >= 2p): the same bubble run pair by pair, p + 1/2 in
    flight (the DualPipe README's PP + 1 stages' activations, PP = 2p), its pairs fused: that README's bubble."""
    for p, m in itertools.product((2, 3, 4, 5), (1, 2, 3, 4, 6, 8, 10, 16, 32)):
        if name == "dualpipev" and m < 2 * p:
            with pytest.raises(ValueError, match=f"at least 2p = {2 * p} micro-batches"):
                make_schedule(name, p, m, 2)
            continue
        schedule = make_schedule(name, p, m, 2)
        validate(schedule, m, 2, placement="v")
        sim = simulate(schedule, m, 2)
        assert sim.bubble <= simulate(zero_bubble_h1(p, m), m).bubble + 1e-12 < bubble_fraction(p, m)
        if m >= p:
            assert simulate(zero_bubble_h1(p, m), m).bubble == pytest.approx(zero_bubble_h1_bubble(p, m))
        if m >= 2 * p:
            assert sim.bubble == pytest.approx((p - 1) / (6 * m + p - 1))
        if name == "zb-v":
            assert max(sim.peak_in_flight) <= p and (m < 2 * p or sim.peak_in_flight == [p] * p)
        else:
            assert sim.peak_in_flight == [p + 0.5] * p
            assert simulate(schedule, m, 2, fuse_pairs=True).bubble == pytest.approx(dualpipe_v_bubble(p, m))
        # every micro-batch crosses every rank boundary twice, forward and back: twice 1F1B's messages
        assert sum(messages_per_rank(schedule)) == 2 * sum(messages_per_rank(one_f_one_b(p, m))) == 4 * (p - 1) * m
    with pytest.raises(ValueError, match="two stages per rank in a V: pass v=2"):
        make_schedule("zb-v", 2, 4)


def test_zb_v_follows_its_phases():
    assert [repr(a) for a in compute_order(zero_bubble_v(2, 4))[1]] == (
        "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 1W2 2W3 1W3".split())
    assert [repr(a) for a in compute_order(dualpipe_v(2, 4))[0]] == (
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3".split())


def test_a_schedule_written_as_text_round_trips_and_gets_its_messages():
    schedule = zero_bubble_v(2, 4)
    text = schedule_csv(schedule)
    assert text.splitlines()[0].startswith("0F0,0F1,0F2,3F0,3I0,3W0")
    assert parse_schedule(text) == schedule  # compute actions only: with_p2p adds the sends and receives
    assert parse_schedule(schedule_csv(schedule, compute_only=False)) == schedule
    assert parse_schedule(["0F0, 0B0,,", "1F0 1B0"]) == one_f_one_b(2, 1)  # empty cells and spaces are fine
    with pytest.raises(ScheduleError, match=r"rank 1: cannot read '1UNSHARD'"):
        parse_schedule("0F0,0B0\n1UNSHARD,1F0,1B0")


def test_the_validator_names_the_first_problem_of_a_hand_written_schedule():
    # rank 0 runs each micro-batch's backward before the next forward, rank 1 both forwards first: each waits
    deadlock = parse_schedule("0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1")
    with pytest.raises(ScheduleError, match=r"deadlocks: rank 0 waits to run 0B0 \(its output gradient from rank 1 "
                                            r"never arrives\); rank 1 waits to run 1F1 \(its activation from rank 0"):
        validate(deadlock, 2)
    w_first = [list(ops) for ops in zero_bubble_v(2, 4)]
    i, j = w_first[0].index(Action("I", 0, 3)), w_first[0].index(Action("W", 0, 3))
    w_first[0][i], w_first[0][j] = w_first[0][j], w_first[0][i]
    with pytest.raises(ScheduleError, match=r"rank 0: 3W0 comes before 3I0 \(the weight gradient follows"):
        validate(w_first, 4, 2, placement="v")
    looped = with_p2p([[Action(a.kind, a.microbatch, a.stage if a.stage < 2 else 5 - a.stage) for a in ops]
                       for ops in compute_order(zero_bubble_v(2, 4))])  # rank r's second stage p + r, not 2p-1-r
    with pytest.raises(ScheduleError, match=r"rank 0: 2(RECV_)?F0 runs stage 2, which lives on rank 1 \(v placement\)"):
        validate(looped, 4, 2, placement="v")
    with pytest.raises(ScheduleError, match="never runs 1W0"):
        check_setup(2, 4, 4, 4, [ops for ops in parse_schedule("0F0,0F1,0F2,0F3,0B0,0B1,0B2,0B3\n"
                                                              "1F0,1I0,1F1,1B1,1F2,1B2,1F3,1B3")])


def test_the_v_schedule_checker_passes_zb_v_and_names_a_looped_placement():
    assert check("6.6", zero_bubble_v).status == "passed"

    def looped_zb_v(p, m):
        return with_p2p([[Action(a.kind, a.microbatch, a.stage if a.stage < p else 3 * p - 1 - a.stage) for a in ops]
                         for ops in compute_order(zero_bubble_v(p, m))])

    with pytest.raises(AssertionError, match="looped, as interleaved 1F1B.*2p - 1 - r"):
        lab06.check_v_schedule(looped_zb_v)
