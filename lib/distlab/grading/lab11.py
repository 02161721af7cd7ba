"""Lab 11 — 3D parallelism. Checkers for the grid, the data-parallel axis of a 3D run, and MFU.

* 11.1 ``grid_groups(world, dp, pp, tp)``: every group of every axis, compared group by group and
  rank by rank with :meth:`distlab.parallel3d.grid.Grid.groups` on hidden grids; a world size that is not
  ``dp·pp·tp`` must raise ``ValueError``.
* 11.2 ``sync_gradients(params, dp_group, dp)``: plugged into :func:`distlab.parallel3d.grid.parallel3d_worker`
  on 8 real ranks (DP × PP × TP = 2 × 2 × 2, a hidden model and seed), every rank's shards
  compared with a single-process run; a wrong update is reported with its factor.
* 11.3 ``model_flops_utilization(...)``: hidden shapes against :func:`distlab.model.training_flops_per_token`
  and :func:`distlab.flops.mfu`, with the usual slips named (no attention term, forward only,
  one GPU's peak for the whole cluster).
* 11.4 ``predicted_bytes(cfg, dp, pp, tp, m, micro_batch)``: the TP and PP bytes the busiest rank of
  a 3D run sends per step, against :func:`distlab.parallel3d.planner.bytes_per_axis` (which equals the comm
  log of real runs, tests/test_mesh.py) on hidden shapes; a missing piece is named.
"""

from __future__ import annotations

import math
import random

from distlab.flops import mfu
from distlab.grading import CheckFailed, quiz
from distlab.grading.harness import ATOL, LONG_JOB_TIMEOUT, lab_seed, raise_if_untouched, run_on_ranks
from distlab.grading.registry import Exercise
from distlab.memory import PRESETS
from distlab.model import GPT, GPTConfig, training_flops_per_token
from distlab.parallel3d.grid import Grid, compare_with_reference, parallel3d_worker, reference_run
from distlab.parallel3d.planner import (
    Layout,
    ModelShape,
    bytes_per_axis,
    gradient_all_reduce_seconds,
    h100_cluster,
    run_cost,
)
from distlab.pipeline_parallel import bubble_fraction
from distlab.tensor_parallel import shard_of

__all__ = ["EXERCISES", "QUIZ", "check_grid_groups", "check_sync_gradients", "check_mfu", "check_predicted_bytes",
           "COLLECTIVE_TIMEOUT"]

_SEED = lab_seed(11)
COLLECTIVE_TIMEOUT = 30.0  # seconds: 8 ranks on 2 busy cores are slow; a deadlock still ends


# ---------------------------------------------------------------- 11.1

def check_grid_groups(grid_groups) -> str:
    """11.1: ``grid_groups(world, dp, pp, tp)`` → ``{"dp": [[ranks]…], "pp": …, "tp": …}``."""
    raise_if_untouched(grid_groups)
    rng = random.Random(_SEED + 1)
    shapes = [(2, 2, 2)] + [(rng.choice([1, 2, 3, 4]), rng.choice([1, 2, 4]), rng.choice([1, 2, 4, 8]))
                            for _ in range(5)]
    for dp, pp, tp in shapes:
        grid = Grid(dp, pp, tp)
        got = grid_groups(grid.world, dp, pp, tp)
        where = f"dp={dp}, pp={pp}, tp={tp}"
        if not isinstance(got, dict) or set(got) != {"dp", "pp", "tp"}:
            raise CheckFailed(f"{where}: return a dict with keys 'dp', 'pp', 'tp', got {type(got).__name__} "
                              f"{sorted(got) if isinstance(got, dict) else ''}")
        for axis in ("dp", "pp", "tp"):
            expected = grid.groups(axis)
            mine = [sorted(int(r) for r in group) for group in got[axis]]
            if sorted(mine) == expected:
                continue
            for rank in range(grid.world):
                theirs = next((g for g in mine if rank in g), None)
                want = grid.group_of(rank, axis)
                if theirs != want:
                    inner = {"tp": "TP is the innermost axis: consecutive ranks",
                             "pp": "PP ranks are tp apart (stride tp)",
                             "dp": "DP ranks are pp·tp apart (stride pp·tp)"}[axis]
                    raise CheckFailed(f"{where}: rank {rank}'s {axis} group is {theirs}, expected {want} ({inner})")
            raise CheckFailed(f"{where}: the {axis} groups {mine} repeat or miss ranks; expected {expected}")
    bad = (2, 2, 2)
    try:
        grid_groups(6, *bad)
    except ValueError:
        pass
    else:
        raise CheckFailed("grid_groups(6, 2, 2, 2) returned; a world of 6 ranks is not 2 × 2 × 2 = 8: raise "
                          "ValueError before building anything")
    return f"{len(shapes)} grids, every rank's dp/pp/tp group as picotron lays them out; a bad world size raises"


# ---------------------------------------------------------------- 11.2

def _launch_3d(cfg: GPTConfig, grid: Grid, batch: int, seed: int, grad_sync) -> list[dict]:
    """On the 8 warm ranks the notebook's cells start (backend ``"auto"``, :data:`COLLECTIVE_TIMEOUT`)."""
    run = run_on_ranks(parallel3d_worker, grid.world, cfg, grid.dp, grid.pp, grid.tp,
                       kwargs=dict(m=2, batch_size=batch, steps=1, seed=seed, data_seed=seed, grad_sync=grad_sync),
                       what="your sync_gradients", backend="auto", collective_timeout=COLLECTIVE_TIMEOUT,
                       timeout=LONG_JOB_TIMEOUT,
                       advice="Reduce over the DP group only (group=dp_group): ranks of other axes hold other tensors.")
    return list(run)


def check_sync_gradients(sync_gradients) -> str:
    """11.2: ``sync_gradients(params, dp_group, dp)`` averages gradients over the DP axis of a 2 × 2 × 2 run."""
    raise_if_untouched(sync_gradients)
    rng = random.Random(_SEED + 2)
    n_head = rng.choice([2, 4])
    cfg = GPTConfig(vocab_size=rng.choice([32, 64]), seq_len=rng.choice([8, 16]), n_layer=2, n_head=n_head,
                    d_model=n_head * rng.choice([4, 8]), tied_embeddings=False)
    grid, batch, seed = Grid(2, 2, 2), 8, rng.randrange(10_000)
    results = _launch_3d(cfg, grid, batch, seed, sync_gradients)
    compared = compare_with_reference(results, cfg, grid, batch, steps=1, seed=seed, data_seed=seed)
    rank, name, diff = compared["worst_param"]
    if diff > ATOL:
        initial = GPT(cfg, seed=seed).state_dict()[name]
        reference = reference_run(cfg, batch, 1, seed=seed, data_seed=seed).state_dict[name]
        result = next(r for r in results if r["rank"] == rank)
        coords = result["coords"]
        start = shard_of(name, initial, cfg, grid.tp, coords["tp"])
        want = shard_of(name, reference, cfg, grid.tp, coords["tp"]) - start
        got = result["state"][name] - start
        factor = (got * want).sum().item() / max((want * want).sum().item(), 1e-30)
        hint = ""
        if math.isclose(factor, grid.dp, rel_tol=0.05):
            hint = f": the update is {grid.dp}x too big — summed over the DP group, not averaged (divide by dp)"
        elif math.isclose(factor, 1 / grid.dp, rel_tol=0.05):
            hint = f": the update is {grid.dp}x too small — divided twice?"
        elif math.isclose(factor, 2 * grid.dp / grid.world, rel_tol=0.05) or math.isclose(factor, 0.5, rel_tol=0.05):
            hint = ": divided by the world size instead of dp?"
        where = ", ".join(f"{axis} {coords[axis]}" for axis in grid.axes)
        raise CheckFailed(f"rank {rank} ({where}), parameter {name} differs from the single-process run by "
                          f"{diff:.1e} (update factor {factor:.2f}){hint}")
    return (f"DP × PP × TP = 2 × 2 × 2 on 8 ranks: loss within {compared['loss_diff']:.0e}, every rank's shards "
            f"within {diff:.0e} of one process")


# ---------------------------------------------------------------- 11.3

def check_mfu(model_flops_utilization) -> str:
    """11.3: ``model_flops_utilization(matmul_params, n_layer, d_model, seq_len, tokens_per_second, gpus, peak)``."""
    raise_if_untouched(model_flops_utilization)
    rng = random.Random(_SEED + 3)
    cases = [(PRESETS[name], rng.uniform(0.15, 0.6), rng.choice([8, 64, 1024])) for name in ("7B", "70B", "405B")]
    for preset, target, gpus in cases:
        n = preset.n_params - preset.vocab_size * preset.d_model
        peak = rng.choice([989e12, 312e12])
        flops = training_flops_per_token(n, preset.n_layer, preset.d_model, preset.seq_len)
        tokens_per_second = round(target * gpus * peak / flops)
        want = mfu(flops, tokens_per_second / gpus, peak)
        got = model_flops_utilization(n, preset.n_layer, preset.d_model, preset.seq_len, tokens_per_second, gpus, peak)
        if isinstance(got, bool) or not isinstance(got, (int, float)) or not math.isfinite(got):
            raise CheckFailed(f"return the MFU as a float, got {got!r}")
        if math.isclose(got, want, rel_tol=1e-6):
            continue
        ratio = got / want
        attention = 12 * preset.n_layer * preset.d_model * preset.seq_len
        case = f"{preset.name} at {tokens_per_second:,.0f} tokens/s on {gpus} GPUs: MFU {got:.4g}, expected {want:.4g}"
        if math.isclose(ratio, 6 * n / (6 * n + attention), rel_tol=1e-3):
            raise CheckFailed(f"{case}: the attention FLOPs (12·n_layer·d_model·seq_len per token) are missing")
        if math.isclose(ratio, 1 / 3, rel_tol=0.02):
            raise CheckFailed(f"{case}: forward FLOPs only — training also runs backward, twice the forward")
        if math.isclose(ratio, gpus, rel_tol=1e-3):
            raise CheckFailed(f"{case}: the peak is per GPU: divide by gpus × peak")
        raise CheckFailed(f"{case} (ratio {ratio:.3g})")
    return f"{len(cases)} runs (7B, 70B, 405B shapes): 6·N + attention FLOPs per token, over gpus × peak"


# ---------------------------------------------------------------- 11.4

def check_predicted_bytes(predicted_bytes) -> str:
    """11.4: ``predicted_bytes(cfg, dp, pp, tp, m, micro_batch)`` → ``{"tp": bytes, "pp": bytes}`` per step."""
    raise_if_untouched(predicted_bytes)
    rng = random.Random(_SEED + 4)
    cases = [(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, tied_embeddings=False),
              2, 2, 2, 2, 2)]
    for _ in range(6):
        pp, tp = rng.choice([1, 2, 4]), rng.choice([1, 2, 4])
        n_head = tp * rng.choice([1, 2])
        cfg = GPTConfig(vocab_size=tp * rng.choice([16, 32]), seq_len=rng.choice([8, 16, 32]),
                        n_layer=pp * rng.choice([1, 2]), n_head=n_head, d_model=n_head * rng.choice([4, 8]),
                        tied_embeddings=False)
        cases.append((cfg, rng.choice([1, 2]), pp, tp, rng.choice([1, 2, 4]), rng.choice([1, 2])))
    for cfg, dp, pp, tp, m, mb in cases:
        want = bytes_per_axis(ModelShape.from_config(cfg), Layout(dp=dp, tp=tp, pp=pp, zero=0, m=m, micro_batch=mb),
                              sequence_parallel=False, bytes_per_value=4)
        got = predicted_bytes(cfg, dp, pp, tp, m, mb)
        where = (f"DP {dp} × PP {pp} × TP {tp}, m={m} micro-batches of {mb}, n_layer={cfg.n_layer}, "
                 f"seq_len={cfg.seq_len}, d_model={cfg.d_model}")
        if not isinstance(got, dict) or not {"tp", "pp"} <= set(got):
            raise CheckFailed(f"{where}: return a dict with 'tp' and 'pp', got {got!r}")
        activation = mb * cfg.seq_len * cfg.d_model * 4
        for axis in ("tp", "pp"):
            if got[axis] == want[axis]:
                continue
            diff = want[axis] - got[axis]
            hints = {m * 3 * mb * cfg.seq_len * 4: "the loss's three all-reduces of one fp32 value per token",
                     m * activation: "one activation-sized all-reduce per micro-batch (the output layer's f in "
                                     "backward, or the embedding's forward when PP = 1)",
                     m * activation * (cfg.n_layer // pp): "one all-reduce per block",
                     -m * activation: "the busiest rank is the last stage: the embedding's all-reduce is on stage 0"}
            if axis == "pp":
                hints = {m * activation: "with PP > 2 a middle stage sends both ways: activations forward, "
                                         "gradients back",
                         -m * activation: "with PP = 2 each rank sends one way only (the ends send nothing "
                                          "past the model's first or last stage)"}
            hint = hints.get(diff, "")
            raise CheckFailed(f"{where}: {axis.upper()} {got[axis]:,} bytes, expected {want[axis]:,.0f}"
                              + (f" — missing or extra: {hint}" if hint else ""))
    return f"{len(cases)} layouts: TP and PP bytes of the busiest rank, as distlab's comm log counts them"


# ---------------------------------------------------------------- quiz

_405B_TFLOPS = 400e12  # Llama 3 405B's reported throughput per GPU (Dubey et al. 2024, Table 4)

QUIZ = [
    quiz.number("Q11.1", "pipeline bubble fraction for PP = 4 and m = 16 micro-batches (1F1B)",
                answer=bubble_fraction(4, 16), rel_tol=0.01,
                hint="'The planner, term by term': (p-1)/(m+p-1)"),
    quiz.number("Q11.2", "milliseconds for one all-reduce of a 7B model's bf16 gradients on 8 GPUs at 450 GB/s",
                answer=gradient_all_reduce_seconds("7B", 8, 450e9) * 1e3, rel_tol=0.03,
                hint="'The seeds' arithmetic, computed': 2(N-1)/N × 2 bytes × N_params / bandwidth"),
    quiz.number("Q11.3", "days to train 70B on 1.4T tokens on 1,024 H100s (989 TFLOP/s bf16) at 50% MFU",
                answer=run_cost("70B", 1.4e12, h100_cluster(1024), 0.5, 2048 * 4096)["days"], rel_tol=0.05,
                hint="'The seeds' arithmetic, computed': (6N + attention) × tokens / (GPUs × peak × MFU)"),
    quiz.number("Q11.4", "MFU of Llama 3 405B at its reported 400 TFLOP/s per H100 (989 TFLOP/s peak)",
                answer=_405B_TFLOPS / 989e12, rel_tol=0.02,
                hint="'MFU: what the model's math gets of the machine': achieved over peak"),
    quiz.choice("Q11.5", "why tensor parallelism stays inside a node", answer="b", options="abcd",
                hint="'Which axis goes where': the TP seconds on NVLink and on InfiniBand"),
    quiz.choice("Q11.6", "MFU is 18%: which is not one of the top suspects", answer="d", options="abcde",
                hint="'MFU at 18%: the top five suspects': which one does not change the time per step?"),
    quiz.number("Q11.7", "process groups along TP in Llama 3's TP 8 × PP 16 × DP 128 on 16,384 GPUs",
                answer=len(Grid(dp=128, pp=16, tp=8).groups("tp")), rel_tol=0,
                hint="'A grid of process groups': one TP group per (dp, pp) coordinate"),
]

EXERCISES = [
    Exercise("11.1", "the process-group grid: every group of every axis", 3, check_grid_groups),
    Exercise("11.2", "data parallelism across pipelines of tensor-parallel stages", 3, check_sync_gradients),
    Exercise("11.3", "MFU with the 6·N rule and attention FLOPs", 2, check_mfu),
    Exercise("11.4", "the bytes each axis sends, predicted", 3, check_predicted_bytes),
    *QUIZ,
]
