"""Lab 13 — the capstone. Checkers for the layout choice, the resumable loader, the restart wiring and the run card.

* 13.1 ``choose_layout(result)``: on hidden models, machines and batches, the planner's fastest *feasible* layout
  the capstone's worker runs (:func:`distlab.capstone.runnable_best`). A layout the planner rejects fails with the
  planner's own reasons; one it cannot run (ZeRO-2/3, interleaving, recomputation, CP) or a slower one is named;
  when nothing fits (one machine of every draw), a ``ValueError`` carrying the planner's reasons is expected.
* 13.2 ``next_batch(tokens, seq_len, batch_size, dp_rank, dp_size, state)``: every DP rank of hidden streams for
  steps that cross an epoch, against :class:`distlab.data.loader.ResumableTokenLoader`; then a "restart" from a
  copy of the state it returned mid-run must continue with the same windows — none repeated, none skipped.
* 13.3 ``resume(ckpt_dir, state)``: a real directory of lab 12's committed checkpoints (and a partial one a dead
  rank left) of a small model, its Adam state and a loader; the weights, the moments and the loader's position
  after ``resume`` must be those of the newest committed checkpoint, and the step returned the next one to run.
* 13.4 ``report_numbers(records, trace, flops_per_token, tokens_per_step, peak_flops)``: hidden runs' records and
  traces (built with :func:`distlab.runtime.trace.build` from spans whose times are drawn per case), against
  :func:`distlab.capstone.derive_report`, each usual slip named.
"""

from __future__ import annotations

import copy
import math
import random
import shutil
import statistics
import tempfile
from pathlib import Path

import numpy as np
import torch

from distlab.capstone.report import derive_report, runnable, runnable_best
from distlab.capstone.train import GridTrainState
from distlab.collectives import ring_all_gather_bytes
from distlab.data.loader import ResumableTokenLoader, window_order
from distlab.data.shards import SHARD_DTYPE
from distlab.fault_tolerance.checkpoint import CheckpointError, checkpoint_path, save_checkpoint
from distlab.grading import quiz
from distlab.grading.contract import CheckFailed, describe_error
from distlab.grading.harness import lab_seed, raise_if_untouched, run_isolated
from distlab.grading.registry import Exercise
from distlab.memory import bytes_per_param
from distlab.model import GPT, GPTConfig
from distlab.parallel3d.planner import Cluster, ModelShape, estimate, plan
from distlab.pipeline_parallel import bubble_fraction, trace_bubble
from distlab.runtime import trace as trace_format
from distlab.runtime.timeline import Span

__all__ = ["EXERCISES", "QUIZ", "check_choose_layout", "check_next_batch", "check_resume", "check_report_numbers"]


def _seed() -> int:
    """This lab's seed for its hidden cases, read as each check runs (:func:`~distlab.grading.harness.lab_seed`)."""
    return lab_seed(13)


# ---------------------------------------------------------------- 13.1

def _layout_cases(rng: random.Random):
    """Small models on CPU-like machines of 4 or 8 ranks whose memory makes some layouts infeasible, an H100 node,
    and one machine where nothing the worker runs fits."""
    cases = []
    for gpus, memory in ((4, rng.choice([6e6, 8e6, 10e6])), (8, rng.choice([4e6, 6e6])), (4, 1e6)):
        n_head = rng.choice([4, 8])
        cfg = GPTConfig(vocab_size=rng.choice([2048, 4096, 5184]), seq_len=64, n_layer=rng.choice([4, 8]),
                        n_head=n_head, d_model=n_head * rng.choice([8, 16]), tied_embeddings=False)
        cluster = Cluster(f"{gpus} CPU ranks", gpus, gpus_per_node=gpus, hbm_bytes=memory,
                          intra_node_bandwidth=rng.choice([0.5e9, 2e9]), inter_node_bandwidth=0.5e9,
                          peak_flops=rng.choice([10e9, 40e9]), intra_node_latency=rng.choice([2e-5, 1e-4]),
                          inter_node_latency=1e-4)
        cases.append((ModelShape.from_config(cfg), cluster, rng.choice([8, 16])))
    return cases


def _plans(rng: random.Random) -> list:
    """The cases' plans, drawn until one of them ranks first a layout the worker cannot run (ZeRO-2/3,
    interleaving, recomputation), so picking the planner's overall best never passes by chance, and one has nothing
    the worker runs that fits, so the ``ValueError`` branch is always checked."""
    for _ in range(20):
        plans = [(model, cluster, batch, plan(model, cluster, batch, precision="fp32", cp=(1,)))
                 for model, cluster, batch in _layout_cases(rng)]
        if (any(p.feasible and not runnable(p.feasible[0].layout) for *_, p in plans)
                and any(not any(runnable(e.layout) for e in p.feasible) for *_, p in plans)):
            return plans
    raise RuntimeError("no draw ranks an unrunnable layout first and leaves one machine with nothing that fits: "
                       "widen _layout_cases")


def _reasons_of(result) -> list[str]:
    """The reasons the planner gives for the nearest layouts the worker runs: what a ValueError should carry."""
    return [reason for e in result.near_misses if runnable(e.layout) for reason in e.reasons]


def check_choose_layout(choose_layout) -> str:
    """13.1: ``choose_layout(result)`` → the :class:`~distlab.parallel3d.planner.Layout` to run."""
    raise_if_untouched(choose_layout)
    rng = random.Random(_seed() + 1)
    checked = 0
    for model, cluster, batch, result in _plans(rng):
        where = f"{model.n_params:,} parameters on {cluster.name} of {cluster.hbm_bytes / 1e6:.0f} MB, batch {batch}"
        try:
            want = runnable_best(result)
        except ValueError:
            want = None
        try:
            got = choose_layout(result)
        except ValueError as error:
            if want is None:
                reasons = _reasons_of(result)
                if reasons and not any(reason in str(error) for reason in reasons):
                    raise CheckFailed(f"{where}: nothing the worker runs fits, and your ValueError says "
                                      f"{str(error)[:120]!r} without the planner's reasons: put the nearest runnable "
                                      f"misses' reasons (result.near_misses[i].reasons, e.g. {reasons[0]!r}) in the "
                                      f"message, so whoever reads it knows what to change") from None
                checked += 1
                continue
            raise CheckFailed(f"{where}: raised ValueError, but {want.layout} fits and the worker runs it") from None
        if want is None:
            raise CheckFailed(f"{where}: no layout the worker runs fits (every one is over memory or not runnable), "
                              f"so raise ValueError with the planner's reasons; got {got}")
        if not hasattr(got, "dp"):
            raise CheckFailed(f"{where}: return a planner Layout (an Estimate's .layout), got {got!r}")
        mine = estimate(model, cluster, got, batch, precision="fp32")
        if not mine.feasible:
            raise CheckFailed(f"{where}: the planner rejects {got}: {'; '.join(mine.reasons)}")
        if not runnable(got):
            raise CheckFailed(f"{where}: {got} is feasible, but the capstone's worker runs only DP × PP × TP with "
                              f"DDP or ZeRO-1, v = 1, no recomputation and no CP: filter those first")
        if got != want.layout:
            place = result.rank_of(got)
            raise CheckFailed(f"{where}: the planner ranks {got} {place}th ({mine.step_time * 1e3:.1f} ms a step); "
                              f"{want.layout} is the fastest the worker runs ({want.step_time * 1e3:.1f} ms): "
                              f"pick by step time, not memory or degree")
        checked += 1
    return (f"{checked} machines: the fastest feasible layout the worker runs, or a ValueError with the planner's "
            f"reasons when none fits")


# ---------------------------------------------------------------- 13.2

def _stream(rng: random.Random, tmp: Path) -> tuple[Path, np.ndarray]:
    tokens = np.array([rng.randrange(1, 60000) for _ in range(rng.randrange(300, 500))], dtype=SHARD_DTYPE)
    path = tmp / f"tokens{rng.getrandbits(16)}.bin"
    tokens.tofile(path)
    return path, tokens.astype(np.int64)


def _batch_mistake(got_x: torch.Tensor, loaders: list, dp_rank: int, seq_len: int) -> str:
    """Name the slip that makes this rank's rows what they are (the other ranks' loaders hold their latest rows:
    this step's for lower ranks, the step before's for higher ones)."""
    for r, other in enumerate(loaders):
        if r != dp_rank and other.last is not None and torch.equal(got_x, other.last):
            if r < dp_rank:
                return (f"it equals DP rank {r}'s rows of this step: each rank takes its own rows of the global "
                        f"batch, d·B/dp … (d+1)·B/dp")
            return (f"it equals the rows DP rank {r} read the step before: the position moves on by the global "
                    f"batch (every rank's rows), not by this rank's")
    own = loaders[dp_rank]
    if own.previous is not None and torch.equal(got_x, own.previous):
        return "the same rows as the step before: the state's position must move on by the global batch"
    loader = own.loader
    tokens = loader.tokens
    start = loader.position - loader.batch_size  # the step's first window, over the global batch
    strided = [int(k) for k in loader.order[start + dp_rank:start + loader.batch_size:loader.dp_size]]
    if len(strided) == len(got_x) and torch.equal(got_x, _windows(tokens, strided, seq_len)):
        return (f"it holds every {loader.dp_size}th window of the step from window {dp_rank} on (a "
                f"DistributedSampler's habit): here DP rank d takes its own block of the global batch, rows "
                f"d·B/dp … (d+1)·B/dp, so the position names the same windows whatever the DP size")
    if start == 0 and loader.epoch > 0:
        dropped = window_order(loader.windows, loader.seed, loader.epoch - 1)[loader.steps_per_epoch
                                                                              * loader.batch_size:]
        tail = {tuple(row.tolist()) for row in _windows(tokens, [int(k) for k in dropped], seq_len)} if len(
            dropped) else set()
        if any(tuple(row.tolist()) in tail for row in got_x):
            return (f"it reads the last {len(dropped)} window(s) of epoch {loader.epoch - 1}, which make an "
                    f"incomplete batch and are dropped (drop_last): an epoch has windows // batch_size steps, then "
                    f"epoch {loader.epoch} starts at position 0 in its own order")
    first = start + dp_rank * loader.rows
    ids = [int(k) for k in loader.order[first:first + loader.rows]]
    if all((k + 1) * (seq_len + 1) <= len(tokens) for k in ids):
        strided = torch.stack([tokens[k * (seq_len + 1):k * (seq_len + 1) + seq_len] for k in ids])
        if torch.equal(got_x, strided):
            return ("windows start every seq_len + 1 tokens: each window's last token (a target) is the next one's "
                    "first input, so window k starts at k·seq_len, or some tokens are never inputs")
    if loader.epoch > 0:
        stale = window_order(loader.windows, loader.seed, 0)[first:first + loader.rows]
        if torch.equal(got_x, torch.stack([tokens[int(k) * seq_len:int(k) * seq_len + seq_len] for k in stale])):
            return ("epoch 0's order in a later epoch: each epoch visits the windows in "
                    "window_order(windows, seed, epoch)")
    return "compare with window k = tokens[k·seq_len : k·seq_len + seq_len + 1], k from window_order"


def _windows(tokens: torch.Tensor, ids, seq_len: int) -> torch.Tensor:
    """Inputs of windows ``ids``: window k starts at k·seq_len."""
    return torch.stack([tokens[k * seq_len:k * seq_len + seq_len] for k in ids])


class _Tracked:
    """A reference loader remembering its rows, so a mistake can be named by whose rows a student's equal."""

    def __init__(self, loader):
        self.loader, self.last, self.previous, self.tokens = loader, None, None, loader.tokens

    def next(self):
        x, y = self.loader.next_batch()
        self.previous, self.last = self.last, x
        return x, y


def check_next_batch(next_batch) -> str:
    """13.2: ``next_batch(tokens, seq_len, batch_size, dp_rank, dp_size, state)`` → ``(x, y, state)``."""
    raise_if_untouched(next_batch)
    rng = random.Random(_seed() + 2)
    tmp = Path(tempfile.mkdtemp(prefix="lab13-loader-"))
    try:
        cases = 0
        for _ in range(3):
            path, tokens = _stream(rng, tmp)
            seq_len, dp = rng.choice([5, 7, 9]), rng.choice([2, 4])
            batch = dp * rng.choice([1, 2, 3])
            order_seed = rng.randrange(1000)
            reference = ResumableTokenLoader(path, seq_len, batch, seed=order_seed)
            steps = reference.steps_per_epoch + 3  # into the second epoch
            loaders = [_Tracked(ResumableTokenLoader(path, seq_len, batch, d, dp, seed=order_seed))
                       for d in range(dp)]
            states = [{"epoch": 0, "position": 0, "seed": order_seed} for _ in range(dp)]
            stream = torch.from_numpy(tokens)
            where = f"{len(tokens)} tokens, seq_len {seq_len}, global batch {batch} over DP {dp}"
            saved = None
            for step in range(steps):
                if step == steps // 2:
                    saved = copy.deepcopy(states)
                for d in range(dp):
                    want_x, want_y = loaders[d].next()
                    try:
                        got = next_batch(stream, seq_len, batch, d, dp, states[d])
                    except (IndexError, RuntimeError) as error:
                        raise CheckFailed(f"{where}: DP rank {d}, step {step}: raised {describe_error(error)}; there "
                                          f"are (len(tokens) - 1) // seq_len windows, window k is tokens[k·seq_len : "
                                          f"k·seq_len + seq_len + 1], and each fits in the stream") from None
                    if not (isinstance(got, tuple) and len(got) == 3):
                        raise CheckFailed(f"{where}: return (x, y, state), got {type(got).__name__}")
                    x, y, states[d] = got
                    here = f"{where}: DP rank {d}, step {step} (epoch {loaders[d].loader.epoch})"
                    if tuple(x.shape) != tuple(want_x.shape):
                        reference = loaders[d].loader
                        drop = (f": the epoch's last batch is incomplete and is dropped (drop_last) — at this step "
                                f"epoch {reference.epoch} begins at position 0" if reference.epoch > 0
                                and reference.position == reference.batch_size and len(x) < len(want_x) else "")
                        raise CheckFailed(f"{here}: x has shape {tuple(x.shape)}, expected {tuple(want_x.shape)} "
                                          f"(batch / dp rows of seq_len tokens)"
                                          f"{drop or ': ' + _shape_advice(x, want_x)}")
                    if not torch.equal(x.long(), want_x):
                        raise CheckFailed(f"{here}: other tokens than expected: "
                                          f"{_batch_mistake(x.long(), loaders, d, seq_len)}")
                    if not torch.equal(y.long(), want_y):
                        raise CheckFailed(f"{here}: x is right but y is not: take y = window[1:] of the same "
                                          f"windows, x shifted by one token (the next token of every position)")
            # a restart: continue from the state saved halfway, as a relaunched job would
            replay = [ResumableTokenLoader(path, seq_len, batch, d, dp, seed=order_seed) for d in range(dp)]
            for d in range(dp):
                for _ in range(steps // 2):
                    replay[d].next_batch()
            for step in range(steps // 2, steps):
                for d in range(dp):
                    want_x, _ = replay[d].next_batch()
                    x, _, saved[d] = next_batch(stream, seq_len, batch, d, dp, saved[d])
                    if not torch.equal(x.long(), want_x):
                        raise CheckFailed(f"{where}: restarted from the state your function returned after step "
                                          f"{steps // 2 - 1}, DP rank {d}'s step {step} reads other windows than "
                                          f"the uninterrupted run: the state must hold everything the next batch "
                                          f"depends on (epoch and global position), nothing kept elsewhere")
            cases += 1
        return (f"{cases} streams, every DP rank, into a second epoch, and a restart halfway that continues with "
                f"the same windows")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------- 13.3

def _train_state(cfg: GPTConfig, path: Path, seed: int) -> GridTrainState:
    model = GPT(cfg, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return GridTrainState(model, optimizer, ResumableTokenLoader(path, cfg.seq_len, 2), rank=0)


def _advance(state: GridTrainState, steps: int) -> None:
    for _ in range(steps):
        x, y = state.loader.next_batch()
        _, loss = state.stage(x, y)
        loss.backward()
        state.optimizer.step()
        state.optimizer.zero_grad(set_to_none=True)
        state.step += 1


def _resume_job(resume, directory: str, cfg: GPTConfig, tokens, seed: int):
    """13.3 where the student's code runs: a fresh state resumed from ``directory``; the step it returned and the
    state after it (the weights, Adam's first moments, the loader's position), which the checker compares."""
    state = _train_state(cfg, tokens, seed)
    start = resume(directory, state)
    moments = {i: s.get("exp_avg") for i, s in enumerate(state.optimizer.state.values())}
    return start, state.stage.state_dict(), moments, state.loader.state_dict()


def check_resume(resume) -> str:
    """13.3: ``resume(ckpt_dir, state)`` loads the newest committed checkpoint and returns the next step."""
    raise_if_untouched(resume)
    rng = random.Random(_seed() + 3)
    tmp = Path(tempfile.mkdtemp(prefix="lab13-resume-"))
    try:
        cfg = GPTConfig(vocab_size=64, seq_len=8, n_layer=1, n_head=2, d_model=16)
        tokens = np.array([rng.randrange(64) for _ in range(400)], dtype=SHARD_DTYPE)
        tokens.tofile(tmp / "tokens.bin")
        seed, every = rng.randrange(1000), rng.choice([2, 3])
        before = {k: v.clone() for k, v in _train_state(cfg, tmp / "tokens.bin", seed).stage.state_dict().items()}
        start, after, _, _ = run_isolated(_resume_job, resume, str(tmp / "none"), cfg, tmp / "tokens.bin", seed)
        if start != 0:
            raise CheckFailed(f"with no checkpoint in the directory, resume returned {start!r}: a fresh job starts at "
                              f"step 0, so return 0 when latest_checkpoint finds none (it returns None)")
        if any(not torch.equal(before[k], v) for k, v in after.items()):
            raise CheckFailed("with no checkpoint in the directory, resume changed the weights: leave a fresh state")
        live = _train_state(cfg, tmp / "tokens.bin", seed)
        root = tmp / "ckpt"
        for _ in range(2):
            _advance(live, every)
            save_checkpoint(live.checkpoint, root, live.step)
        committed = live.step
        weights = {k: v.clone() for k, v in live.stage.state_dict().items()}
        moments = {i: s["exp_avg"].clone() for i, s in enumerate(live.optimizer.state.values())}
        position = live.loader.state_dict()
        _advance(live, every)  # the next save was cut short by a dying rank: a partial directory, never committed
        partial = checkpoint_path(root, live.step).with_name(checkpoint_path(root, live.step).name + ".partial")
        partial.mkdir(parents=True)
        (partial / "__0_0.distcp").write_bytes(b"half a shard")
        try:
            start, state, got_moments, position_after = run_isolated(_resume_job, resume, str(root), cfg,
                                                                      tmp / "tokens.bin", seed)
        except CheckpointError as error:
            if "partial" in str(error) or "incomplete" in str(error):
                raise CheckFailed(f"resume tried to load a checkpoint that was never committed: {error} — take the "
                                  f"newest *committed* one (latest_checkpoint)") from None
            raise CheckFailed(f"the checkpoint did not load: {error} — load state.checkpoint, this rank's entry "
                              f"keyed by its rank, as the job saved it") from None
        untouched = _train_state(cfg, tmp / "tokens.bin", seed).stage.state_dict()
        if all(torch.equal(v, untouched[k]) for k, v in state.items()):
            raise CheckFailed(f"resume did not load the checkpoint into the state (it returned {start!r}, the weights "
                              f"are still the fresh model's): load_checkpoint(state.checkpoint, path) fills the "
                              f"weights, Adam's moments, the loader's position and state.step")
        if start != committed:
            hint = (": step_k holds the state after k updates, so k is the next step's index" if start in
                    (committed + 1, committed - 1) else "")
            raise CheckFailed(f"resume returned {start!r}; the newest committed checkpoint is step_{committed:08d}, "
                              f"so the job continues with step {committed}{hint}")
        name, diff = max(((k, (v - weights[k]).abs().max().item()) for k, v in state.items()),
                         key=lambda item: item[1])
        if diff > 0:
            raise CheckFailed(f"after resume, {name} differs from the checkpoint's by {diff:.2e}: load the checkpoint "
                              f"into the state (load_checkpoint(state.checkpoint, path)) before returning")
        if any(got_moments.get(i) is None or not torch.equal(got_moments[i], m) for i, m in moments.items()):
            raise CheckFailed("after resume the weights are right but Adam's moments are not the checkpoint's: load "
                              "the whole training state, not only the model")
        if position_after != position:
            raise CheckFailed(f"after resume the loader is at {position_after['position']}, the "
                              f"checkpoint's position is {position['position']}: the next batches would repeat or "
                              f"skip tokens; load the whole training state")
        return (f"no checkpoint: step 0; with step_{committed:08d} committed and a partial one beside it: its weights, "
                f"Adam moments and data position, next step {committed}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------- 13.4

def _synthetic_run(rng: random.Random, pp: int, dp: int, steps: int):
    """Records and a trace of a made-up run: per step and rank a ``step<k>`` span holding forward and backward
    spans whose durations are drawn, the first step slow (warm-up), one step an outlier, bytes that differ by rank."""
    ranks = pp * dp
    spans, records = [], [{"rank": r, "step_times": {}, "bytes": {}} for r in range(ranks)]
    clock = 0.0
    for k in range(steps):
        slow = 3.0 if k == 0 else 2.0 if k == steps - 2 else 1.0
        ends = []
        for r in range(ranks):
            stage = (r // 1) % pp
            t = clock + stage * 0.002
            spans_r = []
            for mb in range(2):
                f = rng.uniform(0.004, 0.008) * slow
                spans_r.append(Span(r, f"F{mb}", "compute", t, t + f))
                t += f + rng.uniform(0.0, 0.003)
            for mb in range(2):
                b = rng.uniform(0.008, 0.016) * slow
                spans_r.append(Span(r, f"B{mb}", "compute", t, t + b))
                t += b + rng.uniform(0.0, 0.003)
            end = t + rng.uniform(0.001, 0.004)
            spans.append(Span(r, f"step{k}", "other", clock, end))
            spans += spans_r
            records[r]["step_times"][k] = end - clock
            records[r]["bytes"][k] = {"dp": rng.randrange(10_000, 20_000) * (r + 1), "pp": 4096 * (1 + r % 2),
                                      "tp": 0}
            ends.append(end)
        clock = max(ends) + 0.001
    return records, trace_format.build(spans, world_size=ranks)


def _shape_advice(x, want_x) -> str:
    """Where a wrong batch shape comes from: its rows (the DP rank's share of the batch) or its columns (the
    window's slice)."""
    if x.dim() == 2 and x.shape[0] != want_x.shape[0]:
        return ("each DP rank takes batch_size // dp_size windows a step: check its rows, order[first:first + rows] "
                "with first = position + dp_rank × rows")
    return ("a window is seq_len + 1 tokens, tokens[k × seq_len : k × seq_len + seq_len + 1], x its first seq_len and "
            "y its last: check the slice's bounds and what you cut off")


def _report_mistake(key: str, got: dict, want: dict, records, trace) -> str:
    """Name the slip that gives the student's figure: each candidate is computed from the same records."""
    steps = sorted(records[0]["step_times"])
    if key == "mfu" and math.isclose(got["mfu"], want["mfu"] * len(records), rel_tol=1e-6):
        return "MFU against one rank's peak: the job's tokens/s run on every rank, divide by ranks × peak"
    if key == "tokens_per_second" and math.isclose(got[key], want[key] / len(records), rel_tol=1e-6):
        return "tokens/s of one rank: a step trains the whole global batch"
    if key in ("step_time", "tokens_per_second", "mfu"):
        slips = ((statistics.fmean(max(r["step_times"][k] for r in records) for k in steps[1:]),
                  "the mean step time: one slow step pulls it; take the median over steps"),
                 (statistics.median(records[0]["step_times"][k] for k in steps[1:]),
                  "rank 0's step time: a step ends when its slowest rank does (max over ranks)"),
                 (statistics.median(max(r["step_times"][k] for r in records) for k in steps),
                  "the first step counted: it pays for allocation and warm-up; skip it"))
        mine = got.get("step_time")
        for value, why in slips:
            if isinstance(mine, (int, float)) and math.isclose(mine, value, rel_tol=1e-9):
                return why
        return "step time = median over steps (after the first) of the slowest rank's; tokens/s and MFU from it"
    if key == "bubble":
        mean_idle = statistics.median(trace_bubble(trace, step=k).mean_idle for k in steps[1:])
        if isinstance(got[key], (int, float)) and math.isclose(got[key], mean_idle, rel_tol=1e-6):
            return "the mean idle over ranks: the bubble is the busiest rank's idle share (trace_bubble's fraction)"
        return "the median over steps (after the first) of trace_bubble(trace, step=k).fraction"
    return ("not a sum over ranks or rank 0's: take the most any rank sent in step k (the max over the records of "
            "bytes[k]), then the median over the steps after the first")


_UNITS = {"step_time": (1e3, "ms", ".2f"), "tokens_per_second": (1, "tokens/s", ",.0f"), "mfu": (100, "%", ".3f"),
          "bubble": (1, "", ".4f"), "bytes": (1, "B", ",.0f")}


def _figure(key: str, value) -> str:
    """A figure as the run card prints it (``49.17 ms``, not ``0.04917471303160409``); anything else as it is."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return repr(value)
    scale, unit, form = _UNITS[key]
    return f"{value * scale:{form}}{' ' + unit if unit and unit != '%' else unit}"


def check_report_numbers(report_numbers) -> str:
    """13.4: ``report_numbers(records, trace, flops_per_token, tokens_per_step, peak_flops)`` → the run card's
    measured figures."""
    raise_if_untouched(report_numbers)
    rng = random.Random(_seed() + 4)
    for _ in range(3):
        pp, dp = rng.choice([2, 4]), 2
        records, trace = _synthetic_run(rng, pp, dp, rng.choice([6, 7, 8]))
        # a small GPT's FLOPs per token against CPU-sized peaks: the MFU is a fraction, as a run's is
        args = (rng.randrange(1, 50) * 1e4, rng.choice([256, 512, 1024]), rng.choice([2e10, 8e10]))
        want = derive_report(records, trace, *args)
        try:
            got = report_numbers(records, trace, *args)
        except KeyError as error:
            steps = sorted(records[0]["step_times"])
            raise CheckFailed(f"PP {pp} × DP {dp}: report_numbers raised KeyError {error}: a record's step_times "
                              f"and bytes are keyed by the step numbers it lists ({steps[0]} to {steps[-1]}), so "
                              f"read r['step_times'][k] and r['bytes'][k][axis] for those k only") from None
        if not isinstance(got, dict) or not set(want) <= set(got):
            raise CheckFailed(f"return a dict with {sorted(want)}, got {got!r}")
        where = f"PP {pp} × DP {dp}, {len(records[0]['step_times'])} steps"
        for key in ("step_time", "tokens_per_second", "mfu", "bubble"):
            if not isinstance(got[key], (int, float)) or not math.isclose(got[key], want[key], rel_tol=1e-6):
                raise CheckFailed(f"{where}: {key} {_figure(key, got[key])}, expected {_figure(key, want[key])}: "
                                  f"{_report_mistake(key, got, want, records, trace)}")
        for axis in ("dp", "pp", "tp"):
            mine = got["bytes"].get(axis) if isinstance(got["bytes"], dict) else None
            if mine is None or not math.isclose(mine, want["bytes"][axis], rel_tol=1e-9, abs_tol=0.5):
                raise CheckFailed(f"{where}: {axis.upper()} bytes {_figure('bytes', mine)}, expected "
                                  f"{_figure('bytes', want['bytes'][axis])}: "
                                  f"{_report_mistake('bytes', got, want, records, trace)}")
    return "3 runs' records and traces: step time, tokens/s, MFU, bubble and bytes per axis as derive_report reads them"


# ---------------------------------------------------------------- quiz

QUIZ = [
    quiz.number("Q13.1", "tokens the job trains on in {steps} steps of {batch} sequences × {seq_len} tokens",
                rel_tol=0, given=dict(steps=40, batch=8, seq_len=64),
                vary=dict(steps=(20, 60, 100), batch=(4, 16, 32), seq_len=(32, 128)),
                solve=lambda steps, batch, seq_len: steps * batch * seq_len,
                hint="'4. Train: the run' — what one step of the global batch reads"),
    quiz.number("Q13.2", "pipeline bubble fraction of this run's schedule, were its stages equal: PP {pp}, m = {m} "
                "micro-batches (1F1B)", rel_tol=0.01, given=dict(pp=2, m=4), vary=dict(pp=(4, 8), m=(2, 8, 16)),
                solve=lambda pp, m: bubble_fraction(pp, m),
                hint="lab 06's bubble section, and '6. The run card' — the bubble line beside the replayed one"),
    quiz.number("Q13.3", "a rank dies at step {step} of a job that checkpoints every {every} steps: how many steps "
                "are trained again after the restart?", rel_tol=0, given=dict(step=27, every=10),
                vary=dict(step=(13, 38, 45), every=(4, 6, 8)), solve=lambda step, every: step % every,
                hint="'5. Break it: kill a rank mid-run' — which checkpoint the relaunch loads"),
    quiz.number("Q13.4", "bytes of fp32 Adam state (two moments) per rank for a stage of {params:,} parameters under "
                "ZeRO-1 over DP {dp}", rel_tol=0.01, given=dict(params=220_352, dp=2),
                vary=dict(params=(100_000, 1_000_000), dp=(4, 8)),
                solve=lambda params, dp: params * bytes_per_param(1, dp, "fp32").optimizer,
                hint="'6. The run card' — memory per rank, and lab 04's bytes per parameter"),
    quiz.number("Q13.5", "bytes each rank sends in one step when ZeRO-1 reduce-scatters a {mb} MB fp32 gradient and "
                "all-gathers {mb} MB of fp32 weights over DP {ranks}", rel_tol=0.01, given=dict(mb=0.88, ranks=2),
                vary=dict(mb=(1.0, 10.0), ranks=(4, 8)),
                solve=lambda mb, ranks: 2 * ring_all_gather_bytes(mb * 1e6, ranks),
                hint="'6. The run card' — the DP payload line counts both messages whole; lab 02's ring says what "
                     "a rank sends of each"),
    quiz.choice("Q13.6", "the validation loss ends below the unigram baseline: what does that show", answer="c",
                options="abcd", hint="'Validation against the unigram baseline'"),
    quiz.choice("Q13.7", "a run's MFU is far below the peak, and the card's forward-and-backward term is most of the "
                "step: what is the first thing to change", answer="a", options="abcd",
                hint="'6. The run card': the terms of the step, and lab 11's 'MFU at 18%' suspects"),
]

# Surviving mutants of the solution cells that change nothing the exercises ask for (distlab notebooks
# mutants): key, as benchmarks/results/mutants.txt names it → why it is equivalent.
EQUIVALENT_MUTANTS = {
    '13.1 statements-swapped: `for e in result.feasible: # fastest first if runnable(e.layout): retu…` → `nearest = '
    '[e for e in result.near_misses if runnable(e.layout)][:2] f…`':
        'the near misses are listed before the loop instead of after it: the loop returns without reading them',
    '13.2 statements-swapped: `order = window_order(windows, state["seed"], epoch) rows = batch_size…` → `rows = '
    'batch_size // dp_size order = window_order(windows, state["see…`':
        "two statements that do not read each other's names, in the other order",
    '13.2 statements-swapped: `windows = (len(tokens) - 1) // seq_len epoch, position = state["epoch…` → `epoch, '
    'position = state["epoch"], state["position"] windows = (len(to…`':
        "two statements that do not read each other's names, in the other order",
    '13.4 arguments-swapped: `mfu(flops_per_token, rate / len(records), peak_flops)` → `mfu(rate / len(records), '
    'flops_per_token, peak_flops)`':
        'MFU is flops_per_token × tokens_per_second / peak_flops, symmetric in its first two arguments',
    '13.4 off-by-one: `0` → `-1`':
        "every rank's record lists the same steps: the last record's step numbers are the first's",
    '13.4 off-by-one: `0` → `1`':
        "every rank's record lists the same steps: the second record's step numbers are the first's",
    '13.1 off-by-one: `2` → `1`':
        "the error quotes the reasons of the nearest runnable miss instead of the nearest two: the text asks for the "
        "planner's reasons for the nearest layouts without a count, and the nearest comes first either way",
    '13.1 off-by-one: `2` → `3`':
        "the error quotes the reasons of the nearest three runnable misses instead of two: the text asks for the "
        "planner's reasons for the nearest layouts without a count, and the nearest come first either way",
}

EXERCISES = [
    Exercise("13.1", "the layout, chosen with the planner", 2, check_choose_layout,
             references=("distlab.capstone.report.runnable_best",)),
    Exercise("13.2", "a resumable, DP-sharded token loader", 3, check_next_batch,
             references=("distlab.data.loader.ResumableTokenLoader",)),
    Exercise("13.3", "the restart wiring: resume from the newest committed checkpoint", 2, check_resume,
             references=("distlab.capstone.train.resume_from_latest",)),
    Exercise("13.4", "the run card's figures from the run's own records and trace", 3, check_report_numbers,
             references=("distlab.capstone.report.derive_report",)),
    *QUIZ,
]
