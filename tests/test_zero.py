"""Lab 04: every ZeRO stage, and FSDP2's per-parameter design, equals single-process training and PyTorch's own
(ZeroRedundancyOptimizer, FSDP2), holds the bytes the formulas say, moves the bytes the ring model says, handles
padding, frozen, unused and tied parameters, rejects plans that cannot work before any rank starts, and the checkers
pass the reference while explaining typical mistakes."""

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import distlab
from distlab.grading import CheckFailed, lab04
from distlab.memory import bytes_per_param
from distlab.model import GPT, Block, GPTConfig
from distlab.reference import max_abs_diff
from distlab.workload import reference_run
from distlab.zero import (
    FlatLayout,
    PerParamFSDP,
    alloc_storage,
    assign_params,
    checkpoint_module,
    dim0_chunk,
    free_storage,
    mixed_precision_step,
    plan_units,
    reshard,
    train,
    train_per_param,
    train_worker,
    validate,
)

from processes import rank_processes

pytestmark = [pytest.mark.timeout(180)]

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)
STEPS, BATCH = 3, 12  # 12 rows: 3 per rank on 4 ranks, 4 on 3


@pytest.fixture(scope="module")
def ranks():
    """Warm groups of 4 and 2 ranks (the checkers' too); none may outlive the module."""
    yield {4: distlab.Ranks.shared(4), 2: distlab.Ranks.shared(2)}
    distlab.shutdown()
    deadline = time.monotonic() + 5
    while rank_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not rank_processes(), "rank processes left behind"


def _worst(run, ref):
    return max(max_abs_diff(out["state"], ref["state"]) for out in run)


# ---------------------------------------------------------------- single process pieces

def test_flat_layout_pads_to_equal_shards_and_views_each_parameter():
    params = [torch.zeros(3, 5), torch.zeros(2), torch.zeros(1)]  # 18 elements; a 1-element "bias"
    layout = FlatLayout(params, 4)
    assert (layout.numel, layout.shard_numel, layout.padded_numel, layout.padding) == (18, 5, 20, 2)
    flat = layout.flatten([torch.ones(3, 5), None, torch.full((1,), 7.0)])
    assert flat.tolist() == [1.0] * 15 + [0.0, 0.0, 7.0, 0.0, 0.0]
    assert [v.shape for v in layout.views(flat)] == [(3, 5), (2,), (1,)]
    assert layout.shard(flat, 2).tolist() == [1.0] * 5 and layout.shard(flat, 3).tolist() == [0, 0, 7, 0, 0]
    # (the 3x5 weight straddles shards 0-2: sharding is elementwise, so that is fine)
    assert FlatLayout(params, 32).shard_numel == 1  # more ranks than elements: padding only
    with pytest.raises(ValueError, match="at least one parameter"):
        FlatLayout([], 2)


def test_storage_is_freed_and_refilled_under_live_views():
    full = torch.arange(6.0)
    view = full[2:5]
    free_storage(full)
    assert full.untyped_storage().nbytes() == 0 and view.shape == (3,)
    alloc_storage(full)
    full.copy_(torch.arange(6.0) * 2)
    assert view.tolist() == [4.0, 6.0, 8.0]


def test_wrap_plans_that_cannot_work_fail_before_any_rank_starts():
    model = GPT(CFG)
    assert [name for name, _ in plan_units(model, (Block,))] == ["", "blocks.0", "blocks.1"]
    assert [name for name, _ in plan_units(model, ())] == [""]
    with pytest.raises(ValueError, match="ModuleList is a container that is never called"):
        plan_units(model, (nn.ModuleList,))
    with pytest.raises(ValueError, match=r"contains no module of that class \(it has: .*Block"):
        plan_units(model, (nn.Conv2d,))
    with pytest.raises(ValueError, match="must list nn.Module classes"):
        plan_units(model, ("Block",))
    for kwargs, message in [(dict(batch_size=10), "not divisible by world_size=4"),
                            (dict(shard_size=3), "shard_size=3 must be a positive divisor of world_size=4"),
                            (dict(stage=4), "expected 0 \\(DDP\\), 1, 2 or 3"),
                            (dict(stage=2, impl="torch"), "impl='torch' exists for stage 1"),
                            (dict(wrap="layer"), "wrap='layer'"),
                            (dict(stage=0, shard_size=2), "DDP \\(stage 0\\) shards nothing")]:
        with pytest.raises(ValueError, match=message):
            validate(4, **{"stage": 3, "batch_size": 8, **kwargs})


def test_a_tied_weight_belongs_to_the_unit_enclosing_both_uses():
    model = GPT(CFG)
    names = ["", "tok_emb", "lm_head", "blocks.0"]
    owned = assign_params(model, names)
    assert any(p is model.tok_emb.weight for p in owned[0])  # used by tok_emb and lm_head: the root
    assert owned[1] == [] and owned[2] == []
    assert {id(p) for p in owned[3]} == {id(p) for p in model.blocks[0].parameters()}


def test_mixed_precision_step_accumulates_below_bf16_resolution():
    master = [torch.ones(4)]
    param = [master[0].to(torch.bfloat16)]
    opt = torch.optim.SGD(master, lr=1.0)
    for _ in range(100):
        param[0].grad = torch.full((4,), 1e-4, dtype=torch.bfloat16)
        mixed_precision_step(param, master, opt)
    assert param[0].dtype == torch.bfloat16 and master[0].dtype == torch.float32
    assert master[0][0].item() == pytest.approx(0.99, abs=1e-4)  # 1 + 1e-4 rounds back to 1 in bf16
    assert torch.equal(param[0], master[0].to(torch.bfloat16)) and param[0].grad is None


def test_checkpoint_module_keeps_names_gradients_and_saves_memory():
    from distlab.memory import ActivationMeter
    from distlab.model import synthetic_batch

    x, y = synthetic_batch(CFG, 4, 0)
    plain, ckpt = GPT(CFG), GPT(CFG)
    for block in ckpt.blocks:
        checkpoint_module(block)
    sizes = []
    for model in (plain, ckpt):
        with ActivationMeter(model) as meter:
            loss = model(x, y)[1]
        loss.backward()
        sizes.append(meter.bytes)
    assert sizes[1] < sizes[0] / 2
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in ckpt.named_parameters()]
    assert all(torch.allclose(a.grad, b.grad, atol=1e-7) for a, b in zip(plain.parameters(), ckpt.parameters()))


# ---------------------------------------------------------------- every stage on real ranks

def test_every_stage_and_pytorch_equal_single_process_with_ddp_or_one_and_a_half_times_its_bytes(ranks):
    ref = reference_run(CFG, steps=STEPS, batch_size=BATCH, lr=0.1)
    grad = 4 * sum(p.numel() for p in GPT(CFG).parameters())
    ddp = 2 * 3 / 4 * grad
    runs = {}
    for stage, impl in [(0, "scratch"), (1, "scratch"), (2, "scratch"), (3, "scratch"), (1, "torch"), (3, "torch")]:
        run = ranks[4].run(train_worker, kwargs=dict(stage=stage, impl=impl, cfg=CFG, steps=STEPS, batch_size=BATCH,
                                                     bucket_cap_bytes=8192), show_output=False)
        runs[stage, impl] = run
        name, diff = _worst(run, ref)
        assert diff <= 1e-6, (stage, impl, name, diff)
    wire = {key: sum(row["wire"] for row in run[0]["comm"].values()) for key, run in runs.items()}
    for stage in (0, 1, 2):
        assert wire[stage, "scratch"] == pytest.approx(ddp, rel=1e-6), stage
    assert wire[3, "scratch"] == pytest.approx(1.5 * ddp, rel=0.01)
    assert runs[3, "scratch"][0]["comm"]["all_gather"]["calls"] == 6  # 3 units (root + 2 blocks), twice
    assert set(runs[3, "torch"][0]["comm"]) == {"all_gather", "reduce_scatter"}  # FSDP2's collectives are counted
    assert set(runs[1, "scratch"][0]["comm"]) == {"reduce_scatter", "all_gather"}


def test_edge_cases_padding_frozen_unused_tied_and_world_size_one(ranks):
    cfg = GPTConfig(vocab_size=47, seq_len=8, n_layer=2, n_head=2, d_model=10, tied_embeddings=True)
    assert FlatLayout(list(GPT(cfg).blocks[0].parameters()), 4).padding == 2  # d_model = 2 mod 4: padded shards
    ref = reference_run(cfg, steps=2, batch_size=8, lr=0.1, model="edge")
    for stage in range(4):
        run = ranks[4].run(train_worker, kwargs=dict(stage=stage, cfg=cfg, steps=2, batch_size=8, model="edge",
                                                     bucket_cap_bytes=1024), show_output=False)
        assert _worst(run, ref)[1] <= 1e-6, stage
        assert run[0]["state"]["gpt.pos_emb.weight"].equal(ref["state"]["gpt.pos_emb.weight"])  # frozen, gathered
    one = distlab.launch(train_worker, 1, kwargs=dict(stage=3, cfg=cfg, steps=2, batch_size=8, model="edge"),
                         show_output=False)
    assert _worst(one, ref)[1] <= 1e-6


def _bytes_per_param(dtype):
    """On a rank: one AdamW step per stage, the bytes held per parameter."""
    runs = [train_worker(stage=stage, cfg=CFG, steps=1, batch_size=4, optimizer="adamw", lr=1e-3, dtype=dtype,
                         measure_state=True, return_state=False, bucket_cap_bytes=8192) for stage in range(4)]
    return [sum(r["state_bytes"].values()) / r["n_params"] for r in runs]


def test_state_bytes_match_the_formulas_mixed_and_fp32(ranks):
    for dtype, precision in (("bf16", "mixed"), (None, "fp32")):
        for measured in ranks[2].run(_bytes_per_param, args=(dtype,), show_output=False):
            formula = [bytes_per_param(stage, 2, precision).total for stage in range(4)]
            assert measured == pytest.approx(formula, rel=0.02), dtype


def test_gradient_accumulation_is_exact_and_costs_zero2_and_zero3_per_micro_batch(ranks):
    """k micro-batches: DDP and ZeRO-1 reduce once, ZeRO-2 (k+1)/2 and ZeRO-3 1.5k times DDP's bytes (issue 26.5),
    what lab 11's planner charges; the weights still equal one full-batch step."""
    from distlab.parallel3d.planner import Layout, dp_messages

    k, world = 3, 2

    def every_stage():
        return {s: train_worker(stage=s, cfg=CFG, steps=1, batch_size=6, lr=0.1, micro_batches=k) for s in range(4)}

    run = ranks[world].run(every_stage)
    ref = reference_run(CFG, steps=1, batch_size=6, lr=0.1)
    wire = {s: sum(row["wire"] for row in run[0][s]["comm"].values()) for s in range(4)}
    planner = {}  # in units of (N-1)/N·M: an all-reduce 2, a reduce-scatter or an all-gather 1
    for s in range(4):
        reductions, gathers = dp_messages(Layout(dp=world, zero=s, m=k))
        planner[s] = 2 * reductions if s == 0 else reductions + gathers
    for stage, expected in {0: 1, 1: 1, 2: (k + 1) / 2, 3: 1.5 * k}.items():
        assert wire[stage] / wire[0] == pytest.approx(expected, rel=0.02), (stage, wire)
        assert planner[stage] / planner[0] == pytest.approx(expected, rel=0.02), (stage, planner)
        assert max(max_abs_diff(out[stage]["state"], ref["state"])[1] for out in run) <= 1e-6, stage
    with pytest.raises(ValueError, match="not divisible by world_size·micro_batches = 4·4"):
        validate(4, batch_size=8, micro_batches=4)


def test_recompute_flop_ratio_of_the_quiz_key_is_what_flop_counter_measures():
    """Q4.7's key is the notebook's measurement: full recomputation of every block, attention core written out.
    Counted on the meta device: FlopCounterMode needs shapes, not numbers."""
    from torch.utils.flop_counter import FlopCounterMode

    from distlab.flops import hfu, mfu
    from distlab.model import synthetic_batch
    from distlab.zero import unfused_attention

    cfg = GPTConfig(vocab_size=128, seq_len=256, n_layer=4, n_head=4, d_model=128)
    x, y = (t.to("meta") for t in synthetic_batch(cfg, 2, 0))
    flops = {}
    for recompute in ("none", "selective", "full"):
        model = GPT(cfg).to("meta")
        for block in model.blocks:
            unfused_attention(block.attn, recompute=recompute == "selective")
            if recompute == "full":
                checkpoint_module(block)
        with FlopCounterMode(display=False) as counter:
            model(x, y)[1].backward()
        flops[recompute] = counter.get_total_flops()
    assert flops["full"] / flops["none"] == pytest.approx(lab04.RECOMPUTE_FLOP_RATIO, rel=1e-9)
    assert flops["full"] / flops["none"] < 4 / 3 and flops["selective"] / flops["none"] - 1 < 0.1
    tokens = 2 * cfg.seq_len  # HFU counts the recomputed FLOPs, MFU does not: their ratio is the FLOP ratio
    hardware = hfu(flops["none"] / tokens, 1e3, 1e12, (flops["full"] - flops["none"]) / tokens)
    assert hardware / mfu(flops["none"] / tokens, 1e3, 1e12) == pytest.approx(lab04.RECOMPUTE_FLOP_RATIO)


def test_unfused_attention_computes_what_the_fused_kernel_does():
    torch.manual_seed(0)
    from distlab.zero import attention_core

    q, k, v = (torch.randn(2, 3, 10, 8) for _ in range(3))
    fused = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(attention_core(q, k, v), fused, atol=1e-5)


def test_model_memory_peak_counts_the_recomputed_layer_and_the_gathered_unit():
    from distlab.memory import PRESETS, activation_bytes_per_layer

    p = PRESETS["70B"]
    rest = p.memory(16, 3, 1, checkpointing=True)
    peak = p.memory(16, 3, 1, checkpointing=True, peak=True)
    layer = activation_bytes_per_layer(p.seq_len, 1, p.d_model, p.n_head)
    assert rest.transient == 0 and peak.total == rest.total + layer + 4 * p.layer_params
    assert rest.total < 80e9 < peak.total  # "16 GPUs fit" was optimistic
    assert p.n_layer * p.layer_params + 2 * p.vocab_size * p.d_model + p.d_model == p.n_params
    assert p.memory(8, 3, 1, flash_attention=True).activations == p.n_layer * 34 * p.seq_len * p.d_model


def test_hsdp_matches_fsdp2_hybrid_and_splits_traffic_by_axis(ranks):
    ref = reference_run(CFG, steps=2, batch_size=8, lr=0.1)
    runs = [ranks[4].run(train_worker, kwargs=dict(stage=3, impl=impl, cfg=CFG, steps=2, batch_size=8, shard_size=2,
                                                   measure_state=impl == "scratch"), show_output=False)
            for impl in ("scratch", "torch")]
    for run in runs:
        assert _worst(run, ref)[1] <= 1e-6
    comm = runs[0][0]["comm"]
    params = 4 * sum(p.numel() for p in GPT(CFG).parameters())
    assert comm["all_gather"]["wire"] == pytest.approx(2 * 0.5 * params)  # inside the "node": 2 ranks
    assert comm["all_reduce"]["payload"] == pytest.approx(params / 2)  # across nodes: only the shard
    per_param = sum(runs[0][0]["state_bytes"].values()) / runs[0][0]["n_params"]
    assert per_param == pytest.approx((4 + 4) / 2, rel=0.02)  # fp32 SGD: weights and gradients split over the node


def test_per_block_wrap_prefetch_checkpointing_and_adamw(ranks):
    cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=4, n_head=2, d_model=32)
    ref = reference_run(cfg, steps=2, batch_size=8, optimizer="adamw", lr=1e-3)
    peaks = {}
    for name, kwargs in {"block": {}, "model": dict(wrap="model"),
                         "prefetch": dict(prefetch=True, trace=True, checkpointing=True)}.items():
        run = ranks[4].run(train_worker, kwargs=dict(stage=3, cfg=cfg, steps=2, batch_size=8, optimizer="adamw",
                                                     lr=1e-3, **kwargs), show_output=False)
        assert _worst(run, ref)[1] <= 1e-5  # Adam amplifies fp32 rounding (lab 03)
        peaks[name] = run[0]["peak_param_bytes"]
        if name == "prefetch":  # the next block's all-gather starts inside this block's forward
            forward = [s for s in run.spans if s.rank == 0 and s.label.startswith("forward blocks")]
            gathers = [s for s in run.spans if s.rank == 0 and s.label.startswith("all_gather")]
            assert any(f.start < g.start < f.end for f in forward for g in gathers)
    assert peaks["block"] < peaks["prefetch"] < peaks["model"]  # prefetch holds one more block


def test_mixed_precision_close_to_fp32_and_fsdp2_sends_bf16_params_fp32_grads(ranks):
    ref = reference_run(CFG, steps=2, batch_size=8, lr=0.1)
    ours = ranks[4].run(train_worker, kwargs=dict(stage=3, cfg=CFG, steps=2, batch_size=8, dtype="bf16"),
                        show_output=False)
    fsdp2 = ranks[4].run(train_worker, kwargs=dict(stage=3, impl="torch", cfg=CFG, steps=2, batch_size=8,
                                                   dtype="bf16"), show_output=False)
    assert _worst(ours, ref)[1] < 2e-3 and max_abs_diff(ours[0]["state"], fsdp2[0]["state"])[1] < 2e-3
    n = sum(p.numel() for p in GPT(CFG).parameters())
    comm = ours[0]["comm"]
    assert comm["all_gather"]["payload"] == pytest.approx(2 * 2 * n, rel=0.01)  # twice, 2 bytes per parameter
    assert comm["reduce_scatter"]["payload"] == pytest.approx(4 * n, rel=0.01)  # once, in fp32


def test_train_entry_point_and_bad_input_inside_ranks(ranks):
    run = ranks[4].run(train, kwargs=dict(steps=2, warmup=0, stage=3, batch_size=1, n_layer=1, d_model=32,
                                          seq_len=16, vocab_size=64), show_output=False)
    assert [r["rank"] for r in run] == [0, 1, 2, 3] and run[0]["stage"] == "ZeRO-3"
    assert run[0]["tokens_per_s"] > 0 and set(run[0]["comm_bytes_per_step"]) == {"all_gather", "reduce_scatter"}

    def bad_mesh():
        try:
            train(steps=1, stage=3, shard_size=3)
        except ValueError as error:  # raised on every rank before any collective; caught to keep the ranks warm
            return str(error)

    assert all("shard_size=3 must be a positive divisor" in out for out in ranks[4].run(bad_mesh, show_output=False))


# ------------------------------------------------- checkers (wrong answers: tests/grading/test_wrong_answers_lab04.py)

def gathers_without_allocating(flat):
    dist.all_gather_into_tensor(flat.full, flat.local)


def test_single_process_checkers_and_stubs():
    from torch.utils.checkpoint import checkpoint

    assert "fp32 masters" in lab04.check_mixed_precision(mixed_precision_step)

    @torch.no_grad()
    def steps_in_bf16(params, masters, optimizer):  # forgets the masters
        for p in params:
            p.sub_(1e-3 * p.grad)
            p.grad = None

    with pytest.raises(CheckFailed, match="the master never moved: copy each p.grad"):
        lab04.check_mixed_precision(steps_in_bf16)
    assert "one recompute" in lab04.check_checkpointing(checkpoint_module)

    def reentrant(module):
        forward = module.forward
        module.forward = lambda *args: checkpoint(forward, *args, use_reentrant=True)

    def nothing(module):
        return module

    with pytest.raises(CheckFailed, match="as many as without checkpointing"):
        lab04.check_checkpointing(nothing)
    with pytest.raises(CheckFailed, match="does not require grad any more: reentrant checkpointing"):
        lab04.check_checkpointing(reentrant)

    def stub(*args):
        raise NotImplementedError("Exercise 4.4: replace this line with your solution")

    for exercise in ("4.4", "4.5", "4.6"):  # 4.6's stub is seen before any rank starts
        assert distlab.check(exercise, stub, quiet=True).status == "not attempted"
    assert [e.id for e in lab04.EXERCISES][:6] == ["4.1", "4.2", "4.3", "4.4", "4.5", "4.6"]
    assert len(lab04.QUESTIONS) >= 5 and distlab.check("Q4.2", 1.5, quiet=True).status == "passed"


def test_stubs_inside_ranks_are_not_attempted(ranks):
    def stub(flat):
        raise NotImplementedError("Exercise 4.2: replace this line with your solution")

    assert distlab.check("4.2", stub, quiet=True).status == "not attempted"
    assert distlab.check("4.3", stub, stub, quiet=True).status == "not attempted"


# ---------------------------------------------------------------- FSDP2's design: per-parameter sharding
# On the warm ranks above, with reshuffled data every step: equal to one process (bitwise where the reduction order
# allows it: the same rows per rank, the same threads and N ≤ 2 addends; within 1e-6 otherwise), to one process that
# applies the same casts in bf16 and fp16, and bitwise to PyTorch's fully_shard on the same groups; torch.optim
# optimizers step the shards unchanged; gradients after the hook are shard-shaped fp32, replicated ones identical
# on every rank; tied weights and sizes that do not divide the world work.

# 61 and 90 rows do not divide 4 ranks (chunks of 16 and 23: the last rank holds 13 and 21 rows)
ODD = GPTConfig(vocab_size=61, seq_len=8, n_layer=2, n_head=2, d_model=30, tied_embeddings=False)
TIED = GPTConfig(vocab_size=61, seq_len=8, n_layer=1, n_head=2, d_model=30, tied_embeddings=True)


def _worst_states(states, reference) -> float:
    return max(max_abs_diff(got, want)[1] for got, want in zip(states, reference))


def test_dim0_chunks_are_torch_chunk_sizes_and_bad_policies_fail_before_any_collective():
    for rows in range(0, 13):
        for world in (1, 2, 3, 4, 5):
            sizes = [len(c) for c in torch.arange(rows).chunk(world)] if rows else []
            sizes += [0] * (world - len(sizes))
            got = [dim0_chunk(rows, world, r) for r in range(world)]
            assert [length for _, length, _ in got] == sizes, (rows, world)
            assert all(start == min(r * chunk, rows) for r, (start, _, chunk) in enumerate(got))
    assert dim0_chunk(3, 4, 3) == (3, 0, 1)  # fewer rows than ranks: the last rank holds none
    with pytest.raises(ValueError, match="ModuleList is a container"):
        PerParamFSDP(GPT(ODD), (nn.ModuleList,))
    with pytest.raises(ValueError, match="compute_dtype=torch.int8"):
        PerParamFSDP(GPT(ODD), compute_dtype=torch.int8)
    with pytest.raises(ValueError, match="tok_emb.weight is used by a sharded module and by lm_head"):
        PerParamFSDP(GPT(TIED), (nn.Embedding,))  # tied to lm_head, which would stay replicated
    with pytest.raises(RuntimeError, match="needs torch.distributed"):
        PerParamFSDP(GPT(ODD))


@pytest.fixture(scope="module")
def fp32(ranks):
    """SGD on 4 ranks, default policy (norms replicated), with rank 0's single-process run on the whole batch."""
    return ranks[4].run(train_per_param, kwargs=dict(cfg=ODD, steps=3, batch_size=8, inspect=True,
                                                     reference=dict(world_size=1)))


def test_fp32_equals_one_process_bitwise_on_two_ranks_and_within_1e6_on_four(ranks, fp32):
    # two ranks, each computing its rows as one process does, with the same threads: a + b = b + a, exactly
    two = ranks[2].run(train_per_param, kwargs=dict(cfg=ODD, steps=3, batch_size=8,
                                                    reference=dict(world_size=2)))
    assert all(_worst_states(out["states"], two[0]["reference"]) == 0.0 for out in two)
    # four ranks: the reduce-scatter adds four gradients in its own order, one process sums its batch rows in one
    # pass: different rounding, nothing more
    assert max(_worst_states(out["states"], fp32[0]["reference"]) for out in fp32) < 1e-6
    assert all(_worst_states(out["states"], fp32[0]["states"]) == 0.0 for out in fp32)  # every rank, the same weights
    seen = fp32[0]["optimizer_sees"]  # torch.optim.SGD over nn.Parameters shaped like rows of each tensor
    assert {kind for *_, kind in seen} == {"Parameter"}
    assert ("module.lm_head.weight", (16, 30), "float32", "Parameter") in seen  # 61 rows on 4 ranks: 16 here
    assert ("module.blocks.0.ln1.weight", (30,), "float32", "Parameter") in seen  # replicated: whole


def test_fp32_gradients_after_the_hook_are_shards_and_replicated_ones_identical_on_every_rank(fp32):
    for rank, out in enumerate(fp32):
        for name, grad in out["grads"].items():
            shape = GPT(ODD).get_parameter(name.removeprefix("module.")).shape
            assert grad.dtype == torch.float32, (name, grad.dtype)
            if ".ln" in name:
                assert grad.shape == shape and torch.equal(grad, fp32[0]["grads"][name]), (rank, name)
            else:
                _, length, _ = dim0_chunk(shape[0], 4, rank)
                assert grad.shape == (length, *shape[1:]), (rank, name, grad.shape)


def test_mixed_precision_matches_the_cast_reference_with_fp32_shard_gradients(ranks, fp32):
    for dtype, tolerance in ((torch.bfloat16, 1e-4), (torch.float16, 1e-5)):
        cast = dict(world_size=4, compute_dtype=dtype)
        run = ranks[4].run(train_per_param, kwargs=dict(cfg=ODD, steps=3, batch_size=8, compute_dtype=dtype,
                                                        inspect=True, reference=cast))
        to_cast = _worst_states(run[0]["states"], run[0]["reference"])
        to_fp32 = _worst_states(run[0]["states"], fp32[0]["states"])
        assert to_cast < tolerance and to_cast < to_fp32 / 5, (dtype, to_cast, to_fp32)  # the casts explain it
        for rank, out in enumerate(run):
            assert {g.dtype for g in out["grads"].values()} == {torch.float32}, (dtype, rank)  # fp32 after the hook
            assert all(g.shape == fp32[rank]["grads"][name].shape for name, g in out["grads"].items())
            assert all(torch.equal(g, run[0]["grads"][name]) for name, g in out["grads"].items() if ".ln" in name)


def test_adamw_bitwise_equal_to_fully_shard_on_the_same_groups_and_to_one_process(ranks):
    same = dict(cfg=ODD, steps=3, batch_size=8, sharded=(nn.Linear, nn.Embedding, GPT), optimizer="adamw",
                lr=1e-3)
    ours = ranks[4].run(train_per_param, kwargs=dict(same, reference=dict(world_size=1)))
    theirs = ranks[4].run(train_per_param, kwargs=dict(same, impl="torch"))
    assert _worst_states(ours[0]["states"], theirs[0]["states"]) == 0.0  # the same sums in the same order, then /N
    assert _worst_states(ours[0]["states"], ours[0]["reference"]) < 1e-5  # Adam divides by √v: rounding grows


def test_tied_weights_are_one_shard_gathered_by_both_modules(ranks):
    run = ranks[4].run(train_per_param, kwargs=dict(cfg=TIED, steps=3, batch_size=8, inspect=True,
                                                    reference=dict(world_size=1)))
    assert max(_worst_states(out["states"], run[0]["reference"]) for out in run) < 1e-6
    names = [name for name, *_ in run[0]["optimizer_sees"]]
    assert "module.tok_emb.weight" in names and "module.lm_head.weight" not in names  # one tensor, one shard
    assert run[0]["comm"]["all_gather"]["calls"] == 2 * (2 + 4 + 1)  # tok_emb and lm_head each gather it


def _fewer_rows_than_ranks():
    """A net whose layers have 3 and 2 rows on 4 ranks: AdamW over shards of one row, or none."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 3), nn.Tanh(), nn.Linear(3, 2))
    single = nn.Sequential(nn.Linear(6, 3), nn.Tanh(), nn.Linear(3, 2))
    single.load_state_dict(model.state_dict())
    net = PerParamFSDP(model)
    optimizers = [torch.optim.AdamW(net.parameters(), lr=1e-2), torch.optim.AdamW(single.parameters(), lr=1e-2)]
    x = torch.randn(4 * world, 6, generator=torch.Generator().manual_seed(1))
    for step in range(3):
        net(x[4 * rank:4 * (rank + 1)]).square().mean().backward()
        single(x).square().mean().backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return ([tuple(p.shape) for p in net.parameters()], net.full_state_dict(rank0_only=True), net.full_state_dict(),
            {k: v.clone() for k, v in single.state_dict().items()})


def test_fewer_rows_than_ranks_and_the_full_state_dict_on_rank_0_or_everywhere(ranks):
    run = ranks[4].run(_fewer_rows_than_ranks)
    assert [shapes for shapes, *_ in run] == [[(1, 6), (1,), (1, 3), (1,)], [(1, 6), (1,), (1, 3), (1,)],
                                              [(1, 6), (1,), (0, 3), (0,)], [(0, 6), (0,), (0, 3), (0,)]]
    _, on_zero, everywhere, single = run[0]
    assert max_abs_diff(everywhere, single)[1] < 1e-6 and max_abs_diff(on_zero, everywhere)[1] == 0.0
    assert all(out[1] == {} and max_abs_diff(out[2], everywhere)[1] == 0.0 for out in run[1:])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_gpu_runs_every_stage_with_nccl_cuda_memory_and_bf16():
    from distlab.zero import compute_dtype

    ref = reference_run(CFG, steps=2, batch_size=4, lr=0.1)
    peak_ref = reference_run(CFG, steps=3, batch_size=4, lr=0.1)  # measure_peak trains one more, untimed step
    for stage, impl in [(0, "scratch"), (1, "scratch"), (2, "scratch"), (3, "scratch"), (3, "torch")]:
        run = distlab.launch(train_worker, 1, backend="nccl", show_output=False,
                             kwargs=dict(stage=stage, impl=impl, cfg=CFG, steps=2, batch_size=4, measure_peak=True))
        # GPU kernels round differently
        assert run.backend == "nccl" and _worst(run, peak_ref)[1] <= 1e-4, (stage, impl)
        assert run[0]["peak_memory"][1] == "torch.cuda.max_memory_allocated" and run[0]["peak_memory"][0] > 0
    dtype, why = compute_dtype(torch.device("cuda", 0))
    if dtype == torch.bfloat16:
        run = distlab.launch(train_worker, 1, backend="nccl", show_output=False,
                             kwargs=dict(stage=3, cfg=CFG, steps=2, batch_size=4, dtype="bf16"))
        assert _worst(run, ref)[1] < 2e-3, why


def test_writing_into_freed_storage_is_explained_last(ranks):
    """Last in the module: the failing job ends the warm group (a segfault or a storage error in every rank)."""
    with pytest.raises(CheckFailed, match="storage was freed .*allocate flat.full's storage"):
        lab04.check_zero3(gathers_without_allocating, reshard)
