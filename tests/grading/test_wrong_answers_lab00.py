"""Lab 00: answers students plausibly write, each run through its checker: every one fails, naming the mistake; the
solution notebook's own answers pass."""

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from distlab.mutants import lab_source, reference_namespace
from wrong_answers import checker_tests

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = [pytest.mark.timeout(180)]

SOLUTION = reference_namespace(lab_source(0))[0]


# ---------------------------------------------------------------- 0.1

def formula_beside_a_dummy_all_reduce():
    """Issue 46 item 25: the total from n(n-1)/2, with an all-reduce of something else to satisfy the count."""
    rank, n = dist.get_rank(), dist.get_world_size()
    dist.all_reduce(torch.zeros(1))
    return rank, n, n * (n - 1) // 2


def formula_only():
    n = dist.get_world_size()
    return dist.get_rank(), n, n * (n - 1) // 2


def all_reduce_of_ones():
    total = torch.ones(1)
    dist.all_reduce(total)
    return dist.get_rank(), dist.get_world_size(), total.item()


def ranks_from_one():
    total = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(total)
    return dist.get_rank(), dist.get_world_size(), total.item()


def rank_always_zero():
    total = torch.tensor([0])
    dist.all_reduce(total)
    return 0, dist.get_world_size(), total.item()


def all_reduce_and_barrier():
    """One all-reduce, and a barrier "to be safe": the grader holds the ranks' bytes to one all-reduce's."""
    total = torch.tensor([dist.get_rank()])
    dist.all_reduce(total)
    dist.barrier()
    return dist.get_rank(), dist.get_world_size(), total.item()


# ---------------------------------------------------------------- 0.2

def sum_not_mean(tensor):
    dist.all_reduce(tensor)
    return tensor


def floor_division(tensor):
    """Issue 46 item 27: // instead of /."""
    total = tensor.clone()
    dist.all_reduce(total)
    return total // dist.get_world_size()


def multiplied(tensor):
    total = tensor.clone()
    dist.all_reduce(total)
    return total * dist.get_world_size()


def divided_by_two(tensor):
    total = tensor.clone()
    dist.all_reduce(total)
    return total / 2


def never_reduced(tensor):
    return tensor / dist.get_world_size()


WRONG = [
    ("0.1", "the formula beside a dummy all-reduce", (formula_beside_a_dummy_all_reduce,),
     r"returned total=\d+, but its all_reduce produced 0: return the all-reduced value \(total.item\(\)\), not a "
     r"formula"),
    ("0.1", "the formula, no all-reduce", (formula_only,), r"called dist.all_reduce 0 times"),
    ("0.1", "an all-reduce of ones", (all_reduce_of_ones,), r"that counts the ranks: each rank should put its own id"),
    ("0.1", "rank ids from 1", (ranks_from_one,), r"that sums rank \+ 1: rank ids start at 0"),
    ("0.1", "rank 0 everywhere", (rank_always_zero,), r"rank 1 of 2 returned rank=0; use dist.get_rank\(\)"),
    ("0.1", "an all-reduce and a barrier", (all_reduce_and_barrier,), r"rank 0 of 2 also called barrier: compute "
     r"the sum with one all_reduce and no other communication"),
    ("0.2", "the sum, not the mean", (sum_not_mean,), r"that is the sum over 2 ranks: divide by the world size"),
    ("0.2", "floor division", (floor_division,), r"the mean rounded down to whole numbers: // is floor division"),
    ("0.2", "multiplied by the world size", (multiplied,), r"the sum multiplied by the world size 2: divide by it"),
    ("0.2", "divided by 2 on any world size", (divided_by_two,), r"world size 3.*divided by 2, not by the world size "
                                                                 r"3: use dist.get_world_size\(\)"),
    ("0.2", "never all-reduced", (never_reduced,), r"this rank's own tensor: all-reduce it before dividing"),
    ("0.2", "returns None", (lambda tensor: None,), r"rank 0 returned None; return the averaged tensor"),
]

RIGHT = {"0.1": (SOLUTION["rank_sum"],), "0.2": (SOLUTION["mean_across_ranks"],)}

test_wrong_answer_fails_naming_the_mistake, test_right_answer_passes = checker_tests(WRONG, RIGHT)
