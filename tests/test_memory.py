"""Measured bytes (exact) and the memory formulas every lab quotes."""

import pytest
import torch
import torch.nn as nn

from distlab.memory import (
    PRESETS,
    ActivationMeter,
    GiB,
    activation_bytes_per_layer,
    bytes_per_param,
    memory_report,
    model_memory,
    model_state_bytes,
    tensor_bytes,
)
from distlab.model import GPT, GPTConfig, synthetic_batch

pytestmark = pytest.mark.usefixtures("one_thread")


def test_tensor_bytes_counts_each_storage_once():
    a = torch.zeros(10)  # 40 bytes
    b = torch.zeros(3, dtype=torch.float64)  # 24 bytes
    assert tensor_bytes([a, a[2:5], a.view(2, 5), b, None]) == 64
    model = GPT(GPTConfig())
    tied = model.tok_emb.weight
    assert tensor_bytes(model.parameters()) == 4 * model.num_params()
    assert tensor_bytes([tied, model.lm_head.weight]) == 4 * tied.numel()


def test_adamw_step_is_16_bytes_per_param_in_fp32():
    model = GPT(GPTConfig())
    n, n_tensors = model.num_params(), len(list(model.parameters()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert model_state_bytes(model, opt) == {"parameters": 4 * n, "gradients": 0, "optimizer": 0}
    x, y = synthetic_batch(model.cfg, 2, 0)
    model(x, y)[1].backward()
    opt.step()
    counted = model_state_bytes(model, opt)
    # 4 (param) + 4 (grad) + 8 (exp_avg, exp_avg_sq); AdamW also keeps one fp32 `step` scalar per tensor
    assert counted == {"parameters": 4 * n, "gradients": 4 * n, "optimizer": 8 * n + 4 * n_tensors}
    assert sum(counted.values()) == 16 * n + 4 * n_tensors


def test_sgd_without_momentum_has_no_state():
    model = GPT(GPTConfig(n_layer=1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(*synthetic_batch(model.cfg, 2, 0))[1].backward()
    opt.step()
    assert model_state_bytes(model, opt)["optimizer"] == 0


def test_activation_meter_linear_relu_chain():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3), nn.Tanh())
    x = torch.randn(4, 5)
    with ActivationMeter() as meter:
        out = net(x)
    # Linear1 saves x (4·5); ReLU saves its output (4·7), which Linear2 saves again (same storage);
    # Tanh saves its output (4·3). Weights are parameters: excluded.
    assert meter.bytes == 4 * (4 * 5 + 4 * 7 + 4 * 3)
    assert meter.count == 3
    out.sum().backward()  # the hooks leave autograd working
    assert net[0].weight.grad is not None
    with ActivationMeter(net) as meter2:
        net(x.requires_grad_())
    assert meter2.bytes == meter.bytes


def test_activation_meter_gpt_block_and_checkpointing():
    cfg = GPTConfig()
    model = GPT(cfg)
    s, b, h, a = cfg.seq_len, 3, cfg.d_model, cfg.n_head
    x = torch.randn(b, s, h, requires_grad=True)
    with ActivationMeter(model) as meter:
        model.blocks[0](x)
    # CPU SDPA is a fused (flash) kernel: no s×s scores are kept, only a logsumexp per row.
    # Kept: x, ln1 out, qkv (3), attention out, residual, ln2 out, fc out (4), gelu out (4) = 16·sbh,
    # plus LayerNorm mean/rstd (4·sb) and logsumexp (a·s·b); all fp32.
    assert meter.bytes == 4 * (16 * s * b * h + 4 * s * b + a * s * b)
    assert meter.bytes / activation_bytes_per_layer(s, b, h, a, bytes_per_value=4) == pytest.approx(0.597, abs=0.001)
    with ActivationMeter(model) as ckpt:
        torch.utils.checkpoint.checkpoint(model.blocks[0], x, use_reentrant=False)
    assert ckpt.bytes == 4 * s * b * h == activation_bytes_per_layer(s, b, h, a, checkpointing=True, bytes_per_value=4)


def test_memory_report():
    model = GPT(GPTConfig(n_layer=1))
    opt = torch.optim.AdamW(model.parameters())
    with ActivationMeter(model) as meter:
        loss = model(*synthetic_batch(model.cfg, 2, 0))[1]
    loss.backward()
    opt.step()
    report = memory_report(model, opt, meter)
    d = report.as_dict()
    assert d["activations"] == meter.bytes > 0
    assert d["total"] == d["parameters"] + d["gradients"] + d["optimizer"] + d["activations"]
    assert d["cuda_allocated"] is None and d["cuda_max_allocated"] is None
    assert "MiB" in str(report) and "optimizer" in str(report)
    assert memory_report(model, opt, 1024).activations == 1024


@pytest.mark.parametrize("n", [1, 2, 7, 64, 1000])
def test_bytes_per_param_stages(n):
    mixed = [bytes_per_param(stage, n).total for stage in range(4)]
    assert mixed == pytest.approx([16, 4 + 12 / n, 2 + 14 / n, 16 / n], rel=1e-12)
    fp32 = [bytes_per_param(stage, n, "fp32").total for stage in range(4)]
    assert fp32 == pytest.approx([16, 8 + 8 / n, 4 + 12 / n, 16 / n], rel=1e-12)


def test_bytes_per_param_breakdown_and_errors():
    b = bytes_per_param(2, 8)
    assert (b.params, b.grads, b.optimizer, b.total) == (2.0, 0.25, 1.5, 3.75)
    with pytest.raises(ValueError, match="zero_stage"):
        bytes_per_param(4, 8)
    with pytest.raises(ValueError, match="world_size"):
        bytes_per_param(1, 0)
    with pytest.raises(ValueError, match="precision"):
        bytes_per_param(1, 8, "fp8")


def test_activation_formula_worked_values():
    # s=2048, b=1, h=4096, a=32: sbh·(34 + 5·32·2048/4096) = 2048·4096·114
    assert activation_bytes_per_layer(2048, 1, 4096, 32) == 956_301_312
    assert activation_bytes_per_layer(2048, 1, 4096, 32, checkpointing=True) == 2 * 2048 * 4096
    assert activation_bytes_per_layer(2048, 2, 4096, 32, bytes_per_value=4) == 4 * 956_301_312


def test_presets_and_model_memory():
    assert PRESETS["7B"].n_params == 6_738_415_616  # Llama 2 7B
    assert PRESETS["70B"].n_params == 68_976_648_192  # Llama 2 70B
    assert PRESETS["405B"].n_params == 405_853_388_800  # Llama 3.1 405B
    n = PRESETS["70B"].n_params
    assert model_memory(n, 1, 0).total == 16 * n
    assert model_memory(n, 8, 3).total == 2 * n
    m = PRESETS["70B"].memory(world_size=64, zero_stage=3, micro_batch=1, checkpointing=True)
    assert m.activations == 80 * 2 * 4096 * 8192
    assert m.total == pytest.approx(n * 16 / 64 + 80 * 2 * 4096 * 8192, rel=1e-12)
    assert m.gib()["total"] == pytest.approx(m.total / GiB)
