"""Claims: a notebook's sentence about a measurement, checked against the measurement.

A lab that says "overlap hides communication" must show it on the student's machine, and
CI must notice when it stops being true. ``distlab.claim`` prints the sentence that the
measurement supports, or stops the cell with one line saying what did not hold and what
to look at::

    distlab.claim(overlapped < 0.95 * bucketed,
                  holds=f"overlap saved {1 - overlapped / bucketed:.0%} of the bucketed step",
                  fails=f"overlapped {overlapped * 1e3:.0f} ms vs bucketed {bucketed * 1e3:.0f} ms: on a loaded "
                        "machine the all-reduce may not run beside backward; close other programs and re-run")

Both texts are f-strings of the measured values, so no hand-written number can drift
from the output beside it. Compare medians over repeats with a margin, never single runs.
"""

from __future__ import annotations

__all__ = ["ClaimFailed", "claim"]


class ClaimFailed(AssertionError):
    """A lab's claim did not hold on this machine; the message says what was measured and what to check."""

    def _render_traceback_(self) -> list[str]:
        """IPython shows this one line instead of a traceback."""
        return [f"ClaimFailed: {self}"]


def claim(condition: bool, holds: str, fails: str) -> None:
    """Print ``✓ holds`` when ``condition`` is true; otherwise raise :class:`ClaimFailed` (``fails``).

    Returns nothing, so a claim that ends a cell adds no ``True`` under the line it printed.
    """
    if not condition:
        raise ClaimFailed(fails)
    print(f"✓ {holds}")
