"""Live progress on long work: a bar with its rate and ETA where a person watches, nothing where nobody does.

``progress(iterable, total=None, desc="", unit="it")`` wraps a loop, or is updated by hand
(``with progress(total=n, desc="files") as bar: ... bar.update(k)``). What it draws depends on
:func:`~distlab.runtime.output.audience`, the same question the launcher asks before it shows rank output:

- ``"notebook"`` (a person's JupyterLab, classic notebook, VS Code or Colab): tqdm's ipywidgets bar
  (tqdm's text bar where ipywidgets is missing);
- ``"terminal"``: tqdm's text bar on stderr;
- ``"headless"`` (nbval, pytest, CI, ``distlab notebooks execute`` and ``distlab grade``, a log file): nothing
  at all, so executed notebooks and their nbval comparisons never hold a bar. The object returned then counts
  and iterates like a bar, so a call site never needs an ``if``.

The interface a call site may use is the part of tqdm's that both kinds share: the arguments ``total``,
``desc``, ``unit``, ``initial`` and ``disable``; iterating, ``update(n)``, ``set_description``,
``set_postfix_str``, ``write``, ``close``, ``n``, ``total``, and ``with``. ``bar.write(line)`` prints a line
(on stdout) above a drawn bar without breaking it, as tqdm's does: a loop that reports as it goes (a benchmark's
rounds, the output of the scripts ``benchmarks/run_all.py`` runs) prints through it.

**Inside a rank.** A rank started by ``launch``/``Ranks`` writes its stderr to a file the launcher reads after
the job, so a bar drawn there would show up, frozen, once the job is over. There ``progress`` *reports* instead:
the rank's count goes to the launcher's store at most :data:`REPORT_PERIOD` apart (and at the end), and the
launcher (:class:`RankBars`, polled from its watchdog loop) draws one bar for the job in the notebook: as far
as the slowest rank that reports, the largest total any of them announced, rank 0's description. A rank of a
``torchrun`` job other than rank 0 draws nothing (one bar per job, not one per rank).
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from typing import Iterable

from distlab.runtime.output import audience

REPORT_PERIOD = 0.2  # seconds between a rank's reports to the launcher (its last count is always sent)
POLL_PERIOD = 0.25  # seconds between the launcher's reads of the ranks' reports
_KEY = "distlab/progress/{rank}"

_reporter: dict = {}  # inside a launched rank: the launcher's store port and this rank (report_to)


def progress(iterable: Iterable | None = None, *, total: float | None = None, desc: str = "", unit: str = "it",
             initial: float = 0, disable: bool = False):
    """A progress bar over ``iterable`` (or of ``total`` steps updated by hand) for whoever watches (docstring).

    ``initial``: where the count starts (a run resumed at step 10 of 40); ``disable``: draw nothing even where
    someone watches (a call site's own switch, as tqdm's)."""
    if total is None and iterable is not None and hasattr(iterable, "__len__"):
        total = initial + len(iterable)
    if disable:
        return _Silent(iterable, total, initial)
    if _reporter:
        return _Reporting(iterable, total, initial, desc, unit)
    if os.environ.get("TORCHELASTIC_RUN_ID") and os.environ.get("RANK", "0") != "0":
        return _Silent(iterable, total, initial)
    shown_to = audience()
    if shown_to == "headless":
        return _Silent(iterable, total, initial)
    if shown_to == "notebook":
        try:
            from tqdm.notebook import tqdm as notebook_bar  # noqa: PLC0415  ipywidgets, only for a notebook

            return notebook_bar(iterable, total=total, desc=desc, unit=unit, initial=initial)
        except ImportError:  # tqdm.notebook without ipywidgets: the text bar below still shows in the cell
            pass
    from tqdm.std import tqdm as text_bar  # noqa: PLC0415  tqdm only where a bar is drawn

    return text_bar(iterable, total=total, desc=desc, unit=unit, initial=initial, file=sys.stderr,
                    dynamic_ncols=True)


class _Silent:
    """What ``progress`` returns where nobody watches: it iterates and counts, and draws nothing."""

    def __init__(self, iterable, total, initial: float = 0):
        self.iterable, self.total, self.n = iterable, total, initial

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.n += 1

    def update(self, n: float = 1) -> None:
        self.n += n

    def set_description(self, desc: str = "", refresh: bool = True) -> None:
        pass

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def write(self, s: str, file=None, end: str = "\n") -> None:
        """Print ``s`` (no bar to keep clear of here); flushed, so that a log file keeps the order of events."""
        print(s, end=end, file=file if file is not None else sys.stdout, flush=True)

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------- from a rank to the launcher

def report_to(store_port: int, rank: int) -> None:
    """Called by a launched rank as it starts: its bars report to the launcher's store at ``store_port``."""
    _reporter.update(port=store_port, rank=rank, store=None)


def _store():
    if _reporter["store"] is None:  # a connection of its own: the process group's client is the backend's
        import torch.distributed as dist  # noqa: PLC0415  a rank has imported it long before

        _reporter["store"] = dist.TCPStore("127.0.0.1", _reporter["port"], is_master=False,
                                           timeout=timedelta(seconds=30))
    return _reporter["store"]


class _Reporting(_Silent):
    """A rank's bar: counts like a bar and sends the count to the launcher, which draws it."""

    def __init__(self, iterable, total, initial: float, desc: str, unit: str):
        super().__init__(iterable, total, initial)
        self.desc, self.unit, self._sent_at = desc, unit, None
        self._send()

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update()
        self._send()

    def update(self, n: float = 1) -> None:
        self.n += n
        if time.monotonic() - self._sent_at >= REPORT_PERIOD or (self.total is not None and self.n >= self.total):
            self._send()

    def set_description(self, desc: str = "", refresh: bool = True) -> None:
        self.desc = desc
        self._send()

    def close(self) -> None:
        self._send()

    def _send(self) -> None:
        total = "" if self.total is None else repr(self.total)
        _store().set(_KEY.format(rank=_reporter["rank"]), f"{self.n!r}\t{total}\t{self.unit}\t{self.desc}")
        self._sent_at = time.monotonic()


class RankBars:
    """The launcher's side of the ranks' bars: reads their reports while a job runs and draws one bar for it."""

    def __init__(self, store, world_size: int):
        self.store, self.keys = store, [_KEY.format(rank=r) for r in range(world_size)]
        self.watching, self.bar, self.shape, self.next_poll = False, None, None, 0.0

    def start_job(self) -> None:
        """Forget the last job's reports; watch this job's only where a person will see the bar."""
        for key in self.keys:
            self.store.delete_key(key)
        self.watching, self.next_poll = audience() != "headless", 0.0

    def poll(self, now: bool = False) -> None:
        """Draw what the ranks have reported, at most every :data:`POLL_PERIOD` (called from the watchdog loop)
        unless ``now`` (the job's end: its last counts)."""
        if not self.watching or not (now or time.monotonic() >= self.next_poll):
            return
        self.next_poll = time.monotonic() + POLL_PERIOD
        reports = [self.store.get(key).decode().split("\t", 3) for key in self.keys if self.store.check([key])]
        if not reports:
            return
        done = min(_number(n) for n, _, _, _ in reports)
        totals = [_number(total) for _, total, _, _ in reports if total]
        shape = (reports[0][3], max(totals) if totals else None, reports[0][2])
        if shape != self.shape:  # the ranks started another loop
            self.close()  # the new bar starts where the ranks are: its rate counts only the steps it saw
            self.bar, self.shape = progress(total=shape[1], desc=shape[0], unit=shape[2], initial=done), shape
        if done > self.bar.n:
            self.bar.update(done - self.bar.n)

    def finish(self) -> None:
        """The job ended: draw the ranks' last counts and close the bar."""
        self.poll(now=True)
        self.close()
        self.watching = False

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.bar, self.shape = None, None


def _number(text: str) -> float:
    """A count as a rank sent it: an int stays an int (tqdm shows 20/20, not 20.0/20.0)."""
    return int(text) if text.lstrip("-").isdigit() else float(text)
