"""Finding the processes a test started, to prove none outlive a launch and to end those that would.

One way for every test: by an environment variable, not by parentage. On import (conftest imports this module
before any test starts a process) ``DISTLAB_TEST_LAUNCH`` is set to a marker of this test session, and every
process the session starts inherits it: notebook ranks, their forkserver, kernels, torchrun agents and the
workers they start. A launch that must be told apart from the rest of the session (one torchrun agent and its
ranks: one "node") gets a marker of its own under the session's (:func:`launch_marker`). Parentage would miss
processes: torchrun starts each worker in a session of its own, and a worker whose agent was killed is adopted
by init, out of this process's tree; its environment stays with it.
"""

import contextlib
import os
import time
import uuid

import psutil

MARKER = "DISTLAB_TEST_LAUNCH"
# Under an outer session's marker when this session was itself started by a test (its processes are the outer's too)
SESSION = os.environ[MARKER] = "/".join(filter(None, [os.environ.get(MARKER), uuid.uuid4().hex[:12]]))


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def launch_marker() -> str:
    """A marker for one launch, under this session's: :func:`started` finds its processes by either."""
    return f"{SESSION}/{uuid.uuid4().hex[:12]}"


def started(marker: str = SESSION) -> list[psutil.Process]:
    """Live processes started under ``marker`` (this session's by default, or a launch's), wherever they are now.

    Reads each process's environment as it was when the process started (``/proc/PID/environ``; a change to
    ``os.environ`` inside the process does not alter it). A zombie's cannot be read (psutil raises
    ``ZombieProcess``), so the dead are never found.
    """
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):  # gone meanwhile, a zombie, or another user's
            value = proc.environ().get(MARKER, "")
            if value == marker or value.startswith(marker + "/"):
                found.append(proc)
    return found


def rank_processes() -> list[psutil.Process]:
    """Live rank processes this test session started (ranks name themselves distlab-rankN)."""
    found = []
    for proc in started():
        with contextlib.suppress(psutil.NoSuchProcess):
            if proc.name().startswith("distlab-rank"):
                found.append(proc)
    return found


def shared_ranks_end_here():
    """The body of a module-scoped fixture for tests that share warm groups (``Ranks.shared``, as
    the checkers do): after the module the groups close and no rank process may be left."""
    import distlab

    yield
    distlab.shutdown()
    deadline = time.monotonic() + 5
    while rank_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not rank_processes(), f"rank processes left behind: {rank_processes()}"
