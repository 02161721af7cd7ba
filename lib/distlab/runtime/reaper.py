"""The reaper: one small process per rank group that ends the ranks if the launcher dies.

A rank cannot watch for its launcher's death itself: a rank spinning in pure Python
(``sum(range(10**10))``) holds its GIL, so a watcher thread inside it never runs. The
reaper is a separate process that does nothing but wait: the launcher sends it each
rank's process-group id over a pipe and keeps the write end. A ``None`` means the
launcher closed the group itself; end-of-file without it means the launcher is gone
(killed, crashed), and the reaper kills every rank's process group (the rank and
everything it started) before exiting.
"""

from __future__ import annotations

import os
import signal


def main(lifeline) -> None:
    # A notebook interrupt, a closed terminal or a polite kill is the launcher's to handle;
    # the reaper leaves only when the lifeline says so.
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    groups: list[int] = []
    while True:
        try:
            message = lifeline.recv()
        except (EOFError, OSError, ValueError):
            break  # the launcher died without closing the group
        if message is None:
            return
        groups.append(int(message))
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
