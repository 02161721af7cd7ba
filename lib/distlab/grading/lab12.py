"""Lab 12 — fault tolerance. Checkers run the student's code on real gloo ranks, with real faults.

* 12.1 the resumable loop: a rank is SIGKILLed mid-training (or mid-save), the
  supervisor relaunches the job, and the resumed losses and the final checkpoint
  must equal an uninterrupted run of the reference loop *bit for bit*. A mismatch is
  traced to its cause by reading the student's checkpoint: which entry is missing or
  differs (weights, Adam moments, data position, step).
* 12.2 the replica-hash detector: bits flipped in one or two replicas' parameters
  (the last mantissa bit included, which no float comparison sees); every rank must
  name exactly the corrupted ranks and parameters, and nothing on a clean run.
* 12.3 the spike/NaN guard: hidden loss and gradient-norm sequences against
  :class:`~distlab.fault_tolerance.guards.SpikeGuard`, then one guarded DDP run
  with bad batches whose decisions and final weights must equal the reference's.
* 12.4 Young's interval and the job MTBF from Llama 3's failure rate.

Cases come from the lab's seed, fixed in self-study, so notebook outputs are reproducible;
graded, from the grader's seed (:func:`~distlab.grading.harness.lab_seed`).
"""

from __future__ import annotations

import math
import random
import statistics
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from distlab.fault_tolerance.cadence import LLAMA3, job_mtbf_hours, young_interval
from distlab.fault_tolerance.checkpoint import checkpoint_path, read_checkpoint
from distlab.fault_tolerance.faults import Fault, flip_bit
from distlab.fault_tolerance.guards import SpikeGuard, guarded_train
from distlab.fault_tolerance.resume import MetricsLog, resumable_train, run_with_restarts
from distlab.grading import quiz
from distlab.grading.contract import CheckFailed
from distlab.grading.harness import JOB_TIMEOUT, Edge, case_drawn, lab_seed, max_difference
from distlab.grading.registry import Exercise
from distlab.model import GPT, GPTConfig
from distlab.runtime.launch import Ranks


def _seed() -> int:
    """This lab's seed for its hidden cases, read as each check runs (:func:`~distlab.grading.harness.lab_seed`)."""
    return lab_seed(12)


__all__ = ["EXERCISES", "check_resumable_training", "check_sdc_detector", "check_spike_guard",
           "check_checkpoint_cadence"]


def _ranks(world: int):
    return Ranks.shared(world)  # the notebook's warm groups: no rank start per check


def _tiny_cfg(rng: random.Random) -> GPTConfig:
    n_head = rng.choice([2, 4])
    return GPTConfig(vocab_size=rng.choice([64, 96]), seq_len=rng.choice([16, 24]), n_layer=rng.randint(1, 2),
                     n_head=n_head, d_model=n_head * rng.choice([8, 12]))


# ---------------------------------------------------------------- 12.1

def _resume_cases(rng: random.Random) -> list[dict]:
    cases = []
    for where in ("train", "save"):
        world = rng.choice([2, 3])
        save_every = 3
        steps = save_every * 3
        batch = world * rng.choice([1, 2])
        fault_step = rng.choice([4, 5, 7]) if where == "train" else 2 * save_every
        setup = dict(cfg=_tiny_cfg(rng), batch_size=batch, lr=rng.choice([3e-3, 1e-2]), seed=rng.randrange(1000),
                     data_seed=rng.randrange(1000), n_items=batch * 2 + rng.randrange(1, batch))  # epochs wrap
        resume_at = (fault_step // save_every) * save_every if where == "train" else fault_step - save_every
        cases.append(dict(world=world, steps=steps, save_every=save_every, setup=setup, resume_at=resume_at,
                          fault=Fault(rng.randrange(world), fault_step, where)))
    return cases


def _describe_case(case: dict) -> str:
    fault = case["fault"]
    how = "while writing step_%08d" % fault.step if fault.where == "save" else f"before step {fault.step}"
    return (f"{case['world']} ranks, {case['steps']} steps, a checkpoint every {case['save_every']}, "
            f"rank {fault.rank} killed {how}")


def _normalised(flat: dict) -> dict:
    """Drop the top-level key the state was saved under (``{"train": state}``): ``model.…``, ``optim.…``."""
    return {k.split(".", 1)[1] if "." in k else k: v for k, v in flat.items()}


_PARTS = {"model.": "the weights", "optim.state.": "the optimizer state (Adam's moments and step count)",
          "data.": "the data order's position", "step": "the step counter"}


def _compare_checkpoints(mine: dict, reference: dict, where: str) -> None:
    for prefix, what in _PARTS.items():
        ref_keys = [k for k in reference if k.startswith(prefix)]
        my_keys = [k for k in mine if k.startswith(prefix)]
        if not my_keys:
            raise CheckFailed(f"{where} does not hold {what} (no '{prefix}…' entry): state_dict() must return "
                              f"model, optim, data and step, or a resumed job cannot continue exactly")
        for key in ref_keys:
            if key not in mine:
                raise CheckFailed(f"{where} lacks {key} ({what})")
            a, b = mine[key], reference[key]
            same = torch.equal(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else a == b
            if not same:
                detail = (f"by up to {max_difference(a, b)[0]:.3g}"
                          if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                          else f"({a!r} instead of {b!r})")
                raise CheckFailed(f"{where}: {key} ({what}) differs from the uninterrupted run's {detail}: save "
                                  f"after the optimizer step, and name the checkpoint by the number of updates "
                                  f"it holds")


def _uninterrupted(case: dict) -> dict:
    """The reference run of a case (its losses, and every checkpoint it saved, read), held here. Run before the
    student's code runs on the ranks and read before it could rewrite the files: ranks and files it touched are
    the student's."""
    with tempfile.TemporaryDirectory(prefix="distlab-check12-") as tmp:
        reference = _ranks(case["world"]).run(resumable_train, args=(tmp, case["steps"], case["save_every"]),
                                              kwargs=case["setup"], show_output=False, timeout=JOB_TIMEOUT)[0]
        saved = {step: _normalised(read_checkpoint(checkpoint_path(tmp, step)))
                 for step in range(0, case["steps"] + 1) if checkpoint_path(tmp, step).is_dir()}
    return {**reference, "checkpoints": saved}


def _resume_case(train_resumable, case: dict, reference: dict) -> None:
    ranks = _ranks(case["world"])
    where_text = _describe_case(case)
    with tempfile.TemporaryDirectory(prefix="distlab-check12-") as tmp:
        my_dir = Path(tmp, "yours")
        report = run_with_restarts(train_resumable, case["world"], str(my_dir), ranks=ranks, max_restarts=2,
                                   kwargs=dict(case["setup"], steps=case["steps"], save_every=case["save_every"]),
                                   faults={0: case["fault"]}, timeout=JOB_TIMEOUT)
        if report.attempts[0].outcome == "finished":
            fault = case["fault"]
            raise CheckFailed(f"{where_text}: the first attempt finished, but rank {fault.rank} should have been "
                              "killed: call fault.maybe_kill(rank, step) before every step and pass fault=fault "
                              "to save_checkpoint")
        if len(report.attempts) > 2:
            raise CheckFailed(f"{where_text}: the resumed job failed again ({report.attempts[1].outcome})")
        losses = report.run[0]
        if not isinstance(losses, dict) or not losses:
            raise CheckFailed(f"{where_text}: train_resumable must return {{step: loss}} for the steps it ran, "
                              f"got {type(losses).__name__}")
        start = min(losses)
        if start != case["resume_at"]:
            if start == 0:
                why = "it started again from step 0: load latest_checkpoint(ckpt_dir) and continue from its step"
            elif start == case["resume_at"] - 1:
                why = (f"one step short: the checkpoint named step_{case['resume_at']:08d} must store step = "
                       f"{case['resume_at']}, the number of updates done (the index of the last step plus one)")
            else:
                why = "continue from the step stored in the latest committed checkpoint"
            raise CheckFailed(f"{where_text}: the restarted job began at step {start}, but the last complete "
                              f"checkpoint holds {case['resume_at']} steps: {why}")
        resume_dir = checkpoint_path(my_dir, start)
        if start and resume_dir.is_dir():
            _compare_checkpoints(_normalised(read_checkpoint(resume_dir)), reference["checkpoints"][start],
                                 resume_dir.name)
        for step in sorted(losses):
            if step not in reference["losses"]:
                raise CheckFailed(f"{where_text}: returned a loss for step {step}, beyond the {case['steps']} steps")
            if losses[step] != reference["losses"][step]:
                first = step == start
                cause = ("the first step after resuming already differs: the weights or the data order were not "
                         "restored (load_state_dict must restore model, optim and data)" if first else
                         "the first resumed step matched but a later one did not: the optimizer state (Adam's "
                         "moments and step) was not restored")
                raise CheckFailed(f"{where_text}: after resuming at step {start}, the loss of step {step} is "
                                  f"{losses[step]!r}, the uninterrupted run's {reference['losses'][step]!r}: {cause}")
        missing = [s for s in range(start, case["steps"]) if s not in losses]
        if missing:
            raise CheckFailed(f"{where_text}: the resumed job skipped steps {missing}")
        _check_metrics_log(MetricsLog(my_dir / "metrics.jsonl"), len(report.attempts) - 1, losses, where_text)
        final = checkpoint_path(my_dir, case["steps"])
        if not final.is_dir():
            raise CheckFailed(f"{where_text}: no final checkpoint {final.name}: save every save_every steps, "
                              f"including the last")
        _compare_checkpoints(_normalised(read_checkpoint(final)), reference["checkpoints"][case["steps"]],
                             final.name)


def _check_metrics_log(log: MetricsLog, attempt: int, losses: dict, where: str) -> None:
    """The resumed attempt's records: rank 0's, one per step it ran, each with that step's loss (the log is what
    a crash leaves behind, so a record per rank, or none, defeats it)."""
    records = [r for r in log.read() if r.get("attempt") == attempt]
    if not records:
        raise CheckFailed(f"{where}: the metrics log holds no record of attempt {attempt}: let rank 0 call "
                          f"log.append(attempt=attempt, step=step, loss=loss) after each step")
    steps = [r.get("step") for r in records]
    repeated = sorted({s for s in steps if steps.count(s) > 1})
    if repeated:
        raise CheckFailed(f"{where}: the metrics log records step {repeated[0]} of attempt {attempt} "
                          f"{steps.count(repeated[0])} times: only rank 0 records (if rank == 0), once per step")
    if sorted(steps) != sorted(losses):
        raise CheckFailed(f"{where}: the metrics log records steps {sorted(steps)} of attempt {attempt}, the "
                          f"attempt ran {sorted(losses)}: record each step after it trained")
    for record in records:
        if record.get("loss") != losses[record["step"]]:
            raise CheckFailed(f"{where}: the metrics log's loss of step {record['step']} is {record.get('loss')!r}, "
                              f"the step returned {losses[record['step']]!r}: record the loss train_step_ddp "
                              f"returned")


def check_resumable_training(train_resumable) -> str:
    """12.1: ``train_resumable(ckpt_dir, steps, save_every, *, attempt, fault, **setup)`` → ``{step: loss}``."""
    cases = _resume_cases(random.Random(_seed() + 1))
    references = [_uninterrupted(case) for case in cases]  # before any of the student's code runs on the ranks
    for case, reference in zip(cases, references):
        case_drawn("12.1", where=case["fault"].where, wraps=case["setup"]["n_items"] % case["setup"]["batch_size"] != 0)
        _resume_case(train_resumable, case, reference)
    return (f"{len(cases)} killed runs ({'; '.join(_describe_case(c) for c in cases)}): each resumed from the "
            f"last complete checkpoint and matched the uninterrupted run bit for bit")


# ---------------------------------------------------------------- 12.2

def _sdc_worker(detect_sdc, cfg: GPTConfig, seed: int, flips: list[tuple[int, str, int, int]]) -> dict:
    model = GPT(cfg, seed=seed)
    params = dict(model.named_parameters())
    for rank, name, index, bit in flips:
        if rank == dist.get_rank():
            flip_bit(params[name].data, index, bit)
    verdict = detect_sdc(model)
    return {int(r): sorted(names) for r, names in dict(verdict or {}).items()}


def _sdc_cases(rng: random.Random) -> list[dict]:
    cases = []
    for kind in ("mantissa", "exponent", "two replicas", "clean"):
        world = 4 if kind == "two replicas" else rng.choice([3, 4])
        cfg = _tiny_cfg(rng)
        # matrices only: their entries are random and non-zero, so a last-bit flip is one ulp of a real value
        # (a bias starts at zero, and a flipped zero becomes a subnormal that even a float sum sees)
        shapes = {n: p.numel() for n, p in GPT(cfg).named_parameters() if p.dim() == 2}
        names = list(shapes)
        flips = []
        if kind != "clean":
            # two corrupted replicas, one of them rank 0: a detector that trusts rank 0 as the reference fails
            ranks = [0, rng.randrange(1, world)] if kind == "two replicas" else rng.sample(range(world), 1)
            targets = rng.sample([n for n in names if shapes[n] > 8], len(ranks))  # a clear majority per parameter
            for rank, name in zip(ranks, targets):
                bit = 0 if kind == "mantissa" else rng.choice([0, 12, 30])
                flips.append((rank, name, rng.randrange(shapes[name]), bit))
        cases.append(dict(kind=kind, world=world, cfg=cfg, seed=rng.randrange(1000), flips=flips))
    return cases


def _sdc_hint(case: dict, expected: dict[int, list[str]], got: dict[int, list[str]]) -> str:
    """Name the usual mistake behind a wrong verdict: a float comparison, a reference rank, one hash per model."""
    if 0 in expected and set(got) - set(expected):
        return (": rank 0 is itself corrupted here, so every replica differs from it; take the most common "
                "fingerprint of each parameter as the reference, not rank 0's")
    too_many = [r for r, names in got.items() if r in expected and set(names) > set(expected[r])]
    if too_many:
        return (f": rank {too_many[0]} is named with parameters whose bits are intact; fingerprint each parameter "
                f"separately and name only those that differ from the majority")
    intact = [r for r, names in got.items() if names and not set(names) & set(expected.get(r, []))]
    if intact:
        return (f": rank {intact[0]} is named with parameters whose fingerprints agree with the other replicas'; a "
                f"replica is corrupted where its fingerprint differs (!=) from the most common one")
    missed = [r for r in expected if got.get(r) != expected[r]]
    flip = next((f for f in case["flips"] if missed and f[0] == missed[0]), None)
    if flip is not None and flip[3] == 0:
        return (": a flip of the last mantissa bit changes the value by one unit in the last place, which "
                "allclose, a float sum or a float comparison cannot see; hash the bits (view the tensor as integers)")
    return ""


def check_sdc_detector(detect_sdc) -> str:
    """12.2: ``detect_sdc(model)`` on every rank → ``{rank: [parameter names]}`` of corrupted replicas."""
    cases = _sdc_cases(random.Random(_seed() + 2))
    for case in cases:
        case_drawn("12.2", kind=case["kind"], bits={f[3] for f in case["flips"]}, ranks={f[0] for f in case["flips"]})
        expected: dict[int, list[str]] = {}
        for rank, name, _, _ in case["flips"]:
            expected.setdefault(rank, []).append(name)
        expected = {r: sorted(set(n)) for r, n in expected.items()}
        run = _ranks(case["world"]).run(_sdc_worker, args=(detect_sdc, case["cfg"], case["seed"], case["flips"]),
                                        show_output=False, timeout=JOB_TIMEOUT)
        flips = "; ".join(f"rank {r} bit {b} of {n}[{i}]" for r, n, i, b in case["flips"]) or "no bit flipped"
        for rank, verdict in enumerate(run):
            if verdict != run[0]:
                raise CheckFailed(f"{case['world']} replicas, {flips}: rank {rank} answered {verdict}, rank 0 "
                                  f"{run[0]}: every rank must reach the same verdict from the same gathered hashes")
        got = run[0]
        if got == expected:
            continue
        if not expected:
            raise CheckFailed(f"{case['world']} identical replicas: you reported {got}, but no bit was flipped")
        raise CheckFailed(f"{case['world']} replicas, {flips}: expected {expected}, got {got}"
                          f"{_sdc_hint(case, expected, got)}")
    return (f"{len(cases)} cases on 3-4 replicas (a 1-ulp flip, an exponent flip, two corrupted replicas, a clean "
            f"run): every rank named exactly the corrupted replicas and parameters")


# ---------------------------------------------------------------- 12.3

# Losses and gradient norms are multiples of 2^-16 and the factors dyadic (1.5, 1.75, 5), so a value set to exactly
# factor × the median is that product, and its quotient by the median that factor, in any order a guard computes
# them: "exceeds" is then decided at the limit itself, never by a rounding.
_GRID = 2.0**16


def _on_grid(value: float) -> float:
    return round(value * _GRID) / _GRID


def _sequence(rng: random.Random, n: int, events: dict[int, str]) -> list[tuple[float, float]]:
    """``n`` steps of a slowly falling loss and a gradient norm at a random scale (a median near 1 would make
    ``grad_factor × median`` and ``grad_factor / median`` agree), with ``events`` at their steps; the two
    at-the-limit events are placeholders, set from the history when they are reached (:func:`_at_limit`)."""
    loss, scale, out = rng.uniform(3.0, 6.0), rng.choice([0.05, 0.3, 4.0, 40.0]), []
    for i in range(n):
        loss *= rng.uniform(0.96, 1.0)
        grad = rng.uniform(0.5, 1.5) * scale
        event = events.get(i)
        if event == "nan":
            out.append((float("nan"), float("nan")))
        elif event == "inf_grad":
            out.append((loss, float("inf")))
        elif event == "nan_grad":  # a finite loss beside a NaN gradient norm: `and`, not `or`, of the two tests
            out.append((loss, float("nan")))
        elif event == "spike":
            out.append((loss * rng.uniform(2.0, 4.0), grad * rng.uniform(1.0, 2.0)))
        elif event == "grad":
            out.append((loss, grad * rng.uniform(8.0, 20.0)))
        elif event == "mild":
            out.append((loss * rng.uniform(1.05, 1.2), grad))
        else:
            out.append((loss, grad))
        out[-1] = tuple(_on_grid(v) if math.isfinite(v) else v for v in out[-1])
    return out


def _at_limit(event: str | None, step: tuple[float, float], reference: SpikeGuard) -> tuple[float, float]:
    """The step as the guard sees it: a loss, or a gradient norm, of exactly the limit of the history so far (it
    does not exceed it, so the step is good)."""
    loss, grad = step
    if event == "loss_at_limit":
        return reference.loss_factor * statistics.median(reference.losses), grad
    if event == "grad_at_limit":
        return loss, reference.grad_factor * statistics.median(reference.grad_norms)
    return step


def _guard_sequences(rng: random.Random) -> list[tuple[dict, dict[int, str], list[tuple[float, float]]]]:
    out = []
    for k in range(4):
        params = dict(window=rng.choice([6, 8, 16]), loss_factor=rng.choice([1.5, 1.75]), grad_factor=5.0,
                      patience=rng.choice([2, 3]), warmup=rng.choice([3, 4]))
        warmup = params["warmup"]
        plan = [
            # a NaN during warm-up, then one of each, a loss and a gradient norm exactly at their limits
            {1: "nan", 8: "spike", 12: "grad", 15: "mild", 17: "loss_at_limit", 19: "grad_at_limit",
             21: "nan_grad"},
            # a gradient-norm spike on the first step after warm-up; patience runs out: rollback, then again
            {warmup: "grad", 6: "spike", 7: "spike", 8: "spike", 9: "spike", 14: "nan"},
            {5: "inf_grad", 10: "spike", 11: "nan", 12: "grad", 13: "spike", 20: "spike"},
            # a long bad stretch from the first step after warm-up: the history must not absorb it
            {i: "spike" for i in range(warmup, warmup + 8)},
        ][k]
        out.append((params, plan, _sequence(rng, 24, plan)))
    return out


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def _guard_hint(expected: str, got: str, loss: float, grad: float, reason: str, event: str | None,
                known: int, warmup: int, same_history: bool) -> str:
    """What a guard that answers ``got`` where the reference answers ``expected`` most likely gets wrong; ``event``:
    the step's hidden event, ``known``: the good steps in the reference's history before it, ``same_history``:
    whether the guard's ``losses`` held the reference's before it (True when it keeps none under that name)."""
    if got == "ok" and not (math.isfinite(loss) and math.isfinite(grad)):
        return ("NaN compares False with everything, so a NaN passes a `loss > limit` test: check math.isfinite "
                "first, of the loss and of the gradient norm")
    if not same_history:
        return "Only good steps enter the history; medians of the last `window` good steps"
    if event in ("loss_at_limit", "grad_at_limit") and expected == "ok":
        return ("This value is exactly factor × the recent median, which it does not exceed: a step is bad above "
                "the limit (>), not at it (>=)")
    if got == "ok" and expected != "ok" and known == warmup:
        return (f"This is the first step with warmup = {warmup} good steps known: the spike tests apply once "
                f"len(history) >= warmup")
    if got == "ok" and reason.startswith("gradient-norm"):
        return "The loss looks normal here but the gradient norm spiked: compare it with its own recent median too"
    if expected == "rollback" and got == "skip":
        return "The patience-th bad step in a row asks for 'rollback': count bad steps, reset on a good one"
    if expected == "skip" and got == "rollback":
        return ("Too early for 'rollback': the count of bad steps in a row starts again after a good step and "
                "after a rollback")
    if expected == "ok" and known >= warmup:
        return ("This step is within both limits: its loss at most loss_factor × the median of the last `window` "
                "good losses, its gradient norm at most grad_factor × the median of their gradient norms")
    return "Only good steps enter the history; medians of the last `window` good steps"


def _check_sequences(guard_class, rng: random.Random) -> int:
    for index, (params, plan, sequence) in enumerate(_guard_sequences(rng)):
        mine, reference = guard_class(**params), SpikeGuard(**params)
        case_drawn("12.3", sequence=index, events=set(plan.values()),
                   spike_after_warmup=plan.get(params["warmup"]))
        for step, planned in enumerate(sequence):
            loss, grad = sequence[step] = _at_limit(plan.get(step), planned, reference)
            known = len(reference.losses)
            same_history = list(getattr(mine, "losses", reference.losses)) == list(reference.losses)
            expected, got = reference.decide(loss, grad), mine.decide(loss, grad)
            if got != expected:
                hint = _guard_hint(expected, got, loss, grad, reference.reason, plan.get(step), known,
                                   params["warmup"], same_history)
                recent = ", ".join(f"({_fmt(a)}, {_fmt(b)})" for a, b in sequence[max(0, step - 4):step])
                why = f" ({reference.reason})" if reference.reason else ""
                raise CheckFailed(
                    f"sequence {index + 1} with {params}: at step {step} (loss {_fmt(loss)}, gradient norm "
                    f"{_fmt(grad)}; the steps before: {recent}) the reference answers {expected!r}{why}, yours "
                    f"{got!r}. {hint}")
    return index + 1


def check_spike_guard(guard_class) -> str:
    """12.3: ``guard_class(window, loss_factor, grad_factor, patience, warmup).decide(loss, grad_norm)``."""
    n = _check_sequences(guard_class, random.Random(_seed() + 3))
    cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=2, d_model=16)
    kwargs = dict(bad={6: "garbage", 8: ("empty", (1,)), 9: ("empty", (1,)), 10: ("empty", (0,)), 12: "garbage"},
                  save_every=3, cfg=cfg, batch_size=4, lr=1e-2, n_items=16)
    ranks = _ranks(2)
    with tempfile.TemporaryDirectory(prefix="distlab-check12-") as tmp:
        reference = ranks.run(guarded_train, args=(str(Path(tmp, "reference")), 14, SpikeGuard(warmup=3)),
                              kwargs=kwargs, show_output=False, timeout=JOB_TIMEOUT)
        run = ranks.run(guarded_train, args=(str(Path(tmp, "yours")), 14, guard_class(warmup=3)), kwargs=kwargs,
                        show_output=False, timeout=JOB_TIMEOUT)
    want = [r["decision"] for r in reference[0]["records"]]
    for rank, out in enumerate(run):
        got = [r["decision"] for r in out["records"]]
        if got != want:
            step = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            raise CheckFailed(f"in a DDP run with bad batches, rank {rank} decided {got[step]!r} at step {step}, "
                              f"the reference {want[step]!r}")
        for name, value in out["weights"].items():
            if not torch.equal(value, reference[0]["weights"][name]):
                raise CheckFailed(f"after the guarded DDP run, rank {rank}'s {name} differs from the reference's")
    return (f"{n} hidden loss/gradient-norm sequences decided like the reference; a 2-rank DDP run with garbage and "
            f"batches empty on one rank skipped and rolled back identically ({want.count('skip')} skipped, "
            f"{want.count('rollback')} rolled back)")


# ---------------------------------------------------------------- 12.4

def _ratio_hint(ratio: float) -> str:
    for target, hint in ((1 / math.sqrt(2), "sqrt(δ·M) misses the 2 from τ/(2M): half an interval is lost per "
                                            "failure on average"),
                         (math.sqrt(2), "sqrt(4δM): the lost work per failure is τ/2, not τ"),
                         (0.5, "half of Young's interval?")):
        if abs(ratio - target) < 1e-3 * target:
            return f": {hint}"
    return ""


def check_checkpoint_cadence(job_mtbf, optimal_interval) -> str:
    """12.4: ``job_mtbf(n_gpus)`` in hours from Llama 3's rate, and Young's ``optimal_interval(δ, M)``."""
    rng = random.Random(_seed() + 4)
    for n_gpus in [16_384, 1024, 8] + [rng.choice([2**k for k in range(3, 16)]) for _ in range(3)]:
        case_drawn("12.4", n_gpus=n_gpus)
        got, want = float(job_mtbf(n_gpus)), job_mtbf_hours(n_gpus)
        if not math.isclose(got, want, rel_tol=1e-6):
            hint = ""
            if math.isclose(got, want * n_gpus, rel_tol=1e-6):
                hint = ": that is one GPU's MTBF; a job on N GPUs fails N times as often"
            elif math.isclose(got, want * n_gpus / 16_384, rel_tol=1e-6):
                hint = ": Llama 3's 3.1 h is for 16,384 GPUs; scale it by 16,384 / N"
            elif math.isclose(got, want / 24, rel_tol=1e-6):
                hint = ": that is in days; the answer is in hours"
            elif math.isclose(got, want * 60, rel_tol=1e-6):
                hint = ": that is in minutes; the answer is in hours"
            else:
                hint = (": Llama 3 saw 419 interruptions in 54 days (× 24 h) on 16,384 GPUs; the MTBF of a job on "
                        "N GPUs is that interval × 16,384 / N: check each of these numbers and the division")
            raise CheckFailed(f"job_mtbf({n_gpus}) = {got:.7g} h, expected {want:.7g} h{hint}")
    for _ in range(6):
        delta, mtbf = rng.uniform(5, 900), rng.uniform(1800, 200_000)
        got, want = float(optimal_interval(delta, mtbf)), young_interval(delta, mtbf)
        if not math.isclose(got, want, rel_tol=1e-6):
            hint = _ratio_hint(got / want) or (": Young's interval is sqrt(2 δ M), δ and M in seconds: check the "
                                               "factor 2 and that δ and M multiply")
            raise CheckFailed(f"optimal_interval(δ={delta:.1f} s, M={mtbf:.0f} s) = {got:.1f} s, expected "
                              f"{want:.1f} s{hint}")
    return "job MTBF for 8-32,768 GPUs and Young's interval on 6 random (δ, M) pairs"


# ---------------------------------------------------------------- quiz

# The boundaries each exercise's text names (harness.Edge; tests/grading/test_reference_seeds.py checks every seed's
# cases hold each): a rank killed mid-step and one killed while saving (the newest checkpoint half-written), data that
# wraps around an epoch; a last-bit flip, two corrupted replicas one of them rank 0, a clean run; every guard
# sequence (a NaN during warm-up, patience running out, a long bad stretch), a loss and a gradient norm exactly at
# their limits, a NaN gradient norm beside a finite loss, spikes on the first step after warm-up; Llama 3's own
# 16,384 GPUs and a few.
EDGES = {
    "12.1": [Edge("killed mid-step", lambda c: c["where"] == "train"),
             Edge("killed while saving", lambda c: c["where"] == "save"),
             Edge("an epoch that wraps", lambda c: c["wraps"])],
    "12.2": [Edge("a last-bit flip", lambda c: 0 in c["bits"]),
             Edge("two corrupted replicas, one of them rank 0",
                  lambda c: c["kind"] == "two replicas" and 0 in c["ranks"]),
             Edge("a clean run", lambda c: c["kind"] == "clean")],
    "12.3": [Edge(f"guard sequence {k + 1}", lambda c, k=k: c["sequence"] == k) for k in range(4)] + [
        Edge("a loss exactly at loss_factor × the median", lambda c: "loss_at_limit" in c["events"]),
        Edge("a gradient norm exactly at grad_factor × the median", lambda c: "grad_at_limit" in c["events"]),
        Edge("a NaN gradient norm beside a finite loss", lambda c: "nan_grad" in c["events"]),
        Edge("a loss spike on the first step after warm-up", lambda c: c["spike_after_warmup"] == "spike"),
        Edge("a gradient-norm spike on the first step after warm-up", lambda c: c["spike_after_warmup"] == "grad")],
    "12.4": [Edge("16,384 GPUs (Llama 3's own)", lambda c: c["n_gpus"] == 16_384),
             Edge("8 GPUs", lambda c: c["n_gpus"] == 8)],
}

# Surviving mutants of the solution cells that change nothing the exercises ask for (distlab notebooks mutants):
# key (as benchmarks/results/mutants.txt names it) → why it is equivalent.
EQUIVALENT_MUTANTS = {
    '12.1 off-by-one: `0` → `1`':
        'rank 1 records instead of rank 0: the same records, since train_step_ddp returns the loss averaged over ranks '
        'on every rank',
    '12.1 call-removed: `set_state_dict(self.model, self.optimizer, model_state_dict=state["mo…` → `pass`':
        'DCP loads in place into the tensors state_dict() returned, which for this DDP model and AdamW are the live '
        'parameters and optimizer states (get_state_dict initialises them), so set_state_dict only puts back what is '
        'already there; it matters under FSDP or for state that is not a tensor',
    '12.1 statements-swapped: `if fault is not None: fault.maybe_kill(rank, step) losses[step] = tra…` → `losses[step] '
    '= train_step_ddp(setup, setup.order.next_batch()) if fau…`':
        "the rank is killed after the step's compute instead of before it: nothing of that step is saved or recorded, "
        'so the job resumes from the same checkpoint',
    '12.1 statements-swapped: `if latest is not None: load_checkpoint({"train": state}, latest) loss…` → `losses = {} '
    'if latest is not None: load_checkpoint({"train": state}, …`':
        "two statements that do not read each other's names, in the other order",
    '12.1 statements-swapped: `if rank == 0: log.append(attempt=attempt, step=step, loss=losses[step…` → `state.step = '
    'step + 1 if rank == 0: log.append(attempt=attempt, step=…`':
        "two statements that do not read each other's names, in the other order (the record names the loop's step, not "
        'state.step)',
    '12.1 statements-swapped: `self.order.load_state_dict(state["data"]) self.step = state["step"]` → `self.step = '
    'state["step"] self.order.load_state_dict(state["data"])`':
        "two statements that do not read each other's names, in the other order",
    '12.1 statements-swapped: `set_state_dict(self.model, self.optimizer, model_state_dict=state["mo…` → '
    '`self.order.load_state_dict(state["data"]) set_state_dict(self.model, …`':
        "two statements that do not read each other's names, in the other order",
    '12.2 statements-swapped: `names = [name for name, _ in model.named_parameters()] mine = torch.t…` → `mine = '
    'torch.tensor([fingerprint(p) for _, p in model.named_parameter…`':
        "two statements that do not read each other's names, in the other order",
    '12.2 statements-swapped: `table = torch.stack(everyone) # [rank, parameter] suspects = {}` → `suspects = {} # '
    '[rank, parameter] table = torch.stack(everyone)`':
        "two statements that do not read each other's names, in the other order",
    '12.3 arithmetic: `grad_norm / statistics.median(self.grad_norms)` → `grad_norm * '
    'statistics.median(self.grad_norms)`':
        'only the text of self.reason changes (the ratio it prints); the exercise asks for a few words on why, and the '
        'checker grades the decisions',
    '12.3 arithmetic: `grad_norm / statistics.median(self.grad_norms)` → `grad_norm // '
    'statistics.median(self.grad_norms)`':
        'only the text of self.reason changes (the ratio it prints); the exercise asks for a few words on why, and the '
        'checker grades the decisions',
    '12.3 arithmetic: `loss / statistics.median(self.losses)` → `loss * statistics.median(self.losses)`':
        'only the text of self.reason changes (the ratio it prints); the exercise asks for a few words on why, and the '
        'checker grades the decisions',
    '12.3 arithmetic: `loss / statistics.median(self.losses)` → `loss // statistics.median(self.losses)`':
        'only the text of self.reason changes (the ratio it prints); the exercise asks for a few words on why, and the '
        'checker grades the decisions',
    '12.3 statements-swapped: `if not (math.isfinite(loss) and math.isfinite(grad_norm)): problem = …` → '
    '`self.bad_in_a_row += 1 if not (math.isfinite(loss) and math.isfinite(…`':
        'the count is raised before the tests instead of after: a good step resets it to 0 before returning, a bad one '
        'ends with the same count',
    '12.3 statements-swapped: `self.bad_in_a_row += 1 self.reason = problem` → `self.reason = problem '
    'self.bad_in_a_row += 1`':
        "two statements that do not read each other's names, in the other order",
    '12.3 statements-swapped: `self.grad_norms.append(grad_norm) self.bad_in_a_row, self.reason = 0,…` → '
    '`self.bad_in_a_row, self.reason = 0, "" self.grad_norms.append(grad_no…`':
        "two statements that do not read each other's names, in the other order",
    '12.3 statements-swapped: `self.losses.append(loss) self.grad_norms.append(grad_norm)` → '
    '`self.grad_norms.append(grad_norm) self.losses.append(loss)`':
        "two statements that do not read each other's names, in the other order",
    '12.3 statements-swapped: `self.reason = problem if self.bad_in_a_row >= self.patience: self.bad…` → `if '
    'self.bad_in_a_row >= self.patience: self.bad_in_a_row = 0 return "…`':
        "a rollback keeps the previous bad step's reason instead of its own: the same decisions (the reason is free "
        'text, and the step before a rollback was bad too)',
}

EXERCISES = [
    Exercise("12.1", "resumable training: exact resume after a killed rank", 4, check_resumable_training,
             references=("distlab.fault_tolerance.resume.resumable_train",)),
    Exercise("12.2", "replica hashes name the corrupted DP rank", 3, check_sdc_detector,
             references=("distlab.fault_tolerance.detect.find_divergent_replicas",)),
    Exercise("12.3", "loss-spike and NaN guard: skip or roll back", 3, check_spike_guard,
             references=("distlab.fault_tolerance.guards.SpikeGuard",)),
    Exercise("12.4", "checkpoint cadence from the failure rate", 2, check_checkpoint_cadence,
             references=("distlab.fault_tolerance.cadence.young_interval",
                         "distlab.fault_tolerance.cadence.job_mtbf_hours")),
    quiz.number("Q12.1", "Llama 3's job MTBF in hours", answer=54 * 24 / 419, rel_tol=0.02,
                hint="the section 'How often to checkpoint' (chapter §1) turns a failure count over a window into "
                     "a job's MTBF; mind the unit the question asks for",
                fixed="a published fact: Llama 3's 419 interruptions in 54 days"),
    quiz.number("Q12.2", "Young's interval in minutes for a {stall} s stall at Llama 3's MTBF", rel_tol=0.03,
                given=dict(stall=60), vary=dict(stall=(10, 20, 30, 120, 300)),
                solve=lambda stall: young_interval(stall, LLAMA3.job_mtbf_hours * 3600) / 60,
                hint="Young's interval, derived in the section 'How often to checkpoint' (chapter §1); keep the stall "
                     "and the MTBF in one unit and answer in minutes"),
    quiz.choice("Q12.3", "what an async checkpoint stalls training for", answer="b", options="abcd",
                hint="what does dcp.async_save do before it returns? (section 'Synchronous against asynchronous "
                     "checkpoints')"),
    quiz.choice("Q12.4", "what a checkpoint must hold for a bit-identical resume", answer="c", options="abcd",
                hint="which state changes the next step's batch and update? (section 'A killed rank, restarted')"),
    quiz.choice("Q12.5", "which detector sees a flip of the last mantissa bit", answer="c", options="abcd",
                hint="how big is the change, and which comparisons are exact? (section 'Silent data corruption')"),
    quiz.choice("Q12.6", "the loss spikes at step 28k", answer="b", options="abcd",
                hint="what happens if you replay the same batches? (section 'Loss spikes and NaNs')"),
    quiz.number("Q12.7", "bytes of each rank's shard after loading a {saved}-rank FSDP checkpoint on {loaded} ranks, "
                "vs at {saved}", rel_tol=0.01, given=dict(saved=4, loaded=2),
                vary=dict(saved=(2, 16, 32), loaded=(8, 16)),
                solve=lambda saved, loaded: saved / loaded,  # each rank holds 1/N of every tensor
                hint="what does each FSDP rank hold of every tensor, and what changes when the world size does? "
                     "(section 'Sharded checkpoints, another world size', chapter §3)"),
]
