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

import random

import torch
import torch.distributed as dist

from distlab.collectives import ring_all_reduce_bytes
from distlab.data_parallel import OverlappedDDP, assign_buckets, pytorch_buckets, train_step
from distlab.data_parallel import broadcast_parameters as reference_broadcast
from distlab.flops import mfu
from distlab.grading import quiz
from distlab.grading.contract import CheckFailed
from distlab.grading.harness import (
    LONG_JOB_TIMEOUT,
    case_gradient_bytes,
    lab_seed,
    raise_if_untouched,
    rank_seed,
    run_isolated,
    run_on_ranks,
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


# ---------------------------------------------------------------- running on ranks

def _state(module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in module.state_dict().items()}


def _train_with_sync(module, sync_gradients, case: Case) -> dict:
    """SGD steps on this rank's slice of each global batch, gradients synchronised by ``sync_gradients()``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"initial": _state(module), "states": []}
    opt = make_optimizer(module.parameters(), "sgd", lr=case.lr)
    for step in range(case.steps):
        (x, y), = local_batches(case.cfg, case.batch, step, rank, world, 1, case.data_seed)
        opt.zero_grad(set_to_none=True)
        _, loss = module(x, y)
        loss.backward()
        sync_gradients()
        opt.step()
        out["states"].append(_state(module))
    return out


def _worker_functions(broadcast_fn, allreduce_fn, case: Case) -> dict:
    """3.1 on a rank: the student's broadcast, then SGD steps with the student's gradient all-reduce."""
    module = build_model(case.model, case.cfg, seed=rank_seed(case.seed, dist.get_rank()))
    broadcast_fn(module)
    return _train_with_sync(module, lambda: allreduce_fn(module), case)


def _worker_buckets(assign_fn, allreduce_buckets_fn, case: Case) -> dict:
    """3.2 on a rank: the reference broadcast, the student's buckets and bucketed all-reduce."""
    module = build_model(case.model, case.cfg, seed=rank_seed(case.seed, dist.get_rank()))
    reference_broadcast(module)
    buckets = assign_fn(list(module.parameters()), case.bucket_cap_bytes)
    return _train_with_sync(module, lambda: allreduce_buckets_fn(buckets), case)


def _worker_ddp(ddp_factory, step_fn, case: Case) -> dict:
    """3.3/3.4 on a rank: a DDP class driven by a step function over ``accum`` micro-batches."""
    rank, world = dist.get_rank(), dist.get_world_size()
    module = build_model(case.model, case.cfg, seed=rank_seed(case.seed, rank))
    ddp = ddp_factory(module, case.bucket_cap_bytes)
    out = {"initial": _state(module), "states": []}
    opt = make_optimizer(module.parameters(), "sgd", lr=case.lr)
    for step in range(case.steps):
        micro = local_batches(case.cfg, case.batch, step, rank, world, case.accum, case.data_seed)
        opt.zero_grad(set_to_none=True)
        step_fn(ddp, opt, micro)
        out["states"].append(_state(module))
    return out


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
    cases = [_case(rng, "gpt", tied=True), _case(rng, "edge")]
    for case in cases:
        run = _launch(_worker_functions, case, broadcast_parameters, allreduce_gradients)
        compare_with_reference(run, case)
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
        for cap in (rng.randint(256, 4096), rng.randint(total // 6, total // 2), 25 * 2**20):
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
    cases = [_case(rng, "gpt"), _case(rng, "edge")]
    for case in cases:
        total = case_gradient_bytes(case)
        case.bucket_cap_bytes = rng.randint(total // 8, total // 3)
        _train_and_verify_buckets(_worker_buckets, case, assign_buckets_fn, allreduce_buckets_fn)
    return (f"{n_assign} bucket assignments; {len(cases)} training cases on {_sizes(cases)} ranks: one all-reduce "
            f"per bucket, weights equal the single-process run")


# ---------------------------------------------------------------- 3.3

def _check_overlap(run, case: Case) -> None:
    for rank in range(case.world_size):
        spans = [s for s in run.spans if s.rank == rank]
        backward = [s for s in spans if s.label == "backward"]
        reduces = [s for s in spans if s.label == "all_reduce"]
        overlapped = any(b.start <= r.start < b.end for b in backward for r in reduces)
        if not overlapped:
            raise CheckFailed(
                f"{case}: on rank {rank} no bucket's all_reduce started before backward finished: launch it "
                f"from the gradient hook as soon as its bucket is full, with async_op=True, and wait for the "
                f"handles in finish_gradient_sync()")


def check_overlapped_ddp(ddp_class) -> str:
    """3.3: a DDP class ``ddp_class(module, bucket_cap_bytes)`` whose hooks launch async bucket all-reduces."""
    raise_if_untouched(ddp_class)
    rng = random.Random(_seed() + 3)
    cases = [_case(rng, "gpt", tied=True), _case(rng, "edge")]
    for case in cases:
        total = case_gradient_bytes(case)
        case.bucket_cap_bytes = rng.randint(total // 8, total // 4)  # at least 4 buckets
        run = _train_and_verify_buckets(_worker_ddp, case, ddp_class, train_step)
        if case.model == "gpt":
            _check_overlap(run, case)
    return (f"{len(cases)} cases on {_sizes(cases)} ranks: all-reduces start during backward, buckets with "
            f"missing gradients flushed, weights equal the single-process run")


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


def check_gradient_accumulation(no_sync, train_accumulated) -> str:
    """3.4: ``no_sync(ddp)`` context and ``train_accumulated(ddp, optimizer, micro_batches)``."""
    raise_if_untouched(train_accumulated)
    _check_no_sync_context(no_sync)
    rng = random.Random(_seed() + 4)
    cases = [_case(rng, "gpt", rows=1), _case(rng, "edge", rows=1)]
    for case in cases:  # accum != world size, so a wrong factor points at one cause
        case.accum = rng.choice([a for a in (2, 3, 4) if a != case.world_size])
        total = case_gradient_bytes(case)
        case.bucket_cap_bytes = rng.randint(total // 6, total // 3)
        _train_and_verify_buckets(_worker_ddp, case, OverlappedDDP, train_accumulated)
    return (f"{len(cases)} cases on {_sizes(cases)} ranks with {'/'.join(str(c.accum) for c in cases)} micro-steps: "
            f"one big-batch step, communication on the last micro-step only")


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
                solve=lambda megabytes: len(pytorch_buckets([torch.nn.Parameter(torch.empty(25_000))
                                                             for _ in range(megabytes * 10)])),
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
