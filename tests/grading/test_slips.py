"""The common slips with torch and torch.distributed (``distlab.grading.contract.SLIPS``): each one raised for real by
the installed torch, in this process or on real ranks, and named by the one line a student reads
(``describe_error``); an error that is no slip is told as it is."""

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import distlab
from distlab.grading import check
from distlab.grading.contract import SLIPS, describe_error, is_not_attempted, slip_of
from distlab.runtime.launch import RankCrashed, RankFailed
from distlab.zero import FlatLayout

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = [pytest.mark.timeout(120)]


def _update_leaf():
    w = torch.ones(2, requires_grad=True)
    w -= 1


def _modify_saved():
    a = torch.ones(2, requires_grad=True)
    b = a.exp()
    b.add_(1)
    b.sum().backward()


def _backward_twice():
    a = torch.ones(2, requires_grad=True)
    loss = (a * a).sum()
    loss.backward()
    loss.backward()


# Each slip, as a student writes it: code run in this process.
HERE = {
    "leaf-updated-in-place": _update_leaf,
    "saved-tensor-modified": _modify_saved,
    "backward-twice": _backward_twice,
    "graph-cut": lambda: torch.ones(2).sum().backward(),
    "backward-of-a-tensor": lambda: (torch.ones(2, requires_grad=True) * 2).backward(),
    "dtypes-mixed": lambda: torch.ones(2, 2) @ torch.ones(2, 2, dtype=torch.float64),
    "matmul-shapes": lambda: nn.functional.linear(torch.ones(2, 3), torch.ones(4, 2)),
    "sizes-differ": lambda: torch.ones(3) + torch.ones(4),
    "float-size": lambda: torch.ones(4)[: 4 / 2],
    "item-of-many": lambda: torch.ones(2).item(),
    "floor-division-in-autograd": lambda: (torch.ones(2, requires_grad=True) // 2).sum().backward(),
    "list-for-a-tensor": lambda: dist.all_reduce([torch.ones(2)]),
    "outside-the-ranks": lambda: dist.all_reduce(torch.ones(2)),
    "devices-mixed": lambda: torch.ones(2).index_add_(0, torch.zeros(1, dtype=torch.long),
                                                      torch.ones(1, device="meta")),
    "plain-tensor-parameter": lambda: setattr(nn.Linear(2, 2), "weight", torch.ones(2, 2)),
    "dim-out-of-range": lambda: torch.ones(2).sum(dim=1),
    "shape-index-past-the-end": lambda: torch.ones(2, 2).shape[2],
    "dim-and-index-swapped": lambda: torch.ones(2, 3).gather(torch.zeros(2, 1, dtype=torch.long), -1),
    "index-along-another-dim": lambda: torch.zeros(3, 2).index_add(1, torch.zeros(3, dtype=torch.long),
                                                                   torch.ones(3, 2)),
    "mean-of-integers": lambda: torch.bincount(torch.tensor([0, 1, 1])).mean(),
    "empty-unpack": lambda: _unpack_what_forward_never_saved(),
    "no-kernel-for-the-dtype": lambda: torch.ones(2).to(torch.float8_e4m3fn) * 2.0,
    "scaled-mm-scales": lambda: torch._scaled_mm(  # a row-wise scale_a and scale_b swapped
        torch.ones(32, 16).to(torch.float8_e4m3fn), torch.ones(16, 16).to(torch.float8_e4m3fn).t(),
        scale_a=torch.ones(1, 16), scale_b=torch.ones(32, 1), out_dtype=torch.float32),
    "argument-of-another-kind": lambda: nn.functional.one_hot(3, torch.tensor([1])),
    "index-past-the-end": lambda: torch.ones(4)[4],
    "view-of-a-strided-tensor": lambda: torch.ones(4, 4).t().view(16),
    "size-of-another-shape": lambda: torch.ones(9).view(4, 2),
    "negative-size": lambda: torch.zeros(-(5 // 2)),
    "used-before-assigned": lambda: _use_before_assigning(),
    "tensor-as-a-bool": lambda: bool(torch.ones(2) > 0),
    "permute-dims": lambda: torch.ones(2, 3).permute(0, 0),
    "range-bounds-reversed": lambda: torch.arange(3, 1),
    "lookup-past-the-rows": lambda: nn.functional.embedding(torch.tensor([5]), torch.ones(3, 2)),
    "path-of-another-type": lambda: open(None),  # noqa: SIM115  the slip: a path argument that is None
    "linear-arguments-swapped": lambda: nn.functional.linear(torch.ones(4, 3), torch.ones(2, 2, 3)),
    "empty-list-joined": lambda: torch.cat([t for t in [torch.ones(2)] if t.sum() > 5]),
    "none-in-a-list": lambda: torch.cat([None]),
    "ctx-attribute-unset": lambda: _CtxUnset.apply(torch.ones(2, requires_grad=True)).sum().backward(),
    "p2p-op-arguments": lambda: dist.P2POp(torch.ones(1), dist.isend, 1),
    "torch-arguments-order": lambda: torch.ones(2).masked_fill(0, torch.ones(2, dtype=torch.bool)),
    "unpacked-count": lambda: [a for a, b in zip([(1, 2, 3)])],
    "compared-types": lambda: sorted([("F", 1), 0]),
    "lookup-in-an-empty-table": lambda: nn.functional.embedding(torch.tensor([0]), torch.ones(0, 2)),
    "gradient-of-another-shape": lambda: torch.ones(2, 3, requires_grad=True).sum(0).backward(torch.ones(3, 2)),
}


class _CtxUnset(torch.autograd.Function):
    """A custom autograd Function whose backward reads what its forward forgot to keep."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)  # the slip: ctx.scale is never set

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale


def _unpack_what_forward_never_saved():
    class Doubled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return 2 * x  # the slip: no ctx.save_for_backward(x)

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return 2 * grad

    Doubled.apply(torch.ones(2, requires_grad=True)).sum().backward()


def _use_before_assigning():
    total += 1  # noqa: F821  the slip itself: total is assigned below, after this line
    total = 0
    return total


# Slips only a process group shows, raised on two real ranks.
def _gather_into_a_short_buffer():
    dist.all_gather_into_tensor(torch.empty(3), torch.ones(2))


def _use_what_all_reduce_returned():
    total = dist.all_reduce(torch.ones(2))  # it reduces in place and returns None
    return total / dist.get_world_size()


def _partner_past_the_last_rank():
    """Lab 02's checker names a partner outside 0..N-1 (gloo would crash the rank or wait forever)."""
    from distlab.grading.lab02 import _peers_checked  # noqa: PLC0415  in the rank, as the checker runs it

    with _peers_checked():
        dist.send(torch.ones(1), dist.get_rank() + dist.get_world_size())


def _send_to_myself():
    dist.send(torch.ones(1), dist.get_rank())  # a ring's neighbour computed as the rank itself


def _group_where_a_tensor_belongs():
    return dist.group.WORLD.view_as(torch.ones(1))  # f(group, x) for f(x, group): the group is used as x


def _send_a_transpose():
    dist.all_to_all_single(torch.empty(2, 2), torch.ones(2, 2).t())  # a transposed view, not contiguous


ON_RANKS = {"collective-not-contiguous": _send_a_transpose,
            "collective-buffer-size": _gather_into_a_short_buffer, "group-for-a-tensor": _group_where_a_tensor_belongs,
            "collective-returns-none": _use_what_all_reduce_returned, "peer-is-this-rank": _send_to_myself,
            "peer-outside-the-group": _partner_past_the_last_rank}


def test_every_slip_has_an_example_here():
    assert {slip.name for slip in SLIPS} == set(HERE) | set(ON_RANKS)
    assert len({slip.name for slip in SLIPS}) == len(SLIPS)


@pytest.mark.parametrize("name", sorted(HERE))
def test_the_slip_raised_here_is_named_with_the_students_line(name):
    with pytest.raises(Exception) as raised:
        HERE[name]()
    slip = slip_of(raised.value)
    assert slip is not None and slip.name == name, (name, type(raised.value).__name__, str(raised.value)[:200])
    line = describe_error(raised.value)
    assert line.endswith(f"; the usual slip: {slip.says}") and "(at line " in line, line


@pytest.mark.parametrize("name", sorted(ON_RANKS))
def test_the_slip_raised_on_a_rank_is_named(name):
    with pytest.raises((RankFailed, RankCrashed)) as raised:
        distlab.launch(ON_RANKS[name], 2, show_output=False, warm=True)
    slip = slip_of(raised.value)
    assert slip is not None and slip.name == name, str(raised.value)[:300]
    assert describe_error(raised.value).endswith(f"; the usual slip: {slip.says}")


def test_a_check_reports_the_slip_and_the_students_line():
    """The path a student sees: a wrong answer raises inside a checker, and its ✗ line names the line and slip."""
    def bytes_per_param(zero_stage, world_size):
        sizes = torch.tensor([2.0, 2.0, 12.0])
        return sizes.item() / world_size  # a tensor of three values, read as one

    result = check("1.1", bytes_per_param, quiet=True)
    assert result.status == "failed", result
    assert "(at line " in result.detail and "return sizes.item() / world_size" in result.detail, result.detail
    assert result.detail.endswith("the usual slip: " + slip_of(result.detail).says), result.detail


def test_a_missing_kernel_is_a_failed_attempt_not_an_untouched_stub():
    """torch's NotImplementedError for an op without a kernel (arithmetic on FP8) is the student's slip, told as one;
    only a stub's NotImplementedError ("Exercise N.k: ...") reads as not attempted."""
    def emulated_mm(a, b, scale_a, scale_b, out_dtype):
        return ((a.float() * scale_a) @ (b * scale_b)).to(out_dtype)  # b left in FP8

    result = check("9.4", emulated_mm, None, None, quiet=True)
    assert result.status == "failed" and "no kernel for this op in this dtype" in result.detail, result
    assert is_not_attempted(NotImplementedError("Exercise 9.4: replace this line with your solution"))


def test_an_error_that_is_no_slip_is_told_as_it_is():
    error = ValueError("the student's own message")
    assert slip_of(error) is None and describe_error(error) == "ValueError: the student's own message"


# Other errors a slip is told by (its pattern's other alternatives), each raised for real.
ALSO = [
    ("dtypes-mixed", lambda: nn.functional.layer_norm(torch.ones(2, 4), (4,), torch.ones(4, dtype=torch.bfloat16))),
    ("dtypes-mixed", lambda: setattr(torch.ones(2), "grad", torch.ones(2, dtype=torch.bfloat16))),
    ("matmul-shapes", lambda: torch.ones(2, 1, 3) @ torch.ones(2, 4, 3)),
    ("sizes-differ", lambda: torch.ones(13).expand(4)),
    ("sizes-differ", lambda: torch.ones(1, 3).add_(torch.ones(2, 3))),
    ("index-past-the-end", lambda: [0].__setitem__(2, 1)),
    ("argument-of-another-kind", lambda: torch.zeros(nn.Linear(2, 2).size())),
    ("argument-of-another-kind", lambda: len(3)),
    ("argument-of-another-kind", lambda: FlatLayout(4, [nn.Parameter(torch.ones(2))])),  # its arguments swapped
    ("argument-of-another-kind", lambda: [1, 2][torch.ones(2, dtype=torch.long)]),
    ("torch-arguments-order", lambda: torch.where(torch.zeros(2), torch.ones(2), torch.ones(2))),
    ("unpacked-count", lambda: [a for a, b in [(1, 2, 3)]]),
]


@pytest.mark.parametrize("name, raise_it", ALSO)
def test_each_error_a_slip_is_told_by_names_it(name, raise_it):
    with pytest.raises(Exception) as raised:
        raise_it()
    slip = slip_of(raised.value)
    assert slip is not None and slip.name == name, (name, type(raised.value).__name__, str(raised.value)[:200])
