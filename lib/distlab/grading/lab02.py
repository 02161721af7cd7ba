"""Lab 02 checkers: a ring all-reduce and a ring all-gather from point-to-point ops,
all-reduce as reduce-scatter + all-gather, and a latency-optimal all-reduce (recursive doubling); the quiz.

Each checker runs the student's function on real gloo ranks (world sizes 2, 3
and 4, hidden random tensors whose sizes are often not divisible by the world
size, float32 and float64), compares every rank's result with
``torch.distributed``'s built-in collective, and checks what the function sent:
a ring must be built from ``send``/``isend`` and send 2(N-1)/N * M bytes per
rank (all-reduce) or (N-1)/N * M (all-gather); a recursive-doubling all-reduce must send at
most ceil(log2 N) messages per rank (the ring sends 2(N-1)).
"""

from __future__ import annotations

import math
import random

import torch
import torch.distributed as dist

from distlab.collectives import (
    crossover_bytes,
    ring_all_gather_bytes,
    ring_all_reduce_bytes,
    ring_all_reduce_time,
    tree_steps,
)
from distlab.grading import quiz
from distlab.grading.contract import CheckFailed
from distlab.grading.harness import (
    WORLD_SIZES,
    assert_close,
    raise_if_untouched,
    random_tensor,
    rank_group,
    rounding_tolerance,
    run_job,
)
from distlab.grading.registry import Exercise
from distlab.runtime import comm

P2P_SENDS = ("send", "isend")
COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "gather",
               "scatter")  # canonical names (distlab.runtime.comm.canonical): all_gather_into_tensor is all_gather


def _cases(rng: random.Random, n: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Per world size: a 1-D size not divisible by n, a 2-D float64 tensor, and (n > 2) a tensor smaller than n."""
    numel = rng.randint(n + 1, 3000)
    if numel % n == 0:
        numel += 1
    cases = [((numel,), torch.float32), ((rng.randint(1, 9), rng.randint(1, 40)), torch.float64)]
    if n > 2:
        cases.append(((rng.randint(1, n - 1),), torch.float32))
    return cases


def _run_student(student_fn, x):
    """Call ``student_fn(x)`` and return (its value, calls per canonical op, bytes sent with send/isend)."""
    before = comm.snapshot()
    value = student_fn(x)
    traffic = comm.since(before)
    return value, {op: counts.calls for op, counts in traffic.ops.items()}, traffic.total("wire_bytes", P2P_SENDS)


def _collectives_called(ops: dict[str, int]) -> list[str]:
    return [f"dist.{op}" for op in COLLECTIVES if ops.get(op)]


def _require_p2p(n: int, sent: float, ops, what: str, algorithm: str = "ring") -> None:
    if sent == 0 and n > 1:
        used = _collectives_called(ops)
        because = f" (it called {', '.join(used)})" if used else ""
        raise CheckFailed(f"your {algorithm} sent 0 bytes with send/isend{because}; it must be built from "
                          f"point-to-point ops ({what})")


def _check_sent(r: int, n: int, sent: float, expected: float, tolerance: float, what: str, ops) -> None:
    _require_p2p(n, sent, ops, what)
    if abs(sent - expected) > tolerance:
        raise CheckFailed(f"rank {r} sent {sent:.0f} bytes with send/isend, but a ring sends "
                          f"{expected:.0f} per rank ({what}): each step should send one chunk, not the whole tensor")


# ---------------------------------------------------------------- 2.1 ring all-reduce

def _all_reduce_job(student_fn, shape, dtype, seed):
    """The student's result (their return value, or the argument they reduced in place), what it called and sent."""
    arg = random_tensor(shape, dtype, seed, dist.get_rank())
    value, ops, sent = _run_student(student_fn, arg)
    got = arg if value is None else value
    got = got.detach().clone() if isinstance(got, torch.Tensor) else got
    return got, ops, sent


def _inputs(shape, dtype, seed: int, n: int) -> list[torch.Tensor]:
    """Every rank's input of a case, drawn here: the references are computed here, never on the ranks, which run
    the student's code."""
    return [random_tensor(shape, dtype, seed, r) for r in range(n)]


def _describe_case(n: int, shape, dtype) -> tuple[int, int, str]:
    """Elements, bytes per element, and the words a failure message uses for this case."""
    numel = math.prod(shape)
    element = torch.tensor([], dtype=dtype).element_size()
    return numel, element, f"world size {n}, {numel} {str(dtype).replace('torch.', '')} elements"


def _all_reduce_mistake(mine: torch.Tensor, got: torch.Tensor, expected: torch.Tensor, n: int) -> str:
    """Name the common all-reduce mistake the whole result shows (this rank's input is ``mine``), or ''."""
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape or got.dtype != expected.dtype:
        return ""
    close = dict(rtol=1e-4, atol=1e-6)
    if torch.allclose(got, mine, **close):
        return ("the result is this rank's own input, nothing was added: reduce into the tensor in place "
                "(or return the result)")
    if torch.allclose(got * n, expected, **close):
        return f"that is the sum divided by {n}, the mean: an all-reduce sums (dividing is DDP's job, Lab 03)"
    matching = torch.isclose(got.reshape(-1), expected.reshape(-1), **close)
    if 0 < int(matching.sum()) < matching.numel():
        return (f"{int(matching.sum())} of {matching.numel()} elements hold the sum and the rest do not: is a "
                "phase cut short? After the reduce-scatter (N-1 steps) the all-gather must pass every finished "
                "chunk around the ring (N-1 more)")
    return ""


def _check_all_reduce(student_fn, p2p: bool, tree: bool = False) -> int:
    raise_if_untouched(student_fn)
    rng = random.Random()
    cases = 0
    what_fn = "your recursive doubling" if tree else "your ring" if p2p else "your all-reduce"
    for n in WORLD_SIZES:
        with rank_group(n, what_fn) as ranks:
            for shape, dtype in _cases(rng, n):
                seed = rng.randrange(10**6)
                run = run_job(ranks, _all_reduce_job, student_fn, shape, dtype, seed)
                inputs = _inputs(shape, dtype, seed, n)
                expected = sum(inputs)
                cases += 1
                numel, element, what = _describe_case(n, shape, dtype)
                if n > 2 and numel < n:
                    what += ", fewer elements than ranks"
                for r, (got, ops, sent) in enumerate(run):
                    mistake = _all_reduce_mistake(inputs[r], got, expected, n)
                    assert_close(f"rank {r} ({what})", "the result", got, expected,
                                 atol=rounding_tolerance(expected), hint=mistake, same_dtype=True)
                total = 0.0
                for r, (got, ops, sent) in enumerate(run):
                    if tree:
                        _check_rounds(r, n, sent, ops, what)
                    elif p2p:
                        chunk = max(math.ceil(numel / n), 2) * element
                        _check_sent(r, n, sent, ring_all_reduce_bytes(numel * element, n), chunk, what, ops)
                        total += sent
                    else:
                        _check_reduce_scatter_all_gather(r, ops, what)
                if p2p and not tree and total != 2 * (n - 1) * numel * element:
                    raise CheckFailed(f"the {n} ranks together sent {total:.0f} bytes with send/isend; a ring "
                                      f"all-reduce sends each chunk N-1 times per phase, "
                                      f"{2 * (n - 1) * numel * element} bytes in all ({what})")
    return cases


def check_ring_all_reduce(student_fn) -> str:
    """``student_fn(tensor)`` sums ``tensor`` over all ranks in place (and may return it), from send/recv."""
    cases = _check_all_reduce(student_fn, p2p=True)
    return f"matches dist.all_reduce on {cases} random tensors, 2-4 ranks; each rank sent 2(N-1)/N*M bytes"


# ---------------------------------------------------------------- 2.2 ring all-gather

def _all_gather_job(student_fn, shape, dtype, seed):
    value, ops, sent = _run_student(student_fn, random_tensor(shape, dtype, seed, dist.get_rank()))
    if isinstance(value, (list, tuple)):
        value = [v.detach().clone() if isinstance(v, torch.Tensor) else v for v in value]
    return value, ops, sent


def _misplaced_entry(src: int, got, expected: list[torch.Tensor]) -> str:
    """When entry ``src`` holds another rank's tensor, say whose: the pieces were filed by step, not by source."""
    for other, tensor in enumerate(expected):
        if other != src and isinstance(got, torch.Tensor) and got.shape == tensor.shape and torch.equal(got, tensor):
            return (f"entry {src} holds rank {other}'s tensor; entry i must be rank i's, so file each received "
                    f"piece under the rank it started from, not under the step it arrived in")
    return ""


def check_ring_all_gather(student_fn) -> str:
    """``student_fn(tensor)`` returns a list whose entry i is rank i's tensor, from send/recv."""
    raise_if_untouched(student_fn)
    rng = random.Random()
    cases = 0
    for n in WORLD_SIZES:
        with rank_group(n, "your ring") as ranks:
            for shape, dtype in _cases(rng, n):
                seed = rng.randrange(10**6)
                run = run_job(ranks, _all_gather_job, student_fn, shape, dtype, seed)
                expected = _inputs(shape, dtype, seed, n)
                cases += 1
                numel, element, what = _describe_case(n, shape, dtype)
                what += " per rank"
                for r, (got, ops, sent) in enumerate(run):
                    if not isinstance(got, (list, tuple)) or len(got) != n:
                        kind = f"a {type(got).__name__}" + (f" of length {len(got)}"
                                                            if isinstance(got, (list, tuple)) else "")
                        raise CheckFailed(f"rank {r} returned {kind}; return a list of {n} tensors, "
                                          f"entry i being rank i's tensor ({what})")
                    for src in range(n):
                        assert_close(f"rank {r} ({what})", f"entry {src}", got[src], expected[src],
                                     atol=rounding_tolerance(expected[src]), same_dtype=True,
                                     hint=_misplaced_entry(src, got[src], expected))
                for r, (got, ops, sent) in enumerate(run):
                    _check_sent(r, n, sent, ring_all_gather_bytes(n * numel * element, n), 0, what, ops)
    return (f"matches dist.all_gather on {cases} random tensors, 2-4 ranks; "
            "each rank sent (N-1)/N*M bytes")


# ---------------------------------------------------------------- 2.3 reduce-scatter + all-gather

def _check_reduce_scatter_all_gather(r: int, ops: dict[str, int], what: str) -> None:
    if ops.get("all_reduce"):
        raise CheckFailed(f"rank {r} called dist.all_reduce; build the all-reduce from "
                          f"dist.reduce_scatter_tensor and dist.all_gather_into_tensor ({what})")
    if not ops.get("reduce_scatter"):
        raise CheckFailed(f"rank {r} never called dist.reduce_scatter_tensor ({what})")
    if not ops.get("all_gather"):
        raise CheckFailed(f"rank {r} never called dist.all_gather_into_tensor ({what})")


def check_all_reduce_via_reduce_scatter(student_fn) -> str:
    """``student_fn(tensor)`` all-reduces in place with reduce_scatter_tensor then all_gather_into_tensor."""
    cases = _check_all_reduce(student_fn, p2p=False)
    return f"matches dist.all_reduce on {cases} random tensors, 2-4 ranks, with reduce-scatter + all-gather"


# ---------------------------------------------------------------- 2.4 recursive-doubling all-reduce

def _check_rounds(r: int, n: int, sent: float, ops: dict[str, int], what: str) -> None:
    _require_p2p(n, sent, ops, what, algorithm="recursive doubling")
    messages = ops.get("send", 0) + ops.get("isend", 0)
    rounds = math.ceil(math.log2(n))
    if messages > rounds:
        raise CheckFailed(
            f"rank {r} sent {messages} messages on {n} ranks, but a latency-optimal all-reduce needs only "
            f"ceil(log2 N) = {rounds} ({what}): in round k exchange the whole tensor with rank r xor 2^k and add; "
            f"with N not a power of two, first fold each extra rank r >= p into rank r - p (p the largest power of "
            f"two <= N) and send it the result at the end")


def check_tree_all_reduce(student_fn) -> str:
    """``student_fn(tensor)`` sums ``tensor`` over all ranks in place in ceil(log2 N) rounds, from send/recv."""
    cases = _check_all_reduce(student_fn, p2p=True, tree=True)
    return (f"matches dist.all_reduce on {cases} random tensors, 2-4 ranks; at most ceil(log2 N) messages "
            "per rank")


# ---------------------------------------------------------------- quiz

QUIZ = [
    quiz.number("Q2.1", "bytes per rank of a ring all-reduce (GB)", answer=1.75, rel_tol=0.01,
                hint="section 2: each rank sends 2(N-1)/N * M",
                fixed="its title names none of its numbers (M and N are the chapter's): no other ones can be asked"),
    quiz.number("Q2.2", "all-reduce time of {billions}B bf16 gradients on {gpus} GPUs (ms)", rel_tol=0.03,
                given=dict(billions=7, gpus=8), vary=dict(billions=(1, 3, 13, 34, 70), gpus=(4, 16, 64)),
                solve=lambda billions, gpus: ring_all_reduce_time(billions * 1e9 * 2, gpus, 0.0, 450e9) * 1e3,
                hint="section 4: M = 2 bytes x 7e9, the ring sends 2(N-1)/N * M per rank at beta; alpha is "
                     "negligible at this size"),
    quiz.choice("Q2.3", "the algorithm for a 4 KiB all-reduce on 1024 ranks", answer="b", options="abc",
                hint="section 4: which term of the alpha-beta model dominates a small message, and how many "
                     "steps does each algorithm pay it?"),
    quiz.number("Q2.4", "recursive-doubling/ring crossover for N = {ranks}, alpha = {alpha_us} us, "
                "beta = {beta_gbs} GB/s (MB)", rel_tol=0.02, given=dict(ranks=4, alpha_us=10, beta_gbs=100),
                vary=dict(ranks=(8, 16), alpha_us=(5, 20, 50), beta_gbs=(25, 50, 200)),
                solve=lambda ranks, alpha_us, beta_gbs: crossover_bytes(ranks, alpha_us * 1e-6, beta_gbs * 1e9) / 1e6,
                hint="section 4: M* = (S_ring - S_tree) alpha beta / (B_tree - B_ring), 8 alpha beta for N = 4"),
    quiz.number("Q2.5", "sequential messages of recursive doubling on {ranks} ranks", rel_tol=0, given=dict(ranks=1024),
                vary=dict(ranks=(256, 512, 1000, 2048, 3000, 4096)), solve=lambda ranks: tree_steps(ranks),
                hint="exercise 2.4: each round doubles the block of ranks whose sum you hold"),
    quiz.choice("Q2.6", "ring bytes per rank as N grows from 8 to 1024", answer="c", options="abc",
                hint="section 2: 2(N-1)/N * M for N = 8 and N = 1024"),
]

EXERCISES = [
    Exercise("2.1", "ring all-reduce from send/recv", 3, check_ring_all_reduce,
             references=("distlab.collectives.ring_all_reduce",)),
    Exercise("2.2", "ring all-gather from send/recv", 2, check_ring_all_gather,
             references=("distlab.collectives.ring_all_gather",)),
    Exercise("2.3", "all-reduce = reduce-scatter + all-gather", 1, check_all_reduce_via_reduce_scatter,
             references=("distlab.collectives.all_reduce_via_reduce_scatter",)),
    Exercise("2.4", "recursive-doubling all-reduce in log2(N) rounds", 2, check_tree_all_reduce,
             references=("distlab.collectives.tree_all_reduce",)),
    *QUIZ,
]
