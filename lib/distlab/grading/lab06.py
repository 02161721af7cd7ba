"""Lab 06 — pipeline parallelism. Checkers for partitions, schedules and the executor, and the quiz.

* 6.1 partitions: hidden layer counts and costs; an even split must be contiguous with
  sizes within one of each other, a balanced split must reach the smallest possible
  largest stage (found here by dynamic programming), counting the embedding on the first
  stage and the head on the last.
* 6.2/6.3/6.5 schedules: hidden ``(p, m, v)``, fewer micro-batches than stages included.
  A schedule is checked by what it does, not by its exact text: it must be valid and
  deadlock-free (:func:`~distlab.pipeline_parallel.validate`, which names the first
  problem), reach its schedule's bubble in the unit-time simulation, and hold no more
  micro-batches in flight than the schedule promises.
* 6.4 the executor: runs the student's executor on real gloo ranks under hidden
  schedules and shapes, and compares every rank's weights after an SGD step with the
  single-process run on the whole batch (1e-6); checks the timeline (one span per
  compute, in the schedule's order) and the traffic (``isend``/``irecv`` only, one
  activation or gradient per message).
* 6.6 a V schedule of one's own (ZB-V): hidden ``(p, m)``, fewer micro-batches than the V needs
  included; the schedule must place its stages in a V, split every backward, validate, hold no
  more than 1F1B's ``p`` micro-batches and idle no more than the library's ZB-V in unit time.
"""

from __future__ import annotations

import random

import torch

from distlab.grading import quiz
from distlab.grading.contract import CheckFailed, first_line
from distlab.grading.harness import WEIGHT_ATOL, lab_seed, max_difference, p2p_waits_counted, run_on_ranks
from distlab.grading.registry import Exercise
from distlab.grading.training_cases import update_factor
from distlab.model import GPT, GPTConfig, synthetic_batch
from distlab.pipeline_parallel import (
    ScheduleError,
    balanced_partition,
    bubble_fraction,
    check_partition,
    compute_spans,
    interleaved_bubble_fraction,
    interleaved_warmup,
    lm_loss,
    make_schedule,
    pipeline_worker,
    placement_of,
    reference_states,
    simulate,
    split_microbatches,
    stage_costs,
    stage_placement,
    validate,
    zero_bubble_v,
)
from distlab.runtime.errors import RankFailed
from distlab.tensor_parallel.theory import activation_message_bytes


def _seed() -> int:
    """This lab's seed for its hidden cases, read as each check runs (:func:`~distlab.grading.harness.lab_seed`)."""
    return lab_seed(6)


# every rank blocked in communication this long is a deadlock (a rank still computing is not): a message between
# stages of the checkers' tiny models takes milliseconds, so 6 s is headroom on a busy laptop and a wrong peer
# fails in seconds
COLLECTIVE_TIMEOUT = 6.0

__all__ = ["EXERCISES", "check_partitions", "check_schedules", "check_interleaved", "check_executor",
           "check_zero_bubble", "check_v_schedule"]


# ---------------------------------------------------------------- 6.1 partitions

def _as_ranges(result, where: str) -> list[range]:
    try:
        stages = list(result)
    except TypeError:
        raise CheckFailed(f"{where}: expected a list of ranges, got {type(result).__name__}") from None
    out = []
    for s, stage in enumerate(stages):
        if isinstance(stage, range) and stage.step == 1:
            out.append(stage)
            continue
        try:
            layers = [int(i) for i in stage]
        except TypeError:
            raise CheckFailed(f"{where}: stage {s} is {stage!r}, expected a range of layer indices") from None
        if layers != list(range(layers[0], layers[0] + len(layers))) if layers else True:
            raise CheckFailed(f"{where}: stage {s} holds layers {layers}: a stage is a run of consecutive layers")
        out.append(range(layers[0], layers[-1] + 1))
    return out


def _check_structure(stages: list[range], n_layers: int, n_stages: int, where: str) -> None:
    try:
        check_partition(stages, n_layers, n_stages)
    except ValueError as error:
        text = str(error)
        hint = (": the loop that makes the stages must run once per stage, n_stages times" if "stages, expected" in text
                else ": the last stage must end at n_layers: check how the bounds advance and where the remainder "
                     "layers go" if "but the model has" in text else "")
        raise CheckFailed(f"{where}: {error}{hint}") from None


def _call_on_a_valid_case(fn, args: tuple, where: str):
    """``fn(*args)`` on a case the spec allows: a ValueError it raises is its own guard firing wrongly."""
    try:
        return fn(*args)
    except ScheduleError:
        raise
    except ValueError as error:
        raise CheckFailed(f"{where} raised ValueError: {error}: the spec allows this case, so the condition that "
                          f"guards your raise is wrong") from None


def _expect_value_error(fn, args, where: str, why: str) -> None:
    try:
        fn(*args)
    except ValueError:
        return
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 - a student's crash is a result
        raise CheckFailed(f"{where}: raised {type(error).__name__}, expected a ValueError ({why})") from None
    raise CheckFailed(f"{where}: returned normally, expected a ValueError ({why})")


def _ignores_ends(balanced_partition_fn) -> bool:
    """Whether the split of four equal layers on two stages misses a heavy head or embedding, which only
    an answer that leaves out ``first_extra``/``last_extra`` does (a greedy fill that counts them gets it)."""
    probes = (((0.0, 10.0), [range(0, 3), range(3, 4)]), ((10.0, 0.0), [range(0, 1), range(1, 4)]))
    return any(_as_ranges(balanced_partition_fn([1.0] * 4, 2, first, last), "probe") != want
               for (first, last), want in probes)


def check_partitions(even_partition, balanced_partition_fn) -> str:
    """6.1: ``even_partition(n_layers, n_stages)`` and
    ``balanced_partition(costs, n_stages, first_extra, last_extra)``."""
    rng = random.Random(_seed() + 1)
    cases = [(rng.randint(2, 40), None) for _ in range(12)] + [(7, 7), (5, 1), (10, 4), (13, 4)]
    for n_layers, n_stages in cases:
        n_stages = n_stages or rng.randint(1, n_layers)
        where = f"even_partition({n_layers}, {n_stages})"
        stages = _as_ranges(_call_on_a_valid_case(even_partition, (n_layers, n_stages), where), where)
        _check_structure(stages, n_layers, n_stages, where)
        sizes = [len(s) for s in stages]
        if max(sizes) - min(sizes) > 1:
            raise CheckFailed(f"{where}: stage sizes {sizes} differ by more than one layer")
    _expect_value_error(even_partition, (3, 4), "even_partition(3, 4)", "4 stages cannot each get a layer of 3")

    n_balanced = 0
    for kind in ("uniform, heavy head", "random", "one huge layer", "one layer per stage", "one stage", "heavy ends"):
        n = rng.randint(6, 24)
        stages_n = rng.randint(2, min(6, n))
        costs = [1.0] * n
        first, last = 0.0, 0.0
        if kind == "uniform, heavy head":
            last = rng.uniform(1.5, 4.0)
        elif kind == "random":
            costs = [rng.uniform(0.2, 3.0) for _ in range(n)]
            first, last = rng.uniform(0, 1), rng.uniform(0, 2)
        elif kind == "one huge layer":
            costs[rng.randrange(n)] = n / 2
        elif kind == "one layer per stage":
            stages_n = n = rng.randint(3, 6)
            costs = [rng.uniform(0.5, 2.0) for _ in range(n)]
        elif kind == "one stage":
            stages_n = 1
        else:
            first, last = rng.uniform(2, 5), rng.uniform(2, 5)
        where = (f"balanced_partition({len(costs)} layers {kind}, {stages_n} stages, first_extra={first:.2f}, "
                 f"last_extra={last:.2f})")
        got = _as_ranges(_call_on_a_valid_case(balanced_partition_fn, (list(costs), stages_n, first, last), where),
                         where)
        _check_structure(got, len(costs), stages_n, where)
        best = max(stage_costs(balanced_partition(costs, stages_n, first, last), costs, first, last))
        mine = stage_costs(got, costs, first, last)
        if max(mine) > best * (1 + 1e-9) + 1e-12:
            hint = ""
            without = max(stage_costs(balanced_partition(costs, stages_n), costs))
            if (first or last) and max(stage_costs(got, costs)) <= without * (1 + 1e-9) \
                    and _ignores_ends(balanced_partition_fn):
                hint = (": your split is the best one if the embedding and the head cost nothing; add first_extra to "
                        "the first stage and last_extra to the last")
            hint = hint or (": a greedy fill is not enough; try every cut (dynamic programming) or binary-search the "
                            "largest cost")
            raise CheckFailed(f"{where}: your largest stage costs {max(mine):.3f} (stage costs "
                              f"{[round(c, 2) for c in mine]}), but a split whose largest stage costs {best:.3f} "
                              f"exists{hint}")
        n_balanced += 1
    _expect_value_error(lambda: balanced_partition_fn([1.0, 1.0], 3, 0.0, 0.0), (), "balanced_partition(2 layers, 3 "
                        "stages)", "3 stages cannot each get a layer of 2")
    return f"{len(cases)} even splits and {n_balanced} balanced splits, each optimal; too many stages raise ValueError"


# ---------------------------------------------------------------- 6.2, 6.3, 6.5 schedules

def _where_to_look(error: ScheduleError) -> str:
    """What part of a schedule builder makes the problem the validator found, as advice after its message."""
    text = str(error)
    for said, look in (
            ("names micro-batch", "check the ranges and the index arithmetic that number this rank's micro-batches: "
                                  "each of 0..m-1 runs once per stage"),
            ("names stage", "check the arithmetic that gives each action's stage"),
            ("is not an Action of a stage", "check the arithmetic that gives each action's stage (never below 0)"),
            ("comes before", "check the order in which your loops emit that rank's actions, and that none is "
                             "missing before it"),
            ("runs stage", "check which rank each stage's actions go to"),
            ("appears twice", "a loop emits that action a second time: check its bounds"),
            ("never runs", "a loop stops one step short or a guard skips that action: check their bounds"),
    ):
        if said in text:
            return f": {look}"
    return ": compare your lists with the Gantt chart of distlab.pipeline_parallel.simulate"


def _schedule_failed(where: str, error: ScheduleError) -> CheckFailed:
    return CheckFailed(f"{where}: {error}{_where_to_look(error)}")


def _run_schedule_fn(fn, args: tuple, name: str):
    where = f"{name}({', '.join(map(str, args))})"
    try:
        schedule = _call_on_a_valid_case(fn, args, where)
    except ScheduleError as error:  # with_p2p validates what it is given
        raise _schedule_failed(f"{where} raised ValueError", error) from None
    try:
        schedule = [list(ops) for ops in schedule]
    except TypeError:
        raise CheckFailed(f"{where}: expected a list with one list of Actions per rank") from None
    if len(schedule) != args[0]:
        raise CheckFailed(f"{where}: returned actions for {len(schedule)} ranks, expected p={args[0]}")
    return where, schedule


def _check_one(where: str, schedule, m: int, v: int, bubble: float, costs: dict | None = None) -> list[float]:
    try:
        validate(schedule, m, v)
    except ScheduleError as error:
        raise _schedule_failed(where, error) from None
    sim = simulate(schedule, m, v, **(costs or {}))
    if abs(sim.bubble - bubble) > 1e-9:
        raise CheckFailed(f"{where}: in unit time (forward 1, backward 2) the ranks idle {sim.bubble:.4f} of the step, "
                          f"the schedule should idle {bubble:.4f}: a rank waits where it could compute — compare "
                          f"your order with distlab.pipeline_parallel.simulate's Gantt chart")
    return sim.peak_in_flight


def _schedule_cases(rng: random.Random) -> list[tuple[int, int]]:
    cases = [(2, 1), (4, 2), (3, 3), (1, 3), (4, 16)]  # fewer micro-batches than stages, one rank, the interview case
    cases += [(rng.randint(2, 6), rng.randint(1, 12)) for _ in range(6)]
    return cases


def check_schedules(gpipe_fn, one_f_one_b_fn) -> str:
    """6.2: ``gpipe(p, m)`` and ``one_f_one_b(p, m)`` return each rank's actions."""
    rng = random.Random(_seed() + 2)
    cases = _schedule_cases(rng)
    for p, m in cases:
        where, schedule = _run_schedule_fn(gpipe_fn, (p, m), "gpipe")
        peaks = _check_one(where, schedule, m, 1, bubble_fraction(p, m))
        if any(peak != m for peak in peaks):
            raise CheckFailed(f"{where}: ranks hold {peaks} micro-batches in flight; GPipe runs every forward "
                              f"before any backward, so each rank holds all m={m}")
        where, schedule = _run_schedule_fn(one_f_one_b_fn, (p, m), "one_f_one_b")
        peaks = _check_one(where, schedule, m, 1, bubble_fraction(p, m))
        for r, peak in enumerate(peaks):
            if peak > min(p - r, m):
                raise CheckFailed(f"{where}: rank {r} holds {peak:g} micro-batches in flight; 1F1B holds at most "
                                  f"p - r = {p - r}: run p - r - 1 warm-up forwards, then alternate one forward "
                                  f"and one backward")
    return f"{len(cases)} (p, m) cases, m < p included: valid, bubble (p-1)/(m+p-1), GPipe holds m, 1F1B ≤ p - r"


def check_interleaved(interleaved_fn) -> str:
    """6.3: ``interleaved_1f1b(p, m, v)``; m not a multiple of p must raise ValueError."""
    rng = random.Random(_seed() + 3)
    cases = [(2, 2, 2), (4, 16, 2), (4, 8, 3), (3, 6, 2), (4, 8, 1), (3, 3, 1)]  # v = 1 must be 1F1B
    cases += [(p, p * rng.randint(1, 3), rng.randint(2, 4)) for p in (rng.randint(2, 5) for _ in range(4))]
    for p, m, v in cases:
        where, schedule = _run_schedule_fn(interleaved_fn, (p, m, v), "interleaved_1f1b")
        for r, ops in enumerate(schedule):
            first_backward = next((a for a in ops if getattr(a, "kind", None) == "B"), None)
            if first_backward is not None and first_backward.stage // p != v - 1:
                raise CheckFailed(f"{where}: rank {r}'s first backward runs its chunk {first_backward.stage // p} "
                                  f"(stage {first_backward.stage}); a micro-batch's backward goes through the stages "
                                  f"in reverse, so backward k runs chunk v-1-((k // p) % v), starting at the last")
        peaks = _check_one(where, schedule, m, v, interleaved_bubble_fraction(p, m, v))
        for r, peak in enumerate(peaks):
            limit = min(interleaved_warmup(p, r, v) + 1, m * v) / v  # warm-up forwards + one, a stage = 1/v
            if peak > limit + 1e-9:
                warmup = "p-r-1 forwards as 1F1B (v = 1 is 1F1B)" if v == 1 else "2(p-r-1) + (v-1)p forwards"
                raise CheckFailed(f"{where}: rank {r} holds {peak:.2f} micro-batches' activations in flight "
                                  f"(a stage counts 1/v); its warm-up of {warmup} and one steady forward hold at "
                                  f"most {limit:.2f}: start the backwards sooner")
    _expect_value_error(interleaved_fn, (4, 6, 2), "interleaved_1f1b(4, 6, 2)", "m=6 is not a multiple of p=4")
    return (f"{len(cases)} (p, m, v) cases, v = 1 included: valid, bubble (p-1)/(v·m+p-1), at most the warm-up + 1 "
            f"in flight; m not a multiple of p raises ValueError")


def check_zero_bubble(zero_bubble_fn) -> str:
    """6.5 (bonus): ``zero_bubble_h1(p, m)`` with the backward split into ``I`` and ``W``."""
    rng = random.Random(_seed() + 5)
    cases = [(4, 16), (2, 1), (3, 2), (4, 8)] + [(rng.randint(2, 6), rng.randint(1, 12)) for _ in range(4)]
    for p, m in cases:
        where, schedule = _run_schedule_fn(zero_bubble_fn, (p, m), "zero_bubble_h1")
        if any(a.kind == "B" for ops in schedule for a in ops):
            raise CheckFailed(f"{where}: uses full backwards (B); split each into I (input gradient) and W (weights)")
        if m >= p:  # the deferred W's exactly fill the drain
            peaks = _check_one(where, schedule, m, 1, (p - 1) / (3 * m + p - 1))
        else:  # too few micro-batches to fill it: valid, and no worse than 1F1B
            peaks = _check_one(where, schedule, m, 1, _sim_bubble(where, schedule, m))
            if _sim_bubble(where, schedule, m) > bubble_fraction(p, m) + 1e-9:
                raise CheckFailed(f"{where}: idles more than 1F1B would ({bubble_fraction(p, m):.4f})")
        if max(peaks) > p:
            raise CheckFailed(f"{where}: a rank holds {max(peaks):g} micro-batches in flight; ZB-H1 keeps 1F1B's "
                              f"bound of p = {p}: defer only the W's, not the forwards")
    return f"{len(cases)} cases: I/W split, bubble (p-1)/(3m+p-1) with F = I = W when m >= p, at most p in flight"


def _sim_bubble(where: str, schedule, m: int) -> float:
    try:
        validate(schedule, m)
        return simulate(schedule, m).bubble
    except ScheduleError as error:
        raise _schedule_failed(where, error) from None


# ---------------------------------------------------------------- 6.6 a V schedule

def _describe_placement(placement: tuple[int, ...], p: int) -> str:
    return ", ".join(f"rank {r}: stages {[s for s, q in enumerate(placement) if q == r]}" for r in range(p))


def check_v_schedule(zero_bubble_v_fn) -> str:
    """6.6: ``zero_bubble_v(p, m)``, a ZB-V: two stages per rank in a V, every backward split into I and W."""
    rng = random.Random(_seed() + 6)
    cases = [(2, 4), (3, 2), (4, 8), (2, 1)]  # the V's own count, fewer micro-batches than 2p - 1, m = 1
    cases += [(p, rng.randint(1, 3 * p)) for p in (rng.randint(2, 5) for _ in range(4))]
    for p, m in cases:
        where, schedule = _run_schedule_fn(zero_bubble_v_fn, (p, m), "zero_bubble_v")
        if any(getattr(a, "kind", None) == "B" for ops in schedule for a in ops):
            raise CheckFailed(f"{where}: uses full backwards (B); split each into I (input gradient, sent back at "
                              f"once) and W (weight gradient, deferred into the gaps)")
        v_shape = stage_placement(p, 2, "v")
        try:
            placed = placement_of(schedule)
        except ScheduleError as error:
            raise _schedule_failed(where, error) from None
        if placed != v_shape:
            looped = placed == stage_placement(p, 2, "looped") if len(placed) == 2 * p else False
            hint = (": rank r's second stage is p + r there (looped, as interleaved 1F1B); a V brings the "
                    "micro-batch back down the ranks, so rank r's second stage is 2p - 1 - r" if looped else
                    ": a V runs stages 0 … p-1 down the ranks and p … 2p-1 back up, so rank r holds r and 2p - 1 - r")
            raise CheckFailed(f"{where}: your stages are placed {_describe_placement(placed, p)}{hint}")
        for r, ops in enumerate(schedule):
            first = next((a for a in ops if getattr(a, "kind", None) == "F"), None)
            if first is not None and first.stage != r:
                raise CheckFailed(f"{where}: rank {r} starts with stage {first.stage}, its stage on the way back up; "
                                  f"a micro-batch enters the V at stage 0 and goes down first, so every rank starts "
                                  f"with its first stage, r")
        try:
            validate(schedule, m, 2, placement="v")
        except ScheduleError as error:
            raise _schedule_failed(where, error) from None
        sim = simulate(schedule, m, 2)
        best = simulate(zero_bubble_v(p, m), m, 2).bubble
        if sim.bubble > best + 1e-9:
            raise CheckFailed(f"{where}: in unit time (forward = input gradient = weight gradient) the ranks idle "
                              f"{sim.bubble:.4f} of the step, ZB-V idles {best:.4f}: a rank waits where a deferred W "
                              f"could fill the gap — send each I's gradient back first and keep W for later; compare "
                              f"simulate's Gantt chart with ZB-V's phases")
        worst = max(range(p), key=sim.peak_in_flight.__getitem__)
        if sim.peak_in_flight[worst] > p + 1e-9:
            raise CheckFailed(f"{where}: rank {worst} holds {sim.peak_in_flight[worst]:g} micro-batches' activations "
                              f"(a stage counts 1/2); ZB-V keeps 1F1B's p = {p}: its first phase runs 2(p - r) - 1 "
                              f"forwards, no more")
    return (f"{len(cases)} (p, m) cases, m < 2p - 1 included: V placement, I/W split, valid, idles no more than ZB-V, "
            f"at most p in flight")


# ---------------------------------------------------------------- 6.4 the executor

def _executor_cases(rng: random.Random) -> list[dict]:
    def cfg(n_layer: int) -> GPTConfig:
        n_head = rng.choice([2, 4])
        return GPTConfig(vocab_size=rng.choice([48, 64, 96]), seq_len=rng.choice([8, 12, 16]), n_layer=n_layer,
                         n_head=n_head, d_model=n_head * rng.choice([4, 8]), tied_embeddings=rng.random() < 0.5)

    # p = 3 first: on 2 ranks the next and the previous rank are the same one, (s + 1) % 2 == (s - 1) % 2,
    # so a message sent the wrong way round the ring would still arrive; interleaved on 3 ranks gives every
    # rank stages that receive and send, and wraps from rank 2 to rank 0
    return [
        dict(p=3, schedule="1f1b", m=rng.choice([3, 4]), v=1, cfg=cfg(rng.randint(3, 5))),
        dict(p=3, schedule="interleaved", m=3, v=2, cfg=cfg(6)),
        dict(p=2, schedule="1f1b", m=1, v=1, cfg=cfg(rng.randint(2, 4))),  # fewer micro-batches than stages
    ]


class ExecutorSlip(RuntimeError):
    """What :class:`_Watched` finds wrong in a rank after the student's executor returned."""


class _Watched:
    """The student's ``execute``, run on a rank so that what the weights cannot show is seen: every ``isend`` it
    posts must be waited for before it returns (gloo delivers an unwaited send anyway, NCCL may not, and its
    buffer may be freed or reused), and the loss it returns for micro-batch ``mb`` must be that micro-batch's
    (a shifted index permutes the micro-batches: the same gradients and mean loss, the wrong labels)."""

    def __init__(self, execute, micro_losses: dict[int, float]):
        self.execute, self.micro_losses = execute, micro_losses

    def __call__(self, actions, stages, micro_batches, p, num_stages):
        with p2p_waits_counted() as waits:
            losses = self.execute(actions, stages, micro_batches, p, num_stages)
        if waits.unwaited:
            raise ExecutorSlip(f"{waits.unwaited} of its {len(waits.posted)} isend/irecv were never waited for when "
                               f"execute returned: wait for every send before returning (NCCL may drop a send "
                               f"nobody waits for, and its buffer may be reused)")
        for mb, loss in dict(losses or {}).items():
            want = self.micro_losses.get(mb)
            if want is not None and abs(float(loss) - want) > 1e-4 * max(1.0, abs(want)):
                match = next((other for other, value in self.micro_losses.items()
                              if abs(float(loss) - value) <= 1e-4 * max(1.0, abs(value))), None)
                said = f", micro-batch {match}'s" if match is not None else ""
                raise ExecutorSlip(f"its loss for micro-batch {mb} is {float(loss):.5f}{said}, expected {want:.5f}: "
                                   f"index micro_batches and the losses with the action's own micro-batch number")
        return losses


def _micro_losses(cfg: GPTConfig, batch: int, m: int, seed: int, data_seed: int) -> dict[int, float]:
    """Each micro-batch's loss at step 0 in one process: what the last stage's executor returns for it."""
    model = GPT(cfg, seed=seed)
    x, y = synthetic_batch(cfg, batch, 0, seed=data_seed)
    with torch.no_grad():
        return {mb: lm_loss(model(xm), ym).item() for mb, (xm, ym) in enumerate(split_microbatches(x, y, m))}


def _describe(case: dict) -> str:
    tied = ", tied embeddings" if case["cfg"].tied_embeddings else ""
    return f"{case['schedule']} on p={case['p']} ranks, m={case['m']}" + (f", v={case['v']}" if case["v"] > 1 else "") \
        + f", {case['cfg'].n_layer} layers{tied}"


def _update_hint(got, ref, before, m: int) -> str:
    factor = update_factor(got, ref, before)
    if factor is None:
        return ""
    for target, why in ((m, f"the gradient is m={m} times too large: divide each micro-batch's loss by m"),
                        (1 / m, f"the gradient is m={m} times too small: the loss was divided by m twice?"),
                        (0.0, "the parameter never moved: its stage's backward did not run, or its gradient was "
                              "lost (send x.grad back; do not zero it)")):
        if abs(factor - target) <= 0.02 * max(abs(target), 1e-3):
            return f": {why}"
    return f" (its update is {factor:.2f}x the reference's)"


def check_executor(execute) -> str:
    """6.4: ``execute(actions, stages, micro_batches, p, num_stages)`` runs one rank's schedule; returns its losses."""
    rng = random.Random(_seed() + 4)
    cases = _executor_cases(rng)
    steps, lr = 1, 0.1
    for case in cases:
        p, m, v, cfg = case["p"], case["m"], case["v"], case["cfg"]
        rows = rng.choice([1, 2])
        batch = rows * m
        seed, data_seed = rng.randrange(1000), rng.randrange(1000)
        what = _describe(case)
        try:
            run = run_on_ranks(pipeline_worker, p, kwargs=dict(schedule=case["schedule"], cfg=cfg, m=m, v=v,
                               batch_size=batch, steps=steps, lr=lr, seed=seed, data_seed=data_seed,
                               executor=_Watched(execute, _micro_losses(cfg, batch, m, seed, data_seed))),
                               what=f"your executor ({what})", collective_timeout=COLLECTIVE_TIMEOUT,
                               advice="Check the peers: an activation of stage s goes to the rank of stage s+1, "
                                      "(s + 1) % p, and comes from (s - 1) % p; a gradient the other way. Post every "
                                      "receive the schedule lists (irecv) and wait for it only in the compute that "
                                      "needs it.")
        except RankFailed as error:
            if getattr(error, "exc_type", "") == "ExecutorSlip":
                raise CheckFailed(f"your executor ({what}): {first_line(error)}") from None
            if getattr(error, "exc_type", "") != "KeyError":
                raise
            raise CheckFailed(f"your executor ({what}): {first_line(error)}: a lookup found nothing under that key: "
                              f"check the keys your RECV_F/RECV_B store and the F/B/SEND that read them, the action "
                              f"kind each branch tests, and the stage arithmetic ((s - 1) % p, (s + 1) % p)") from None
        ref = reference_states(cfg, steps=steps, batch_size=batch, lr=lr, seed=seed, data_seed=data_seed)
        ref_before = reference_states(cfg, steps=steps - 1, batch_size=batch, lr=lr, seed=seed, data_seed=data_seed)
        for r, out in enumerate(run):
            for name, got in out["state"].items():
                diff = max_difference(got, ref.state_dict[name])[0]
                if diff > WEIGHT_ATOL:
                    hint = _update_hint(got, ref.state_dict[name], ref_before.state_dict[name], m)
                    raise CheckFailed(f"{what}: after {steps} SGD step(s) rank {r}'s {name} differs from the single-"
                                      f"process run on the whole batch by {diff:.3g}{hint}")
        last = (p * v - 1) % p
        losses = run[last]["losses"]
        if any(loss is None or abs(loss - want) > 1e-5 for loss, want in zip(losses, ref.losses)):
            raise CheckFailed(f"{what}: rank {last} (the last stage) should return every micro-batch's loss "
                              f"({{micro_batch: loss}}); their mean is {losses} per step, the batch loss is "
                              f"{[round(x, 5) for x in ref.losses]}")
        _check_timeline(run, case, steps)
        _check_traffic(run, case, steps, rows)
    return (f"{len(cases)} cases (1F1B and interleaved on 3 ranks, 1F1B with m < p): weights equal the "
            f"single-process run, spans follow the schedule, isend/irecv of one activation per message")


def _check_timeline(run, case: dict, steps: int) -> None:
    schedule = make_schedule(case["schedule"], case["p"], case["m"], case["v"])
    for r, ops in enumerate(schedule):
        want = [f"{a.kind}{a.microbatch}" for a in ops if a.kind in ("F", "B")] * steps
        got = [s.label.split(".")[0] for s in sorted(compute_spans(run.spans), key=lambda s: s.start) if s.rank == r]
        if got != want:
            first = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
            raise CheckFailed(f"{_describe(case)}: rank {r}'s timeline should hold one span per forward/backward, "
                              f"labelled like 'F3'/'B3' (distlab.span(f'F{{mb}}')), in the schedule's order; span "
                              f"#{first + 1} is {got[first] if first < len(got) else 'missing'}, expected "
                              f"{want[first] if first < len(want) else 'none'}")


def _check_traffic(run, case: dict, steps: int, rows: int) -> None:
    schedule = make_schedule(case["schedule"], case["p"], case["m"], case["v"])
    cfg = case["cfg"]
    message = rows * cfg.seq_len * cfg.d_model * 4
    for r, log in enumerate(run.comm):
        blocking = [op for op in ("send", "recv") if op in log.ops]
        if blocking:
            raise CheckFailed(f"{_describe(case)}: rank {r} used blocking dist.{blocking[0]}; post isend/irecv and "
                              f"wait only where the data is needed")
        sends = sum(a.kind.startswith("SEND") for a in schedule[r]) * steps
        recvs = sum(a.kind.startswith("RECV") for a in schedule[r]) * steps
        got_sends = log.ops["isend"].calls if "isend" in log.ops else 0
        got_recvs = log.ops["irecv"].calls if "irecv" in log.ops else 0
        tied = cfg.tied_embeddings and case["p"] > 1 and r in (0, (case["p"] * case["v"] - 1) % case["p"])
        extra = steps if tied else 0  # sync_tied_gradients: one exchange per step
        if (got_sends - extra, got_recvs - extra) != (sends, recvs):
            raise CheckFailed(f"{_describe(case)}: rank {r} posted {got_sends - extra} isend and {got_recvs - extra} "
                              f"irecv in {steps} steps; the schedule lists {sends} sends and {recvs} receives")
        payload = log.ops["isend"].payload_bytes - extra * _tied_bytes(cfg) if sends else 0
        if sends and payload != sends * message:
            raise CheckFailed(f"{_describe(case)}: rank {r} sent {payload:,} bytes in {sends} messages; each "
                              f"activation or gradient is {message:,} bytes (rows x seq_len x d_model x 4)")


def _tied_bytes(cfg: GPTConfig) -> int:
    return cfg.vocab_size * cfg.d_model * 4


# ---------------------------------------------------------------- quiz

# Surviving mutants of the solution cells that change nothing the exercises ask for (distlab notebooks
# mutants): key, as benchmarks/results/mutants.txt names it → why it is equivalent.
EQUIVALENT_MUTANTS = {
    '6.1 statements-swapped: `base, extra = divmod(n_layers, n_stages) bounds = [0]` → `bounds = [0] base, extra = '
    'divmod(n_layers, n_stages)`':
        "two statements that do not read each other's names, in the other order",
    '6.1 off-by-one: `1` → `2`':
        'the table best is one column wider (n + 2 entries a row): the dynamic programme reads columns 0..n only',
    '6.1 off-by-one: `1` → `2` #2':
        'the table cut is one column wider (n + 2 entries a row): the walk back reads columns 0..n only',
    '6.1 off-by-one: `1` → `2` #3':
        'the table best gets one more row (n_stages + 2): the dynamic programme reads rows 0..n_stages only',
    '6.1 off-by-one: `1` → `2` #4':
        'the table cut gets one more row (n_stages + 2): the walk back reads rows 0..n_stages only',
    '6.2 arguments-swapped: `min(p - r - 1, m)` → `min(m, p - r - 1)`':
        'min is symmetric',
    '6.3 arguments-swapped: `min(2 * (p - r - 1) + (v - 1) * p if v > 1 else p - r - 1, total)` → `min(total, 2 * (p '
    '- r - 1) + (v - 1) * p if v > 1 else p - r - 1)`':
        'min is symmetric',
    '6.3 statements-swapped: `ops += [action(k, r, False) for k in range(total - warmup, total)] or…` → '
    '`order.append(ops) ops += [action(k, r, False) for k in range(total - …`':
        'order holds the list ops itself, and += extends that list in place: the same schedule',
    '6.3 off-by-one: `k % p` → `(k - 1) % p`':
        'the micro-batches of each round of p are renamed by one fixed rotation, the same for every forward and '
        'backward on every rank: the same schedule under other names (micro-batches are interchangeable: the '
        'bubble, the in-flight counts and the gradients do not depend on which one is called 0)',
    '6.4 call-removed: `outputs[(mb, s)].detach()` → `outputs[mb, s]`':
        'the send reads only the activation\'s values (Channels.send sends tensor.contiguous()): a tensor that '
        'requires grad sends the same bytes, and autograd is not involved in an isend',
    '6.4 guard-removed: `a.kind == "B"` → `True`':
        'the branches above take RECV_F, RECV_B, SEND_F, SEND_B and F, and the schedules an executor runs here hold '
        'no I or W: B is the only kind left at that elif, so its test is always true there',
    '6.4 statements-swapped: `losses[mb] = loss.item() out = loss / m` → `out = loss / m losses[mb] = loss.item()`':
        "two statements that do not read each other's names, in the other order",
    '6.5 arguments-swapped: `min(p - r - 1, m)` → `min(m, p - r - 1)`':
        'min is symmetric',
    '6.5 arguments-swapped: `min(r, m)` → `min(m, r)`':
        'min is symmetric',
    '6.5 compare: `w < m` → `w <= m`':
        'w counts the W\'s emitted, which never pass the I\'s emitted: at that line w <= mb < m, so w < m and '
        'w <= m are both always true',
    '6.5 guard-removed: `w < m` → `True`':
        'w counts the W\'s emitted, which never pass the I\'s emitted: at that line w <= mb < m, so the guard is '
        'always true',
    '6.6 compare: `done("W", stage) < n` → `done(\'W\', stage) <= n`':
        'the one extra W is numbered n >= m, and the last line keeps only micro-batches below m',
    '6.6 off-by-one: `1` → `2`':
        'for m <= 2p - 2 the builder pads to 2p - 2 micro-batches instead of 2p - 1 and drops the padding: still '
        'a V placement with I/W split, valid, no more idle than ZB-V (less on p=2, m=2) and at most p in flight, '
        'which is all 6.6 asks (we checked p = 2..6, m = 1..19)',
}

EXERCISES = [
    Exercise("6.1", "partition layers into stages: even and cost-balanced", 2, check_partitions,
             references=("distlab.pipeline_parallel.partition.balanced_partition",
                         "distlab.pipeline_parallel.partition.even_partition")),
    Exercise("6.2", "GPipe and 1F1B schedules", 3, check_schedules,
             references=("distlab.pipeline_parallel.schedules.gpipe",
                         "distlab.pipeline_parallel.schedules.one_f_one_b")),
    Exercise("6.3", "interleaved 1F1B schedule", 2, check_interleaved,
             references=("distlab.pipeline_parallel.schedules.interleaved_1f1b",)),
    Exercise("6.4", "run any schedule on real ranks", 4, check_executor,
             references=("distlab.pipeline_parallel.executor.run_schedule",)),
    Exercise("6.5", "bonus: zero-bubble ZB-H1 schedule", 1, check_zero_bubble,
             references=("distlab.pipeline_parallel.schedules.zero_bubble_h1",)),
    Exercise("6.6", "bonus: a V schedule of your own, ZB-V", 2, check_v_schedule,
             references=("distlab.pipeline_parallel.schedules.zero_bubble_v",)),
    quiz.number("Q6.1", "bubble fraction for p = {p} stages and m = {m} micro-batches", abs_tol=0.002,
                given=dict(p=8, m=24), vary=dict(p=(4, 6, 16), m=(8, 16, 32, 64)), solve=bubble_fraction,
                hint="see 'The bubble, in theory' (the step is fill + steady state + drain)"),
    quiz.number("Q6.2", "smallest m that keeps the 1F1B bubble at or below {percent}% with p = {p}", abs_tol=0,
                given=dict(percent=5, p=6), vary=dict(percent=(2, 10), p=(4, 8, 12)),
                solve=lambda percent, p: next(m for m in range(1, 10**5) if bubble_fraction(p, m) <= percent / 100),
                hint="see 'The bubble, in theory' and solve its bubble fraction for m"),
    quiz.number("Q6.3", "interleaved 1F1B bubble for p = {p}, m = {m}, v = {v}", abs_tol=0.002,
                given=dict(p=6, m=12, v=2), vary=dict(p=(4, 8), m=(8, 16, 24), v=(3, 4)),
                solve=interleaved_bubble_fraction,
                hint="see 'Interleaved 1F1B': what a stage slot is worth with v stages per rank"),
    quiz.number("Q6.4", "micro-batches in flight on rank {rank} under 1F1B with p = {p}, m = 32", abs_tol=0,
                given=dict(rank=2, p=6), vary=dict(rank=(0, 1, 3, 5), p=(8,)),
                solve=lambda rank, p: min(interleaved_warmup(p, rank, 1) + 1, 32),
                hint="see 'Memory: GPipe against 1F1B' and the 1F1B warm-up in Exercise 6.2"),
    quiz.number("Q6.5", "MiB sent forward per micro-batch between two stages of a 70B model (d_model 8192, "
                "seq {seq}, micro-batch {micro_batch}, bf16)", abs_tol=0.01,
                given=dict(seq=4096, micro_batch=1), vary=dict(seq=(1024, 2048, 8192, 16384), micro_batch=(2, 4, 8)),
                solve=lambda seq, micro_batch: activation_message_bytes(micro_batch, seq, 8192, bytes_per_value=2)
                / 2**20,
                hint="see 'Bytes between stages': what one micro-batch's activation holds"),
    quiz.choice("Q6.6", "why pipeline parallelism is the parallelism that crosses nodes", "b", "abcd",
                hint="see 'Bytes between stages'"),
    quiz.choice("Q6.7", "a guide says 'bubble = (p-1)/m'; what does that number measure", "c", "abcd",
                hint="see 'The bubble, in theory', the interview question worked out"),
    quiz.choice("Q6.8", "what ZB-V pays, against 1F1B at the same p and m, for its near-zero bubble", "b", "abcd",
                hint="see 'V-shaped schedules: ZB-V and DualPipeV' and its comparison table"),
]
