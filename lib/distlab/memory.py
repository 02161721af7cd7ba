"""Memory accounting: what training keeps in memory, measured and predicted, in one place.

Two halves that every lab uses side by side:

* **Measurement** — :func:`tensor_bytes`, :func:`model_state_bytes`, :class:`ActivationMeter`,
  :func:`memory_report` count the bytes of real tensors (each storage once, so a tied
  weight or a view is never counted twice).
* **Theory** — :func:`bytes_per_param` (Adam, mixed precision or fp32, ZeRO stages 0–3),
  :func:`activation_bytes_per_layer` (Korthikanti et al. 2022), :func:`model_memory` and the
  Llama-shaped :data:`PRESETS`. This is the single source of truth: the Lab 01 checkers,
  the course text and later labs all call these functions rather than restating formulas.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable

import torch
import torch.nn as nn

__all__ = [
    "tensor_bytes", "model_state_bytes", "ActivationMeter", "MemoryReport", "memory_report",
    "BytesPerParam", "bytes_per_param", "activation_bytes_per_layer", "ModelMemory", "model_memory",
    "Preset", "PRESETS", "GiB", "MiB",
]

MiB = 2**20
GiB = 2**30


# --------------------------------------------------------------------------- measurement


def _storage_key_and_bytes(t: torch.Tensor) -> tuple[tuple, int]:
    try:
        storage = t.untyped_storage()
        if t.device.type == "meta":  # every meta storage's data pointer is 0: one storage object per allocation
            return ("meta", id(storage)), storage.nbytes()
        return (str(t.device), storage.data_ptr()), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a plain storage
        return ("id", id(t)), t.numel() * t.element_size()


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes held by ``tensors``, each underlying storage counted once (``None`` skipped).

    Counting storages rather than tensors is what memory actually costs: a tied weight,
    a view or a slice of a flat buffer shares one allocation, and the whole allocation is held.
    """
    seen: set[tuple] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        key, nbytes = _storage_key_and_bytes(t)
        if key not in seen:
            seen.add(key)
            total += nbytes
    return total


def _optimizer_tensors(optimizer) -> Iterable[torch.Tensor]:
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Exact bytes of ``parameters``, ``gradients`` (``p.grad``) and ``optimizer`` state.

    The optimizer entry counts every tensor in ``optimizer.state``: for AdamW that is
    ``exp_avg`` and ``exp_avg_sq`` (8 bytes/param in fp32) plus one 4-byte ``step`` scalar
    per parameter tensor. It is 0 before the first ``step()``, which creates the state lazily.
    """
    params = list(model.parameters())
    return {
        "parameters": tensor_bytes(params),
        "gradients": tensor_bytes(p.grad for p in params),
        "optimizer": tensor_bytes(_optimizer_tensors(optimizer)) if optimizer is not None else 0,
    }


class ActivationMeter:
    """Bytes of the tensors autograd saves for backward while the ``with`` block runs.

    ``with ActivationMeter(model) as meter: loss = model(x, y)[1]`` then ``meter.bytes``.
    Uses ``torch.autograd.graph.saved_tensors_hooks``: every tensor saved for backward passes
    through our pack hook. Storages are deduplicated, and storages of parameters (of ``model``
    if given, and any ``nn.Parameter`` or view of one) are excluded: weights are not activations.
    Meter one forward at a time (a freed storage's address can be reused later).
    """

    def __init__(self, model: nn.Module | None = None):
        self._param_keys = set()
        if model is not None:
            self._param_keys = {_storage_key_and_bytes(p)[0] for p in model.parameters()}
        self._seen: dict[tuple, int] = {}
        self._hooks = None

    def _pack(self, t: torch.Tensor):
        base = t._base if t._base is not None else t
        if not isinstance(base, nn.Parameter) and not isinstance(t, nn.Parameter):
            key, nbytes = _storage_key_and_bytes(t)
            if key not in self._param_keys:
                self._seen.setdefault(key, nbytes)
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def __enter__(self) -> "ActivationMeter":
        self._seen.clear()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None

    @property
    def bytes(self) -> int:
        """Total bytes of distinct non-parameter storages saved for backward."""
        return sum(self._seen.values())

    @property
    def count(self) -> int:
        """Number of distinct storages saved."""
        return len(self._seen)


@dataclass
class MemoryReport:
    """Bytes by category; ``cuda_*`` come from the CUDA caching allocator and are None on CPU."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    total: int
    cuda_allocated: int | None = None
    cuda_max_allocated: int | None = None

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        names = ("parameters", "gradients", "optimizer", "activations", "total")
        rows = [(name, getattr(self, name)) for name in names]
        if self.cuda_allocated is not None:
            rows += [("cuda allocated", self.cuda_allocated), ("cuda max allocated", self.cuda_max_allocated)]
        return "\n".join(f"{name:>20}: {value / MiB:10.3f} MiB" for name, value in rows)


def memory_report(model: nn.Module, optimizer=None, activations: "int | ActivationMeter | None" = None) -> MemoryReport:
    """Counted bytes of a model's training state (plus activations, a byte count or a meter)."""
    states = model_state_bytes(model, optimizer)
    act = activations.bytes if isinstance(activations, ActivationMeter) else int(activations or 0)
    cuda_allocated = cuda_max = None
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type == "cuda":
        cuda_allocated = torch.cuda.memory_allocated(device)
        cuda_max = torch.cuda.max_memory_allocated(device)
    return MemoryReport(states["parameters"], states["gradients"], states["optimizer"], act,
                        sum(states.values()) + act, cuda_allocated, cuda_max)


# --------------------------------------------------------------------------- theory

# Bytes per parameter before sharding: (params, grads, optimizer state) for Adam.
# mixed: bf16 params (2) + bf16 grads (2) + fp32 master params, Adam m, Adam v (4+4+4 = 12).
# fp32:  fp32 params (4) + fp32 grads (4) + Adam m, v (4+4 = 8).
# mixed_fp32_grads: mixed, but the gradients accumulate over micro-batches and are reduced in fp32
#   (4): Megatron-LM's `--accumulate-allreduce-grads-in-fp32`, and Llama 3's choice for stability.
_UNSHARDED = {"mixed": (2, 2, 12), "fp32": (4, 4, 8), "mixed_fp32_grads": (2, 4, 12)}


@dataclass(frozen=True)
class BytesPerParam:
    """Bytes each rank holds per model parameter, by category."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def bytes_per_param(zero_stage: int, world_size: int, precision: str = "mixed") -> BytesPerParam:
    """Per-rank bytes per parameter for Adam under DDP (stage 0) or ZeRO stage 1/2/3.

    ZeRO shards, over ``world_size`` ranks, stage 1: optimizer state; stage 2: + gradients;
    stage 3: + parameters. Mixed precision: 16 | 4 + 12/N | 2 + 14/N | 16/N.
    fp32: 16 | 8 + 8/N | 4 + 12/N | 16/N. ``"mixed_fp32_grads"`` (bf16 parameters, fp32 gradients):
    18 | 6 + 12/N | 2 + 16/N | 18/N.
    """
    if zero_stage not in (0, 1, 2, 3) or isinstance(zero_stage, bool):
        raise ValueError(f"zero_stage={zero_stage!r}; expected 0, 1, 2 or 3")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive integer")
    if precision not in _UNSHARDED:
        raise ValueError(f"precision={precision!r}; expected one of {sorted(_UNSHARDED)}")
    p, g, o = _UNSHARDED[precision]
    n = world_size
    return BytesPerParam(
        params=p / n if zero_stage >= 3 else float(p),
        grads=g / n if zero_stage >= 2 else float(g),
        optimizer=o / n if zero_stage >= 1 else float(o),
    )


def _half_bytes(numerator: int) -> int | float:
    return numerator // 2 if numerator % 2 == 0 else numerator / 2


def activation_bytes_per_layer(seq_len: int, batch: int, d_model: int, n_head: int,
                               checkpointing: bool = False, bytes_per_value: int = 2,
                               flash_attention: bool = False) -> int | float:
    """Activation bytes one transformer layer keeps for backward (Korthikanti et al. 2022, §4).

    Without recomputation: ``s·b·h·(34 + 5·a·s/h)`` bytes for 16-bit activations, where
    34·sbh covers the stored inputs of LayerNorms, QKV, attention, projections, MLP and GELU
    (plus 1-byte dropout masks) and 5·a·s²·b the attention scores, softmax and its dropout mask.
    With full recomputation only the layer input is kept: ``2·s·b·h``. ``bytes_per_value``
    rescales both (the formula is written for 2): 4 for fp32 activations. ``flash_attention``:
    a fused kernel (FlashAttention) keeps no s×s scores, so the ``5·a·s/h`` term drops out.
    """
    s, b, h, a = seq_len, batch, d_model, n_head
    if checkpointing:
        return _half_bytes(2 * s * b * h * bytes_per_value)
    scores = 0 if flash_attention else 5 * a * s
    return _half_bytes(s * b * (34 * h + scores) * bytes_per_value)


@dataclass(frozen=True)
class ModelMemory:
    """Bytes one rank holds: model states (from :func:`bytes_per_param`) and activations."""

    params: float
    grads: float
    optimizer: float
    activations: float
    transient: float = 0.0  # only at the peak (``model_memory(peak=True)``): a recomputed layer, a gathered unit

    @property
    def states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.states + self.activations + self.transient

    def gib(self) -> dict[str, float]:
        names = ("params", "grads", "optimizer", "activations", "transient", "states", "total")
        return {name: getattr(self, name) / GiB for name in names}


def model_memory(n_params: int, world_size: int, zero_stage: int, precision: str = "mixed", *,
                 n_layer: int = 0, seq_len: int = 0, micro_batch: int = 0, d_model: int = 0, n_head: int = 1,
                 checkpointing: bool = False, bytes_per_value: int = 2, flash_attention: bool = False,
                 peak: bool = False, unit_params: float = 0) -> ModelMemory:
    """Per-rank training memory: ``n_params · bytes_per_param`` plus ``n_layer`` layers of
    activations for one micro-batch (ZeRO shards model states, never activations).

    Leave the shape arguments at 0 for model states only. ``flash_attention``: no s×s scores
    (:func:`activation_bytes_per_layer`). ``peak=True`` adds, as ``transient``, what exists only
    while one layer computes: under checkpointing that layer's full activations (its forward runs
    again in backward), and under ZeRO-3 the gathered unit of ``unit_params`` parameters — its
    full weights and, before the reduce-scatter, its full gradients in the compute dtype. Still
    not included: embeddings/logits activations, a prefetched next unit, communication buffers and
    fragmentation — real peaks sit somewhat above even this.
    """
    per = bytes_per_param(zero_stage, world_size, precision)
    act = transient = 0
    if n_layer and seq_len and micro_batch and d_model:
        act = n_layer * activation_bytes_per_layer(seq_len, micro_batch, d_model, n_head, checkpointing,
                                                   bytes_per_value, flash_attention)
        if peak and checkpointing:
            transient += activation_bytes_per_layer(seq_len, micro_batch, d_model, n_head, False, bytes_per_value,
                                                    flash_attention)
    if peak and zero_stage == 3:
        weights, grads, _ = _UNSHARDED[precision]
        transient += unit_params * (weights + grads)
    return ModelMemory(n_params * per.params, n_params * per.grads, n_params * per.optimizer, act, transient)


@dataclass(frozen=True)
class Preset:
    """A Llama-shaped model: enough shape to count parameters and activations."""

    name: str
    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int
    ffn_dim: int
    vocab_size: int
    seq_len: int  # pre-training context length

    @property
    def n_params(self) -> int:
        """Exact Llama parameter count: GQA attention, SwiGLU MLP (3 matrices), RMSNorms, untied head."""
        return self.n_layer * self.layer_params + 2 * self.vocab_size * self.d_model + self.d_model

    @property
    def layer_params(self) -> int:
        """Parameters of one transformer layer: one FSDP unit when every block is wrapped."""
        d, kv = self.d_model, self.n_kv_head * (self.d_model // self.n_head)
        return 2 * d * d + 2 * d * kv + 3 * d * self.ffn_dim + 2 * d

    def memory(self, world_size: int, zero_stage: int, micro_batch: int = 1, checkpointing: bool = False,
               precision: str = "mixed", flash_attention: bool = False, peak: bool = False) -> ModelMemory:
        """:func:`model_memory` for this model at its pre-training sequence length (``peak``: one layer
        recomputed and, under ZeRO-3, one layer gathered as the unit)."""
        return model_memory(self.n_params, world_size, zero_stage, precision, n_layer=self.n_layer,
                            seq_len=self.seq_len, micro_batch=micro_batch, d_model=self.d_model,
                            n_head=self.n_head, checkpointing=checkpointing, flash_attention=flash_attention,
                            peak=peak, unit_params=self.layer_params)


PRESETS: dict[str, Preset] = {
    # Llama 2 7B (6,738,415,616 params) and 70B (68,976,648,192), Llama 3.1 405B (405,853,388,800).
    "7B": Preset("7B", n_layer=32, d_model=4096, n_head=32, n_kv_head=32, ffn_dim=11008, vocab_size=32000,
                 seq_len=4096),
    "70B": Preset("70B", n_layer=80, d_model=8192, n_head=64, n_kv_head=8, ffn_dim=28672, vocab_size=32000,
                  seq_len=4096),
    "405B": Preset("405B", n_layer=126, d_model=16384, n_head=128, n_kv_head=8, ffn_dim=53248, vocab_size=128256,
                   seq_len=8192),
}
