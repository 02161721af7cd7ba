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
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from distlab.fault_tolerance.cadence import LLAMA3, job_mtbf_hours, young_interval
from distlab.fault_tolerance.checkpoint import checkpoint_path, read_checkpoint
from distlab.fault_tolerance.faults import Fault, flip_bit
from distlab.fault_tolerance.guards import SpikeGuard, guarded_train
from distlab.fault_tolerance.resume import resumable_train, run_with_restarts
from distlab.grading import quiz
from distlab.grading.contract import CheckFailed
from distlab.grading.harness import JOB_TIMEOUT, lab_seed, max_difference
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
        final = checkpoint_path(my_dir, case["steps"])
        if not final.is_dir():
            raise CheckFailed(f"{where_text}: no final checkpoint {final.name}: save every save_every steps, "
                              f"including the last")
        _compare_checkpoints(_normalised(read_checkpoint(final)), reference["checkpoints"][case["steps"]],
                             final.name)


def check_resumable_training(train_resumable) -> str:
    """12.1: ``train_resumable(ckpt_dir, steps, save_every, *, attempt, fault, **setup)`` → ``{step: loss}``."""
    cases = _resume_cases(random.Random(_seed() + 1))
    references = [_uninterrupted(case) for case in cases]  # before any of the student's code runs on the ranks
    for case, reference in zip(cases, references):
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

def _sequence(rng: random.Random, n: int, events: dict[int, str]) -> list[tuple[float, float]]:
    loss, out = rng.uniform(3.0, 6.0), []
    for i in range(n):
        loss *= rng.uniform(0.96, 1.0)
        grad = rng.uniform(0.5, 1.5)
        event = events.get(i)
        if event == "nan":
            out.append((float("nan"), float("nan")))
        elif event == "inf_grad":
            out.append((loss, float("inf")))
        elif event == "spike":
            out.append((loss * rng.uniform(2.0, 4.0), grad * rng.uniform(1.0, 2.0)))
        elif event == "grad":
            out.append((loss, grad * rng.uniform(8.0, 20.0)))
        elif event == "mild":
            out.append((loss * rng.uniform(1.05, 1.2), grad))
        else:
            out.append((loss, grad))
    return out


def _guard_sequences(rng: random.Random) -> list[tuple[dict, list[tuple[float, float]]]]:
    plans = [
        {1: "nan", 8: "spike", 12: "grad", 15: "mild"},  # a NaN during warm-up, then one of each
        {6: "spike", 7: "spike", 8: "spike", 9: "spike", 14: "nan"},  # patience runs out: rollback, then again
        {5: "inf_grad", 10: "spike", 11: "nan", 12: "grad", 13: "spike", 20: "spike"},
        {i: "spike" for i in range(6, 14)},  # a long bad stretch: the history must not absorb it
    ]
    out = []
    for plan in plans:
        params = dict(window=rng.choice([6, 8, 16]), loss_factor=rng.choice([1.5, 1.8]), grad_factor=5.0,
                      patience=rng.choice([2, 3]), warmup=rng.choice([3, 4]))
        out.append((params, _sequence(rng, 24, plan)))
    return out


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def _guard_hint(expected: str, got: str, loss: float, grad: float, reason: str) -> str:
    """What a guard that answers ``got`` where the reference answers ``expected`` most likely gets wrong."""
    if got == "ok" and not (math.isfinite(loss) and math.isfinite(grad)):
        return "NaN compares False with everything, so a NaN passes a `loss > limit` test: check math.isfinite first"
    if got == "ok" and reason.startswith("gradient-norm"):
        return "The loss looks normal here but the gradient norm spiked: compare it with its own recent median too"
    if expected == "rollback" and got == "skip":
        return "The patience-th bad step in a row asks for 'rollback': count bad steps, reset on a good one"
    if expected == "skip" and got == "rollback":
        return ("Too early for 'rollback': the count of bad steps in a row starts again after a good step and "
                "after a rollback")
    return "Only good steps enter the history; medians of the last `window` good steps"


def _check_sequences(guard_class, rng: random.Random) -> int:
    for index, (params, sequence) in enumerate(_guard_sequences(rng)):
        mine, reference = guard_class(**params), SpikeGuard(**params)
        for step, (loss, grad) in enumerate(sequence):
            expected, got = reference.decide(loss, grad), mine.decide(loss, grad)
            if got != expected:
                recent = ", ".join(f"({_fmt(a)}, {_fmt(b)})" for a, b in sequence[max(0, step - 4):step])
                why = f" ({reference.reason})" if reference.reason else ""
                raise CheckFailed(
                    f"sequence {index + 1} with {params}: at step {step} (loss {_fmt(loss)}, gradient norm "
                    f"{_fmt(grad)}; the steps before: {recent}) the reference answers {expected!r}{why}, yours "
                    f"{got!r}. {_guard_hint(expected, got, loss, grad, reference.reason)}")
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
            raise CheckFailed(f"job_mtbf({n_gpus}) = {got:.4g} h, expected {want:.4g} h{hint}")
    for _ in range(6):
        delta, mtbf = rng.uniform(5, 900), rng.uniform(1800, 200_000)
        got, want = float(optimal_interval(delta, mtbf)), young_interval(delta, mtbf)
        if not math.isclose(got, want, rel_tol=1e-6):
            raise CheckFailed(f"optimal_interval(δ={delta:.1f} s, M={mtbf:.0f} s) = {got:.1f} s, expected "
                              f"{want:.1f} s{_ratio_hint(got / want)}")
    return "job MTBF for 8-32,768 GPUs and Young's interval on 6 random (δ, M) pairs"


# ---------------------------------------------------------------- quiz

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
