"""3D parallelism: the process-group grid, and DP × PP × TP training composed from labs 05 and 06.

A job of ``world = dp · pp · tp`` ranks is a grid: rank ``r`` sits at coordinates
``(d, s, t)`` of ``arange(world).view(dp, pp, tp)`` (picotron's layout, ``ProcessGroupManager``
in ``picotron/process_group_manager.py``; Llama 3's order [TP, CP, PP, DP] from the inside out,
Dubey et al. 2024, §3.3.2). Megatron-LM numbers its ranks otherwise by default: PP outermost, then DP
(:data:`MEGATRON_ORDER`; ``Grid(..., order=MEGATRON_ORDER)`` and :func:`order_table` show both).
TP is the innermost axis in both, so a TP group is ``tp`` *consecutive* ranks:
with ``tp`` dividing the GPUs per node, every TP group lives inside one node, on NVLink —
TP communicates inside every layer, forward and backward, and cannot afford the network.
PP is next (one point-to-point message per micro-batch per stage boundary), DP outermost
(one gradient all-reduce per step, which overlaps with backward).

* :class:`Grid` — the arithmetic: coordinates, every group of every axis, which axes stay in a node, in
  either rank order (:func:`order_table` prints them side by side);
* :func:`process_groups` — the real ``torch.distributed`` groups of this rank (and the pipeline's
  point-to-point channels); :func:`device_mesh_groups` — the same from PyTorch's ``init_device_mesh``;
* :func:`parallel3d_worker` — training on the grid: each stage of lab 06's pipeline is a slice of
  lab 05's tensor-parallel GPT, each pipeline a data-parallel replica; :func:`compare_with_reference`
  proves it equal to one process, and :func:`measured_bytes_per_axis` reads what each axis sent.

Under torchrun::

    torchrun --nproc-per-node=8 -m distlab.torchrun distlab.parallel3d.grid:train dp=2 pp=2 tp=2 steps=3
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from distlab.data_parallel import allreduce_buckets
from distlab.flops import step_report
from distlab.model import GPT, GPTConfig, synthetic_batch
from distlab.pipeline_parallel import StageModule, check_setup, even_partition, make_schedule, run_schedule
from distlab.pipeline_parallel.executor import Channels
from distlab.pipeline_parallel.train import keep_freed_memory
from distlab.reference import make_optimizer, train_reference
from distlab.runtime import comm
from distlab.runtime.progress import progress as progress_bar
from distlab.runtime.rank import device
from distlab.runtime.subgroups import own_subgroup, subgroup
from distlab.tensor_parallel import TensorParallelGPT, check_tp_sizes, shard_of, vocab_parallel_cross_entropy
from distlab.zero.flat import Axis
from distlab.zero.optim import ShardedOptimizer

__all__ = ["AXES", "MEGATRON_ORDER", "Grid", "order_table", "ProcessGroups", "process_groups", "device_mesh_groups",
           "group_ranks_worker", "average_gradients", "check_3d_setup", "parallel3d_worker", "replica_losses",
           "reference_run", "compare_with_reference", "measured_bytes_per_axis", "train"]

AXES = ("dp", "pp", "cp", "tp")  # outermost to innermost, Llama 3's order: the coordinates, and distlab's rank order
# Megatron-LM's default rank order, outermost to innermost: initialize_model_parallel(order="tp-cp-ep-dp-pp") in
# megatron/core/parallel_state.py names the axes from the innermost out (RankGenerator: rank = tp + dp·tp + pp·tp·dp
# with cp = ep = 1). DP sits inside PP: its groups have stride tp, a pipeline's stages stride tp·dp.
MEGATRON_ORDER = ("pp", "dp", "cp", "tp")
ORDER_SOURCES = {"distlab": "picotron's (picotron/process_group_manager.py, ProcessGroupManager) and Llama 3's "
                             "[TP, CP, PP, DP] from the inside out (Dubey et al. 2024, §3.3.2)",
                 "Megatron-LM": 'megatron/core/parallel_state.py, initialize_model_parallel(order="tp-cp-ep-dp-pp"), '
                                "the axes named from the innermost out"}


@dataclass(frozen=True)
class Grid:
    """``dp × pp × tp`` ranks laid out as ``arange(world).view(dp, pp, tp)``.

    ``cp`` (context parallelism, lab 07) sits between PP and TP when it is used, as in Llama 3
    (``[TP, CP, PP, DP]`` from the inside out); the training run here keeps ``cp = 1``.
    ``order`` numbers the ranks: the axes outermost to innermost (:data:`AXES`, or Megatron-LM's
    :data:`MEGATRON_ORDER`); coordinates are named by axis whatever the order.
    """

    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    order: tuple[str, ...] = AXES

    def __post_init__(self) -> None:
        for axis in AXES:
            value = getattr(self, axis)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{axis}={value!r} must be a positive integer")
        if sorted(self.order) != sorted(AXES):
            raise ValueError(f"order={self.order!r} must name each of {AXES} once, outermost first")

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def shape(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in AXES}

    @property
    def axes(self) -> tuple[str, ...]:
        """The axes this grid uses: all of :data:`AXES` but ``cp`` when ``cp = 1``."""
        return tuple(axis for axis in AXES if axis != "cp" or self.cp > 1)

    def check_world(self, world: int) -> None:
        """One-line ``ValueError`` when the job's world size is not ``dp · pp · tp``."""
        if world != self.world:
            sizes = " × ".join(str(getattr(self, a)) for a in self.axes)
            names = " × ".join(self.axes)
            raise ValueError(f"world size {world} is not {names} = {sizes} = {self.world}: "
                             f"start {self.world} ranks or change the degrees")

    def ranks(self) -> torch.Tensor:
        """The grid itself: ``ranks()[d, s, c, t]`` is the global rank at those coordinates, in either order."""
        numbered = torch.arange(self.world).view(*(self.shape[axis] for axis in self.order))
        return numbered.permute(*(self.order.index(axis) for axis in AXES))

    def coords(self, rank: int) -> dict[str, int]:
        """``{"dp": d, "pp": s, "cp": c, "tp": t}`` of a global rank."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside a grid of {self.world} ranks")
        coords = {}
        for axis in reversed(self.order):
            rank, coords[axis] = divmod(rank, getattr(self, axis))
        return {axis: coords[axis] for axis in AXES}

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis``: the ranks that differ only in that coordinate, in order."""
        if axis not in AXES:
            raise ValueError(f"axis must be one of {AXES}, got {axis!r}")
        dim = AXES.index(axis)
        grid = self.ranks().movedim(dim, -1)  # the axis last: each row is one group
        return grid.reshape(-1, self.shape[axis]).tolist()

    def group_of(self, rank: int, axis: str) -> list[int]:
        """The ranks of ``rank``'s group along ``axis``."""
        return next(group for group in self.groups(axis) if rank in group)

    def nodes_spanned(self, axis: str, gpus_per_node: int) -> int:
        """How many nodes the widest group along ``axis`` spans when ranks fill nodes in order."""
        dim = AXES.index(axis)
        nodes = self.ranks().movedim(dim, -1).reshape(-1, self.shape[axis]) // gpus_per_node
        return int(((nodes.diff(dim=1) != 0).sum(dim=1) + 1).max())  # a group's ranks ascend

    def inside_node(self, gpus_per_node: int) -> dict[str, bool]:
        """For each axis: whether all its groups stay inside one node (ranks fill nodes in order)."""
        return {axis: self.nodes_spanned(axis, gpus_per_node) == 1 for axis in AXES}


def order_table(grid: Grid) -> str:
    """Each rank's group along every axis under distlab's order and under Megatron-LM's default, side by side, and
    where Megatron's comes from: the same degrees, other groups."""
    grids = {"distlab": Grid(grid.dp, grid.pp, grid.tp, grid.cp), "Megatron-LM": Grid(grid.dp, grid.pp, grid.tp,
                                                                                   grid.cp, MEGATRON_ORDER)}
    axes = grids["distlab"].axes

    def groups(g: Grid, rank: int) -> str:
        return "  ".join(f"{axis} {g.group_of(rank, axis)}" for axis in axes)

    width = len(groups(grids["distlab"], grid.world - 1))
    lines = [f"{'':7}" + " | ".join(f"{name + ' (' + ' > '.join(a for a in g.order if a in axes) + ')':{width}}"
                                    for name, g in grids.items())]
    lines += [f"rank {rank:<2}" + " | ".join(f"{groups(g, rank):{width}}" for g in grids.values())
              for rank in range(grid.world)]
    lines += [f"{name}'s order: {source}" for name, source in ORDER_SOURCES.items()]
    return "\n".join(line.rstrip() for line in lines)


@dataclass
class ProcessGroups:
    """This rank's coordinates and its group along each axis of the grid, plus its pipeline's channels."""

    grid: Grid
    coords: dict[str, int]
    groups: dict[str, object]
    pipe: Channels

    @property
    def dp(self):
        return self.groups["dp"]

    @property
    def pp(self):
        return self.groups["pp"]

    @property
    def tp(self):
        return self.groups["tp"]

    def ranks(self, axis: str) -> list[int]:
        return dist.get_process_group_ranks(self.groups[axis])


def process_groups(grid: Grid) -> ProcessGroups:
    """This rank's groups along every axis of ``grid``, and lab 06's channels for each pipeline (its ``pp`` groups).

    Every rank asks for every group, axis by axis in the order of :data:`AXES` (``new_group``
    is collective; ``cp`` only when ``cp > 1``); they are made once, and a warm rank keeps them between jobs.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    grid.check_world(world)
    mine = {axis: own_subgroup(grid.groups(axis)) for axis in grid.axes}
    return ProcessGroups(grid, grid.coords(rank), mine, Channels(grid.pp, grid.groups("pp")))


def device_mesh_groups(grid: Grid) -> dict[str, list[int]]:
    """This rank's group along each axis, as PyTorch's ``init_device_mesh`` builds them (its dimensions in the grid's
    order: the mesh numbers ranks as ``arange(world).view(shape)``)."""
    grid.check_world(dist.get_world_size())
    dims = tuple(axis for axis in grid.order if axis in grid.axes)
    mesh = init_device_mesh(device().type, tuple(grid.shape[a] for a in dims), mesh_dim_names=dims)
    return {axis: dist.get_process_group_ranks(mesh[axis].get_group()) for axis in grid.axes}


def group_ranks_worker(grid: Grid, groups_fn: Callable[[int, int, int, int], dict] | None = None) -> dict:
    """On a rank: its coordinates and the ranks of its groups, made three ways.

    ``ours``: real groups from :func:`process_groups`; ``device_mesh``: PyTorch's; and,
    when ``groups_fn(world, dp, pp, tp)`` is given (a student's grid), ``theirs``: the
    group of this rank along each axis according to it, built as a real group too.
    """
    rank = dist.get_rank()
    groups = process_groups(grid)
    out = {"rank": rank, "coords": groups.coords, "ours": {axis: groups.ranks(axis) for axis in grid.axes},
           "device_mesh": device_mesh_groups(grid)}
    if groups_fn is not None:
        layout = groups_fn(grid.world, grid.dp, grid.pp, grid.tp)
        theirs = {}
        for axis in ("dp", "pp", "tp"):
            for ranks in layout[axis]:
                made = subgroup(ranks)
                if rank in ranks:
                    theirs[axis] = dist.get_process_group_ranks(made)
        out["theirs"] = theirs
    return out


# ---------------------------------------------------------------- training on the grid

def average_gradients(params: Sequence[torch.nn.Parameter], group, dp: int) -> None:
    """Data parallelism over ``group``: one flat all-reduce of every gradient, divided by ``dp``
    (lab 03's :func:`~distlab.data_parallel.allreduce_buckets` with one bucket, on the DP group).

    Each replica saw ``1/dp`` of the batch and its loss is that part's mean, so the mean of
    the replicas' gradients is the full batch's gradient. Only the ``dp`` ranks holding the
    *same* shard of the *same* stage are in a DP group: reducing over the world would add
    different tensors together.
    """
    if dp > 1:
        allreduce_buckets([list(params)], group)


def check_3d_setup(cfg: GPTConfig, grid: Grid, m: int, batch_size: int, world: int | None = None,
                   schedule: str = "1f1b", zero: int = 0) -> None:
    """Every size the 3D run needs, checked before any rank starts: one ``ValueError`` line."""
    if world is not None:
        grid.check_world(world)
    if zero not in (0, 1):
        raise ValueError(f"zero={zero!r}: the 3D run averages gradients over DP (0) or shards the optimizer state "
                         f"over it (ZeRO-1); for ZeRO-2/3 run distlab.zero:train")
    if cfg.tied_embeddings:
        raise ValueError("the 3D run needs untied embeddings (GPTConfig(tied_embeddings=False), as Llama 3): "
                         "the token embedding (first stage) and the output layer (last stage) are cut apart")
    check_tp_sizes(cfg, grid.tp)
    if batch_size % grid.dp:
        raise ValueError(f"the batch of {batch_size} sequences does not split over dp={grid.dp} replicas")
    if grid.cp > 1:
        raise ValueError(f"this run composes DP, PP and TP; cp={grid.cp} (context parallelism, lab 07) "
                         f"is not part of it")
    check_setup(grid.pp, m, cfg.n_layer, batch_size // grid.dp, schedule)


def parallel3d_worker(cfg: GPTConfig, dp: int, pp: int, tp: int, m: int = 2, batch_size: int = 4, steps: int = 1,
                      optimizer: str = "sgd", lr: float = 0.1, seed: int = 0, data_seed: int = 0,
                      schedule: str = "1f1b", grad_sync: Callable | None = None, zero: int = 0,
                      on_step: Callable | None = None, progress: bool = True) -> dict:
    """Train ``GPT(cfg, seed)`` on a ``dp × pp × tp`` grid; report this rank.

    The composition, with no third implementation of anything: lab 05's
    :class:`~distlab.tensor_parallel.TensorParallelGPT` over this rank's TP group, cut by lab
    06's :class:`~distlab.pipeline_parallel.StageModule` into this rank's stage (they keep the
    GPT's parameter names), run by lab 06's :func:`~distlab.pipeline_parallel.run_schedule`
    over this pipeline's channels, its last stage scoring with the vocabulary-parallel loss;
    then the replicas' gradients are averaged over the DP group (``grad_sync``, default
    :func:`average_gradients`) and every rank updates its own shards.

    Every replica takes rows ``d·B/dp …`` of the step's ``batch_size`` sequences, in ``m``
    micro-batches. Returns ``rank``, ``coords``, ``losses`` (the replica's mean loss per step
    on its last stage's ranks, else ``None``), ``state`` (this rank's shards, GPT names),
    ``bytes``: per step, the payload bytes this rank sent along each axis, and ``step_times``.
    ``zero=1``: lab 04's :class:`~distlab.zero.ShardedOptimizer` over the DP group instead (ZeRO-1:
    gradients reduce-scattered, each rank updating its shard of the optimizer state, weights all-gathered).
    ``on_step(step, loss, seconds)`` is called on every rank after every step (``loss`` None off the last stage).
    ``progress``: a bar of the steps where a person watches, one for the job, drawn by the launcher
    (:mod:`distlab.runtime.progress`); none under nbval or CI.
    """
    grid = Grid(dp, pp, tp)
    check_3d_setup(cfg, grid, m, batch_size, dist.get_world_size(), schedule, zero)
    keep_freed_memory()
    groups = process_groups(grid)
    d, s = groups.coords["dp"], groups.coords["pp"]
    dev = device()
    layers = even_partition(cfg.n_layer, pp)[s]
    stage = StageModule(TensorParallelGPT(GPT(cfg, seed=seed).to(dev), groups.tp), layers, s == 0, s == pp - 1)
    params = list(stage.parameters())
    if zero:
        factory = functools.partial(make_optimizer, optimizer=optimizer, lr=lr)
        opt = ShardedOptimizer(params, factory, shard=Axis(groups.dp if dp > 1 else None, dp, d))
    else:
        opt = make_optimizer(params, optimizer, lr=lr)
    actions = make_schedule(schedule, pp, m)[s]
    rows = batch_size // dp
    sync = (lambda *_: None) if zero else (grad_sync or average_gradients)  # ZeRO-1 reduces in its step

    def loss_fn(local_logits, targets):
        return vocab_parallel_cross_entropy(local_logits, targets, groups.tp)

    out = {"rank": dist.get_rank(), "coords": groups.coords, "layers": list(layers), "losses": [], "bytes": [],
           "step_times": []}
    for step in progress_bar(range(steps), desc="3D steps", unit="step", disable=not progress):
        x, y = synthetic_batch(cfg, batch_size, step, seed=data_seed)
        micro = list(zip(x[d * rows:(d + 1) * rows].to(dev).chunk(m), y[d * rows:(d + 1) * rows].to(dev).chunk(m)))
        start = time.perf_counter()
        before = comm.snapshot()
        stats = run_schedule(actions, {s: stage}, micro, loss_fn=loss_fn, p=pp, num_stages=pp, chan=groups.pipe)
        schedule_traffic = comm.since(before)
        sent = {"tp": schedule_traffic.total("payload_bytes", "all_reduce"),
                "pp": schedule_traffic.total("payload_bytes", ("isend", "send"))}
        before = comm.snapshot()
        sync(params, groups.dp, dp)
        opt.step()
        sent["dp"] = comm.since(before).total("payload_bytes", ("all_reduce", "reduce_scatter", "all_gather"))
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        out["step_times"].append(time.perf_counter() - start)
        out["losses"].append(statistics.fmean(stats.losses.values()) if stats.losses else None)
        out["bytes"].append(sent)
        if on_step is not None:
            on_step(step, out["losses"][-1], out["step_times"][-1])
    out["state"] = {name: t.detach().to("cpu", copy=True) for name, t in stage.state_dict().items()}
    return out


def replica_losses(results: Sequence[dict]) -> list[float]:
    """The global batch's loss per step: the mean over DP replicas of their last stage's loss."""
    last = [r for r in results if r["losses"] and r["losses"][0] is not None and r["coords"]["tp"] == 0]
    return [statistics.fmean(r["losses"][i] for r in last) for i in range(len(last[0]["losses"]))]


def reference_run(cfg: GPTConfig, batch_size: int, steps: int, optimizer: str = "sgd", lr: float = 0.1,
                  seed: int = 0, data_seed: int = 0):
    """The single-process run a 3D run must equal: ``GPT(cfg, seed)``, one step per whole batch."""
    batches = [synthetic_batch(cfg, batch_size, step, seed=data_seed) for step in range(steps)]
    return train_reference(cfg, batches, lr=lr, optimizer=optimizer, seed=seed)


def compare_with_reference(results: Sequence[dict], cfg: GPTConfig, grid: Grid, batch_size: int, steps: int,
                           optimizer: str = "sgd", lr: float = 0.1, seed: int = 0, data_seed: int = 0) -> dict:
    """The 3D run against one process training ``GPT(cfg, seed)`` on the whole batches.

    Returns the largest loss difference over steps and the worst parameter: ``(rank, name,
    difference)`` over every rank's shards, each compared with the same slice of the
    reference (:func:`~distlab.tensor_parallel.shard_of`). Also checks that every parameter
    of the model is held by some rank.
    """
    reference = reference_run(cfg, batch_size, steps, optimizer, lr, seed, data_seed)
    losses = replica_losses(results)
    loss_diff = max(abs(a - b) for a, b in zip(losses, reference.losses))
    worst, held = (-1, "", 0.0), set()
    for r in results:
        for name, tensor in r["state"].items():
            held.add(name)
            expected = shard_of(name, reference.state_dict[name], cfg, grid.tp, r["coords"]["tp"])
            if expected.shape != tensor.shape:
                raise ValueError(f"rank {r['rank']}: {name} has shape {tuple(tensor.shape)}, "
                                 f"expected its shard {tuple(expected.shape)}")
            diff = (tensor.double() - expected.double()).abs().max().item()
            if diff > worst[2] or worst[0] < 0:
                worst = (r["rank"], name, diff)
    missing = sorted(set(reference.state_dict) - held)
    if missing:
        raise ValueError(f"no rank holds {', '.join(missing[:3])}")
    return {"losses": losses, "reference_losses": reference.losses, "loss_diff": loss_diff, "worst_param": worst}


def measured_bytes_per_axis(results: Sequence[dict], step: int = -1) -> dict[str, int]:
    """Payload bytes one rank sent along each axis in one step (the most any rank sent)."""
    return {axis: max(r["bytes"][step][axis] for r in results) for axis in ("dp", "pp", "tp")}


def train(dp: int = 2, pp: int = 2, tp: int = 2, steps: int = 3, batch_size: int = 8, microbatches: int = 2,
          n_layer: int = 4, d_model: int = 64, n_head: int = 4, vocab_size: int = 256, seq_len: int = 32,
          lr: float = 0.1, seed: int = 0, zero: int = 0, log_every: int = 0, peak: float | str = "measured") -> dict:
    """The torchrun entry point: train on a ``dp × pp × tp`` grid (``zero=1``: ZeRO-1 over DP).

    ``log_every=k`` (torchrun's default is 1): rank 0 prints every k-th step (the mean of the replicas'
    losses, summed to it each step; tokens/s; MFU against ``peak``), then a summary that says, from the
    comm log, how many bytes per step each axis sent and whether its groups crossed a node boundary
    (a node: torchrun's ``GROUP_RANK``, the ranks one agent started). Returns this rank's ``rank``,
    ``coords``, ``node``, ``losses`` and ``bytes`` (per step and axis).
    """
    cfg = GPTConfig(vocab_size=int(vocab_size), seq_len=int(seq_len), n_layer=int(n_layer), n_head=int(n_head),
                    d_model=int(d_model), tied_embeddings=False)
    grid, world = Grid(int(dp), int(pp), int(tp)), dist.get_world_size()
    check_3d_setup(cfg, grid, int(microbatches), int(batch_size), world, zero=int(zero))
    report = step_report(f"3d dp{grid.dp}·pp{grid.pp}·tp{grid.tp}", cfg, int(steps), int(batch_size) * cfg.seq_len,
                         log_every, peak)
    dev = device()

    def on_step(step, loss, seconds):
        # the replicas' last-stage ranks (TP index 0) hold the losses: their mean, summed to every rank
        mine = loss is not None and grid.coords(dist.get_rank())["tp"] == 0
        total = torch.tensor([loss if mine else 0.0, float(mine)], dtype=torch.float64, device=dev)
        dist.all_reduce(total)
        report.step(step, (total[0] / total[1]).item(), seconds)

    out = parallel3d_worker(cfg, grid.dp, grid.pp, grid.tp, m=int(microbatches), batch_size=int(batch_size),
                            steps=int(steps), lr=float(lr), seed=int(seed), zero=int(zero),
                            on_step=on_step if report else None, progress=report is None)
    node = int(os.environ.get("GROUP_RANK", 0))  # torchrun's node index; one node under distlab.launch
    result = {"rank": out["rank"], "coords": out["coords"], "node": node, "losses": out["losses"],
              "bytes": out["bytes"]}
    if report:
        nodes = [None] * world
        dist.all_gather_object(nodes, node)
        summary = report.finish()
        if dist.get_rank() == 0:
            for axis in ("tp", "pp", "dp"):
                crossing = any(len({nodes[r] for r in group}) > 1 for group in grid.groups(axis))
                print(f"  {axis}: {out['bytes'][-1][axis]:,} bytes sent by rank 0 per step, groups "
                      f"{'cross a node boundary' if crossing else 'inside one node'}", flush=True)
        result["mfu"] = summary["mfu"]
    return result
