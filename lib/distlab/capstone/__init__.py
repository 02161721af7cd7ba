"""The capstone: raw Common Crawl to a trained model on DP × PP × TP at once (ZeRO-1 on DP, tensor parallelism of at
least 2), surviving a killed rank, with every figure predicted by the calibrated planner before the run.

Each earlier lab proves one idea alone; a real run needs them together, and most of what goes wrong lives at the
joins: a loader that repeats tokens after a restart, a gradient norm counted once per TP rank, a planner's
prediction nobody compared with the clock. This package holds only those joins; every piece it joins is imported
from the topic that teaches it.

- ``train``: the end-to-end worker (``python -m distlab.torchrun distlab.capstone:train train_path=…``) on a
  DP × PP × TP grid (lab 11) with ZeRO-1 (lab 04), real tokens (lab 10,
  :mod:`distlab.data.loader`), AdamW with warm-up, cosine decay and clipping, and lab 12's checkpoints
- ``report``: the run card — each measured figure beside the planner's prediction, with the ratio, and the term
  responsible where they disagree (the machine is calibrated by :func:`distlab.parallel3d.calibration.calibrate`)
"""

from distlab.capstone.report import (
    BAND,
    OFF_BY,
    RunCard,
    card_rows,
    derive_report,
    measured_terms,
    responsible_term,
    runnable,
    runnable_best,
    stage_trace,
)
from distlab.capstone.train import (
    GridTrainState,
    capstone_worker,
    checkpoint_weights,
    clip_global_norm,
    dense_state,
    evaluate,
    lr_at,
    reference_losses,
    replica_losses,
    resume_from_latest,
    train,
)

__all__ = ["GridTrainState", "capstone_worker", "checkpoint_weights", "clip_global_norm", "dense_state", "evaluate",
           "lr_at",
           "reference_losses", "replica_losses", "resume_from_latest", "RunCard", "card_rows", "derive_report",
           "runnable_best", "OFF_BY", "BAND", "measured_terms", "responsible_term", "runnable", "stage_trace", "train"]
