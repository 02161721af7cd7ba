"""Lab 12: a table of wrong answers students write, each run through its checker: it fails, and the message
names the mistake (not only the numbers); the right answers pass (tests/grading/test_fault_tolerance_grading.py).

Exercise 12.1's cases each train twice with a real SIGKILL in between, so its mistakes go through one case
(the checker's own ``_resume_case``, on the case it would run first or on its mid-save case): each fails there.
"""

import math
import random
import re
import statistics
import sys
from pathlib import Path

import cloudpickle
import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import distlab
from distlab.fault_tolerance import (
    MetricsLog,
    SpikeGuard,
    TrainState,
    find_divergent_replicas,
    fingerprint,
    job_mtbf_hours,
    latest_checkpoint,
    load_checkpoint,
    make_training,
    save_checkpoint,
    train_step_ddp,
    young_interval,
)
from distlab.grading import CheckFailed, find_exercise, lab12

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = [pytest.mark.timeout(300)]


# ---------------------------------------------------------------- 12.1: what the checkpoint holds, how the loop runs

class WeightsOnly(TrainState):
    """Forgets the optimizer: Adam restarts from zero moments after a resume."""

    def state_dict(self):
        model_state, _ = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "data": self.data.state_dict(), "step": self.step}

    def load_state_dict(self, state):
        self.model.load_state_dict(state["model"])
        self.data.load_state_dict(state["data"])
        self.step = state["step"]


class NoDataPosition(TrainState):
    """Forgets where the data order was: the resumed job trains on batches it has seen."""

    def state_dict(self):
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state, "step": self.step}

    def load_state_dict(self, state):
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.step = state["step"]


def loop_with(state_class=TrainState, resume=True, honour_fault=True, name_by_index=False, recorders=(0,)):
    """The notebook's loop, with one of the usual mistakes switched on; ``recorders``: the ranks that append to
    the metrics log."""

    def train_resumable(ckpt_dir, steps, save_every, *, attempt=0, fault=None, **setup_kwargs):
        setup = make_training(**setup_kwargs)
        state = state_class(setup.model, setup.optimizer, setup.order)
        log = MetricsLog(Path(ckpt_dir) / "metrics.jsonl")
        latest = latest_checkpoint(ckpt_dir) if resume else None
        if latest is not None:
            load_checkpoint({"train": state}, latest)
        losses = {}
        for step in range(state.step, steps):
            if fault is not None and honour_fault:
                fault.maybe_kill(dist.get_rank(), step)
            losses[step] = train_step_ddp(setup, setup.order.next_batch())
            if dist.get_rank() in recorders:
                log.append(attempt=attempt, step=step, loss=losses[step])
            state.step = step if name_by_index else step + 1  # off by one: the step index, not the updates done
            if (step + 1) % save_every == 0:
                save_checkpoint({"train": state}, ckpt_dir, step + 1, fault=fault if honour_fault else None)
        return losses

    return train_resumable


def _resume_case(where):
    return next(c for c in lab12._resume_cases(random.Random(lab12._seed() + 1)) if c["fault"].where == where)


RESUME_MISTAKES = [
    ("never calls fault.maybe_kill", loop_with(honour_fault=False), "train",
     r"the first attempt finished, but rank \d should have been killed: call fault.maybe_kill"),
    ("never loads the checkpoint", loop_with(resume=False), "train",
     r"began at step 0, but the last complete checkpoint holds \d+ steps: .*load latest_checkpoint"),
    ("saves the weights but not Adam", loop_with(WeightsOnly), "save",
     r"does not hold the optimizer state \(Adam's moments and step count\)"),
    ("saves no data position", loop_with(NoDataPosition), "save", r"does not hold the data order's position"),
    ("stores the step index, one short", loop_with(name_by_index=True), "train",
     r"began at step \d+, but the last complete checkpoint holds \d+ steps: one step short: .* must store step ="),
    ("every rank records its loss", loop_with(recorders=range(8)), "train",
     r"the metrics log records step \d+ of attempt 1 \d times: only rank 0 records \(if rank == 0\)"),
    ("no rank records", loop_with(recorders=()), "train",
     r"the metrics log holds no record of attempt 1: let rank 0 call log.append"),
]


@pytest.mark.parametrize("name,loop,where,message", RESUME_MISTAKES, ids=[m[0] for m in RESUME_MISTAKES])
def test_resumable_training_mistakes_are_named(name, loop, where, message):
    case = _resume_case(where)
    with pytest.raises(CheckFailed, match=message):
        lab12._resume_case(loop, case, lab12._uninterrupted(case))


# ---------------------------------------------------------------- 12.2: replica hashes

def float_sum_detector(model):
    """Compares float sums: blind to a flip of the last mantissa bit."""
    mine = torch.tensor([float(p.detach().sum()) for p in model.parameters()], dtype=torch.float64)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    out = {}
    for j, (name, _) in enumerate(model.named_parameters()):
        values = [float(g[j]) for g in gathered]
        for rank, value in enumerate(values):
            if value != statistics.mode(values):
                out.setdefault(rank, []).append(name)
    return out


def only_my_own_verdict(model):
    """Each rank reports only itself: the ranks disagree about the verdict."""
    return {r: n for r, n in find_divergent_replicas(model).items() if r == dist.get_rank()}


def rank_zero_is_the_reference(model):
    """Compares every replica with rank 0's: when rank 0 is the corrupted one, it names all the others."""
    mine = torch.tensor([fingerprint(p) for p in model.parameters()], dtype=torch.int64)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    out = {}
    for rank, theirs in enumerate(gathered):
        for j, (name, _) in enumerate(model.named_parameters()):
            if theirs[j] != gathered[0][j]:
                out.setdefault(rank, []).append(name)
    return out


def one_hash_per_model(model):
    """One fingerprint for the whole model: the corrupted rank is found, but every parameter is blamed."""
    mine = torch.tensor([sum(fingerprint(p) for p in model.parameters()) % 2**62], dtype=torch.int64)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    majority = statistics.mode(int(g) for g in gathered)
    names = [n for n, _ in model.named_parameters()]
    return {rank: names for rank, g in enumerate(gathered) if int(g) != majority}


def names_the_intact(model):
    """``==`` for ``!=``: names, for every replica, the parameters that agree with the majority."""
    mine = torch.tensor([fingerprint(p) for p in model.parameters()], dtype=torch.int64)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    out = {}
    for j, (name, _) in enumerate(model.named_parameters()):
        majority = statistics.mode(int(g[j]) for g in gathered)
        for rank, theirs in enumerate(gathered):
            if int(theirs[j]) == majority:
                out.setdefault(rank, []).append(name)
    return out


SDC_MISTAKES = [
    ("== for !=", names_the_intact, r"fingerprints agree with the other replicas..*differs \(!=\) from the most"),
    ("float sums", float_sum_detector, r"bit 0 of .*one unit in the last place.*hash the bits"),
    ("each rank only itself", only_my_own_verdict, r"every rank must reach the same verdict"),
    ("rank 0 as the reference", rank_zero_is_the_reference,
     r"rank 0 is itself corrupted here.*the most common fingerprint"),
    ("one hash per model", one_hash_per_model, r"parameters whose bits are intact; fingerprint each parameter"),
]


@pytest.mark.parametrize("name,detector,message", SDC_MISTAKES, ids=[m[0] for m in SDC_MISTAKES])
def test_sdc_detector_mistakes_are_named(name, detector, message):
    result = distlab.check("12.2", detector, quiet=True)
    assert result.status == "failed", result
    assert re.search(message, result.detail), result.detail


# ---------------------------------------------------------------- 12.3: the guard

class GullibleGuard(SpikeGuard):
    """Lets every step into its history: a long bad stretch becomes the new normal."""

    def decide(self, loss, grad_norm):
        decision = super().decide(loss, grad_norm)
        if decision != "ok" and math.isfinite(loss) and math.isfinite(grad_norm):
            self.losses.append(loss)
            self.grad_norms.append(grad_norm)
        return decision


class NanBlindGuard(SpikeGuard):
    """Compares with the median only: ``nan > limit`` is False, so a NaN step passes."""

    def decide(self, loss, grad_norm):
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return "ok"
        return super().decide(loss, grad_norm)


class LossOnlyGuard(SpikeGuard):
    """Never looks at the gradient norm."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.grad_factor = math.inf


class NeverRollsBack(SpikeGuard):
    """Skips every bad step, however many come in a row."""

    def decide(self, loss, grad_norm):
        decision = super().decide(loss, grad_norm)
        return "skip" if decision == "rollback" else decision


class CountNeverResets(SpikeGuard):
    """Does not start counting again after a rollback: the next bad step in a row is a rollback too."""

    def decide(self, loss, grad_norm):
        decision = super().decide(loss, grad_norm)
        if decision == "rollback":
            self.bad_in_a_row = self.patience - 1
        return decision


class BadAtTheLimit(SpikeGuard):
    """``>=`` for "exceeds": a loss or gradient norm exactly at factor × the median counts as a spike."""

    def _problem(self, loss, grad_norm):
        problem = super()._problem(loss, grad_norm)
        if problem or len(self.losses) < self.warmup:
            return problem
        at_limit = (loss >= self.loss_factor * statistics.median(self.losses)
                    or grad_norm >= self.grad_factor * statistics.median(self.grad_norms))
        return "at the limit" if at_limit else ""


class WarmupOneLate(SpikeGuard):
    """``len(history) > warmup``: the first step after warm-up is never tested."""

    def _problem(self, loss, grad_norm):
        if len(self.losses) == self.warmup and math.isfinite(loss) and math.isfinite(grad_norm):
            return ""
        return super()._problem(loss, grad_norm)


class EitherFinite(SpikeGuard):
    """``isfinite(loss) or isfinite(grad_norm)``: a NaN gradient norm beside a finite loss reaches the median tests,
    where every comparison with NaN is False."""

    def _problem(self, loss, grad_norm):
        if math.isfinite(loss) == math.isfinite(grad_norm):
            return super()._problem(loss, grad_norm)
        if len(self.losses) < self.warmup:
            return ""
        spike = (loss > self.loss_factor * statistics.median(self.losses)
                 or grad_norm > self.grad_factor * statistics.median(self.grad_norms))
        return "spike" if spike else ""


GUARD_MISTAKES = [
    ("bad steps enter the history", GullibleGuard, r"Only good steps enter the history"),
    ("NaN passes", NanBlindGuard, r"NaN compares False with everything.*math.isfinite"),
    ("loss only", LossOnlyGuard, r"gradient norm spiked: compare it with its own recent median"),
    ("never rolls back", NeverRollsBack, r"patience-th bad step in a row asks for 'rollback'"),
    ("count never resets", CountNeverResets, r"Too early for 'rollback'.*after a rollback"),
    ("at the limit is bad (>=)", BadAtTheLimit, r"exactly factor × the recent median.*\(>\), not at it \(>=\)"),
    ("warm-up one step late", WarmupOneLate, r"first step with warmup = \d good steps known.*len\(history\) >= warmup"),
    ("isfinite(loss) or isfinite(grad_norm)", EitherFinite, r"NaN compares False with everything.*gradient norm"),
]


@pytest.mark.parametrize("name,guard,message", GUARD_MISTAKES, ids=[m[0] for m in GUARD_MISTAKES])
def test_guard_mistakes_are_named(name, guard, message):
    result = distlab.check("12.3", guard, quiet=True)  # fails on the hidden sequences, before the DDP run
    assert result.status == "failed", result
    assert re.search(r"sequence \d+ .* at step \d+ .*the reference answers", result.detail), result.detail
    assert re.search(message, result.detail), result.detail


# ---------------------------------------------------------------- 12.4: the cadence

CADENCE_MISTAKES = [
    ("sqrt(δM)", job_mtbf_hours, lambda d, m: math.sqrt(d * m), r"misses the 2 from τ/\(2M\)"),
    ("sqrt(4δM)", job_mtbf_hours, lambda d, m: math.sqrt(4 * d * m), r"the lost work per failure is τ/2, not τ"),
    ("one GPU's MTBF", lambda n: job_mtbf_hours(n) * n, young_interval, r"one GPU's MTBF"),
    ("Llama 3's MTBF for every size", lambda n: job_mtbf_hours(16_384), young_interval, r"scale it by 16,384 / N"),
    ("days", lambda n: job_mtbf_hours(n) / 24, young_interval, r"that is in days; the answer is in hours"),
    ("minutes", lambda n: job_mtbf_hours(n) * 60, young_interval, r"that is in minutes"),
    ("419 read as 420 interruptions", lambda n: 54 * 24 / 420 * 16_384 / n, young_interval,
     r"= 3\.085714 h, expected 3\.093079 h: Llama 3 saw 419 interruptions in 54 days"),
    ("sqrt(3δM)", job_mtbf_hours, lambda d, m: math.sqrt(3 * d * m), r"Young's interval is sqrt\(2 δ M\)"),
]


@pytest.mark.parametrize("name,mtbf,interval,message", CADENCE_MISTAKES, ids=[m[0] for m in CADENCE_MISTAKES])
def test_cadence_mistakes_are_named(name, mtbf, interval, message):
    result = distlab.check("12.4", mtbf, interval, quiet=True)
    assert result.status == "failed" and re.search(message, result.detail), result.detail


# ---------------------------------------------------------------- quiz: a hint points to a section, gives nothing away

@pytest.mark.parametrize("question,wrong", [("Q12.1", 54 / 419), ("Q12.2", 13.6), ("Q12.3", "a"), ("Q12.4", "b"),
                                            ("Q12.5", "d"), ("Q12.6", "a"), ("Q12.7", 0.5)])
def test_a_wrong_quiz_answer_gets_a_hint_that_keeps_the_answer(question, wrong):
    result = distlab.check(question, wrong, quiet=True)
    assert result.status == "failed" and "section" in result.detail, result.detail
    answer = find_exercise(question).answer
    if isinstance(answer, float):
        assert f"{answer:.2g}" not in result.detail and f"{answer:.3g}" not in result.detail, result.detail
    for giveaway in ("sqrt", "√", "419", "24 hours", "half the ranks", "×", "·"):
        assert giveaway not in result.detail, (giveaway, result.detail)
