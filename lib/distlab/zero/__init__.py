"""ZeRO-1/2/3 and FSDP from scratch: shard optimizer state, then gradients, then parameters.

DDP keeps 16 bytes per parameter on every rank (mixed-precision Adam: bf16 weights and
gradients, fp32 master weights and two moments). ZeRO (Rajbhandari et al. 2020) shards
them over the N data-parallel ranks, one kind more per stage, with the formulas of
:func:`distlab.memory.bytes_per_param`:

=========  =====================================  =================  ==================================
stage      sharded                                bytes/param/rank   traffic per step vs DDP, k micro-b.
=========  =====================================  =================  ==================================
DDP        nothing                                16                 1 (one all-reduce per step)
ZeRO-1     optimizer state                        4 + 12/N           1 (reduce-scatter + all-gather)
ZeRO-2     + gradients                            2 + 14/N           (k + 1)/2 (k reduce-scatters)
ZeRO-3     + parameters (FSDP)                    16/N               1.5·k (2 all-gathers + 1 r-s each)
=========  =====================================  =================  ==================================

With gradient accumulation (k micro-batches per step) DDP and ZeRO-1 keep the full gradient and
reduce once; ZeRO-2/3 keep only a shard, so every micro-batch's gradients are reduce-scattered.

* :mod:`~distlab.zero.flat` — flat padded buffers (:class:`FlatParam`), the device mesh
  (:class:`Axis`, :func:`mesh_axes`: DDP, ZeRO and HSDP as one code path) and their collectives;
* :mod:`~distlab.zero.optim` — ZeRO-1, :class:`ShardedOptimizer`, and :func:`mixed_precision_step`;
* :mod:`~distlab.zero.zero2` — ZeRO-2, :class:`ZeRO2`, gradients reduce-scattered per bucket in backward;
* :mod:`~distlab.zero.fsdp` — ZeRO-3, :class:`ZeRO3`, per-unit gather/free with hooks, prefetch,
  and :func:`checkpoint_module` (activation checkpointing);
* :mod:`~distlab.zero.per_param` — FSDP2's design: :class:`PerParamFSDP` shards every parameter on dim 0, the
  module's parameters are the shards (any ``torch.optim`` optimizer steps them), mixed precision keeps fp32 masters;
  :func:`apply_fully_shard` puts PyTorch's ``fully_shard`` on the same modules, :func:`train_per_param` trains either;
* :mod:`~distlab.zero.train` — :func:`train_worker` for every stage and for PyTorch's own
  (``ZeroRedundancyOptimizer``, FSDP2 ``fully_shard``), measurements, and :func:`train` for torchrun::

    torchrun --nproc-per-node=8 -m distlab.torchrun distlab.zero:train stage=3 steps=20
"""

from distlab.zero.flat import (
    Axis,
    FlatLayout,
    FlatParam,
    alloc_storage,
    free_storage,
    gather_flat,
    mesh_axes,
    reduce_scatter_mean,
)
from distlab.zero.fsdp import (
    FSDPUnit,
    ZeRO3,
    assign_params,
    attention_core,
    checkpoint_module,
    plan_units,
    reshard,
    unfused_attention,
    unshard,
)
from distlab.zero.optim import ShardedOptimizer, mixed_precision_step
from distlab.zero.per_param import (
    DEFAULT_SHARDED,
    PerParamFSDP,
    ShardedParam,
    apply_fully_shard,
    cast_reference,
    compare_designs,
    dim0_chunk,
    reduce_scatter_dim0,
    shuffled_rows,
    train_per_param,
)
from distlab.zero.train import (
    STAGES,
    WRAP_POLICIES,
    comm_per_step,
    comm_snapshot,
    compute_dtype,
    full_state_dict,
    make_engine,
    peak_memory,
    run_exercise,
    state_bytes,
    train,
    train_worker,
    validate,
)
from distlab.zero.zero2 import ZeRO2, reduce_accumulating, reduce_scatter_grads

__all__ = [
    "Axis", "FlatLayout", "FlatParam", "alloc_storage", "free_storage",
    "gather_flat", "mesh_axes", "reduce_scatter_mean", "FSDPUnit", "ZeRO3", "assign_params", "checkpoint_module",
    "plan_units", "reshard", "unshard", "ShardedOptimizer", "mixed_precision_step", "STAGES", "WRAP_POLICIES",
    "comm_per_step", "comm_snapshot", "compute_dtype", "full_state_dict", "make_engine", "peak_memory",
    "state_bytes", "train", "train_worker", "validate", "ZeRO2", "reduce_scatter_grads", "run_exercise",
    "attention_core", "unfused_attention", "reduce_accumulating", "DEFAULT_SHARDED", "PerParamFSDP", "ShardedParam",
    "apply_fully_shard", "cast_reference", "compare_designs", "dim0_chunk", "reduce_scatter_dim0", "shuffled_rows",
    "train_per_param",
]
