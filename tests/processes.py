"""Finding the rank processes a test started, to prove none outlive a launch."""

import time

import psutil


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def rank_processes() -> list[psutil.Process]:
    """Live rank processes this test session started (ranks name themselves distlab-rankN)."""
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.name().startswith("distlab-rank") and alive(proc):
                found.append(proc)
        except psutil.NoSuchProcess:
            pass
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
