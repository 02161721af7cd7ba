"""Which cells of a notebook its checks need, so ``distlab grade`` runs only those.

A lab's demos, timings and benchmark plots teach; no check depends on them, and they are most of a lab's
running time (lab 03's solution runs for minutes, its checks for seconds). The solution marks each such cell
with the tag ``grader-skips`` (nbgrader-style cell metadata, copied into the generated lab), written by
``distlab notebooks tag`` from :func:`cells_checks_need` and kept current by a test.

A tag alone is not trusted at grading time: a student may have put a helper their answer uses into a demo
cell, or a later cell of theirs may read a demo's result. So the grader skips a tagged cell only when the
same analysis, run on the student's notebook as it is, finds that no kept cell needs it.

The analysis is by names, with Python's own :mod:`symtable`: a cell is needed when it holds a check
(``distlab.check``), an exercise's code or a quiz answer, is the notebook's last cell (it closes the ranks),
or binds at module level a name that a needed cell reads: as it runs (from cells above it), or inside its
functions and classes (from any cell, since they run when a check calls them).
"""

from __future__ import annotations

import symtable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only, for the reason distlab.runtime.kernels gives
    import nbformat

__all__ = ["SKIP_TAG", "cells_checks_need", "cells_to_skip", "skippable_cells", "python_source"]

SKIP_TAG = "grader-skips"
_ESSENTIAL = ("distlab.check", "# BEGIN SOLUTION", "# SOLUTION Q")


def python_source(source: str) -> str:
    """A cell's Python: its IPython lines (``%magic``, ``!shell``) dropped, so ``ast``/``symtable`` can read it."""
    return "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))


def _names(source: str) -> tuple[set[str], set[str], set[str]]:
    """(names a cell binds at module level, globals it reads as it runs, globals its functions and classes read
    when they are called later); a cell that does not parse binds and reads nothing."""
    try:
        top = symtable.symtable(python_source(source), "cell", "exec")
    except SyntaxError:
        return set(), set(), set()
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    now = {s.get_name() for s in top.get_symbols() if s.is_referenced()}
    later: set[str] = set()
    tables = list(top.get_children())
    while tables:
        table = tables.pop()
        later |= {s.get_name() for s in table.get_symbols() if s.is_global() and s.is_referenced()}
        tables.extend(table.get_children())
    return bound, now, later


def cells_checks_need(notebook: nbformat.NotebookNode) -> set[int]:
    """Indices of the code cells the notebook's checks and answers need (see the module's docstring).

    A name a cell reads as it runs needs the cells before it that bind it; a name its functions read needs every
    cell that binds it, before or after: the function reads it when a check calls it, further down."""
    code = [(i, c.source) for i, c in enumerate(notebook.cells) if c.cell_type == "code"]
    if not code:
        return set()
    names = {i: _names(source) for i, source in code}
    needed = {i for i, source in code if any(marker in source for marker in _ESSENTIAL)} | {code[-1][0]}
    pending = sorted(needed)
    while pending:
        reader = pending.pop()
        _, now, later = names[reader]
        for i, _ in code:
            if i not in needed and (i < reader and names[i][0] & now or names[i][0] & later):
                needed.add(i)
                pending.append(i)
    return needed


def skippable_cells(notebook: nbformat.NotebookNode) -> list[int]:
    """Code cells no check needs: what a solution tags ``grader-skips``."""
    needed = cells_checks_need(notebook)
    return [i for i, c in enumerate(notebook.cells) if c.cell_type == "code" and i not in needed]


def cells_to_skip(notebook: nbformat.NotebookNode) -> set[int]:
    """Cells the grader leaves out of this notebook: tagged ``grader-skips`` and, in the notebook as it is,
    needed by no check."""
    tagged = {i for i, c in enumerate(notebook.cells)
              if c.cell_type == "code" and SKIP_TAG in c.get("metadata", {}).get("tags", [])}
    return tagged - cells_checks_need(notebook) if tagged else set()
