"""Mutation testing of the checkers: small wrong answers made from every exercise's reference solution.

A lab's wrong-answer table (``tests/grading/test_wrong_answers_labNN.py``) holds the mistakes someone thought of.
This tool makes the ones nobody wrote down: for each exercise it takes the solution notebook's own answer (the
lines between ``# BEGIN SOLUTION N.k`` and ``# END SOLUTION``), changes one thing in its syntax tree (a ``<``
into ``<=``, a constant by one, a ``.wait()`` removed, two arguments swapped; :data:`OPERATORS`), and runs the
exercise's check on each such mutant. A checker should fail every mutant that changes what the code computes,
with a message that says where to look; a mutant that passes either computes the same thing (an *equivalent*
mutant, listed with its reason in the lab's checker module, ``EQUIVALENT_MUTANTS``) or shows a hidden case the
checker lacks.

How it runs (``distlab notebooks mutants``, ``make mutants``): one process per lab imports torch, distlab and
the lab's checkers and executes the notebook's definitions once (:func:`reference_namespace`); then each mutant
runs in a child *forked* from it, which redefines the mutated function, calls ``distlab.check`` and reports,
within a time limit (a child past it is killed: "hung"). So a mutant costs its check's time, not an import of
torch, and no mutant can disturb another. Each outcome is classified (:func:`classify`):

* ``specific``: failed with a message that names where to look (advice after its numbers, or a named slip);
* ``vague``: failed with only numbers, or a raw exception (its type and line, no slip named);
* ``survived``: passed (``equivalent`` when the lab lists it with a reason);
* ``hung``: ran past its time limit: the checker let it run instead of failing it.

Results go to ``benchmarks/results/mutants.json`` after every mutant, so a run resumes where it stopped (an
exercise is redone only when its cell, its checker or this tool changed: its fingerprint), and
``mutants.txt`` is written from them: per exercise and lab the counts, every survivor and hung mutant, and every
vague message, for triage.
"""

from __future__ import annotations

import ast
import hashlib
import json
import linecache
import os
import random
import re
import select
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import nbformat

from distlab.grading.cells import cells_checks_need
from distlab.grading.contract import SLIP_SAID, slip_of
from distlab.grading.harness import GRADE_SEED_VARIABLE
from distlab.notebooks import REPO_ROOT, SOLUTION_BLOCK

__all__ = ["OPERATORS", "Mutant", "LabSource", "lab_source", "mutants_of", "reference_namespace", "classify",
           "run_lab", "check_mutant", "write_report", "main_loop", "in_fork",
           "prepare_forks", "check_threads"]

# Bump when the operators or the classification change: every exercise's results are then redone.
TOOL_VERSION = "2"
RESULTS = REPO_ROOT / "benchmarks" / "results" / "mutants.json"
REPORT = REPO_ROOT / "benchmarks" / "results" / "mutants.txt"
# At most this many mutants per exercise (each operator represented, the rest drawn with a fixed seed): a long
# solution makes hundreds, and a few dozen of each kind already find the checker's gaps.
MAX_PER_EXERCISE = 40
# A mutant's time limit: this many times its reference's check time, and never below MIN_LIMIT seconds: above the
# checkers' own job limits (harness.JOB_TIMEOUT, LONG_JOB_TIMEOUT: 60 and 120 s), so a checker that catches a hang
# itself is seen doing so.
LIMIT_FACTOR = 4.0
MIN_LIMIT = 150.0
# How long the reference check of one exercise may take before the tool gives up on that exercise.
REFERENCE_LIMIT = 900.0

OPERATORS = {
    "compare": "a comparison flipped: < and <=, > and >=, == and !=, is and is not, in and not in",
    "off-by-one": "an integer constant, a range's end, an index or a modulo moved by one",
    "call-removed": "a call statement removed (a .wait(), a .zero_(), an all-reduce, a send), a raise removed, or "
                    "a call inside an expression dropped to its receiver (x.clone() → x)",
    "arguments-swapped": "two adjacent positional arguments of a call swapped",
    "rank-constant": "dist.get_world_size() → 2, dist.get_rank() → 0",
    "min-max": "min and max swapped (builtins, tensor methods, torch.minimum/maximum, amin/amax, ReduceOp)",
    "sum-mean": "sum and mean swapped (tensor methods, torch.sum/mean)",
    "guard-removed": "an if's condition replaced by True",
    "statements-swapped": "two adjacent statements swapped",
    # our own, from the labs' code
    "arithmetic": "+ and -, * and /, / and // swapped (// is lab 00's floor-division slip)",
    "reduce-op": "a collective's ReduceOp changed (MAX → SUM, SUM → MAX)",
    "group-dropped": "a collective's group= dropped: it runs on every rank, not the group",
    "out-of-place": "an in-place tensor method made out-of-place, its result dropped (x.add_(y) → x.add(y))",
    "logic": "and and or swapped, a not dropped",
}

_COMPARE_FLIP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
                 ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
_ARITHMETIC_FLIP = {ast.Add: [ast.Sub], ast.Sub: [ast.Add], ast.Mult: [ast.Div], ast.Div: [ast.Mult, ast.FloorDiv],
                    ast.FloorDiv: [ast.Div]}
_MIN_MAX = {"min": "max", "max": "min", "minimum": "maximum", "maximum": "minimum", "amin": "amax", "amax": "amin",
            "MIN": "MAX", "MAX": "MIN"}
_SUM_MEAN = {"sum": "mean", "mean": "sum"}
_DROPPED_IN_EXPRESSIONS = {"clone", "wait", "detach", "contiguous", "float", "item", "t"}
_IN_PLACE = {"add_", "sub_", "mul_", "div_", "neg_", "clamp_", "clamp_min_", "clamp_max_", "addcmul_", "addcdiv_",
             "lerp_", "sqrt_", "exp_", "pow_", "abs_"}


# ---------------------------------------------------------------- the reference answers, as a kernel holds them

@dataclass
class LabSource:
    """A solution notebook read for this tool: its code cells, where each exercise's answer is, and what each
    ``distlab.check`` call hands in."""

    lab: int
    path: Path
    cells: dict[int, str]  # code cell index → its Python (IPython lines blanked, so lines keep their numbers)
    needed: list[int]  # the code cells the checks need (grading/cells.py), in order
    answers: dict[str, int] = field(default_factory=dict)  # exercise → the cell holding its solution block
    check_args: dict[str, list[str]] = field(default_factory=dict)  # exercise → the expressions handed to check

    def filename(self, cell: int) -> str:
        return f"<{self.path.name} cell {cell}>"


def lab_source(lab: int, solutions: Path = REPO_ROOT / "solutions") -> LabSource:
    """Read ``solutions/NN_*.ipynb`` of lab ``lab``."""
    paths = sorted(solutions.glob(f"{lab:02d}_*.ipynb"))
    if not paths:
        raise FileNotFoundError(f"no solution notebook for lab {lab:02d} in {solutions}")
    notebook = nbformat.read(paths[0], as_version=4)
    cells = {i: "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in c.source.split("\n"))
             for i, c in enumerate(notebook.cells) if c.cell_type == "code"}
    source = LabSource(lab, paths[0], cells, sorted(cells_checks_need(notebook)))
    for i, text in cells.items():
        for match in SOLUTION_BLOCK.finditer(text):
            source.answers.setdefault(match["id"], i)
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Call) and ast.unparse(node.func) == "distlab.check" and node.args
                    and isinstance(node.args[0], ast.Constant) and not str(node.args[0].value).startswith("Q")):
                source.check_args[str(node.args[0].value)] = [ast.unparse(a) for a in node.args[1:]]
    missing = sorted(set(source.answers) - set(source.check_args))
    if missing:
        raise ValueError(f"{paths[0].name}: exercises {missing} have a solution block but no distlab.check call")
    return source


def _is_demo(node: ast.stmt) -> bool:
    """A statement the checks never need: a bare expression (a print, a plot, a check), a loop, a
    ``with distlab.needs(...)`` block, or an assignment of a check's result."""
    if isinstance(node, ast.Expr | ast.For | ast.While | ast.With | ast.If | ast.Try):
        return True
    return any(isinstance(n, ast.Call) and ast.unparse(n.func) in ("distlab.check", "distlab.needs")
               for n in ast.walk(node))


def _run_statements(source_text: str, filename: str, statements: list[ast.stmt], namespace: dict) -> list[str]:
    """Execute ``statements`` (nodes of ``source_text``) one by one with their own line numbers, the cell's text in
    linecache so a traceback shows the line; return the errors of those that failed (skipped, the rest run)."""
    lines = source_text.splitlines(keepends=True)
    linecache.cache[filename] = (len(source_text), None, lines, filename)
    errors = []
    for node in statements:
        try:
            exec(compile(ast.Module([node], []), filename, "exec"), namespace)  # noqa: S102  the course's own code
        except Exception as error:  # noqa: BLE001  a demo's assignment that needs a skipped cell: left out
            errors.append(f"{filename} line {node.lineno}: {type(error).__name__}: {error}")
    return errors


def reference_namespace(source: LabSource) -> tuple[dict, list[str]]:
    """The globals a student's kernel holds when the checks run, with the solution's answers: of every cell the
    checks need, in order, its imports and each statement that binds a name the answers use (their functions and
    classes, the constants and helpers those read, and so on). Demos, loops, checks, ``needs`` blocks and
    assignments no answer reads (a demo's training run) are left out. Returns the namespace and the statements
    that failed (one that needs a demo's result)."""
    statements = [(i, node) for i in source.needed for node in ast.parse(source.cells[i]).body if not _is_demo(node)]
    wanted = {name for expressions in source.check_args.values() for expression in expressions
              for name in _names_read(ast.parse(expression, mode="eval"))}
    kept: set[int] = set()
    while True:
        more = [k for k, (_, node) in enumerate(statements) if k not in kept
                and (isinstance(node, ast.Import | ast.ImportFrom) or _names_bound(node) & wanted)]
        if not more:
            break
        kept.update(more)
        for k in more:
            wanted |= _names_read(statements[k][1])
    namespace: dict = {"__name__": f"lab{source.lab:02d}_notebook"}
    errors = []
    for k, (i, node) in enumerate(statements):
        if k in kept:
            errors += _run_statements(source.cells[i], source.filename(i), [node], namespace)
    return namespace, errors


def _names_bound(node: ast.stmt) -> set[str]:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {node.name}
    targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
    return {n.id for target in targets if target is not None for n in ast.walk(target) if isinstance(n, ast.Name)}


def _names_read(node: ast.AST) -> set[str]:
    """Every name ``node`` reads (locals too: an over-count only keeps a statement more)."""
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} | {
        n.value.id for n in ast.walk(node) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}


def _answer_statements(text: str, exercise: str) -> list[ast.stmt]:
    """The top-level statements of a cell that hold ``exercise``'s solution block (the def or class around it)."""
    lines = _block_lines(text, exercise)
    tree = ast.parse(text)
    return [node for node in tree.body
            if any(node.lineno <= line <= node.end_lineno for first, last in lines for line in (first, last))]


def _block_lines(text: str, exercise: str) -> list[tuple[int, int]]:
    """(first, last) line of each of ``exercise``'s solution blocks in a cell, markers excluded, 1-based."""
    spans = []
    for match in SOLUTION_BLOCK.finditer(text):
        if match["id"] == exercise:
            begin = text.count("\n", 0, match.start()) + 1
            end = text.count("\n", 0, match.start() + match.group(0).rfind("# END SOLUTION")) + 1
            if begin + 1 <= end - 1:
                spans.append((begin + 1, end - 1))
    return spans


# ---------------------------------------------------------------- mutants

@dataclass(frozen=True)
class Mutant:
    exercise: str
    operator: str
    line: int  # in the cell
    before: str
    after: str
    source: str  # the whole mutated cell

    @property
    def change(self) -> str:
        return f"{self.operator}: `{_short(self.before)}` → `{_short(self.after)}`"


def _short(text: str, limit: int = 70) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


class _Offsets:
    """Character offsets of AST positions (whose columns count UTF-8 bytes) in a cell's text."""

    def __init__(self, text: str):
        self.text = text
        self.lines = text.splitlines(keepends=True) or [""]
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))

    def at(self, line: int, col: int) -> int:
        return self.starts[line - 1] + len(self.lines[line - 1].encode()[:col].decode(errors="ignore"))

    def span(self, node: ast.AST) -> tuple[int, int]:
        return self.at(node.lineno, node.col_offset), self.at(node.end_lineno, node.end_col_offset)


def _replaced(node: ast.AST, **changes) -> str:
    """``node`` with some of its fields changed, as source."""
    copy = ast.parse(ast.unparse(node), mode="eval").body if isinstance(node, ast.expr) else None
    if copy is None:
        raise TypeError("only expressions are rewritten by unparsing")
    for name, value in changes.items():
        setattr(copy, name, value)
    return ast.unparse(copy)


def _edits(tree: ast.Module, inside: Callable[[ast.AST], bool], offsets: _Offsets) -> Iterator[tuple]:
    """(operator, node, start, end, replacement) for every mutation of a node inside the solution block."""
    text = offsets.text
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and not inside(node):
            yield from _statement_edits(node, inside, offsets, text)  # the block's own statements
            continue
        if not hasattr(node, "lineno") or not inside(node):
            continue
        start, end = offsets.span(node)
        if isinstance(node, ast.Compare):
            for k, op in enumerate(node.ops):
                if type(op) in _COMPARE_FLIP:
                    ops = list(node.ops)
                    ops[k] = _COMPARE_FLIP[type(op)]()
                    yield "compare", node, start, end, _replaced(node, ops=ops)
        elif isinstance(node, ast.BinOp):
            for new in _ARITHMETIC_FLIP.get(type(node.op), []):
                yield "arithmetic", node, start, end, _replaced(node, op=new())
            if isinstance(node.op, ast.Mod):
                for delta in ("+ 1", "- 1"):
                    yield "off-by-one", node, start, end, \
                        f"({ast.unparse(node.left)} {delta}) % {ast.unparse(node.right)}"
        elif isinstance(node, ast.AugAssign) and type(node.op) in (ast.Add, ast.Sub, ast.Mult, ast.Div):
            new = {ast.Add: "-=", ast.Sub: "+=", ast.Mult: "/=", ast.Div: "*="}[type(node.op)]
            yield "arithmetic", node, start, end, f"{ast.unparse(node.target)} {new} {ast.unparse(node.value)}"
        elif isinstance(node, ast.BoolOp):
            yield "logic", node, start, end, _replaced(node, op=ast.Or() if isinstance(node.op, ast.And) else ast.And())
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not | ast.USub):
            yield ("logic" if isinstance(node.op, ast.Not) else "arithmetic"), node, start, end, \
                f"({ast.unparse(node.operand)})"
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            for value in (node.value + 1, node.value - 1):
                yield "off-by-one", node, start, end, repr(value)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            yield from _index_edits(node, offsets)
        elif isinstance(node, ast.Call):
            yield from _call_edits(node, start, end)
        elif isinstance(node, ast.Attribute):
            if node.attr in _MIN_MAX:
                yield "min-max", node, start, end, f"{ast.unparse(node.value)}.{_MIN_MAX[node.attr]}"
            elif node.attr in _SUM_MEAN:
                yield "sum-mean", node, start, end, f"{ast.unparse(node.value)}.{_SUM_MEAN[node.attr]}"
        elif isinstance(node, ast.Name) and node.id in ("min", "max") and isinstance(node.ctx, ast.Load):
            yield "min-max", node, start, end, _MIN_MAX[node.id]
        elif isinstance(node, ast.If):
            test_start, test_end = offsets.span(node.test)
            yield "guard-removed", node, test_start, test_end, "True"
        elif isinstance(node, ast.Raise):
            yield "call-removed", node, start, end, "pass"
        if isinstance(node, ast.stmt) and hasattr(node, "body"):  # the function around the block too
            yield from _statement_edits(node, inside, offsets, text)
    # statements of the module itself are defs: nothing to swap at the top


def _index_edits(node: ast.Subscript, offsets: _Offsets) -> Iterator[tuple]:
    index = node.slice
    if isinstance(index, ast.Slice):
        for part in (index.lower, index.upper):
            if part is not None and not isinstance(part, ast.Constant):
                start, end = offsets.span(part)
                for delta in ("+ 1", "- 1"):
                    yield "off-by-one", part, start, end, f"({ast.unparse(part)}) {delta}"
    elif isinstance(index, ast.Name | ast.BinOp | ast.Attribute | ast.Call):
        start, end = offsets.span(index)
        for delta in ("+ 1", "- 1"):
            yield "off-by-one", index, start, end, f"({ast.unparse(index)}) {delta}"


def _call_edits(node: ast.Call, start: int, end: int) -> Iterator[tuple]:
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if name == "range" and node.args:
        stop = node.args[1] if len(node.args) > 1 else node.args[0]
        if not isinstance(stop, ast.Constant):
            for delta in (" + 1", " - 1"):
                args = list(node.args)
                args[args.index(stop)] = ast.parse(f"({ast.unparse(stop)}){delta}", mode="eval").body
                yield "off-by-one", node, start, end, _replaced(node, args=args)
    if name in ("get_world_size", "get_rank"):
        yield "rank-constant", node, start, end, "2" if name == "get_world_size" else "0"
    if isinstance(func, ast.Attribute) and name in _DROPPED_IN_EXPRESSIONS and not node.args and not node.keywords:
        yield "call-removed", node, start, end, ast.unparse(func.value)
    if isinstance(func, ast.Attribute) and name in _IN_PLACE:
        yield "out-of-place", node, start, end, _replaced(node, func=ast.Attribute(func.value, name[:-1], ast.Load()))
    positional = [a for a in node.args if not isinstance(a, ast.Starred)]
    if len(positional) == len(node.args):
        for k in range(len(node.args) - 1):
            args = list(node.args)
            args[k], args[k + 1] = args[k + 1], args[k]
            if ast.unparse(args[k]) != ast.unparse(args[k + 1]):
                yield "arguments-swapped", node, start, end, _replaced(node, args=args)
    for keyword in node.keywords:
        if keyword.arg == "group":
            yield "group-dropped", node, start, end, _replaced(node, keywords=[k for k in node.keywords
                                                                                 if k is not keyword])
        if keyword.arg == "op" and isinstance(keyword.value, ast.Attribute):
            new = "SUM" if keyword.value.attr != "SUM" else "MAX"
            op = ast.Attribute(keyword.value.value, new, ast.Load())
            yield "reduce-op", node, start, end, _replaced(node, keywords=[
                ast.keyword("op", op) if k is keyword else k for k in node.keywords])


def _statement_edits(node: ast.stmt, inside, offsets: _Offsets, text: str) -> Iterator[tuple]:
    """Edits of a body's statements: a call statement removed, two neighbours swapped."""
    for body in (getattr(node, "body", []), getattr(node, "orelse", []), getattr(node, "finalbody", [])):
        if not isinstance(body, list):
            continue
        for k, statement in enumerate(body):
            if not inside(statement):
                continue
            start, end = offsets.span(statement)
            if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call):
                yield "call-removed", statement, start, end, "pass"
            if k + 1 < len(body) and inside(body[k + 1]):
                after = body[k + 1]
                if any(isinstance(s, ast.FunctionDef | ast.ClassDef) for s in (statement, after)) or (
                        isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)):
                    continue
                a, b = (start, end), offsets.span(after)
                yield ("statements-swapped", statement, a[0], b[1],
                       text[b[0]:b[1]] + text[a[1]:b[0]] + text[a[0]:a[1]])


def mutants_of(text: str, exercise: str, limit: int | None = MAX_PER_EXERCISE) -> tuple[list[Mutant], int]:
    """The mutants of ``exercise``'s solution block in a cell's text (each compiles, no two alike), and how many
    there were before ``limit`` (every operator kept, the rest drawn with a seed fixed by the cell's text)."""
    blocks = _block_lines(text, exercise)
    if not blocks:
        raise ValueError(f"no solution block for exercise {exercise} in this cell")
    tree = ast.parse(text)
    offsets = _Offsets(text)

    def inside(node: ast.AST) -> bool:
        return any(first <= node.lineno and node.end_lineno <= last for first, last in blocks)

    found: dict[str, Mutant] = {}
    for operator, node, start, end, replacement in _edits(tree, inside, offsets):
        source = text[:start] + replacement + text[end:]
        if source == text or source in found:
            continue
        try:
            compile(source, "<mutant>", "exec")
        except SyntaxError:
            continue
        found[source] = Mutant(exercise, operator, node.lineno, text[start:end], replacement, source)
    every = list(found.values())
    if limit is None or len(every) <= limit:
        return every, len(every)
    rng = random.Random(hashlib.sha256(text.encode()).hexdigest())
    by_operator: dict[str, list[Mutant]] = {}
    for mutant in every:
        by_operator.setdefault(mutant.operator, []).append(mutant)
    chosen = [rng.choice(group) for group in by_operator.values()]
    rest = [m for m in every if m not in chosen]
    chosen += rng.sample(rest, max(0, limit - len(chosen)))
    return sorted(chosen, key=every.index), len(every)


def keys_of(mutants: list[Mutant]) -> list[str]:
    """Names that identify each mutant across runs: exercise and change, numbered when the same change occurs
    more than once (no line numbers, so an edit elsewhere in the cell keeps them)."""
    seen: dict[str, int] = {}
    keys = []
    for mutant in mutants:
        base = f"{mutant.exercise} {mutant.change}"
        seen[base] = seen.get(base, 0) + 1
        keys.append(base if seen[base] == 1 else f"{base} #{seen[base]}")
    return keys


# ---------------------------------------------------------------- classifying what the check said

_NUMBER = re.compile(r"[-+]?(?:\d[\d,_]*\.?\d*(?:e[-+]?\d+)?|\.\d+(?:e[-+]?\d+)?)", re.IGNORECASE)


# Words that make a clause advice rather than a report of numbers: what to do, or what went wrong.
_ADVICE = frozenset("""use return call pass divide multiply add skip wait launch keep check broadcast write take look
count put send receive compute split remove reduce subtract scale cut zero must instead forgot forget missing never
file follow walk close collapse strip join encode round exchange load store flush fold shift clamp apply give make
start order lost twice swapped wrong sign overflows rounds forwards divided summed multiplied added scaled""".split())


def classify(status: str, detail: str) -> str:
    """``specific``, ``vague`` or ``survived`` for a check's outcome on a mutant.

    A failure names where to look when it says more than numbers: after the last number it shows, at least two
    words ("…, expected 0.5): divide by the world size"; "…; use dist.get_rank()"), or a clause after the first (cut
    at ":" and ";") of three words or more with a word of advice in it (:data:`_ADVICE`: "Hint: each rank must send
    to (rank + 1) % N"); for an error raised by the student's code, when the slip is named
    (:func:`distlab.grading.contract.slip_of`). Only numbers ("expected 16 bytes/param, got 8"), or an exception's
    type, text and line, is vague. A heuristic, checked on examples in tests/test_mutants.py."""
    if status == "passed":
        return "survived"
    if status != "failed":
        return "vague"
    if detail.startswith("raised "):
        return "specific" if SLIP_SAID in detail or slip_of(detail) is not None else "vague"
    while (trailing := re.search(r"\s*\([^()]*\)\s*$", detail)) and not detail.startswith("("):
        detail = detail[:trailing.start()]  # the case, named in parentheses at the end, is no advice
    numbers = list(_NUMBER.finditer(detail))
    tail = detail[numbers[-1].end():] if numbers else detail
    if len(re.findall(r"[A-Za-z_][A-Za-z_.()']+", tail)) >= 2:
        return "specific"
    for clause in re.split(r"[:;]\s", detail)[1:]:
        words = [w.lower() for w in re.findall(r"[A-Za-z][A-Za-z']+", clause)]
        if len(words) >= 3 and _ADVICE & set(words):
            return "specific"
    return "vague"


# ---------------------------------------------------------------- running: one warm process per lab, a fork each

@dataclass
class Outcome:
    key: str
    operator: str
    line: int
    change: str
    kind: str  # specific | vague | survived | hung | equivalent
    seconds: float
    detail: str = ""
    status: str = ""  # the check's: passed, failed, hung


# The intra-op threads a check runs with: torch's default, given back to each forked check (:func:`check_threads`).
_CHECK_THREADS: list[int] = []


def prepare_forks(labs: list[int]) -> None:
    """Before forking a process per lab: import the labs' checkers here (what they ask the forkserver to preload
    counts only before it starts) and start distlab's forkserver, which every forked lab and mutant then shares.

    This process and the labs' run torch on one thread: GNU OpenMP's thread pool does not survive a fork (a child
    of a process that ran a parallel region waits forever at its first barrier), so only the forked checks, which
    fork nothing that computes, get torch's threads back (:func:`check_threads`)."""
    import importlib  # noqa: PLC0415  each lab's checker module, by its number

    import torch  # noqa: PLC0415  imported already by the grading modules

    _CHECK_THREADS[:] = [torch.get_num_threads()]
    torch.set_num_threads(1)
    for lab in labs:
        importlib.import_module(f"distlab.grading.lab{lab:02d}")
    from distlab.runtime.group import forkserver_context  # noqa: PLC0415  only forking checks needs it

    context = forkserver_context()
    if context.get_start_method() == "forkserver":
        probe = context.Process(target=os.getpid, name="distlab-mutants-probe")
        probe.start()
        probe.join()


def _in_child(write_fd: int, job: Callable[[], dict]) -> None:
    """The body of a forked child: run ``job`` quietly, write its JSON result as one line, end the ranks, exit."""
    try:
        os.setpgid(0, 0)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        from distlab.runtime.kernels import adopt_forkserver  # noqa: PLC0415  only a forked child needs it

        adopt_forkserver()  # ranks from the forkserver the tool's process started (its imports paid once)
        result = job()
    except BaseException as error:  # noqa: BLE001  the tool's own failure, reported, never a hang
        result = {"status": "tool error", "detail": f"{type(error).__name__}: {error}"}
    try:
        os.write(write_fd, (json.dumps(result) + "\n").encode())
        from distlab.runtime.launch import shutdown  # noqa: PLC0415  imported already; closes the child's ranks

        shutdown()
    finally:
        os._exit(0)


def in_fork(job: Callable[[], dict], limit: float) -> tuple[dict | None, float]:
    """``job()`` in a forked child within ``limit`` seconds: (its result, seconds), or (None, seconds) when it ran
    past the limit (the child and everything in its process group is killed; its ranks end with it)."""
    read_fd, write_fd = os.pipe()
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _in_child(write_fd, job)
    os.close(write_fd)
    data = b""
    deadline = started + limit
    try:
        while b"\n" not in data:
            left = None if limit == float("inf") else deadline - time.monotonic()
            if left is not None and left <= 0 or not select.select([read_fd], [], [], left)[0]:
                break
            chunk = os.read(read_fd, 1 << 16)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(read_fd)
    seconds = time.monotonic() - started
    if b"\n" not in data:
        _kill(pid)
    else:
        _reap(pid, grace=30.0)
    line = data.split(b"\n", 1)[0]
    if not line:
        return None if seconds >= limit else {"status": "crashed", "detail": "the check's process died"}, seconds
    return json.loads(line), seconds


def _kill(pid: int) -> None:
    for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            target()
        except (ProcessLookupError, PermissionError):
            pass
    os.waitpid(pid, 0)


def _reap(pid: int, grace: float) -> None:
    end = time.monotonic() + grace
    while time.monotonic() < end:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return
        time.sleep(0.05)
    _kill(pid)


def check_threads() -> None:
    """In a forked check: torch's intra-op threads back to its default (the forking processes run on one)."""
    import torch  # noqa: PLC0415  imported already

    if _CHECK_THREADS:
        torch.set_num_threads(_CHECK_THREADS[0])


def _check_job(source: LabSource, namespace: dict, exercise: str, text: str | None, seed: int | None):
    """What a child runs: redefine the exercise's answer from ``text`` (a mutated cell; None: the reference's),
    then its check, as ``distlab.check`` reports it."""
    def job() -> dict:
        import distlab  # noqa: PLC0415  imported by the lab's process before it forked

        check_threads()
        if seed is not None:
            os.environ[GRADE_SEED_VARIABLE] = str(seed)
        if text is not None:
            cell = source.answers[exercise]
            errors = _run_statements(text, source.filename(cell), _answer_statements(text, exercise), namespace)
            if errors:
                return {"status": "failed", "detail": f"raised while defining the answer: {errors[0]}"}
        args = [eval(expression, namespace) for expression in source.check_args[exercise]]  # noqa: S307
        result = distlab.check(exercise, *args, quiet=True)
        return {"status": result.status, "detail": result.detail}
    return job


def check_mutant(source: LabSource, namespace: dict, exercise: str, text: str, limit: float,
                 seed: int | None = None) -> tuple[str, str, float]:
    """Check ``exercise`` with its answer redefined from ``text`` (a mutated cell) in a forked child within
    ``limit`` seconds: (kind, the check's detail, seconds), kind as :func:`classify` says, or "hung"."""
    result, seconds = in_fork(_check_job(source, namespace, exercise, text, seed), limit)
    if result is None:
        return "hung", "", seconds
    kind = "vague" if result["status"] in ("tool error", "crashed") else classify(result["status"], result["detail"])
    return kind, result["detail"], seconds


def fingerprint(source: LabSource, exercise: str) -> str:
    """What an exercise's results depend on most: its cell, its lab's checker module and this tool's version (a
    change to the shared harness is not counted: it would mark every exercise of every lab for a rerun)."""
    grading = Path(__file__).resolve().parent / "grading"
    parts = [TOOL_VERSION, source.cells[source.answers[exercise]],
             checker_code((grading / f"lab{source.lab:02d}.py").read_text(encoding="utf-8"))]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def checker_code(text: str) -> str:
    """A checker module as far as it decides outcomes: its syntax tree without docstrings, its ``EDGES`` and
    ``EQUIVALENT_MUTANTS`` tables (and the lists of ``Edge`` they are built from), its ``case_drawn(...)``
    records (each one statement) and the import of
    ``Edge`` and ``case_drawn``, which change no check's outcome: declaring a lab's edges, or its triage, does
    not mark its results for a rerun."""
    class Strip(ast.NodeTransformer):
        def visit_Assign(self, node):
            names = {getattr(target, "id", "") for target in node.targets}
            edges = any(isinstance(n, ast.Call) and getattr(n.func, "id", "") == "Edge" for n in ast.walk(node.value))
            return None if edges or names & {"EDGES", "EQUIVALENT_MUTANTS"} else node

        def visit_ImportFrom(self, node):
            node.names = [alias for alias in node.names if alias.name not in ("Edge", "case_drawn")]
            return node if node.names else None

        def visit_Expr(self, node):
            value = node.value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                return None  # a docstring
            if isinstance(value, ast.Call) and getattr(value.func, "id", "") in ("case_drawn", "_drawn"):
                return None
            return node

        def generic_visit(self, node):
            super().generic_visit(node)
            for name in ("body", "orelse", "finalbody"):
                if isinstance(getattr(node, name, None), list) and not getattr(node, name) and name == "body":
                    setattr(node, name, [ast.Pass()])
            return node

    return ast.dump(Strip().visit(ast.parse(text)))


def equivalents(lab: int) -> dict[str, str]:
    """The lab's triaged equivalent mutants (``EQUIVALENT_MUTANTS`` in its checker module): key → why."""
    import importlib  # noqa: PLC0415  the lab's checker module, by its number

    module = importlib.import_module(f"distlab.grading.lab{lab:02d}")
    return dict(getattr(module, "EQUIVALENT_MUTANTS", {}))


def run_lab(lab: int, results: dict, save: Callable[[], None], exercises: list[str] | None = None,
            limit_per_exercise: int | None = MAX_PER_EXERCISE, seed: int | None = None,
            log: Callable[[str], None] = print) -> None:
    """Every mutant of lab ``lab``'s exercises (or only ``exercises``), each checked in a fork of this process,
    into ``results["exercises"]``; ``save()`` after every mutant. Exercises whose fingerprint matches a finished
    entry are skipped; an unfinished one resumes after its last mutant. Call in a process of its own (it
    imports the lab and executes its notebook's definitions)."""
    source = lab_source(lab)
    namespace, errors = reference_namespace(source)
    for error in errors:
        log(f"  lab {lab:02d}: left out {error}")
    from distlab.runtime.launch import shutdown  # noqa: PLC0415  the namespace may have started ranks

    shutdown()
    for exercise in sorted(source.answers, key=lambda e: int(e.split(".")[1])):
        if exercises and exercise not in exercises:
            continue
        print_ = fingerprint(source, exercise)
        entry = results["exercises"].get(exercise)
        if entry and entry.get("fingerprint") == print_ and entry.get("finished"):
            log(f"  {exercise}: done before (fingerprint {print_}), skipped")
            continue
        if not entry or entry.get("fingerprint") != print_:
            entry = {"fingerprint": print_, "finished": False, "outcomes": {}}
            results["exercises"][exercise] = entry
        text = source.cells[source.answers[exercise]]
        reference, seconds = in_fork(_check_job(source, namespace, exercise, None, seed), REFERENCE_LIMIT)
        entry["reference"] = {"status": reference["status"] if reference else "hung",
                              "detail": reference["detail"] if reference else "", "seconds": round(seconds, 2)}
        if not reference or reference["status"] != "passed":
            log(f"  {exercise}: the reference does not pass ({entry['reference']}); no mutants run")
            entry["finished"] = True
            save()
            continue
        limit = max(MIN_LIMIT, LIMIT_FACTOR * seconds)
        mutants, generated = mutants_of(text, exercise, limit_per_exercise)
        entry["generated"] = generated
        keys = keys_of(mutants)
        log(f"  {exercise}: reference passed in {seconds:.1f} s; {len(mutants)} of {generated} mutants, "
            f"limit {limit:.0f} s each")
        for key, mutant in zip(keys, mutants):
            if key in entry["outcomes"]:
                continue
            kind, detail, took = check_mutant(source, namespace, exercise, mutant.source, limit, seed)
            status = "passed" if kind == "survived" else kind if kind == "hung" else "failed"
            entry["outcomes"][key] = asdict(Outcome(key, mutant.operator, mutant.line, mutant.change, kind,
                                                    round(took, 2), detail[:1000], status))
            save()
        entry["finished"] = True
        save()


# ---------------------------------------------------------------- results and the report

def load_results(path: Path = RESULTS) -> dict:
    if path.exists():
        return json.loads(path.read_text(encoding="utf-8"))
    return {"exercises": {}}


def save_results(results: dict, path: Path = RESULTS) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(temporary, path)


KINDS = ("specific", "vague", "survived", "equivalent", "hung")


def _sort_key(exercise: str) -> tuple[int, int]:
    lab, k = exercise.split(".")
    return int(lab), int(k)


def kind_of(outcome: dict, known: dict[str, str]) -> str:
    """An outcome's kind as this tool classifies it now: from the check's status and message (so a better
    classification reads old results anew), "equivalent" for a survivor the lab lists."""
    status = outcome.get("status") or {"survived": "passed", "equivalent": "passed", "hung": "hung"}.get(
        outcome["kind"], "failed")
    if status == "hung":
        return "hung"
    if outcome["kind"] == "vague" and not outcome["detail"]:
        return "vague"  # the tool's own error or a crashed check: no message to read
    kind = classify(status, outcome["detail"])
    return "equivalent" if kind == "survived" and outcome["key"] in known else kind


def summary(results: dict) -> dict[str, dict[str, int]]:
    """Per exercise: mutants run and how many of each kind."""
    table = {}
    known = {}
    for exercise, entry in sorted(results["exercises"].items(), key=lambda item: _sort_key(item[0])):
        lab = int(exercise.split(".")[0])
        known.setdefault(lab, equivalents(lab))
        counts = {kind: 0 for kind in KINDS}
        for outcome in entry.get("outcomes", {}).values():
            outcome["kind"] = kind_of(outcome, known[lab])
            counts[outcome["kind"]] += 1
        counts["run"] = sum(counts[kind] for kind in KINDS)
        counts["generated"] = entry.get("generated", 0)
        table[exercise] = counts
    return table


def _rates(counts: dict[str, int]) -> str:
    live = counts["run"] - counts["equivalent"]
    killed = counts["specific"] + counts["vague"]
    if not live:
        return "   -      -"
    return f"{100 * killed / live:5.1f}% {100 * counts['specific'] / live:5.1f}%"


def write_report(results: dict, path: Path = REPORT, stale: set[str] = frozenset()) -> str:
    """``mutants.txt``: per exercise and per lab the counts, overall rates, then each lab's survivors, hung and
    vague mutants; ``stale``: exercises whose cell or checker changed since their results (to rerun)."""
    table = summary(results)
    header = (f"{'exercise':<9} {'generated':>9} {'run':>4} {'specific':>8} {'vague':>5} {'survived':>8} "
              f"{'equiv':>5} {'hung':>4}   killed specific (of non-equivalent)")
    lines = ["Mutation testing of the checkers (distlab notebooks mutants; lib/distlab/mutants.py).",
             "Each mutant is the reference solution with one change (operators below), checked in its own process.",
             "specific: failed naming where to look; vague: only numbers or a raw exception; survived: passed;",
             "equiv: survived, listed as equivalent in the lab's EQUIVALENT_MUTANTS with its reason; hung: past "
             "the time limit.", "", "Operators:"]
    lines += [f"  {name}: {what}" for name, what in OPERATORS.items()]
    meta = results.get("meta", {})
    if meta:
        lines += ["", "Run: " + ", ".join(f"{k} {v}" for k, v in meta.items())]
    lines += ["", header]
    totals = {kind: 0 for kind in (*KINDS, "run", "generated")}
    labs: dict[int, dict[str, int]] = {}
    for exercise, counts in table.items():
        mark = " (stale: rerun)" if exercise in stale else ""
        reference = results["exercises"][exercise].get("reference", {})
        if reference.get("status") != "passed":
            lines.append(f"{exercise:<9} reference did not pass: {reference.get('status')} "
                         f"{_short(reference.get('detail', ''), 90)}{mark}")
            continue
        lines.append(f"{exercise:<9} {counts['generated']:>9} {counts['run']:>4} {counts['specific']:>8} "
                     f"{counts['vague']:>5} {counts['survived']:>8} {counts['equivalent']:>5} {counts['hung']:>4}   "
                     f"{_rates(counts)}{mark}")
        lab = labs.setdefault(int(exercise.split(".")[0]), {kind: 0 for kind in totals})
        for kind in totals:
            lab[kind] += counts[kind]
            totals[kind] += counts[kind]
    lines += ["", "Per lab:", header.replace("exercise", "lab     ")]
    for lab, counts in sorted(labs.items()):
        lines.append(f"{lab:02d}        {counts['generated']:>9} {counts['run']:>4} {counts['specific']:>8} "
                     f"{counts['vague']:>5} {counts['survived']:>8} {counts['equivalent']:>5} {counts['hung']:>4}   "
                     f"{_rates(counts)}")
    lines.append(f"all       {totals['generated']:>9} {totals['run']:>4} {totals['specific']:>8} "
                 f"{totals['vague']:>5} {totals['survived']:>8} {totals['equivalent']:>5} {totals['hung']:>4}   "
                 f"{_rates(totals)}")
    for lab in sorted(labs):
        known = equivalents(lab)
        details = []
        for exercise, entry in sorted(results["exercises"].items(), key=lambda item: _sort_key(item[0])):
            if int(exercise.split(".")[0]) != lab:
                continue
            for outcome in entry.get("outcomes", {}).values():
                kind = outcome["kind"]
                if kind == "equivalent":
                    details.append(f"  equivalent  {outcome['key']} (cell line {outcome['line']}): "
                                   f"{known.get(outcome['key'], 'listed')}")
                elif kind in ("survived", "hung"):
                    details.append(f"  {kind:<11} {outcome['key']} (cell line {outcome['line']})")
                elif kind == "vague":
                    details.append(f"  vague       {outcome['key']} (cell line {outcome['line']}): "
                                   f"{_short(outcome['detail'], 160)}")
        if details:
            lines += ["", f"Lab {lab:02d}:"] + details
    text = "\n".join(lines) + "\n"
    path.write_text(text, encoding="utf-8")
    return text


def stale_exercises(results: dict) -> set[str]:
    """Exercises whose recorded fingerprint no longer matches the code: their results are out of date."""
    stale = set()
    by_lab: dict[int, list[str]] = {}
    for exercise in results["exercises"]:
        by_lab.setdefault(int(exercise.split(".")[0]), []).append(exercise)
    for lab, exercises in by_lab.items():
        source = lab_source(lab)
        for exercise in exercises:
            if exercise not in source.answers or \
                    results["exercises"][exercise].get("fingerprint") != fingerprint(source, exercise):
                stale.add(exercise)
    return stale


def main_loop(labs: list[int], exercises: list[str] | None = None, results_path: Path = RESULTS,
              report_path: Path = REPORT, limit_per_exercise: int | None = MAX_PER_EXERCISE,
              seed: int | None = None, fresh: bool = False, log: Callable[[str], None] = print) -> str:
    """Run the mutants of ``labs`` (each in a forked process of its own, resuming from ``results_path``), then
    write the report; return its text."""
    prepare_forks(labs)
    log_fd = os.dup(1)  # the tool's log, for the forked labs, whose own stdout is silenced for the student's code
    results = load_results(results_path)
    if fresh:
        results["exercises"] = {e: entry for e, entry in results["exercises"].items()
                                if int(e.split(".")[0]) not in labs}
        save_results(results, results_path)
    for lab in labs:
        started = time.monotonic()
        log(f"lab {lab:02d}:")

        def lab_job(lab=lab) -> dict:
            run_lab(lab, results, lambda: save_results(results, results_path), exercises, limit_per_exercise,
                    seed, log=lambda line: os.write(log_fd, (line + "\n").encode()))
            return {"status": "done", "detail": ""}

        result, _ = in_fork(lab_job, float("inf"))
        results = load_results(results_path)
        log(f"lab {lab:02d}: {result['status'] if result else 'stopped'} in {time.monotonic() - started:.0f} s")
    results.setdefault("meta", {}).update(
        cores=os.cpu_count(), load=f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "n/a",
        python=sys.version.split()[0], limit_per_exercise=limit_per_exercise,
        seed=seed if seed is not None else "self-study (lab_seed)")
    save_results(results, results_path)
    return write_report(results, report_path, stale_exercises(results))

