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

from distlab.flops import PEAK_FLOPS, mfu
from distlab.grading import quiz
from distlab.grading.contract import CheckFailed, describe_error, first_line
from distlab.grading.harness import (
    ATOL,
    LONG_JOB_TIMEOUT,
    Edge,
    case_drawn,
    lab_seed,
    raise_if_untouched,
    run_on_ranks,
)
from distlab.grading.registry import Exercise
from distlab.memory import PRESETS
from distlab.model import GPT, GPTConfig, training_flops_per_token
from distlab.parallel3d.grid import Grid, compare_with_reference, parallel3d_worker, reference_run
from distlab.parallel3d.planner import (
    Layout,
    ModelShape,
    bytes_per_axis,
    dp_messages,
    gradient_all_reduce_seconds,
    h100_cluster,
    run_cost,
)
from distlab.pipeline_parallel import bubble_fraction
from distlab.tensor_parallel import shard_of

__all__ = ["EXERCISES", "QUIZ", "check_grid_groups", "check_sync_gradients", "check_mfu", "check_predicted_bytes",
           "COLLECTIVE_TIMEOUT"]



def _seed() -> int:
    """This lab's seed for its hidden cases, read as each check runs (:func:`~distlab.grading.harness.lab_seed`)."""
    return lab_seed(11)


COLLECTIVE_TIMEOUT = 30.0  # seconds: 8 ranks on 2 busy cores are slow; a deadlock still ends


# ---------------------------------------------------------------- 11.1

def check_grid_groups(grid_groups) -> str:
    """11.1: ``grid_groups(world, dp, pp, tp)`` → ``{"dp": [[ranks]…], "pp": …, "tp": …}``."""
    raise_if_untouched(grid_groups)
    rng = random.Random(_seed() + 1)
    shapes = [(2, 2, 2), (3, 1, 4)] + [(rng.choice([1, 2, 3, 4]), rng.choice([1, 2, 4]), rng.choice([1, 2, 4, 8]))
                                       for _ in range(4)]  # 2 x 2 x 2, where axes are easily swapped; an odd DP, PP 1
    for dp, pp, tp in shapes:
        case_drawn("11.1", dp=dp, pp=pp, tp=tp)
        grid = Grid(dp, pp, tp)
        where = f"dp={dp}, pp={pp}, tp={tp}"
        try:
            got = grid_groups(grid.world, dp, pp, tp)
        except ValueError as error:
            raise CheckFailed(f"{where}: grid_groups({grid.world}, {dp}, {pp}, {tp}) raised ValueError "
                              f"({first_line(error)[:80]}), but {grid.world} ranks are {dp} × {pp} × {tp}: check the "
                              f"condition before your raise (raise only when world != dp·pp·tp)") from None
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
                    inner = {"tp": "TP is the innermost axis: take consecutive ranks",
                             "pp": "PP ranks are tp apart: take every tp-th rank (stride tp)",
                             "dp": "DP ranks are pp·tp apart: take every (pp·tp)-th rank (stride pp·tp)"}[axis]
                    raise CheckFailed(f"{where}: rank {rank}'s {axis} group is {theirs}, expected {want}: {inner}")
            raise CheckFailed(f"{where}: the {axis} groups {mine} repeat or miss ranks; expected {expected}")
    bad = (2, 2, 2)
    try:
        grid_groups(6, *bad)
    except ValueError:
        pass
    except Exception as error:  # noqa: BLE001  any other error is the mistake this case names
        raise CheckFailed(f"grid_groups(6, 2, 2, 2) raised {describe_error(error)}; a world of 6 ranks is not "
                          f"2 × 2 × 2 = 8: compare world with dp·pp·tp first and raise ValueError naming the "
                          f"sizes") from None
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
    rng = random.Random(_seed() + 2)
    n_head = rng.choice([2, 4])
    cfg = GPTConfig(vocab_size=rng.choice([32, 64]), seq_len=rng.choice([8, 16]), n_layer=2, n_head=n_head,
                    d_model=n_head * rng.choice([4, 8]), tied_embeddings=False)
    grid, batch, seed = Grid(2, 2, 2), 8, rng.randrange(10_000)
    case_drawn("11.2", dp=grid.dp, pp=grid.pp, tp=grid.tp)
    results = _launch_3d(cfg, grid, batch, seed, sync_gradients)
    compared = compare_with_reference(results, cfg, grid, batch, steps=1, seed=seed, data_seed=seed)
    rank, name, diff = compared["worst_param"]
    if diff > ATOL:
        _raise_if_replicas_disagree(results, grid)
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
        elif math.isclose(factor, grid.dp / grid.world, rel_tol=0.05):
            hint = (f": the update is {grid.world // grid.dp}x too small — divided by the world size "
                    f"({grid.world}) instead of the DP group's ({grid.dp})")
        elif math.isclose(factor, grid.dp * grid.dp, rel_tol=0.05):
            hint = (f": the update is {grid.dp * grid.dp}x too big — summed over the DP group and multiplied by dp "
                    f"instead of divided (flat /= dp)")
        elif math.isclose(factor, 1 / grid.dp, rel_tol=0.05):
            hint = (f": the update is {grid.dp}x too small — divided by dp twice, or by more ranks than the DP "
                    f"group's {grid.dp}?")
        where = ", ".join(f"{axis} {coords[axis]}" for axis in grid.axes)
        raise CheckFailed(f"rank {rank} ({where}), parameter {name} differs from the single-process run by "
                          f"{diff:.1e} (update factor {factor:.2f}){hint}")
    return (f"DP × PP × TP = 2 × 2 × 2 on 8 ranks: loss within {compared['loss_diff']:.0e}, every rank's shards "
            f"within {diff:.0e} of one process")


def _raise_if_replicas_disagree(results: list[dict], grid: Grid) -> None:
    """The ranks of one DP group hold the same shard of the same stage: after a step they must agree exactly.
    If they do not, the gradients were not averaged over the DP group (each replica stepped on its own)."""
    by_rank = {r["rank"]: r for r in results}
    for group in grid.groups("dp"):
        first = by_rank[group[0]]["state"]
        for other in group[1:]:
            for name, value in first.items():
                apart = (by_rank[other]["state"][name] - value).abs().max().item()
                if apart > ATOL:
                    raise CheckFailed(f"ranks {group[0]} and {other} (one DP group) end the step with different "
                                      f"{name} ({apart:.1e} apart): the gradients were not averaged over the DP "
                                      f"group, so each replica stepped on its own half of the batch")


# ---------------------------------------------------------------- 11.3

def check_mfu(model_flops_utilization) -> str:
    """11.3: ``model_flops_utilization(matmul_params, n_layer, d_model, seq_len, tokens_per_second, gpus, peak)``."""
    raise_if_untouched(model_flops_utilization)
    rng = random.Random(_seed() + 3)
    cases = [(PRESETS[name], rng.uniform(0.15, 0.6), rng.choice([8, 64, 1024])) for name in ("7B", "70B", "405B")]
    for preset, target, gpus in cases:
        case_drawn("11.3", preset=preset.name, gpus=gpus)
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
        case = f"{preset.name} at {tokens_per_second:,.0f} tokens/s on {gpus} GPUs: MFU {got:.4g}, expected {want:.4g}"
        raise CheckFailed(f"{case} (ratio {ratio:.3g}): {_mfu_mistake(ratio, n, preset, gpus)}")
    return f"{len(cases)} runs (7B, 70B, 405B shapes): 6·N + attention FLOPs per token, over gpus × peak"


def _mfu_mistake(ratio: float, n: int, preset, gpus: int) -> str:
    """Name the slip whose answer is ``ratio`` times the right one (each gives a distinct ratio on these shapes)."""
    attention = 12 * preset.n_layer * preset.d_model * preset.seq_len
    total = 6 * n + attention
    slips = [
        ((2 * n + attention) / total, "2·N for the weights: training counts 6·N per token (2·N forward, 4·N "
                                      "backward), like the attention term's 12 = 3 × 4"),
        (1 / 3, "forward FLOPs only (2·N + 4·n_layer·d_model·seq_len): training also runs backward, twice the "
                "forward — 6·N + 12·n_layer·d_model·seq_len"),
        (6 * n / total, "the attention FLOPs (12·n_layer·d_model·seq_len per token) are missing"),
        ((6 * n + attention / 2) / total, "half the attention FLOPs: count 12·n_layer·d_model·seq_len (QKᵀ and "
                                          "A·V, forward and backward), as distlab.model.training_flops_per_token"),
        ((6 * n + 2 * attention) / total, "twice the attention FLOPs: 12·n_layer·d_model·seq_len already counts "
                                          "QKᵀ and A·V, forward and backward"),
        (gpus, "the peak is per GPU: divide by gpus × peak"),
        (1 / gpus, "divided by the GPUs twice? tokens_per_second is the whole cluster's: divide once by "
                   "gpus × peak"),
        (100, "a percentage: return the fraction (0.4, not 40)"),
    ]
    for value, why in slips:
        if math.isclose(ratio, value, rel_tol=2e-3):
            return why
    return "MFU = (6·N + 12·n_layer·d_model·seq_len) × tokens/s / (gpus × peak); compare your terms with it"


# ---------------------------------------------------------------- 11.4

def check_predicted_bytes(predicted_bytes) -> str:
    """11.4: ``predicted_bytes(cfg, dp, pp, tp, m, micro_batch)`` → ``{"tp": bytes, "pp": bytes}`` per step."""
    raise_if_untouched(predicted_bytes)
    rng = random.Random(_seed() + 4)
    cases = [(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, tied_embeddings=False),
              2, 2, 2, 2, 2)]
    for k in range(6):
        pp, tp = rng.choice([1, 2, 4]), rng.choice([1, 2, 4])
        pp, tp = (1, tp) if k == 0 else (pp, 1) if k == 1 else (pp, tp)  # no pipeline bytes; no TP bytes
        n_head = tp * rng.choice([1, 2])
        cfg = GPTConfig(vocab_size=tp * rng.choice([16, 32]), seq_len=rng.choice([8, 16, 32]),
                        n_layer=pp * rng.choice([1, 2]), n_head=n_head, d_model=n_head * rng.choice([4, 8]),
                        tied_embeddings=False)
        cases.append((cfg, rng.choice([1, 2]), pp, tp, rng.choice([1, 2, 4]), rng.choice([1, 2])))
    for cfg, dp, pp, tp, m, mb in cases:
        case_drawn("11.4", dp=dp, pp=pp, tp=tp, m=m)
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
            hints = [(m * 3 * mb * cfg.seq_len * 4, "the loss's three all-reduces of one fp32 value per token"),
                     (m * activation, "one activation-sized all-reduce per micro-batch (the output layer's f in "
                                      "backward, or the embedding's forward when PP = 1)"),
                     (m * activation * (cfg.n_layer // pp), "one all-reduce per block (four: two forward, two "
                                                            "backward)"),
                     (-m * activation, "the busiest rank is the last stage: the embedding's all-reduce is on "
                                       "stage 0")]
            if axis == "pp":
                hints = [(m * activation, "with PP > 2 a middle stage sends both ways: activations forward, "
                                          "gradients back"),
                         (-m * activation, "with PP = 2 each rank sends one way only (the ends send nothing "
                                           "past the model's first or last stage)")]
            hint = ", or ".join(text for value, text in hints if value == diff)  # one block per stage: two match
            raise CheckFailed(f"{where}: {axis.upper()} {got[axis]:,} bytes, expected {want[axis]:,.0f}: "
                              + (f"check this term, missing or extra: {hint}" if hint
                                 else _bytes_advice(axis, want[axis], got[axis])))
    return f"{len(cases)} layouts: TP and PP bytes of the busiest rank, as distlab's comm log counts them"


def _bytes_advice(axis: str, want: float, got: float) -> str:
    """Where to look when a predicted axis matches no single missing or extra term: a size of 1 that must move
    nothing, nothing counted, or the terms and their sizes (what the student's function adds up)."""
    size = "tp" if axis == "tp" else "pp"
    if want == 0:
        return f"with {size} = 1 no rank sends on this axis: count its bytes only when {size} > 1"
    if got == 0:
        return f"with {size} > 1 this axis carries bytes every micro-batch: count them"
    if axis == "tp":
        return ("check each term and its size: per micro-batch four activation all-reduces per block of the "
                "stage (n_layer // pp blocks), one for the output layer's f (and with PP = 1 one for the embedding), "
                "and the loss's three of one fp32 value per token, all times m; an activation is "
                "micro_batch × seq_len × d_model × 4 bytes")
    return ("check each term and its size: per micro-batch the busiest rank sends one activation (micro_batch × "
            "seq_len × d_model × 4 bytes) forward and one gradient back (with PP = 2 each rank sends one way "
            "only), times m")


# ---------------------------------------------------------------- quiz

def _q_all_reduce_ms(preset: str, gpus: int, bandwidth: float = 450e9) -> float:
    return gradient_all_reduce_seconds(preset, gpus, bandwidth) * 1e3


def _q_days(trillions: float, gpus: int, mfu: float = 0.4, flops_per_token: float | None = None) -> float:
    """Days of the 405B preset's run (``run_cost``'s 6N + attention FLOPs per token unless ``flops_per_token``)."""
    days = run_cost("405B", trillions * 1e12, h100_cluster(gpus), mfu, 2048 * 8192)["days"]
    if flops_per_token is None:
        return days
    return days * flops_per_token / ModelShape.from_preset("405B").flops_per_token


QUIZ = [
    quiz.number("Q11.1", "pipeline bubble fraction for PP = {pp} and m = {m} micro-batches (1F1B)", rel_tol=0.01,
                given=dict(pp=8, m=32), vary=dict(pp=(4, 16), m=(8, 16, 64)),
                solve=lambda pp, m: bubble_fraction(pp, m),
                wrong={"(p - 1)/m: the idle time over the ideal time, not over the step": lambda pp, m: (pp - 1) / m,
                       "the busy fraction m/(m + p - 1)": lambda pp, m: 1 - bubble_fraction(pp, m)},
                hint="'MFU at 18%: the top five suspects', suspect 1, and lab 06's bubble section"),
    quiz.number("Q11.2", "milliseconds for one all-reduce of the {preset} model's bf16 gradients on {gpus} GPUs at "
                "450 GB/s", rel_tol=0.02, given=dict(preset="70B", gpus=8),
                # no 64 GPUs: there the seeds' slip, 2·M/β, is 1.6% above the answer, as close as rounding the
                # preset's 68.98B parameters to 70B
                vary=dict(preset=("7B", "405B"), gpus=(2, 4, 16)), solve=_q_all_reduce_ms,
                wrong={"2·M/β without (N - 1)/N (the seeds' slip)":
                       lambda preset, gpus: _q_all_reduce_ms(preset, gpus) * gpus / (gpus - 1),
                       "fp32 gradients": lambda preset, gpus: 2 * _q_all_reduce_ms(preset, gpus),
                       "NVLink's 900 GB/s both ways": lambda preset, gpus: _q_all_reduce_ms(preset, gpus, 900e9)},
                hint="'The seeds' arithmetic, computed', and lab 02's ring all-reduce: what each GPU sends"),
    quiz.number("Q11.3", "days to train 405B on {trillions}T tokens on {gpus:,} H100s (989 TFLOP/s bf16) at 40% MFU",
                given=dict(trillions=15.6, gpus=16384),
                vary=dict(trillions=(2, 5, 10, 30), gpus=(2048, 4096, 8192, 32768)), solve=_q_days, rel_tol=0.03,
                wrong={"6N alone, every parameter, no attention FLOPs": lambda trillions, gpus: _q_days(
                           trillions, gpus, flops_per_token=6 * PRESETS["405B"].n_params),
                       "at 100% MFU": lambda trillions, gpus: _q_days(trillions, gpus, mfu=1.0)},
                hint="'The seeds' arithmetic, computed', and 'MFU: what the model's math gets of the machine'"),
    # 430: the top of Llama 3 405B's reported 380–430 TFLOP/s per GPU (Dubey et al. 2024, Table 4)
    quiz.number("Q11.4", "MFU of Llama 3 405B at {tflops} TFLOP/s per H100 (989 TFLOP/s peak)", rel_tol=0.02,
                given=dict(tflops=430), vary=dict(tflops=(300, 350, 380, 400, 500)),
                solve=lambda tflops: tflops * 1e12 / h100_cluster(1).peak_flops,
                wrong={"against the FP8 peak": lambda tflops: tflops * 1e12 / PEAK_FLOPS["H100 SXM fp8"]},
                hint="'MFU: what the model's math gets of the machine'"),
    quiz.choice("Q11.5", "why tensor parallelism stays inside a node", answer="b", options="abcd",
                hint="'Which axis goes where': the TP seconds on NVLink and on InfiniBand"),
    quiz.choice("Q11.6", "MFU is 18%: which is not one of the top suspects", answer="d", options="abcde",
                hint="'MFU at 18%: the top five suspects': each suspect is a term of the step time"),
    quiz.number("Q11.7", "pipelines (process groups along PP) in Llama 3's TP {grid.tp} × PP {grid.pp} × DP {grid.dp} "
                "on {grid.world:,} GPUs", rel_tol=0, given=dict(grid=Grid(dp=128, pp=16, tp=8)),
                # Llama 3's model split (TP 8 × PP 16) at other data-parallel widths: DP 64 is its 8,192-GPU stage
                vary=dict(grid=tuple(Grid(dp=dp, pp=16, tp=8) for dp in (16, 32, 64, 256))),
                solve=lambda grid: len(grid.groups("pp")),
                wrong={"the pipeline's length, PP": lambda grid: grid.pp, "the DP degree": lambda grid: grid.dp,
                       "the TP groups, DP x PP": lambda grid: grid.dp * grid.pp},
                hint="'A grid of process groups': which ranks a PP group holds"),
    quiz.number("Q11.8", "gradient reduce-scatters per step of ZeRO-2 under PP 16 with m = {m} micro-batches "
                         "(gradients not kept over the micro-batches)", rel_tol=0,
                given=dict(m=16), vary=dict(m=(4, 8, 24, 32, 64)),
                solve=lambda m: dp_messages(Layout(dp=128, tp=8, pp=16, zero=2, m=m))[0],
                wrong={"one per step, as ZeRO-1": lambda m: 1},
                hint="'The planner, term by term': ZeRO under a pipeline"),
]

# The boundaries each exercise's text names (harness.Edge; tests/grading/test_reference_seeds.py checks every seed's
# cases hold each): 11.1's 2 x 2 x 2 grid (axes easily swapped), an axis of size 1 and an odd DP; 11.2 on 2 x 2 x 2;
# 11.3 on every preset; 11.4 without a pipeline (PP 1) and without TP (TP 1), and with several micro-batches.
EDGES = {
    "11.1": [Edge("2 x 2 x 2", lambda c: (c["dp"], c["pp"], c["tp"]) == (2, 2, 2)),
             Edge("an axis of size 1", lambda c: 1 in (c["dp"], c["pp"], c["tp"])),
             Edge("an odd DP", lambda c: c["dp"] % 2 == 1 and c["dp"] > 1)],
    "11.2": [Edge("DP groups of 2 in a 2 x 2 x 2 grid", lambda c: (c["dp"], c["pp"], c["tp"]) == (2, 2, 2))],
    "11.3": [Edge(f"the {name} preset", lambda c, name=name: c["preset"] == name) for name in ("7B", "70B", "405B")],
    "11.4": [Edge("PP 1: no pipeline bytes", lambda c: c["pp"] == 1), Edge("TP 1: no TP bytes", lambda c: c["tp"] == 1),
             Edge("several micro-batches", lambda c: c["m"] > 1)],
}

EXERCISES = [
    Exercise("11.1", "the process-group grid: every group of every axis", 3, check_grid_groups,
             references=("distlab.parallel3d.grid.process_groups",)),
    Exercise("11.2", "data parallelism across pipelines of tensor-parallel stages", 3, check_sync_gradients,
             references=("distlab.parallel3d.grid.average_gradients",)),
    Exercise("11.3", "MFU with the 6·N rule and attention FLOPs", 2, check_mfu,
             references=("distlab.flops.mfu",)),
    Exercise("11.4", "the bytes each axis sends, predicted", 3, check_predicted_bytes),
    *QUIZ,
]

# Mutants of the solutions (distlab notebooks mutants) that compute the same thing, and why.
EQUIVALENT_MUTANTS = {
    '11.1 arguments-swapped: `grid.permute(0, 2, 1)` → `grid.permute(2, 0, 1)`':
        "the same PP groups listed in another order (rows by tp then dp): each group holds the same ranks, and any "
        "fixed order works, since every rank builds its groups from the same list",
    '11.1 arguments-swapped: `grid.permute(1, 2, 0)` → `grid.permute(2, 1, 0)`':
        "the same DP groups listed in another order (rows by tp then pp): each group holds the same ranks, and any "
        "fixed order works, since every rank builds its groups from the same list",
    '11.2 off-by-one: `1` → `0`':
        "the shortcut for dp = 1 only saves work: an all-reduce over a group of one rank and a division by 1 leave "
        "the gradients as they are",
    '11.2 statements-swapped: `dist.all_reduce(flat, group=dp_group) flat /= dp` → '
    '`flat /= dp dist.all_reduce(flat, group=dp_group)`':
        "dividing by dp before or after the sum gives the same mean (the all-reduce is linear)",
    '11.2 statements-swapped: `flat /= dp offset = 0` → `offset = 0 flat /= dp`':
        "two statements that do not read each other's names, in the other order",
    '11.2 statements-swapped: `if dp == 1: return flat = torch.cat([p.grad.reshape(-1) for p in para…` → '
    '`flat = torch.cat([p.grad.reshape(-1) for p in params]) if dp == 1: re…`':
        "the flat copy is built before the dp = 1 shortcut instead of after: wasted work, the same gradients",
    '11.4 statements-swapped: `activation = micro_batch * cfg.seq_len * cfg.d_model * 4 # fp32 [b, s…` → '
    '`out = {"tp": 0, "pp": 0} # fp32 [b, s, h] activation = micro_batch * …`':
        "two statements that do not read each other's names, in the other order",
    '11.4 statements-swapped: `per_micro += 3 * micro_batch * cfg.seq_len * 4 # the loss: max, sum o…` → '
    '`if pp == 1: per_micro += activation # the loss: max, sum of exponenti…`':
        "two additions to the same sum in the other order",
    "11.4 statements-swapped: `per_micro += activation # the output layer's f: an all-reduce in back…` → "
    "`per_micro += 3 * micro_batch * cfg.seq_len * 4 # the output layer's f…`":
        "two additions to the same sum in the other order",
}
