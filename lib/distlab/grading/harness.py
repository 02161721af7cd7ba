"""What every checker shares, written once: seeds, time limits, tolerances, running code on ranks, comparing.

A checker in ``grading/labNN.py`` holds its lab's cases and what its failures mean; the scaffolding around
them lives here, so that every lab draws, runs and compares the same way and a fix reaches all of them:

* :func:`lab_seed` and :func:`rank_seed`: where hidden cases (fixed in self-study, the grader's when graded)
  and per-rank weights come from;
* :class:`Edge` and :func:`case_drawn`: the boundaries each exercise's text names (a size not divisible by the
  world, N = 2, a value at a threshold), and each hidden case as it is drawn, so a test sees that the cases
  cover every boundary under every seed;
* :data:`JOB_TIMEOUT`, :data:`LONG_JOB_TIMEOUT`: what a time limit is for; :func:`tolerance`: the one rule
  for how close a right answer comes (relative and absolute, from the dtype's epsilon and the terms summed);
* :func:`run_on_ranks` and :func:`launch_failures_fail_the_check`: a job whose ranks deadlock, disagree
  or never finish becomes a :class:`~distlab.grading.contract.CheckFailed` that says so, not a traceback;
  :func:`rank_group` and :func:`run_job` for a checker that runs several jobs on a group of its own;
* :func:`max_difference`, :func:`is_close` and :func:`assert_close`: a tensor against the reference,
  the failure naming where and by how much (the one comparer every checker uses), on :func:`plain` data
  (a tensor subclass or a number that lies about equality is compared as the plain value it holds);
* :func:`raise_if_untouched`: an untouched stub is "not attempted" before any rank starts;
* :func:`run_isolated`: the part of a checker that needs the student's objects whole, run where they live
  (under ``distlab grade``, beside the grading process: :mod:`distlab.grading.isolation`).
"""

from __future__ import annotations

import ast
import inspect
import math
import os
import textwrap
import types
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from distlab.grading.contract import CheckFailed, first_line
from distlab.runtime import comm
from distlab.runtime.launch import (
    DEFAULT_COLLECTIVE_TIMEOUT,
    CollectiveTimeout,
    LaunchTimeout,
    RankFailed,
    Ranks,
    Run,
    UnmatchedCommunication,
    launch,
)
from distlab.runtime.payload import plain
from distlab.workload import build_model, gradient_bytes

__all__ = ["Edge", "case_drawn", "cases_drawn", "uncovered", "GRADE_SEED_VARIABLE", "JOB_TIMEOUT",
           "LONG_JOB_TIMEOUT", "ATOL", "WEIGHT_ATOL", "WORLD_SIZES",
           "RANK_GROUP_COLLECTIVE_TIMEOUT", "lab_seed", "rank_seed", "random_tensor", "case_gradient_bytes",
           "raise_if_untouched", "launch_failures_fail_the_check", "run_on_ranks", "rank_group", "run_job", "ops_used",
           "Waits", "p2p_waits_counted",
           "max_difference", "Tolerance", "ROUNDING_ULPS", "DEFAULT_TERMS", "tolerance", "is_close", "assert_close",
           "plain", "with_reference", "stub_message", "run_isolated"]

# The environment variable through which ``distlab grade`` gives each kernel the seed of its hidden cases.
GRADE_SEED_VARIABLE = "DISTLAB_GRADE_SEED"
# Seconds one checker job may run: long enough for a rank starved on a busy laptop, short enough that an
# endless loop outside any collective (which no collective timeout sees) fails the check instead of hanging it.
JOB_TIMEOUT = 60.0
# For jobs of many ranks on few cores, or many training steps per job (labs 03 and 11).
LONG_JOB_TIMEOUT = 120.0
# The world sizes a checker of collectives runs on: 2, where the next and the previous rank are the same one;
# 3, odd; 4, a power of two.
WORLD_SIZES = (2, 3, 4)
# Seconds a collective of a :func:`rank_group` may wait: a deadlocked ring fails within seconds, a rank slowed by a
# busy machine does not.
RANK_GROUP_COLLECTIVE_TIMEOUT = 8.0


# ---------------------------------------------------------------- where cases come from

def lab_seed(lab: int) -> int:
    """The seed of lab ``lab``'s hidden cases, different per lab so no two labs draw the same cases.

    Self-study: fixed (lab 3 → 3_2024), so a notebook's check lines read the same on every run. Graded:
    ``distlab grade`` draws a seed per grading run, records it in its report (``--seed`` replays it) and hands
    it to each kernel in :data:`GRADE_SEED_VARIABLE`, so the cases a grade is decided on are in no package.
    Read when a check runs, not at import: the grader's kernels are forked from a process that imported
    every lab before any seed was drawn.
    """
    graded = os.environ.get(GRADE_SEED_VARIABLE, "").strip()
    return int(graded) * 100 + lab if graded else lab * 10_000 + 2024


def rank_seed(seed: int, rank: int) -> int:
    """The seed a rank builds its model from: rank 0 the case's, every other rank its own.

    The replicas start different on purpose: only code that broadcasts rank 0's weights ends up with
    the single-process reference's, so a forgotten broadcast fails the check.
    """
    return seed if rank == 0 else seed + 1000 * rank + 1


def random_tensor(shape, dtype, seed: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s input of a case: normal values drawn in float64 from ``seed`` and the rank, then cast."""
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def case_gradient_bytes(case) -> int:
    """The bytes of every gradient of ``case``'s model (``case.model``, ``case.cfg``, ``case.seed``):
    a tied weight once, frozen weights never. One all-reduce of each per step is what DDP moves, and
    what a DDP or ZeRO step's traffic is held to."""
    return gradient_bytes(build_model(case.model, case.cfg, seed=case.seed))


# ---------------------------------------------------------------- the edges each exercise's text names

@dataclass(frozen=True)
class Edge:
    """A boundary an exercise's text or docstring states ("a size not divisible by the world size", "N = 2", "a
    value exactly at the threshold"), as a test on one hidden case's facts (what :func:`case_drawn` recorded).
    A lab lists them per exercise in ``EDGES``; ``tests/grading/test_edges.py`` runs each reference under
    several seeds and fails when a seed's cases miss an edge, so a boundary is in the cases by construction,
    never by the luck of a draw."""

    name: str
    holds: Callable[[dict], bool]

    def covered_by(self, cases: list[dict]) -> bool:
        return any(self.holds(case) for case in cases)


# Every hidden case drawn in this process since :func:`cases_drawn` was last cleared, as (exercise, facts).
_CASES: list[tuple[str, dict]] = []


def case_drawn(exercise: str, **facts) -> None:
    """A checker says what a hidden case is as it draws it (world size, sizes, dtype, values at a threshold…):
    the facts an exercise's :class:`Edge` tests read. It changes nothing in the check."""
    _CASES.append((exercise, facts))


def cases_drawn(exercise: str, clear: bool = False) -> list[dict]:
    """The facts of ``exercise``'s cases drawn so far in this process; ``clear`` forgets every exercise's."""
    found = [facts for drawn, facts in _CASES if drawn == exercise]
    if clear:
        _CASES.clear()
    return found


def uncovered(edges: list[Edge], cases: list[dict]) -> list[str]:
    """The names of the edges no case sits on."""
    return [edge.name for edge in edges if not edge.covered_by(cases)]


# ---------------------------------------------------------------- running the student's code

def raise_if_untouched(*student_code) -> None:
    """Raise the stub's ``NotImplementedError`` now when a function (or a method of a class) the student
    hands in is still exactly its stub, so an unfinished exercise is "not attempted" without starting ranks.

    Only a body that is nothing but ``raise NotImplementedError("Exercise …")`` counts; anything the
    student wrote runs on the ranks as usual.
    """
    for code in student_code:
        if hasattr(code, "stub_messages"):  # held apart by the grader (grading/isolation.py): it read the source
            messages = code.stub_messages()
        else:
            functions = [code] if callable(code) and not inspect.isclass(code) else [
                member for _, member in inspect.getmembers(code, inspect.isfunction)]
            messages = [m for m in map(_stub_message, functions) if m is not None]
        if messages:
            raise NotImplementedError(messages[0])


def _stub_message(fn) -> str | None:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    return stub_message(tree.body[0]) if tree.body else None


def stub_message(node: ast.AST) -> str | None:
    """The stub's message when the function ``node`` (a syntax tree) is nothing but the lab's
    ``raise NotImplementedError("Exercise …")``, else None."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    body = [statement for statement in node.body
            if not (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant))]  # docstrings
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or not isinstance(body[0].exc, ast.Call):
        return None
    call = body[0].exc
    if getattr(call.func, "id", None) != "NotImplementedError" or not call.args:
        return None
    text = getattr(call.args[0], "value", None)
    return text if isinstance(text, str) and text.startswith("Exercise ") else None


@contextmanager
def launch_failures_fail_the_check(what: str, world_size: int, advice: str = "", timeout: float = JOB_TIMEOUT):
    """Inside the block, ranks that never finish or do not make matching calls fail the check.

    A deadlock (:class:`CollectiveTimeout`), calls that do not pair up (:class:`UnmatchedCommunication`, or
    a rank's ``CollectiveMismatch``) and a job past ``timeout`` (an endless loop) are the student's
    mistakes, not crashes of the grader: each becomes a :class:`CheckFailed` that names ``what`` ran
    ("your ring"), on how many ranks, and what the launcher saw (its first line). ``advice`` is the
    lab's usual cause; without it, the launcher's own hint for what it saw. Any other error propagates.
    """
    try:
        yield
    except (CollectiveTimeout, UnmatchedCommunication, RankFailed) as error:
        if isinstance(error, RankFailed) and "CollectiveMismatch" not in str(error):  # on any rank, lead or not
            raise
        how = "deadlocked" if isinstance(error, CollectiveTimeout) else "made calls that do not match"
        hint = getattr(error, "hint", "")
        advice = advice or (f"Hint: {hint}" if hint else "")
        raise CheckFailed(f"{what} {how} on {world_size} ranks: {first_line(error)} {advice}".rstrip()) from None
    except LaunchTimeout:
        raise CheckFailed(f"{what} did not finish within {timeout:g} s on {world_size} ranks: look for an endless "
                          "loop, or a rank waiting for a message no other rank sends") from None


def run_on_ranks(worker, world_size: int, *args, what: str, advice: str = "", kwargs: dict | None = None,
                 backend: str = "gloo", collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT,
                 timeout: float = JOB_TIMEOUT) -> Run:
    """``worker(*args, **kwargs)`` on ``world_size`` warm ranks, quietly; launch failures fail the check
    (:func:`launch_failures_fail_the_check`, with ``what`` and ``advice``).

    Warm ranks are kept per world size, backend and collective timeout: with the ones the notebook's cells
    use (the defaults: gloo, distlab's collective timeout) a check starts no process.
    """
    with launch_failures_fail_the_check(what, world_size, advice, timeout):
        return launch(worker, world_size, args, kwargs, warm=True, show_output=False, backend=backend,
                      collective_timeout=collective_timeout, timeout=timeout)


@contextmanager
def rank_group(world_size: int, what: str):
    """A gloo group of its own for one world size, for several jobs (:func:`run_job`); a hang becomes a
    :class:`CheckFailed` that says so, and the group is closed when the block ends.

    No lab-specific advice: the launcher says what it saw (everyone receiving, everyone sending, sends to
    the wrong neighbour, a missing call) and what to check for that case; the hint is its, not a fixed guess.
    """
    ranks = Ranks(world_size, backend="gloo", collective_timeout=RANK_GROUP_COLLECTIVE_TIMEOUT)
    try:
        with launch_failures_fail_the_check(what, world_size):
            yield ranks
    finally:
        ranks.close()


def run_job(ranks: Ranks, fn, *args) -> Run:
    """``fn(*args)`` on every rank of a :func:`rank_group`, quietly, within :data:`JOB_TIMEOUT`."""
    return ranks.run(fn, args=args, timeout=JOB_TIMEOUT, show_output=False)


def ops_used(log=None) -> dict[str, int]:
    """Inside a rank: how many times each torch.distributed op was called so far in this job."""
    log = log or comm.current_log()
    return {op: stats.calls for op, stats in log.ops.items() if stats.calls}


@dataclass
class Waits:
    """The point-to-point handles a block posted (:func:`p2p_waits_counted`) and how many were never waited for."""

    posted: list

    @property
    def unwaited(self) -> int:
        return sum(not work.waited for work in self.posted)


class _CountedWork:
    def __init__(self, work):
        self.work, self.waited = work, False

    def wait(self, *args, **kwargs):
        self.waited = True
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.work, name)


@contextmanager
def p2p_waits_counted():
    """Inside a rank: the handles ``dist.isend``/``irecv`` return in the block (``batch_isend_irecv`` returns
    theirs), each told whether it was waited for. gloo completes a send or receive nobody waits for (NCCL need
    not, and the buffer may be read before it arrives), so an unwaited handle is invisible in the values a
    check compares. Both the package's names and ``distributed_c10d``'s are replaced, as comm's are, so that
    ``P2POp``'s check accepts the counted ``dist.isend``."""
    import torch.distributed as dist  # noqa: PLC0415  patched only inside the block, in the rank that runs it
    from torch.distributed import distributed_c10d  # noqa: PLC0415  likewise

    waits = Waits([])
    real = {name: getattr(distributed_c10d, name) for name in ("isend", "irecv")}

    def counted(name):
        def call(*args, **kwargs):
            waits.posted.append(_CountedWork(real[name](*args, **kwargs)))
            return waits.posted[-1]
        return call

    for name in real:
        setattr(distributed_c10d, name, counted(name))
        setattr(dist, name, getattr(distributed_c10d, name))
    try:
        yield waits
    finally:
        for name, function in real.items():
            setattr(distributed_c10d, name, function)
            setattr(dist, name, function)


# ---------------------------------------------------------------- comparing with the reference

def max_difference(got: torch.Tensor, expected: torch.Tensor) -> tuple[float, tuple[int, ...]]:
    """The largest ``|got - expected|`` (in float64) and its index; ``(0.0, ())`` for empty tensors.

    Equal infinities (a fully masked row's ``-inf``) do not differ; a NaN on either side differs
    infinitely, so no tolerance lets it pass.
    """
    got = plain(got)
    if not got.numel():
        return 0.0, ()
    diff = _differences(got, expected)
    index = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
    return diff.max().item(), index


def _differences(got: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    got, expected = got.detach().double(), expected.detach().double()
    diff = (got - expected).abs()
    diff = torch.where(torch.isinf(got) & (got == expected), torch.zeros_like(diff), diff)
    return torch.where(torch.isnan(diff), torch.full_like(diff, torch.inf), diff)


@dataclass(frozen=True)
class Tolerance:
    """How far a right answer may be from the reference: ``|got - expected| ≤ atol + rtol·|expected|``, element by
    element (:func:`tolerance` says where the two numbers come from)."""

    rtol: float
    atol: float
    dtype: torch.dtype = torch.float32

    def bound(self, expected: torch.Tensor) -> torch.Tensor:
        """The largest difference allowed at each element of ``expected``."""
        return self.atol + self.rtol * expected.detach().double().abs().nan_to_num(posinf=0.0, neginf=0.0)

    def holds(self, got: float, expected: float) -> bool:
        """The rule on two numbers (a formula's result against the library's)."""
        return math.isfinite(got) and abs(got - expected) <= self.atol + self.rtol * abs(expected)

    def round_off_sized(self, difference: float, magnitude: float) -> bool:
        """Whether a difference of a tolerance's size, though over it, is still rounding's size rather than a wrong
        formula's: below √eps of the values compared (3.5e-4 in fp32), where no mistake in a formula lands but a
        sum in a lower precision, or of many more terms in another order, does. Its hint then says so instead of
        the exercise's usual mistake (a correct softmax told to "subtract the max" is sent to fix what is right)."""
        return difference <= math.sqrt(_eps(self.dtype)) * max(magnitude, 1.0)


# Units in the last place one rounding may move a result that a right answer computes in another order than the
# reference (other blocks, shards, ranks or kernels); over n terms summed such errors grow like √n.
ROUNDING_ULPS = 16
# The terms a compared value sums when its checker does not say: a dot product of a small hidden case's width.
DEFAULT_TERMS = 64


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps if dtype.is_floating_point else 0.0


def tolerance(expected, *, dtype: torch.dtype | None = None, terms: int = DEFAULT_TERMS, scale: float | None = None,
              atol: float = 0.0, rtol: float = 0.0) -> Tolerance:
    """The one rule for how close a right answer comes to the reference, from the arithmetic that made it.

    ``rtol = ROUNDING_ULPS · eps · √terms``: rounding in the dtype the values are computed in (``dtype``,
    ``expected``'s by default; 16-bit floats accumulate in fp32, as torch's reductions and matmuls do, and are then
    rounded once more, two units in their own last place), over the ``terms`` each value sums. ``atol = rtol ·
    scale``: the same rounding at the magnitude compared, the largest finite ``|expected|`` (a sum that cancels
    passes the magnitude of its terms as ``scale``), and never below one, so values of order one and smaller are
    held to the absolute rounding of order one. A loss of 128 in fp32 is then allowed 128 times what a loss of 1
    is, and a float64 case is held to float64's rounding. A checker's own ``atol``/``rtol`` (the labs written
    before this rule) are floors: the rule never makes a check tighter than its checker asked.
    """
    if dtype is None:
        dtype = expected.dtype if isinstance(expected, torch.Tensor) else torch.float64
    accumulate = torch.float32 if dtype.is_floating_point and torch.finfo(dtype).bits == 16 else dtype
    rounding = ROUNDING_ULPS * _eps(accumulate) * math.sqrt(max(terms, 1)) + (
        2 * _eps(dtype) if accumulate != dtype else 0.0)
    if scale is None:
        scale = _magnitude(expected)
    return Tolerance(max(rtol, rounding), max(atol, rounding * max(scale, 1.0)), dtype)


def _magnitude(values) -> float:
    """The largest finite ``|value|`` (a masked row's ``-inf`` does not count), 0 for none."""
    if not isinstance(values, torch.Tensor):
        return abs(float(values)) if math.isfinite(float(values)) else 0.0
    finite = values.detach().double().abs()
    finite = finite[torch.isfinite(finite)]
    return finite.max().item() if finite.numel() else 0.0


# What :func:`tolerance` allows fp32 values of order one: the absolute tolerance checkers written before the rule
# name (``atol=ATOL``), kept as their floor.
ATOL = tolerance(torch.ones(1)).atol
# Weights after a few SGD steps on ranks against one process on the whole batch: only the order of the
# gradient reduction differs, so a wrong scaling factor of even 1% is far above it.
WEIGHT_ATOL = 1e-6


def is_close(got, expected: torch.Tensor, atol: float = 0.0, rtol: float = 0.0, **rule) -> bool:
    """Whether ``got`` is a tensor of ``expected``'s shape within :func:`tolerance` everywhere (equal infinities are
    close, a NaN never is): the test behind a check, and behind "does the answer match this known mistake?"
    hints. ``rule``: :func:`tolerance`'s ``dtype``, ``terms`` and ``scale``; ``atol``/``rtol``: floors."""
    got = plain(got)
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(expected.shape):
        return False
    if not got.numel():
        return True
    allowed = tolerance(expected, atol=atol, rtol=rtol, **rule)
    return bool((_differences(got, expected) <= allowed.bound(expected)).all())


def assert_close(where: str, what: str, got, expected: torch.Tensor, atol: float = 0.0, hint="",
                 same_dtype: bool = False, **rule) -> None:
    """Raise :class:`CheckFailed` unless ``got`` is a tensor of ``expected``'s shape (and, with ``same_dtype``,
    its dtype) within :func:`tolerance` everywhere (``rule``: its ``dtype``, ``terms``, ``scale``, ``rtol``;
    ``atol``: a floor).

    The message starts with ``where`` (the case, the rank) and ``what`` (the tensor), then says how far off it is
    and shows the worst element beside its expected value, then ``hint``: the usual cause, a text or a function of
    ``(got, expected)`` that chooses it by what differs ("" for none that fits). A difference of rounding's size
    gets no hint (a right formula computed in a lower precision would be sent to fix what is right) but says so.
    """
    got = plain(got)
    if not isinstance(got, torch.Tensor):
        raise CheckFailed(f"{where}: {what} should be a tensor, got {type(got).__name__}")
    if tuple(got.shape) != tuple(expected.shape):
        raise CheckFailed(f"{where}: {what} has shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
    if same_dtype and got.dtype != expected.dtype:
        raise CheckFailed(f"{where}: {what} has dtype {got.dtype}, expected {expected.dtype}")
    if not got.numel():
        return
    allowed = tolerance(expected, atol=atol, **rule)
    diff, bound = _differences(got, expected), allowed.bound(expected)
    excess = diff / bound.clamp_min(torch.finfo(torch.float64).tiny)
    if bool((diff <= bound).all()):
        return
    index = tuple(int(i) for i in torch.unravel_index(excess.argmax(), excess.shape))
    worst = diff[index].item()
    if allowed.round_off_sized(worst, _magnitude(expected)):
        why = (f"a difference of rounding's size, not a wrong formula: compute in {_dtype_name(allowed.dtype)} "
               "(not a lower precision) and sum in a stable order")
    else:
        why = hint(got, expected) if callable(hint) else hint
    raise CheckFailed(f"{where}: {what} differs from the reference by up to {worst:.3g}, more than {bound[index]:.3g} "
                      f"(at {list(index)}: {got[index].item():.6g}, expected {expected[index].item():.6g})"
                      + (f": {why}" if why else ""))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# ---------------------------------------------------------------- grading one exercise on its own

def with_reference(student, **pieces):
    """``student`` (a function or a class) with the global names in ``pieces`` bound to the library's versions.

    An exercise that builds on an earlier one (lab 05's MLP on its linears, lab 08's layer on its router) calls
    the earlier answer by its global name in the notebook. Graded as written, a mistake in the earlier exercise
    fails the later one too, with a message about the wrong exercise; graded with the reference in its place,
    each exercise counts for what it adds. Only names the student's code looks up globally are replaced: a
    piece reached another way (an attribute, a closure) stays the student's. A class becomes a subclass whose
    methods are rebuilt on the new globals, so ``super()`` and ``isinstance`` keep working.
    """
    if hasattr(student, "with_reference"):  # held apart by the grader: it rebinds where the code runs
        return student.with_reference(**pieces)

    def names(code) -> set[str]:  # the globals a function and the functions nested in it look up
        return set(code.co_names).union(*(names(c) for c in code.co_consts if isinstance(c, types.CodeType)))

    def rebind(fn):
        if not isinstance(fn, types.FunctionType) or not names(fn.__code__) & set(pieces):
            return fn
        copy = types.FunctionType(fn.__code__, {**fn.__globals__, **pieces}, fn.__name__, fn.__defaults__,
                                  fn.__closure__)
        copy.__kwdefaults__, copy.__qualname__, copy.__doc__ = fn.__kwdefaults__, fn.__qualname__, fn.__doc__
        return copy

    if not isinstance(student, type):
        return rebind(student)
    methods = {}
    for name, value in vars(student).items():
        function = value.__func__ if isinstance(value, staticmethod | classmethod) else value
        if isinstance(function, types.FunctionType) and rebind(function) is not function:
            methods[name] = type(value)(rebind(function)) if function is not value else rebind(function)
    if not methods:
        return student  # nothing of it looks up a replaced name
    return type(student.__name__, (student,), {**methods, "__qualname__": student.__qualname__ + "[reference]",
                                                "__module__": student.__module__})


def run_isolated(job, *args):
    """``job(*args)``, where the student's code among ``args`` lives: in a notebook, right here; under
    ``distlab grade``, in the sandbox beside the grading process, so that only plain data comes back
    (:mod:`distlab.grading.isolation`).

    For the part of a checker that drives the student's code through state it cannot hand over as a value:
    autograd on what the code returned, a module or an optimizer it changes in place, a count taken while it
    runs. ``job`` (a module-level function of the checker) returns what the checker compares, as tensors,
    numbers and containers of them; the comparison stays in the checker, against its own reference.
    """
    for arg in args:
        if hasattr(arg, "run_beside"):
            return arg.run_beside(job, *args)
    return job(*args)
