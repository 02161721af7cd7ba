"""Lab 12's CUDA paths on one GPU: an NCCL rank whose state lives on the GPU, checkpointed asynchronously
(staged to host memory), reloaded and resumed; replica fingerprints computed on the GPU. Skipped without CUDA."""

import pytest
import torch

import distlab
from distlab.fault_tolerance import checkpoint_path, fingerprint, read_checkpoint, resumable_train
from distlab.model import GPTConfig

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("no_leftover_ranks"), pytest.mark.timeout(300)]

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=2, d_model=16)
SMALL = dict(cfg=CFG, batch_size=4, n_items=10, async_save=True)


def test_a_fingerprint_computed_on_the_gpu_equals_the_cpu_one():
    values = torch.randn(300_000, generator=torch.Generator().manual_seed(0))
    assert fingerprint(values.cuda()) == fingerprint(values)


def test_async_checkpoints_of_gpu_state_reload_exactly_and_resume_under_nccl(tmp_path):
    def job(root, steps):
        return distlab.launch(resumable_train, 1, args=(str(root), steps, 2), kwargs=SMALL, backend="nccl",
                              show_output=False)[0]

    straight = job(tmp_path / "straight", 6)
    first = job(tmp_path / "resumed", 4)
    saved = read_checkpoint(checkpoint_path(tmp_path / "resumed", 4))
    for name, value in first["weights"].items():  # what the GPU held is what the async save wrote
        assert torch.equal(saved[f"train.model.{name}"], value), name
    resumed = job(tmp_path / "resumed", 6)
    assert resumed["start"] == 4 and sorted(resumed["losses"]) == [4, 5]
    for step, loss in resumed["losses"].items():  # GPU kernels may differ in the last bits between runs
        assert loss == pytest.approx(straight["losses"][step], rel=1e-4), step
    for name, value in straight["weights"].items():
        torch.testing.assert_close(resumed["weights"][name], value, rtol=1e-4, atol=1e-6)
