"""Lab 05: the TP GPT equals the dense model (TP 2 and 4, with and without sequence parallelism), every
collective and activation byte equals its formula, DTensor agrees, and the checkers pass the reference while
telling a wrong student what differs."""

import time

import pytest
import torch
import torch.distributed as dist

import distlab
from distlab import memory
from distlab.grading import lab05
from distlab.model import GPT, GPTConfig, synthetic_batch
from distlab.reference import train_reference
from distlab.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelAttention,
    TensorParallelMLP,
    VocabParallelEmbedding,
    check_tp_sizes,
    copy_to_tp,
    gather_sequence,
    is_replicated,
    qkv_rows,
    reduce_from_tp,
    reduce_scatter_sequence,
    shard_state,
    theory,
    vocab_parallel_cross_entropy,
)
from distlab.tensor_parallel.communication import all_gather_linear
from distlab.tensor_parallel.workers import choose_precision, dtensor_step, tp_step, train, train_worker

from processes import rank_processes

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_thread")]

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32)
BATCH = 4


@pytest.fixture(scope="module", autouse=True)
def ranks4():
    """One warm group for the module: the checkers' own (same key), so their tests reuse it too.

    It lives across tests by design, so instead of the per-test ``no_leftover_ranks`` check,
    the module ends by proving that closing it leaves no rank process behind.
    """
    yield distlab.Ranks.shared(4, "gloo", lab05.COLLECTIVE_TIMEOUT)
    distlab.shutdown()
    deadline = time.monotonic() + 5
    while rank_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not rank_processes(), f"rank processes left behind: {rank_processes()}"


def _dense(cfg):
    model = GPT(cfg, seed=0)
    x, y = synthetic_batch(cfg, BATCH, 0)
    logits, loss = model(x, y)
    loss.backward()
    return model, logits.detach(), loss.item()


# ---------------------------------------------------------------- single process

def test_bad_sizes_are_one_line_errors_naming_them():
    with pytest.raises(ValueError, match=r"^tp=4 does not divide n_head=6 \(each rank keeps whole attention heads\)"):
        check_tp_sizes(GPTConfig(n_head=6, d_model=48, vocab_size=256), 4)
    with pytest.raises(ValueError, match=r"vocab_size=250") as info:
        check_tp_sizes(GPTConfig(vocab_size=250), 4)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"seq_len=6"):
        check_tp_sizes(GPTConfig(seq_len=6), 4, sequence_parallel=True)
    check_tp_sizes(GPTConfig(seq_len=6), 4)  # without SP the sequence is not split
    with pytest.raises(ValueError, match="positive integer"):
        check_tp_sizes(CFG, 0)


def test_qkv_rows_keep_whole_heads_of_q_k_and_v():
    rows = qkv_rows(d_model=8, n_head=4, tp=2, rank=1)  # heads 2, 3: rows 4-7 of q, k and v
    assert rows.tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]
    everything = torch.cat([qkv_rows(32, 8, 4, r) for r in range(4)])
    assert sorted(everything.tolist()) == list(range(96))
    with pytest.raises(ValueError, match="n_head=6 is not divisible"):
        qkv_rows(48, 6, 4, 0)


def test_shards_of_every_parameter_tile_the_dense_model():
    dense = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=4, d_model=32, tied_embeddings=False))
    state = dict(dense.named_parameters())
    shards = [shard_state(state, dense.cfg, 4, r) for r in range(4)]
    for name, p in state.items():
        if is_replicated(name):
            assert all(s[name] is p for s in shards), name
        else:
            assert sum(s[name].numel() for s in shards) == p.numel(), name
    assert not is_replicated("lm_head.weight") and is_replicated("blocks.0.attn.proj.bias")


def test_activation_formula_reduces_to_memory_at_tp_1_and_splits_as_korthikanti():
    for preset in memory.PRESETS.values():
        s, h, a = preset.seq_len, preset.d_model, preset.n_head
        assert theory.activation_bytes_per_layer_tp(s, 1, h, a) == memory.activation_bytes_per_layer(s, 1, h, a)
        dense_layer = memory.activation_bytes_per_layer(s, 1, h, a)
        assert theory.activation_bytes_per_layer_tp(s, 1, h, a, 1, True) == dense_layer
        assert theory.activation_bytes_per_layer_tp(s, 1, h, a, flash_attention=True) == \
            memory.activation_bytes_per_layer(s, 1, h, a, flash_attention=True)
        tp8 = theory.activation_bytes_per_layer_tp(s, 1, h, a, 8)
        assert tp8 == s * h * (10 + 24 / 8) + 5 * a * s * s / 8
        assert theory.activation_bytes_per_layer_tp(s, 1, h, a, 8, True) == dense_layer / 8
        # fused attention keeps no s×s scores: TP + SP splits all 34·sbh (the lab's 70B table, second column)
        assert theory.activation_bytes_per_layer_tp(s, 1, h, a, 8, True, flash_attention=True) == 34 * s * h / 8


def test_collective_formulas():
    block = theory.collectives_per_block(2, 16, 32, tp=4)
    m = 2 * 16 * 32 * 4
    assert block == {"forward": {"all_reduce": (2, 2 * m)}, "backward": {"all_reduce": (2, 2 * m)}}
    sp = theory.collectives_per_block(2, 16, 32, tp=4, sequence_parallel=True)
    assert sp["forward"] == {"all_gather": (2, 2 * m), "reduce_scatter": (2, 2 * m)}
    assert theory.collectives_per_block(2, 16, 32, tp=1) == {"forward": {}, "backward": {}}
    # one 70B layer's all-reduce (4096 tokens, bf16) on 8 GPUs: 2·7/8·64 MiB over the link
    seconds = theory.tp_allreduce_seconds(4096, 1, 8192, 8, 50e9)
    assert seconds == pytest.approx(2 * 7 / 8 * 64 * 2**20 / 50e9)


def test_gather_linear_backward_runs_in_the_forward_precision():
    """Under autocast the fused gather-linear's backward matmuls follow the bf16 forward (world of one here)."""
    x, w, b = torch.randn(2, 4, 8), torch.randn(6, 8), torch.randn(6)
    grads = []
    for fn in (all_gather_linear, lambda x, w, b: torch.nn.functional.linear(x, w, b)):
        leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fn(*leaves)
        assert y.dtype == torch.bfloat16
        y.float().square().sum().backward()
        grads.append([t.grad for t in leaves])
    for ours, torch_grad in zip(*grads):
        assert ours.dtype == torch.float32 and torch.allclose(ours, torch_grad, rtol=2e-2, atol=2e-2)
    assert choose_precision("auto", torch.device("cpu"))[0] is None
    with pytest.raises(ValueError, match="needs a GPU with bf16"):
        choose_precision("bf16", torch.device("cpu"))


# ---------------------------------------------------------------- on ranks: equal to the dense model

@pytest.mark.parametrize("tied", [True, False])
def test_tp_gpt_equals_dense_with_and_without_sequence_parallelism(ranks4, tied):
    cfg = GPTConfig(**{**vars(CFG), "tied_embeddings": tied})
    dense, logits, loss = _dense(cfg)
    grads = {name: p.grad for name, p in dense.named_parameters()}
    replicated = sum(p.numel() * 4 for name, p in dense.named_parameters() if is_replicated(name))
    for tp in (2, 4):
        for sp in (False, True):
            run = ranks4.run(tp_step, args=(cfg, tp, sp, BATCH), show_output=False)
            for out in run:
                r = out["tp_rank"]
                assert out["loss"] == pytest.approx(loss, abs=1e-5)
                per = cfg.vocab_size // tp
                assert torch.allclose(out["logits"], logits[..., r * per:(r + 1) * per], atol=1e-5)
                expected = shard_state(grads, cfg, tp, r)
                assert set(out["grads"]) == set(expected)
                for name, grad in out["grads"].items():
                    assert torch.allclose(grad, expected[name], atol=1e-5), (tp, sp, name)
            formula = theory.collectives_per_step(cfg, BATCH, tp, sp, replicated_param_bytes=replicated)
            assert run[0]["collectives"] == formula, (tp, sp)
            assert run[0]["block_activation_bytes"] == theory.gpt_block_activation_bytes(cfg, BATCH, tp, sp)


def test_tp_training_follows_the_single_process_run(ranks4):
    steps = 8
    reference = train_reference(CFG, [synthetic_batch(CFG, 8, s) for s in range(steps)], lr=1e-3)
    for tp, sp in ((4, True), (2, False)):
        run = ranks4.run(train_worker, args=(CFG, tp, sp, steps, 8), show_output=False)
        for out in run:
            assert max(abs(a - b) for a, b in zip(out["losses"], reference.losses)) < 1e-4


def test_dtensor_gives_the_same_outputs_gradients_and_collectives(ranks4):
    for kind, sp in (("mlp", False), ("attention", False), ("block", True)):
        run = ranks4.run(dtensor_step, args=(CFG, kind, 4, sp), show_output=False)
        for out in run:
            for who in ("ours", "dtensor"):
                assert max(out[who]["max_diff"].values()) < 1e-5, (kind, who, out[who]["max_diff"])
            assert out["ours"]["forward"] == out["dtensor"]["forward"]
            if not sp:  # with SP ours gathers the saved shards again in backward; DTensor keeps them gathered
                assert out["ours"]["backward"] == out["dtensor"]["backward"]
            else:
                ours, theirs = out["ours"]["backward"], out["dtensor"]["backward"]
                assert ours["all_gather"][0] == theirs["all_gather"][0] + 2
                assert ours["reduce_scatter"] == theirs["reduce_scatter"]


def test_functional_collectives_are_counted_under_their_own_names(ranks4):
    def job():
        from torch.distributed import _functional_collectives as funcol

        x = torch.ones(2, 3)
        funcol.all_reduce(x, "sum", list(range(dist.get_world_size()))).wait()
        funcol.all_gather_tensor(x, 0, list(range(dist.get_world_size()))).wait()
        dist.all_reduce(x)

    run = ranks4.run(job, show_output=False)
    ops = run.comm[1].ops
    assert ops["functional_all_reduce"].calls == 1 and ops["functional_all_reduce"].payload_bytes == 24
    assert ops["functional_all_gather"].calls == 1 and ops["functional_all_gather"].payload_bytes == 4 * 24
    assert ops["functional_all_reduce"].wire_bytes == 2 * 3 / 4 * 24
    assert ops["all_reduce"].calls == 1  # the c10d call is still counted once, under its own name


def test_train_entry_point_and_a_bad_config_fails_before_work(ranks4):
    run = ranks4.run(train, kwargs=dict(steps=2, warmup=0, n_layer=1, d_model=32, seq_len=16, vocab_size=64,
                                        sequence_parallel=True), show_output=False)
    assert [r["rank"] for r in run] == [0, 1, 2, 3] and run[0]["tp"] == 4
    assert run[0]["loss_first"] == run[3]["loss_first"]
    cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=4, d_model=32)
    replicated = sum(p.numel() * 4 for name, p in GPT(cfg).named_parameters() if is_replicated(name))
    expected = {}
    for phase in theory.collectives_per_step(cfg, 8, 4, True, replicated_param_bytes=replicated).values():
        for kind, (calls, payload) in phase.items():
            expected[kind] = (expected.get(kind, (0, 0))[0] + calls, expected.get(kind, (0, 0))[1] + payload)
    assert run[0]["collectives_per_step"] == expected
    with pytest.raises(distlab.RankFailed, match="tp=4 does not divide n_head=6"):
        ranks4.run(train, kwargs=dict(steps=1, n_head=6, d_model=48), show_output=False)


# ------------------------------------------ checkers (wrong answers: tests/grading/test_wrong_answers_lab05.py)

def test_checkers_pass_the_reference():
    assert "f and g exact" in lab05.check_conjugate_functions(copy_to_tp, reduce_from_tp)
    assert "row layers" in lab05.check_parallel_linears(ColumnParallelLinear, RowParallelLinear)
    assert "dense MLP" in lab05.check_parallel_mlp(TensorParallelMLP)
    assert "dense attention" in lab05.check_parallel_attention(qkv_rows, TensorParallelAttention)
    assert "embedding and loss" in lab05.check_vocab_parallel(VocabParallelEmbedding, vocab_parallel_cross_entropy)
    assert "sequence-parallel" in lab05.check_sequence_parallel(gather_sequence, reduce_scatter_sequence)
    assert [e.id for e in lab05.EXERCISES][:6] == ["5.1", "5.2", "5.3", "5.4", "5.5", "5.6"]
    assert len([e for e in lab05.EXERCISES if e.is_quiz]) >= 5


def test_untouched_stubs_are_not_attempted():
    def stub(*args, **kwargs):
        raise NotImplementedError("Exercise 5.1: replace this line with your solution")

    class StubLayer(torch.nn.Module):
        def __init__(self, *args, **kwargs):
            super().__init__()
            raise NotImplementedError("Exercise 5.2: replace this line with your solution")

    assert distlab.check("5.1", stub, stub, quiet=True).status == "not attempted"
    assert distlab.check("5.2", StubLayer, StubLayer, quiet=True).status == "not attempted"
    assert distlab.check("5.5", StubLayer, stub, quiet=True).status == "not attempted"
    assert distlab.check("Q5.1", ..., quiet=True).status == "not attempted"
