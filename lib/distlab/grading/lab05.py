"""Lab 05 — tensor and sequence parallelism. Checkers run the student's code on 4 real gloo ranks.

Every case is either one TP group of 4 ranks or two TP groups of 2 (ranks 0-1 and 2-3), so a
collective without ``group=`` or a slice taken with the global rank shows up. Inputs, weights
and upstream gradients are drawn from a fixed-seed generator; the parent process builds the
same dense layer and compares every rank's output, input gradient and parameter gradients
with the matching slices of the dense ones (fp32, to what rounding allows:
:func:`~distlab.grading.harness.tolerance`), and the collectives each phase issued (from distlab's
comm log) with what Megatron-LM's layer issues. Failure messages name the case, the rank, the tensor
and, where a mistake has a signature, its usual cause — also when it
surfaces as a rank's error (autograd's "invalid gradient", an index past the weight on rank 2).
An exercise built on earlier ones (5.2 on f and g, 5.3–5.5 on the linears) runs on distlab's versions
of those pieces (:func:`~distlab.grading.harness.with_reference`), so a mistake fails only its own check.
An untouched stub's ``NotImplementedError`` propagates and is reported as "not attempted" — found by
calling the student's code once in this process first (:func:`_stub_probe`), so an unfinished lab
starts no ranks for it.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from distlab.collectives import ring_all_reduce_time
from distlab.grading import quiz
from distlab.grading.contract import CheckFailed, first_line
from distlab.grading.harness import Edge, assert_close, case_drawn, is_close, lab_seed, run_on_ranks, with_reference
from distlab.grading.registry import Exercise
from distlab.memory import MiB
from distlab.model import Block, GPTConfig
from distlab.runtime.errors import RankFailed
from distlab.tensor_parallel.communication import (
    CopyToTensorParallel,
    ReduceFromTensorParallel,
    comm_since,
    comm_snapshot,
    copy_to_tp,
    reduce_from_tp,
    tp_group,
    tp_rank,
)
from distlab.tensor_parallel.gpt import shard_of
from distlab.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, qkv_rows, shard_range
from distlab.tensor_parallel.theory import activation_bytes_per_layer_tp, activation_message_bytes

__all__ = ["EXERCISES", "Case", "check_conjugate_functions", "check_parallel_linears", "check_parallel_mlp",
           "check_parallel_attention", "check_vocab_parallel", "check_sequence_parallel"]



def _seed() -> int:
    """This lab's seed for its hidden cases, read as each check runs (:func:`~distlab.grading.harness.lab_seed`)."""
    return lab_seed(5)


WORLD = 4
COLLECTIVE_TIMEOUT = 5.0  # seconds: the hidden cases are tiny, so a deadlock can fail fast


@dataclass
class Case:
    tp: int
    seed: int
    batch: int = 2
    seq_len: int = 8
    d_in: int = 16
    d_out: int = 24
    bias: bool = True

    def __str__(self) -> str:
        groups = "one TP group of 4 ranks" if self.tp == WORLD else "two TP groups of 2 ranks (0-1, 2-3)"
        return f"tp={self.tp}, {groups}"

    def group_of(self, rank: int) -> list[int]:
        start = rank // self.tp * self.tp
        return list(range(start, start + self.tp))


def _cases(rng: random.Random, **dims) -> list[Case]:
    """Two cases: tp=2 (two groups, with biases) and tp=4 (no bias), with random sizes divisible by 4."""
    out = []
    for tp in (2, 4):
        case = Case(tp=tp, seed=rng.randrange(10**6), batch=rng.randint(1, 3), seq_len=4 * rng.randint(1, 3),
                    d_in=4 * rng.randint(2, 6), d_out=4 * rng.randint(2, 6), bias=tp == 2)  # with a bias and without
        for key, value in dims.items():
            setattr(case, key, value(rng) if callable(value) else value)
        out.append(case)
    return out


def _randn(shape, *seed) -> torch.Tensor:
    generator = torch.Generator().manual_seed(hash(seed) % (2**62))
    return torch.randn(*shape, generator=generator)


def _launch(worker, *args):
    """Run ``worker`` on the 4 ranks; a rank's error that has a usual cause becomes a failure naming it."""
    case = next(arg for arg in args if isinstance(arg, Case))
    try:
        return run_on_ranks(worker, WORLD, *args, what="your code", collective_timeout=COLLECTIVE_TIMEOUT,
                            advice="Every rank of a TP group must make the same collective calls, on the TP group "
                                   "(group=...).")
    except RankFailed as error:
        named = _named_rank_error(error, case)
        if named is None:
            raise
        raise CheckFailed(named) from None


_INVALID_GRADIENT = re.compile(r"Function (\w+?)Backward returned an invalid gradient at index (\d+) - got "
                               r"\[([\d, ]*)\] but expected shape compatible with \[([\d, ]*)\]")


_SHAPE_MISMATCH = re.compile(r"Mismatch in shape: grad_output\[0\] has a shape of torch.Size\(\[([\d, ]*)\]\) and "
                             r"output\[0\] has a shape of torch.Size\(\[([\d, ]*)\]\)")


def _named_rank_error(error: RankFailed, case: Case) -> str | None:
    """What a rank's error usually means in this lab, or None: autograd's "invalid gradient" from a backward
    that returns the wrong shape and its "mismatch in shape" from a forward that does (5.6), an index past the
    weight from slicing with the global rank (5.2-5.5)."""
    text = str(error)
    invalid = _INVALID_GRADIENT.search(text)
    if invalid:
        name, got, expected = invalid.group(1), invalid.group(3), invalid.group(4)
        got_shape, expected_shape = ([int(v) for v in shape.split(",") if v.strip()] for shape in (got, expected))
        head = f"{case}: {name}'s backward returned a gradient of shape [{got}] for its input of shape [{expected}]"
        if len(got_shape) == len(expected_shape) == 3 and got_shape[1] == case.tp * expected_shape[1]:
            return (f"{name}'s backward returned the full-sequence gradient [{got}] for a shard of shape "
                    f"[{expected}] ({case}): the backward of an all-gather is a reduce-scatter — sum the group's "
                    f"gradients and keep this rank's part (reduce_scatter_along_sequence)")
        if len(got_shape) == len(expected_shape) == 3 and expected_shape[1] == case.tp * got_shape[1]:
            return (f"{name}'s backward returned the shard's gradient [{got}] for a full-sequence input of shape "
                    f"[{expected}] ({case}): the backward of a reduce-scatter is an all-gather of the shards' "
                    f"gradients (all_gather_sequence)")
        return f"{head}: backward returns one gradient per input of forward, shaped like that input (None for group)"
    mismatch = _SHAPE_MISMATCH.search(text)
    if mismatch:
        expected, got = ([int(v) for v in shape.split(",") if v.strip()] for shape in mismatch.groups())
        hint = ("the right number of values along the wrong dimension: concatenate along the sequence (dimension 1 "
                "of [batch, seq, hidden]), not the hidden size" if len(got) == len(expected) == 3 and got[2] !=
                expected[2] and got[1] * got[2] == expected[1] * expected[2] else "look at which dimension you split "
                "or concatenate")
        return f"{case}: an output of your code has shape {got} where the reference's has {expected}: {hint}"
    if error.exc_type == "IndexError" and case.tp < WORLD and error.rank >= case.tp:
        return (f"{case}: rank {error.rank} raised IndexError ({first_line(error).split(': ', 1)[-1]}) while ranks "
                f"0-{case.tp - 1} did not: global rank {error.rank} is rank {error.rank % case.tp} of its TP group, "
                f"so take this rank's slice with dist.get_rank(group), not the global dist.get_rank()")
    return None


# ---------------------------------------------------------------- each exercise graded on its own

class _ReferenceColumn(ColumnParallelLinear):
    """distlab's column-parallel layer with the notebook's signature (``rows`` and ``gather_output`` positional)."""

    def __init__(self, dense, group=None, rows=None, gather_output=False, **options):
        super().__init__(dense, group, rows=rows, gather_output=gather_output, **options)


class _ReferenceRow(RowParallelLinear):
    """distlab's row-parallel layer with the notebook's signature."""

    def __init__(self, dense, group=None, **options):
        super().__init__(dense, group, **options)


# The notebook's names for exercise 5.1's pieces (f, g and their autograd functions) and 5.2's layers, bound to
# distlab's versions when a later exercise is graded, so that a mistake in 5.1 or 5.2 fails only its own check.
_REFERENCE_5_1 = dict(f=copy_to_tp, g=reduce_from_tp, CopyToTP=CopyToTensorParallel,
                      ReduceFromTP=ReduceFromTensorParallel)
_REFERENCE_5_2 = dict(_REFERENCE_5_1, ColumnParallelLinear=_ReferenceColumn, RowParallelLinear=_ReferenceRow)


def _stub_probe(*calls) -> None:
    """Call the student's code once in this process, where there is no process group.

    An untouched stub raises ``NotImplementedError`` at once: it propagates ("not attempted")
    without starting ranks. Any other error — a collective needs the group this process does
    not have — is left to the real check on ranks.
    """
    for call in calls:
        try:
            call()
        except NotImplementedError:
            raise
        except Exception:
            pass


# ---------------------------------------------------------------- comparing

def _expect(case, rank: int, what: str, got, expected, hint: str = "", terms: int | None = None) -> None:
    """``what`` on ``rank`` equals the dense layer's slice (:func:`assert_close`), named like the checks beside it;
    a wrong shape gets the hint too (a slice of the wrong dimension is the usual cause). ``terms``: the widest sum
    behind the value (the case's widest layer by default), which the rounding allowed grows with."""
    if hint and isinstance(got, torch.Tensor) and tuple(got.shape) != tuple(expected.shape):
        raise CheckFailed(f"{case}, rank {rank}: {what} has shape {tuple(got.shape)}, expected "
                          f"{tuple(expected.shape)}: {hint}")
    assert_close(f"{case}, rank {rank}", what, got, expected, hint=hint,
                 terms=terms or 4 * max(case.d_in, case.d_out, case.batch * case.seq_len))


def _describe(counts: dict) -> str:
    if not counts:
        return "no collective"
    return ", ".join(f"{calls} {kind}{'s' if calls > 1 else ''} ({payload:,} bytes)"
                     for kind, (calls, payload) in sorted(counts.items()))


def _expect_collectives(case, rank: int, what: str, got: dict, expected: dict, hint: str = "") -> None:
    if got != expected:
        raise CheckFailed(f"{case}, rank {rank}: {what} issued {_describe(got)}; Megatron's issues "
                          f"{_describe(expected)}" + (f": {hint}" if hint else ""))


def _grads_of(module: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: None if p.grad is None else p.grad.detach().clone() for name, p in module.named_parameters()}


def _expect_parameters(case, rank: int, what: str, got: dict, expected_names) -> None:
    missing = sorted(set(expected_names) - set(got))
    if missing:
        raise CheckFailed(f"{case}, rank {rank}: {what} has parameters {sorted(got)}; expected "
                          f"{sorted(expected_names)} "
                          f"(named like the dense module's, each an nn.Parameter)")
    for name in expected_names:
        if got[name] is None:
            raise CheckFailed(f"{case}, rank {rank}: {what}.{name} got no gradient: keep it an nn.Parameter that "
                              f"the forward pass uses")


# ---------------------------------------------------------------- 5.1 f and g

def _worker_conjugate(f, g, case: Case) -> dict:
    group, rank = tp_group(case.tp), dist.get_rank()
    shape = (case.batch, case.seq_len, case.d_in)
    x, w, z, v = (_randn(shape, case.seed, 1), _randn(shape, case.seed, 2, rank), _randn(shape, case.seed, 3, rank),
                  _randn(shape, case.seed, 4, rank // case.tp))
    out = {}
    xf = x.clone().requires_grad_(True)
    before = comm_snapshot()
    y = f(xf, group)
    out["f forward"] = comm_since(before)
    out["f output"] = y.detach().clone()
    before = comm_snapshot()
    (y * w).sum().backward()
    out["f backward"] = comm_since(before)
    out["f grad"] = xf.grad.clone()
    xs = x.clone().requires_grad_(True)
    h = xs * 1.0
    (f(h, group) + h).mul(w).sum().backward()  # the add hands one gradient tensor to both branches
    out["f shared grad"] = xs.grad.clone()
    zg = z.clone().requires_grad_(True)
    before = comm_snapshot()
    y = g(zg, group)
    out["g forward"] = comm_since(before)
    out["g output"] = y.detach().clone()
    out["g input after"] = zg.detach().clone()  # the caller's x, which g must leave as it was
    before = comm_snapshot()
    (y * v).sum().backward()
    out["g backward"] = comm_since(before)
    out["g grad"] = zg.grad.clone()
    return out


def check_conjugate_functions(f, g) -> str:
    """5.1: ``f(x, group)`` identity forward / all-reduce backward; ``g(x, group)`` the reverse."""
    _stub_probe(lambda: f(torch.zeros(2, requires_grad=True), None).sum().backward(),
                lambda: g(torch.zeros(2, requires_grad=True), None).sum().backward())
    rng = random.Random(_seed() + 1)
    cases = _cases(rng)
    for case in cases:
        case_drawn("5.1", tp=case.tp, bias=case.bias, d_in=case.d_in, d_out=case.d_out)
        run = _launch(_worker_conjugate, f, g, case)
        shape = (case.batch, case.seq_len, case.d_in)
        nbytes = 4 * case.batch * case.seq_len * case.d_in
        x = _randn(shape, case.seed, 1)
        for rank, out in enumerate(run):
            members = case.group_of(rank)
            w_sum = sum(_randn(shape, case.seed, 2, r) for r in members)
            w_world = sum(_randn(shape, case.seed, 2, r) for r in range(WORLD))
            own_w = _randn(shape, case.seed, 2, rank)
            _expect(case, rank, "f(x) in forward", out["f output"], x,
                    "f is the identity in forward (return x.view_as(x)); its all-reduce belongs to backward")
            got = out["f grad"]
            if case.tp < WORLD and is_close(got, w_world):
                raise CheckFailed(f"{case}, rank {rank}: x.grad is the sum over all {WORLD} ranks, not over its TP "
                                  f"group of {case.tp}: pass group=group to the collective")
            if case.tp > 1 and is_close(got, own_w):
                raise CheckFailed(f"{case}, rank {rank}: x.grad after f is this rank's own gradient, not the sum over "
                                  f"its TP group: f's backward must all-reduce the incoming gradient")
            _expect(case, rank, "x.grad after f", got, w_sum, "f's backward returns the gradient summed over the group")
            _expect(case, rank, "x.grad when f's output gradient is shared with another branch (y = f(h) + h)",
                    out["f shared grad"], w_sum + own_w,
                    "f's backward reduced the incoming gradient in place, which autograd may share with another "
                    "branch: all-reduce a copy (grad.clone())")
            _expect_collectives(case, rank, "f in forward", out["f forward"], {})
            _expect_collectives(case, rank, "f in backward", out["f backward"], {"all_reduce": (1, nbytes)})
            z_sum = sum(_randn(shape, case.seed, 3, r) for r in members)
            averaged = is_close(out["g output"], z_sum / case.tp)
            _expect(case, rank, "g(x) in forward", out["g output"], z_sum,
                    f"the average over the group, not the sum: each of the {case.tp} ranks holds a partial sum of "
                    f"the output, so g adds them (no division)" if averaged else
                    "g returns the sum of x over the TP group (all-reduce a copy on the group)")
            if not torch.equal(out["g input after"], _randn(shape, case.seed, 3, rank)):
                raise CheckFailed(f"{case}, rank {rank}: g(x) changed x itself: all-reduce a copy (x.clone()) and "
                                  f"return it, since the caller may still use x")
            _expect(case, rank, "x.grad after g", out["g grad"], _randn(shape, case.seed, 4, rank // case.tp),
                    "g's backward is the identity: the output's gradient is already the same on every rank")
            _expect_collectives(case, rank, "g in forward", out["g forward"], {"all_reduce": (1, nbytes)})
            _expect_collectives(case, rank, "g in backward", out["g backward"], {},
                                "g's backward is the identity")
    return "tp=2 (two groups) and tp=4: f and g exact forward and backward, one all-reduce each, on the TP group"


# ---------------------------------------------------------------- 5.2 column- and row-parallel linears

def _dense_linear(case: Case) -> nn.Linear:
    dense = nn.Linear(case.d_in, case.d_out, bias=case.bias)
    with torch.no_grad():
        dense.weight.copy_(_randn(dense.weight.shape, case.seed, 10))
        if case.bias:
            dense.bias.copy_(_randn(dense.bias.shape, case.seed, 11))
    return dense


def _column_rows(case: Case, custom: bool) -> list[torch.Tensor]:
    """Each TP rank's rows: contiguous blocks, or (custom) blocks of a fixed random permutation."""
    order = torch.randperm(case.d_out, generator=torch.Generator().manual_seed(case.seed)) if custom \
        else torch.arange(case.d_out)
    return list(order.chunk(case.tp))


def _shared_with(layer, dense) -> list[str]:
    """The layer's parameters that share memory with the dense layer's: a step on one would change the other."""
    storages = {p.untyped_storage().data_ptr() for p in dense.parameters()}
    return [name for name, p in layer.named_parameters() if p.untyped_storage().data_ptr() in storages]


def _run_layer(layer, x, upstream, dense=None) -> dict:
    shared = _shared_with(layer, dense) if dense is not None else []
    x = x.clone().requires_grad_(True)
    before = comm_snapshot()
    y = layer(x)
    forward = comm_since(before)
    before = comm_snapshot()
    y.backward(upstream)
    return {"output": y.detach().clone(), "input grad": x.grad.clone(), "grads": _grads_of(layer),
            "forward": forward, "backward": comm_since(before), "shared": shared}


def _worker_linears(column_cls, row_cls, case: Case) -> dict:
    group = tp_group(case.tp)
    r = tp_rank(group)
    dense = _dense_linear(case)
    x = _randn((case.batch, case.seq_len, case.d_in), case.seed, 12)
    g_out = _randn((case.batch, case.seq_len, case.d_out), case.seed, 13)
    rows = _column_rows(case, custom=True)[r]
    out = {"column": _run_layer(column_cls(dense, group), x, g_out[..., shard_range(case.d_out, case.tp, r)], dense),
           "column rows": _run_layer(column_cls(dense, group, rows=rows), x, g_out[..., rows], dense),
           "column gather": _run_layer(column_cls(dense, group, gather_output=True), x, g_out, dense)}
    g_row = _randn((case.batch, case.seq_len, case.d_out), case.seed, 14)
    out["row"] = _run_layer(row_cls(dense, group), x[..., shard_range(case.d_in, case.tp, r)], g_row, dense)
    return out


def _dense_pass(layer, x, upstream):
    x = x.clone().requires_grad_(True)
    y = layer(x)
    y.backward(upstream)
    return y.detach(), x.grad, {name: p.grad for name, p in layer.named_parameters()}


def check_parallel_linears(column_cls, row_cls) -> str:
    """5.2: ``ColumnParallelLinear(dense, group, rows=None, gather_output=False)`` and
    ``RowParallelLinear(dense, group)``."""
    column_cls, row_cls = (with_reference(cls, **_REFERENCE_5_1) for cls in (column_cls, row_cls))  # before the
    # probe, so that an untouched 5.1 does not make a finished 5.2 "not attempted"
    _stub_probe(lambda: column_cls(nn.Linear(4, 4), None)(torch.zeros(1, 4)),
                lambda: row_cls(nn.Linear(4, 4), None)(torch.zeros(1, 4)))
    rng = random.Random(_seed() + 2)
    cases = _cases(rng)
    for case in cases:
        case_drawn("5.2", tp=case.tp, bias=case.bias, d_in=case.d_in, d_out=case.d_out)
        run = _launch(_worker_linears, column_cls, row_cls, case)
        dense = _dense_linear(case)
        x = _randn((case.batch, case.seq_len, case.d_in), case.seed, 12)
        y, x_grad, grads = _dense_pass(dense, x, _randn((case.batch, case.seq_len, case.d_out), case.seed, 13))
        dense_row = _dense_linear(case)
        y_row, x_grad_row, grads_row = _dense_pass(dense_row, x, _randn((case.batch, case.seq_len, case.d_out),
                                                                        case.seed, 14))
        m_in, m_out = 4 * x.numel(), 4 * y.numel()
        names = ["weight", "bias"] if case.bias else ["weight"]
        for rank, out in enumerate(run):
            r = rank % case.tp
            block = shard_range(case.d_out, case.tp, r)
            for key, what in (("column", "ColumnParallelLinear"), ("column rows", "ColumnParallelLinear(rows=...)"),
                              ("column gather", "ColumnParallelLinear(gather_output=True)"),
                              ("row", "RowParallelLinear")):
                if out[key]["shared"]:
                    raise CheckFailed(f"{case}, rank {rank}: {what}.{out[key]['shared'][0]} shares memory with the "
                                      f"dense layer's: copy your slice (.clone()), or a step on one changes the other")
            for key, rows in (("column", torch.arange(case.d_out)[block]),
                              ("column rows", _column_rows(case, custom=True)[r])):
                res, what = out[key], "ColumnParallelLinear" + ("(rows=...)" if key == "column rows" else "")
                _expect_parameters(case, rank, what, res["grads"], names)
                _expect(case, rank, f"{what}.weight's gradient", res["grads"]["weight"], grads["weight"][rows],
                        "a column-parallel layer keeps rows (output features) of dense.weight" +
                        (", those listed in rows" if key == "column rows" else ""))
                if case.bias:
                    _expect(case, rank, f"{what}.bias's gradient", res["grads"]["bias"], grads["bias"][rows])
                _expect(case, rank, f"{what}'s output", res["output"], y[..., rows],
                        "keep exactly the rows listed in rows, in their order" if key == "column rows" else
                        "its gradients match, so check the values it keeps: the same rows of dense.weight and of "
                        "dense.bias")
                _expect(case, rank, f"{what}'s input gradient", res["input grad"], x_grad,
                        "the input enters through f: its gradient is summed over the TP group")
                _expect_collectives(case, rank, f"{what} in forward", res["forward"], {})
                _expect_collectives(case, rank, f"{what} in backward", res["backward"], {"all_reduce": (1, m_in)})
            res = out["column gather"]
            _expect(case, rank, "ColumnParallelLinear(gather_output=True)'s output", res["output"], y,
                    "all-gather the ranks' output slices in rank order along the last dimension")
            _expect(case, rank, "ColumnParallelLinear(gather_output=True)'s input gradient", res["input grad"], x_grad,
                    "the gathered output's gradient must be split back to this rank's slice before the matmul")
            _expect_collectives(case, rank, "ColumnParallelLinear(gather_output=True) in forward", res["forward"],
                                {"all_gather": (1, m_out)})
            res, cols = out["row"], shard_range(case.d_in, case.tp, r)
            _expect_parameters(case, rank, "RowParallelLinear", res["grads"], names)
            _expect(case, rank, "RowParallelLinear.weight's gradient", res["grads"]["weight"],
                    grads_row["weight"][:, cols], "a row-parallel layer keeps columns (input features) of dense.weight")
            hint = ("rank r multiplies its columns of x by its columns of dense.weight (x[..., cols] @ "
                    "weight[:, cols].T), g sums the partial products over the TP group, then the bias is added once")
            if "all_reduce" not in res["forward"]:
                hint = ("no all-reduce in forward, so each rank returned its partial product: sum it over the TP "
                        "group with g, then add the bias")
            elif case.bias and is_close(res["output"], y_row + (case.tp - 1) * dense_row.bias.detach()):
                hint = (f"the bias was added on each of the {case.tp} ranks before the all-reduce, so it is counted "
                        f"{case.tp} times: add it once, after the reduction")
            _expect(case, rank, "RowParallelLinear's output", res["output"], y_row, hint)
            if case.bias:
                _expect(case, rank, "RowParallelLinear.bias's gradient", res["grads"]["bias"], grads_row["bias"])
            _expect(case, rank, "RowParallelLinear's input gradient", res["input grad"], x_grad_row[..., cols])
            _expect_collectives(case, rank, "RowParallelLinear in forward", res["forward"], {"all_reduce": (1, m_out)})
            _expect_collectives(case, rank, "RowParallelLinear in backward", res["backward"], {})
    return ("tp=2 (two groups) and tp=4: column (contiguous, custom rows, gathered) and row layers equal the dense "
            "Linear in output and every gradient (run on distlab's f and g, so 5.1 does not count here)")


# ---------------------------------------------------------------- 5.3 / 5.4 the MLP and attention

def _dense_block(cfg: GPTConfig, seed: int) -> Block:
    """A transformer block with seeded weights, built directly on the CPU (fast in a fresh rank)."""
    block = Block(cfg)
    with torch.no_grad():
        for i, (name, p) in enumerate(block.named_parameters()):
            values = _randn(p.shape, seed, 100 + i)
            if p.dim() == 2:
                p.copy_(values / p.shape[1] ** 0.5)
            else:
                p.copy_(values * 0.1 + (1.0 if name.startswith("ln") and name.endswith("weight") else 0.0))
    return block


def _module_cfg(case: Case, n_head: int) -> GPTConfig:
    return GPTConfig(vocab_size=32, seq_len=case.seq_len, n_layer=1, n_head=n_head, d_model=case.d_in, bias=case.bias)


def _worker_module(module_cls, kind: str, case: Case, n_head: int) -> dict:
    group = tp_group(case.tp)
    cfg = _module_cfg(case, n_head)
    dense = getattr(_dense_block(cfg, case.seed), kind)
    x = _randn((case.batch, case.seq_len, case.d_in), case.seed, 20)
    upstream = _randn((case.batch, case.seq_len, case.d_in), case.seed, 21)
    return _run_layer(module_cls(dense, group), x, upstream)


def _check_module(module_cls, kind: str, rng: random.Random, what: str, heads, hints: dict) -> list[Case]:
    small = _dense_block(GPTConfig(vocab_size=8, seq_len=4, n_layer=1, n_head=2, d_model=8), 0)
    module_cls = with_reference(module_cls, **_REFERENCE_5_2)  # before the probe: an untouched 5.2 is not this one's
    _stub_probe(lambda: module_cls(getattr(small, kind), None)(torch.zeros(1, 4, 8)))
    cases = _cases(rng)
    for case in cases:
        n_head = heads(rng, case)
        case_drawn({"mlp": "5.3", "attn": "5.4"}[kind], tp=case.tp, bias=case.bias, n_head=n_head, d_in=case.d_in)
        run = _launch(_worker_module, module_cls, kind, case, n_head)
        cfg = _module_cfg(case, n_head)
        dense = getattr(_dense_block(cfg, case.seed), kind)
        x = _randn((case.batch, case.seq_len, case.d_in), case.seed, 20)
        y, x_grad, grads = _dense_pass(dense, x, _randn((case.batch, case.seq_len, case.d_in), case.seed, 21))
        m = 4 * x.numel()
        prefix = f"blocks.0.{kind}."
        for rank, out in enumerate(run):
            r = rank % case.tp
            _expect(case, rank, f"{what}'s output", out["output"], y, hints.get("output", ""))
            _expect(case, rank, f"{what}'s input gradient", out["input grad"], x_grad)
            _expect_parameters(case, rank, what, out["grads"], list(grads))
            for name, grad in grads.items():
                expected = shard_of(prefix + name, grad, cfg, case.tp, r)
                _expect(case, rank, f"{what}.{name}'s gradient", out["grads"][name], expected, hints.get(name, ""))
            _expect_collectives(case, rank, f"{what} in forward", out["forward"], {"all_reduce": (1, m)},
                                "one all-reduce (the row-parallel projection's g), nothing else")
            _expect_collectives(case, rank, f"{what} in backward", out["backward"], {"all_reduce": (1, m)},
                                "one all-reduce (the column-parallel input's f), nothing else")
    return cases


def check_parallel_mlp(mlp_cls) -> str:
    """5.3: ``TensorParallelMLP(mlp, group)``: column-parallel fc, GELU, row-parallel proj."""
    rng = random.Random(_seed() + 3)
    _check_module(mlp_cls, "mlp", rng, "TensorParallelMLP", lambda rng, case: 4,
                  {"fc.weight": "fc is column-parallel: keep its rows", "proj.weight": "proj is row-parallel: keep its "
                   "columns, matching fc's rows",
                   "output": "the MLP is proj(GELU(fc(x))): the GELU between the two linears, on each rank's slice of "
                             "fc's output, before proj's all-reduce"})
    return ("tp=2 (two groups) and tp=4: output and every gradient equal the dense MLP; one all-reduce each way "
            "(run on distlab's linears, so 5.2 does not count here)")


def check_parallel_attention(qkv_rows_fn, attention_cls) -> str:
    """5.4: ``qkv_rows(d_model, n_head, tp, rank)`` and ``TensorParallelAttention(attn, group)``."""
    rng = random.Random(_seed() + 4)
    for k in range(6):
        tp = rng.choice([2, 4, 8]) if k else 8  # the first: 8 ranks, one head each
        head_dim, n_head = rng.choice([2, 4, 8]), tp * (rng.randint(1, 3) if k else 1)  # the first: a head per rank
        d_model, rank = n_head * head_dim, rng.randrange(tp)
        case_drawn("5.4", layout=True, tp=tp, n_head=n_head, rank=rank)
        expected = qkv_rows(d_model, n_head, tp, rank)
        got = qkv_rows_fn(d_model, n_head, tp, rank)
        got = torch.as_tensor(got).flatten()
        if got.tolist() != expected.tolist():
            contiguous = torch.arange(3 * d_model)[shard_range(3 * d_model, tp, rank)]
            hint = ""
            by_heads = torch.arange(rank * n_head // tp, (rank + 1) * n_head // tp)
            if got.tolist() == contiguous.tolist():
                hint = (": that is a contiguous block of the packed rows, which mixes q, k and v; take your heads' "
                        "rows from each of q (rows 0…d), k (d…2d) and v (2d…3d)")
            elif got.tolist() == expected[: len(expected) // 3].tolist():
                hint = ": only the rows of q: take this rank's heads' rows of k (+d_model) and v (+2·d_model) too"
            elif got.tolist() == torch.cat([by_heads + part * d_model for part in range(3)]).tolist():
                hint = (": those count heads, not rows: a rank's heads span d_model/tp rows of q "
                        "(n_head/tp heads of head_dim rows each)")
            elif len(got) != len(expected):
                hint = (f": {len(got)} rows, expected {len(expected)}: a rank keeps d_model/tp = {d_model // tp} rows "
                        f"of each of q, k and v (check the range of its heads' rows)")
            else:
                third = len(expected) // 3
                part = next(i for i in range(3) if got[i * third:(i + 1) * third].tolist()
                            != expected[i * third:(i + 1) * third].tolist())
                hint = (f": the rows taken from {'qkv'[part]} are wrong: this rank's heads span rows rank·d/tp … "
                        f"(rank+1)·d/tp - 1 of q, and the same rows + d_model of k and + 2·d_model of v")
            raise CheckFailed(f"qkv_rows(d_model={d_model}, n_head={n_head}, tp={tp}, rank={rank}) returned "
                              f"{got.tolist()[:8]}…, expected {expected.tolist()[:8]}…{hint}")
    _check_module(attention_cls, "attn", rng, "TensorParallelAttention",
                  # tp=2: always two heads a rank (d_in is a multiple of 4); tp=4: one or two where d_in allows
                  lambda rng, case: 2 * case.tp if case.tp == 2 else (
                      case.tp * rng.randint(1, 2) if case.d_in % (2 * case.tp) == 0 else case.tp),
                  {"qkv.weight": "keep the q, k and v rows of this rank's heads (qkv_rows)",
                   "output": "each rank attends with its own n_head/tp heads: split qkv(x) into q, k, v, view each "
                             "as [B, T, heads, head_dim] and transpose to [B, heads, T, head_dim] for causal "
                             "attention, transpose back, then proj (row-parallel: the columns of the same heads)",
                   "proj.weight": "proj is row-parallel: keep the columns of this rank's heads"})
    return ("6 head layouts; tp=2 (two groups) and tp=4: output and every gradient equal the dense attention; "
            "one all-reduce each way (run on distlab's linears, so 5.2 does not count here)")


# ---------------------------------------------------------------- 5.5 vocabulary-parallel embedding and loss

def _vocab_ids(case: Case, vocab: int) -> torch.Tensor:
    """The case's token ids (and targets): random, with the first id of every shard among them, where a
    comparison one off at a shard's edge (<= for <, > for >=) gives a token to two ranks or to none."""
    idx = torch.randint(vocab, (case.batch, case.seq_len), generator=torch.Generator().manual_seed(case.seed))
    firsts = torch.tensor([shard_range(vocab, case.tp, r).start for r in range(case.tp)])[:idx.numel()]
    idx.view(-1)[:len(firsts)] = firsts
    return idx


def _worker_vocab(embedding_cls, loss_fn, case: Case) -> dict:
    group = tp_group(case.tp)
    r = tp_rank(group)
    vocab = case.d_out
    dense = nn.Embedding(vocab, case.d_in)
    with torch.no_grad():
        dense.weight.copy_(_randn(dense.weight.shape, case.seed, 30))
    idx = _vocab_ids(case, vocab)
    layer = embedding_cls(dense, group)
    before = comm_snapshot()
    y = layer(idx)
    forward = comm_since(before)
    y.backward(_randn((case.batch, case.seq_len, case.d_in), case.seed, 31))
    out = {"embedding": {"output": y.detach().clone(), "grads": _grads_of(layer), "forward": forward}}
    for scale in (1.0, 60.0):  # 60: exp() overflows fp32 unless the max is subtracted first
        logits = scale * _randn((case.batch, case.seq_len, vocab), case.seed, 32)
        local = logits[..., shard_range(vocab, case.tp, r)].clone().requires_grad_(True)
        before = comm_snapshot()
        loss = loss_fn(local, idx, group)
        forward = comm_since(before)
        before = comm_snapshot()
        loss.backward()
        out[f"loss x{scale:g}"] = {"loss": loss.detach().clone(), "grad": local.grad.clone(), "forward": forward,
                                   "backward": comm_since(before)}
    return out


# exp() of a float32 overflows to inf above this: log(float32's largest value, 3.4e38).
EXP_OVERFLOWS_FP32_ABOVE = 88.72


def _loss_mistake(got_loss, got_grad, expected: torch.Tensor, tokens: int, logits: torch.Tensor) -> str:
    """The usual cause the rank's loss and gradient show, chosen by what differs, or "": a loss or gradient that
    is not finite where the logits pass exp()'s range (no max subtracted), or the loss summed over the tokens."""
    finite = all(isinstance(t, torch.Tensor) and bool(torch.isfinite(t).all()) for t in (got_loss, got_grad))
    largest = logits.abs().max().item()
    if not finite and largest > EXP_OVERFLOWS_FP32_ABOVE:
        return (f"your loss or gradient is not finite: these logits reach {largest:.0f}, and exp() overflows fp32 "
                f"past {EXP_OVERFLOWS_FP32_ABOVE}: subtract the max over the whole vocabulary (all-reduce with "
                f"op=MAX) before exp")
    if isinstance(got_loss, torch.Tensor) and is_close(got_loss.reshape(()), expected * tokens):
        return f"that is the sum over the {tokens} tokens: return the mean"
    return ""


# Where to look when the loss differs and no usual mistake fits: the pieces of the formula and who holds them.
_LOSS_FORMULA = ("the loss is the mean over tokens of log Σ exp(z − max) − (z_target − max): each rank sums exp over "
                 "its own slice and all-reduces that sum on the group, and the one rank holding the target's logit "
                 "contributes it (zero elsewhere, all-reduced too)")


def check_vocab_parallel(embedding_cls, loss_fn) -> str:
    """5.5: ``VocabParallelEmbedding(embedding, group)``, ``vocab_parallel_cross_entropy(logits, targets, group)``."""
    embedding_cls, loss_fn = (with_reference(code, **_REFERENCE_5_1) for code in (embedding_cls, loss_fn))
    _stub_probe(lambda: embedding_cls(nn.Embedding(8, 4), None)(torch.zeros(1, 2, dtype=torch.long)),
                lambda: loss_fn(torch.zeros(1, 2, 8, requires_grad=True), torch.zeros(1, 2, dtype=torch.long), None))
    rng = random.Random(_seed() + 5)
    cases = _cases(rng, d_out=lambda rng: 4 * rng.randint(4, 12))
    for case in cases:
        run = _launch(_worker_vocab, embedding_cls, loss_fn, case)
        vocab = case.d_out
        dense = nn.Embedding(vocab, case.d_in)
        with torch.no_grad():
            dense.weight.copy_(_randn(dense.weight.shape, case.seed, 30))
        idx = _vocab_ids(case, vocab)
        y = dense(idx)
        y.backward(_randn((case.batch, case.seq_len, case.d_in), case.seed, 31))
        tokens = idx.numel()
        for rank, out in enumerate(run):
            r = rank % case.tp
            rows = shard_range(vocab, case.tp, r)
            emb = out["embedding"]
            _expect(case, rank, "VocabParallelEmbedding's output", emb["output"], y.detach(),
                    "look up only your rows (shift the ids by your first row), zero the tokens outside them, and "
                    "sum over the TP group")
            _expect_parameters(case, rank, "VocabParallelEmbedding", emb["grads"], ["weight"])
            _expect(case, rank, "VocabParallelEmbedding.weight's gradient", emb["grads"]["weight"],
                    dense.weight.grad[rows],
                    f"rank {r} of the group keeps vocabulary rows {rows.start}…{rows.stop - 1}")
            _expect_collectives(case, rank, "VocabParallelEmbedding in forward", emb["forward"],
                                {"all_reduce": (1, 4 * y.numel())})
            for scale in (1.0, 60.0):
                logits = (scale * _randn((case.batch, case.seq_len, vocab), case.seed, 32)).requires_grad_(True)
                case_drawn("5.5", tp=case.tp, vocab=vocab, largest=logits.abs().max().item(),
                           shard_firsts=all(bool((idx == shard_range(vocab, case.tp, s).start).any())
                                            for s in range(case.tp)))
                loss = F.cross_entropy(logits.reshape(-1, vocab), idx.reshape(-1))
                loss.backward()
                res = out[f"loss x{scale:g}"]
                hint = _loss_mistake(res["loss"], res["grad"], loss.detach(), tokens, logits.detach())
                _expect(case, rank, f"the loss (logits x{scale:g})", res["loss"].reshape(()), loss.detach(),
                        hint or _LOSS_FORMULA,
                        terms=vocab)
                _expect(case, rank, f"the logits' gradient (logits x{scale:g})", res["grad"], logits.grad[..., rows],
                        hint or "the gradient of each rank's slice is softmax − one_hot on that slice, divided by "
                                "the number of tokens", terms=vocab)
                moved = sum(payload for _, payload in res["forward"].values()) + \
                    sum(payload for _, payload in res["backward"].values())
                if "all_gather" in res["forward"] or moved > 4 * 4 * tokens:
                    raise CheckFailed(
                        f"{case}, rank {rank}: the loss's collectives ({_describe(res['forward'])} forward, "
                        f"{_describe(res['backward'])} backward) move more than a few values per token: the full "
                        f"logits ({4 * tokens * vocab:,} bytes) must never be gathered; all-reduce only the max, "
                        f"the sum of exponentials and the target's logit ({4 * tokens:,} bytes each)")
    return ("tp=2 (two groups) and tp=4: embedding and loss equal the dense ones (logits up to x60), "
            "only per-token values communicated")


# ---------------------------------------------------------------- 5.6 sequence parallelism

def _worker_sequence(gather_fn, scatter_fn, case: Case) -> dict:
    group = tp_group(case.tp)
    rank, r = dist.get_rank(), tp_rank(group)
    b, s, h = case.batch, case.seq_len, case.d_in
    out = {}
    shard = _randn((b, s // case.tp, h), case.seed, 40, rank).requires_grad_(True)
    before = comm_snapshot()
    full = gather_fn(shard, group)
    out["gather forward"] = comm_since(before)
    out["gathered"] = full.detach().clone()
    before = comm_snapshot()
    full.backward(_randn((b, s, h), case.seed, 41, rank))
    out["gather backward"] = comm_since(before)
    out["gather grad"] = shard.grad.clone()
    partial = _randn((b, s, h), case.seed, 42, rank).requires_grad_(True)
    before = comm_snapshot()
    mine = scatter_fn(partial, group)
    out["scatter forward"] = comm_since(before)
    out["scattered"] = mine.detach().clone()
    before = comm_snapshot()
    mine.backward(_randn((b, s // case.tp, h), case.seed, 43, rank))
    out["scatter backward"] = comm_since(before)
    out["scatter grad"] = partial.grad.clone()
    # a sequence-parallel LayerNorm + MLP: LN on the shard, gather, column/row matmuls, reduce-scatter
    cfg = _module_cfg(case, 4)
    block = _dense_block(cfg, case.seed)
    ln = block.ln2
    fc_w, proj_w = (shard_of(f"blocks.0.mlp.{name}.weight", getattr(block.mlp, name).weight.detach(), cfg, case.tp,
                             r).clone().requires_grad_(True) for name in ("fc", "proj"))
    x = _randn((b, s, h), case.seed, 44)[:, shard_range(s, case.tp, r)].clone().requires_grad_(True)
    fc_b = None if block.mlp.fc.bias is None else shard_of("blocks.0.mlp.fc.bias", block.mlp.fc.bias.detach(), cfg,
                                                            case.tp, r)
    hidden = F.gelu(F.linear(gather_fn(ln(x), group), fc_w, fc_b))
    y = x + scatter_fn(F.linear(hidden, proj_w), group)
    if block.mlp.proj.bias is not None:
        y = y + block.mlp.proj.bias.detach()  # after the reduce-scatter: once per token
    y.backward(_randn((b, s, h), case.seed, 45)[:, shard_range(s, case.tp, r)])
    out["mlp"] = {"output": y.detach().clone(), "input grad": x.grad.clone(), "fc": fc_w.grad.clone(),
                  "proj": proj_w.grad.clone(), "ln": ln.weight.grad.clone()}
    return out


def check_sequence_parallel(gather_fn, scatter_fn) -> str:
    """5.6: ``gather_sequence(x, group)`` (all-gather / reduce-scatter) and ``reduce_scatter_sequence(x, group)``."""
    _stub_probe(lambda: gather_fn(torch.zeros(1, 2, 4, requires_grad=True), None).sum().backward(),
                lambda: scatter_fn(torch.zeros(1, 2, 4, requires_grad=True), None).sum().backward())
    rng = random.Random(_seed() + 6)
    cases = _cases(rng)
    for case in cases:
        case_drawn("5.6", tp=case.tp, bias=case.bias, seq_len=case.seq_len)
        run = _launch(_worker_sequence, gather_fn, scatter_fn, case)
        b, s, h, t = case.batch, case.seq_len, case.d_in, case.tp
        m = 4 * b * s * h
        cfg = _module_cfg(case, 4)
        block = _dense_block(cfg, case.seed)
        x = _randn((b, s, h), case.seed, 44).requires_grad_(True)
        y = x + block.mlp(block.ln2(x))
        y.backward(_randn((b, s, h), case.seed, 45))
        for rank, out in enumerate(run):
            members, r = case.group_of(rank), rank % t
            mine = shard_range(s, t, r)
            gathered = torch.cat([_randn((b, s // t, h), case.seed, 40, q) for q in members], dim=1)
            _expect(case, rank, "gather_sequence's output", out["gathered"], gathered,
                    "concatenate the group's shards in rank order along the sequence (dimension 1 of [batch, seq, "
                    "hidden])")
            summed_grads = sum(_randn((b, s, h), case.seed, 41, q) for q in members)
            _expect(case, rank, "the shard's gradient after gather_sequence", out["gather grad"],
                    summed_grads[:, mine], "the gradient of an all-gather is a reduce-scatter: sum the group's "
                    "gradients and keep this rank's part of the sequence")
            _expect_collectives(case, rank, "gather_sequence in forward", out["gather forward"], {"all_gather": (1, m)})
            _expect_collectives(case, rank, "gather_sequence in backward", out["gather backward"],
                                {"reduce_scatter": (1, m)})
            partial_sum = sum(_randn((b, s, h), case.seed, 42, q) for q in members)
            _expect(case, rank, "reduce_scatter_sequence's output", out["scattered"], partial_sum[:, mine],
                    "sum over the TP group, and keep this rank's part of the sequence")
            grads = torch.cat([_randn((b, s // t, h), case.seed, 43, q) for q in members], dim=1)
            _expect(case, rank, "the input's gradient after reduce_scatter_sequence", out["scatter grad"], grads,
                    "the gradient of a reduce-scatter is an all-gather of the shards' gradients")
            _expect_collectives(case, rank, "reduce_scatter_sequence in forward", out["scatter forward"],
                                {"reduce_scatter": (1, m)})
            _expect_collectives(case, rank, "reduce_scatter_sequence in backward", out["scatter backward"],
                                {"all_gather": (1, m)})
            mlp = out["mlp"]
            where = "a sequence-parallel LayerNorm + MLP built on your functions:"
            _expect(case, rank, f"{where} the output shard", mlp["output"], y.detach()[:, mine])
            _expect(case, rank, f"{where} the input shard's gradient", mlp["input grad"], x.grad[:, mine])
            _expect(case, rank, f"{where} fc.weight's gradient", mlp["fc"],
                    shard_of("blocks.0.mlp.fc.weight", block.mlp.fc.weight.grad, cfg, t, r))
            _expect(case, rank, f"{where} proj.weight's gradient", mlp["proj"],
                    shard_of("blocks.0.mlp.proj.weight", block.mlp.proj.weight.grad, cfg, t, r))
        ln_total = sum(out["mlp"]["ln"] for rank, out in enumerate(run) if rank < t)
        _expect(case, 0, "the LayerNorm weight's gradients summed over the group", ln_total, block.ln2.weight.grad,
                "each rank's LayerNorm saw its own tokens only: their partial gradients must add up to the dense one")
    return ("tp=2 (two groups) and tp=4: all-gather/reduce-scatter pairs exact both ways; a sequence-parallel "
            "LayerNorm + MLP equals the dense one")


# The boundaries each exercise's text names (harness.Edge; tests/grading/test_reference_seeds.py checks every seed's
# cases hold each): "two TP groups of 2 ranks side by side" (global rank 3 is rank 1 of its group) and one of 4; a
# bias and none (added once, after the sum); 5.4's head count divisible by t with one head per rank and several;
# 5.5's logits past exp()'s fp32 range (the max over the whole vocabulary matters) and small ones.
_GROUPS = [Edge("two TP groups of 2 ranks", lambda c: c["tp"] == 2), Edge("one TP group of 4", lambda c: c["tp"] == 4)]
_BIAS = [Edge("a bias", lambda c: c["bias"]), Edge("no bias", lambda c: not c["bias"])]
EDGES = {
    "5.1": _GROUPS,
    "5.2": [*_GROUPS, *_BIAS],
    "5.3": [*_GROUPS, *_BIAS],
    "5.4": [*_GROUPS, Edge("one head per rank", lambda c: c.get("layout") and c["n_head"] == c["tp"]),
            Edge("several heads per rank", lambda c: c.get("layout") and c["n_head"] > c["tp"]),
            Edge("8 ranks of heads", lambda c: c.get("layout") and c["tp"] == 8),
            Edge("the attention run with several heads per rank",
                 lambda c: not c.get("layout") and c["n_head"] > c["tp"])],
    "5.5": [*_GROUPS, Edge("logits past exp()'s fp32 range", lambda c: c["largest"] > EXP_OVERFLOWS_FP32_ABOVE),
            Edge("logits well inside it", lambda c: c["largest"] < 20),
            Edge("a token and a target on every shard's first id", lambda c: c["shard_firsts"])],
    "5.6": _GROUPS,
}

# Surviving mutants of the solution cells that change nothing the exercises ask for (distlab notebooks
# mutants): key, as benchmarks/results/mutants.txt names it → why it is equivalent.
EQUIVALENT_MUTANTS = {
    '5.2 call-removed: `dense.weight.detach()[rows].clone()` → `dense.weight.detach()[rows]`':
        'indexing with a tensor of rows already copies them: the parameter shares no memory with the dense layer '
        'either way',
    '5.2 call-removed: `dense.bias.detach()` → `dense.bias`':
        'nn.Parameter makes a new leaf of the copy either way: the clone of a tensor that requires grad is detached '
        'when it becomes a Parameter',
    '5.2 call-removed: `dense.bias.detach()` → `dense.bias` #2':
        'nn.Parameter makes a new leaf of the copy either way: the clone of a tensor that requires grad is detached '
        'when it becomes a Parameter',
    '5.2 call-removed: `dense.weight.detach()` → `dense.weight`':
        'nn.Parameter makes a new leaf of the copy either way: the clone of a tensor that requires grad is detached '
        'when it becomes a Parameter',
    '5.2 call-removed: `dense.weight.detach()` → `dense.weight` #2':
        'nn.Parameter makes a new leaf of the copy either way: the clone of a tensor that requires grad is detached '
        'when it becomes a Parameter',
    '5.2 statements-swapped: `if rows is None: per = dense.out_features // t rows = torch.arange(r …` → `self.group, '
    'self.gather_output = group, gather_output if rows is None…`':
        "two statements that do not read each other's names, in the other order",
    '5.2 statements-swapped: `self.group = group self.weight = nn.Parameter(dense.weight.detach()[:…` → `self.weight '
    '= nn.Parameter(dense.weight.detach()[:, r * per:(r + 1) *…`':
        "two statements that do not read each other's names, in the other order",
    '5.2 statements-swapped: `self.group, self.gather_output = group, gather_output self.weight = n…` → `self.weight '
    '= nn.Parameter(dense.weight.detach()[rows].clone()) self.…`':
        "two statements that do not read each other's names, in the other order",
    '5.2 statements-swapped: `self.weight = nn.Parameter(dense.weight.detach()[:, r * per:(r + 1) *…` → `self.bias = '
    'None if dense.bias is None else nn.Parameter(dense.bias.d…`':
        'two parameters (or submodules) assigned in the other order: they are registered in the other order, which '
        'no output or gradient depends on',
    '5.2 statements-swapped: `self.weight = nn.Parameter(dense.weight.detach()[rows].clone()) self.…` → `self.bias = '
    'None if dense.bias is None else nn.Parameter(dense.bias.d…`':
        'two parameters (or submodules) assigned in the other order: they are registered in the other order, which '
        'no output or gradient depends on',
    '5.3 statements-swapped: `self.fc = ColumnParallelLinear(mlp.fc, group) self.proj = RowParallel…` → `self.proj = '
    'RowParallelLinear(mlp.proj, group) self.fc = ColumnParall…`':
        'two parameters (or submodules) assigned in the other order: they are registered in the other order, which '
        'no output or gradient depends on',
    '5.4 arguments-swapped: `y.transpose(1, 2)` → `y.transpose(2, 1)`':
        'transpose(1, 2) and transpose(2, 1) are the same operation',
    '5.4 arithmetic: `d_model // self.head_dim` → `d_model / self.head_dim`':
        'qkv_rows does not read n_head (a rank\'s rows follow from d_model and tp alone): a float there changes '
        'nothing',
    '5.4 statements-swapped: `B, T, _ = x.shape q, k, v = self.qkv(x).chunk(3, dim=-1)` → `q, k, v = '
    'self.qkv(x).chunk(3, dim=-1) B, T, _ = x.shape`':
        "two statements that do not read each other's names, in the other order",
    '5.4 statements-swapped: `self.qkv = ColumnParallelLinear(attn.qkv, group, rows=qkv_rows(d_mode…` → `self.proj = '
    'RowParallelLinear(attn.proj, group) self.qkv = ColumnPara…`':
        'two parameters (or submodules) assigned in the other order: they are registered in the other order, which '
        'no output or gradient depends on',
    '5.5 group-dropped: `dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)` → `dist.all_reduce(top, '
    'op=dist.ReduceOp.MAX)`':
        "the max only keeps exp() in range: the loss is the same for any shift at least the group's max (log-sum-exp "
        'is shift-invariant), and the max over every rank is one',
    '5.5 off-by-one: `0` → `1`':
        "the index given to targets outside this rank's shard only fills a slot that `* mine` zeroes afterwards; 1 "
        'is as valid an index as 0 (every shard holds at least 2 ids)',
    '5.5 statements-swapped: `sum_exp = g(shifted.exp().sum(dim=-1), group) mine = (targets >= star…` → `mine = '
    '(targets >= start) & (targets < start + per) sum_exp = g(shift…`':
        "two statements that do not read each other's names, in the other order",
}

EXERCISES = [
    Exercise("5.1", "f and g: the conjugate all-reduce functions", 2, check_conjugate_functions,
             references=("distlab.tensor_parallel.communication.CopyToTensorParallel",
                         "distlab.tensor_parallel.communication.ReduceFromTensorParallel",
                         "distlab.tensor_parallel.communication.copy_to_tp",
                         "distlab.tensor_parallel.communication.reduce_from_tp")),
    Exercise("5.2", "column- and row-parallel linear layers", 3, check_parallel_linears,
             references=("distlab.tensor_parallel.layers.ColumnParallelLinear",
                         "distlab.tensor_parallel.layers.RowParallelLinear")),
    Exercise("5.3", "the Megatron MLP: one all-reduce each way", 2, check_parallel_mlp,
             references=("distlab.tensor_parallel.layers.TensorParallelMLP",)),
    Exercise("5.4", "attention with the heads split over ranks", 3, check_parallel_attention,
             references=("distlab.tensor_parallel.layers.TensorParallelAttention",
                         "distlab.tensor_parallel.layers.qkv_rows")),
    Exercise("5.5", "vocabulary-parallel embedding and cross-entropy", 3, check_vocab_parallel,
             references=("distlab.tensor_parallel.layers.VocabParallelEmbedding",
                         "distlab.tensor_parallel.layers.vocab_parallel_cross_entropy")),
    Exercise("5.6", "sequence parallelism: all-gather in, reduce-scatter out", 3, check_sequence_parallel,
             references=("distlab.tensor_parallel.communication.GatherSequence",
                         "distlab.tensor_parallel.communication.ReduceScatterSequence",
                         "distlab.tensor_parallel.communication.gather_sequence",
                         "distlab.tensor_parallel.communication.reduce_scatter_sequence")),
    quiz.number("Q5.1", "all-reduces per block per training step (TP, no SP)", answer=4,
                hint="see the lab's section 9, Every collective counted (the chapter's section 5)",
                fixed="a count of the block's collectives: the question has no number to change"),
    quiz.number("Q5.2", "MiB in one TP all-reduce of a 70B layer ({tokens} tokens, hidden 8192, bf16)", rel_tol=0.01,
                given=dict(tokens=4096), vary=dict(tokens=(1024, 2048, 8192, 16384, 32768)),
                solve=lambda tokens: activation_message_bytes(1, tokens, 8192, bytes_per_value=2) / MiB,
                hint="see the lab's section 13, Why TP stays inside an NVLink domain: what one TP all-reduce "
                     "carries (the chapter's section 8)"),
    quiz.choice("Q5.3", "what sequence parallelism puts in place of each TP all-reduce", answer="b", options="abcd",
                hint="look at the collectives counted with and without SP (sections 7 and 9)"),
    quiz.number("Q5.4", "activation bytes per rank at TP={tp} without SP, as a fraction of TP=1", rel_tol=0.02,
                given=dict(tp=8), vary=dict(tp=(2, 4, 16, 32, 64)),
                solve=lambda tp: activation_bytes_per_layer_tp(4096, 1, 8192, 64, tp, flash_attention=True)
                / activation_bytes_per_layer_tp(4096, 1, 8192, 64, 1, flash_attention=True),
                hint="see the lab's section 10, Activation memory per rank: which of a layer's "
                     "activations TP splits and which stay whole (the chapter's section 7)"),
    quiz.number("Q5.5", "milliseconds for a {mib} MiB ring all-reduce on {gpus} GPUs at {gbs} GB/s", rel_tol=0.03,
                given=dict(mib=64, gpus=8, gbs=50), vary=dict(mib=(16, 32, 128, 256), gpus=(2, 4, 16), gbs=(25, 100)),
                solve=lambda mib, gpus, gbs: ring_all_reduce_time(mib * MiB, gpus, 0.0, gbs * 1e9) * 1e3,
                hint="see the lab's section 13 and lab 02's ring all-reduce: the bytes a ring sends "
                     "per GPU, over the link (the chapter's section 8)"),
    quiz.choice("Q5.6", "why the number of attention heads must be divisible by the TP degree", answer="a",
                options="abcd", hint="what does a rank need to compute softmax(q·kᵀ)·v for one head? (section 5, "
                                     "attention: split the heads)"),
]
