"""distlab: learn distributed LLM training by running real torch.distributed ranks from notebook cells."""

from distlab.grading import check
from distlab.launcher import (CollectiveTimeout, LaunchError, LaunchInterrupted, LaunchTimeout, RankCrashed,
                              RankFailed, Ranks, Run, launch, shutdown)
from distlab.rank import device
from distlab.timeline import span

__all__ = [
    "check", "launch", "Ranks", "Run", "shutdown", "device", "span",
    "LaunchError", "RankFailed", "RankCrashed", "CollectiveTimeout", "LaunchTimeout", "LaunchInterrupted",
]
