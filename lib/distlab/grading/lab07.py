"""Lab 07 — ring attention and context parallelism. Checkers compare with full attention.

The reference is always ``F.scaled_dot_product_attention`` on the whole sequence in one process
(fp32; forward to 1e-5, gradients to 1e-4). The distributed exercises run on real gloo ranks (2
and 4 of them, the warm groups the notebook uses): every rank draws the same full Q, K, V from a
hidden seed, keeps its shard, runs the student's code, and the checker reassembles the shards.
Beyond the values, the checkers read distlab's comm log and timeline: ring attention must pass
K/V blocks with point-to-point messages (N-1 blocks per rank, each posted before the block in hand
is computed), Ulysses must make four all-to-alls of the local shard. Failure messages name the
case, the rank and the tensor, and the usual cause.

Cases come from the lab's seed, fixed in self-study, so the notebook's output is reproducible. An untouched
stub's ``NotImplementedError`` propagates (from a rank too) and is reported as "not attempted".
"""

from __future__ import annotations

import math
import random
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab.context_parallel import (
    SEQ_DIM,
    attention_block,
    hidden_transfer_tokens,
    layout_positions,
    measure_work,
    ring_bytes,
    shard,
    ulysses_bytes,
    unshard,
)
from distlab.flops import PEAK_FLOPS
from distlab.grading import quiz
from distlab.grading.contract import CheckFailed, first_line, slip_of
from distlab.grading.harness import (
    ATOL,
    Edge,
    assert_close,
    case_drawn,
    lab_seed,
    max_difference,
    p2p_waits_counted,
    run_isolated,
    run_on_ranks,
)
from distlab.grading.registry import Exercise
from distlab.memory import PRESETS, GiB, activation_bytes_per_layer
from distlab.runtime import comm
from distlab.runtime.errors import RankFailed


def _seed() -> int:
    """This lab's seed for its hidden cases, read as each check runs (:func:`~distlab.grading.harness.lab_seed`)."""
    return lab_seed(7)


GRAD_ATOL = 1e-4  # gradients sum many more rounded terms than the forward (harness.ATOL)

__all__ = ["EXERCISES", "Case", "check_online_softmax", "check_merge_and_blockwise", "check_ring_forward",
           "check_causal_ring", "check_ring_backward", "check_ulysses"]


@dataclass
class Case:
    world_size: int
    batch: int
    heads: int
    seq_len: int
    head_dim: int
    seed: int
    causal: bool = False
    layout: str = "contiguous"

    def tensors(self, count: int = 3) -> list[torch.Tensor]:
        """The full Q, K, V (and, with count=4, the output gradient) that every rank draws alike."""
        generator = torch.Generator().manual_seed(self.seed)
        shape = (self.batch, self.heads, self.seq_len, self.head_dim)
        return [torch.randn(shape, generator=generator) for _ in range(count)]

    def __str__(self) -> str:
        mask = "causal" if self.causal else "no mask"
        return (f"N={self.world_size}, {self.seq_len} tokens ({self.layout}, {mask}), {self.heads} heads, "
                f"head_dim {self.head_dim}")


@contextmanager
def _one_thread():
    """The hidden cases are tiny: on one thread they take milliseconds, on a loaded machine too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _case(rng: random.Random, world_size: int, **overrides) -> Case:
    layout = overrides.get("layout", "contiguous")
    parts = 2 * world_size if layout == "zigzag" else world_size
    case = Case(world_size=world_size, batch=rng.randint(1, 2), heads=rng.choice([1, 2, 3]),
                seq_len=parts * rng.randint(3, 8), head_dim=rng.choice([4, 8, 16]), seed=rng.randrange(10_000))
    for key, value in overrides.items():
        setattr(case, key, value)
    return case


def _reference(q, k, v, causal=False):
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[SEQ_DIM]
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal), torch.logsumexp(scores, dim=-1)


def _pair(result, where: str):
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise CheckFailed(f"{where}: return the pair (out, lse), got {type(result).__name__}")
    return result


# ---------------------------------------------------------------- 7.1

def _no_rescale(q, k_blocks, v_blocks):
    """The classic mistake: running max and sums, but old sums never rescaled when the max grows."""
    m = row_sum = acc = None
    for k, v in zip(k_blocks, v_blocks):
        s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        m = s.amax(-1) if m is None else torch.maximum(m, s.amax(-1))
        p = torch.exp(s - m.unsqueeze(-1))
        row_sum = p.sum(-1) if row_sum is None else row_sum + p.sum(-1)
        acc = p @ v if acc is None else acc + p @ v
    return acc / row_sum.unsqueeze(-1)


def _online_softmax_mistakes(q, k, v) -> dict[str, list[tuple[torch.Tensor, str]]]:
    """What the usual wrong answers of 7.1 return, by output: each with the sentence that names the mistake."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = (q @ k.transpose(-2, -1)) * scale
    m = s.amax(-1)
    weights = torch.exp(s - m.unsqueeze(-1))
    row_sum, acc = weights.sum(-1), weights @ v
    unscaled = q @ k.transpose(-2, -1)
    return {
        "out": [(torch.softmax(unscaled, -1) @ v, "the scores are not scaled: multiply q·k by 1/sqrt(d)"),
                (acc, "out is the accumulator a: divide it by the running sum l at the end, o = a / l")],
        "lse": [(torch.log(row_sum), "lse is log(l) alone: add the running max back, lse = m + log(l)"),
                (m, "lse is the running max m alone: lse = m + log(l)"),
                (torch.logsumexp(unscaled, -1), "lse is taken over unscaled scores: scale q·k by 1/sqrt(d)")],
    }


def _name_mistake(got, mistakes: list[tuple[torch.Tensor, str]], where: str, name: str) -> None:
    """Raise naming the mistake when ``got`` equals what one of the known wrong answers returns."""
    if not isinstance(got, torch.Tensor):
        return
    for wrong, why in mistakes:
        if got.shape == wrong.shape and torch.isfinite(wrong).all() and max_difference(got.float(), wrong)[0] <= ATOL:
            raise CheckFailed(f"{where}: {name} differs from full attention's: {why}")


def _stream_hint(online_softmax_attention, q, k_block, v_block) -> str:
    """Where to look when a stream's output differs: a stream of one block shows whether one block is already
    wrong (the scores, the exponentials, p @ v, the final division) or only the update a further block makes."""
    try:
        out, _ = _pair(online_softmax_attention(q, iter([k_block]), iter([v_block])), "one block")
        alone_right = isinstance(out, torch.Tensor) and out.shape == q.shape[:-1] + v_block.shape[-1:] \
            and max_difference(out, _reference(q, k_block, v_block)[0])[0] <= ATOL
    except Exception:  # noqa: BLE001 - a probe: its own failure only means no hint
        return ""
    if alone_right:
        return ("a stream of one block is right, so the update when a further block arrives is wrong: multiply l "
                "and acc by exp(m_old - m_new), then add this block's p.sum(-1) and p @ v")
    return ("a stream of one block already differs from attention: check the scores q @ kᵀ / sqrt(d), "
            "exp(s - m), acc = p @ v and out = acc / l")


def check_online_softmax(online_softmax_attention) -> str:
    """7.1: ``online_softmax_attention(q, k_blocks, v_blocks) -> (out, lse)`` in one pass over streams."""
    with _one_thread():
        return _check_online_softmax(online_softmax_attention)


def _check_online_softmax(online_softmax_attention) -> str:
    rng = random.Random(_seed() + 1)
    kinds = ["random", "rising max", "large scores", "random"]
    for kind in kinds:
        b, h, d = rng.randint(1, 2), rng.randint(1, 3), rng.choice([4, 8, 16])
        q_len, sizes = rng.randint(3, 12), [rng.randint(1, 9) for _ in range(rng.randint(3, 6))]
        generator = torch.Generator().manual_seed(rng.randrange(10_000))
        q = torch.randn(b, h, q_len, d, generator=generator)
        k = torch.randn(b, h, sum(sizes), d, generator=generator)
        v = torch.randn(b, h, sum(sizes), d, generator=generator)
        if kind == "rising max":  # later keys align ever better with every query: the max keeps growing
            k = k * 0.1 + q.mean(2, keepdim=True) * torch.linspace(0, 3, sum(sizes)).view(1, 1, -1, 1)
        if kind == "large scores":
            q = q * 100  # scores of several hundred: exp overflows float32 past ~88
        k_blocks, v_blocks = list(k.split(sizes, SEQ_DIM)), list(v.split(sizes, SEQ_DIM))
        case_drawn("7.1", kind=kind, sizes=sizes, largest=(q @ k.transpose(-2, -1)).abs().max().item() / d**0.5)
        where = f"{kind} case ({q_len} queries, key blocks of {sizes})"
        try:
            out, lse = _pair(online_softmax_attention(q, iter(k_blocks), iter(v_blocks)), where)
        except TypeError as error:
            raise CheckFailed(f"{where}: raised TypeError ({error}): k_blocks and v_blocks are streams (iterators) "
                              f"that can be read once; loop over zip(k_blocks, v_blocks) a single time") from None
        expected_out, expected_lse = _reference(q, k, v)
        if isinstance(out, torch.Tensor) and not torch.isfinite(out).all():
            scores = (q @ k.transpose(-2, -1)).abs().max().item() / math.sqrt(d)
            raise CheckFailed(f"{where}: out has inf/NaN with scores up to {scores:.0f}: exp() overflows float32 "
                              f"past about 88, subtract the running max before exponentiating")
        if isinstance(out, torch.Tensor) and out.shape == expected_out.shape:
            diff, _ = max_difference(out, expected_out)
            if diff > ATOL and max_difference(out, _no_rescale(q, k_blocks, v_blocks))[0] <= ATOL:
                raise CheckFailed(f"{where}: out is off by {diff:.3g}: when a block raises the running max m, the "
                                  f"running sum l and accumulator must be multiplied by exp(m_old - m_new) first")
        mistakes = _online_softmax_mistakes(q, k, v)
        mistakes["out"].append((F.scaled_dot_product_attention(q, k_blocks[-1], v_blocks[-1]),
                                "out is the last block's attention alone: carry l and a across the blocks"))
        if not (isinstance(out, torch.Tensor) and out.shape == expected_out.shape
                and max_difference(out, expected_out)[0] <= ATOL):
            _name_mistake(out, mistakes["out"], where, "out")
        if not (isinstance(lse, torch.Tensor) and lse.shape == expected_lse.shape
                and max_difference(lse, expected_lse)[0] <= ATOL * max(1.0, expected_lse.abs().max().item())):
            _name_mistake(lse, mistakes["lse"], where, "lse")
        hint = _stream_hint(online_softmax_attention, q, k_blocks[0], v_blocks[0])
        assert_close(where, "out", out, expected_out, hint=hint)
        assert_close(where, "lse", lse, expected_lse, ATOL * max(1.0, expected_lse.abs().max().item()),
                     "lse = m + log(l), the log of the softmax denominator")
    return f"{len(kinds)} streams of uneven blocks, a rising max and scores of several hundred: equal to SDPA"


# ---------------------------------------------------------------- 7.2

def _check_merge(merge_partials, rng: random.Random) -> int:
    cases = 0
    for kind in ("random split", "one part sees nothing", "no part sees anything"):
        b, h, d, n = rng.randint(1, 2), rng.randint(1, 3), rng.choice([4, 8]), rng.randint(6, 16)
        generator = torch.Generator().manual_seed(rng.randrange(10_000))
        q, k, v = (torch.randn(b, h, n, d, generator=generator) for _ in range(3))
        cut = rng.randint(1, n - 1)
        q_pos = torch.arange(n)
        if kind == "random split":
            k_pos = None
            q_pos = None
        elif kind == "one part sees nothing":
            k_pos = torch.arange(n)  # causal: early queries see no key of the second part
        else:
            q_pos, k_pos = torch.arange(n), torch.arange(n) + n  # every key after every query
        parts = [attention_block(q, k[:, :, a:z], v[:, :, a:z], q_pos, None if k_pos is None else k_pos[a:z])
                 for a, z in ((0, cut), (cut, n))]
        expected_out, expected_lse = attention_block(q, k, v, q_pos, k_pos)
        where = f"merge_partials, {kind} (keys split {cut}+{n - cut})"
        case_drawn("7.2", merge=kind)
        out, lse = _pair(merge_partials(*parts[0], *parts[1]), where)
        if isinstance(out, torch.Tensor) and torch.isnan(out).any():
            raise CheckFailed(f"{where}: out has NaN where a part's lse is -inf (its queries saw none of its keys): "
                              f"such a part must get weight 0; when both are -inf the result is out = 0, lse = -inf "
                              f"(guard exp(-inf - -inf))")
        if isinstance(out, torch.Tensor) and kind == "random split" and out.shape == expected_out.shape:
            if max_difference(out, parts[0][0] + parts[1][0])[0] < 1e-6:
                raise CheckFailed(f"{where}: out is out_a + out_b: weight each part by exp(lse_part - lse) with "
                                  f"lse = log(exp(lse_a) + exp(lse_b))")
            (out_a, lse_a), (out_b, lse_b) = parts
            if not (isinstance(lse, torch.Tensor) and lse.shape == expected_lse.shape
                    and max_difference(lse, expected_lse)[0] <= ATOL):  # a wrong lse makes out wrong too
                _name_mistake(lse, [
                    (torch.maximum(lse_a, lse_b), "lse is max(lse_a, lse_b): the denominators add, "
                                                  "lse = logaddexp(lse_a, lse_b)"),
                    (lse_a + lse_b, "lse is lse_a + lse_b, the log of a product: the denominators add, "
                                    "lse = logaddexp(lse_a, lse_b)")], where, "lse")
            _name_mistake(out, [
                ((out_a + out_b) / 2, "out is the mean of the parts: weight each by its share of the softmax "
                                      "denominator, exp(lse_part - lse)"),
                (out_a * lse_a.exp().unsqueeze(-1) + out_b * lse_b.exp().unsqueeze(-1),
                 "the parts are weighted by exp(lse_part) without dividing by exp(lse): use exp(lse_part - lse)"),
                (out_a * (lse_b - torch.logaddexp(lse_a, lse_b)).exp().unsqueeze(-1)
                 + out_b * (lse_a - torch.logaddexp(lse_a, lse_b)).exp().unsqueeze(-1),
                 "the weights are swapped: out_a takes exp(lse_a - lse), out_b exp(lse_b - lse)")], where, "out")
        assert_close(where, "out", out, expected_out, hint="weight each part by its share of the denominator: "
                     "out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)")
        assert_close(where, "lse", lse, expected_lse, hint="lse = logaddexp(lse_a, lse_b)")
        cases += 1
    return cases


def _unmasked_diagonal(q, k, v, block: int) -> torch.Tensor:
    """Causal blockwise attention that skips the later blocks but computes the diagonal one unmasked."""
    outs = []
    for start in range(0, q.shape[SEQ_DIM], block):
        stop = min(start + block, q.shape[SEQ_DIM])
        outs.append(F.scaled_dot_product_attention(q[:, :, start:stop], k[:, :, :stop], v[:, :, :stop]))
    return torch.cat(outs, dim=SEQ_DIM)


def _blockwise_job(blockwise_attention, q, k, v, block: int, causal: bool):
    """7.2's blockwise attention where the student's code runs: its result, and how many scores it computed
    (counted in that process: a count the code could alter, as any count taken beside it)."""
    with measure_work() as work:
        result = blockwise_attention(q, k, v, block, causal)
    return result, work.computed


def check_merge_and_blockwise(merge_partials, blockwise_attention) -> str:
    """7.2: ``merge_partials(out_a, lse_a, out_b, lse_b)`` and ``blockwise_attention(q, k, v, block_size, causal)``."""
    with _one_thread():
        return _check_merge_and_blockwise(merge_partials, blockwise_attention)


def _check_merge_and_blockwise(merge_partials, blockwise_attention) -> str:
    rng = random.Random(_seed() + 2)
    merges = _check_merge(merge_partials, rng)
    cases = 0
    for index, causal in enumerate((False, True, True)):
        b, h, d, n = rng.randint(1, 2), rng.randint(1, 3), rng.choice([4, 8, 16]), rng.randint(20, 40)
        block = rng.choice([3, 5, 7, 8])
        if index == 2:  # a last query block of one token: a loop that stops one position early drops it
            n -= n % block - 1
        generator = torch.Generator().manual_seed(rng.randrange(10_000))
        q, k, v = (torch.randn(b, h, n, d, generator=generator) for _ in range(3))
        where = f"blockwise_attention, {n} tokens in blocks of {block} ({'causal' if causal else 'no mask'})"
        case_drawn("7.2", causal=causal, tokens=n, block=block)
        result, computed = run_isolated(_blockwise_job, blockwise_attention, q, k, v, block, causal)
        out, lse = _pair(result, where)
        expected_out, expected_lse = _reference(q, k, v, causal)
        if causal and isinstance(out, torch.Tensor) and out.shape == expected_out.shape:
            _name_mistake(out, [(_reference(q, k, v)[0], "no key is masked: with causal=True pass each block's "
                                 "positions, attention_block(qb, kb, vb, q_pos, k_pos)"),
                                (_unmasked_diagonal(q, k, v, block), "the blocks after the query block are skipped "
                                 "but the diagonal block is not masked: pass q_pos and k_pos to attention_block")],
                          where, "out")
        if isinstance(out, torch.Tensor) and out.dim() == 4 and out.shape[SEQ_DIM] != n:
            raise CheckFailed(f"{where}: out holds {out.shape[SEQ_DIM]} query positions, expected {n}: loop over the "
                              f"query blocks with range(0, T, block_size), each ending at min(start + block_size, "
                              f"T), and append each block's output once, in order")
        hint = "the last block is shorter when block_size does not divide the sequence" if n % block else ""
        if causal:
            hint = hint or "key j is visible to query i when j <= i: pass the block's positions to attention_block"
        assert_close(where, "out", out, expected_out, hint=hint)
        assert_close(where, "lse", lse, expected_lse, hint=hint)
        if causal and computed >= b * h * n * n:
            raise CheckFailed(f"{where}: computed {computed:,} scores, as many as without a mask: blocks whose "
                              f"first key comes after the last query are fully masked; skip them")
        cases += 1
    return f"{merges} merges (masked parts included) and {cases} blockwise runs, causal and not: equal to SDPA"


# ---------------------------------------------------------------- running student code on ranks

def _launch(worker, world_size: int, *args):
    return run_on_ranks(worker, world_size, *args, what="your code",
                        advice="Post each step's send and receive together (dist.batch_isend_irecv, or isend and "
                               "irecv before waiting on either), on every rank, the same number of times.")


def _shards(case: Case, count: int = 3) -> list[torch.Tensor]:
    rank = dist.get_rank()
    return [shard(t, case.world_size, rank, case.layout) for t in case.tensors(count)]


def _forward_worker(fn, cases, kind):
    """On a rank: the student's forward on each case's shard; output, lse and what the comm log saw."""
    results = []
    for case in cases:
        q, k, v = _shards(case)
        before = comm.snapshot()
        with measure_work() as work:
            if kind == "ring":
                result = fn(q, k, v)
            else:
                result = fn(q, k, v, lambda r, c=case: layout_positions(c.seq_len, c.world_size, r, c.layout))
        out, lse = result if isinstance(result, (tuple, list)) and len(result) == 2 else (result, None)
        events = comm.since(before).events
        results.append({"out": out, "lse": lse, "events": [(op, size, start) for op, size, start, _ in events],
                        "computed": work.computed})
    return results


def _assemble(run, index: int, key: str, case: Case):
    shards = [rank_results[index][key] for rank_results in run]
    if any(not isinstance(s, torch.Tensor) for s in shards):
        return None
    return unshard([s.detach().float() for s in shards], case.layout)


def _owner(case: Case, token: int) -> int:
    return next(r for r in range(case.world_size)
                if token in layout_positions(case.seq_len, case.world_size, r, case.layout).tolist())


def _compare_shards(run, index: int, case: Case, name: str, expected: torch.Tensor, atol: float, missing: str,
                    hint) -> None:
    """Reassemble every rank's ``name`` shard and compare with ``expected``; ``hint(got)`` explains a mismatch."""
    got = _assemble(run, index, name, case)
    if got is None:
        raise CheckFailed(f"{case}: {missing}")
    if got.shape != expected.shape:
        raise CheckFailed(f"{case}: the shards of {name} assemble to shape {tuple(got.shape)}, expected "
                          f"{tuple(expected.shape)}")
    diff, where = max_difference(got, expected)
    if diff > atol:
        raise CheckFailed(f"{case}: rank {_owner(case, where[2])}'s {name} for token {where[2]} differs from full "
                          f"attention's by {diff:.3g}: {hint(got)}")


def _check_values(run, index: int, case: Case, hint: str) -> None:
    expected_out, expected_lse = _reference(*case.tensors(), case.causal)
    for name, expected in (("out", expected_out), ("lse", expected_lse)):
        _compare_shards(run, index, case, name, expected, ATOL,
                        "return (out, lse) from every rank, out [B, H, T/N, D] and lse [B, H, T/N]", lambda _: hint)


def _p2p_bytes(events) -> int:
    return sum(size for op, size, _ in events if op == "isend")


def _check_ring_messages(run, index: int, case: Case) -> None:
    expected = ring_bytes(case.batch, case.heads, case.seq_len, case.head_dim, case.world_size)
    block = expected // (case.world_size - 1)
    for rank, results in enumerate(run):
        events = results[index]["events"]
        others = sorted({op for op, _, _ in events} - {"isend", "irecv"})
        if others:
            raise CheckFailed(f"{case}: rank {rank} called {', '.join(others)}: ring attention passes K/V blocks to "
                              f"the right neighbour with point-to-point messages (batch_isend_irecv); a collective "
                              f"gathers all N blocks at once")
        sent = _p2p_bytes(events)
        if sent != expected:
            raise CheckFailed(f"{case}: rank {rank} sent {sent:,} bytes, expected {expected:,} = (N-1) K/V blocks of "
                              f"{block:,} bytes: send the block in hand once per step, and nothing after the last step")


def _check_overlap(run, case: Case) -> None:
    """Every transfer must be posted before the block in hand is computed (ordering, not timing)."""
    for rank in range(case.world_size):
        receives = [start for op, _, start in run[rank][0]["events"] if op == "irecv"]
        blocks = sorted(s.start for s in run.spans if s.rank == rank and s.label == "attention")
        if len(blocks) != case.world_size:
            raise CheckFailed(f"{case}: rank {rank} called attention_block {len(blocks)} times, expected "
                              f"{case.world_size} (one block per step): compute each block with attention_block")
        for step, receive in enumerate(receives):
            if receive > blocks[step]:
                raise CheckFailed(
                    f"{case}: on rank {rank} the receive of block {step + 1} was posted after block {step}'s compute "
                    f"began: post the next transfer (batch_isend_irecv) before attention_block and wait for it "
                    f"after, so the K/V transfer overlaps the compute")


def _worlds(rng: random.Random, **overrides) -> list[Case]:
    return [_case(rng, 2, **overrides), _case(rng, 4, **overrides)]


# ---------------------------------------------------------------- 7.3

def check_ring_forward(ring_attention_forward) -> str:
    """7.3: ``ring_attention_forward(q, k, v) -> (out, lse)`` on contiguous shards, no mask."""
    rng = random.Random(_seed() + 3)
    cases = _worlds(rng)
    for case in cases:
        case_drawn("7.3", world=case.world_size, heads=case.heads, batch=case.batch)
        run = _launch(_forward_worker, case.world_size, ring_attention_forward, [case], "ring")
        _check_ring_messages(run, 0, case)
        _check_values(run, 0, case, "after step i a rank holds the block of rank (rank - i) mod N; merge every "
                                    "block's (out, lse) into the running pair")
        _check_overlap(run, case)
    return ("N=2 and N=4: equal to SDPA on the full sequence, N-1 K/V blocks sent per rank, each transfer posted "
            "before the block in hand is computed")


# ---------------------------------------------------------------- 7.4

def _check_zigzag_positions(zigzag_positions, rng: random.Random) -> int:
    cases = 0
    for world in (1, 2, 3, 4, 8):
        seq_len = 2 * world * rng.randint(1, 4)
        for rank in sorted({0, world - 1, rng.randrange(world)}):
            expected = layout_positions(seq_len, world, rank, "zigzag").tolist()
            try:
                got = zigzag_positions(seq_len, world, rank)
            except ValueError as error:
                raise CheckFailed(f"zigzag_positions({seq_len}, {world}, {rank}) raised ValueError: {error}: "
                                  f"{seq_len} tokens do split into 2·{world} equal chunks, so the condition that "
                                  f"guards your raise is wrong") from None
            got = torch.as_tensor(got).flatten().tolist() if got is not None else None
            if got != expected:
                raise CheckFailed(f"zigzag_positions({seq_len}, {world}, {rank}) returned {got}, expected {expected}: "
                                  f"cut the sequence into 2·N chunks; rank r holds chunk r, then chunk 2N-1-r")
            cases += 1
    try:
        got = zigzag_positions(12, 4, 0)
    except ValueError:
        return cases
    raise CheckFailed(f"zigzag_positions(12, 4, 0) returned {got!r}: 12 tokens do not split into 2·4 equal chunks; "
                      f"raise a ValueError that names both numbers")


def _ideal_computed(case: Case, rank: int) -> int:
    """Scores one rank's causal ring must compute: every block through attention_block with positions."""
    q_pos = layout_positions(case.seq_len, case.world_size, rank, case.layout)
    with measure_work() as ideal:
        for source in range(case.world_size):
            k_pos = layout_positions(case.seq_len, case.world_size, source, case.layout)
            shape = (case.batch, case.heads)
            attention_block(torch.zeros(*shape, q_pos.numel(), 1), torch.zeros(*shape, k_pos.numel(), 1),
                            torch.zeros(*shape, k_pos.numel(), 1), q_pos, k_pos)
    return ideal.computed


def check_causal_ring(zigzag_positions, causal_ring_attention) -> str:
    """7.4: ``zigzag_positions(seq_len, world_size, rank)`` and
    ``causal_ring_attention(q, k, v, positions_of) -> (out, lse)``."""
    rng = random.Random(_seed() + 4)
    n_positions = _check_zigzag_positions(zigzag_positions, rng)
    layouts = ("contiguous", "zigzag", "striped")
    for world in (2, 4):
        cases = [_case(rng, world, causal=True, layout=layout) for layout in layouts]
        case_drawn("7.4", world=world, layouts=layouts)
        run = _launch(_forward_worker, world, causal_ring_attention, cases, "causal")
        for index, case in enumerate(cases):
            _check_ring_messages(run, index, case)
            _check_values(run, index, case, "mask each block with the positions of the rank it came from, "
                                            "positions_of((rank - step) % N), against your own queries' positions")
            for rank, results in enumerate(run):
                ideal = _ideal_computed(case, rank)
                if results[index]["computed"] > ideal:
                    raise CheckFailed(f"{case}: rank {rank} computed {results[index]['computed']:,} scores, more than "
                                      f"the {ideal:,} its causal blocks need: pass both blocks' positions to "
                                      f"attention_block so that fully masked blocks and tiles are skipped")
    return (f"{n_positions} zig-zag shards; causal ring on N=2 and N=4 with contiguous, zig-zag and striped layouts: "
            f"equal to causal SDPA, masked blocks skipped")


# ---------------------------------------------------------------- 7.5

def _backward_worker(function_class, cases):
    results = []
    for case in cases:
        q, k, v, dout = _shards(case, 4)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = function_class.apply(q, k, v, case.causal, case.layout)
        before = comm.snapshot()
        with p2p_waits_counted() as waits:
            out.backward(dout)
        events = comm.since(before).events
        ops = sorted({event[0] for event in events})
        results.append({"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "ops": ops,
                        "sent": sum(event[1] for event in events if event[0] == "isend"), "unwaited": waits.unwaited,
                        "posted": len(waits.posted)})
    return results


def _own_queries_only(case: Case, name: str) -> torch.Tensor:
    """dK or dV as if accumulators never travelled: each block gets only its owner's queries' share."""
    q, k, v, dout = case.tensors(4)
    shards = []
    for rank in range(case.world_size):
        positions = layout_positions(case.seq_len, case.world_size, rank, case.layout)
        mine = torch.zeros_like(dout).index_copy_(SEQ_DIM, positions, dout.index_select(SEQ_DIM, positions))
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        F.scaled_dot_product_attention(*inputs, is_causal=case.causal).backward(mine)
        shards.append(inputs[1 if name == "dk" else 2].grad.index_select(SEQ_DIM, positions))
    return unshard(shards, case.layout)


def _gradient_hint(run, index: int, case: Case, name: str, got: torch.Tensor, expected: torch.Tensor) -> str:
    if name == "dq":
        return "dQ of this rank's queries is the sum of every block's dq"
    if max_difference(got, _own_queries_only(case, name))[0] <= GRAD_ATOL:
        return (f"{name} holds only the owner's own queries' share: a block's dK/dV accumulator must travel around "
                f"the ring with it, collecting every rank's share, and come back to the block's owner")
    shards = [run[r][index][name] for r in range(case.world_size)]
    expected_shards = [shard(expected, case.world_size, r, case.layout) for r in range(case.world_size)]
    if all(max_difference(shards[r], expected_shards[(r + 1) % case.world_size])[0] <= GRAD_ATOL
           for r in range(case.world_size)):
        return ("rank r holds the complete dK/dV of block r+1: after the N-th step send the accumulator one more "
                "hop, home to the block's owner")
    return ("receive the block's accumulator from the left before adding this rank's share, then pass it right "
            "with its block; dK/dV of a fully masked block get nothing from this rank")


def check_ring_backward(function_class) -> str:
    """7.5: a ``torch.autograd.Function`` with ``apply(q, k, v, causal, layout)`` whose backward runs the ring."""
    rng = random.Random(_seed() + 5)
    plans = {2: [dict(causal=False, layout="contiguous"), dict(causal=True, layout="zigzag")],
             4: [dict(causal=True, layout="contiguous"), dict(causal=True, layout="zigzag"),
                 dict(causal=False, layout="striped")]}
    total = 0
    for world, settings in plans.items():
        cases = [_case(rng, world, **s) for s in settings]
        case_drawn("7.5", world=world, settings=settings)
        run = _launch(_backward_worker, world, function_class, cases)
        for index, case in enumerate(cases):
            q, k, v, dout = case.tensors(4)
            ref = [t.clone().requires_grad_() for t in (q, k, v)]
            out = F.scaled_dot_product_attention(*ref, is_causal=case.causal)
            out.backward(dout)
            got_out = _assemble(run, index, "out", case)
            if got_out is None:
                raise CheckFailed(f"{case}: forward must return the attention output tensor")
            assert_close(str(case), "out", got_out, out.detach(), hint="forward must equal full attention")
            for rank, result in enumerate(run):
                others = sorted(set(result[index]["ops"]) - {"isend", "irecv"})
                if others:
                    raise CheckFailed(f"{case}: rank {rank}'s backward called {', '.join(others)}: K/V and their "
                                      f"dK/dV accumulators travel around the ring with point-to-point messages")
                if result[index]["unwaited"]:
                    raise CheckFailed(f"{case}: rank {rank}'s backward returned with {result[index]['unwaited']} of "
                                      f"its {result[index]['posted']} sends and receives never waited for: wait for "
                                      f"each pass before reading what it received (the last accumulator's too)")
            for name, expected in (("dq", ref[0].grad), ("dk", ref[1].grad), ("dv", ref[2].grad)):
                _compare_shards(run, index, case, name, expected, GRAD_ATOL,
                                f"{name} is None: backward must return (dq, dk, dv, None, None), one gradient per "
                                f"input of forward",
                                lambda got, n=name, e=expected: _gradient_hint(run, index, case, n, got, e))
            # after the values: a wrong gradient's hint says what the accumulators hold, which says more than a
            # byte count; right values sent with passes too many or too few are told by the count
            backward = ring_bytes(case.batch, case.heads, case.seq_len, case.head_dim, case.world_size,
                                  backward=True) - ring_bytes(case.batch, case.heads, case.seq_len, case.head_dim,
                                                              case.world_size)
            for rank, result in enumerate(run):
                if result[index]["sent"] != backward:
                    block = backward // (2 * case.world_size - 1)
                    raise CheckFailed(f"{case}: rank {rank}'s backward sent {result[index]['sent']:,} bytes, expected "
                                      f"{backward:,} = N-1 K/V passes and N dK/dV passes of {block:,} bytes: pass "
                                      f"K/V on only while a block is still to come, and each accumulator once a step")
            total += 1
    return f"{total} cases on N=2 and N=4, causal and not, three layouts: output and dQ, dK, dV equal SDPA's"


# ---------------------------------------------------------------- 7.6

def _ulysses_worker(fn, cases, bad_case):
    results = []
    for case in cases:
        q, k, v = _shards(case)
        before = comm.snapshot()
        out = fn(q, k, v, case.causal)
        events = comm.since(before).events
        results.append({"out": out, "events": [(op, size, start) for op, size, start, _ in events]})
    q, k, v = _shards(bad_case)
    try:
        fn(q, k, v, bad_case.causal)
        refused = None
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 - reported to the student as what went wrong
        refused = (type(error).__name__, first_line(error))
    return {"results": results, "refused": refused}


def check_ulysses(ulysses_attention) -> str:
    """7.6: ``ulysses_attention(q, k, v, causal) -> out`` with two all-to-alls each way."""
    rng = random.Random(_seed() + 6)
    for world in (2, 4):
        cases = [_case(rng, world, heads=world * rng.randint(1, 2), causal=causal) for causal in (False, True)]
        bad = _case(rng, world, heads=world + 1)
        case_drawn("7.6", world=world, heads=[c.heads for c in cases], causal=[c.causal for c in cases], bad=bad.heads)
        try:
            run = _launch(_ulysses_worker, world, ulysses_attention, cases, bad)
        except RankFailed as error:
            if getattr(error, "exc_type", "") != "ValueError" or slip_of(error) is not None:
                raise
            raise CheckFailed(f"N={world}, heads {[c.heads for c in cases]}: {first_line(error)}: these head counts "
                              f"divide by N, so the condition that guards your raise is wrong") from None
        for index, case in enumerate(cases):
            shards = [r["results"][index]["out"] for r in run]
            if any(not isinstance(s, torch.Tensor) for s in shards):
                raise CheckFailed(f"{case}: return the output shard [B, H, T/N, D] on every rank")
            want = (case.batch, case.heads, case.seq_len // world, case.head_dim)
            odd = next((r for r, s in enumerate(shards) if tuple(s.shape) != want), None)
            if odd is not None:
                raise CheckFailed(f"{case}: rank {odd} returned a shard of shape {tuple(shards[odd].shape)}, expected "
                                  f"{want} = [B, H, T/N, D], q's own layout: heads_to_seq must end by reshaping the "
                                  f"received head groups to (b, h, t, d), batch first, then heads, then tokens")
            expected, _ = _reference(*case.tensors(), case.causal)
            got = unshard([s.detach().float() for s in shards], "contiguous")
            assert_close(str(case), "out", got, expected,
                         hint="after the first all-to-all a rank holds all T tokens of H/N heads, sequence chunks "
                              "in rank order; the second all-to-all sends sequence chunk j of every head back to "
                              "rank j")
            expected_bytes = ulysses_bytes(case.batch, case.heads, case.seq_len, case.head_dim, world)
            for rank, result in enumerate(run):
                events = result["results"][index]["events"]
                others = sorted({op for op, _, _ in events} - {"all_to_all_single", "all_to_all"})
                if others:
                    raise CheckFailed(f"{case}: rank {rank} called {', '.join(others)}: Ulysses moves data with "
                                      f"all-to-alls only (sequence shards to head shards and back)")
                shard_bytes = case.batch * case.heads * case.seq_len // world * case.head_dim * 4
                payload = sum(size for _, size, _ in events)
                if payload != 4 * shard_bytes:
                    raise CheckFailed(f"{case}: rank {rank}'s all-to-alls carried {payload:,} bytes, expected "
                                      f"{4 * shard_bytes:,} = 4 × its shard (Q, K, V in, the output back; "
                                      f"{expected_bytes:,.0f} of them leave the rank)")
        refusal = run[0]["refused"]
        if refusal is None or refusal[0] != "ValueError":
            raise CheckFailed(f"{bad}: {bad.heads} heads on {world} ranks cannot be split into whole heads, yet "
                              + ("it ran without error" if refusal is None else f"it raised {refusal[0]}: {refusal[1]}")
                              + ": raise a ValueError naming the heads and the ranks before any all-to-all")
    return "N=2 and N=4, causal and not: equal to SDPA with 4 all-to-alls of the shard; heads % N != 0 refused"


# ---------------------------------------------------------------- quiz


_Q_SHAPE = (1, 32, 8192, 128)  # batch, heads, tokens, head size of the byte questions: their ratios do not depend on it


def _q_blocks_sent(n: int) -> float:
    """K/V blocks one rank sends in ring forward on ``n`` ranks: its bytes over one shard's K and V."""
    batch, heads, seq_len, head_dim = _Q_SHAPE
    return ring_bytes(*_Q_SHAPE, n, bytes_per_value=2) / (2 * batch * heads * (seq_len // n) * head_dim * 2)


def _q_bytes_ratio(n: int) -> float:
    return ring_bytes(*_Q_SHAPE, n, bytes_per_value=2) / ulysses_bytes(*_Q_SHAPE, n, bytes_per_value=2)


def _q_checkpointed_gib(thousands: int, cp: int) -> float:
    """``thousands``k tokens (1024 each, as "128k" means 131072) of the 70B preset over ``cp`` ranks."""
    model = PRESETS["70B"]
    per_layer = activation_bytes_per_layer(thousands * 1024 // cp, 1, model.d_model, model.n_head, checkpointing=True)
    return model.n_layer * per_layer / GiB


def _q_hidden_tokens(heads: int, kv_heads: int) -> float:
    return hidden_transfer_tokens(PEAK_FLOPS["H100 SXM bf16"], 450e9, bytes_per_value=2, heads=heads,
                                  kv_heads=kv_heads)


# The boundaries each exercise's text names (harness.Edge; tests/grading/test_reference_seeds.py checks every seed's
# cases hold each): 7.1's uneven blocks, a max that keeps rising and scores past exp()'s fp32 range (88); 7.2's part
# that sees no key and both parts empty (-inf, -inf), the last block shorter, causal and not; 7.3-7.5 on N = 2 and
# 4, 7.4's contiguous, zig-zag and striped layouts, 7.5 causal and not; 7.6 heads a multiple of N (and a head count
# that is not, which must be refused), causal and not.
EDGES = {
    "7.1": [Edge("key blocks of uneven sizes", lambda c: len(set(c["sizes"])) > 1),
            Edge("a max that keeps rising", lambda c: c["kind"] == "rising max"),
            Edge("scores past exp()'s fp32 range", lambda c: c["largest"] > 88.72)],
    "7.2": [Edge("a part that sees no key", lambda c: c.get("merge") == "one part sees nothing"),
            Edge("no part sees anything", lambda c: c.get("merge") == "no part sees anything"),
            Edge("a last block shorter than block_size", lambda c: "tokens" in c and c["tokens"] % c["block"] != 0),
            Edge("a last block of one token", lambda c: "tokens" in c and c["tokens"] % c["block"] == 1),
            Edge("causal", lambda c: c.get("causal") is True), Edge("no mask", lambda c: c.get("causal") is False)],
    "7.3": [Edge("N = 2", lambda c: c["world"] == 2), Edge("N = 4", lambda c: c["world"] == 4)],
    "7.4": [Edge(f"N = {n}, {layout}", lambda c, n=n, layout=layout: c["world"] == n and layout in c["layouts"])
            for n in (2, 4) for layout in ("contiguous", "zigzag", "striped")],
    "7.5": [Edge("N = 2", lambda c: c["world"] == 2), Edge("N = 4", lambda c: c["world"] == 4),
            Edge("causal", lambda c: any(s["causal"] for s in c["settings"])),
            Edge("no mask", lambda c: any(not s["causal"] for s in c["settings"]))],
    "7.6": [Edge("N = 2", lambda c: c["world"] == 2), Edge("N = 4", lambda c: c["world"] == 4),
            Edge("causal and not", lambda c: set(c["causal"]) == {True, False}),
            Edge("heads not a multiple of N (refused)", lambda c: c["bad"] % c["world"] != 0)],
}

# Surviving mutants of the solution cells that change nothing the exercises ask for (distlab notebooks
# mutants): key, as benchmarks/results/mutants.txt names it → why it is equivalent.
# Why a guard on world > 1 in 7.5 decides nothing the exercise asks.
_RING_OF_TWO = ("the exercise runs the ring on N >= 2 ranks (its edges are N = 2 and N = 4; a ring of one rank is "
                "plain attention, no context parallelism), where world > 1 always holds")

EQUIVALENT_MUTANTS = {
    '7.1 arguments-swapped: `k_block.transpose(-2, -1)` → `k_block.transpose(-1, -2)`':
        'transpose(a, b) and transpose(b, a) are the same operation',
    '7.1 arguments-swapped: `torch.maximum(m, s.amax(dim=-1))` → `torch.maximum(s.amax(dim=-1), m)`':
        'torch.maximum is symmetric',
    '7.1 arithmetic: `-2` → `(2)`':
        'q and the key blocks are [batch, heads, tokens, head_dim]: dim 2 is dim -2',
    '7.1 statements-swapped: `l = l * rescale + p.sum(-1) acc = acc * rescale.unsqueeze(-1) + p @ v…` → `acc = acc * '
    'rescale.unsqueeze(-1) + p @ v_block l = l * rescale + p.s…`':
        "two statements that do not read each other's names, in the other order",
    '7.2 arguments-swapped: `min(k_start + block_size, k.shape[2])` → `min(k.shape[2], k_start + block_size)`':
        'min is symmetric',
    '7.2 arguments-swapped: `min(q_start + block_size, q.shape[2])` → `min(q.shape[2], q_start + block_size)`':
        'min is symmetric',
    '7.2 compare: `k_start >= q_stop` → `k_start > q_stop`':
        'the key block that starts at q_stop is entirely in the future of the query block: computing it (every score '
        'masked, lse -inf) merges with weight exp(-inf) = 0, so stopping one block later changes nothing but time',
    '7.2 off-by-one: `range(0, q.shape[2], block_size)` → `range(0, q.shape[2] + 1, block_size)`':
        'the extra start q.shape[2] appears only when it is a multiple of block_size, and its query block is empty: '
        'nothing is added to the concatenation',
    '7.2 statements-swapped: `q_pos = torch.arange(q_start, q_stop) if causal else None out = lse =…` → `out = lse = '
    'None q_pos = torch.arange(q_start, q_stop) if causal else…`':
        "two statements that do not read each other's names, in the other order",
    '7.3 statements-swapped: `for request in requests: request.wait() kv = incoming` → `kv = incoming for request in '
    'requests: request.wait()`':
        'the receive buffer is named before the wait instead of after: it is read only after the wait, so the same '
        'values',
    '7.3 statements-swapped: `out, lse = block if out is None else merge_attention(out, lse, *block…` → `if step < '
    'world - 1: for request in requests: request.wait() kv = inc…`':
        'the wait for the next block comes before this block is merged instead of after: the merge reads neither '
        'the buffer in flight nor kv',
    '7.3 statements-swapped: `right, left = (rank + 1) % world, (rank - 1) % world kv = torch.stack…` → `kv = '
    'torch.stack([k, v]) right, left = (rank + 1) % world, (rank - 1)…`':
        "two statements that do not read each other's names, in the other order",
    '7.4 statements-swapped: `chunk = seq_len // (2 * world_size) late = 2 * world_size - 1 - rank` → `late = 2 * '
    'world_size - 1 - rank chunk = seq_len // (2 * world_size)`':
        "two statements that do not read each other's names, in the other order",
    '7.4 statements-swapped: `for request in requests: request.wait() kv = incoming` → `kv = incoming for request in '
    'requests: request.wait()`':
        'the receive buffer is named before the wait instead of after: it is read only after the wait, so the same '
        'values',
    '7.4 statements-swapped: `if step < world - 1: incoming = torch.empty_like(kv) requests = dist.…` → `k_pos = '
    'positions_of((rank - step) % world) if step < world - 1: inco…`':
        "two statements that do not read each other's names, in the other order",
    '7.4 statements-swapped: `kv = torch.stack([k, v]) out = lse = None` → `out = lse = None kv = torch.stack([k, '
    'v])`':
        "two statements that do not read each other's names, in the other order",
    '7.4 statements-swapped: `q_pos = positions_of(rank) kv = torch.stack([k, v])` → `kv = torch.stack([k, v]) q_pos '
    '= positions_of(rank)`':
        "two statements that do not read each other's names, in the other order",
    '7.5 statements-swapped: `delta = (dout * out).sum(-1) dq = torch.zeros_like(q)` → `dq = torch.zeros_like(q) '
    'delta = (dout * out).sum(-1)`':
        "two statements that do not read each other's names, in the other order",
    '7.5 statements-swapped: `for request in grad_requests: request.wait() dkv = dkv_incoming` → `dkv = dkv_incoming '
    'for request in grad_requests: request.wait()`':
        'the receive buffer is named before the wait instead of after: it is read only after the wait, so the same '
        'values',
    '7.5 statements-swapped: `for request in grad_requests: request.wait() dkv = dkv_incoming` → `dkv = dkv_incoming '
    'for request in grad_requests: request.wait()` #2':
        'the receive buffer is named before the wait instead of after: it is read only after the wait, so the same '
        'values',
    '7.5 statements-swapped: `for request in kv_requests: request.wait() kv = incoming` → `kv = incoming for request '
    'in kv_requests: request.wait()`':
        'the receive buffer is named before the wait instead of after: it is read only after the wait, so the same '
        'values',
    '7.5 compare: `world > 1` → `world >= 1`':
        _RING_OF_TWO,
    '7.5 guard-removed: `world > 1` → `True`':
        _RING_OF_TWO,
    '7.5 guard-removed: `world > 1` → `True` #2':
        _RING_OF_TWO,
    '7.5 off-by-one: `1` → `0`':
        _RING_OF_TWO + ': world > 0 holds as well',
    '7.5 off-by-one: `8` → `7`':
        'the accumulators ride on the K/V ring\'s tag 7: every rank posts its K/V pass and its accumulator pass in '
        'the same order, and gloo pairs the messages of one tag from one peer in the order they are posted, so '
        'the two never mix (the separate tag is a margin, NCCL ignores tags and keeps order)',
    "7.5 statements-swapped: `dq += dq_part if step > 0: # this block's accumulator arrives from th…` → `if step > 0: "
    "# this block's accumulator arrives from the left for req…`":
        'dq and the arriving accumulator are independent: adding dq_part before or after waiting for dK/dV gives '
        'the same values',
    '7.5 statements-swapped: `if world > 1: dkv_incoming = torch.empty_like(dkv) grad_requests = ri…` → `if step < '
    'world - 1: for request in kv_requests: request.wait() kv = …`':
        'the next K/V block is waited for before the accumulator\'s pass is posted instead of after: both were '
        'posted before this step\'s compute, so the same values and the same overlap with it',
    '7.6 arguments-swapped: `recv.permute(1, 2, 0, 3, 4).reshape(b, h // world, world * t, d)` → `recv.permute(1, 2, '
    '0, 3, 4).reshape(h // world, b, world * t, d)`':
        'the two leading dims only label the (batch, head) slices of the same memory: SDPA attends within each [T, D] '
        'slice, and heads_to_seq reshapes that memory back in the same order, so the values are the same',
    '7.6 arguments-swapped: `recv.transpose(0, 1)` → `recv.transpose(1, 0)`':
        'transpose(a, b) and transpose(b, a) are the same operation',
}

EXERCISES = [
    Exercise("7.1", "online softmax over streaming key blocks", 2, check_online_softmax,
             references=("distlab.context_parallel.blocks.online_softmax_attention",)),
    Exercise("7.2", "merge partial attention by log-sum-exp; blockwise", 2, check_merge_and_blockwise,
             references=("distlab.context_parallel.blocks.blockwise_attention",
                         "distlab.context_parallel.blocks.merge_attention")),
    Exercise("7.3", "ring attention forward with overlapped K/V passes", 3, check_ring_forward,
             references=("distlab.context_parallel.ring.ring_attention",
                         "distlab.context_parallel.ring.ring_attention_forward")),
    Exercise("7.4", "causal ring attention and the zig-zag layout", 3, check_causal_ring,
             references=("distlab.context_parallel.ring.ring_attention",
                         "distlab.context_parallel.ring.ring_attention_forward")),
    Exercise("7.5", "ring attention backward: dK/dV around the ring", 4, check_ring_backward),
    Exercise("7.6", "DeepSpeed-Ulysses all-to-all attention", 3, check_ulysses,
             references=("distlab.context_parallel.ulysses.ulysses_attention",)),
    quiz.number("Q7.1", "K/V blocks a rank sends in ring forward, N={n}", rel_tol=0, given=dict(n=8),
                vary=dict(n=(2, 4, 16, 32, 64)), solve=_q_blocks_sent,
                wrong={"N: a block sent after the last step too": lambda n: n,
                       "2(N - 1): K and V counted as separate blocks": lambda n: 2 * (n - 1)},
                hint="count the steps at which a block leaves the rank (section 'Exercise 7.3 — ring attention')"),
    # rel_tol 0.005 and N ≤ 32: at N = 64 the answer, 1.984, is within 0.8% of the limit 2, which then passes
    quiz.number("Q7.2", "contiguous causal ring, N={n}: slowest rank's work / mean", rel_tol=0.005, given=dict(n=8),
                vary=dict(n=(2, 4, 16, 32)),
                solve=lambda n: (n - 1 / 2) / (n / 2),  # rank r: r full blocks and half the diagonal one
                wrong={"2, the limit for a long ring": lambda n: 2,
                       "(N - 1)/(N/2): the diagonal block left out": lambda n: (n - 1) / (n / 2),
                       "slowest/fastest, (N - 1/2)/(1/2)": lambda n: 2 * n - 1},
                hint="count the blocks each rank computes (section 'Causal masks: skipped blocks and unequal work')"),
    quiz.number("Q7.3", "ring forward bytes / Ulysses forward bytes per rank, N={n}", rel_tol=0.005, given=dict(n=8),
                vary=dict(n=(2, 4, 16, 32, 64)), solve=_q_bytes_ratio,
                wrong={"(N - 1)/2: an all-to-all counted as the whole shard, not (N - 1)/N": lambda n: (n - 1) / 2,
                       "N/4: K and V counted as one tensor": lambda n: n / 4},
                hint="section 'Bytes: ring against Ulysses'"),
    quiz.number("Q7.4", "largest Ulysses degree for {heads} query heads, {kv_heads} K/V heads", rel_tol=0,
                given=dict(heads=64, kv_heads=8), vary=dict(heads=(32, 48, 96, 128), kv_heads=(2, 4, 16)),
                solve=lambda heads, kv_heads: math.gcd(heads, kv_heads),  # whole query and K/V heads per rank
                wrong={"the query heads alone": lambda heads, kv_heads: heads},
                hint="section 'Exercise 7.6 — DeepSpeed-Ulysses' and 'When each wins'"),
    quiz.number("Q7.5", "tokens per rank to hide a ring step over 450 GB/s NVLink on an H100, {heads} query heads, "
                "{kv_heads} K/V heads", rel_tol=0.02, given=dict(heads=32, kv_heads=8),
                # K/V heads fewer than query heads in every variant: 16 of each would not be grouped-query attention
                vary=dict(heads=(16, 64, 128), kv_heads=(2, 4)), solve=_q_hidden_tokens,
                wrong={"without grouped-query attention's H_kv/H": lambda heads, kv_heads: _q_hidden_tokens(1, 1),
                       "H/H_kv instead of H_kv/H":
                           lambda heads, kv_heads: _q_hidden_tokens(1, 1) * heads / kv_heads,
                       "NVLink's 900 GB/s both ways": lambda heads, kv_heads: _q_hidden_tokens(heads, kv_heads) / 2},
                hint="compare one step's FLOPs with its bytes, and count which heads each belongs to (section "
                     "'When each wins')"),
    quiz.number("Q7.6", "GiB of checkpointed layer inputs per GPU, 70B, {thousands}k tokens, CP={cp}", rel_tol=0.02,
                given=dict(thousands=128, cp=32), vary=dict(thousands=(32, 64, 256, 512), cp=(8, 16, 64)),
                solve=_q_checkpointed_gib,
                wrong={"GB (10^9 bytes), not GiB": lambda thousands, cp: _q_checkpointed_gib(thousands, cp) * GiB / 1e9,
                       "fp32 layer inputs": lambda thousands, cp: 2 * _q_checkpointed_gib(thousands, cp),
                       "34·sbh, no checkpointing": lambda thousands, cp: 17 * _q_checkpointed_gib(thousands, cp)},
                hint="what full checkpointing keeps per layer, for one rank's tokens (section "
                     "'At scale: 128k tokens of a 70B model')"),
    quiz.choice("Q7.7", "ring attention or Ulysses", "c", "abc",
                hint="section 'When each wins'"),
]
