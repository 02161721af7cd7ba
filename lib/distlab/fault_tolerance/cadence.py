"""How often to checkpoint: Young's and Daly's interval from the mean time between failures.

Checkpoint every τ seconds of training, each checkpoint stalling training for δ, on
a job whose mean time between failures is M. Per unit of training time the job loses

* δ/τ to checkpoint stalls, and
* per failure, on average half an interval of work since the last checkpoint, τ/2,
  plus the restart R (detect, reschedule, reload); failures come every M,

so the wasted fraction is W(τ) ≈ δ/τ + (τ/2 + R)/M. Setting dW/dτ = 0 gives
Young's interval τ* = √(2δM) (Young 1974); Daly (2006) adds the higher-order terms
that matter when δ is not small against M. Failures scale with the hardware: with
a per-GPU mean time between failures m, a job on N GPUs fails every m/N.

Llama 3's 405B pre-training (Dubey et al. 2024, section 3.3.4): 419 unexpected
interruptions in a 54-day snapshot on 16,384 H100 GPUs, one every ~3.1 hours.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["FailureRecord", "LLAMA3", "gpu_mtbf_hours", "job_mtbf_hours", "young_interval", "daly_interval",
           "expected_lost_work", "waste_fraction", "Cadence", "plan_cadence"]


@dataclass(frozen=True)
class FailureRecord:
    """A published failure count: ``interruptions`` in ``days`` of training on ``gpus`` GPUs."""

    interruptions: int
    days: float
    gpus: int
    source: str

    @property
    def job_mtbf_hours(self) -> float:
        return self.days * 24 / self.interruptions


LLAMA3 = FailureRecord(419, 54, 16_384, "Llama 3 (Dubey et al. 2024), 405B pre-training, section 3.3.4")


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return float(value)


def gpu_mtbf_hours(record: FailureRecord = LLAMA3) -> float:
    """Mean time between failures of one GPU (with its share of host, network and software): job MTBF × GPUs."""
    return record.job_mtbf_hours * record.gpus


def job_mtbf_hours(n_gpus: int, record: FailureRecord = LLAMA3) -> float:
    """A job's mean time between failures on ``n_gpus``, if each GPU fails as often as in ``record``."""
    return gpu_mtbf_hours(record) / _positive("n_gpus", n_gpus)


def young_interval(checkpoint_cost: float, mtbf: float) -> float:
    """Young's optimal time between checkpoints, √(2·δ·M) (any unit, the same for both)."""
    return math.sqrt(2 * _positive("checkpoint_cost", checkpoint_cost) * _positive("mtbf", mtbf))


def daly_interval(checkpoint_cost: float, mtbf: float) -> float:
    """Daly's (2006) higher-order optimum: √(2δM)·[1 + ⅓√(δ/2M) + δ/(18M)] − δ for δ < 2M, else M."""
    delta, m = _positive("checkpoint_cost", checkpoint_cost), _positive("mtbf", mtbf)
    if delta >= 2 * m:
        return m
    return math.sqrt(2 * delta * m) * (1 + math.sqrt(delta / (2 * m)) / 3 + delta / (18 * m)) - delta


def expected_lost_work(interval: float, restart: float = 0.0) -> float:
    """Training time lost per failure: half an interval on average, plus the restart."""
    return _positive("interval", interval) / 2 + restart


def waste_fraction(interval: float, checkpoint_cost: float, mtbf: float, restart: float = 0.0) -> float:
    """First-order share of time not spent training: δ/τ + (τ/2 + R)/M."""
    return (_positive("checkpoint_cost", checkpoint_cost) / _positive("interval", interval)
            + expected_lost_work(interval, restart) / _positive("mtbf", mtbf))


@dataclass(frozen=True)
class Cadence:
    n_gpus: int
    mtbf_hours: float
    checkpoint_seconds: float
    restart_seconds: float
    interval_minutes: float  # Young's, or the async write time if longer
    daly_minutes: float
    lost_minutes_per_failure: float
    waste: float  # at Young's interval
    young_minutes: float = 0.0  # √(2δM) alone, before the write bounds it
    write_seconds: float = 0.0  # an async save's background write (0 for a synchronous one)

    @property
    def write_bound(self) -> bool:
        """True when Young's interval is shorter than the write: checkpoints are then written back to back."""
        return self.young_minutes * 60 < self.write_seconds

    def __str__(self) -> str:
        return (f"{self.n_gpus:>6,} GPUs: MTBF {self.mtbf_hours:7.2f} h; checkpoint stall "
                f"{self.checkpoint_seconds:g} s "
                f"-> every {self.interval_minutes:6.1f} min (Daly {self.daly_minutes:6.1f}); lose "
                f"{self.lost_minutes_per_failure:5.1f} min per failure; {self.waste:.1%} of the time wasted")


def plan_cadence(n_gpus: int, checkpoint_seconds: float, restart_seconds: float = 600.0,
                 record: FailureRecord = LLAMA3, write_seconds: float = 0.0) -> Cadence:
    """The checkpoint cadence for a job on ``n_gpus``, failure rate scaled from ``record``.

    ``write_seconds`` is how long an async save keeps writing after its stall: the next
    save waits for it, so checkpointing more often than that only turns the write back
    into a stall. The interval is Young's, but never shorter than the write.
    """
    mtbf_s = job_mtbf_hours(n_gpus, record) * 3600
    tau = max(young_interval(checkpoint_seconds, mtbf_s), write_seconds)
    young = young_interval(checkpoint_seconds, mtbf_s)
    return Cadence(n_gpus, mtbf_s / 3600, checkpoint_seconds, restart_seconds, tau / 60,
                   daly_interval(checkpoint_seconds, mtbf_s) / 60, expected_lost_work(tau, restart_seconds) / 60,
                   waste_fraction(tau, checkpoint_seconds, mtbf_s, restart_seconds), young / 60, write_seconds)
