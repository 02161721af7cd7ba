"""Lab 12 checkers: the references pass, typical wrong answers fail with a message that names the cause,
and untouched stubs are "not attempted"."""

import math
import random
import statistics
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict

import distlab
from distlab.fault_tolerance import (
    SpikeGuard,
    TrainState,
    find_divergent_replicas,
    job_mtbf_hours,
    latest_checkpoint,
    load_checkpoint,
    make_training,
    resumable_train,
    save_checkpoint,
    train_step_ddp,
    young_interval,
)
from distlab.grading import CheckFailed, lab12

from processes import shared_ranks_end_here

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = [pytest.mark.timeout(300)]


@pytest.fixture(scope="module", autouse=True)
def ranks_end_with_the_module():
    """The checkers keep warm groups (``Ranks.shared``); they end with the module, and no rank may be left."""
    yield from shared_ranks_end_here()


# ---------------------------------------------------------------- answers a student might give

def reference_loop(ckpt_dir, steps, save_every, *, attempt=0, fault=None, **setup):
    return resumable_train(ckpt_dir, steps, save_every, attempt=attempt, fault=fault, **setup)["losses"]


class WeightsOnly(TrainState):
    """Forgets the optimizer: Adam restarts from zero moments after a resume."""

    def state_dict(self):
        model_state, _ = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "data": self.data.state_dict(), "step": self.step}

    def load_state_dict(self, state):
        self.model.load_state_dict(state["model"])
        self.data.load_state_dict(state["data"])
        self.step = state["step"]


def loop_with(state_class, resume=True, honour_fault=True):
    def train_resumable(ckpt_dir, steps, save_every, *, attempt=0, fault=None, **setup_kwargs):
        setup = make_training(**setup_kwargs)
        state = state_class(setup.model, setup.optimizer, setup.order)
        latest = latest_checkpoint(ckpt_dir) if resume else None
        if latest is not None:
            load_checkpoint({"train": state}, latest)
        losses = {}
        for step in range(state.step, steps):
            if fault is not None and honour_fault:
                fault.maybe_kill(dist.get_rank(), step)
            losses[step] = train_step_ddp(setup, setup.order.next_batch())
            state.step = step + 1
            if state.step % save_every == 0:
                save_checkpoint({"train": state}, ckpt_dir, state.step, fault=fault if honour_fault else None)
        return losses

    return train_resumable


def float_sum_detector(model):
    """Compares float sums: blind to a flip of the last mantissa bit."""
    mine = torch.tensor([float(p.detach().sum()) for p in model.parameters()], dtype=torch.float64)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    names = [n for n, _ in model.named_parameters()]
    out = {}
    for j, name in enumerate(names):
        values = [float(g[j]) for g in gathered]
        majority = statistics.mode(values)
        for rank, value in enumerate(values):
            if value != majority:
                out.setdefault(rank, []).append(name)
    return out


def only_my_own_verdict(model):
    """Each rank reports only itself: the ranks disagree about the verdict."""
    verdict = find_divergent_replicas(model)
    return {r: n for r, n in verdict.items() if r == dist.get_rank()}


class GullibleGuard(SpikeGuard):
    """Lets every step into its history: a long bad stretch becomes the new normal."""

    def decide(self, loss, grad_norm):
        decision = super().decide(loss, grad_norm)
        if decision != "ok" and math.isfinite(loss) and math.isfinite(grad_norm):
            self.losses.append(loss)
            self.grad_norms.append(grad_norm)
        return decision


def stub(*args, **kwargs):
    raise NotImplementedError("Exercise 12.1: replace this line with your solution")


class StubGuard(SpikeGuard):
    def decide(self, loss, grad_norm):
        raise NotImplementedError("Exercise 12.3: replace this line with your solution")


# ---------------------------------------------------------------- the references pass

def test_references_pass_every_checker():
    for exercise_id, code, detail in [
            ("12.4", (job_mtbf_hours, young_interval), "Young's interval"),
            ("12.3", (SpikeGuard,), "rolled back identically"),
            ("12.2", (find_divergent_replicas,), "a 1-ulp flip"),
            ("12.1", (reference_loop,), "matched the uninterrupted run bit for bit")]:
        result = distlab.check(exercise_id, *code, quiet=True)
        assert result.status == "passed" and result.points == result.max_points, result
        assert detail in result.detail


def test_quiz_answers_and_hints():
    answers = {"Q12.1": 3.093, "Q12.2": young_interval(60, 54 * 24 / 419 * 3600) / 60, "Q12.3": "b", "Q12.4": "c",
               "Q12.5": "c", "Q12.6": "b", "Q12.7": 2}
    for question, answer in answers.items():
        assert distlab.check(question, answer, quiet=True).status == "passed", question
    wrong = distlab.check("Q12.2", math.sqrt(60 * 11_134) / 60, quiet=True)
    assert wrong.status == "failed" and "sqrt(2·δ·M)" in wrong.detail


# ---------------------------------------------------------------- wrong answers fail clearly

def _one_resume_case(where="train"):
    return next(c for c in lab12._resume_cases(random.Random(lab12._SEED + 1)) if c["fault"].where == where)


def test_a_loop_that_ignores_the_fault_or_never_resumes_is_named():
    case = _one_resume_case()
    with pytest.raises(CheckFailed, match="the first attempt finished, but rank .* should have been killed"):
        lab12._resume_case(loop_with(TrainState, honour_fault=False), case)
    with pytest.raises(CheckFailed, match="began at step 0, but the last complete checkpoint holds .* started again "
                                          "from step 0"):
        lab12._resume_case(loop_with(TrainState, resume=False), case)


def test_a_checkpoint_without_optimizer_state_is_named():
    with pytest.raises(CheckFailed, match=r"step_\d+ does not hold the optimizer state \(Adam's moments"):
        lab12._resume_case(loop_with(WeightsOnly), _one_resume_case("save"))


def test_sdc_detectors_that_compare_floats_or_disagree_fail():
    with pytest.raises(CheckFailed, match="bit 0 of .*one unit in the last place.*hash the bits"):
        lab12.check_sdc_detector(float_sum_detector)
    with pytest.raises(CheckFailed, match="every rank must reach the same verdict"):
        lab12.check_sdc_detector(only_my_own_verdict)


def test_a_guard_that_learns_from_bad_steps_fails_with_the_step():
    with pytest.raises(CheckFailed, match=r"sequence \d+ .* at step \d+ .* the reference answers "
                                          r"'(skip|rollback)'.*Only good steps enter the history"):
        lab12.check_spike_guard(GullibleGuard)


def test_cadence_mistakes_get_their_hint():
    with pytest.raises(CheckFailed, match="misses the 2 from τ/\\(2M\\)"):
        lab12.check_checkpoint_cadence(job_mtbf_hours, lambda d, m: math.sqrt(d * m))
    with pytest.raises(CheckFailed, match="one GPU's MTBF"):
        lab12.check_checkpoint_cadence(lambda n: job_mtbf_hours(n) * n, young_interval)


@pytest.mark.parametrize("exercise_id,code", [("12.1", (stub,)), ("12.2", (stub,)), ("12.3", (StubGuard,)),
                                               ("12.4", (stub, stub))])
def test_stub_is_not_attempted(exercise_id, code, capsys):
    result = distlab.check(exercise_id, *code)
    assert result.status == "not attempted" and result.points == 0
    assert "(not attempted)" in capsys.readouterr().out
