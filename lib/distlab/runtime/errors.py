"""The ways a launch can fail, as exception classes.

They sit apart from the code that raises them because three modules need them and none should import
another for them: :mod:`~distlab.runtime.diagnose` builds them from what the ranks reported,
:mod:`~distlab.runtime.group` returns them from a job, and :mod:`~distlab.runtime.launch` (which
re-exports them as distlab's public API) decides from them whether a warm group survives.
"""

from __future__ import annotations


class LaunchError(RuntimeError):
    """A launch that did not complete; the message says which rank and why."""


class RankFailed(LaunchError):
    """A rank raised an exception. ``exc_type`` names it (e.g. "NotImplementedError").

    ``group_intact`` is True when every rank reported, none was inside a communication op or had one in
    flight, and their ledgers balance: the process group is as clean as after a successful job, so a warm
    group keeps its ranks (a stub lab's guarded cells then cost milliseconds, not a restart each).
    """

    def __init__(self, message: str, rank: int, exc_type: str, failed_ranks: list[int],
                 group_intact: bool = False):
        super().__init__(message)
        self.rank, self.exc_type, self.failed_ranks = rank, exc_type, failed_ranks
        self.group_intact = group_intact


class RankCrashed(LaunchError):
    """A rank's process ended without reporting: os._exit, a signal, a segfault, an abort."""

    def __init__(self, message: str, rank: int, exitcode: int | None):
        super().__init__(message)
        self.rank, self.exitcode = rank, exitcode


class CollectiveTimeout(LaunchError):
    """Ranks waited in a collective or point-to-point op that never completed.

    ``waiting`` maps each waiting rank to its op; ``kind`` says what the launcher saw:
    ``"deadlock"`` (every running rank waits in a point-to-point op), ``"mismatch"``
    (ranks wait in different collectives), ``"missing"`` (the others finished without
    the call), ``"slow"`` (the others were still computing), or ``"hang"``; ``hint`` says what to check.
    """

    def __init__(self, message: str, waiting: dict[int, str], kind: str = "hang", hint: str = ""):
        super().__init__(message)
        self.waiting, self.kind, self.hint = waiting, kind, hint


class LaunchTimeout(LaunchError):
    """The whole job ran past the ``timeout`` given to it."""


class UnmatchedCommunication(LaunchError):
    """The job returned, but a send was never received or ranks made different numbers of collective calls."""


class ReturnValueError(LaunchError):
    """A rank's return value could not be rebuilt in the launching process."""


class LaunchInterrupted(KeyboardInterrupt):
    """The notebook's interrupt button (or Ctrl-C) stopped a launch; every rank was ended."""
