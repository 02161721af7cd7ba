"""Lab 00 checkers: a first function on ranks, and a mean across ranks.

Multi-rank checkers run the student's function on real gloo ranks, one warm
group per world size (2, 3 and 4), and compare each rank's answer with
``torch.distributed``'s own result. The helpers at the top are shared with
:mod:`distlab.grading.lab02`; what every lab shares is in :mod:`distlab.grading.harness`.
"""

from __future__ import annotations

import random
from contextlib import contextmanager

import torch
import torch.distributed as dist

from distlab.collectives import first_mismatch
from distlab.grading import CheckFailed, quiz
from distlab.grading.harness import JOB_TIMEOUT, launch_failures_fail_the_check, raise_if_untouched
from distlab.grading.registry import Exercise
from distlab.runtime import comm
from distlab.runtime.launch import Ranks

WORLD_SIZES = (2, 3, 4)
COLLECTIVE_TIMEOUT = 8.0  # seconds: a deadlocked ring fails within seconds, a rank slowed by a busy machine does not


# ---------------------------------------------------------------- shared helpers

@contextmanager
def rank_group(world_size: int, what: str):
    """A gloo group of its own for one world size, for several jobs; a hang becomes a CheckFailed that says so.

    No lab-specific advice: the launcher says what it saw (everyone receiving, everyone sending, sends to
    the wrong neighbour, a missing call) and what to check for that case; the hint is its, not a fixed guess.
    """
    ranks = Ranks(world_size, backend="gloo", collective_timeout=COLLECTIVE_TIMEOUT)
    try:
        with launch_failures_fail_the_check(what, world_size):
            yield ranks
    finally:
        ranks.close()


def run_job(ranks: Ranks, fn, *args):
    return ranks.run(fn, args=args, timeout=JOB_TIMEOUT, show_output=False)


def ops_used(log=None) -> dict[str, int]:
    """Inside a rank: how many times each torch.distributed op was called so far in this job."""
    log = log or comm.current_log()
    return {op: stats.calls for op, stats in log.ops.items() if stats.calls}


def random_tensor(shape, dtype, seed: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def compare_tensor(rank: int, expected: torch.Tensor, got, what: str, hint=None) -> None:
    """Raise CheckFailed naming the rank and the first element that differs."""
    if not isinstance(got, torch.Tensor):
        raise CheckFailed(f"rank {rank}: {what} should be a tensor, got {type(got).__name__}")
    if tuple(got.shape) != tuple(expected.shape):
        raise CheckFailed(f"rank {rank}: {what} has shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
    if got.dtype != expected.dtype:
        raise CheckFailed(f"rank {rank}: {what} has dtype {got.dtype}, expected {expected.dtype}")
    miss = first_mismatch(expected, got)
    if miss is not None:
        index, want, have = miss
        extra = hint(index, want, have) if hint else ""
        raise CheckFailed(f"rank {rank}, element {index}: expected {want:.6g}, got {have:.6g} "
                          f"({what}){extra}")


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
    rank, n = dist.get_rank(), dist.get_world_size()
    x = random_tensor(shape, dtype, seed, rank)
    got = student_fn(x.clone())
    if isinstance(got, torch.Tensor):
        got = got.detach().clone()
    expected = x.clone()
    dist.all_reduce(expected)
    expected /= n
    return got, expected


def check_mean_across_ranks(student_fn) -> str:
    """``student_fn(tensor)`` returns the element-wise mean of every rank's tensor."""
    raise_if_untouched(student_fn)
    rng = random.Random()
    cases = 0
    for n in WORLD_SIZES:
        shapes = [(rng.randint(1, 40),), (rng.randint(1, 6), rng.randint(1, 9))]
        with rank_group(n, "your function") as ranks:
            for shape, dtype in zip(shapes, (torch.float32, torch.float64)):
                run = run_job(ranks, _mean_job, student_fn, shape, dtype, rng.randrange(10**6))
                cases += 1
                for r, (got, expected) in enumerate(run):
                    if got is None:
                        raise CheckFailed(f"rank {r} returned None; return the averaged tensor")

                    def hint(i, want, have, n=n):
                        if abs(have - want * n) <= 1e-4 * max(1.0, abs(want * n)) and abs(want) > 1e-6:
                            return f"; that is the sum over {n} ranks: divide by the world size"
                        return ""

                    what = f"world size {n}, {_shape_text(shape)} {_dtype_text(dtype)}"
                    compare_tensor(r, expected, got, what, hint)
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
