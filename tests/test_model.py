"""The shared GPT, its synthetic data and the reference trainer."""

import math

import pytest
import torch

from distlab.model import GPT, GPTConfig, count_params, flops_per_token, synthetic_batch
from distlab.reference import max_abs_diff, train_reference

SMALL = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)


pytestmark = pytest.mark.usefixtures("one_thread")


def test_two_constructions_are_bit_identical_and_leave_global_rng_alone():
    before = torch.random.get_rng_state()
    a, b = GPT(SMALL, seed=0), GPT(SMALL, seed=0)
    assert torch.equal(before, torch.random.get_rng_state())
    for (name, ta), tb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(ta, tb), name
    c = GPT(SMALL, seed=1)
    assert not torch.equal(a.blocks[0].attn.qkv.weight, c.blocks[0].attn.qkv.weight)


def test_module_names_are_stable():
    names = {name for name, _ in GPT(SMALL).named_parameters()}
    for expected in ["tok_emb.weight", "pos_emb.weight", "blocks.1.ln1.weight", "blocks.1.attn.qkv.weight",
                     "blocks.1.attn.proj.bias", "blocks.1.ln2.bias", "blocks.1.mlp.fc.weight",
                     "blocks.1.mlp.proj.weight", "ln_f.weight"]:
        assert expected in names


def test_init_statistics():
    cfg = GPTConfig(n_layer=8)
    model = GPT(cfg)
    assert abs(model.blocks[0].mlp.fc.weight.std().item() - 0.02) < 0.001
    assert abs(model.blocks[0].mlp.proj.weight.std().item() - 0.02 / math.sqrt(16)) < 0.0003
    assert torch.count_nonzero(model.blocks[3].attn.qkv.bias) == 0
    assert torch.all(model.ln_f.weight == 1)


def test_tied_weights_counted_once():
    tied = GPT(SMALL)
    assert tied.lm_head.weight is tied.tok_emb.weight
    untied_cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, tied_embeddings=False)
    untied = GPT(untied_cfg)
    assert untied.num_params() - tied.num_params() == 64 * 32
    assert tied.num_params() == count_params(SMALL) == sum(p.numel() for p in tied.parameters())
    assert untied.num_params() == count_params(untied_cfg)
    assert (tied.num_params(include_embeddings=False) == untied.num_params(include_embeddings=False)
            == count_params(SMALL, False))
    nobias = GPTConfig(vocab_size=64, seq_len=16, n_layer=3, n_head=2, d_model=32, bias=False, mlp_ratio=2)
    assert GPT(nobias).num_params() == count_params(nobias)


def test_flops_per_token_formula():
    cfg = GPTConfig()
    n = count_params(cfg, include_embeddings=False) + cfg.vocab_size * cfg.d_model
    assert flops_per_token(cfg) == 6 * n + 12 * 2 * 64 * 64
    assert flops_per_token(cfg) == 797184


def test_shapes_and_loss():
    model = GPT(SMALL)
    x, y = synthetic_batch(SMALL, 3, step=0)
    assert x.shape == y.shape == (3, 16) and x.dtype == torch.int64
    logits = model(x)
    assert logits.shape == (3, 16, 64)
    logits2, loss = model(x, y)
    assert torch.equal(logits, logits2)
    assert abs(loss.item() - math.log(64)) < 0.1  # small init: near-uniform predictions
    with pytest.raises(ValueError, match="exceeds"):
        model(torch.zeros(1, 17, dtype=torch.int64))


def test_checkpointing_gives_same_gradients():
    x, y = synthetic_batch(SMALL, 2, step=0)
    grads = []
    for ckpt in (False, True):
        model = GPT(SMALL)
        model.activation_checkpointing = ckpt
        model(x, y)[1].backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    name, diff = max_abs_diff(grads[0], grads[1])
    assert diff < 1e-6, (name, diff)


@pytest.mark.parametrize("kwargs, message", [
    (dict(n_head=3), "d_model=64 is not divisible by n_head=3"),
    (dict(n_layer=0), "n_layer=0 must be a positive integer"),
    (dict(vocab_size=2.5), "vocab_size=2.5"),
])
def test_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**kwargs)


def test_synthetic_batch_deterministic_shifted_and_learnable():
    x1, y1 = synthetic_batch(SMALL, 4, step=5, seed=3)
    x2, y2 = synthetic_batch(SMALL, 4, step=5, seed=3)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])
    assert not torch.equal(x1, synthetic_batch(SMALL, 4, step=6, seed=3)[0])
    assert not torch.equal(x1, synthetic_batch(SMALL, 4, step=5, seed=4)[0])
    # each token has at most four successors: the process is learnable
    x, y = synthetic_batch(SMALL, 64, step=0)
    successors = {}
    for a, b in zip(x.flatten().tolist(), y.flatten().tolist()):
        successors.setdefault(a, set()).add(b)
    assert max(len(s) for s in successors.values()) <= 4


def test_reference_loss_goes_down_and_is_deterministic():
    batches = [synthetic_batch(SMALL, 8, step) for step in range(30)]
    run = train_reference(SMALL, batches, lr=1e-2)
    assert len(run.losses) == 30
    assert sum(run.losses[-5:]) / 5 < run.losses[0] - 1.0  # ln(64) ≈ 4.16 → ≈ 2.4
    again = train_reference(SMALL, batches[:3], lr=1e-2)
    assert again.losses == run.losses[:3]
    sgd = train_reference(SMALL, batches[:3], lr=0.5, optimizer="sgd")
    assert sgd.losses[0] == run.losses[0] and sgd.losses[2] != run.losses[2]
    with pytest.raises(ValueError, match="optimizer"):
        train_reference(SMALL, batches[:1], optimizer="lion")


def test_max_abs_diff_names_the_parameter():
    a = {"w": torch.zeros(3), "b": torch.zeros(2)}
    b = {"w": torch.tensor([0.0, 0.5, 0.0]), "b": torch.tensor([0.0, -2.0])}
    assert max_abs_diff(a, b) == ("b", 2.0)
    assert max_abs_diff(a, a) == ("w", 0.0)
    with pytest.raises(KeyError):
        max_abs_diff(a, {"w": torch.zeros(3)})
