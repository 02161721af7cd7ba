"""The notebook as a distributed console: ``%load_ext distlab``, then ``%%ranks`` cells run on warm ranks.

::

    %%ranks 4                      # the cell's body runs on 4 ranks; what it defines stays for the next cell
    x = torch.ones(2) * (rank + 1)
    dist.all_reduce(x)
    x                              # a last expression prints per rank: [ranks 0-3] tensor([10., 10.])

    %%ranks --only 0,1             # only ranks 0 and 1 run it; the others sit the cell out
    %%ranks --gather x             # the notebook gets x back: a list in rank order (of the ranks that ran)
    %ranks status                  # the ranks, their processes and the names each holds
    %ranks reset                   # end the ranks (and their names); the next cell starts fresh ones

A cell is a job on one :class:`~distlab.runtime.launch.Ranks` this magic keeps for the kernel's life: the
same watchdog, failure reports (the rank, the cell's own line, what every other rank was doing), cleanup
and output grouping (:mod:`~distlab.runtime.output`) as ``distlab.launch``; the names live in each rank's
:mod:`~distlab.runtime.console` namespace. A rank that raises keeps its names when the others were clean
(nothing in flight, nothing unmatched): a prompt keeps its variables after an error too. A hang, a crash or
the stop button ends the ranks, says so, and the next cell starts fresh ones; no rank outlives the kernel
(the launcher's reaper ends them even when the kernel is killed).

How a learner compares the two: ``launch(fn)`` runs a function on fresh ranks and returns its values,
the form a script or a cluster job takes; ``%%ranks`` explores step by step, state kept, as one would at a
Python prompt on each machine.
"""

from __future__ import annotations

import argparse
import ast
import shlex
import sys

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class

from distlab.runtime.console import run_cell
from distlab.runtime.diagnose import describe_exit, ranks_text
from distlab.runtime.errors import CollectiveTimeout, LaunchError
from distlab.runtime.launch import DEFAULT_COLLECTIVE_TIMEOUT, Ranks, resolve_backend

DEFAULT_WORLD_SIZE = 4

USAGE = """\
%%ranks [N] [--backend auto|gloo|nccl] [--only RANKS] [--gather NAME] [--timeout S] [--threads T]
        [--collective-timeout S]
    run the cell on N warm ranks (4 by default; afterwards the running group's size); names persist
%ranks status    the ranks, their processes and the names each holds
%ranks reset     end the ranks and their names; the next %%ranks cell starts fresh ones"""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"%%ranks: {message}\n{USAGE}")


def _cell_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="%%ranks", add_help=False)
    parser.add_argument("world_size", nargs="?", type=int)
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"))
    parser.add_argument("--only")
    parser.add_argument("--gather")
    parser.add_argument("--timeout", type=float)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--collective-timeout", type=float)
    return parser


def parse_ranks(text: str, world_size: int) -> tuple[int, ...]:
    """``"0,1"``, ``"2"`` or ``"0-2,5"`` as sorted ranks, each checked against ``world_size``."""
    found = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            span = range(int(first), int(last if dash else first) + 1)
        except ValueError:
            raise UsageError(f"%%ranks --only {text}: expected ranks like 0,1 or 0-2") from None
        found.update(span)
    outside = sorted(r for r in found if not 0 <= r < world_size)
    if not found or outside:
        raise UsageError(f"%%ranks --only {text}: ranks run from 0 to {world_size - 1}"
                         + (f", not {ranks_text(outside)}" if outside else ""))
    return tuple(sorted(found))


@magics_class
class RanksMagics(Magics):
    """``%%ranks`` and ``%ranks``; one warm group of ranks per kernel (the module docstring)."""

    def __init__(self, shell=None):
        super().__init__(shell)
        self.group: Ranks | None = None
        self.names: dict[int, list[str]] = {}  # what each rank's cells defined, as of the last cell that finished
        self.cells = 0  # cells run on the current group

    @line_cell_magic
    def ranks(self, line: str, cell: str | None = None):
        __tracebackhide__ = True
        if cell is None:
            command = line.strip()
            if command not in ("status", "reset"):
                raise UsageError(f"%ranks takes status or reset, not {command!r} (a cell on ranks starts "
                                 f"with %%ranks)\n{USAGE}")
            print(self.status() if command == "status" else self.reset())
        else:
            self.run(line, cell)

    # ---- a cell

    def run(self, line: str, cell: str):
        """Run ``cell`` on the ranks ``line`` asks for; bind ``--gather``'s values in the notebook."""
        __tracebackhide__ = True
        args = _cell_parser().parse_args(shlex.split(line))
        group = self._group_for(args)
        run_on = parse_ranks(args.only, group.world_size) if args.only else None
        if args.gather is not None and not args.gather.isidentifier():
            raise UsageError(f"%%ranks --gather {args.gather}: expected a variable name")
        # The cell as the notebook shows it, cached so that the ranks' reports quote its lines; the source the
        # ranks compile has a blank first line for the magic's, so line numbers are the cell's own.
        filename = self.shell.compile.cache(f"%%ranks {line}\n{cell}", self.shell.execution_count)
        source = "\n" + cell
        compile(source, filename, "exec", ast.PyCF_ONLY_AST)  # a syntax error shows here, before any rank starts
        self._say_if_ranks_ended(group)
        try:
            result = group.run(run_cell, args=(source, filename, run_on, args.gather), timeout=args.timeout)
        except (LaunchError, KeyboardInterrupt) as error:
            if isinstance(error, CollectiveTimeout) and error.kind == "missing" and run_on is not None:
                error.args = (f"{error}\nRanks {ranks_text(set(range(group.world_size)) - set(run_on))} sat "
                              f"this cell out (--only {args.only}): a collective over all ranks needs every "
                              "rank in the cell.",)
            if not group.alive:
                self.names = {}
                print(f"distlab: the {group.world_size} ranks were ended, with the names earlier %%ranks cells "
                      "defined; the next %%ranks cell starts fresh ones.", file=sys.stderr)
            raise
        self.cells += 1
        ran = run_on if run_on is not None else range(group.world_size)
        self.names.update({r: result[r][0] for r in ran})
        if args.gather is not None:
            self.shell.user_ns[args.gather] = [result[r][1] for r in ran]

    def _group_for(self, args) -> Ranks:
        """The warm group this cell runs on: the current one, or a new one if none holds names yet."""
        current = self.group
        defaults = {"world_size": DEFAULT_WORLD_SIZE, "backend": "auto",
                    "collective_timeout": DEFAULT_COLLECTIVE_TIMEOUT, "threads": None}
        # What the cell names, else what the running group has, else the defaults
        wanted = {name: getattr(args, name) if getattr(args, name) is not None
                  else getattr(current, name) if current is not None else default
                  for name, default in defaults.items()}
        try:
            wanted["backend"] = resolve_backend(wanted["backend"], wanted["world_size"])
        except ValueError as error:
            raise UsageError(f"%%ranks: {error}") from None
        if current is not None:
            have = {name: getattr(current, name) for name in wanted}
            if have == wanted:
                return current
            if current.alive:
                differ = ", ".join(f"{name} {have[name]} -> {wanted[name]}" for name in wanted
                                   if have[name] != wanted[name])
                raise UsageError(f"%%ranks: the running ranks were started with other settings ({differ}) and "
                                 "hold the names earlier cells defined; run %ranks reset to end them, then this "
                                 "cell starts new ones")
            current.close()
        try:
            self.group = Ranks(**wanted)
        except ValueError as error:
            raise UsageError(f"%%ranks: {error}") from None
        self.names, self.cells = {}, 0
        return self.group

    def _say_if_ranks_ended(self, group: Ranks) -> None:
        """A rank that died between cells (killed, out of memory) takes the names with it: say so, then go on."""
        gone = [(r, code) for r, (_, code) in enumerate(group.processes()) if code is not None]
        if gone and not group.alive:
            how = "; ".join(f"rank {r}: {describe_exit(code)}" for r, code in gone)
            print(f"distlab: rank(s) of the warm group had exited since the last cell ({how}); starting "
                  f"{group.world_size} fresh ranks: names from earlier %%ranks cells are gone.", file=sys.stderr)
            self.names, self.cells = {}, 0

    # ---- %ranks status and reset

    def status(self) -> str:
        """The group's settings, each rank's process, and the names its cells defined."""
        group = self.group
        if group is None or not group.processes():
            return "no ranks are running: the next %%ranks cell starts them (%%ranks 4 for four)"
        threads = f"{group.threads} thread(s) each" if group.threads else "threads shared out by cores"
        lines = [f"{group.world_size} {group.backend} ranks ({threads}, collective timeout "
                 f"{group.collective_timeout:g} s); {self.cells} cell(s) run on them"]
        for r, (pid, code) in enumerate(group.processes()):
            state = "running, idle between cells" if code is None else f"exited ({describe_exit(code)})"
            names = ", ".join(self.names.get(r, [])) or "none yet"
            lines.append(f"  rank {r}: pid {pid}, {state}; names: {names}")
        return "\n".join(lines)

    def reset(self) -> str:
        """End the ranks and forget their names; the next cell starts fresh ranks of the same settings."""
        group = self.group
        if group is None or not group.processes():
            return "no ranks were running; the next %%ranks cell starts fresh ones"
        group.close()
        self.names, self.cells = {}, 0
        return (f"ended the {group.world_size} {group.backend} ranks and the names they held; the next %%ranks "
                "cell starts fresh ones")

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


_loaded: list[RanksMagics] = []  # the instance registered with this kernel's shell


def load_ipython_extension(ipython) -> None:
    """``%load_ext distlab``: register ``%%ranks``/``%ranks`` (once per kernel)."""
    if not _loaded:
        _loaded.append(RanksMagics(ipython))
    ipython.register_magics(_loaded[0])


def unload_ipython_extension(ipython) -> None:
    """``%unload_ext distlab``: end the magic's ranks."""
    for magics in _loaded:
        magics.close()
