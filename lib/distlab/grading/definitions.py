"""What ``distlab grade`` reads from a student's notebook, by its syntax tree: each exercise's check line, and the
statements its code needs (the functions and classes the check names, the imports and helpers they use).

The grader runs the notebook for its outputs, then grades each exercise in a process the notebook's top-level
code never ran in (:mod:`distlab.grading.isolation`). That process is given, as text, only what the exercise's
check line hands the checker: ``distlab.check("2.1", ring_all_reduce)`` names ``ring_all_reduce``, so its
definition, and every top-level statement that binds (or mutates) a global name the definition reads, transitively,
in the cells that ran before the check line. The student's code is executed only where the grader cannot be
reached from it (the sandbox and the ranks); the grading process itself only parses it.

Reading is by names, with Python's own :mod:`symtable` (as :mod:`distlab.grading.cells` reads which cells a check
needs), on the cell as IPython runs it (``%magic`` lines and ``%%cell`` magics become the calls IPython makes, so a
``%%ranks`` cell binds nothing in the kernel). A check line is a call of ``distlab.check`` (or ``check`` imported
from distlab) with a literal id, at the top level of a cell or inside a top-level block; the latest one that ran
counts, as the kernel's ledger kept the latest result. A quiz question's answer is read from the kernel after the
last cell (:func:`quiz_expressions`): the expression its check line hands over, or the variable ``qL_K`` the
lab's quiz cells bind for question ``QL.K``.
"""

from __future__ import annotations

import ast
import hashlib
import symtable
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from distlab.grading.harness import stub_message

if TYPE_CHECKING:  # annotations only, for the reason distlab.runtime.kernels gives
    import nbformat

__all__ = ["Definitions", "CheckLine", "check_lines", "quiz_expressions", "answer_variable", "cell_filename"]


def cell_filename(cell: int) -> str:
    """The file name the student's code is compiled under: what a traceback and a failure line name."""
    return f"<notebook cell {cell}>"


@lru_cache(maxsize=4096)
def _python(source: str) -> str:
    """A cell as IPython executes it: magics turned into ``get_ipython()`` calls, lines kept where they were."""
    from IPython.core.inputtransformer2 import TransformerManager  # noqa: PLC0415  heavy, only grading reads cells

    try:
        return TransformerManager().transform_cell(source)
    except Exception:  # noqa: BLE001  what IPython cannot read, the kernel could not run either
        return source


@dataclass(frozen=True)
class Definitions:
    """The statements an exercise's code needs, in notebook order: per cell, its source (as IPython runs it) and
    the first lines of the top-level statements to execute. Plain data: it travels to the sandbox and the ranks
    as text, and is executed only there."""

    cells: tuple[tuple[int, str, tuple[int, ...]], ...]  # (cell index, source, first lines of its chosen statements)

    def digest(self) -> str:
        return hashlib.sha256(repr(self.cells).encode()).hexdigest()[:16]

    def to_json(self) -> list:
        return [[cell, source, list(lines)] for cell, source, lines in self.cells]

    @classmethod
    def from_json(cls, data: list) -> Definitions:
        return cls(tuple((int(cell), str(source), tuple(int(line) for line in lines)) for cell, source, lines in data))

    def statements(self) -> list[tuple[int, ast.stmt]]:
        """The chosen statements, parsed (never executed): (cell, statement), in order."""
        found = []
        for cell, source, lines in self.cells:
            wanted = set(lines)
            found += [(cell, node) for node in ast.parse(source).body if node.lineno in wanted]
        return found

    def stub_messages(self, name: str) -> list[str]:
        """The stub messages of ``name``'s last definition here: the function itself, or each method of a class,
        that is still exactly the lab's ``raise NotImplementedError("Exercise …")``."""
        last = None
        for _, node in self.statements():
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                last = node
        if last is None:
            return []
        functions = [last] if not isinstance(last, ast.ClassDef) else [
            n for n in last.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        return [message for message in map(stub_message, functions) if message]


@dataclass(frozen=True)
class CheckLine:
    """One check line that ran: the exercise it checks, the cell, the expressions it hands the checker (source
    text) and what they need."""

    exercise_id: str
    cell: int
    expressions: tuple[str, ...]
    definitions: Definitions


# ---------------------------------------------------------------- reading names


def _bound_and_read(node: ast.stmt) -> tuple[frozenset, frozenset]:
    """(names a top-level statement binds at module level, global names it reads, now or when its functions run)."""
    try:
        top = symtable.symtable(ast.unparse(ast.Module(body=[node], type_ignores=[])), "cell", "exec")
    except (SyntaxError, ValueError, RecursionError):
        return frozenset(), frozenset()
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    read = {s.get_name() for s in top.get_symbols() if s.is_referenced()}
    tables = list(top.get_children())
    while tables:
        table = tables.pop()
        read |= {s.get_name() for s in table.get_symbols() if s.is_global() and s.is_referenced()}
        bound |= {s.get_name() for s in table.get_symbols() if s.is_declared_global() and s.is_assigned()}
        tables.extend(table.get_children())
    return frozenset(bound), frozenset(read)


def _mutated(node: ast.stmt) -> frozenset:
    """Global names a statement changes without binding them: ``table[k] = v``, ``obj.x += 1``, ``items.append(v)``."""
    def root(target):
        while isinstance(target, (ast.Subscript, ast.Attribute)):
            target = target.value
        return target.id if isinstance(target, ast.Name) else None

    targets = []
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif isinstance(node, ast.Delete):
        targets = node.targets
    elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute):
        targets = [node.value.func]
    names = {root(t) for t in targets if isinstance(t, (ast.Subscript, ast.Attribute))}
    return frozenset(n for n in names if n)


def _distlab_aliases(node: ast.stmt, aliases: dict[str, str]) -> None:
    """Record names an import binds to distlab's check (``check``) or to a module that has it (``distlab``)."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name in ("distlab", "distlab.grading"):
                aliases[alias.asname or alias.name.split(".")[0]] = "module"
    elif isinstance(node, ast.ImportFrom) and node.module in ("distlab", "distlab.grading"):
        for alias in node.names:
            if alias.name == "check":
                aliases[alias.asname or "check"] = "check"
            elif alias.name == "grading":
                aliases[alias.asname or "grading"] = "module"


def _check_call(node: ast.AST, aliases: dict[str, str]) -> tuple[str, tuple[str, ...]] | None:
    """(exercise id, argument sources) when ``node`` is a check call with a literal id, else None."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    func = node.func
    if isinstance(func, ast.Name):
        is_check = aliases.get(func.id) == "check"
    elif isinstance(func, ast.Attribute) and func.attr == "check":
        base = func.value
        while isinstance(base, ast.Attribute):
            base = base.value
        is_check = isinstance(base, ast.Name) and aliases.get(base.id) == "module"
    else:
        is_check = False
    first = node.args[0]
    if not is_check or not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
        return None
    if any(isinstance(a, ast.Starred) for a in node.args[1:]):
        return None
    return first.value, tuple(ast.unparse(a) for a in node.args[1:])


def _calls_in(node: ast.stmt):
    """Calls a top-level statement makes as it runs: not those in its functions, classes and lambdas."""
    pending = [] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else [node]
    while pending:
        current = pending.pop()
        if isinstance(current, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(current, ast.Call):
            yield current
        pending.extend(ast.iter_child_nodes(current))


# ---------------------------------------------------------------- the notebook, read


def _statements(notebook: nbformat.NotebookNode, ran: set[int]) -> list[tuple[int, str, ast.stmt]]:
    """Top-level statements of the code cells that ran, in order: (cell, its source as run, statement)."""
    found = []
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "code" or index not in ran:
            continue
        source = _python(cell.source)
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue  # the kernel raised SyntaxError and ran none of it
        found += [(index, source, node) for node in tree.body]
    return found


def _needs(expressions: tuple[str, ...], before: list[tuple[int, str, ast.stmt]],
           names: list[tuple[frozenset, frozenset]], mutations: list[frozenset]) -> Definitions:
    """The statements of ``before`` that the expressions need (the module's docstring), as :class:`Definitions`;
    ``names`` and ``mutations`` are each statement's (:func:`_bound_and_read`, :func:`_mutated`)."""
    wanted: set[str] = set()
    for expression in expressions:
        try:
            wanted |= _bound_and_read(ast.parse(expression).body[0])[1]
        except (SyntaxError, IndexError):
            continue
    chosen = {i for i, (_, _, node) in enumerate(before) if isinstance(node, ast.ImportFrom)
              and any(alias.name == "*" for alias in node.names)}
    # Data the notebook built (a table, a config) can be changed in place; a module cannot, as far as this reads:
    # ``distlab.claim(...)`` or ``torch.manual_seed(...)`` is a call, not a change to the name.
    data = {name for i, (_, _, node) in enumerate(before) if not isinstance(node, (ast.Import, ast.ImportFrom))
            for name in names[i][0]}
    checks = {i for i, (_, _, node) in enumerate(before) if _is_check_line(node)}
    pending = list(wanted)
    seen = set(pending)
    while pending:
        name = pending.pop()
        for i in range(len(before)):
            (bound, read), changed = names[i], mutations[i]
            if i in chosen or i in checks or (name not in bound and (name not in changed or name not in data)):
                continue
            chosen.add(i)
            for more in read - seen:
                seen.add(more)
                pending.append(more)
    cells: dict[int, tuple[str, list[int]]] = {}
    for i in sorted(chosen):
        cell, source, node = before[i]
        cells.setdefault(cell, (source, []))[1].append(node.lineno)
    return Definitions(tuple((cell, source, tuple(lines)) for cell, (source, lines) in cells.items()))


def _is_check_line(node: ast.stmt) -> bool:
    """A statement whose calls include ``….check("…", …)``: it binds only a check's result, which no exercise's
    code needs, and executing it would run a check."""
    return any(isinstance(call.func, (ast.Attribute, ast.Name)) and getattr(call.func, "attr", getattr(
        call.func, "id", None)) == "check" and call.args and isinstance(call.args[0], ast.Constant)
        for call in _calls_in(node))


def check_lines(notebook: nbformat.NotebookNode, ran: set[int]) -> dict[str, CheckLine]:
    """The latest check line of each exercise among the cells that ran, with what its code needs (a quiz question's
    line needs nothing: its answer is read from the kernel, :func:`quiz_expressions`)."""
    statements = _statements(notebook, ran)
    names = [_bound_and_read(node) for _, _, node in statements]
    mutations = [_mutated(node) for _, _, node in statements]
    aliases: dict[str, str] = {}
    found: dict[str, CheckLine] = {}
    for position, (cell, _, node) in enumerate(statements):
        _distlab_aliases(node, aliases)
        for call in _calls_in(node):
            checked = _check_call(call, aliases)
            if checked is None:
                continue
            exercise_id, expressions = checked
            needed = Definitions(()) if exercise_id.startswith("Q") else _needs(
                expressions, statements[:position], names[:position], mutations[:position])
            found[exercise_id] = CheckLine(exercise_id, cell, expressions, needed)
    return found


def answer_variable(question_id: str) -> str:
    """The variable a lab's quiz cell binds for question ``QL.K``: ``qL_K``."""
    return "q" + question_id[1:].replace(".", "_")


def quiz_expressions(notebook: nbformat.NotebookNode, ran: set[int], question_ids) -> dict[str, str]:
    """For each question, what the grader asks the kernel for after the last cell: the expression of its latest
    check line that ran (``distlab.check("Q0.2", q0_2)`` hands over ``q0_2``), or else the variable the lab's quiz
    cell binds (:func:`answer_variable`), which a loop over the answers (``for q, a in ...: distlab.check(q, a)``)
    also checks."""
    lines = check_lines(notebook, ran)
    found = {}
    for question in question_ids:
        line = lines.get(question)
        found[question] = line.expressions[0] if line is not None and len(line.expressions) == 1 else \
            answer_variable(question)
    return found
