"""Fault tolerance: checkpoints that survive crashes, exact restarts, and the detectors a large run needs.

At 16,384 GPUs something fails every few hours (Llama 3: 419 unexpected interruptions
in 54 days). A run survives by checkpointing often and cheaply, restarting exactly,
and noticing what does not crash: hangs, loss spikes, NaNs, silently corrupted bits.

* :mod:`~distlab.fault_tolerance.checkpoint` — DCP checkpoints, synchronous and async,
  committed by rename, verified by checksum, checked for compatibility before loading.
* :mod:`~distlab.fault_tolerance.stall` — what a save costs the training loop, sync against async.
* :mod:`~distlab.fault_tolerance.reshard` — FSDP2 checkpoints loaded into another world size.
* :mod:`~distlab.fault_tolerance.faults` — the faults the lab injects, for real.
* :mod:`~distlab.fault_tolerance.resume` — a resumable DDP job and the supervisor that restarts it.
* :mod:`~distlab.fault_tolerance.guards` — loss-spike/NaN guard, skip and rollback, NaN diagnosis.
* :mod:`~distlab.fault_tolerance.detect` — replica hashes and gradient norms for SDC, a hang's suspect.
* :mod:`~distlab.fault_tolerance.stragglers` — one slow rank paces every synchronous step; finding it.
* :mod:`~distlab.fault_tolerance.cadence` — Young/Daly checkpoint intervals from the failure rate.
"""

from distlab.fault_tolerance.cadence import (
    LLAMA3,
    daly_interval,
    expected_lost_work,
    job_mtbf_hours,
    plan_cadence,
    waste_fraction,
    young_interval,
)
from distlab.fault_tolerance.checkpoint import (
    CheckpointError,
    PendingCheckpoint,
    TrainState,
    async_save_checkpoint,
    check_compatible,
    checkpoint_group,
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    partial_checkpoints,
    read_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from distlab.fault_tolerance.detect import (
    find_divergent_replicas,
    fingerprint,
    grad_norm_outliers,
    hang_suspects,
    local_grad_norm,
)
from distlab.fault_tolerance.faults import (
    DyingWriter,
    Fault,
    corrupt_file,
    die,
    flip_bit,
    flip_bit_on_disk,
    hang_in_recv,
)
from distlab.fault_tolerance.guards import SpikeGuard, diagnose_nonfinite, guarded_train, masked_cross_entropy
from distlab.fault_tolerance.resume import (
    MetricsLog,
    RestartReport,
    ShuffledOrder,
    TrainSetup,
    make_training,
    resumable_train,
    run_with_restarts,
    train,
    train_step_ddp,
)
from distlab.fault_tolerance.stragglers import find_stragglers, pace_by_rank, straggler_steps

__all__ = [
    "LLAMA3", "daly_interval", "expected_lost_work", "job_mtbf_hours", "plan_cadence", "waste_fraction",
    "young_interval", "CheckpointError", "PendingCheckpoint", "TrainState", "async_save_checkpoint",
    "check_compatible", "checkpoint_group", "checkpoint_path", "latest_checkpoint", "list_checkpoints",
    "load_checkpoint", "partial_checkpoints", "read_checkpoint", "save_checkpoint", "verify_checkpoint",
    "find_divergent_replicas", "fingerprint", "grad_norm_outliers", "hang_suspects", "local_grad_norm",
    "DyingWriter", "Fault", "corrupt_file", "die", "flip_bit", "flip_bit_on_disk", "hang_in_recv", "SpikeGuard",
    "diagnose_nonfinite", "guarded_train", "masked_cross_entropy", "MetricsLog", "RestartReport", "ShuffledOrder",
    "train",
    "TrainSetup", "make_training", "resumable_train", "run_with_restarts", "train_step_ddp", "find_stragglers",
    "pace_by_rank", "straggler_steps",
]
