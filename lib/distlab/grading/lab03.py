"""Lab 03 — DDP from scratch. Checkers run the student's code on real gloo ranks.

Every case trains a small GPT for a few SGD steps on 2-4 ranks (each rank on its
slice of the global batch, rank 0's weights broadcast to the others) and compares
every rank's weights after every step with a single-process run on the full batch
(:func:`distlab.workload.reference_run`), to 1e-6 (the training cases labs 03 and 04
share, :mod:`distlab.grading.training_cases`). On a mismatch the message names the
parameter, the step and the rank, and — since one plain SGD step moves a weight by
``-lr·grad`` — the factor between the student's update and the reference's, with the
usual cause ("summed but not divided by world size?"). Communication is
checked from distlab's comm log: all-reduce payload per step equals the gradient
bytes exactly (every gradient once, a tied weight once, frozen weights never).

Cases come from the lab's seed (fixed in self-study: reproducible notebook output) over world
sizes, seeds, model shapes, bucket sizes and accumulation steps a student cannot
special-case. Collectives time out after a few seconds so a deadlock fails fast.
An untouched stub's ``NotImplementedError`` (raised inside a rank) propagates and
is reported as "not attempted".
"""

from __future__ import annotations

import contextlib
import random

import torch
import torch.distributed as dist

from distlab.collectives import ring_all_reduce_bytes
from distlab.data_parallel import OverlappedDDP, assign_buckets, pytorch_bucket_count, train_step
from distlab.data_parallel import broadcast_parameters as reference_broadcast
from distlab.flops import mfu
from distlab.grading import quiz
from distlab.grading.contract import CheckFailed
from distlab.grading.harness import (
    LONG_JOB_TIMEOUT,
    Edge,
    case_drawn,
    case_gradient_bytes,
    lab_seed,
    raise_if_untouched,
    rank_seed,
    run_isolated,
    run_on_ranks,
    tolerance,
)
from distlab.grading.registry import Exercise
from distlab.grading.training_cases import STEPS, Case, compare_with_reference
from distlab.model import GPTConfig
from distlab.reference import make_optimizer
from distlab.workload import build_model, local_batches


def _seed() -> int:
    """This lab's seed for its hidden cases, read as each check runs (:func:`~distlab.grading.harness.lab_seed`)."""
    return lab_seed(3)


COLLECTIVE_TIMEOUT = 30.0  # seconds: long enough for a rank starved on a busy machine; a deadlock still fails

__all__ = ["EXERCISES", "QUIZ", "check_naive_ddp", "check_bucketed_ddp", "check_overlapped_ddp",
           "check_gradient_accumulation"]


def _random_cfg(rng: random.Random) -> GPTConfig:
    n_head = rng.choice([2, 4])
    return GPTConfig(vocab_size=rng.choice([64, 96, 128]), seq_len=rng.choice([16, 24, 32]),
                     n_layer=rng.randint(1, 2), n_head=n_head, d_model=n_head * rng.choice([8, 12, 16]),
                     tied_embeddings=rng.random() < 0.7)


def _case(rng: random.Random, model: str = "gpt", tied: bool | None = None, **overrides) -> Case:
    cfg = _random_cfg(rng)
    if tied is not None:
        cfg.tied_embeddings = tied
    case = Case(world_size=rng.randint(2, 4), seed=rng.randrange(10_000), data_seed=rng.randrange(10_000),
                cfg=cfg, model=model, rows=rng.choice([1, 2]))
    for key, value in overrides.items():
        setattr(case, key, value)
    return case


def _cases(rng: random.Random, tied: bool | None = None, **both) -> list[Case]:
    """An exercise's two training cases: the plain GPT (``tied``) and the one with frozen and unused parameters,
    on two different world sizes (so one is above 2: a division by a constant 2 shows)."""
    sizes = rng.sample([2, 3, 4], 2)
    return [_case(rng, "gpt", tied, world_size=sizes[0], **both), _case(rng, "edge", world_size=sizes[1], **both)]


def _drawn(exercise: str, case: Case, **facts) -> None:
    """Record a training case's facts for the exercise's edges (harness.case_drawn)."""
    case_drawn(exercise, world=case.world_size, model=case.model, tied=case.cfg.tied_embeddings, accum=case.accum,
               **facts)


# ---------------------------------------------------------------- running on ranks

def _state(module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in module.state_dict().items()}


def _train_with_sync(module, sync_gradients, case: Case) -> dict:
    """SGD steps on this rank's slice of each global batch, gradients synchronised by ``sync_gradients()``; also
    which frozen parameters came out of it with a gradient."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"initial": _state(module), "states": [], "frozen with a gradient": []}
    opt = make_optimizer(module.parameters(), "sgd", lr=case.lr)
    for step in range(case.steps):
        (x, y), = local_batches(case.cfg, case.batch, step, rank, world, 1, case.data_seed)
        opt.zero_grad(set_to_none=True)
        _, loss = module(x, y)
        loss.backward()
        sync_gradients()
        out["frozen with a gradient"] += [name for name, p in module.named_parameters()
                                          if not p.requires_grad and p.grad is not None]
        opt.step()
        out["states"].append(_state(module))
    return out


# A buffer each rank's model gets with its own values for 3.1: the GPT's only buffers are the same on every rank,
# so without it a broadcast that skips buffers would pass.
PROBE_BUFFER = "probe_buffer"


def _probe_of(rank: int) -> torch.Tensor:
    """The values rank ``rank``'s probe buffer starts with."""
    return torch.full((3,), float(rank + 1))


def _worker_functions(broadcast_fn, allreduce_fn, case: Case) -> dict:
    """3.1 on a rank: the student's broadcast (of a model holding a buffer of this rank's own values), then SGD
    steps with the student's gradient all-reduce."""
    rank = dist.get_rank()
    module = build_model(case.model, case.cfg, seed=rank_seed(case.seed, rank))
    module.register_buffer(PROBE_BUFFER, _probe_of(rank))
    broadcast_fn(module)
    probe = module._buffers.pop(PROBE_BUFFER).clone()
    return {**_train_with_sync(module, lambda: allreduce_fn(module), case), "probe": probe}


def _worker_buckets(assign_fn, allreduce_buckets_fn, case: Case) -> dict:
    """3.2 on a rank: the reference broadcast, the student's buckets and bucketed all-reduce."""
    module = build_model(case.model, case.cfg, seed=rank_seed(case.seed, dist.get_rank()))
    reference_broadcast(module)
    buckets = assign_fn(list(module.parameters()), case.bucket_cap_bytes)
    return _train_with_sync(module, lambda: allreduce_buckets_fn(buckets), case)


class _WatchedWork:
    """A collective's handle that notes when it is waited on (in ``events``), then waits."""

    def __init__(self, work, events: list, index: int):
        self._work, self._events, self._index = work, events, index

    def wait(self, *args, **kwargs):
        self._events.append(("wait", self._index))
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


@contextlib.contextmanager
def _watching_all_reduces(ddp, events: list):
    """While in the block: every dist.all_reduce call (launched async or not, each handle's wait) and every start of
    ``ddp.finish_gradient_sync()``, in order, into ``events``. The real collectives run; this only looks."""
    real, finish = dist.all_reduce, ddp.finish_gradient_sync

    def watched(tensor, *args, **kwargs):
        async_op = kwargs.get("async_op", args[2] if len(args) > 2 else False)
        work = real(tensor, *args, **kwargs)
        events.append(("launch", bool(async_op)))
        return _WatchedWork(work, events, len(events) - 1) if work is not None else None

    def finishing(*args, **kwargs):
        events.append(("finish",))
        return finish(*args, **kwargs)

    dist.all_reduce, ddp.finish_gradient_sync = watched, finishing
    try:
        yield
    finally:
        dist.all_reduce = real
        del ddp.finish_gradient_sync  # the instance attribute: the class's method again


def _worker_ddp(ddp_factory, step_fn, case: Case, zero_grad: bool = True) -> dict:
    """3.3/3.4 on a rank: a DDP class driven by a step function over ``accum`` micro-batches. Per step it also
    returns the all-reduce events (:func:`_watching_all_reduces`), what the step function returned with the mean
    loss of the micro-batches before it, and the gradients left afterwards. ``zero_grad=False``: the step function
    zeroes them itself (3.4)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    module = build_model(case.model, case.cfg, seed=rank_seed(case.seed, rank))
    ddp = ddp_factory(module, case.bucket_cap_bytes)
    out = {"initial": _state(module), "states": [], "events": [], "returned": [], "left": []}
    opt = make_optimizer(module.parameters(), "sgd", lr=case.lr)
    for step in range(case.steps):
        micro = local_batches(case.cfg, case.batch, step, rank, world, case.accum, case.data_seed)
        if zero_grad:
            opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            mean_loss = sum(module(x, y)[1].item() for x, y in micro) / len(micro)
        events: list = []
        with _watching_all_reduces(ddp, events):
            returned = step_fn(ddp, opt, micro)
        out["events"].append(events)
        out["returned"].append((returned.item() if isinstance(returned, torch.Tensor) and returned.numel() == 1
                                else returned, mean_loss))
        out["left"].append([name for name, p in module.named_parameters()
                            if p.grad is not None and bool(p.grad.any())])
        out["states"].append(_state(module))
    return out


def _worker_accumulated(ddp_factory, step_fn, case: Case) -> dict:
    """3.4 on a rank: :func:`_worker_ddp`, the student's step zeroing the gradients itself."""
    return _worker_ddp(ddp_factory, step_fn, case, zero_grad=False)


def _launch(worker, case: Case, *args):
    return run_on_ranks(worker, case.world_size, *args, case, what=f"your code ({case})",
                        advice="Every rank must make the same collective calls in the same order: a parameter with "
                               "no gradient on some rank (p.grad is None) still needs its all-reduce (with zeros), "
                               "and buckets must be launched in bucket order.",
                        collective_timeout=COLLECTIVE_TIMEOUT, timeout=LONG_JOB_TIMEOUT)


def check_communication(run, case: Case, expected_calls: int | None = None) -> None:
    """All-reduce payload per optimizer step = the gradient bytes; optionally the call count."""
    grad = case_gradient_bytes(case)
    for rank, log in enumerate(run.comm):
        stats = log.ops.get("all_reduce")
        payload = stats.payload_bytes / case.steps if stats else 0
        calls = stats.calls / case.steps if stats else 0
        if payload != grad:
            raise CheckFailed(
                f"{case}: rank {rank}'s all_reduce calls carried {payload:,.0f} bytes per step, but the "
                f"gradients are {grad:,} bytes: all-reduce each gradient exactly once per optimizer step "
                f"(a tied weight once, frozen parameters never" + (", not on every micro-step)" if
                                                                  case.accum > 1 else ")"))
        if expected_calls is not None and calls != expected_calls:
            raise CheckFailed(f"{case}: rank {rank} made {calls:g} all_reduce calls per step, expected "
                              f"{expected_calls} (one per bucket)")


# ---------------------------------------------------------------- 3.1

def check_naive_ddp(broadcast_parameters, allreduce_gradients) -> str:
    """3.1: ``broadcast_parameters(model)`` and ``allreduce_gradients(model)`` (mean over ranks)."""
    raise_if_untouched(broadcast_parameters, allreduce_gradients)
    rng = random.Random(_seed() + 1)
    cases = _cases(rng, tied=True)[::-1]  # the frozen parameters first: the broadcast's usual miss, named first
    for case in cases:
        _drawn("3.1", case)
        run = _launch(_worker_functions, case, broadcast_parameters, allreduce_gradients)
        compare_with_reference(run, case)
        for rank, out in enumerate(run):
            if out["probe"].tolist() != _probe_of(0).tolist():
                raise CheckFailed(f"{case}: after broadcast_parameters, rank {rank}'s buffer {PROBE_BUFFER} holds "
                                  f"{out['probe'].tolist()}, rank 0's was {_probe_of(0).tolist()}: broadcast the "
                                  "buffers too (model.buffers()), from rank 0")
        for rank, out in enumerate(run):
            if out["frozen with a gradient"]:
                raise CheckFailed(f"{case}: after allreduce_gradients, rank {rank}'s "
                                  f"{out['frozen with a gradient'][0]} (requires_grad=False) has a gradient: skip "
                                  "the parameters that do not require grad before giving a missing gradient zeros")
        check_communication(run, case)
    return (f"{len(cases)} cases on {_sizes(cases)} ranks, tied/frozen/unused parameters: every rank equals "
            f"the single-process run after {STEPS} steps, each gradient reduced once")


def _sizes(cases) -> str:
    sizes = sorted({c.world_size for c in cases})
    return "/".join(map(str, sizes))


# ---------------------------------------------------------------- 3.2

def _names(model) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def _assignment_job(assign_fn, model, cap: int):
    """3.2's assignment where the student's code runs: each bucket as the positions of its parameters in
    ``model.parameters()`` (None for an entry that is not one of them), or the name of the type it returned
    when that is no list of buckets. Identity is what the check is about, and it does not travel: positions do."""
    params = list(model.parameters())
    got = assign_fn(params, cap)
    try:
        buckets = [list(b) for b in got]
    except TypeError:
        return type(got).__name__
    position = {id(p): i for i, p in enumerate(params)}
    return [[position.get(id(p)) if isinstance(p, torch.nn.Parameter) else None for p in b] for b in buckets]


def _check_bucket_assignment(assign_fn, rng: random.Random) -> int:
    cases = 0
    for model_kind, tied in (("gpt", True), ("gpt", False), ("edge", True)):
        cfg = _random_cfg(rng)
        cfg.tied_embeddings = tied
        model = build_model(model_kind, cfg, seed=rng.randrange(1000))
        names = _names(model)
        total = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
        # a LayerNorm vector's bytes: the last parameters, in reverse order ln_f.bias and ln_f.weight, each fill a
        # bucket exactly (closed at the cap, not past it); one byte more, and a bucket of two just passes it
        exact = 4 * cfg.d_model
        for cap in (rng.randint(256, 4096), rng.randint(total // 6, total // 2), 25 * 2**20, exact, exact + 1):
            case_drawn("3.2", cap=cap, exact=exact, total=total)
            params = list(model.parameters())
            expected = assign_buckets(params, cap)
            got = run_isolated(_assignment_job, assign_fn, model, cap)
            where = f"for the {'tied ' if tied and model_kind == 'gpt' else ''}" \
                    f"{'GPT' if model_kind == 'gpt' else 'GPT with a frozen pos_emb'} and bucket_cap_bytes={cap}"
            if isinstance(got, str):
                raise CheckFailed(f"{where}: expected a list of buckets, each a list of parameters, got {got}")
            if any(i is None for b in got for i in b):
                raise CheckFailed(f"{where}: buckets must hold the model's parameters themselves")
            flat = [params[i] for b in got for i in b]
            seen: dict[int, int] = {}
            for p in flat:
                seen[id(p)] = seen.get(id(p), 0) + 1
            for name, p in model.named_parameters():
                count = seen.get(id(p), 0)
                if not p.requires_grad and count:
                    raise CheckFailed(f"{where}: {name} (requires_grad=False) is in a bucket: a frozen parameter "
                                      f"has no gradient to reduce")
                if p.requires_grad and count == 0:
                    raise CheckFailed(f"{where}: {name} is in no bucket")
                if count > 1:
                    raise CheckFailed(f"{where}: {name} is in the buckets {count} times: a tied weight is one "
                                      f"tensor and must be reduced once")
            if [id(p) for p in flat] != [id(p) for b in expected for p in b]:  # `!=` on tensors is elementwise
                first = names[id(expected[0][0])]
                got_first = names.get(id(flat[0]), "?")
                raise CheckFailed(f"{where}: the first bucket should start with {first} (the last registered "
                                  f"parameter, whose gradient backward produces first), got {got_first}: walk "
                                  f"the parameters in reverse registration order")
            if [len(b) for b in got] != [len(b) for b in expected]:
                raise CheckFailed(
                    f"{where}: expected {len(expected)} bucket(s) of {[len(b) for b in expected]} parameters, got "
                    f"{[len(b) for b in got]}: add parameters to the open bucket and close it as soon as it holds "
                    f"bucket_cap_bytes or more")
            cases += 1
    return cases


def _train_and_verify_buckets(worker, case: Case, *student_code):
    """Run the student's bucketed DDP on the case: weights must equal the single-process run,
    with one all-reduce per bucket of the reference bucket assignment."""
    run = _launch(worker, case, *student_code)
    compare_with_reference(run, case)
    model = build_model(case.model, case.cfg, seed=case.seed)
    check_communication(run, case, expected_calls=len(assign_buckets(list(model.parameters()), case.bucket_cap_bytes)))
    return run


def check_bucketed_ddp(assign_buckets_fn, allreduce_buckets_fn) -> str:
    """3.2: ``assign_buckets(params, bucket_cap_bytes)`` and ``allreduce_buckets(buckets)``."""
    raise_if_untouched(assign_buckets_fn, allreduce_buckets_fn)
    rng = random.Random(_seed() + 2)
    n_assign = _check_bucket_assignment(assign_buckets_fn, rng)
    cases = _cases(rng)
    for case in cases:
        total = case_gradient_bytes(case)
        case.bucket_cap_bytes = rng.randint(total // 8, total // 3)
        _drawn("3.2", case, cap=case.bucket_cap_bytes, total=total, exact=None)
        _train_and_verify_buckets(_worker_buckets, case, assign_buckets_fn, allreduce_buckets_fn)
    return (f"{n_assign} bucket assignments; {len(cases)} training cases on {_sizes(cases)} ranks: one all-reduce "
            f"per bucket, weights equal the single-process run")


# ---------------------------------------------------------------- 3.3

def _overlap_missing(events: list) -> str:
    """Why one step's all-reduces overlapped no backward computation, or "" when one did: an all-reduce launched
    with async_op=True before ``finish_gradient_sync()`` (from a hook, during backward) and waited on only after it
    (so backward went on computing while it ran)."""
    finish = next((i for i, event in enumerate(events) if event[0] == "finish"), len(events))
    early = [i for i, event in enumerate(events[:finish]) if event[0] == "launch"]
    waits: dict[int, int] = {}  # each handle's first wait
    for i, event in enumerate(events):
        if event[0] == "wait":
            waits.setdefault(event[1], i)
    if not early:
        return ("no bucket's all_reduce was launched before finish_gradient_sync(): launch each bucket from the "
                "gradient hook as soon as it is full")
    if not any(events[i][1] for i in early):
        return ("the all_reduce calls made during backward are synchronous (no async_op=True), so backward stops "
                "for each one and nothing overlaps: launch with async_op=True and keep the handle")
    if all(waits.get(i, finish) < finish for i in early if events[i][1]):
        return ("each handle is waited on before backward ends (in the hook?), so backward still stops for it: wait "
                "for the handles in finish_gradient_sync()")
    return ""


def _check_overlap(run, case: Case) -> None:
    """On every rank, every step: some all-reduce ran while backward computed (:func:`_overlap_missing`)."""
    for rank, out in enumerate(run):
        for step, events in enumerate(out["events"]):
            why = _overlap_missing(events)
            if why:
                raise CheckFailed(f"{case}: in step {step + 1} on rank {rank} no all-reduce overlapped backward: "
                                  f"{why}")


def check_overlapped_ddp(ddp_class) -> str:
    """3.3: a DDP class ``ddp_class(module, bucket_cap_bytes)`` whose hooks launch async bucket all-reduces."""
    raise_if_untouched(ddp_class)
    rng = random.Random(_seed() + 3)
    cases = _cases(rng, tied=True)
    for case in cases:
        total = case_gradient_bytes(case)
        case.bucket_cap_bytes = rng.randint(total // 8, total // 4)  # at least 4 buckets
        if case.model == "edge":
            _rare_bias_alone_and_sometimes_missing(case)
        _drawn("3.3", case, buckets=len(assign_buckets(list(build_model(case.model, case.cfg).parameters()),
                                                       case.bucket_cap_bytes)),
               missing_then_back=_gradient_comes_and_goes(case),
               early_not_last=case.model == "edge" and _gradient_early_not_last(case))
        try:
            run = _train_and_verify_buckets(_worker_ddp, case, ddp_class, train_step)
        except CheckFailed as failure:
            if case.model == "edge" and "rare_bias" in str(failure):
                raise CheckFailed(f"{failure}: rare_bias gets no gradient on some ranks in some steps, and one "
                                  "accumulated over no_sync in others; the flush must load every slot whose gradient "
                                  "did not arrive (its accumulated gradient, or zeros) before dividing and reducing"
                                  ) from None
            raise
        if case.model == "gpt":
            _check_overlap(run, case)
    return (f"{len(cases)} cases on {_sizes(cases)} ranks: all-reduces start during backward, buckets with "
            f"missing gradients flushed, weights equal the single-process run")


def _rare_bias_used(case: Case, step: int, rank: int) -> list[bool]:
    """Whether each of ``rank``'s micro-batches of ``step`` uses the edge model's ``rare_bias`` (a row whose first
    token is below vocab/4: :class:`distlab.workload.EdgeCaseGPT`)."""
    return [bool((x[:, 0] < case.cfg.vocab_size // 4).any())
            for x, _ in local_batches(case.cfg, case.batch, step, rank, case.world_size, case.accum, case.data_seed)]


def _gradient_comes_and_goes(case: Case) -> bool:
    """Whether some rank has ``rare_bias``'s gradient in one step and none in the next."""
    if case.model != "edge":
        return False
    used = [[any(_rare_bias_used(case, step, rank)) for step in range(case.steps)] for rank in range(case.world_size)]
    return any(steps[s] and not steps[s + 1] for steps in used for s in range(case.steps - 1))


def _rare_bias_alone_and_sometimes_missing(case: Case) -> None:
    """3.3's edge case: ``rare_bias`` alone in the first bucket (the cap is its bytes), two micro-steps per step
    (train_step accumulates the first under the class's no_sync), and data in which some rank has its gradient in
    one step and none in the next, and one in which its gradient comes only from the first micro-step (so it
    reaches the bucket in the flush, accumulated): a flush that skips a bucket's last slot, reuses what it loaded
    before, or loads after dividing, shows."""
    case.bucket_cap_bytes = 4 * case.cfg.vocab_size
    case.accum, case.rows = 2, 1
    start = case.data_seed
    for case.data_seed in range(start, start + 400):
        if _gradient_comes_and_goes(case) and _gradient_early_not_last(case):
            return


# ---------------------------------------------------------------- 3.4

class _Flag:
    def __init__(self):
        self.require_backward_grad_sync = True


def _no_sync_job(no_sync) -> tuple:
    """3.4's context where the student's code runs: the flag inside it, after it, and after an exception in it."""
    ddp = _Flag()
    with no_sync(ddp):
        inside = ddp.require_backward_grad_sync
    after = ddp.require_backward_grad_sync
    try:
        with no_sync(ddp):
            raise KeyError("boom")
    except KeyError:
        pass
    return inside, after, ddp.require_backward_grad_sync


def _check_no_sync_context(no_sync) -> None:
    inside, after, after_error = run_isolated(_no_sync_job, no_sync)
    if inside is not False:
        raise CheckFailed("inside no_sync(ddp), ddp.require_backward_grad_sync should be False")
    if after is not True:
        raise CheckFailed("after no_sync(ddp), ddp.require_backward_grad_sync should be True again")
    if after_error is not True:
        raise CheckFailed("after an exception inside no_sync(ddp), synchronisation must be switched back on "
                          "(restore the flag in a finally block)")


def _gradient_early_not_last(case: Case) -> bool:
    """Whether some rank uses ``rare_bias`` in an early micro-batch of a step and not in its last."""
    return any(any(used[:-1]) and not used[-1] for step in range(case.steps) for rank in range(case.world_size)
               for used in [_rare_bias_used(case, step, rank)])


def _rare_bias_early_not_last(case: Case) -> None:
    """3.4's edge case: data in which some rank uses ``rare_bias`` in an early micro-batch of a step and not in its
    last, so its gradient is accumulated under no_sync and reaches its bucket only in the flush."""
    start = case.data_seed
    for case.data_seed in range(start, start + 200):
        if _gradient_early_not_last(case):
            return


def _check_gradients_zeroed(run, case: Case) -> None:
    """train_accumulated leaves no gradient behind (the next step would add to it)."""
    for rank, out in enumerate(run):
        for step, left in enumerate(out["left"]):
            if left:
                raise CheckFailed(f"{case}: after step {step + 1} rank {rank}'s {left[0]} still holds a gradient: "
                                  "call optimizer.zero_grad() after optimizer.step(), or the next step adds to it")


def _check_mean_loss(run, case: Case) -> None:
    """train_accumulated returns the mean loss of its micro-batches (each computed with the step's weights)."""
    for rank, out in enumerate(run):
        for step, (returned, mean_loss) in enumerate(out["returned"]):
            if isinstance(returned, bool) or not isinstance(returned, int | float) or \
                    not tolerance(torch.tensor(mean_loss), terms=case.accum * case.cfg.vocab_size).holds(
                        returned, mean_loss):
                raise CheckFailed(f"{case}: in step {step + 1} rank {rank}'s train_accumulated returned "
                                  f"{returned!r}; the mean of its {case.accum} micro-batch losses is {mean_loss:.6g}: "
                                  "add up loss.item() of each micro-batch and divide by their number")


def check_gradient_accumulation(no_sync, train_accumulated) -> str:
    """3.4: ``no_sync(ddp)`` context and ``train_accumulated(ddp, optimizer, micro_batches)``."""
    raise_if_untouched(train_accumulated)
    _check_no_sync_context(no_sync)
    rng = random.Random(_seed() + 4)
    cases = _cases(rng, rows=1)
    for case in cases:  # accum != world size, so a wrong factor points at one cause
        case.accum = rng.choice([a for a in (2, 3, 4) if a != case.world_size])
        total = case_gradient_bytes(case)
        case.bucket_cap_bytes = rng.randint(total // 6, total // 3)
        if case.model == "edge":
            _rare_bias_early_not_last(case)
        _drawn("3.4", case, early_not_last=case.model == "edge" and _gradient_early_not_last(case))
        run = _launch(_worker_accumulated, case, OverlappedDDP, train_accumulated)
        _check_gradients_zeroed(run, case)
        compare_with_reference(run, case)
        model = build_model(case.model, case.cfg, seed=case.seed)
        check_communication(run, case, expected_calls=len(assign_buckets(list(model.parameters()),
                                                                          case.bucket_cap_bytes)))
        if case.model == "gpt":
            _check_overlap(run, case)
        _check_mean_loss(run, case)
    return (f"{len(cases)} cases on {_sizes(cases)} ranks with {'/'.join(str(c.accum) for c in cases)} micro-steps: "
            f"one big-batch step, communication on the last micro-step only")


# The boundaries each exercise's text names (harness.Edge; tests/grading/test_reference_seeds.py checks every seed's
# cases hold each): 3.1's tied weight, frozen parameters and a gradient missing on a rank; 3.2's "close the bucket
# as soon as it holds bucket_cap_bytes or more" (exactly at the cap, one byte over, one bucket for everything); 3.3's
# buckets launched in order and a flush of gradients that never came; 3.4's A micro-steps (A != N) and a gradient
# accumulated in an early micro-step only. Every exercise trains on a world size above 2.
_ABOVE_2 = Edge("a world size above 2", lambda c: c.get("world", 0) > 2)
_TIED = Edge("a tied weight", lambda c: c.get("model") == "gpt" and c.get("tied"))
_EDGE_MODEL = Edge("frozen, unused and sometimes-unused parameters", lambda c: c.get("model") == "edge")
EDGES = {
    "3.1": [_TIED, _EDGE_MODEL, _ABOVE_2],
    "3.2": [Edge("a bucket that reaches the cap exactly", lambda c: c.get("exact") and c["cap"] == c["exact"]),
            Edge("a cap one byte above a bucket's size", lambda c: c.get("exact") and c["cap"] == c["exact"] + 1),
            Edge("one bucket holding every parameter", lambda c: "exact" in c and c["cap"] >= c["total"]),
            _EDGE_MODEL, _ABOVE_2],
    "3.3": [Edge("several buckets, launched in order", lambda c: c.get("buckets", 0) >= 2), _TIED, _EDGE_MODEL,
            Edge("a gradient on a rank in one step and none in the next", lambda c: c.get("missing_then_back")),
            Edge("a gradient accumulated under no_sync that reaches its bucket in the flush",
                 lambda c: c.get("early_not_last")), _ABOVE_2],
    "3.4": [Edge("A micro-steps, A != N", lambda c: c.get("accum", 1) > 1 and c["accum"] != c["world"]),
            Edge("a gradient accumulated in an early micro-step only", lambda c: c.get("early_not_last")),
            _EDGE_MODEL, _ABOVE_2],
}

# Mutants of the reference that compute the same thing (distlab notebooks mutants), each with why.
_INDEPENDENT = "two statements that do not read each other's names, in the other order"
_LINEAR = "dividing by the world size before or after the sum gives the same mean (the all-reduce is linear)"
EQUIVALENT_MUTANTS = {
    "3.1 statements-swapped: `dist.all_reduce(p.grad) p.grad /= world` → `p.grad /= world dist.all_reduce(p.grad)`":
        _LINEAR,
    "3.1 statements-swapped: `for p in model.parameters(): dist.broadcast(p.data, src=0) for b in m…` → "
    "`for b in model.buffers(): dist.broadcast(b, src=0) for p in model.par…`": _INDEPENDENT,
    "3.2 statements-swapped: `dist.all_reduce(flat) flat /= world` → `flat /= world dist.all_reduce(flat)`": _LINEAR,
    "3.2 statements-swapped: `flat /= world offset = 0` → `offset = 0 flat /= world`": _INDEPENDENT,
    "3.2 statements-swapped: `current.append(p) size += p.numel() * p.element_size()` → "
    "`size += p.numel() * p.element_size() current.append(p)`": _INDEPENDENT,
    "3.2 call-removed: `flat[offset:offset + p.numel()].view_as(p).clone()` → "
    "`flat[offset:offset + p.numel()].view_as(p)`": "each gradient a view into its bucket's flat tensor instead of a "
                                                    "copy: the same values, and the optimizer only reads them",
    "3.3 guard-removed: `j not in ready` → `True`": "loading a slot whose gradient already arrived copies the same "
                                                     "p.grad into it again",
    "3.3 statements-swapped: `handle.wait() bucket.store_grads()` → `bucket.store_grads() handle.wait()`":
        "store_grads makes each p.grad a view of the bucket's buffer, so after the wait p.grad holds the reduced "
        "values either way",
    "3.3 statements-swapped: `if len(ready) < len(bucket.params) and not flush: return for j in ran…` → "
    "`for j in range(len(bucket.params)): if j not in ready: bucket.load_gr…`":
        "a missing slot loaded before the fullness test is loaded again, with its gradient, when it arrives",
    "3.3 statements-swapped: `self.buckets[i].load_grad(j) self.ready[i].add(j)` → "
    "`self.ready[i].add(j) self.buckets[i].load_grad(j)`": _INDEPENDENT,
    "3.3 statements-swapped: `self.handles.append(dist.all_reduce(bucket.buffer, async_op=True)) se…` → "
    "`self.next_bucket += 1 self.handles.append(dist.all_reduce(bucket.buff…`": _INDEPENDENT,
    "3.3 statements-swapped: `self.ready[i].add(j) self.launch_full_buckets()` → "
    "`self.launch_full_buckets() self.ready[i].add(j)`": "the bucket is then launched at the next hook or the flush "
                                                         "instead of at once: the same reduced gradients, later",
    "3.4 call-removed: `loss.item()` → `loss`": "the mean loss returned as a one-element tensor, which the check "
                                                "reads as the number",
}

QUIZ = [
    quiz.number("Q3.1", "GB each GPU sends per step for a {billions}B model's bf16 gradients on {gpus} GPUs",
                rel_tol=0.01, given=dict(billions=7, gpus=8), vary=dict(billions=(1, 3, 13, 34, 70), gpus=(4, 16, 64)),
                solve=lambda billions, gpus: ring_all_reduce_bytes(billions * 1e9 * 2, gpus) / 1e9,
                hint="'What it costs: bytes on the wire': 2(N-1)/N x the gradient bytes"),
    quiz.number("Q3.2", "SGD update factor when gradients are summed, not averaged, over {ranks} ranks", rel_tol=0,
                given=dict(ranks=4), vary=dict(ranks=(2, 3, 5, 6, 8, 12, 16, 32)),
                solve=lambda ranks: ranks,  # the sum of N equal gradients is N times their mean
                hint="'Why averaging gradients is exact': the sum is N times the mean"),
    quiz.number("Q3.3", "all-reduces per step, after the first iteration, for {megabytes} MB of gradients under "
                "PyTorch DDP's default buckets", rel_tol=0, given=dict(megabytes=30),
                vary=dict(megabytes=(10, 20, 50, 60, 80, 100, 120)),
                solve=lambda megabytes: pytorch_bucket_count(megabytes * 1e6),
                hint="'What PyTorch's DDP really does with buckets': which cap does the first bucket get, and "
                     "which the others?"),
    quiz.choice("Q3.4", "all-reduce rounds per optimizer step with 4 micro-steps under no_sync", answer="b",
                options="abc", hint="exercise 3.4: only the last micro-step's backward communicates"),
    quiz.number("Q3.5", "MFU of a {billions}B model at {tokens:,} tokens/s per H100 (989 TFLOP/s)", rel_tol=0.03,
                given=dict(billions=7, tokens=3000), vary=dict(billions=(3, 8, 13), tokens=(1500, 2000, 4500)),
                solve=lambda billions, tokens: mfu(6 * billions * 1e9, tokens, 989e12),
                hint="'FLOPs per token and MFU': 6N FLOPs per token x tokens/s / peak"),
    quiz.choice("Q3.6", "not a suspect for an MFU of 18%", answer="d", options="abcd",
                hint="'MFU at 18%: where the time goes': which of these changes how much time the GPUs spend "
                     "on anything but model math?"),
]

EXERCISES = [
    Exercise("3.1", "naive DDP: broadcast and average gradients", 3, check_naive_ddp,
             references=("distlab.data_parallel.allreduce_gradients", "distlab.data_parallel.broadcast_parameters")),
    Exercise("3.2", "gradient buckets: one flat all-reduce per bucket", 3, check_bucketed_ddp,
             references=("distlab.data_parallel.allreduce_buckets", "distlab.data_parallel.assign_buckets")),
    Exercise("3.3", "overlap all-reduce with backward from gradient hooks", 4, check_overlapped_ddp,
             references=("distlab.data_parallel.OverlappedDDP",)),
    Exercise("3.4", "gradient accumulation with no_sync", 2, check_gradient_accumulation),
    *QUIZ,
]
