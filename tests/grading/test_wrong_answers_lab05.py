"""Lab 05: answers students plausibly write, each run through its checker: every one fails, naming the mistake.

The right answers are the solution notebook's own code, executed into one namespace as in a kernel, so a later
exercise calls the earlier ones by their notebook names. A wrong answer replaces one name there; the exercises
built on it must still pass (their checkers run on distlab's reference for the pieces below them).
"""

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import distlab
from distlab.tensor_parallel import all_gather_sequence, reduce_scatter_along_sequence
from wrong_answers import solution_namespace

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_thread")]

NOTEBOOK = Path(__file__).resolve().parents[2] / "solutions" / "05_tensor_parallel.ipynb"


SOLUTION = solution_namespace("05_tensor_parallel.ipynb", 5)
ANSWERS = {"5.1": ("f", "g"), "5.2": ("ColumnParallelLinear", "RowParallelLinear"), "5.3": ("TensorParallelMLP",),
           "5.4": ("qkv_rows", "TensorParallelAttention"),
           "5.5": ("VocabParallelEmbedding", "vocab_parallel_cross_entropy"),
           "5.6": ("gather_sequence", "reduce_scatter_sequence")}


def answer(exercise: str, namespace: dict) -> list:
    return [namespace[name] for name in ANSWERS[exercise]]


# ---------------------------------------------------------------- wrong answers, one small class each

class FNoAllReduce(torch.autograd.Function):
    """5.1: f's backward returns the gradient as it came (forgot the all-reduce)."""

    @staticmethod
    def forward(ctx, x, group=None):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class FWorld(torch.autograd.Function):
    """5.1: f's backward all-reduces over every rank (forgot group=)."""

    @staticmethod
    def forward(ctx, x, group=None):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad, None


class FInPlace(torch.autograd.Function):
    """5.1: f's backward all-reduces autograd's gradient tensor in place."""

    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class GAveraged(torch.autograd.Function):
    """5.1: g averages the partial sums instead of adding them."""

    @staticmethod
    def forward(ctx, x, group=None):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out / dist.get_world_size(group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GInPlace(torch.autograd.Function):
    """5.1: g all-reduces its input in place and returns it: the caller's x is overwritten."""

    @staticmethod
    def forward(ctx, x, group=None):
        dist.all_reduce(x, group=group)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GReducesBackward(torch.autograd.Function):
    """5.1: g all-reduces in backward too (as if it were f as well)."""

    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def apply_of(function):
    return lambda x, group=None: function.apply(x, group)


class ColumnGlobalRank(SOLUTION["ColumnParallelLinear"]):
    """5.2: rows chosen with the global rank (dist.get_rank()) instead of the rank in the TP group."""

    def __init__(self, dense, group=None, rows=None, gather_output=False):
        torch.nn.Module.__init__(self)
        t, r = dist.get_world_size(group), dist.get_rank()
        per = dense.out_features // t
        rows = torch.arange(r * per, (r + 1) * per) if rows is None else rows
        self.group, self.gather_output = group, gather_output
        self.weight = torch.nn.Parameter(dense.weight.detach()[rows].clone())
        self.bias = None if dense.bias is None else torch.nn.Parameter(dense.bias.detach()[rows].clone())


class ColumnNoF(SOLUTION["ColumnParallelLinear"]):
    """5.2: the input does not go through f, so its gradient is this rank's part only."""

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        return SOLUTION["gather_from_tp"](y, self.group) if self.gather_output else y


class ColumnIgnoresRows(SOLUTION["ColumnParallelLinear"]):
    """5.2: always the contiguous block, whatever rows says."""

    def __init__(self, dense, group=None, rows=None, gather_output=False):
        super().__init__(dense, group, None, gather_output)


class RowBiasEveryRank(SOLUTION["RowParallelLinear"]):
    """5.2: the bias added on every rank before the all-reduce."""

    def forward(self, x):
        return SOLUTION["g"](F.linear(x, self.weight, self.bias), self.group)


class RowNoReduce(SOLUTION["RowParallelLinear"]):
    """5.2: the partial product returned without the all-reduce (forgot g)."""

    def forward(self, x):
        y = F.linear(x, self.weight)
        return y if self.bias is None else y + self.bias


class RowSliceShared(SOLUTION["RowParallelLinear"]):
    """5.2: the weight's columns kept as a view of the dense layer's (no .clone()): they share memory."""

    def __init__(self, dense, group=None):
        super().__init__(dense, group)
        t, r = dist.get_world_size(group), dist.get_rank(group)
        per = dense.in_features // t
        self.weight = torch.nn.Parameter(dense.weight.detach()[:, r * per:(r + 1) * per])


class MLPNoGelu(SOLUTION["TensorParallelMLP"]):
    """5.3: forgot the GELU between the two linears."""

    def forward(self, x):
        return self.proj(self.fc(x))


class MLPBothColumn(torch.nn.Module):
    """5.3: both linears column-parallel, the output gathered (the 'other order': communication in the middle)."""

    def __init__(self, mlp, group=None):
        super().__init__()
        self.fc = SOLUTION["ColumnParallelLinear"](mlp.fc, group, gather_output=True)
        self.proj = SOLUTION["ColumnParallelLinear"](mlp.proj, group, gather_output=True)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class MLPGeluAfterReduce(SOLUTION["TensorParallelMLP"]):
    """5.3: the GELU applied after the row-parallel projection instead of between the linears."""

    def forward(self, x):
        return F.gelu(self.proj(self.fc(x)))


def qkv_rows_contiguous(d_model, n_head, tp, rank):
    """5.4: a contiguous block of the packed rows (mixes q, k and v)."""
    per = 3 * d_model // tp
    return torch.arange(rank * per, (rank + 1) * per)


def qkv_rows_q_only(d_model, n_head, tp, rank):
    """5.4: this rank's heads of q only (forgot k and v)."""
    per = d_model // tp
    return torch.arange(rank * per, (rank + 1) * per)


def qkv_rows_head_count(d_model, n_head, tp, rank):
    """5.4: steps by heads per rank instead of rows per rank (n_head/tp, not d_model/tp)."""
    per = n_head // tp
    heads = torch.arange(rank * per, (rank + 1) * per)
    return torch.cat([heads, heads + d_model, heads + 2 * d_model])


class EmbeddingNoMask(SOLUTION["VocabParallelEmbedding"]):
    """5.5: tokens outside this rank's rows are clamped but not zeroed."""

    def forward(self, idx):
        outside = (idx < self.start) | (idx >= self.end)
        local = F.embedding((idx - self.start).masked_fill(outside, 0), self.weight)
        return SOLUTION["g"](local, self.group)


def cross_entropy_gathered(local_logits, targets, group=None):
    """5.5: gathers the full logits and calls F.cross_entropy."""
    full = SOLUTION["gather_from_tp"](local_logits, group)
    return F.cross_entropy(full.reshape(-1, full.shape[-1]).float(), targets.reshape(-1))


def cross_entropy_no_max(local_logits, targets, group=None):
    """5.5: no max subtracted: exp() overflows on large logits."""
    start = dist.get_rank(group) * local_logits.shape[-1]
    logits = local_logits.float()
    sum_exp = SOLUTION["g"](logits.exp().sum(-1), group)
    mine = (targets >= start) & (targets < start + logits.shape[-1])
    picked = logits.gather(-1, (targets - start).masked_fill(~mine, 0).unsqueeze(-1)).squeeze(-1) * mine
    return (sum_exp.log() - SOLUTION["g"](picked, group)).mean()


def cross_entropy_edge_included(local_logits, targets, group=None):
    """5.5: the shard's end taken in (<= start + per): the next shard's first id counted on two ranks."""
    per = local_logits.shape[-1]
    start = dist.get_rank(group) * per
    logits = local_logits.float()
    top = logits.detach().amax(dim=-1)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - top.unsqueeze(-1)
    sum_exp = SOLUTION["g"](shifted.exp().sum(dim=-1), group)
    mine = (targets >= start) & (targets <= start + per)
    index = (targets - start).masked_fill(~mine, 0).clamp(max=per - 1)
    picked = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1) * mine
    return (sum_exp.log() - SOLUTION["g"](picked, group)).mean()


def cross_entropy_sum(local_logits, targets, group=None):
    """5.5: the sum over tokens instead of the mean."""
    return SOLUTION["vocab_parallel_cross_entropy"](local_logits, targets, group) * targets.numel()


class GatherIdentityBackward(torch.autograd.Function):
    """5.6: all-gather forward, but backward hands back the full-sequence gradient."""

    @staticmethod
    def forward(ctx, x, group=None):
        return all_gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherSliceBackward(torch.autograd.Function):
    """5.6: backward keeps this rank's part of the gradient without summing the group's."""

    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        return all_gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        t, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(t, dim=1)[r].contiguous(), None


class ScatterIdentityBackward(torch.autograd.Function):
    """5.6: reduce-scatter forward, backward returns the shard's gradient as it is."""

    @staticmethod
    def forward(ctx, x, group=None):
        return reduce_scatter_along_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def gather_on_hidden(x, group=None):
    """5.6: gathers along the hidden dimension (the last) instead of the sequence."""
    return SOLUTION["gather_from_tp"](x, group)


WRONG = [
    # (exercise, name in the notebook, wrong answer, what the failure must say)
    ("5.1", "f", apply_of(FNoAllReduce), r"this rank's own gradient.*f's backward must all-reduce"),
    ("5.1", "f", apply_of(FWorld), r"sum over all 4 ranks, not over its TP group of 2: pass group=group"),
    ("5.1", "f", apply_of(FInPlace), r"shared with another branch.*all-reduce a copy"),
    ("5.1", "g", apply_of(GAveraged), r"g\(x\) in forward.*the average over the group, not the sum"),
    ("5.1", "g", apply_of(GInPlace), r"g\(x\) changed x itself: all-reduce a copy \(x.clone\(\)\)"),
    ("5.1", "g", apply_of(GReducesBackward), r"x.grad after g.*g's backward is the identity"),
    ("5.1", "f", SOLUTION["g"], r"f\(x\) in forward.*identity in forward"),
    ("5.2", "ColumnParallelLinear", ColumnGlobalRank,
     r"rank 2 raised IndexError.*global rank 2 is rank 0 of its TP group.*dist.get_rank\(group\)"),
    ("5.2", "ColumnParallelLinear", ColumnNoF, r"input gradient.*enters through f"),
    ("5.2", "ColumnParallelLinear", ColumnIgnoresRows,
     r"ColumnParallelLinear\(rows=...\)'s output.*keep exactly the rows listed in rows"),
    ("5.2", "RowParallelLinear", RowBiasEveryRank, r"counted 2 times: add it once, after the reduction"),
    ("5.2", "RowParallelLinear", RowNoReduce, r"RowParallelLinear's output.*no all-reduce in forward.*with g"),
    ("5.2", "RowParallelLinear", RowSliceShared, r"RowParallelLinear.weight shares memory with the dense layer"),
    ("5.3", "TensorParallelMLP", MLPNoGelu, r"TensorParallelMLP's output differs.*GELU between"),
    ("5.3", "TensorParallelMLP", MLPBothColumn, r"fc is column-parallel.*|proj is row-parallel"),
    ("5.3", "TensorParallelMLP", MLPGeluAfterReduce, r"TensorParallelMLP's output differs.*GELU between"),
    ("5.4", "qkv_rows", qkv_rows_contiguous, r"contiguous block of the packed rows, which mixes q, k and v"),
    ("5.4", "qkv_rows", qkv_rows_q_only, r"only the rows of q: take.*k.*and v"),
    ("5.4", "qkv_rows", qkv_rows_head_count, r"heads, not rows: a rank's heads span d_model/tp rows"),
    ("5.5", "VocabParallelEmbedding", EmbeddingNoMask, r"zero the tokens outside them"),
    ("5.5", "vocab_parallel_cross_entropy", cross_entropy_gathered, r"full logits .* must never be gathered"),
    ("5.5", "vocab_parallel_cross_entropy", cross_entropy_no_max, r"subtract the max over the whole vocabulary"),
    ("5.5", "vocab_parallel_cross_entropy", cross_entropy_edge_included, r"the loss \(logits x1\) differs"),
    ("5.5", "vocab_parallel_cross_entropy", cross_entropy_sum, r"the sum over the \d+ tokens: return the mean"),
    ("5.6", "gather_sequence", apply_of(GatherIdentityBackward),
     r"backward returned the full-sequence gradient .*the backward of an all-gather is a reduce-scatter"),
    ("5.6", "gather_sequence", apply_of(GatherSliceBackward), r"the gradient of an all-gather is a reduce-scatter"),
    ("5.6", "reduce_scatter_sequence", apply_of(ScatterIdentityBackward),
     r"backward returned the shard's gradient .*the backward of a reduce-scatter is an all-gather"),
    ("5.6", "gather_sequence", gather_on_hidden, r"along the sequence \(dimension 1"),
]


@pytest.mark.parametrize("exercise, name, wrong, message", WRONG,
                         ids=[f"{e}-{getattr(w, '__name__', n)}-{i}" for i, (e, n, w, _) in enumerate(WRONG)])
def test_wrong_answer_fails_naming_the_mistake(exercise, name, wrong, message):
    namespace = {**SOLUTION, name: wrong}
    result = distlab.check(exercise, *answer(exercise, namespace), quiet=True)
    assert result.status == "failed", result
    assert re.search(message, result.detail), result.detail


def test_right_answers_pass():
    for exercise in ANSWERS:
        result = distlab.check(exercise, *answer(exercise, SOLUTION), quiet=True)
        assert result.status == "passed", result


class ColumnStub(torch.nn.Module):
    """5.2 untouched: the stub a generated lab carries."""

    def __init__(self, dense, group=None, rows=None, gather_output=False):
        super().__init__()
        raise NotImplementedError("Exercise 5.2: replace this line with your solution")


@pytest.mark.parametrize("exercise, name, wrong", [("5.2", "f", apply_of(FNoAllReduce)),
                                                    ("5.3", "ColumnParallelLinear", ColumnNoF),
                                                    ("5.3", "ColumnParallelLinear", ColumnStub),
                                                    ("5.4", "RowParallelLinear", RowBiasEveryRank),
                                                    ("5.5", "g", apply_of(GAveraged))])
def test_a_wrong_earlier_exercise_does_not_fail_the_next(exercise, name, wrong):
    """The notebook's right answer to ``exercise``, calling a wrong earlier piece by its notebook name, passes.

    The notebook's code looks its names up in ``SOLUTION`` (its globals), as in a kernel where the student's
    wrong earlier answer is defined: put the wrong piece there for the one check.
    """
    right = SOLUTION[name]
    SOLUTION[name] = wrong
    try:
        result = distlab.check(exercise, *answer(exercise, SOLUTION), quiet=True)
    finally:
        SOLUTION[name] = right
    assert result.status == "passed", result
