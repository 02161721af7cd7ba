"""Labs 00 and 02 checkers: the references pass; lab 00's wrong answers fail naming the rank and the case; a
deadlock fails fast; an untouched stub is 'not attempted'. Lab 02's wrong answers are its table's
(test_wrong_answers_lab02.py)."""

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

import distlab
from distlab import collectives as C
from distlab.grading import CheckFailed, harness, lab00, lab02
from distlab.grading.lab00 import check_mean_across_ranks, check_rank_sum
from distlab.grading.lab02 import check_ring_all_reduce

# Send this module's functions to the ranks by value: a fresh rank then need not import pytest and this file.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leftover_ranks")]


# ---------------------------------------------------------------- student answers, right and wrong

def rank_sum():
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    return dist.get_rank(), dist.get_world_size(), total.item()


def rank_sum_by_formula():
    n = dist.get_world_size()
    return dist.get_rank(), n, n * (n - 1) // 2


def mean_across_ranks(x):
    dist.all_reduce(x)
    return x / dist.get_world_size()


def mean_forgets_to_divide(x):
    dist.all_reduce(x)
    return x


def deadlocking_ring(x):
    incoming = torch.empty_like(x)
    dist.recv(incoming, (dist.get_rank() - 1) % dist.get_world_size())  # everyone waits, nobody sends
    return x


def stub(*args):
    raise NotImplementedError("Exercise 2.1: replace this line with your solution")


# ---------------------------------------------------------------- the references pass

def test_exercise_ids_and_points():
    assert [e.id for e in lab00.EXERCISES if not e.is_quiz] == ["0.1", "0.2"]
    assert [e.id for e in lab02.EXERCISES if not e.is_quiz] == ["2.1", "2.2", "2.3", "2.4"]
    assert all(e.points > 0 for e in lab00.EXERCISES + lab02.EXERCISES)


def test_references_pass_every_checker(no_leftover_ranks):
    for exercise_id, fn, detail in [
            ("0.1", rank_sum, "2, 3 and 4 ranks"), ("0.2", mean_across_ranks, "random tensors"),
            ("2.1", C.ring_all_reduce, "each rank sent 2(N-1)/N*M bytes"),
            ("2.2", C.ring_all_gather, "each rank sent (N-1)/N*M bytes"),
            ("2.3", C.all_reduce_via_reduce_scatter, "reduce-scatter + all-gather"),
            ("2.4", C.tree_all_reduce, "at most ceil(log2 N) messages")]:
        result = distlab.check(exercise_id, fn, quiet=True)
        assert result.status == "passed" and result.points == result.max_points, result
        assert detail in result.detail


# ---------------------------------------------------------------- wrong answers fail clearly

def test_rank_sum_without_all_reduce_fails():
    with pytest.raises(CheckFailed, match=r"rank 0 of 2 called dist.all_reduce 0 times"):
        check_rank_sum(rank_sum_by_formula)
    with pytest.raises(CheckFailed, match=r"return a tuple \(rank, world_size, total\)"):
        check_rank_sum(lambda: 3)


def test_mean_that_forgets_to_divide_names_rank_and_case():
    with pytest.raises(CheckFailed, match=r"^rank 0 \(world size 2, \d+ float32\): the mean differs from the reference "
                                          r"by up to .* \(at \[\d+\]: .*, expected .*\): that is the sum over 2 ranks: "
                                          r"divide by the world size"):
        check_mean_across_ranks(mean_forgets_to_divide)
    with pytest.raises(CheckFailed, match=r"rank 0 returned None"):
        check_mean_across_ranks(lambda x: None)


def test_deadlocked_ring_fails_fast_with_the_hint_for_what_happened(monkeypatch, no_leftover_ranks):
    monkeypatch.setattr(harness, "RANK_GROUP_COLLECTIVE_TIMEOUT", 1.5)
    with pytest.raises(CheckFailed, match=r"^your ring deadlocked on 2 ranks: every rank waits to receive \(rank 0 "
                                          r"waits for rank 1, rank 1 waits for rank 0\) and none is sending.* "
                                          r"Hint: start each send before the matching receive \(dist.isend\)"):
        check_ring_all_reduce(deadlocking_ring)


@pytest.mark.parametrize("exercise_id", ["0.1", "0.2", "2.1", "2.2", "2.3", "2.4"])
def test_stub_is_not_attempted(exercise_id, capsys, no_leftover_ranks):
    result = distlab.check(exercise_id, stub)
    assert result.status == "not attempted" and result.points == 0
    assert "(not attempted)" in capsys.readouterr().out
