"""Loss spikes and NaNs: a guard that skips or rolls back bad steps, and a diagnosis that names the cause.

A large run sees the loss jump or turn NaN every so often: a garbage batch, a value
that overflowed fp16, a 0/0 in a loss normalised by a count that happened to be zero,
a checkpoint that came back corrupted. The response has two parts:

* :class:`SpikeGuard` decides, before the optimizer step, from the *global* loss and
  gradient norm (identical on every rank, so every rank decides the same): apply the
  step, skip it (drop the gradients; the data order moves on), or — when bad steps
  keep coming — roll back to the last good checkpoint and continue *past* the bad
  data (PaLM's recipe: restart before the spike, skip the batches that caused it).
* :func:`diagnose_nonfinite` replays one batch and names where the first non-finite
  value appeared: a corrupted parameter, an fp16 overflow in a named module, or the
  loss's own division by zero.

:func:`guarded_train` runs both inside the lab's DDP job, with bad batches injected.
"""

from __future__ import annotations

import copy
import math
import statistics
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from distlab.fault_tolerance.checkpoint import load_checkpoint, save_checkpoint
from distlab.fault_tolerance.resume import TrainSetup, local_rows, make_training
from distlab.model import GPTConfig

__all__ = ["SpikeGuard", "DECISIONS", "masked_cross_entropy", "global_grad_norm", "Diagnosis", "diagnose_nonfinite",
           "FP16_MAX", "BAD_BATCHES", "bad_batch", "guarded_train"]

DECISIONS = ("ok", "skip", "rollback")
FP16_MAX = torch.finfo(torch.float16).max  # 65504


class SpikeGuard:
    """Judge each step by its global loss and gradient norm against the recent good steps.

    A step is bad when its loss or gradient norm is not finite, or (once ``warmup`` good
    steps are known) when its loss exceeds ``loss_factor`` × the median of the last
    ``window`` good losses, or its gradient norm exceeds ``grad_factor`` × their median
    gradient norm. A bad step is skipped; the ``patience``-th bad step in a row asks for a
    rollback (and the count starts again). Only good steps enter the history, so a spike
    never raises the bar for the next one. ``reason`` explains the last decision.
    """

    def __init__(self, window: int = 16, loss_factor: float = 1.5, grad_factor: float = 5.0, patience: int = 3,
                 warmup: int = 4):
        if window < 1 or warmup < 1 or patience < 1 or warmup > window:
            raise ValueError(f"need 1 <= warmup <= window and patience >= 1, got window={window}, "
                             f"warmup={warmup}, patience={patience}")
        if loss_factor <= 1 or grad_factor <= 1:
            raise ValueError(f"the factors must exceed 1, got loss_factor={loss_factor}, grad_factor={grad_factor}")
        self.window, self.loss_factor, self.grad_factor = window, loss_factor, grad_factor
        self.patience, self.warmup = patience, warmup
        self.losses: deque[float] = deque(maxlen=window)
        self.grad_norms: deque[float] = deque(maxlen=window)
        self.bad_in_a_row = 0
        self.reason = ""

    def _problem(self, loss: float, grad_norm: float) -> str:
        if not math.isfinite(loss) or not math.isfinite(grad_norm):
            return f"non-finite {'loss' if not math.isfinite(loss) else 'gradient norm'}"
        if len(self.losses) < self.warmup:
            return ""
        loss_median, grad_median = statistics.median(self.losses), statistics.median(self.grad_norms)
        if loss > self.loss_factor * loss_median:
            return f"loss spike: {loss:.3g} is {loss / loss_median:.1f}x the recent median {loss_median:.3g}"
        if grad_norm > self.grad_factor * grad_median:
            return (f"gradient-norm spike: {grad_norm:.3g} is {grad_norm / grad_median:.1f}x the recent median "
                    f"{grad_median:.3g}")
        return ""

    def decide(self, loss: float, grad_norm: float) -> str:
        """``"ok"``, ``"skip"`` or ``"rollback"`` for a step with this global loss and gradient norm."""
        problem = self._problem(float(loss), float(grad_norm))
        if not problem:
            self.losses.append(float(loss))
            self.grad_norms.append(float(grad_norm))
            self.bad_in_a_row, self.reason = 0, ""
            return "ok"
        self.bad_in_a_row += 1
        if self.bad_in_a_row >= self.patience:
            self.bad_in_a_row = 0
            self.reason = f"{problem}; {self.patience} bad steps in a row"
            return "rollback"
        self.reason = problem
        return "skip"


# ---------------------------------------------------------------- losses and norms

def masked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the tokens where ``mask`` is 1 (padding and prompts excluded).

    ``sum(loss · mask) / sum(mask)``: when a batch has no target token at all the
    result is 0/0 = NaN, the division by zero behind many NaN reports.
    """
    per_token = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), reduction="none")
    mask = mask.reshape(-1).to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum()


@torch.no_grad()
def global_grad_norm(model: nn.Module) -> float:
    """L2 norm of all gradients (after DDP's averaging it is the same on every rank)."""
    norms = [p.grad.detach().float().norm() for p in model.parameters() if p.grad is not None]
    return float(torch.stack(norms).norm()) if norms else 0.0


# ---------------------------------------------------------------- diagnosis

@dataclass
class Diagnosis:
    """What made a batch's loss non-finite: ``kind`` (corrupted-parameter, fp16-overflow,
    nonfinite-activation, loss-division-by-zero, nonfinite-loss, finite), ``where``, ``detail``."""

    kind: str
    where: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind} at {self.where}: {self.detail}" if self.where else f"{self.kind}: {self.detail}"


def _corrupted_parameter(model: nn.Module, outlier: float) -> Diagnosis | None:
    """A non-finite parameter, or one element ``outlier`` times larger than its tensor's median magnitude."""
    for name, p in model.named_parameters():
        data = p.detach().float().reshape(-1)
        finite = torch.isfinite(data)
        if not bool(finite.all()):
            index = int((~finite).nonzero()[0])
            return Diagnosis("corrupted-parameter", name, f"element {index} is {float(data[index])}: training never "
                             "writes that; suspect the checkpoint it came from or silent data corruption")
        magnitude = data.abs()
        typical = float(magnitude.median()) or float(magnitude.mean()) or 1.0
        index = int(magnitude.argmax())
        if float(magnitude[index]) > outlier * typical:
            return Diagnosis("corrupted-parameter", name,
                             f"element {index} is {float(data[index]):.3g}, {float(magnitude[index]) / typical:.1e}x "
                             f"the tensor's median magnitude {typical:.3g}: a flipped exponent bit (a corrupted "
                             f"checkpoint or silent data corruption), not training")
    return None


def diagnose_nonfinite(model: nn.Module, x: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None = None,
                       outlier: float = 1e6) -> Diagnosis:
    """Replay one batch and name where the first non-finite value appears.

    Checks, in order: the parameters (non-finite or absurd values), every leaf module's
    output in execution order (an fp16 output that is infinite while the same module in
    fp32 stays finite is an fp16 overflow), then the loss (a mask with no tokens is 0/0).
    """
    suspect = _corrupted_parameter(model, outlier)
    if suspect is not None:
        return suspect
    names = {module: name for name, module in model.named_modules()}
    found: list[Diagnosis] = []

    def hook(module, inputs, output):
        if found or not isinstance(output, torch.Tensor) or bool(torch.isfinite(output).all()):
            return
        tensors = [t for t in inputs if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if tensors and not all(bool(torch.isfinite(t).all()) for t in tensors):
            return  # not the first: its input was already broken
        name = names.get(module, type(module).__name__)
        if output.dtype == torch.float16:
            with torch.no_grad():
                reference = _run_in_fp32(module, inputs)
            peak = float(reference.abs().max())
            if bool(torch.isfinite(reference).all()) and peak > FP16_MAX:
                found.append(Diagnosis("fp16-overflow", name, f"its output reaches {peak:.3g} in fp32, above fp16's "
                                       f"maximum {FP16_MAX:.0f}, so fp16 stores inf: compute in bf16, which has "
                                       f"fp32's exponent range"))
                return
        found.append(Diagnosis("nonfinite-activation", name, "a non-finite output from finite inputs"))

    leaves = [m for m in model.modules() if not list(m.children())]
    handles = [m.register_forward_hook(hook) for m in leaves]
    try:
        with torch.no_grad():
            logits = model(x)
    finally:
        for handle in handles:
            handle.remove()
    if found:
        return found[0]
    mask = torch.ones_like(targets) if mask is None else mask
    loss = masked_cross_entropy(logits, targets, mask)
    if bool(torch.isfinite(loss)):
        return Diagnosis("finite", "", f"the loss is {float(loss):.4g}")
    if int(mask.sum()) == 0:
        return Diagnosis("loss-division-by-zero", "the loss", "the batch has no target token (mask.sum() == 0): "
                         "sum(loss·mask)/sum(mask) is 0/0 = NaN; skip such batches or clamp the count to 1")
    return Diagnosis("nonfinite-loss", "the loss", "finite logits but a non-finite loss")


def _run_in_fp32(module: nn.Module, inputs: tuple) -> torch.Tensor:
    """The module's output with its parameters and inputs in fp32 (a copy: the model is untouched)."""
    twin = copy.deepcopy(module).float()
    return twin(*[t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs])


# ---------------------------------------------------------------- the guarded job

BAD_BATCHES = ("garbage", "empty")


def bad_batch(kind: str, x: torch.Tensor, y: torch.Tensor, vocab_size: int, seed: int = 0):
    """Turn a batch bad: ``garbage`` (uniformly random tokens: a corrupted document) or
    ``empty`` (every target masked out: the loss becomes 0/0). Returns ``(x, y, mask)``."""
    if kind == "garbage":
        generator = torch.Generator().manual_seed(seed)
        tokens = torch.randint(vocab_size, (x.shape[0], x.shape[1] + 1), generator=generator)
        return tokens[:, :-1].to(x.device), tokens[:, 1:].to(y.device), torch.ones_like(y)
    if kind == "empty":
        return x, y, torch.zeros_like(y)
    raise ValueError(f"kind must be one of {BAD_BATCHES}, got {kind!r}")


def _step_with_guard(setup: TrainSetup, indices: torch.Tensor, guard, bad: str | None, step: int) -> dict:
    x, y = local_rows(setup, indices)
    mask = torch.ones_like(y)
    if bad is not None:
        x, y, mask = bad_batch(bad, x, y, setup.cfg.vocab_size, seed=step)
    loss = masked_cross_entropy(setup.model(x), y, mask)
    loss.backward()
    setup.ddp.finish_gradient_sync()
    total = loss.detach().clone()
    dist.all_reduce(total)
    global_loss = float(total) / dist.get_world_size()
    grad_norm = global_grad_norm(setup.model)
    decision = guard.decide(global_loss, grad_norm)
    if decision not in DECISIONS:
        raise ValueError(f"the guard answered {decision!r}; it must answer one of {DECISIONS}")
    if decision == "ok":
        setup.optimizer.step()
    setup.optimizer.zero_grad(set_to_none=True)
    return {"step": step, "loss": global_loss, "grad_norm": grad_norm, "decision": decision,
            "reason": getattr(guard, "reason", "")}


def guarded_train(ckpt_dir: str, steps: int, guard, *, bad: dict | None = None, save_every: int = 4,
                  cfg: GPTConfig | None = None, batch_size: int = 8, lr: float = 3e-3, seed: int = 0,
                  data_seed: int = 0, n_items: int = 64) -> dict:
    """Train with ``guard`` deciding every step; ``bad[step]`` spoils that step's batch: ``kind`` on
    every rank (a bad global batch), or ``(kind, ranks)`` on those ranks only.

    Runs on every rank. Good state is checkpointed every ``save_every`` applied steps; a
    rollback reloads the last checkpoint's weights and optimizer state but keeps the data
    order where it is, so the batches that caused the trouble are not replayed. Returns
    one record per step and the final weights.
    """
    setup = make_training(cfg, batch_size, lr, seed, data_seed, n_items)
    bad = bad or {}
    records, applied = [], 0
    save_checkpoint({"train": setup.state}, ckpt_dir, 0)  # a rollback before the first save returns here
    for step in range(steps):
        kind, where = (bad[step] if isinstance(bad.get(step), tuple) else (bad.get(step), None))
        spoiled = kind if where is None or dist.get_rank() in where else None
        record = _step_with_guard(setup, setup.order.next_batch(), guard, spoiled, step)
        if record["decision"] == "ok":
            applied += 1
            setup.state.step = applied
            if applied % save_every == 0:
                save_checkpoint({"train": setup.state}, ckpt_dir, applied)
        elif record["decision"] == "rollback":
            position = setup.order.state_dict()
            manifest = load_checkpoint({"train": setup.state}, ckpt_dir)
            setup.order.load_state_dict(position)  # past the bad data, not back to it
            applied = setup.state.step
            record["rolled_back_to"] = manifest["step"]
        records.append(record)
    return {"records": records, "weights": {k: v.detach().cpu().clone() for k, v in setup.model.state_dict().items()}}
