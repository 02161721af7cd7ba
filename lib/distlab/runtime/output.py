"""Rank output a person can read: grouped by rank, identical lines said once, in a stable order.

Four ranks that print the same line four times bury what differs between them. So the launcher shows a
job's output as *blocks*: where every rank that printed agrees line for line, one block says it once
(``[ranks 0-3] after [60.0, 64.0]``); where they differ, each rank's lines of that stretch form a block of
their own, in rank order (ranks whose stretch is identical share one). Lines are compared by position, so
the order is the ranks' own and the same on every run, whatever order the processes printed in.

Who reads it decides the form, and :func:`audience` says who that is:

- ``"notebook"``: a person's Jupyter front end (JupyterLab, the classic notebook, VS Code, Colab): one
  display with the grouped text (``text/plain``) and HTML of the same text, plus a collapsible block per rank
  holding that rank's whole output when the ranks said different things;
- ``"terminal"`` and ``"headless"``: the grouped text on stdout (and stderr for the ranks' stderr), byte for
  byte what nbval compares and a grader or a log file keeps.

Headless is anything no person watches live: nbval and pytest (``PYTEST_CURRENT_TEST``, which the kernels
nbval starts inherit), CI (``CI``), distlab's own notebook runners (``distlab notebooks execute``, ``distlab
grade``, which set :data:`HEADLESS_ENV` for their kernels), and a process whose stderr is not a terminal.
:mod:`~distlab.runtime.progress` asks the same question before it draws a bar.
"""

from __future__ import annotations

import html
import os
import sys
from typing import NamedTuple, Sequence

from distlab.runtime.diagnose import ranks_text

HEADLESS_ENV = "DISTLAB_HEADLESS"  # set (to anything but 0/false/no) where no person watches: plain text, no bars


def _set(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def _kernel_shell():
    """The IPython shell of a Jupyter kernel this process is, else None (IPython is never imported here for it)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell if getattr(shell, "kernel", None) is not None else None


def audience() -> str:
    """Who will read what this process shows: ``"notebook"``, ``"terminal"`` or ``"headless"`` (module docstring)."""
    if _set(HEADLESS_ENV) or _set("CI") or "PYTEST_CURRENT_TEST" in os.environ:
        return "headless"
    if _kernel_shell() is not None:
        return "notebook"
    stream = sys.__stderr__
    return "terminal" if stream is not None and stream.isatty() else "headless"


class Block(NamedTuple):
    """Consecutive lines that ``ranks`` printed alike."""

    ranks: tuple[int, ...]
    lines: tuple[str, ...]

    @property
    def label(self) -> str:
        return f"rank {self.ranks[0]}" if len(self.ranks) == 1 else f"ranks {ranks_text(self.ranks)}"


def blocks(texts: Sequence[str]) -> list[Block]:
    """The ranks' texts (``texts[r]`` is rank r's) as blocks: common stretches once, the rest rank by rank.

    Only ranks that printed take part: when ranks 0 and 1 print the same line and ranks 2 and 3 print
    nothing, the line is ``[ranks 0, 1]``'s.
    """
    lines = {r: text.splitlines() for r, text in enumerate(texts) if text}
    speakers = tuple(lines)
    if not speakers:
        return []
    longest = max(len(rank_lines) for rank_lines in lines.values())

    def common(i: int) -> bool:
        return all(len(lines[r]) > i for r in speakers) and len({lines[r][i] for r in speakers}) == 1

    found: list[Block] = []
    start = 0
    while start < longest:
        shared = common(start)
        end = start
        while end < longest and common(end) == shared:
            end += 1
        if shared:
            found.append(Block(speakers, tuple(lines[speakers[0]][start:end])))
        else:
            alike: dict[tuple[str, ...], list[int]] = {}  # in the order of each stretch's first rank
            for r in speakers:
                stretch = tuple(lines[r][start:end])
                if stretch:
                    alike.setdefault(stretch, []).append(r)
            found += [Block(tuple(ranks), stretch) for stretch, ranks in alike.items()]
        start = end
    return found


def as_text(texts: Sequence[str]) -> str:
    """The grouped text: each line after its ranks' label, ``[rank 2] ...`` or ``[ranks 0-3] ...``."""
    return "".join(f"[{block.label}] {line}\n" for block in blocks(texts) for line in block.lines)


def as_html(stdout: Sequence[str], stderr: Sequence[str]) -> str:
    """The grouped text as HTML (stderr in red), then, where it interleaves ranks that differ with lines said
    once, one collapsible block per rank with that rank's whole output (closed: the grouped text has every line)."""
    out, err = blocks(stdout), blocks(stderr)
    rows = [_row(block, line, error) for error, found in ((False, out), (True, err))
            for block in found for line in block.lines]
    parts = ['<div class="distlab-rank-output">', f'<pre style="margin:0">{"".join(rows)}</pre>']
    speakers = [r for r in range(max(len(stdout), len(stderr)))
                if _at(stdout, r) or _at(stderr, r)]
    # Each rank's output whole, when the grouped text interleaves it with lines said once for several ranks
    # (when every line already belongs to one rank, the grouped text is rank by rank: nothing to add).
    if len({(_at(stdout, r), _at(stderr, r)) for r in speakers}) > 1 and any(
            len(block.ranks) > 1 for block in out + err):
        for r in speakers:
            text, error = _at(stdout, r).splitlines(), _at(stderr, r).splitlines()
            count = len(text) + len(error)
            body = "".join(_line(line, False) for line in text) + "".join(_line(line, True) for line in error)
            parts.append(f'<details><summary>rank {r} · {count} line{"s" if count != 1 else ""}</summary>'
                         f'<pre style="margin:0 0 0 1.5em">{body}</pre></details>')
    parts.append("</div>")
    return "".join(parts)


def _at(texts: Sequence[str], r: int) -> str:
    return texts[r] if r < len(texts) else ""


_LABEL_STYLE = "font-weight:bold;color:var(--jp-ui-font-color2, #616161)"
_ERROR_STYLE = "color:var(--jp-error-color1, #d32f2f)"


def _line(text: str, error: bool) -> str:
    escaped = html.escape(text)
    return (f'<span style="{_ERROR_STYLE}">{escaped}</span>' if error else escaped) + "\n"


def _row(block: Block, line: str, error: bool) -> str:
    return f'<span style="{_LABEL_STYLE}">[{html.escape(block.label)}]</span> ' + _line(line, error)


def show(stdout: Sequence[str], stderr: Sequence[str]) -> None:
    """Show the ranks' output as its :func:`audience` reads best (module docstring)."""
    out, err = as_text(stdout), as_text(stderr)
    if not out and not err:
        return
    if audience() == "notebook":
        from IPython.display import display  # noqa: PLC0415  only in a kernel, which has imported IPython already

        display({"text/plain": out + err, "text/html": as_html(stdout, stderr)}, raw=True)
        return
    if out:
        sys.stdout.write(out)
        sys.stdout.flush()
    if err:
        sys.stderr.write(err)
        sys.stderr.flush()
