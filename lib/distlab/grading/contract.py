"""The grading contract's ground floor: what a check raises, what it returns, and how its result reads.

A checker raises :class:`CheckFailed` saying what differs; ``distlab.check`` (:mod:`distlab.grading`) turns
the outcome into a :class:`CheckResult`, whose :meth:`~CheckResult.line` is the one line a student reads, in
the notebook and in the feedback an instructor hands back (:mod:`distlab.grading.submissions`). An error in
the student's code is told in one line too (:func:`describe_error`): its type, its first line, the student's
own source line and, when it is one of the common slips with torch and torch.distributed (:data:`SLIPS`, the
one list of them), which slip. This module imports nothing of distlab, so every other part of grading can
stand on it.
"""

from __future__ import annotations

import os
import re
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, fields

__all__ = ["STUB_MESSAGE", "MARKS", "CheckFailed", "CheckResult", "is_not_attempted", "describe_error",
           "student_frame", "first_line", "Slip", "SLIPS", "SLIP_SAID", "slip_of"]

# What an untouched exercise raises: ``distlab labs`` writes it into the student's stub, and a check reads a
# NotImplementedError as "not attempted".
STUB_MESSAGE = "Exercise {id}: replace this line with your solution"

# A result's mark by status; "not run" is the grader's, for a check whose cell never ran.
MARKS = {"passed": "✓", "failed": "✗", "not attempted": "·", "not run": "-"}


class CheckFailed(AssertionError):
    """Raised by a checker when the student's answer is wrong; the message says how."""


@dataclass
class CheckResult:
    id: str
    title: str
    status: str  # "passed" | "failed" | "not attempted" (and "not run", which only the grader writes)
    points: int
    max_points: int
    detail: str = ""
    label: str = ""  # "Exercise 2.1" or "Question Q2.1"
    given: float | None = None  # a varied quiz question's answer, which the grader marks itself (grading/quiz.py)

    @classmethod
    def from_entry(cls, entry: Mapping) -> CheckResult:
        """A result read back from a report: the ledger's JSON, with whatever keys the grader added."""
        return cls(**{f.name: entry[f.name] for f in fields(cls) if f.name in entry})

    def _ipython_display_(self) -> None:
        """``check`` already printed the line; a bare call at the end of a cell shows nothing more."""

    @property
    def name(self) -> str:
        """Label and title: "Exercise 2.1 ring all-reduce from send/recv"."""
        return f"{self.label or 'Exercise ' + self.id} {self.title}"

    def line(self) -> str:
        """Mark, name, points and what differed: what the notebook prints and the feedback repeats."""
        head = f"{MARKS.get(self.status, '?')} {self.name}: {self.points}/{self.max_points} points"
        if self.status in ("not attempted", "not run"):
            return f"{head} ({self.status})"
        return f"{head} ({self.detail})" if self.detail else head


def is_not_attempted(error: BaseException) -> bool:
    """True for the NotImplementedError an untouched stub raises, in this process or in a rank; not for the one
    torch raises for an op it has no kernel for (``"mul_cpu" not implemented for 'Float8_e4m3fn'``): that is an
    attempt that fails, and :data:`SLIPS` names it."""
    if not isinstance(error, NotImplementedError) and getattr(error, "exc_type", None) != "NotImplementedError":
        return False
    return not re.search(_NO_KERNEL, str(error))


# What torch's NotImplementedError for a missing kernel says (a stub's says "Exercise N.k: ...").
_NO_KERNEL = r"not implemented for '\w+'|Could not run 'aten::"


def describe_error(error: BaseException) -> str:
    """One line for an error raised in or by the student's code: its type, first line and, when it was raised
    in this process, the student's line (the innermost frame outside distlab and the libraries), so the
    student sees where to look rather than a torch internal; then, when the error is a common slip
    (:func:`slip_of`), what the slip is. A rank's error already names its rank and line."""
    kind = type(error).__name__  # a rank's error (RankFailed) names the rank's exception in its first line
    text = f"{kind}: {first_line(error)}" if first_line(error) else kind
    where = student_frame(error) or getattr(error, "student_line", "")  # an error rebuilt from another process's
    text = f"{text} (at {where})" if where else text
    slip = slip_of(error)
    return f"{text}{SLIP_SAID}{slip.says}" if slip else text


# distlab's own files, by where the package is: a user's clone is often a folder named distlab too, and their
# files in it are theirs.
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def student_frame(error: BaseException) -> str:
    """``"line 7: total += x"`` for the innermost traceback frame in a notebook cell or a user's file, or ""."""
    frames = traceback.extract_tb(error.__traceback__) if error.__traceback__ else []
    for frame in reversed(frames):
        name = frame.filename.replace("\\", "/")
        if (os.path.abspath(frame.filename).startswith(_PACKAGE) or "site-packages" in name or "/lib/python" in name
                or name.startswith("<frozen")):
            continue
        line = (frame.line or "").strip()
        return f"line {frame.lineno}: {line}" if line else f"line {frame.lineno}"
    return ""


def first_line(error, limit: int = 300) -> str:
    """The first line of an error (or of a message), at most ``limit`` characters: a launch error's first line
    says what happened, the lines after it are tracebacks and per-rank details a result line has no room for."""
    lines = str(error).strip().splitlines()
    return lines[0][:limit] if lines else ""


# ---------------------------------------------------------------- common slips, told by their error

@dataclass(frozen=True)
class Slip:
    """A common slip with torch or torch.distributed, recognised by the error it raises (``pattern``, searched in
    the exception's type and whole message) and said in words a student can act on (``says``)."""

    name: str
    pattern: str
    says: str


# How a result line introduces the slip it names.
SLIP_SAID = "; the usual slip: "
# The one list of slips (tests/grading/test_slips.py raises each for real and checks it is named). First match wins.
SLIPS = [
    Slip("leaf-updated-in-place", r"a leaf Variable that requires grad is being used in an in-place operation",
         "a parameter (a tensor with requires_grad=True) updated in place while autograd records: update it "
         "under `with torch.no_grad():`"),
    Slip("saved-tensor-modified", r"modified by an inplace operation",
         "an in-place op (+=, add_, copy_, a collective that reduces in place) changed a tensor autograd saved for "
         "backward: work on a copy (.clone()) or out of place"),
    Slip("backward-twice", r"backward through the graph a second time",
         "backward ran twice through one graph: call it once per forward pass"),
    Slip("graph-cut", r"does not require grad and does not have a grad_fn",
         "what backward() starts from is cut off the graph: a .detach(), .item(), torch.no_grad() or a tensor "
         "rebuilt from values (torch.tensor(...)) sits between the parameters and it"),
    Slip("backward-of-a-tensor", r"grad can be implicitly created only for scalar outputs",
         "backward() without an argument needs a scalar: reduce the output first (the loss, .sum()) or pass the "
         "upstream gradient"),
    Slip("dtypes-mixed", r"same dtype|different dtypes|expected scalar type|Found dtype|mixed dtype|"
         r"assign a gradient with dtype",
         "two dtypes meet (float32 and float64, an integer and a float): make buffers with the input's dtype "
         "(torch.empty_like(x), dtype=x.dtype)"),
    Slip("matmul-shapes", r"shapes cannot be multiplied|inner dimensions differ|"
         r"Expected size for first two dimensions of batch2 tensor",
         "a matmul's inner sizes differ: its operands in the other order, a shard cut along the wrong dimension "
         "(rows or columns?), or a weight that needs .t()"),
    Slip("sizes-differ", r"The size of tensor a \(\d+\) must match the size of tensor b|stack expects each tensor "
         r"to be equal size|Sizes of tensors must match|The expanded size of the tensor|"
         r"doesn't match the broadcast shape",
         "tensors of different sizes meet: a shard beside a whole tensor, or chunks of unequal size where the size "
         "does not divide by the world (split every side the same way)"),
    Slip("float-size", r"slice indices must be integers|'float' object cannot be interpreted as an integer|"
         r"must be tuple of ints, not float|must be int, not float|for \^: 'int' and 'float'|for \^: 'float'|"
         r"tensors used as indices must be long, int, byte or bool|tuple of ints,\s*but got float|"
         r"(reshape|view)\(\) takes 1 positional argument but \d+ were given|invalid combination of arguments - "
         r"got \(float",
         "a size or an index came out a float: / always gives a float; use // (integer division) for sizes and "
         "indices"),
    Slip("floor-division-in-autograd", r"derivative for aten::floor_divide is not implemented",
         "// on a tensor that needs a gradient: floor division has none; divide with /"),
    Slip("item-of-many", r"elements cannot be converted to Scalar|only one element tensors can be converted",
         ".item() (or float(), int()) needs a one-element tensor: reduce it first, or index one element"),
    Slip("collective-returns-none", r"'NoneType'|NoneType'|non-iterable NoneType",
         "a value is None: dist.all_reduce, broadcast, send and recv work in place and return None (a handle "
         "only with async_op=True), so keep using the tensor you passed; a function without return returns None "
         "too"),
    Slip("list-for-a-tensor", r"Expected parameter `\w+` of type torch\.Tensor|must be Tensor, not list",
         "a collective got a list where it takes one tensor: all_reduce, broadcast and the *_tensor collectives "
         "take a tensor; all_gather and reduce_scatter (without _tensor) take lists"),
    Slip("collective-buffer-size", r"invalid tensor size|invalid output tensor list|worldSize == inputShape|"
         r"Received data size doesn't match expected size|output tensor size must be",
         "a collective's buffer has the wrong size: all_gather_into_tensor's output (reduce_scatter_tensor's "
         "input) holds world_size times the shard, and a receive must expect exactly what its peer sends"),
    Slip("peer-is-this-rank", r"Pair is not connected|destination rank should not be the same|source rank should "
         r"not be the same",
         "a send or receive with this rank itself as the peer: a ring's neighbours are (rank + 1) % N and "
         "(rank - 1) % N, never the rank itself"),
    Slip("peer-outside-the-group", r"there is no such rank|Invalid (destination|source) rank|invalid root rank",
         "a send or receive with a rank that does not exist: partners must lie in 0..N-1 (take them modulo N, or "
         "check that an extra rank's partner is there)"),
    Slip("outside-the-ranks", r"Default process group has not been initialized",
         "torch.distributed is used outside the ranks: call it inside the function the ranks run"),
    Slip("devices-mixed", r"to be on the same device|to be in the same device|is not on the expected device",
         "tensors on different devices meet: make buffers on the input's device (torch.empty_like(x), "
         "device=x.device)"),
    Slip("plain-tensor-parameter", r"as parameter '\w+' \(torch\.nn\.Parameter or None expected\)",
         "a module's parameter replaced by a plain tensor: wrap it, nn.Parameter(tensor)"),
    Slip("dim-out-of-range", r"Dimension out of range|Dimension specified as -?\d+ but tensor has no dimensions",
         "a dim past the tensor's dimensions: they count from 0 (a 2-D tensor has 0 and 1; -1 is the last)"),
    Slip("shape-index-past-the-end", r"tuple index out of range",
         "an index past a tuple's end: a tensor's .shape has one entry per dimension (a 2-D tensor has shape[0] "
         "and shape[1]), and a function that returns a pair has [0] and [1]"),
    Slip("dim-and-index-swapped", r"argument 'dim' \(position 1\) must be int, not Tensor|Index is supposed to be "
         r"a vector",
         "gather, scatter, index_add, index_copy and index_select take (dim, index, values): the dim (an int) "
         "first, then the index tensor, then the values; the arguments are in another order"),
    Slip("index-along-another-dim", r"Number of indices \(\d+\) should be equal to source\.size\(dim\)",
         "index_add/index_copy place source's slices along dim at the positions the index names, one index per "
         "slice: along dim 0 (one row per token) the index has as many entries as source has rows"),
    Slip("mean-of-integers", r"mean\(\): could not infer output dtype",
         ".mean() of an integer tensor (counts from bincount, one_hot, cumsum): sum the counts with .sum(), or "
         "take .float() first for an average"),
    Slip("scaled-mm-scales", r"Invalid scaling configuration",
         "torch._scaled_mm's scales do not fit its operands: tensor-wise both are one-element float32 tensors, "
         "row-wise scale_a is (M, 1) and scale_b (1, N); check which scale goes with which operand"),
    Slip("no-kernel-for-the-dtype", _NO_KERNEL,
         "torch has no kernel for this op in this dtype (FP8 tensors support almost no arithmetic, integer ones no "
         "softmax or mean): convert with .float() first, compute, and cast the result back if needed"),
    Slip("empty-unpack", r"not enough values to unpack \(expected \d+, got 0\)",
         "nothing to unpack: ctx.saved_tensors is empty unless forward saved them with ctx.save_for_backward(...) "
         "before it returns (an empty list or split unpacks to nothing too)"),
    Slip("argument-of-another-kind", r"must be (Tensor|int), not (int|float|NoneType|str)\b|"
         r"'(int|float|list|tuple|str|ModuleList|torch\.dtype)' object has no attribute|"
         r"'(Linear|Embedding)' object has no attribute '(size|shape|dim|numel|contiguous|dtype|device)'|"
         r"'(int|float)' object is not subscriptable|object of type '(int|float)' has no len\(\)|"
         r"only integer tensors of a single element can be converted to an index|"
         r"for [-+*/]: 'Tensor' and 'torch\.dtype'|"
         r"(KeyError: |=\[)(tensor\(|Parameter containing)",
         "a value of another kind where the call expects something else (a number for a tensor, a list for a "
         "module, a tensor for a name): check the order of the call's arguments against its signature"),
    Slip("index-past-the-end", r"index -?\d+ is out of bounds for dimension|list (assignment )?index out of range",
         "an index past the end: the global rank where the rank in the group is meant (dist.get_rank(group)), or "
         "a loop one step too long"),
    Slip("size-of-another-shape", r"shape '\[[-\d, ]*\]' is invalid for input of size",
         "a .view()/.reshape() to a shape of another number of elements: count what was padded or cut off (the "
         "last chunk may be shorter)"),
    Slip("negative-size", r"must be non-negative|invalid shape dimension -\d",
         "a size came out negative: check the size arithmetic (a ceiling division is -(-a // b))"),
    Slip("used-before-assigned", r"cannot access (local|free) variable '\w+' where it is not associated with a value|"
         r"referenced before assignment",
         "a name is read before the line that assigns it runs: check the order of your statements"),
    Slip("view-of-a-strided-tensor", r"view size is not compatible with input tensor's size and stride",
         ".view() needs contiguous memory (a transpose or a slice is not): use .reshape(), or .contiguous().view()"),
    Slip("tensor-as-a-bool", r"Boolean value of Tensor with more than one value is ambiguous",
         "a tensor of several values was read as a bool (if x:, and/or) or passed where a flag or a process group "
         "belongs: use .any() or .all(), and check the order of the call's arguments"),
    Slip("group-for-a-tensor", r"ProcessGroup' object has no attribute|ProcessGroup' object is not",
         "a process group was used as a tensor: check the order of the call's arguments (the tensor first, "
         "group=... after)"),
    Slip("range-bounds-reversed", r"upper bound and lower bound inconsistent with step sign",
         "torch.arange(start, end) with end below start: check the order and the arithmetic of the bounds"),
    Slip("lookup-past-the-rows", r"index out of range in self",
         "an index past a lookup table's rows (F.embedding, index_select): shift the ids by the shard's first row "
         "and mask the ids outside it"),
    Slip("empty-list-joined", r"expected a non-empty list of Tensors",
         "torch.cat/stack got an empty list: the loop that fills it ran zero times (check its range and its guard) "
         "or its .append was lost"),
    Slip("none-in-a-list", r"expected Tensor as element \d+ in argument \d+, but got NoneType",
         "a list handed to torch.cat/stack holds None: a variable a loop should set stayed None (the loop ran zero "
         "times or skipped every step), or a function has no return"),
    Slip("ctx-attribute-unset", r"'\w+Backward' object has no attribute",
         "backward reads a ctx attribute that forward never set: set ctx.<name> in forward before its return"),
    Slip("p2p-op-arguments", r"Expected ``op`` to be of type ``torch\.distributed\.isend``",
         "dist.P2POp(op, tensor, peer) takes the function (dist.isend or dist.irecv) first, then the tensor, then "
         "the peer's rank"),
    Slip("torch-arguments-order", r"received an invalid combination of arguments|where expected condition to be a "
         r"boolean tensor",
         "a torch function got arguments of the wrong types: check their order against its signature "
         "(masked_fill(mask, value), where(condition, x, y))"),
    Slip("unpacked-count", r"too many values to unpack|not enough values to unpack \(expected \d+, got [1-9]",
         "an unpacking (a, b = ..., for a, b in ...) got another number of values: check what the right side "
         "returns, and the order of zip's arguments"),
    Slip("compared-types", r"not supported between instances of '\w+' and '\w+'",
         "a comparison between a number and a value of another type (a str, a tuple): check the order of a call's "
         "arguments"),
    Slip("collective-not-contiguous", r"Tensors must be contiguous",
         "a collective needs contiguous memory: after a transpose, permute or slice call .contiguous() on what "
         "you send"),
    Slip("lookup-in-an-empty-table", r"self indexing axis dim should be positive",
         "a lookup (index_select, F.embedding) into a table with no rows: the slice of the weight is empty; check "
         "its start and end"),
    Slip("gradient-of-another-shape", r"Mismatch in shape: grad_output\[0\] has a shape of",
         "the gradient passed to backward has another shape than its output: check the shape of the buffer the "
         "gradient is received into"),
    Slip("path-of-another-type", r"expected str, bytes or os\.PathLike object, not",
         "a path was expected and got something else: check the order of the call's arguments, and that the path "
         "is not None"),
    Slip("permute-dims", r"permute\(\): duplicate dims are not allowed|number of dims don't match in permute",
         "permute takes every dim once, in its new place (a permutation of 0..n-1): check the dims listed"),
    Slip("linear-arguments-swapped", r"t\(\) expects a tensor with <= 2 dimensions",
         "F.linear(input, weight, bias) takes the 2-D weight second: the arguments are in the other order"),
]


def slip_of(error) -> Slip | None:
    """The slip an error (or an error's text: a result's "raised …" line) is, or None. A rank's error carries its
    exception's type (``exc_type``) and the whole report, which are searched too."""
    text = error if isinstance(error, str) else f"{getattr(error, 'exc_type', '')} {type(error).__name__}: {error}"
    return next((slip for slip in SLIPS if re.search(slip.pattern, text)), None)
