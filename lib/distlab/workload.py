"""The workload the data-parallel labs train and are checked on, below every topic that trains it.

DDP (lab 03), ZeRO and FSDP (lab 04), mixture-of-experts and 3D training, and the checkers of all of them
train the same thing: the lab's GPT, or :class:`EdgeCaseGPT` with every parameter situation a gradient
synchronisation must handle, on synthetic global batches split evenly over ranks and micro-steps. Every such
run must reproduce :func:`reference_run`, the single-process run on the whole batch, and moves the bytes
:func:`gradient_bytes` counts. Written once here, so that no topic is another's library for its inputs.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from distlab.model import GPT, GPTConfig, synthetic_batch
from distlab.reference import make_optimizer

__all__ = ["gradient_params", "gradient_bytes", "EdgeCaseGPT", "build_model", "global_batch", "local_batches",
           "cpu_state", "reference_run"]


# ---------------------------------------------------------------- what a step's gradients are

def gradient_params(module: nn.Module) -> list[nn.Parameter]:
    """Parameters that receive gradients, in registration order, a tied weight once."""
    return [p for p in module.parameters() if p.requires_grad]  # parameters() already de-duplicates


def gradient_bytes(module: nn.Module) -> int:
    """Bytes of all gradients one step produces: what DDP must all-reduce, each exactly once."""
    return sum(p.numel() * p.element_size() for p in gradient_params(module))


# ---------------------------------------------------------------- models and data

class EdgeCaseGPT(nn.Module):
    """The lab's GPT with every parameter situation DDP must handle.

    * ``gpt.tok_emb.weight`` is tied to the output projection (when ``cfg.tied_embeddings``);
    * ``gpt.pos_emb.weight`` is frozen (``requires_grad=False``): broadcast, never reduced;
    * ``unused`` never gets a gradient;
    * ``rare_bias`` is added to the logits of rows whose first token is below vocab/4 only,
      so on a rank whose rows have none it gets no gradient while other ranks' does.
    """

    def __init__(self, cfg: GPTConfig, seed: int = 0):
        super().__init__()
        self.gpt = GPT(cfg, seed=seed)
        self.gpt.pos_emb.weight.requires_grad_(False)
        generator = torch.Generator().manual_seed(seed + 12345)
        self.unused = nn.Parameter(torch.randn(cfg.d_model, generator=generator))
        self.rare_bias = nn.Parameter(0.1 * torch.randn(cfg.vocab_size, generator=generator))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        logits = self.gpt(idx)
        rare = idx[:, 0] < self.gpt.cfg.vocab_size // 4
        if bool(rare.any()):
            logits = logits + rare[:, None, None].to(logits.dtype) * self.rare_bias
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def build_model(kind: str, cfg: GPTConfig, seed: int = 0) -> nn.Module:
    """``"gpt"``: :class:`~distlab.model.GPT`; ``"edge"``: :class:`EdgeCaseGPT`."""
    if kind == "gpt":
        return GPT(cfg, seed=seed)
    if kind == "edge":
        return EdgeCaseGPT(cfg, seed=seed)
    raise ValueError(f"model must be 'gpt' or 'edge', got {kind!r}")


def global_batch(cfg: GPTConfig, batch_size: int, step: int, data_seed: int = 0):
    """The whole step's ``(x, y)``: what the single-process reference trains on."""
    return synthetic_batch(cfg, batch_size, step, seed=data_seed)


def local_batches(cfg: GPTConfig, batch_size: int, step: int, rank: int, world_size: int, accum: int = 1,
                  data_seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s share of the global batch, split into ``accum`` micro-batches.

    Rank r gets rows ``r·B/N … (r+1)·B/N``; each micro-batch has ``B/(N·accum)`` rows.
    """
    if batch_size % (world_size * accum):
        raise ValueError(f"global batch {batch_size} is not divisible by world_size·accum = "
                         f"{world_size}·{accum}: the local batches must be equal-sized for the averaged "
                         f"gradient to equal the full-batch gradient")
    x, y = global_batch(cfg, batch_size, step, data_seed)
    local = batch_size // world_size
    x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
    micro = local // accum
    return [(x[a * micro:(a + 1) * micro], y[a * micro:(a + 1) * micro]) for a in range(accum)]


# ---------------------------------------------------------------- the single-process run

def cpu_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of ``module``'s weights on the CPU, detached: what a run returns and a comparison reads."""
    return {name: t.detach().to("cpu", copy=True) for name, t in module.state_dict().items()}


def reference_run(cfg: GPTConfig | None = None, steps: int = 3, batch_size: int = 8, seed: int = 0,
                  data_seed: int = 0, optimizer: str = "sgd", lr: float = 0.1, model: str = "gpt",
                  keep_states: bool = False) -> dict:
    """The single-process run every variant must reproduce: the same model (rank 0's seed),
    the same optimizer, one step per *global* batch. ``states`` holds the weights after
    each step when ``keep_states``; ``initial`` the weights before training."""
    cfg = cfg or GPTConfig()
    module = build_model(model, cfg, seed=seed)
    opt = make_optimizer(module.parameters(), optimizer, lr=lr)
    out = {"initial": cpu_state(module), "losses": [], "states": []}
    for step in range(steps):
        x, y = global_batch(cfg, batch_size, step, data_seed)
        _, loss = module(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        out["losses"].append(loss.item())
        if keep_states:
            out["states"].append(cpu_state(module))
    out["state"] = cpu_state(module)
    return out
