"""The reference ring algorithms equal torch.distributed's built-ins on real gloo ranks, and send what the
cost model says they send (measured by distlab.runtime.comm, exact for point-to-point ops)."""

import os
import subprocess
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

import distlab
from distlab import collectives as C

# Send this module's functions to the ranks by value: a fresh rank then need not import pytest and this file.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def groups():
    made = {}

    def get(n):
        if n not in made:
            made[n] = distlab.Ranks(n, backend="gloo", collective_timeout=10)
        return made[n]

    yield get
    for ranks in made.values():
        ranks.close()


# ---------------------------------------------------------------- jobs run inside the ranks

def _inputs(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed * 7919 + dist.get_rank())
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def _compare_all_reduce(shape, dtype, seed, transpose=False):
    x = _inputs(shape, dtype, seed)
    if transpose:
        x = x.t()  # a non-contiguous view
    expected = x.clone()
    dist.all_reduce(expected)
    ring = x.clone().t().contiguous().t() if transpose else x.clone()
    returned = C.ring_all_reduce(ring)
    via = C.all_reduce_via_reduce_scatter(x.clone())
    return (returned is ring, C.first_mismatch(expected, ring), C.first_mismatch(expected, via),
            ring.is_contiguous())


def _compare_segmented(cases, segment_bytes):
    """The pipelined ring with small segments (several per chunk, the last ones shorter or empty), call
    after call with sizes and dtypes that shrink and grow the receive buffers it keeps between calls."""
    misses = []
    for seed, (numel, dtype) in enumerate(cases):
        x = _inputs((numel,), dtype, seed)
        expected = x.clone()
        dist.all_reduce(expected)
        C.ring_all_reduce(x, segment_bytes=segment_bytes)
        misses.append(C.first_mismatch(expected, x))
    return misses


def _compare_all_gather(shape, dtype, seed):
    x = _inputs(shape, dtype, seed)
    expected = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(expected, x)
    got = C.ring_all_gather(x)
    return len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(expected, got))


def _ring_bytes(numel, dtype):
    C.ring_all_reduce(torch.ones(numel, dtype=dtype))


def _gather_bytes(numel):
    C.ring_all_gather(torch.ones(numel))


def _subgroup_ring():
    sub = dist.new_group([0, 2])
    x = torch.tensor([float(dist.get_rank() + 1)] * 5)
    if dist.get_rank() in (0, 2):
        C.ring_all_reduce(x, group=sub)
    return x.tolist()


# ---------------------------------------------------------------- chunking

def test_chunk_sizes_split_like_tensor_split():
    assert C.chunk_sizes(10, 4) == [3, 3, 2, 2]
    assert C.chunk_sizes(2, 4) == [1, 1, 0, 0]
    assert C.chunk_sizes(8, 1) == [8]
    for numel in (0, 1, 5, 17, 64):
        for n in (1, 2, 3, 4, 7):
            sizes = C.chunk_sizes(numel, n)
            assert sizes == [t.numel() for t in torch.arange(numel).tensor_split(n)]
            assert sum(sizes) == numel and max(sizes) - min(sizes) <= 1
    flat = torch.zeros(10)
    C.split_chunks(flat, 4)[1].fill_(1.0)  # views: writing a chunk writes the tensor
    assert flat.tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 0, 0]
    with pytest.raises(ValueError):
        C.chunk_sizes(3, 0)


# ---------------------------------------------------------------- correctness on real ranks

@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_ring_all_reduce_and_reduce_scatter_all_gather_equal_builtin(groups, n):
    ranks = groups(n)
    cases = [((1,), torch.float32), ((3,), torch.float32), ((1000,), torch.float32), ((1001,), torch.float64),
             ((7, 13), torch.float64)]
    for seed, (shape, dtype) in enumerate(cases):
        for returned_self, ring_miss, via_miss, _ in ranks.run(_compare_all_reduce, args=(shape, dtype, seed),
                                                               show_output=False):
            assert returned_self and ring_miss is None and via_miss is None, (n, shape, dtype)
    # a non-contiguous input is reduced in place too
    for returned_self, ring_miss, via_miss, contiguous in ranks.run(
            _compare_all_reduce, args=((5, 6), torch.float32, 99, True), show_output=False):
        assert returned_self and ring_miss is None and via_miss is None


@pytest.mark.parametrize("n", [2, 3, 4])
def test_pipelined_ring_with_many_segments_equals_builtin(groups, n):
    cases = [(1001, torch.float32), (50, torch.float64), (4099, torch.float64), (7, torch.float32),
             (3000, torch.float32)]
    for misses in groups(n).run(_compare_segmented, args=(cases, 64), show_output=False):
        assert misses == [None] * len(cases), (n, misses)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_ring_all_gather_equals_builtin(groups, n):
    for seed, (shape, dtype) in enumerate([((1,), torch.float32), ((10,), torch.float64), ((3, 5), torch.float32)]):
        assert all(groups(n).run(_compare_all_gather, args=(shape, dtype, seed), show_output=False))


def test_ring_all_reduce_on_a_subgroup(groups):
    values = groups(4).run(_subgroup_ring, show_output=False)
    assert values == [[4.0] * 5, [2.0] * 5, [4.0] * 5, [4.0] * 5]


# ---------------------------------------------------------------- bytes: measured vs the cost model

@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_all_reduce_sends_2_n_minus_1_over_n_M(groups, n):
    numel = 12 * 1024  # divisible by 2, 3 and 4: the formula holds exactly on every rank
    run = groups(n).run(_ring_bytes, args=(numel, torch.float32), show_output=False)
    M = 4 * numel
    sent = [log.total(ops=("send", "isend")) for log in run.comm]
    assert sent == [C.ring_all_reduce_bytes(M, n)] * n
    assert all(log.ops["isend"].calls == 2 * (n - 1) for log in run.comm)
    assert all("all_reduce" not in log.ops for log in run.comm)


def test_ring_bytes_for_sizes_not_divisible_by_world_size(groups):
    n, numel = 4, 1003
    run = groups(n).run(_ring_bytes, args=(numel, torch.float64), show_output=False)
    M, element = 8 * numel, 8
    sent = [log.total(ops=("send", "isend")) for log in run.comm]
    assert sum(sent) == 2 * (n - 1) * M  # every chunk travels N-1 times per phase
    for s in sent:  # each rank within two elements of 2(N-1)/N * M
        assert abs(s - C.ring_all_reduce_bytes(M, n)) <= 2 * element


@pytest.mark.parametrize("n", [2, 4])
def test_ring_all_gather_sends_n_minus_1_over_n_of_output(groups, n):
    run = groups(n).run(_gather_bytes, args=(1000,), show_output=False)
    assert [log.total(ops=("send", "isend")) for log in run.comm] == [C.ring_all_gather_bytes(n * 4000, n)] * n


# ---------------------------------------------------------------- cost model and sweep

def test_cost_model_formulas():
    assert C.ring_all_reduce_bytes(1000, 4) == 1500
    assert C.ring_all_reduce_bytes(1000, 1) == 0
    assert C.ring_all_gather_bytes(1000, 4) == 750
    assert C.ring_all_reduce_time(4e6, 4, alpha=1e-5, beta=1e9) == pytest.approx(6e-5 + 6e6 / 1e9)
    assert C.bus_bandwidth(4e6, 6e-3, 4) == pytest.approx(1e9)


def test_nccl_tree_is_not_recursive_doubling():
    """NCCL's double binary tree: a tree's latency, about the ring's bytes (2M against 2(N-1)/N M)."""
    big, n = 14e9, 1024
    ring, nccl_tree = C.ring_all_reduce_time(big, n, 0.0, 1e9), C.double_binary_tree_all_reduce_time(big, n, 0.0, 1e9)
    assert nccl_tree / ring == pytest.approx(n / (n - 1))
    assert C.double_binary_tree_all_reduce_time(0.0, n, 5e-6, 1e9) == pytest.approx(2 * 10 * 5e-6)
    assert C.double_binary_tree_all_reduce_time(0.0, n, 5e-6, 1e9) < C.ring_all_reduce_time(0.0, n, 5e-6, 1e9) / 50
    assert C.tree_all_reduce_time(big, n, 0.0, 1e9) / nccl_tree == pytest.approx(10 / 2)  # log2 N * M against 2M
    assert C.all_reduce_cost("doubling", 1.0, 8) == C.all_reduce_cost("tree", 1.0, 8) == (3, 3.0)


def test_in_network_reduction_sends_about_m_and_gloo_wire_counts_its_protocol():
    """NVLS: each GPU sends its M once and its 1/N of the sum once. gloo's ring: >= 2N segments of <= 1 MiB, a
    48-byte preamble per segment sent, a ready notice per transfer each way (tests/test_wire.py measures it)."""
    assert C.in_network_all_reduce_bytes(8e9, 8) == pytest.approx(9e9)
    assert C.in_network_all_reduce_time(8e9, 8, 0.0, 1e9) < C.ring_all_reduce_time(8e9, 8, 0.0, 1e9)
    big = C.gloo_all_reduce_wire(4 * 2**20, 4, 0)  # 8 segments of 512 KiB: 6 sent and 6 received per phase
    assert (big.sends, big.receives, big.protocol) == (12, 12, 36 * 48)
    assert big.tensor == C.ring_all_reduce_bytes(4 * 2**20, 4)
    huge = C.gloo_all_reduce_wire(64 * 2**20, 4, 1)  # 64 segments of 1 MiB, 48 forwarded per phase
    assert (huge.sends, huge.receives) == (96, 96)
    tiny = [C.gloo_all_reduce_wire(8, 4, rank) for rank in range(4)]  # two non-empty 4-byte segments of eight
    assert [t.total for t in tiny] == [296, 392, 592, 496]
    assert C.gloo_all_reduce_wire(8, 1, 0).total == 0


def test_fit_alpha_beta_recovers_the_model():
    sizes = [4 * 1024 * 8**i for i in range(5)]
    times = [C.ring_all_reduce_time(m, 4, alpha=20e-6, beta=2e9) for m in sizes]
    alpha, beta = C.fit_alpha_beta(sizes, times, 4)
    assert alpha == pytest.approx(20e-6, rel=1e-6) and beta == pytest.approx(2e9, rel=1e-6)
    with pytest.raises(ValueError):
        C.fit_alpha_beta(sizes, times, 1)


def test_bandwidth_sweep_and_table(groups):
    rows = C.bandwidth_sweep({"ring": C.ring_all_reduce, "gloo": C.builtin_all_reduce}, [4096, 65536],
                             ranks=groups(2), reps=2)
    assert [(r["name"], r["bytes"], r["world_size"]) for r in rows] == [
        ("ring", 4096, 2), ("gloo", 4096, 2), ("ring", 65536, 2), ("gloo", 65536, 2)]
    assert all(len(r["times"]) == 2 and r["median_s"] > 0 and r["busbw"] > 0 for r in rows)
    table = C.format_sweep(rows, baseline="gloo").splitlines()
    assert "ring/gloo" in table[0] and table[1].split()[:2] == ["4", "KiB"] and len(table) == 3


def test_first_mismatch():
    a = torch.arange(5.0)
    assert C.first_mismatch(a, a.clone()) is None
    b = a.clone()
    b[3] = 7.0
    assert C.first_mismatch(a, b) == (3, 3.0, 7.0)


# ---------------------------------------------------------------- measuring a window, reusing groups

def _measured_window():
    from distlab.runtime import comm

    n, x = dist.get_world_size(), torch.ones(6)
    dist.all_reduce(x)  # before the window
    before = comm.snapshot()
    out = torch.empty(6 * n)
    dist.all_gather_into_tensor(out, x)
    dist.all_gather(list(out.chunk(n)), x)
    middle = comm.snapshot()
    dist.all_reduce(x)
    return comm.since(before, middle), comm.since(middle)


def test_since_counts_each_collective_under_one_name_whichever_function_issued_it(groups):
    from distlab.runtime.comm import OpCounts

    window, after = groups(2).run(_measured_window)[0]
    assert dict(window.ops) == {"all_gather": OpCounts(2, 2 * 48, 2 * 24.0)}  # M: the 48-byte output, half sent
    assert [event[0] for event in window.events] == ["all_gather_into_tensor", "all_gather"]
    assert window.total("payload_bytes", "all_gather_single") == 2 * 48 == window.total("payload_bytes")
    assert dict(after.ops) == {"all_reduce": OpCounts(1, 24, 24.0)}


def _cached_group():
    from distlab.runtime.subgroups import subgroup

    pair = subgroup([1, 0])
    return (id(pair), subgroup([0, 1]) is pair, subgroup([0, 1], purpose="checkpoint") is pair,
            dist.get_process_group_ranks(pair))


def test_a_group_is_made_once_per_default_group_and_reused_by_later_jobs(groups, tmp_path):
    from distlab.runtime.subgroups import subgroup

    first, second = groups(2).run(_cached_group), groups(2).run(_cached_group)
    assert first[0][1:] == (True, False, [0, 1]) and [r[0] for r in first] == [r[0] for r in second]
    made = []
    for attempt in range(2):  # a new default group: the old one's groups are never handed out
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / str(attempt)}", rank=0, world_size=1)
        try:
            made.append(subgroup([0]))
            assert subgroup([0]) is made[-1]
        finally:
            dist.destroy_process_group()
    assert made[0] is not made[1]


# ---------------------------------------------------------------- hello_world: launch and torchrun

def test_hello_world_under_launch(groups, capsys):
    assert list(groups(4).run(C.hello_world)) == [10.0] * 4
    out = capsys.readouterr().out
    assert "[rank 3] rank 3 of 4 on cpu: all_reduce(rank + 1) = 10" in out


def test_hello_world_under_torchrun_environment(tmp_path):
    """What torchrun gives a process: RANK, WORLD_SIZE, MASTER_ADDR/PORT; hello_world joins and leaves."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
        code = "from distlab.collectives import hello_world; print('RESULT', hello_world())"
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=60) for p in procs]
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, err
        assert f"rank {rank} of 2 on cpu: all_reduce(rank + 1) = 3" in out and "RESULT 3.0" in out



# ---------------------------------------------------------------- the CUDA path (runs where there is a GPU)

def _lab02_paths_on_this_rank():
    dev = distlab.device()
    x = torch.arange(1000.0, device=dev)
    ring, tree = C.ring_all_reduce(x.clone()), C.tree_all_reduce(x.clone())
    via = C.all_reduce_via_reduce_scatter(x.clone())
    times = C.time_all_reduce(C.builtin_all_reduce, 1 << 20, reps=2)
    return str(dev), dist.get_backend(), all(torch.equal(t, x) for t in (ring, tree, via)), len(times)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_nccl_rank_on_a_gpu_runs_the_lab_02_paths(no_leftover_ranks):
    (device, backend, equal, timed), = distlab.launch(_lab02_paths_on_this_rank, 1, backend="nccl")
    assert (device, backend, equal, timed) == ("cuda:0", "nccl", True, 2)
    assert list(distlab.launch(C.hello_world, 1, backend="nccl")) == [1.0]
