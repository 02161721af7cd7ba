"""Sharded checkpoints loaded into a different world size: FSDP2 on 4 ranks → 2, and 2 → 4.

Under FSDP (``fully_shard``) no rank holds a whole parameter: each holds a
``DTensor`` shard of every parameter and of its Adam moments. DCP writes each rank's
shards to that rank's own file and records, in ``.metadata``, every tensor's global
shape and which byte ranges hold which slice. Loading into another world size is
then a planning problem, not a conversion: each new rank asks for the slices its new
shards cover, and DCP reads those byte ranges from whichever files hold them. After
a node is lost, a job can come back on fewer ranks (or grow when nodes return)
without a conversion step.

:func:`fsdp_job` trains and saves, or loads (and optionally trains on), on the
ranks it is launched on; :func:`gather_full_state` collects the full tensors on
rank 0 so a test can compare them bit for bit across world sizes.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard  # torch >= 2.6 (already loaded by the state_dict import above)

from distlab.fault_tolerance.checkpoint import TrainState, latest_checkpoint, load_checkpoint, save_checkpoint
from distlab.fault_tolerance.resume import ShuffledOrder, TrainSetup, local_rows
from distlab.model import GPT, GPTConfig, synthetic_batch
from distlab.runtime.rank import device

__all__ = ["build_fsdp", "gather_full_state", "fsdp_job"]


def build_fsdp(cfg: GPTConfig, batch_size: int, lr: float = 3e-3, seed: int = 0, data_seed: int = 0,
               n_items: int = 64) -> TrainSetup:
    """The lab's GPT with every block and the root under FSDP2 (``fully_shard``), AdamW, a data order."""
    model = GPT(cfg, seed=seed).to(device())
    # The mesh names this rank's device: without one, fully_shard builds it on the machine's accelerator,
    # so gloo ranks on a one-GPU machine would each try to claim cuda:<rank> ("invalid device ordinal").
    mesh = init_device_mesh(device().type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    order = ShuffledOrder(n_items, batch_size, seed=data_seed)
    pool = synthetic_batch(cfg, n_items, step=0, seed=data_seed)
    return TrainSetup(model, None, optimizer, order, pool, TrainState(model, optimizer, order), cfg)


def gather_full_state(setup: TrainSetup) -> dict[str, torch.Tensor] | None:
    """Every parameter and optimizer tensor, unsharded, on rank 0's CPU (``None`` on the others).

    Keys: ``model.<name>`` and ``optim.<name>.<exp_avg|exp_avg_sq|step>``: canonical
    names, the same whatever the world size, so two runs can be compared key by key.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optim_state = get_state_dict(setup.model, setup.optimizer, options=options)
    if dist.get_rank() != 0:
        return None
    full = {f"model.{k}": v.clone() for k, v in model_state.items()}
    for name, entries in optim_state["state"].items():
        for key, value in entries.items():
            full[f"optim.{name}.{key}"] = value.clone() if isinstance(value, torch.Tensor) else torch.tensor(value)
    return full


def _train_fsdp(setup: TrainSetup, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        x, y = local_rows(setup, setup.order.next_batch())
        _, loss = setup.model(x, y)
        loss.backward()  # FSDP2 reduce-scatters the gradients into each rank's shard
        setup.optimizer.step()
        setup.optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / dist.get_world_size())
        setup.state.step += 1
    return losses


def fsdp_job(ckpt_dir: str, *, train_steps: int = 0, save: bool = True, load: bool = False,
             cfg: GPTConfig | None = None, batch_size: int = 8, seed: int = 0) -> dict:
    """On every rank: build FSDP2 GPT (a seed per world size, so a load must overwrite it), optionally load
    the latest checkpoint in ``ckpt_dir`` (whatever world size wrote it), train, optionally save.

    Returns, from rank 0, the full state before saving (or after loading), and from
    every rank the bytes of the shards it holds and the checkpoint files it wrote.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = cfg or GPTConfig()
    setup = build_fsdp(cfg, batch_size, seed=seed + 100 * world)
    loaded_from = None
    if load:
        latest = latest_checkpoint(ckpt_dir)
        manifest = load_checkpoint({"train": setup.state}, latest if latest is not None else ckpt_dir)
        loaded_from = {"step": manifest["step"], "world_size": manifest["world_size"]}
    after_load = gather_full_state(setup) if load else None
    losses = _train_fsdp(setup, train_steps)
    before_save = gather_full_state(setup) if save else None
    path = save_checkpoint({"train": setup.state}, ckpt_dir, setup.state.step) if save else None
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in setup.model.parameters())
    files = {}
    if path is not None:
        files = {f.name: f.stat().st_size for f in Path(path).iterdir() if f.name.startswith(f"__{rank}_")}
    return {"rank": rank, "world_size": world, "loaded_from": loaded_from, "after_load": after_load,
            "before_save": before_save, "losses": losses, "shard_bytes": shard_bytes, "files": files,
            "path": os.fspath(path) if path is not None else None}
