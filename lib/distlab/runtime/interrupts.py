"""Interrupt-proof cleanup: the first interrupt stops a launch, the ones after it cannot stop the cleanup.

A student who presses the notebook's stop button while ranks are being ended tends to press it again.
Were the second press to land inside ``close()``, ranks would be left running. Both the launch entry points
(:mod:`~distlab.runtime.launch`) and a rank group that is interrupted while starting
(:mod:`~distlab.runtime.group`) end ranks through :func:`close_quietly` under an :class:`InterruptGuard`.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager


class InterruptGuard:
    """The first interrupt stops a launch; interrupts that follow, while ranks are ended, are absorbed.

    Replaces the SIGINT handler while active (main thread only; elsewhere it does nothing):
    the first SIGINT runs the previous handler (IPython's raises KeyboardInterrupt), every
    later one, and any once ``stopping`` is set, only sets ``absorbed``.
    """

    def __init__(self):
        self.previous = None
        self.stopping = False
        self.absorbed = False

    def __enter__(self) -> "InterruptGuard":
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGINT)
            if callable(previous):  # not SIG_IGN / SIG_DFL: those keep their meaning
                self.previous = previous
                signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.stopping:
            self.absorbed = True
            return
        self.stopping = True
        self.previous(signum, frame)

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
            self.previous = None


@contextmanager
def interrupts_deferred():
    """Hold an interrupt until the block is done, then deliver it (main thread only; elsewhere it does nothing).

    For steps that must not be cut in half: a rank started but not yet recorded would be a process no one ends
    (the forkserver has forked it, and the launcher never learned its pid).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):  # SIG_IGN / SIG_DFL keep their meaning
        yield
        return
    pressed = []
    signal.signal(signal.SIGINT, lambda signum, frame: pressed.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pressed:
        previous(*pressed[0])


def close_quietly(group, guard: InterruptGuard) -> None:
    """End ``group`` (a rank group, or None) whatever interrupts arrive meanwhile (they are recorded on the guard)."""
    guard.stopping = True
    while group is not None:
        try:
            group.close()
            return
        except KeyboardInterrupt:  # arrived before the guard could absorb it: close again
            guard.absorbed = True
