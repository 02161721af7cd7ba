"""Lab 02: answers students plausibly write, each run through its checker: every one fails, naming the mistake;
the library's reference for each exercise passes. The mistakes fail on the first case (world size 2), but for the
naive exchange, which is a ring there and sends too much from world size 3 on."""

import re
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

import distlab
from distlab import collectives as C

pytestmark = [pytest.mark.timeout(180)]

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks need not import this file


def _ring_steps(x, phases):
    """A ring over chunks of x, running only the phases named ('reduce-scatter', 'all-gather')."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = list(x.view(-1).tensor_split(n))
    right, left = (rank + 1) % n, (rank - 1) % n
    for phase in phases:
        for step in range(n - 1):
            if phase == "reduce-scatter":
                send, recv = (rank - step) % n, (rank - step - 1) % n
            else:
                send, recv = (rank + 1 - step) % n, (rank - step) % n
            incoming = torch.empty_like(chunks[recv])
            request = dist.isend(chunks[send].clone(), right)
            dist.recv(incoming, left)
            request.wait()
            if phase == "reduce-scatter":
                chunks[recv] += incoming
            else:
                chunks[recv].copy_(incoming)
    return x


def calls_the_builtin(x):
    """dist.all_reduce instead of the algorithm the exercise asks for (2.1, 2.3, 2.4)."""
    dist.all_reduce(x)
    return x


def naive_all_reduce(x):
    """Right sums, but every rank sends its whole tensor to every other rank: (N-1) * M bytes, N-1 messages."""
    rank, n = dist.get_rank(), dist.get_world_size()
    requests = [dist.isend(x.clone(), peer) for peer in range(n) if peer != rank]
    total = x.clone()
    for peer in range(n):
        if peer != rank:
            incoming = torch.empty_like(x)
            dist.recv(incoming, peer)
            total += incoming
    for request in requests:
        request.wait()
    x.copy_(total)
    return x


# ---------------------------------------------------------------- 2.1 ring all-reduce

def ring_without_all_gather(x):
    """Stops after the reduce-scatter: each rank holds one summed chunk."""
    return _ring_steps(x, ["reduce-scatter"])


def ring_returns_the_mean(x):
    """Divides by the world size: a mean, not a sum."""
    _ring_steps(x, ["reduce-scatter", "all-gather"])
    x /= dist.get_world_size()
    return x


def ring_out_of_place(x):
    """Builds the sum in a copy and returns nothing: the caller's tensor is unchanged."""
    _ring_steps(x.clone(), ["reduce-scatter", "all-gather"])


def ring_sends_whole_tensor(x):
    """Passes the whole tensor around the ring, N-1 times M bytes: right sums, too many bytes."""
    rank, n = dist.get_rank(), dist.get_world_size()
    travelling, total = x.clone(), x.clone()
    for _ in range(n - 1):
        incoming = torch.empty_like(x)
        request = dist.isend(travelling, (rank + 1) % n)
        dist.recv(incoming, (rank - 1) % n)
        request.wait()
        total += incoming
        travelling = incoming
    x.copy_(total)
    return x


# ---------------------------------------------------------------- 2.2 ring all-gather

def gather_calls_builtin(x):
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x)
    return out


def gather_filed_by_step(x):
    """Appends pieces in the order they arrive, so entry i is not rank i's tensor."""
    rank, n = dist.get_rank(), dist.get_world_size()
    pieces, travelling = [x.clone()], x.clone()
    for _ in range(n - 1):
        incoming = torch.empty_like(x)
        request = dist.isend(travelling, (rank + 1) % n)
        dist.recv(incoming, (rank - 1) % n)
        request.wait()
        pieces.append(incoming)
        travelling = incoming
    return pieces


def gather_returns_concatenation(x):
    """Returns one tensor instead of a list of N."""
    return torch.cat(C.ring_all_gather(x))


# ---------------------------------------------------------------- 2.3 reduce-scatter + all-gather

def rs_ag_without_all_gather(x):
    """Reduce-scatters, then writes its own chunk back, never gathering the others."""
    n = dist.get_world_size()
    flat = x.view(-1)
    padded = torch.zeros(-(-flat.numel() // n) * n, dtype=x.dtype)
    padded[:flat.numel()] = flat
    mine = torch.empty(padded.numel() // n, dtype=x.dtype)
    dist.reduce_scatter_tensor(mine, padded)
    return x


def rs_ag_without_padding(x):
    """Reduce-scatters a tensor whose size N does not divide: gloo refuses, on the ranks."""
    n = dist.get_world_size()
    mine = torch.empty(x.numel() // n, dtype=x.dtype)
    dist.reduce_scatter_tensor(mine, x.reshape(-1))
    dist.all_gather_into_tensor(x.view(-1), mine)
    return x


# ---------------------------------------------------------------- 2.4 recursive doubling

def doubling_with_a_ring(x):
    """A ring is no latency-optimal all-reduce: 2(N-1) messages."""
    return _ring_steps(x, ["reduce-scatter", "all-gather"])


def linear_chain(x):
    """Issue 46 item 22: reduce N-1 → … → 0, then broadcast back: at most 2 messages per rank, 2(N-1) rounds."""
    rank, n = dist.get_rank(), dist.get_world_size()
    flat, incoming = x.view(-1), torch.empty_like(x.view(-1))
    if rank < n - 1:
        dist.recv(incoming, rank + 1)
        flat += incoming
    if rank > 0:
        dist.send(flat, rank - 1)
        dist.recv(flat, rank - 1)
    if rank < n - 1:
        dist.send(flat, rank + 1)
    return x


def doubling_without_waiting(x):
    """Recursive doubling whose extra rank never waits on its isend."""
    rank, n = dist.get_rank(), dist.get_world_size()
    flat, incoming = x.view(-1), torch.empty_like(x.view(-1))
    p = 1 << (n.bit_length() - 1)
    if rank >= p:
        dist.isend(flat, rank - p)
        dist.irecv(flat, rank - p).wait()
        return x
    if rank + p < n:
        dist.irecv(incoming, rank + p).wait()
        flat += incoming
    distance = 1
    while distance < p:
        requests = [dist.isend(flat, rank ^ distance), dist.irecv(incoming, rank ^ distance)]
        for request in requests:
            request.wait()
        flat += incoming
        distance *= 2
    if rank + p < n:
        dist.isend(flat, rank + p).wait()
    return x


WRONG = [
    ("2.1", calls_the_builtin, r"your ring sent 0 bytes with send/isend \(it called dist.all_reduce\); it must be "
                               r"built from point-to-point ops"),
    ("2.1", ring_without_all_gather, r"^rank \d \(world size 2, \d+ float32 elements\): the result differs from the "
                                     r"reference by up to .*elements hold the sum and the rest do not: is a phase "
                                     r"cut short\? After the reduce-scatter"),
    ("2.1", ring_returns_the_mean, r"that is the sum divided by 2, the mean: an all-reduce sums"),
    ("2.1", ring_out_of_place, r"the result is this rank's own input, nothing was added: reduce into the tensor"),
    ("2.1", ring_sends_whole_tensor, r"each step should send one chunk, not the whole tensor"),
    ("2.1", naive_all_reduce, r"rank 0 sent \d+ bytes with send/isend, but a ring sends \d+ per rank \(world size 3"),
    ("2.2", gather_calls_builtin, r"sent 0 bytes with send/isend \(it called dist.all_gather\)"),
    ("2.2", gather_filed_by_step, r"^rank \d \(world size 2, \d+ float32 elements per rank\): entry \d differs "
                                  r"from the reference .*entry \d holds rank \d's tensor; entry i must be rank i's"),
    ("2.2", gather_returns_concatenation, r"returned a Tensor; return a list of 2 tensors"),
    ("2.3", calls_the_builtin, r"called dist.all_reduce; build the all-reduce from dist.reduce_scatter_tensor"),
    ("2.3", rs_ag_without_all_gather, r"the result is this rank's own input, nothing was added"),
    ("2.3", rs_ag_without_padding, r"raised RankFailed"),  # a failure of the check, not a crash of the grader
    ("2.4", calls_the_builtin, r"your recursive doubling sent 0 bytes with send/isend"),
    ("2.4", naive_all_reduce, r"sent 3 messages on 4 ranks, but a latency-optimal all-reduce"),
    ("2.4", doubling_with_a_ring, r"sent 2 messages on 2 ranks, but a latency-optimal all-reduce needs only "
                                  r"ceil\(log2 N\) = 1"),
    ("2.4", linear_chain, r"your messages form a chain 2 rounds long on 2 ranks \(each waiting on the one before\), "
                          r"but recursive doubling takes 1"),
    ("2.4", doubling_without_waiting, r"rank 2 returned with 1 request\(s\) never waited on \(isend; world size 3"),
]


@pytest.mark.parametrize("exercise, wrong, message", WRONG, ids=[f"{w[0]}-{w[1].__name__}" for w in WRONG])
def test_a_wrong_answer_fails_naming_the_mistake(exercise, wrong, message):
    result = distlab.check(exercise, wrong, quiet=True)
    assert result.status == "failed" and result.points == 0, result
    assert re.search(message, result.detail), result.detail


@pytest.mark.parametrize("exercise, right", [("2.1", C.ring_all_reduce), ("2.2", C.ring_all_gather),
                                             ("2.3", C.all_reduce_via_reduce_scatter), ("2.4", C.tree_all_reduce)])
def test_the_reference_passes(exercise, right):
    assert distlab.check(exercise, right, quiet=True).status == "passed"
