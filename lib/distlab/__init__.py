"""distlab: learn distributed LLM training by running real torch.distributed ranks from notebook cells."""

from distlab.claims import ClaimFailed, claim
from distlab.grading import check, needs
from distlab.launcher import (CollectiveTimeout, LaunchError, LaunchInterrupted, LaunchTimeout, RankCrashed,
                              RankFailed, Ranks, ReturnValueError, Run, UnmatchedCommunication, launch, shutdown)
from distlab.rank import device
from distlab.timeline import span

__all__ = [
    "check", "needs", "claim", "ClaimFailed", "launch", "Ranks", "Run", "shutdown", "device", "span",
    "LaunchError", "RankFailed", "RankCrashed", "CollectiveTimeout", "LaunchTimeout", "LaunchInterrupted",
    "UnmatchedCommunication", "ReturnValueError",
]
