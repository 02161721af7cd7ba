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

import contextlib
import math
import random

import torch
import torch.distributed as dist

from distlab.collectives import (
    chunk_sizes,
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
    Edge,
    assert_close,
    case_drawn,
    is_close,
    lab_seed,
    raise_if_untouched,
    random_tensor,
    rank_group,
    run_job,
    tolerance,
)
from distlab.grading.registry import Exercise
from distlab.runtime import comm

P2P_SENDS = ("send", "isend")
COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "gather",
               "scatter")  # canonical names (distlab.runtime.comm.canonical): all_gather_into_tensor is all_gather


# The world sizes 2.4 also runs on: 8, where p = 8 needs three rounds (xor 1, 2, 4), which N <= 4 never shows.
TREE_WORLD_SIZES = (*WORLD_SIZES, 8)


def _cases(rng: random.Random, n: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Per world size: a 1-D size not divisible by n, a 2-D float64 tensor, and (n > 2) a tensor smaller than n;
    on 8 ranks only the first (the rounds are what it is there for)."""
    numel = rng.randint(n + 1, 3000)
    if numel % n == 0:
        numel += 1
    cases = [((numel,), torch.float32), ((rng.randint(1, 9), rng.randint(1, 40)), torch.float64)]
    if 2 < n < 8:
        cases.append(((rng.randint(1, n - 1),), torch.float32))
    return cases[:1] if n == 8 else cases


# Point-to-point ops and the name of their peer argument.
_PEER = {"send": "dst", "isend": "dst", "recv": "src", "irecv": "src"}


@contextlib.contextmanager
def _peers_checked():
    """While in the block, a send or receive with a rank outside 0..N-1 raises a ValueError that names it, instead
    of what gloo does with it (a crash of the rank, or a wait that never ends). The real ops run otherwise."""
    n = dist.get_world_size()
    real = {op: getattr(dist, op) for op in _PEER}

    def checked(op):
        def call(tensor, *args, **kwargs):
            peer = args[0] if args else kwargs.get(_PEER[op])
            if isinstance(peer, int) and not 0 <= peer < n:
                raise ValueError(f"{op} {'to' if _PEER[op] == 'dst' else 'from'} rank {peer}: there is no such rank "
                                 f"(the ranks are 0-{n - 1})")
            return real[op](tensor, *args, **kwargs)
        return call

    for op in _PEER:
        setattr(dist, op, checked(op))
    try:
        yield
    finally:
        for op, function in real.items():
            setattr(dist, op, function)


def _run_student(student_fn, x):
    """Call ``student_fn(x)``; return (its value, calls per canonical op, bytes sent with send/isend, and each
    point-to-point op it made as (op, start, end, peer), end NaN for a request nobody waited on)."""
    log = comm.current_log()
    first = len(log.events)
    before = comm.snapshot()
    with _peers_checked():
        value = student_fn(x)
    traffic = comm.since(before)
    p2p = [(op, start, end, peer) for (op, _, start, end), (peer, _) in zip(log.events[first:], log.peers[first:])
           if op in comm.P2P_OPS]
    return (value, {op: counts.calls for op, counts in traffic.ops.items()}, traffic.total("wire_bytes", P2P_SENDS),
            p2p)


def _check_waited(r: int, p2p: list, what: str) -> None:
    """Every isend and irecv was waited on before the function returned: until then its buffer may be in use."""
    open_requests = [op for op, _, end, _ in p2p if end != end]
    if open_requests:
        raise CheckFailed(f"rank {r} returned with {len(open_requests)} request(s) never waited on "
                          f"({', '.join(sorted(set(open_requests)))}; {what}): call .wait() on every isend and irecv "
                          "before you return or reuse its buffer")


def critical_path(p2p_by_rank: list[list[tuple]]) -> int:
    """The longest chain of point-to-point messages each of which waits on the one before it: the rounds an
    algorithm takes. A send's depth is one more than the deepest receive its rank completed before issuing it
    (the data it may carry); a receive's is its matching send's (the k-th send from a to b with the k-th
    receive on b from a)."""
    sends: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for rank, ops in enumerate(p2p_by_rank):
        for i, (op, _, _, peer) in enumerate(ops):
            if op in P2P_SENDS:
                sends.setdefault((rank, peer), []).append((rank, i))
    depth: dict[tuple[int, int], int] = {}

    def send_depth(rank: int, i: int) -> int:
        if (rank, i) not in depth:
            depth[(rank, i)] = 0  # a cycle (clock noise) counts as no dependency
            start = p2p_by_rank[rank][i][1]
            seen: dict[int, int] = {}
            deepest = 0
            for op, _, end, peer in p2p_by_rank[rank]:
                if op in ("recv", "irecv"):
                    k = seen[peer] = seen.get(peer, -1) + 1
                    matched = sends.get((peer, rank), [])
                    if end == end and end <= start and k < len(matched):
                        deepest = max(deepest, send_depth(*matched[k]))
            depth[(rank, i)] = deepest + 1
        return depth[(rank, i)]

    return max((send_depth(r, i) for r, ops in enumerate(p2p_by_rank) for i, (op, *_) in enumerate(ops)
                if op in P2P_SENDS), default=0)


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
    value, ops, sent, p2p = _run_student(student_fn, arg)
    got = arg if value is None else value
    got = got.detach().clone() if isinstance(got, torch.Tensor) else got
    return got, ops, sent, p2p


def _inputs(shape, dtype, seed: int, n: int) -> list[torch.Tensor]:
    """Every rank's input of a case, drawn here: the references are computed here, never on the ranks, which run
    the student's code."""
    return [random_tensor(shape, dtype, seed, r) for r in range(n)]


def _describe_case(n: int, shape, dtype) -> tuple[int, int, str]:
    """Elements, bytes per element, and the words a failure message uses for this case."""
    numel = math.prod(shape)
    element = torch.tensor([], dtype=dtype).element_size()
    return numel, element, f"world size {n}, {numel} {str(dtype).replace('torch.', '')} elements"


def _unwritten(got: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Where a result holds what no arithmetic on the inputs gives: NaN, inf, or values a million times the largest
    expected (what torch.empty left in a buffer nobody received into)."""
    values = got.detach().double().reshape(-1)
    largest = expected.detach().double().abs().max().item() if expected.numel() else 0.0
    return ~torch.isfinite(values) | (values.abs() > 1e6 * max(largest, 1.0))


def _chunk_of(index: int, numel: int, n: int) -> tuple[int, int, int]:
    """(chunk, first, last) of the element ``index`` of a flat tensor cut the way the ring cuts it."""
    first = 0
    for chunk, size in enumerate(chunk_sizes(numel, n)):
        if index < first + size:
            return chunk, first, first + size - 1
        first += size
    return n - 1, first, numel - 1


def _all_reduce_mistake(mine: torch.Tensor, got: torch.Tensor, expected: torch.Tensor, n: int) -> str:
    """Name the common all-reduce mistake the whole result shows (this rank's input is ``mine``), or where the
    first wrong element lies in the ring's chunks."""
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape or got.dtype != expected.dtype:
        return ""
    unwritten = _unwritten(got, expected)
    if unwritten.any():
        index = int(unwritten.nonzero()[0])
        chunk, first, last = _chunk_of(index, got.numel(), n)
        return (f"element {index} (chunk {chunk} of {n}, elements {first}…{last}) holds "
                f"{got.reshape(-1)[index].item():.3g}, which no sum of the inputs gives: a buffer read before anything "
                f"was received into it (torch.empty), or before its wait() returned")
    if is_close(got, mine, terms=n):
        return ("the result is this rank's own input, nothing was added: reduce into the tensor in place "
                "(or return the result)")
    if is_close(got * n, expected, terms=n):
        return f"that is the sum divided by {n}, the mean: an all-reduce sums (dividing is DDP's job, Lab 03)"
    allowed = tolerance(expected, terms=n)
    matching = (got - expected).abs().reshape(-1) <= allowed.bound(expected).reshape(-1)
    if bool(matching.all()):
        return ""
    if 0 < int(matching.sum()) < matching.numel():
        return (f"{int(matching.sum())} of {matching.numel()} elements hold the sum and the rest do not: is a "
                "phase cut short? After the reduce-scatter (N-1 steps) the all-gather must pass every finished "
                "chunk around the ring (N-1 more)")
    index = int((~matching).nonzero()[0])
    chunk, first, last = _chunk_of(index, got.numel(), n)
    return (f"the first wrong element is in chunk {chunk} of {n} (elements {first}…{last}): follow that chunk "
            f"through your steps, which one each rank sends and which it adds to")


def _check_all_reduce(student_fn, p2p: bool, tree: bool = False) -> int:
    raise_if_untouched(student_fn)
    rng = random.Random(lab_seed(2) + (2 if tree else 1 if p2p else 3))
    cases = 0
    what_fn = "your recursive doubling" if tree else "your ring" if p2p else "your all-reduce"
    exercise = "2.4" if tree else "2.1" if p2p else "2.3"
    for n in TREE_WORLD_SIZES if tree else WORLD_SIZES:
        with rank_group(n, what_fn) as ranks:
            for shape, dtype in _cases(rng, n):
                case_drawn(exercise, world=n, shape=shape, dtype=dtype)
                seed = rng.randrange(10**6)
                run = run_job(ranks, _all_reduce_job, student_fn, shape, dtype, seed)
                inputs = _inputs(shape, dtype, seed, n)
                expected = sum(inputs)
                cases += 1
                numel, element, what = _describe_case(n, shape, dtype)
                if n > 2 and numel < n:
                    what += ", fewer elements than ranks"
                for r, (got, ops, sent, p2p_ops) in enumerate(run):
                    _check_waited(r, p2p_ops, what)
                    mistake = _all_reduce_mistake(inputs[r], got, expected, n)
                    assert_close(f"rank {r} ({what})", "the result", got, expected, terms=n, hint=mistake,
                                 same_dtype=True)
                total = 0.0
                for r, (got, ops, sent, _) in enumerate(run):
                    if tree:
                        _check_rounds(r, n, sent, ops, what)
                    elif p2p:
                        chunk = max(math.ceil(numel / n), 2) * element
                        _check_sent(r, n, sent, ring_all_reduce_bytes(numel * element, n), chunk, what, ops)
                        total += sent
                    else:
                        _check_reduce_scatter_all_gather(r, ops, what)
                if tree:
                    _check_critical_path(n, [p2p_ops for *_, p2p_ops in run], what)
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
    value, ops, sent, p2p = _run_student(student_fn, random_tensor(shape, dtype, seed, dist.get_rank()))
    if isinstance(value, (list, tuple)):
        value = [v.detach().clone() if isinstance(v, torch.Tensor) else v for v in value]
    return value, ops, sent, p2p


def _misplaced_entry(src: int, got, expected: list[torch.Tensor]) -> str:
    """When entry ``src`` holds another rank's tensor, say whose: the pieces were filed by step, not by source;
    when it holds values nobody wrote, that it was never received into."""
    for other, tensor in enumerate(expected):
        if other != src and isinstance(got, torch.Tensor) and got.shape == tensor.shape and torch.equal(got, tensor):
            return (f"entry {src} holds rank {other}'s tensor; entry i must be rank i's, so file each received "
                    f"piece under the rank it started from, not under the step it arrived in")
    if isinstance(got, torch.Tensor) and got.shape == expected[src].shape and _unwritten(got, expected[src]).any():
        return (f"entry {src} holds values no rank sent (what torch.empty left there): it was never received into, "
                f"or was read before its wait() returned: each step forwards the piece received the step before")
    return ""


def check_ring_all_gather(student_fn) -> str:
    """``student_fn(tensor)`` returns a list whose entry i is rank i's tensor, from send/recv."""
    raise_if_untouched(student_fn)
    rng = random.Random(lab_seed(2) + 4)
    cases = 0
    for n in WORLD_SIZES:
        with rank_group(n, "your ring") as ranks:
            for shape, dtype in _cases(rng, n):
                case_drawn("2.2", world=n, shape=shape, dtype=dtype)
                seed = rng.randrange(10**6)
                run = run_job(ranks, _all_gather_job, student_fn, shape, dtype, seed)
                expected = _inputs(shape, dtype, seed, n)
                cases += 1
                numel, element, what = _describe_case(n, shape, dtype)
                what += " per rank"
                for r, (got, ops, sent, p2p_ops) in enumerate(run):
                    _check_waited(r, p2p_ops, what)
                    if not isinstance(got, (list, tuple)) or len(got) != n:
                        kind = f"a {type(got).__name__}" + (f" of length {len(got)}"
                                                            if isinstance(got, (list, tuple)) else "")
                        raise CheckFailed(f"rank {r} returned {kind}; return a list of {n} tensors, "
                                          f"entry i being rank i's tensor ({what})")
                    for src in range(n):
                        assert_close(f"rank {r} ({what})", f"entry {src}", got[src], expected[src], terms=1,
                                     same_dtype=True, hint=_misplaced_entry(src, got[src], expected))
                for r, (got, ops, sent, _) in enumerate(run):
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


def _check_critical_path(n: int, p2p_by_rank: list[list[tuple]], what: str) -> None:
    """Recursive doubling's messages form log2(N) rounds (plus a fold in and a hand back when N is not a power of
    two: :func:`distlab.collectives.tree_steps`); a chain through the ranks (reduce 3→2→1→0, then broadcast back)
    sends as few messages per rank but takes 2(N-1) rounds, which this counts (:func:`critical_path`)."""
    rounds, allowed = critical_path(p2p_by_rank), tree_steps(n)
    if rounds > allowed:
        raise CheckFailed(f"your messages form a chain {rounds} rounds long on {n} ranks (each waiting on the one "
                          f"before), but recursive doubling takes {allowed} ({what}): in round k every rank exchanges "
                          "with rank r xor 2^k at once, so the rounds, not a path through the ranks, carry the sum")


def check_tree_all_reduce(student_fn) -> str:
    """``student_fn(tensor)`` sums ``tensor`` over all ranks in place in ceil(log2 N) rounds, from send/recv."""
    cases = _check_all_reduce(student_fn, p2p=True, tree=True)
    return (f"matches dist.all_reduce on {cases} random tensors, 2-4 and 8 ranks; at most ceil(log2 N) messages "
            "per rank, in log2 N rounds")


# ---------------------------------------------------------------- quiz

QUIZ = [
    quiz.number("Q2.1", "bytes per rank of a ring all-reduce (GB)", answer=1.75, rel_tol=0.01,
                hint="section 2: each rank sends 2(N-1)/N * M",
                fixed="its title names none of its numbers (M and N are the chapter's): no other ones can be asked"),
    quiz.number("Q2.2", "all-reduce time of {billions}B bf16 gradients on {gpus} GPUs (ms)", rel_tol=0.03,
                given=dict(billions=7, gpus=8), vary=dict(billions=(1, 3, 13, 34, 70), gpus=(4, 16, 64)),
                solve=lambda billions, gpus: ring_all_reduce_time(billions * 1e9 * 2, gpus, 0.0, 450e9) * 1e3,
                hint="section 5: M = 2 bytes x 7e9, the ring sends 2(N-1)/N * M per rank at beta; alpha is "
                     "negligible at this size"),
    quiz.choice("Q2.3", "the algorithm for a 4 KiB all-reduce on 1024 ranks", answer="b", options="abc",
                hint="section 3: which term of the alpha-beta model dominates a small message, and how many "
                     "steps does each algorithm pay it?"),
    quiz.number("Q2.4", "recursive-doubling/ring crossover for N = {ranks}, alpha = {alpha_us} us, "
                "beta = {beta_gbs} GB/s (MB)", rel_tol=0.02, given=dict(ranks=4, alpha_us=10, beta_gbs=100),
                vary=dict(ranks=(8, 16), alpha_us=(5, 20, 50), beta_gbs=(25, 50, 200)),
                solve=lambda ranks, alpha_us, beta_gbs: crossover_bytes(ranks, alpha_us * 1e-6, beta_gbs * 1e9) / 1e6,
                hint="section 3: M* = (S_ring - S_tree) alpha beta / (B_tree - B_ring), 8 alpha beta for N = 4"),
    quiz.number("Q2.5", "sequential messages of recursive doubling on {ranks} ranks", rel_tol=0, given=dict(ranks=1024),
                vary=dict(ranks=(256, 512, 1000, 2048, 3000, 4096)), solve=lambda ranks: tree_steps(ranks),
                hint="exercise 2.4: each round doubles the block of ranks whose sum you hold"),
    quiz.choice("Q2.6", "ring bytes per rank as N grows from 8 to 1024", answer="c", options="abc",
                hint="section 2: 2(N-1)/N * M for N = 8 and N = 1024"),
]

def _world(c: dict) -> int:
    return c["world"]


def _numel(c: dict) -> int:
    return math.prod(c["shape"])


# The boundaries each exercise's text names (harness.Edge; tests/grading/test_reference_seeds.py checks every seed's
# cases hold each): "2, 3 and 4 ranks", "sizes not divisible by N, fewer elements than ranks, 2-D, float32 and
# float64" (2.1, 2.2's same shapes), the zero padding to a multiple of N (2.3), and for 2.4 "N that is not a power
# of two (N = 3)" and enough ranks (8) that log2 N rounds differ from what N <= 4 allows.
_RINGS = [Edge("2 ranks", lambda c: _world(c) == 2), Edge("3 ranks", lambda c: _world(c) == 3),
          Edge("4 ranks", lambda c: _world(c) == 4),
          Edge("a size not divisible by N", lambda c: _numel(c) % _world(c) != 0),
          Edge("fewer elements than ranks", lambda c: _numel(c) < _world(c)),
          Edge("a 2-D tensor", lambda c: len(c["shape"]) == 2),
          Edge("float32", lambda c: c["dtype"] == torch.float32),
          Edge("float64", lambda c: c["dtype"] == torch.float64)]
EDGES = {
    "2.1": _RINGS, "2.2": _RINGS, "2.3": _RINGS,
    "2.4": [*_RINGS, Edge("N not a power of two", lambda c: _world(c) & (_world(c) - 1) != 0),
            Edge("8 ranks: three rounds", lambda c: _world(c) == 8)],
}

# Mutants of the reference that compute the same thing (distlab notebooks mutants), each with why.
_INDEPENDENT = "two statements that do not read each other's names, in the other order"
EQUIVALENT_MUTANTS = {
    "2.1 off-by-one: `1` → `0`": "the shortcut for N = 1 (if n == 1) made n == 0: on one rank both loops run zero "
                                 "steps and return the tensor as it is, what the shortcut returns",
    "2.1 statements-swapped: `if n == 1: return tensor right, left = (rank + 1) % n, (rank - 1) % n` → "
    "`right, left = (rank + 1) % n, (rank - 1) % n if n == 1: return tensor`": _INDEPENDENT,
    "2.1 statements-swapped: `right, left = (rank + 1) % n, (rank - 1) % n chunks = coll.split_chun…` → "
    "`chunks = coll.split_chunks(tensor.view(-1), n) right, left = (rank + …`": _INDEPENDENT,
    "2.2 statements-swapped: `right, left = (rank + 1) % n, (rank - 1) % n pieces = [torch.empty_li…` → "
    "`pieces = [torch.empty_like(tensor) for _ in range(n)] right, left = (…`": _INDEPENDENT,
    "2.3 statements-swapped: `n = dist.get_world_size() flat = tensor.reshape(-1)` → "
    "`flat = tensor.reshape(-1) n = dist.get_world_size()`": _INDEPENDENT,
    "2.3 statements-swapped: `padded[: flat.numel()] = flat mine = torch.empty(per_rank, dtype=tens…` → "
    "`mine = torch.empty(per_rank, dtype=tensor.dtype) padded[: flat.numel(…`": _INDEPENDENT,
    "2.4 statements-swapped: `flat += incoming distance *= 2` → `distance *= 2 flat += incoming`": _INDEPENDENT,
    "2.4 statements-swapped: `if rank + p < n: dist.irecv(incoming, rank + p).wait() flat += incomi…` → "
    "`distance = 1 if rank + p < n: dist.irecv(incoming, rank + p).wait() f…`": _INDEPENDENT,
    "2.4 statements-swapped: `if rank >= p: # an extra rank: hand my tensor in, get the sum back di…` → "
    "`if rank + p < n: dist.irecv(incoming, rank + p).wait() flat += incomi…`":
        "the two ifs exclude each other (rank >= p makes rank + p >= 2p > n), so their order changes nothing",
    "2.4 statements-swapped: `incoming = torch.empty_like(flat) p = 1 << (n.bit_length() - 1)` → "
    "`p = 1 << (n.bit_length() - 1) incoming = torch.empty_like(flat)`": _INDEPENDENT,
    "2.4 statements-swapped: `rank, n = dist.get_rank(), dist.get_world_size() flat = tensor.view(-…` → "
    "`flat = tensor.view(-1) rank, n = dist.get_rank(), dist.get_world_size…`": _INDEPENDENT,
}

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
