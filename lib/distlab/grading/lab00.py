"""Lab 00 checkers: a first function on ranks, and a mean across ranks.

Multi-rank checkers run the student's function on real gloo ranks, one group per
world size (2, 3 and 4, :func:`distlab.grading.harness.rank_group`), and compare
each rank's answer with ``torch.distributed``'s own result.
"""

from __future__ import annotations

import random

import torch
import torch.distributed as dist

from distlab.grading import quiz
from distlab.grading.contract import CheckFailed
from distlab.grading.harness import (
    WORLD_SIZES,
    assert_close,
    is_close,
    ops_used,
    raise_if_untouched,
    random_tensor,
    rank_group,
    rounding_tolerance,
    run_job,
)
from distlab.grading.registry import Exercise


def _shape_text(shape) -> str:
    return "x".join(map(str, shape))


def _dtype_text(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# ---------------------------------------------------------------- 0.1 rank, world size, one all-reduce

def _rank_sum_job(student_fn):
    value = student_fn()
    return value, ops_used()


def check_rank_sum(student_fn) -> str:
    """``student_fn()`` on each rank returns (rank, world_size, sum of all rank ids) using one all_reduce."""
    raise_if_untouched(student_fn)
    for n in WORLD_SIZES:
        with rank_group(n, "your function") as ranks:
            run = run_job(ranks, _rank_sum_job, student_fn)
        for r, (value, ops) in enumerate(run):
            if not isinstance(value, (tuple, list)) or len(value) != 3:
                raise CheckFailed(f"rank {r} of {n} returned {value!r}; return a tuple (rank, world_size, total)")
            rank, world, total = value
            if _number(rank) != r:
                raise CheckFailed(f"rank {r} of {n} returned rank={_number(rank)!r}; use dist.get_rank()")
            if _number(world) != n:
                raise CheckFailed(f"rank {r} of {n} returned world_size={_number(world)!r}; "
                                  "use dist.get_world_size()")
            want = n * (n - 1) // 2
            if _number(total) != want:
                raise CheckFailed(f"rank {r} of {n}: the sum of rank ids should be {want}, got {_number(total)!r}")
            calls = ops.get("all_reduce", 0)
            if calls != 1:
                raise CheckFailed(f"rank {r} of {n} called dist.all_reduce {calls} times; compute the sum "
                                  "with exactly one all_reduce")
    return "rank, world size and one all_reduce correct on 2, 3 and 4 ranks"


def _number(value):
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return tuple(value.reshape(-1).tolist())
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# ---------------------------------------------------------------- 0.2 mean across ranks

def _mean_job(student_fn, shape, dtype, seed):
    got = student_fn(random_tensor(shape, dtype, seed, dist.get_rank()))
    return got.detach().clone() if isinstance(got, torch.Tensor) else got


def _mean_of(shape, dtype, seed: int, n: int) -> torch.Tensor:
    """The reference, computed here: the ranks run the student's code, so nothing they compute is one."""
    return sum(random_tensor(shape, dtype, seed, r) for r in range(n)) / n


def check_mean_across_ranks(student_fn) -> str:
    """``student_fn(tensor)`` returns the element-wise mean of every rank's tensor."""
    raise_if_untouched(student_fn)
    rng = random.Random()
    cases = 0
    for n in WORLD_SIZES:
        shapes = [(rng.randint(1, 40),), (rng.randint(1, 6), rng.randint(1, 9))]
        with rank_group(n, "your function") as ranks:
            for shape, dtype in zip(shapes, (torch.float32, torch.float64)):
                seed = rng.randrange(10**6)
                run = run_job(ranks, _mean_job, student_fn, shape, dtype, seed)
                expected = _mean_of(shape, dtype, seed, n)
                cases += 1
                for r, got in enumerate(run):
                    if got is None:
                        raise CheckFailed(f"rank {r} returned None; return the averaged tensor")
                    summed = is_close(got, expected * n, atol=1e-4, rtol=1e-4) and bool(expected.abs().max() > 1e-6)
                    assert_close(f"rank {r} (world size {n}, {_shape_text(shape)} {_dtype_text(dtype)})", "the mean",
                                 got, expected, atol=rounding_tolerance(expected), same_dtype=True,
                                 hint=f"that is the sum over {n} ranks: divide by the world size" if summed else "")
    return f"matches all_reduce / world_size on {cases} random tensors, 2-4 ranks"


# Why lab 00's numeric questions ask every student the chapter's numbers.
_WORKED_EXAMPLE = ("lab 00 is the worked example the instructor guide grades with a course secret: its solution "
                   "must pass under any secret")

QUIZ = [
    quiz.number("Q0.1", "LOCAL_RANK of global rank 11 on nodes of 8 GPUs", answer=3, rel_tol=0,
                hint="section 3: ranks fill one node after the other; the local rank is the index on its node",
                fixed=_WORKED_EXAMPLE),
    quiz.number("Q0.2", "all_reduce(rank + 1) on 8 ranks", answer=36, rel_tol=0,
                hint="section 2: every rank ends with the sum of every rank's value", fixed=_WORKED_EXAMPLE),
    quiz.choice("Q0.3", "the backend for tensors on GPUs", answer="b", options="abc",
                hint="section 1: which backend moves CUDA tensors over NVLink and InfiniBand?"),
    quiz.number("Q0.4", "tensor bytes each rank sends in a ring all-reduce of 1000 float32 on 4 ranks", answer=6000,
                rel_tol=0,
                hint="section 2: the comm table, 2(N-1)/N * M with M the message's bytes", fixed=_WORKED_EXAMPLE),
    quiz.choice("Q0.5", "what the other ranks do when one skips a collective", answer="b", options="abc",
                hint="the chapter, 'The model': a collective completes only when every rank of the group calls it"),
]

EXERCISES = [
    Exercise("0.1", "ranks, world size and a first all-reduce", 1, check_rank_sum),
    Exercise("0.2", "the mean across ranks", 1, check_mean_across_ranks),
    *QUIZ,
]
