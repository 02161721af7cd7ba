"""Lab 03: every DDP variant equals single-process training, moves exactly the gradient bytes,
overlaps when it should, handles frozen/unused/tied parameters and world size 1, and the
checkers pass the reference while telling a wrong student which parameter differs and why."""

import contextlib

import pytest
import torch
import torch.distributed as dist

import distlab
from distlab.data_parallel import (
    Bucket,
    NaiveDDP,
    OverlappedDDP,
    allreduce_buckets,
    allreduce_gradients,
    assign_buckets,
    broadcast_parameters,
    pytorch_buckets,
    torch_ddp_buckets,
    train,
    train_step,
    train_worker,
)
from distlab.flops import measure_matmul_peak, mfu, model_flops_per_token, tokens_per_second
from distlab.grading import CheckFailed, lab03
from distlab.model import GPT, GPTConfig, flops_per_token
from distlab.reference import max_abs_diff, train_reference
from distlab.workload import EdgeCaseGPT, gradient_bytes, reference_run

pytestmark = [pytest.mark.timeout(120)]

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)
# the checkers' setting: tests and checkers share the warm groups
FAST = dict(collective_timeout=lab03.COLLECTIVE_TIMEOUT)
STEPS, BATCH = 3, 8  # 8 rows: 2 per rank on 4 ranks, 4 per rank on 2


@pytest.fixture(scope="module")
def ranks4():
    yield distlab.Ranks.shared(4, **FAST)
    distlab.shutdown()


@pytest.fixture(scope="module")
def ranks2():
    yield distlab.Ranks.shared(2, **FAST)
    distlab.shutdown()


def _check_equal(run, ref, atol=1e-6):
    for rank, out in enumerate(run):
        name, diff = max_abs_diff(out["state"], ref["state"])
        assert diff <= atol, f"rank {rank}: {name} differs by {diff}"


# ---------------------------------------------------------------- single process pieces


@contextlib.contextmanager
def no_sync(ddp):
    """A student's answer to exercise 3.4's context manager."""
    ddp.require_backward_grad_sync = False
    try:
        yield
    finally:
        ddp.require_backward_grad_sync = True

def test_bucket_assignment_reverse_order_cap_and_ties():
    model = EdgeCaseGPT(CFG)
    params = list(model.parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    buckets = assign_buckets(params, 4096)
    flat = [names[id(p)] for b in buckets for p in b]
    expected = [n for n, p in reversed(list(model.named_parameters())) if p.requires_grad]
    assert flat == expected  # reverse registration order, frozen pos_emb skipped, tied weight once
    assert "gpt.pos_emb.weight" not in flat and flat.count("gpt.tok_emb.weight") == 1
    for b in buckets[:-1]:  # every closed bucket reached the cap; dropping its last param falls below
        size = sum(p.numel() * 4 for p in b)
        assert size >= 4096 and size - b[-1].numel() * 4 < 4096
    assert len(assign_buckets(params, 25 * 2**20)) == 1
    assert [len(b) for b in assign_buckets(params, 1)] == [1] * len(flat)
    with pytest.raises(ValueError, match="bucket_cap_bytes"):
        assign_buckets(params, 0)


def test_pytorch_bucket_rule_caps_the_first_bucket_only():
    params = [torch.nn.Parameter(torch.empty(2**16)) for _ in range(12)]  # 256 KiB each
    assert [len(b) for b in pytorch_buckets(params, 2**20, first_bucket_cap_bytes=2**18)] == [1, 4, 4, 3]
    assert [len(b) for b in pytorch_buckets(params, 2**20, first_bucket_cap_bytes=2**20)] == [4, 4, 4]
    assert len(pytorch_buckets(params)) == 2  # 1 MiB first (dist._DEFAULT_FIRST_BUCKET_BYTES), then 25 MiB
    with pytest.raises(ValueError, match="first_bucket_cap_bytes"):
        pytorch_buckets(params, first_bucket_cap_bytes=0)


def test_pytorch_buckets_are_the_buckets_torch_ddp_rebuilds(ranks2):
    """The rule the lab states, against the installed torch's DDP: one bucket in the first iteration, then
    the gradients' arrival order with a 1 MiB first bucket (default cap) or one cap throughout (cap set)."""
    cfg = GPTConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, d_model=128)  # 3.3 MB of gradients
    model = GPT(cfg, seed=0)
    by_name, names = dict(model.named_parameters()), {id(p): n for n, p in model.named_parameters()}
    for options, first_cap in (({}, dist._DEFAULT_FIRST_BUCKET_BYTES), ({"bucket_cap_mb": 0.5}, 2**19)):
        real = ranks2.run(torch_ddp_buckets, kwargs=dict(cfg=cfg, **options), show_output=False)[0]
        assert real["first_bucket_cap_bytes"] == first_cap and len(real["launched"][0]) == 1, options
        rebuilt = [bucket_names for bucket_names, _ in real["launched"][1]]
        rule = pytorch_buckets([by_name[n] for n in real["arrival"]], real["bucket_cap_bytes"], first_cap)
        assert [[names[id(p)] for p in b] for b in rule] == rebuilt and len(rebuilt) > 1, options


def test_bucket_views_share_the_flat_buffer():
    model = GPT(CFG)
    bucket = Bucket(0, list(model.parameters())[:3])
    for p in bucket.params:
        p.grad = torch.full_like(p, 2.0)
    bucket.load_grads()
    assert bucket.buffer.eq(2.0).all() and bucket.nbytes == bucket.numel * 4
    bucket.buffer.mul_(3)
    bucket.store_grads()
    assert all(p.grad.eq(6.0).all() and p.grad.data_ptr() == v.data_ptr() for p, v in zip(bucket.params, bucket.views))


def test_reference_run_is_train_reference():
    ours = reference_run(CFG, steps=2, batch_size=4, seed=3, optimizer="adamw", lr=1e-3)
    from distlab.workload import global_batch
    theirs = train_reference(CFG, [global_batch(CFG, 4, s) for s in range(2)], lr=1e-3, optimizer="adamw", seed=3)
    assert max_abs_diff(ours["state"], theirs.state_dict)[1] == 0.0
    assert ours["losses"] == theirs.losses


def test_without_process_group_the_error_is_clear():
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        NaiveDDP(GPT(CFG))
    with pytest.raises(RuntimeError, match="not initialised"):
        allreduce_gradients(GPT(CFG))


def test_flops_and_mfu_helpers():
    b = model_flops_per_token(CFG)
    assert b.total == flops_per_token(CFG)
    assert b.dense == 6 * b.matmul_params and 0 < b.attention_share < 0.5
    peak = measure_matmul_peak(sizes=(64, 128), min_seconds=0.01)
    assert peak.flops > 1e6 and peak.size in (64, 128)
    assert mfu(1e9, 100.0, 2e11) == pytest.approx(0.5)
    assert tokens_per_second(0.4, 6e9, 989e12, devices=8) == pytest.approx(0.4 * 8 * 989e12 / 6e9)


# ---------------------------------------------------------------- equivalence on real ranks

@pytest.mark.parametrize("model", ["gpt", "edge"])
def test_every_variant_equals_single_process(ranks4, model):
    ref = reference_run(CFG, steps=STEPS, batch_size=BATCH, model=model)
    for variant in ("naive", "bucketed", "overlapped", "torch"):
        run = ranks4.run(train_worker, kwargs=dict(variant=variant, cfg=CFG, steps=STEPS, batch_size=BATCH,
                                                   model=model, bucket_cap_bytes=8192))
        _check_equal(run, ref)
        assert [out["losses"] for out in run][0] != ref["losses"]  # local losses, not the global ones


def test_untied_embeddings_and_two_ranks(ranks2):
    cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=2, d_model=32, tied_embeddings=False)
    ref = reference_run(cfg, steps=STEPS, batch_size=BATCH, seed=7, data_seed=1)
    for variant in ("naive", "overlapped"):
        run = ranks2.run(train_worker, kwargs=dict(variant=variant, cfg=cfg, steps=STEPS, batch_size=BATCH,
                                                   seed=7, data_seed=1, bucket_cap_bytes=4096))
        _check_equal(run, ref)


def test_accumulation_equals_one_big_batch(ranks2):
    ref = reference_run(CFG, steps=STEPS, batch_size=12, model="edge")
    for variant in ("bucketed", "overlapped", "torch"):
        run = ranks2.run(train_worker, kwargs=dict(variant=variant, cfg=CFG, steps=STEPS, batch_size=12, accum=3,
                                                   model="edge", bucket_cap_bytes=8192))
        _check_equal(run, ref)
        if variant != "torch":  # communication on the last micro-step only
            stats = run.comm[0].ops["all_reduce"]
            assert stats.calls == STEPS * run[0]["n_buckets"]
            assert stats.payload_bytes == STEPS * run[0]["grad_bytes"]


def test_adamw_with_find_unused_parameters(ranks2):
    """A parameter no rank used keeps grad=None, so AdamW skips it as in single-process training."""
    ref = reference_run(CFG, steps=4, batch_size=8, model="edge", optimizer="adamw", lr=1e-3)
    run = ranks2.run(train_worker, kwargs=dict(variant="overlapped", cfg=CFG, steps=4, batch_size=8, model="edge",
                                               optimizer="adamw", lr=1e-3, bucket_cap_bytes=8192,
                                               find_unused_parameters=True))
    _check_equal(run, ref, atol=1e-5)  # Adam divides by sqrt(v): fp32 rounding is amplified near zero grads
    assert run[0]["state"]["unused"].equal(ref["state"]["unused"])


def test_world_size_one():
    ref = reference_run(CFG, steps=2, batch_size=4, model="edge")
    for variant in ("naive", "bucketed", "overlapped"):
        run = distlab.launch(train_worker, 1, kwargs=dict(variant=variant, cfg=CFG, steps=2, batch_size=4,
                                                          model="edge", bucket_cap_bytes=4096), **FAST)
        _check_equal(run, ref)
        assert run.comm[0].ops["all_reduce"].wire_bytes == 0


# ---------------------------------------------------------------- communication accounting

def test_bytes_per_step_are_gradient_bytes_and_ring_formula(ranks4):
    grad = gradient_bytes(GPT(CFG))
    assert grad == 4 * sum(p.numel() for p in GPT(CFG).parameters())  # tied weight once
    for variant in ("naive", "bucketed", "overlapped"):
        run = ranks4.run(train_worker, kwargs=dict(variant=variant, cfg=CFG, steps=STEPS, batch_size=BATCH,
                                                   bucket_cap_bytes=16384, return_state=False))
        for log in run.comm:
            stats = log.ops["all_reduce"]
            assert stats.payload_bytes == STEPS * grad, variant
            assert stats.wire_bytes == pytest.approx(STEPS * 2 * 3 / 4 * grad), variant
            assert log.ops["broadcast"].payload_bytes == 4 * sum(p.numel() for p in GPT(CFG).parameters())


def test_frozen_parameters_are_not_reduced(ranks2):
    run = ranks2.run(train_worker, kwargs=dict(variant="overlapped", cfg=CFG, steps=1, batch_size=4, model="edge",
                                               bucket_cap_bytes=4096, return_state=False))
    model = EdgeCaseGPT(CFG)
    frozen = model.gpt.pos_emb.weight.numel() * 4
    total = sum(p.numel() * 4 for p in model.parameters())
    assert run.comm[0].ops["all_reduce"].payload_bytes == total - frozen == run[0]["grad_bytes"]


# ---------------------------------------------------------------- timeline

def _backward_overlaps(run, rank):
    backward = [s for s in run.spans if s.rank == rank and s.label == "backward"]
    reduces = [s for s in run.spans if s.rank == rank and s.label == "all_reduce"]
    return any(b.start <= r.start < b.end for b in backward for r in reduces)


def test_overlapped_timeline_overlaps_and_naive_does_not(ranks4):
    kwargs = dict(cfg=CFG, steps=2, batch_size=BATCH, bucket_cap_bytes=8192, return_state=False)
    overlapped = ranks4.run(train_worker, kwargs=dict(kwargs, variant="overlapped"))
    naive = ranks4.run(train_worker, kwargs=dict(kwargs, variant="naive"))
    for rank in range(4):
        assert _backward_overlaps(overlapped, rank)
        assert not _backward_overlaps(naive, rank)


# ---------------------------------------------------------------- robustness

def test_missing_finish_is_a_clear_error_not_a_hang(ranks2):
    def forgets():
        model = GPT(CFG)
        ddp = OverlappedDDP(model, 4096)
        x, y = distlab.workload.local_batches(CFG, 4, 0, dist.get_rank(), 2)[0]
        ddp(x, y)[1].backward()
        ddp(x, y)  # no finish_gradient_sync()

    with pytest.raises(distlab.RankFailed, match="finish_gradient_sync"):
        ranks2.run(forgets, show_output=False)


def test_train_entry_point_under_launch(ranks2):
    run = ranks2.run(train, kwargs=dict(steps=2, warmup=0, variant="overlapped", batch_size=2, n_layer=1,
                                        d_model=32, seq_len=16, vocab_size=64, bucket_mb=0.01))
    assert [r["rank"] for r in run] == [0, 1]
    assert run[0]["allreduce_bytes_per_step"] == run[0]["grad_bytes"]
    assert run[0]["world_size"] == 2 and run[0]["tokens_per_s"] > 0


# ---------------------------------------------------------------- checkers

def _broadcast(model):
    broadcast_parameters(model)


def _sum_not_mean(model):
    for p in model.parameters():
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)


def test_checkers_pass_the_reference():
    from distlab.data_parallel import train_step as reference_step

    assert "cases" in lab03.check_naive_ddp(broadcast_parameters, allreduce_gradients)
    assert "bucket" in lab03.check_bucketed_ddp(assign_buckets, allreduce_buckets)
    assert "cases" in lab03.check_overlapped_ddp(OverlappedDDP)


    assert "micro-steps" in lab03.check_gradient_accumulation(no_sync, reference_step)
    assert [e.id for e in lab03.EXERCISES if not e.is_quiz] == ["3.1", "3.2", "3.3", "3.4"]


def test_sum_not_mean_names_parameter_and_factor():
    with pytest.raises(CheckFailed, match=r"rank 0's \S+ differs from the reference by a factor of [234]\.00: "
                                          r"gradients summed but not divided by world size\?"):
        lab03.check_naive_ddp(broadcast_parameters, _sum_not_mean)
    result = distlab.check("3.1", broadcast_parameters, _sum_not_mean, quiet=True)
    assert result.status == "failed" and "factor" in result.detail


def test_checker_mistakes_are_explained():
    def no_broadcast(model):
        pass

    with pytest.raises(CheckFailed, match=r"rank 1's \S+ differs from rank 0's initial weights"):
        lab03.check_naive_ddp(no_broadcast, allreduce_gradients)

    def forward_order(params, cap):
        return [list(b)[::-1] for b in assign_buckets(list(params)[::-1], cap)][::-1] or [[]]

    with pytest.raises(CheckFailed, match="reverse registration order|bucket"):
        lab03.check_bucketed_ddp(forward_order, allreduce_buckets)

    def with_frozen(params, cap):
        params = list(params)
        return assign_buckets(params, cap)[:-1] + [assign_buckets(params, cap)[-1] + [p for p in params
                                                                                  if not p.requires_grad]]

    with pytest.raises(CheckFailed, match=r"requires_grad=False\) is in a bucket"):
        lab03.check_bucketed_ddp(with_frozen, allreduce_buckets)

    @contextlib.contextmanager
    def syncs_anyway(ddp):
        yield

    with pytest.raises(CheckFailed, match="inside no_sync"):
        lab03.check_gradient_accumulation(syncs_anyway, train_step)


    def sync_every_micro_step(ddp, optimizer, micro_batches):
        for x, y in micro_batches:
            (ddp(x, y)[1] / len(micro_batches)).backward()
            ddp.finish_gradient_sync()
        optimizer.step()
        optimizer.zero_grad()

    with pytest.raises(CheckFailed, match="all_reduce calls carried .* not on every micro-step"):
        lab03.check_gradient_accumulation(no_sync, sync_every_micro_step)

    def loss_not_scaled(ddp, optimizer, micro_batches):
        for k, (x, y) in enumerate(micro_batches):
            with no_sync(ddp) if k < len(micro_batches) - 1 else contextlib.nullcontext():
                ddp(x, y)[1].backward()
        ddp.finish_gradient_sync()
        optimizer.step()
        optimizer.zero_grad()

    with pytest.raises(CheckFailed, match=r"factor of [234]\.00: gradients of the [234] micro-steps summed"):
        lab03.check_gradient_accumulation(no_sync, loss_not_scaled)

    def skips_missing(model):  # no zeros for a missing grad: ranks disagree on the calls
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()

    with pytest.raises((CheckFailed, distlab.LaunchError)):
        lab03.check_naive_ddp(broadcast_parameters, skips_missing)


def test_blocking_class_fails_the_overlap_check():
    from distlab.data_parallel import BucketedDDP

    with pytest.raises(CheckFailed, match="no all-reduce overlapped backward: no bucket's all_reduce was launched "
                                          r"before finish_gradient_sync\(\)"):
        lab03.check_overlapped_ddp(BucketedDDP)


def test_untouched_stubs_are_not_attempted():
    def stub(*args):
        raise NotImplementedError("Exercise 3.1: replace this line with your solution")

    assert distlab.check("3.1", stub, stub, quiet=True).status == "not attempted"

    class StubDDP(OverlappedDDP):
        def _grad_ready(self, param):
            raise NotImplementedError("Exercise 3.3: replace this line with your solution")

    assert distlab.check("3.3", StubDDP, quiet=True).status == "not attempted"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_nccl_rank_on_a_gpu_trains_like_the_cpu_reference(no_leftover_ranks):
    ref = reference_run(CFG, steps=STEPS, batch_size=BATCH)
    for variant in ("naive", "bucketed", "overlapped", "torch"):
        run = distlab.launch(train_worker, 1, backend="nccl", kwargs=dict(variant=variant, cfg=CFG, steps=STEPS,
                                                                          batch_size=BATCH, bucket_cap_bytes=8192))
        name, diff = max_abs_diff(run[0]["state"], ref["state"])
        assert diff < 1e-4, (variant, name, diff)  # GPU kernels sum in another order than the CPU's
    peak = measure_matmul_peak(sizes=(1024, 4096), dtype=torch.bfloat16, device="cuda", min_seconds=0.05)
    assert peak.flops > 1e13 and peak.device == "cuda"
