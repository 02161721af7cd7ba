"""Finding the rank processes a test started, to prove none outlive a launch."""

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
