"""Context parallelism: blocks, merges, layouts and the cost model in one process; ring, Ulysses and USP on
real ranks against full attention, forward and backward; the lab 07 checkers against right and wrong answers."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import distlab
from distlab import context_parallel as cp
from distlab.grading import CheckFailed, lab07

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_thread")]  # tiny ops: one thread is fastest


@pytest.fixture
def ranks_ended(no_leftover_ranks):
    """Tests share warm groups within themselves; every group is ended before no_leftover_ranks looks."""
    yield
    distlab.shutdown()


def _qkv(shape, seed=0, count=3):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for _ in range(count)]


# ---------------------------------------------------------------- one process

@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_layouts_cover_every_token_once_and_shard_round_trips(layout, world):
    seq_len = 2 * world * 3
    positions = torch.cat([cp.layout_positions(seq_len, world, r, layout) for r in range(world)])
    assert sorted(positions.tolist()) == list(range(seq_len))
    x = _qkv((2, 3, seq_len, 4), count=1)[0]
    shards = [cp.shard(x, world, r, layout) for r in range(world)]
    assert all(s.shape[2] == seq_len // world for s in shards)
    assert torch.equal(cp.unshard(shards, layout), x)


def test_zigzag_pairs_an_early_chunk_with_a_late_one_and_bad_sizes_are_refused():
    assert [cp.layout_positions(16, 4, r, "zigzag").tolist() for r in (0, 3)] == [[0, 1, 14, 15], [6, 7, 8, 9]]
    assert cp.layout_positions(8, 4, 1, "striped").tolist() == [1, 5]
    with pytest.raises(ValueError, match=r"sequence length 12 is not divisible by 2·world_size = 8 for the zigzag"):
        cp.layout_positions(12, 4, 0, "zigzag")
    with pytest.raises(ValueError, match="not divisible by world_size = 3"):
        cp.layout_positions(10, 3, 0, "contiguous")
    with pytest.raises(ValueError, match="layout must be one of"):
        cp.layout_positions(8, 2, 0, "diagonal")


def test_attention_block_is_sdpa_with_its_log_sum_exp_and_a_causal_mask_by_positions():
    q, k, v = _qkv((2, 3, 40, 8))
    out, lse = cp.attention_block(q, k, v)
    assert (out - F.scaled_dot_product_attention(q, k, v)).abs().max() <= 1e-6
    assert (lse - torch.logsumexp(q @ k.transpose(-2, -1) / math.sqrt(8), -1)).abs().max() <= 1e-5
    pos = torch.arange(40)
    out, _ = cp.attention_block(q, k, v, pos, pos)
    assert (out - F.scaled_dot_product_attention(q, k, v, is_causal=True)).abs().max() <= 1e-6
    out, lse = cp.attention_block(q, k, v, pos, pos + 40)  # every key after every query
    assert out.eq(0).all() and torch.isneginf(lse).all()


def test_merge_is_exact_and_a_part_that_saw_nothing_weighs_zero():
    q, k, v = _qkv((1, 2, 12, 8))
    parts = [cp.attention_block(q, k[:, :, a:b], v[:, :, a:b]) for a, b in ((0, 5), (5, 12))]
    out, lse = cp.merge_attention(*parts[0], *parts[1])
    assert (out - F.scaled_dot_product_attention(q, k, v)).abs().max() <= 1e-6
    empty = (torch.zeros_like(out), torch.full_like(lse, -math.inf))
    assert torch.equal(cp.merge_attention(*empty, out, lse)[0], out)
    both = cp.merge_attention(*empty, *empty)
    assert both[0].eq(0).all() and torch.isneginf(both[1]).all()


def test_online_softmax_and_blockwise_equal_sdpa_even_with_huge_scores():
    q, k, v = _qkv((2, 2, 24, 8))
    big = q * 40  # scores of several hundred
    out, lse = cp.online_softmax_attention(big, iter(k.split([5, 9, 10], 2)), iter(v.split([5, 9, 10], 2)))
    assert torch.isfinite(out).all() and (out - F.scaled_dot_product_attention(big, k, v)).abs().max() <= 1e-5
    for causal in (False, True):
        with cp.measure_work() as work:
            out, _ = cp.blockwise_attention(q, k, v, block_size=7, causal=causal)
        assert (out - F.scaled_dot_product_attention(q, k, v, is_causal=causal)).abs().max() <= 1e-6
        assert (work.computed < 2 * 2 * 24 * 24) == causal  # causal: blocks above the diagonal skipped


def test_block_backward_is_autograd_of_attention():
    q, k, v, dout = _qkv((1, 2, 20, 8), count=4)
    for causal in (False, True):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*inputs, is_causal=causal)
        out.backward(dout)
        pos = torch.arange(20) if causal else None
        ours, lse = cp.attention_block(q, k, v, pos, pos)
        grads = cp.attention_block_backward(q, k, v, dout, lse, (dout * ours).sum(-1), pos, pos)
        assert max((g - t.grad).abs().max().item() for g, t in zip(grads, inputs)) <= 1e-5


def test_work_per_rank_contiguous_is_lopsided_zigzag_even_striped_even_but_larger():
    """Exact score counts of each rank's causal ring, computed in one process block by block."""
    seq_len, world = 1024, 4
    computed = {}
    for layout in cp.LAYOUTS:
        per_rank = []
        for rank in range(world):
            q_pos = cp.layout_positions(seq_len, world, rank, layout)
            with cp.measure_work() as work:
                for source in range(world):
                    k_pos = cp.layout_positions(seq_len, world, source, layout)
                    cp.attention_block(torch.zeros(1, 1, 256, 1), torch.zeros(1, 1, 256, 1), torch.zeros(1, 1, 256, 1),
                                       q_pos, k_pos)
            per_rank.append(work.computed)
            assert work.useful <= work.computed
        computed[layout] = per_rank
    assert computed["contiguous"] == sorted(computed["contiguous"]) and max(computed["contiguous"]) > 5 * min(
        computed["contiguous"])
    assert len(set(computed["zigzag"])) == 1 and len(set(computed["striped"])) == 1
    assert sum(computed["zigzag"]) == sum(computed["contiguous"]) < sum(computed["striped"])


def test_cost_model():
    # N=4, 1x2 heads, 64 tokens, dim 8, fp32: a rank's K/V block is 2*2*16*8*4 = 2048 bytes
    assert cp.ring_bytes(1, 2, 64, 8, 4) == 3 * 2048
    assert cp.ring_bytes(1, 2, 64, 8, 4, backward=True) == (3 + 3 + 4) * 2048
    assert cp.ring_bytes(1, 2, 64, 8, 1, backward=True) == 0
    assert cp.ulysses_bytes(1, 2, 64, 8, 4) == 4 * 3 / 4 * 1024
    shape = (1, 32, 8192, 128)
    assert cp.ring_bytes(*shape, 8) / cp.ulysses_bytes(*shape, 8) == pytest.approx(4.0)  # N/2
    assert cp.hidden_transfer_tokens(1e15, 50e9, bytes_per_value=2) == pytest.approx(20_000)


def test_hidden_transfer_threshold_counts_kv_heads_against_query_heads():
    """Grouped-query attention: FLOPs scale with the query heads, the ring's bytes with the K/V heads, so the
    lab's 70B (64 query heads, 8 K/V heads) hides its transfer from 8x fewer tokens (issue 26 item 7)."""
    mha = cp.hidden_transfer_tokens(1e15, 50e9, bytes_per_value=2)
    assert cp.hidden_transfer_tokens(1e15, 50e9, bytes_per_value=2, heads=64) == pytest.approx(mha)
    assert cp.hidden_transfer_tokens(1e15, 50e9, bytes_per_value=2, heads=64, kv_heads=8) == pytest.approx(mha / 8)
    # the threshold is where compute time equals transfer time, per rank and step, all heads counted
    heads, kv, d, e, flops, beta = 64, 8, 128, 2, 1e15, 50e9
    threshold = cp.hidden_transfer_tokens(flops, beta, bytes_per_value=e, heads=heads, kv_heads=kv)
    compute, transfer = (4 * threshold**2 * d * heads / flops, 2 * threshold * d * kv * e / beta)
    assert compute == pytest.approx(transfer) and threshold == pytest.approx(2500)
    with pytest.raises(ValueError, match="kv_heads=3 must divide heads=64"):
        cp.hidden_transfer_tokens(1e15, 50e9, heads=64, kv_heads=3)


def test_peak_memory_counts_what_is_alive_at_once():
    with cp.PeakMemory() as peak:
        a = torch.empty(2**18)  # 1 MiB
        del a
        b = torch.empty(2**18)
        c = torch.empty(2**18)
    del b, c
    assert peak.bytes == 2 * 2**20


# ---------------------------------------------------------------- on ranks

METHODS = [("ring", "contiguous"), ("ring", "zigzag"), ("ring", "striped"), ("ulysses", "contiguous"),
           ("usp", "zigzag")]


def _verify_all(world):
    rows = []
    for method, layout in METHODS:
        if method == "usp" and world < 4:
            continue
        for causal in (False, True):
            rows.append(cp.verify(method, batch=2, heads=4, seq_len=64, head_dim=8, causal=causal, layout=layout,
                                  ulysses_size=2))
    return rows


@pytest.mark.usefixtures("ranks_ended")
@pytest.mark.parametrize("world", [1, 2, 4])
def test_ring_ulysses_and_usp_equal_full_attention_forward_and_backward(world):
    run = distlab.launch(_verify_all, world, args=(world,), warm=True, show_output=False)
    for i, row in enumerate(run[0]):
        what = f"N={world} {row['method']} {row['layout']} causal={row['causal']}"
        assert max(r[i]["forward_error"] for r in run) <= 1e-5, what
        assert max(r[i]["grad_error"] for r in run) <= 1e-4, what
        if row["method"] == "ring":
            assert all(r[i]["bytes_sent"] == cp.ring_bytes(2, 4, 64, 8, world, backward=True) for r in run), what
        if row["method"] == "ulysses":
            assert all(r[i]["bytes_sent"] == cp.ulysses_bytes(2, 4, 64, 8, world, backward=True) for r in run), what
        if row["method"] == "usp":
            expected = cp.ulysses_bytes(2, 4, 32, 8, 2, backward=True) + cp.ring_bytes(2, 2, 64, 8, 2, backward=True)
            assert all(r[i]["bytes_sent"] == expected for r in run), what


def _overlap_and_bad_input():
    q, k, v = (cp.shard(t, dist.get_world_size(), dist.get_rank()) for t in _qkv((1, 2, 64, 8)))
    for overlap in (True, False):
        dist.barrier()
        cp.ring_attention_forward(q, k, v, overlap=overlap)
    errors = []
    for bad in (lambda: cp.ring_attention_forward(q[:, :, :3], k[:, :, :3], v[:, :, :3], True, "zigzag"),
                lambda: cp.ulysses_attention(q[:, :1], k[:, :1], v[:, :1]),
                lambda: cp.usp_groups(3)):
        try:
            bad()
        except ValueError as error:
            errors.append(str(error))
    return errors


@pytest.mark.usefixtures("ranks_ended")
def test_transfers_posted_before_compute_only_when_overlapped_and_bad_shapes_refused():
    run = distlab.launch(_overlap_and_bad_input, 2, warm=True, show_output=False)
    for rank in range(2):
        receives = sorted(s.start for s in run.spans if s.rank == rank and s.label == "irecv")
        blocks = sorted(s.start for s in run.spans if s.rank == rank and s.label == "attention")
        assert len(receives) == 2 and len(blocks) == 4
        assert receives[0] < blocks[0]  # overlapped: the next block is on the wire during compute
        assert receives[1] > blocks[2]  # serial: posted after the block's compute began
    messages = run[0]
    assert len(messages) == 3
    assert "sequence length 6 is not divisible by 2·world_size = 4" in messages[0]
    assert "number of heads (1) to be divisible by the number of ranks (2)" in messages[1]
    assert "world size 2 is not divisible by the Ulysses degree 3" in messages[2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.usefixtures("ranks_ended")
def test_one_nccl_rank_on_a_gpu_is_exact():
    rows = distlab.launch(_verify_all, 1, args=(1,), backend="nccl", show_output=False)[0]
    assert all(r["device"].startswith("cuda") and r["forward_error"] <= 1e-5 and r["grad_error"] <= 1e-4 for r in rows)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.usefixtures("ranks_ended")
def test_two_nccl_ranks_are_exact():
    run = distlab.launch(_verify_all, 2, args=(2,), backend="nccl", show_output=False)
    assert all(r["forward_error"] <= 1e-5 and r["grad_error"] <= 1e-4 for rows in run for r in rows)


# ---------------------------------------------------------------- checkers: student-like answers

def zigzag_positions(seq_len, world_size, rank):
    return cp.layout_positions(seq_len, world_size, rank, "zigzag")


def causal_ring(q, k, v, positions_of, own_positions_only=False):
    rank, world = dist.get_rank(), dist.get_world_size()
    q_pos, kv, out, lse = positions_of(rank), torch.stack([k, v]), None, None
    for step in range(world):
        if step < world - 1:
            incoming = torch.empty_like(kv)
            requests = cp.ring_pass(kv, incoming)
        k_pos = q_pos if own_positions_only else positions_of((rank - step) % world)
        block = cp.attention_block(q, kv[0], kv[1], q_pos, k_pos)
        out, lse = block if out is None else cp.merge_attention(out, lse, *block)
        if step < world - 1:
            for request in requests:
                request.wait()
            kv = incoming
    return out, lse


def _ring_backward(dout, q, k, v, out, lse, causal, layout, travel=True, last_hop=True):
    """Student-like ring backward with two classic bugs behind flags."""
    rank, world = dist.get_rank(), dist.get_world_size()
    positions = (lambda r: cp.layout_positions(q.shape[2] * world, world, r, layout)) if causal else (lambda r: None)
    delta = (dout * out).sum(-1)
    dq, kv = torch.zeros_like(q), torch.stack([k, v])
    dkv = torch.zeros_like(kv)
    own = None
    grad_requests, dkv_incoming = [], None  # set by the previous step's ring_pass, read from step 1 on
    for step in range(world):
        if step < world - 1:
            incoming = torch.empty_like(kv)
            requests = cp.ring_pass(kv, incoming)
        parts = cp.attention_block_backward(q, kv[0], kv[1], dout, lse, delta, positions(rank),
                                            positions((rank - step) % world))
        dq += parts[0]
        if not travel:
            if step == 0:
                own = torch.stack(parts[1:])
        else:
            if step > 0:
                for request in grad_requests:
                    request.wait()
                dkv = dkv_incoming
            dkv[0] += parts[1]
            dkv[1] += parts[2]
            if step < world - 1 or last_hop:
                dkv_incoming = torch.empty_like(dkv)
                grad_requests = cp.ring_pass(dkv, dkv_incoming, tag=8)
        if step < world - 1:
            for request in requests:
                request.wait()
            kv = incoming
    if not travel:
        return dq, own[0], own[1]
    if last_hop:
        for request in grad_requests:
            request.wait()
        dkv = dkv_incoming
    return dq, dkv[0], dkv[1]


def ring_function(**bugs):
    class StudentRing(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, causal, layout):
            out, lse = cp.ring_attention_forward(q, k, v, causal, layout)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.causal, ctx.layout = causal, layout
            return out

        @staticmethod
        def backward(ctx, dout):
            return (*_ring_backward(dout, *ctx.saved_tensors, ctx.causal, ctx.layout, **bugs), None, None)

    return StudentRing


def ring_forward(q, k, v):
    return cp.ring_attention_forward(q, k, v)


def serial_ring_forward(q, k, v):
    return cp.ring_attention_forward(q, k, v, overlap=False)


def ulysses(q, k, v, causal=False):
    return cp.ulysses_attention(q, k, v, causal)


@pytest.mark.usefixtures("ranks_ended")
def test_checkers_pass_the_reference_implementations():
    assert "SDPA" in lab07.check_online_softmax(cp.online_softmax_attention)
    assert "merges" in lab07.check_merge_and_blockwise(cp.merge_attention, cp.blockwise_attention)
    assert "posted before" in lab07.check_ring_forward(ring_forward)
    assert "masked blocks skipped" in lab07.check_causal_ring(zigzag_positions, causal_ring)
    assert "dQ, dK, dV" in lab07.check_ring_backward(ring_function())
    assert "refused" in lab07.check_ulysses(ulysses)
    exercises = [e.id for e in lab07.EXERCISES]
    assert exercises[:6] == ["7.1", "7.2", "7.3", "7.4", "7.5", "7.6"] and len(exercises) >= 11


def test_online_softmax_mistakes_are_explained():
    def no_max(q, k_blocks, v_blocks):
        row_sum = acc = 0
        for k, v in zip(k_blocks, v_blocks):
            p = torch.exp(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]))
            row_sum, acc = row_sum + p.sum(-1), acc + p @ v
        return acc / row_sum.unsqueeze(-1), torch.log(row_sum)

    def no_rescale(q, k_blocks, v_blocks):
        k_blocks, v_blocks = list(k_blocks), list(v_blocks)
        return lab07._no_rescale(q, k_blocks, v_blocks), cp.online_softmax_attention(q, k_blocks, v_blocks)[1]

    def needs_a_list(q, k_blocks, v_blocks):
        return cp.online_softmax_attention(q, [k_blocks[i] for i in range(len(k_blocks))], v_blocks)

    with pytest.raises(CheckFailed, match="subtract the running max before exponentiating"):
        lab07.check_online_softmax(no_max)
    with pytest.raises(CheckFailed, match=r"multiplied by exp\(m_old - m_new\)"):
        lab07.check_online_softmax(no_rescale)
    with pytest.raises(CheckFailed, match="streams .* loop over zip"):
        lab07.check_online_softmax(needs_a_list)


def test_merge_and_blockwise_mistakes_are_explained():
    def unguarded(out_a, lse_a, out_b, lse_b):
        lse = torch.logaddexp(lse_a, lse_b)
        return out_a * torch.exp(lse_a - lse)[..., None] + out_b * torch.exp(lse_b - lse)[..., None], lse

    def summed(out_a, lse_a, out_b, lse_b):
        return out_a + out_b, torch.logaddexp(lse_a, lse_b)

    def one_block(q, k, v, block_size, causal=False):  # right values, but every score computed
        positions = torch.arange(q.shape[2]) if causal else None
        return cp.attention_block(q, k, v, positions, positions)

    with pytest.raises(CheckFailed, match="NaN where a part's lse is -inf"):
        lab07.check_merge_and_blockwise(unguarded, cp.blockwise_attention)
    with pytest.raises(CheckFailed, match=r"out is out_a \+ out_b"):
        lab07.check_merge_and_blockwise(summed, cp.blockwise_attention)
    with pytest.raises(CheckFailed, match="as many as without a mask"):
        lab07.check_merge_and_blockwise(cp.merge_attention, one_block)


@pytest.mark.usefixtures("ranks_ended")
def test_ring_mistakes_are_explained():
    with pytest.raises(CheckFailed, match=r"receive of block 1 was posted after block 0's compute began"):
        lab07.check_ring_forward(serial_ring_forward)

    def gathers(q, k, v):
        keys = [torch.empty_like(k) for _ in range(dist.get_world_size())]
        dist.all_gather(keys, k)
        return ring_forward(q, k, v)

    with pytest.raises(CheckFailed, match="called all_gather"):
        lab07.check_ring_forward(gathers)

    def late_first(seq_len, world_size, rank):
        return cp.layout_positions(seq_len, world_size, rank, "zigzag").roll(seq_len // (2 * world_size))

    with pytest.raises(CheckFailed, match=r"zigzag_positions\(\d+, \d+, \d+\) returned .* chunk r, then chunk 2N-1-r"):
        lab07.check_causal_ring(late_first, causal_ring)

    def no_check(seq_len, world_size, rank):
        return torch.arange(seq_len).chunk(2 * world_size)[rank] if seq_len % (2 * world_size) else zigzag_positions(
            seq_len, world_size, rank)

    with pytest.raises(CheckFailed, match=r"zigzag_positions\(12, 4, 0\) returned .* raise a ValueError"):
        lab07.check_causal_ring(no_check, causal_ring)
    with pytest.raises(CheckFailed, match=r"positions_of\(\(rank - step\) % N\)"):
        lab07.check_causal_ring(zigzag_positions, lambda *a: causal_ring(*a, own_positions_only=True))


@pytest.mark.usefixtures("ranks_ended")
def test_backward_and_ulysses_mistakes_are_explained():
    with pytest.raises(CheckFailed, match="holds only the owner's own queries' share"):
        lab07.check_ring_backward(ring_function(travel=False))
    with pytest.raises(CheckFailed, match="holds the complete dK/dV of block r\\+1"):
        lab07.check_ring_backward(ring_function(last_hop=False))

    def no_head_check(q, k, v, causal=False):
        world = dist.get_world_size()
        pad = (-q.shape[1]) % world
        if pad:  # pads heads instead of refusing; then trims them
            q, k, v = (torch.cat([t, t[:, :pad]], 1) for t in (q, k, v))
        return cp.ulysses_attention(q, k, v, causal)[:, :q.shape[1] - pad]

    with pytest.raises(CheckFailed, match="cannot be split into whole heads, yet it ran without error"):
        lab07.check_ulysses(no_head_check)

    def chunks_not_in_order(q, k, v, causal=False):
        world, (b, h, t, d) = dist.get_world_size(), q.shape
        if h % world:
            raise ValueError("heads")

        def to_heads(x):
            send = x.reshape(b, world, h // world, t, d).transpose(0, 1).contiguous()
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send)
            return recv.reshape(b, h // world, world * t, d)  # forgot to move the rank axis next to the tokens

        out = F.scaled_dot_product_attention(*(to_heads(x) for x in (q, k, v)), is_causal=causal)
        return cp.heads_to_seq(out)

    with pytest.raises(CheckFailed, match="second all-to-all sends sequence chunk j"):
        lab07.check_ulysses(chunks_not_in_order)


@pytest.mark.usefixtures("ranks_ended")
def test_untouched_stubs_are_not_attempted():
    def stub(*args):
        raise NotImplementedError("Exercise 7.3: replace this line with your solution")

    for exercise, args in (("7.1", (stub,)), ("7.2", (stub, stub)), ("7.3", (stub,)), ("7.4", (stub, stub)),
                           ("7.6", (stub,))):
        assert distlab.check(exercise, *args, quiet=True).status == "not attempted", exercise

    class StubRing(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, causal, layout):
            return cp.ring_attention_forward(q, k, v, causal, layout)[0]

        @staticmethod
        def backward(ctx, dout):
            raise NotImplementedError("Exercise 7.5: replace this line with your solution")

    assert distlab.check("7.5", StubRing, quiet=True).status == "not attempted"
    assert distlab.check("Q7.1", ..., quiet=True).status == "not attempted"
    assert distlab.check("Q7.3", 3.0, quiet=True).status == "failed"
