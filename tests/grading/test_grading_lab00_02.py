"""Labs 00 and 02 checkers: the references pass; wrong rings fail naming rank and element (or the bytes they
sent); a ring that calls dist.all_reduce is caught; a "tree" with too many messages is caught; a deadlock fails
fast; an untouched stub is 'not attempted'."""

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

import distlab
from distlab import collectives as C
from distlab.grading import CheckFailed, lab00, lab02
from distlab.grading.lab00 import check_mean_across_ranks, check_rank_sum
from distlab.grading.lab02 import (
    check_all_reduce_via_reduce_scatter,
    check_ring_all_gather,
    check_ring_all_reduce,
    check_tree_all_reduce,
)

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


def ring_with_builtin(x):
    dist.all_reduce(x)
    return x


def ring_without_all_gather(x):
    """Reduce-scatter only: each rank ends up with one finished chunk and partial sums elsewhere."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = C.split_chunks(x.view(-1), n)
    for step in range(n - 1):
        send, recv = (rank - step) % n, (rank - step - 1) % n
        incoming = torch.empty_like(chunks[recv])
        req = dist.isend(chunks[send], (rank + 1) % n)
        dist.recv(incoming, (rank - 1) % n)
        req.wait()
        chunks[recv] += incoming
    return x


def naive_all_reduce(x):
    """Correct sums, but every rank sends its whole tensor to every other rank: (N-1) * M bytes."""
    rank, n = dist.get_rank(), dist.get_world_size()
    reqs = [dist.isend(x, peer) for peer in range(n) if peer != rank]
    total = x.clone()
    for peer in range(n):
        if peer != rank:
            incoming = torch.empty_like(x)
            dist.recv(incoming, peer)
            total += incoming
    for req in reqs:
        req.wait()
    x.copy_(total)
    return x


def deadlocking_ring(x):
    incoming = torch.empty_like(x)
    dist.recv(incoming, (dist.get_rank() - 1) % dist.get_world_size())  # everyone waits, nobody sends
    return x


def stub(*args):
    raise NotImplementedError("Exercise 2.1: replace this line with your solution")


def gather_rotated(x):
    pieces = C.ring_all_gather(x)
    return pieces[1:] + pieces[:1]


def gather_with_builtin(x):
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x)
    return out


def reduce_scatter_without_padding(x):
    n = dist.get_world_size()
    mine = torch.empty(x.numel() // n, dtype=x.dtype)
    dist.reduce_scatter_tensor(mine, x.reshape(-1))
    dist.all_gather_into_tensor(x.view(-1), mine)
    return x


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


def test_mean_that_forgets_to_divide_names_rank_and_element():
    with pytest.raises(CheckFailed, match=r"^rank 0, element 0: expected .*, got .* divide by the world size"):
        check_mean_across_ranks(mean_forgets_to_divide)
    with pytest.raises(CheckFailed, match=r"rank 0 returned None"):
        check_mean_across_ranks(lambda x: None)


def test_ring_that_calls_all_reduce_is_caught():
    with pytest.raises(CheckFailed, match=r"your ring sent 0 bytes with send/isend \(it called dist.all_reduce\); "
                                          r"it must be built from point-to-point ops"):
        check_ring_all_reduce(ring_with_builtin)


def test_ring_without_all_gather_names_rank_and_element():
    number = r"-?[\d.e+-]+"
    with pytest.raises(CheckFailed, match=rf"^rank \d, element \d+: expected {number}, got {number} \(world size 2"):
        check_ring_all_reduce(ring_without_all_gather)


def test_naive_all_reduce_sends_too_much():
    # on 2 ranks a naive exchange is a ring; on 3 it sends (N-1)*M instead of 2(N-1)/N*M
    with pytest.raises(CheckFailed, match=r"rank 0 sent \d+ bytes with send/isend, but a ring sends \d+ per rank "
                                          r"\(world size 3"):
        check_ring_all_reduce(naive_all_reduce)


def test_a_ring_or_a_builtin_is_no_tree():
    with pytest.raises(CheckFailed, match=r"rank 0 sent 2 messages on 2 ranks, but a latency-optimal all-reduce "
                                          r"needs only ceil\(log2 N\) = 1 .*rank r xor 2\^k"):
        check_tree_all_reduce(C.ring_all_reduce)
    with pytest.raises(CheckFailed,
                       match=r"your recursive doubling sent 0 bytes with send/isend \(it called dist.all_reduce\)"):
        check_tree_all_reduce(ring_with_builtin)
    # everyone-to-everyone: right sums, N-1 messages per rank, too many from N = 4 on
    with pytest.raises(CheckFailed, match=r"sent 3 messages on 4 ranks"):
        check_tree_all_reduce(naive_all_reduce)


def test_deadlocked_ring_fails_fast_with_the_hint_for_what_happened(monkeypatch, no_leftover_ranks):
    monkeypatch.setattr(lab00, "COLLECTIVE_TIMEOUT", 1.5)
    with pytest.raises(CheckFailed, match=r"^your ring deadlocked on 2 ranks: every rank waits to receive \(rank 0 "
                                          r"waits for rank 1, rank 1 waits for rank 0\) and none is sending.* "
                                          r"Hint: start each send before the matching receive \(dist.isend\)"):
        check_ring_all_reduce(deadlocking_ring)


def test_all_gather_mistakes():
    with pytest.raises(CheckFailed, match=r"^rank 0, element 0: expected .* \(entry 0, world size 2"):
        check_ring_all_gather(gather_rotated)
    with pytest.raises(CheckFailed, match=r"sent 0 bytes with send/isend \(it called dist.all_gather\)"):
        check_ring_all_gather(gather_with_builtin)
    with pytest.raises(CheckFailed, match=r"rank 0 returned a Tensor; return a list of 2 tensors"):
        check_ring_all_gather(lambda x: x)


def test_reduce_scatter_all_gather_mistakes():
    with pytest.raises(CheckFailed, match=r"rank 0 called dist.all_reduce; build the all-reduce from"):
        check_all_reduce_via_reduce_scatter(ring_with_builtin)
    # forgetting to pad: gloo refuses sizes not divisible by N; reported as a failure, not a crash
    result = distlab.check("2.3", reduce_scatter_without_padding, quiet=True)
    assert result.status == "failed" and "raised RankFailed" in result.detail


@pytest.mark.parametrize("exercise_id", ["0.1", "0.2", "2.1", "2.2", "2.3", "2.4"])
def test_stub_is_not_attempted(exercise_id, capsys, no_leftover_ranks):
    result = distlab.check(exercise_id, stub)
    assert result.status == "not attempted" and result.points == 0
    assert "(not attempted)" in capsys.readouterr().out
