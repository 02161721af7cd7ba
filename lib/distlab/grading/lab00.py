"""Lab 00 checkers: a first function on ranks, and a mean across ranks.

Multi-rank checkers run the student's function on real gloo ranks, one group per
world size (2, 3 and 4, :func:`distlab.grading.harness.rank_group`), and compare
each rank's answer with ``torch.distributed``'s own result.
"""

from __future__ import annotations

import random

import torch
import torch.distributed as dist

from distlab.grading import quiz, wiretap
from distlab.grading.contract import CheckFailed
from distlab.grading.harness import (
    WORLD_SIZES,
    Edge,
    assert_close,
    case_drawn,
    is_close,
    lab_seed,
    ops_used,
    raise_if_untouched,
    random_tensor,
    rank_group,
    run_job,
)
from distlab.grading.registry import Exercise


def _shape_text(shape) -> str:
    return "x".join(map(str, shape))


def _dtype_text(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# ---------------------------------------------------------------- 0.1 rank, world size, one all-reduce

def _rank_sum_job(student_fn):
    """The student's value, their op counts, what each of their all-reduces produced (the tensor handed to
    ``dist.all_reduce``, read after the function returns: the real collective runs, this only looks) and its
    element size (how gloo cuts the message, for :func:`_wire_agrees`)."""
    handed = []
    real = dist.all_reduce

    def watched(tensor, *args, **kwargs):
        handed.append(tensor)
        return real(tensor, *args, **kwargs)

    dist.all_reduce = watched
    try:
        value = student_fn()
    finally:
        dist.all_reduce = real
    tensors = [t for t in handed if isinstance(t, torch.Tensor)]
    return value, ops_used(), [_number(t.detach().clone()) for t in tensors], [t.element_size() for t in tensors]


def check_rank_sum(student_fn) -> str:
    """``student_fn()`` on each rank returns (rank, world_size, sum of all rank ids) using one all_reduce, and the
    total it returns is what that all-reduce produced (not a formula beside a dummy all-reduce)."""
    raise_if_untouched(student_fn)
    for n in WORLD_SIZES:
        case_drawn("0.1", world=n)
        with rank_group(n, "your function") as ranks:
            try:
                run, sent = wiretap.observed_job(ranks, _rank_sum_job, student_fn)
            except wiretap.Unaccounted as error:
                raise CheckFailed(f"on {n} ranks, the ranks' own record of their communication cannot be held "
                                  f"against what the kernel saw: {error}. 0.1 is graded by the bytes the kernel "
                                  "counted on gloo's connections") from None
        for r, (value, _, _, _) in enumerate(run):  # what every rank says it is, before what it summed
            if not isinstance(value, (tuple, list)) or len(value) != 3:
                raise CheckFailed(f"rank {r} of {n} returned {value!r}; return a tuple (rank, world_size, total)")
            rank, world, _ = value
            if _number(rank) != r:
                raise CheckFailed(f"rank {r} of {n} returned rank={_number(rank)!r}; use dist.get_rank()")
            if _number(world) != n:
                raise CheckFailed(f"rank {r} of {n} returned world_size={_number(world)!r}; "
                                  "use dist.get_world_size()")
        for r, (value, ops, produced, _) in enumerate(run):
            calls = ops.get("all_reduce", 0)
            if calls != 1:
                raise CheckFailed(f"rank {r} of {n} called dist.all_reduce {calls} times; compute the sum "
                                  "with exactly one all_reduce")
            others = sorted(op for op in ops if op != "all_reduce")
            if others:
                raise CheckFailed(f"rank {r} of {n} also called {', '.join(others)}: compute the sum with one "
                                  "all_reduce and no other communication (the grader counts the bytes the ranks "
                                  "send each other)")
            total, want = _number(value[2]), n * (n - 1) // 2
            if produced and total != produced[0]:
                raise CheckFailed(f"rank {r} of {n} returned total={total!r}, but its all_reduce produced "
                                  f"{produced[0]!r}: return the all-reduced value (total.item()), not a formula")
            if total != want:
                raise CheckFailed(f"rank {r} of {n}: the sum of rank ids should be {want}, got {total!r}: "
                                  + _sum_mistake(total, n))
        if sent is not None:
            _wire_agrees(run, sent, n)
    return "rank, world size and one all_reduce correct on 2, 3 and 4 ranks"


def _wire_agrees(run, sent: list[int], n: int) -> None:
    """The ranks' own record (one all_reduce of M bytes each, in their logs) against what the kernel counted on
    their sockets to each other (:mod:`distlab.grading.wiretap`): the record is the student's process's to
    rewrite, the kernel's counters are not. They must agree, else the ranks' word for their one all_reduce is
    all there is, and it scores nothing."""
    messages = {_number(getattr(log.ops.get("all_reduce"), "payload_bytes", 0)) for log in run.comm}
    message = next(iter(messages)) if len(messages) == 1 else None
    every_size = (1, 2, 4, 8, 16)  # what the ranks' wrapper saw handed to dist.all_reduce, else any dtype's
    sizes = tuple({size for *_, seen in run for size in seen if size in every_size}) or every_size
    if isinstance(message, int) and wiretap.one_all_reduce(sent, message, sizes):
        return
    raise CheckFailed(f"on {n} ranks, the ranks' own record of their communication (one all_reduce of "
                      f"{' or '.join(map(repr, sorted(messages, key=repr)))} bytes) disagrees with what the kernel "
                      f"saw: their connections to each other carried {sent} bytes, not one all_reduce of that "
                      "message. The grade counts what the kernel saw, not what a rank says it did")


def _sum_mistake(total, n: int) -> str:
    """What a wrong all-reduced sum of rank ids usually means."""
    if total == n:
        return "that counts the ranks: each rank should put its own id (dist.get_rank()) in the tensor, not 1"
    if total == n * (n + 1) // 2:
        return "that sums rank + 1: rank ids start at 0"
    if total == 0:
        return "every rank put 0 in: each rank should put its own id (dist.get_rank()) in the tensor"
    return "all-reduce a tensor holding this rank's id, dist.get_rank(), and read the sum back"


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


def _summed(shape, dtype, seed: int, n: int) -> torch.Tensor:
    """The ranks' inputs summed, computed here: the ranks run the student's code, so nothing they compute is a
    reference."""
    return sum(random_tensor(shape, dtype, seed, r) for r in range(n))


def _mean_mistake(mine: torch.Tensor, summed: torch.Tensor, n: int):
    """The hint for a wrong mean, chosen by what it equals (this rank's input ``mine``, the ``summed`` tensor)."""
    def hint(got: torch.Tensor, expected: torch.Tensor) -> str:
        if is_close(got, summed, terms=n):
            return f"that is the sum over {n} ranks: divide by the world size"
        if is_close(got, torch.div(summed, n, rounding_mode="floor"), terms=n):
            return "that is the mean rounded down to whole numbers: // is floor division; divide with /"
        if is_close(got, summed * n, terms=n):
            return f"that is the sum multiplied by the world size {n}: divide by it"
        if is_close(got, mine / n, terms=n) or is_close(got, mine, terms=n):
            return "that is this rank's own tensor: all-reduce it before dividing, and return the reduced one"
        for k in range(1, 9):
            if k != n and is_close(got, summed / k, terms=n):
                return f"that is the sum divided by {k}, not by the world size {n}: use dist.get_world_size()"
        return ""
    return hint


def check_mean_across_ranks(student_fn) -> str:
    """``student_fn(tensor)`` returns the element-wise mean of every rank's tensor."""
    raise_if_untouched(student_fn)
    rng = random.Random(lab_seed(0))
    cases = 0
    for n in WORLD_SIZES:
        shapes = [(rng.randint(1, 40),), (rng.randint(1, 6), rng.randint(1, 9))]
        with rank_group(n, "your function") as ranks:
            for shape, dtype in zip(shapes, (torch.float32, torch.float64)):
                case_drawn("0.2", world=n, shape=shape, dtype=dtype)
                seed = rng.randrange(10**6)
                run = run_job(ranks, _mean_job, student_fn, shape, dtype, seed)
                summed = _summed(shape, dtype, seed, n)
                expected = summed / n
                cases += 1
                for r, got in enumerate(run):
                    if got is None:
                        raise CheckFailed(f"rank {r} returned None; return the averaged tensor")
                    assert_close(f"rank {r} (world size {n}, {_shape_text(shape)} {_dtype_text(dtype)})", "the mean",
                                 got, expected, terms=n, same_dtype=True,
                                 hint=_mean_mistake(random_tensor(shape, dtype, seed, r), summed, n))
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

# The boundaries each exercise's text names, each a test on one hidden case (harness.Edge, tests/grading/
# test_reference_seeds.py): 0.1 "the checker runs it on 2, 3 and 4 ranks"; 0.2 "float32 or float64", any shape.
EDGES = {
    "0.1": [Edge("2 ranks", lambda c: c["world"] == 2),
            Edge("an odd number of ranks (3)", lambda c: c["world"] == 3),
            Edge("4 ranks", lambda c: c["world"] == 4)],
    "0.2": [Edge("float32", lambda c: c["dtype"] == torch.float32),
            Edge("float64", lambda c: c["dtype"] == torch.float64),
            Edge("a 2-D tensor", lambda c: len(c["shape"]) == 2),
            Edge("2 ranks", lambda c: c["world"] == 2),
            Edge("an odd number of ranks", lambda c: c["world"] % 2 == 1)],
}

# Mutants of the reference that compute the same thing (distlab notebooks mutants), each with why.
EQUIVALENT_MUTANTS = {
    "0.1 call-removed: `total.item()` → `total`": "a one-element tensor is accepted as the total (the text's .item() "
                                                 "is a hint, and the checker reads either)",
    "0.2 call-removed: `tensor.clone()` → `tensor`": "reducing the argument in place returns the same mean; the text "
                                                     "asks for the returned value only",
}

EXERCISES = [
    Exercise("0.1", "ranks, world size and a first all-reduce", 1, check_rank_sum),
    Exercise("0.2", "the mean across ranks", 1, check_mean_across_ranks),
    *QUIZ,
]
