"""The rank side of the ``%%ranks`` cell magic: each rank runs a cell's source in names it keeps between cells.

A warm rank (:class:`~distlab.runtime.launch.Ranks`) is a process that outlives its jobs, so a module-level
dict here is a namespace that lives as long as the rank: what one ``%%ranks`` cell defines, the next one
uses, as in a Python prompt per rank. A cell travels as a job like any other (:func:`run_cell`, sent by
reference with its source as an argument), so everything the launcher does for jobs holds for cells: the
watchdog, the failure reports with the user's line, the ledger of sends and collectives, the cleanup.

Each cell starts from the process settings every job starts from (the same torch seed, default dtype, grad
mode, environment: :class:`~distlab.runtime.rank.ProcessState`): names persist across cells, settings do
not, so a cell prints the same numbers however many cells ran before it (nbval re-runs them in order, a
learner re-runs one out of order). Seed or set what a cell needs inside the cell.

This module runs inside ranks and imports no IPython; the notebook side is :mod:`~distlab.runtime.magic`.
"""

from __future__ import annotations

import ast
import builtins

import torch
import torch.distributed as dist

from distlab.runtime.rank import device

_names: dict | None = None  # this rank's namespace, created by its first cell


def _starting_names() -> dict:
    """What a rank's first cell finds defined: what nearly every cell on ranks needs."""
    return {"__name__": "__main__", "__builtins__": builtins, "torch": torch, "dist": dist,
            "rank": dist.get_rank(), "world_size": dist.get_world_size(), "device": device}


def namespace() -> dict:
    """This rank's names: ``torch``, ``dist``, ``rank``, ``world_size`` and ``device`` to start with."""
    global _names
    if _names is None:
        _names = _starting_names()
    return _names


def run_cell(source: str, filename: str, run_on: tuple[int, ...] | None = None, gather: str | None = None):
    """Run ``source`` in this rank's namespace; return the names its cells defined and the value of ``gather``.

    ``filename`` is the name the notebook cached the cell under, so that tracebacks, stack dumps of a blocked
    rank and the ``issued at`` line of every op point at the cell's own lines. A cell ending in an expression
    prints its value's ``repr`` (nothing for None), as a prompt would. Ranks outside ``run_on`` do nothing
    and return None.
    """
    if run_on is not None and dist.get_rank() not in run_on:
        return None
    names = namespace()
    tree = ast.parse(source, filename)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, filename, "exec"), names)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), filename, "eval"), names)
        if value is not None:
            print(repr(value))
    if gather is not None and gather not in names:
        raise NameError(f"--gather {gather}: rank {dist.get_rank()} has no variable {gather!r} "
                        "(define it in this cell or an earlier %%ranks cell)")
    return defined_names(), (names[gather] if gather is not None else None)


def defined_names() -> list[str]:
    """The names this rank's cells defined (not those bound to start with), which ``%ranks status`` lists."""
    given = _starting_names()
    return sorted(name for name in namespace() if name not in given)
