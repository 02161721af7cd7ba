"""Collectives from first principles: ring all-reduce and all-gather built from sends and receives.

Labs 00 and 02 teach with these functions; the tests, the checkers and
``benchmarks/bench_ring.py`` use them as the one reference.

Every function below runs *inside* a rank (under :func:`distlab.launch`, a warm
:class:`distlab.Ranks`, or torchrun) with the default process group initialised.

The cost model. A ring all-reduce of M bytes on N ranks cuts the tensor into N
chunks and makes 2(N-1) steps: N-1 of reduce-scatter (send a chunk to the
right, add the chunk from the left) and N-1 of all-gather (pass the finished
chunks around). Each step moves one chunk of M/N bytes, so every rank sends

    2(N-1)/N * M bytes                         (:func:`ring_all_reduce_bytes`)

and, with a per-message latency alpha and a link bandwidth beta, takes

    t(M) = 2(N-1) * alpha + 2(N-1)/N * M / beta  (:func:`ring_all_reduce_time`).
"""

from __future__ import annotations

import math
import os
import statistics
import time
import warnings
from typing import Callable, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "hello_world", "chunk_sizes", "split_chunks", "ring_all_reduce", "ring_all_gather",
    "all_reduce_via_reduce_scatter", "builtin_all_reduce", "ring_all_reduce_bytes", "ring_all_gather_bytes",
    "ring_all_reduce_time", "fit_alpha_beta", "bus_bandwidth", "time_all_reduce", "bandwidth_sweep",
    "format_sweep", "first_mismatch", "KiB", "MiB",
]

KiB, MiB = 2**10, 2**20


# ---------------------------------------------------------------- hello, world

def hello_world() -> float:
    """Every rank adds its ``rank + 1``; all of them print and return the same sum, N(N+1)/2.

    Runs under ``distlab.launch(hello_world, 4)`` and under torchrun
    (``torchrun --nproc-per-node=4 -m distlab.torchrun distlab.collectives:hello_world``);
    if no process group exists yet it joins one from torchrun's environment
    variables (NCCL when this process has a GPU, gloo otherwise) and leaves it afterwards.
    """
    from distlab.rank import device

    owns_group = not dist.is_initialized()
    if owns_group:
        use_nccl = torch.cuda.is_available() and dist.is_nccl_available()
        if use_nccl:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if use_nccl else "gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        x = torch.tensor([rank + 1.0], device=device())
        dist.all_reduce(x)  # default op: SUM
        total = x.item()
        print(f"rank {rank} of {world} on {x.device}: all_reduce(rank + 1) = {total:g}")
        return total
    finally:
        if owns_group:
            dist.destroy_process_group()


# ---------------------------------------------------------------- chunking

def chunk_sizes(numel: int, n: int) -> list[int]:
    """How many elements each of ``n`` chunks gets: sizes differ by at most one, the first ones larger.

    ``chunk_sizes(10, 4) == [3, 3, 2, 2]``, the same split as ``torch.tensor_split``;
    ``chunk_sizes(2, 4) == [1, 1, 0, 0]`` (empty chunks are fine: nothing is sent for them).
    """
    if n < 1 or numel < 0:
        raise ValueError(f"need n >= 1 and numel >= 0, got numel={numel}, n={n}")
    base, extra = divmod(numel, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


def split_chunks(flat: torch.Tensor, n: int) -> list[torch.Tensor]:
    """``n`` views of a 1-D tensor with :func:`chunk_sizes`; writing to a view writes to ``flat``."""
    if flat.dim() != 1:
        raise ValueError(f"split_chunks expects a 1-D tensor, got shape {tuple(flat.shape)}")
    return list(torch.split(flat, chunk_sizes(flat.numel(), n)))


def _ring_peers(group) -> tuple[int, int, int, int]:
    """(my index in the group, group size, global rank of my right neighbour, of my left one)."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    right, left = (rank + 1) % n, (rank - 1) % n
    if group is not None:
        right, left = dist.get_global_rank(group, right), dist.get_global_rank(group, left)
    return rank, n, right, left


def _exchange(send: torch.Tensor, recv: torch.Tensor, right: int, left: int, group) -> None:
    """Send ``send`` to the right neighbour while receiving ``recv`` from the left one.

    Both are posted non-blocking, then waited on: if every rank made a blocking
    send first, each would wait for a neighbour that is itself still sending,
    and the ring would deadlock. (``irecv`` + ``wait`` is also much cheaper
    than a blocking ``recv`` on gloo: about 0.5 ms against 3 ms per message on
    a small machine with torch 2.13.) Empty chunks are skipped on both sides:
    both neighbours know the chunk sizes.
    """
    requests = []
    if send.numel():
        requests.append(dist.isend(send, right, group=group))
    if recv.numel():
        requests.append(dist.irecv(recv, left, group=group))
    for request in requests:
        request.wait()


# ---------------------------------------------------------------- ring algorithms

def ring_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place with a ring of point-to-point messages; return it.

    Phase 1, reduce-scatter: in step s rank r sends chunk (r - s) mod N to the
    right and adds the chunk (r - s - 1) mod N that arrives from the left.
    After N-1 steps rank r holds the complete sum of chunk (r + 1) mod N.
    Phase 2, all-gather: in step s rank r sends chunk (r + 1 - s) mod N to the
    right and overwrites chunk (r - s) mod N with the finished one from the left.
    """
    rank, n, right, left = _ring_peers(group)
    if n == 1:
        return tensor
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    chunks = split_chunks(work.view(-1), n)
    scratch = torch.empty_like(chunks[0])  # chunk 0 is the largest
    for step in range(n - 1):  # reduce-scatter
        send_idx, recv_idx = (rank - step) % n, (rank - step - 1) % n
        incoming = scratch[: chunks[recv_idx].numel()]
        _exchange(chunks[send_idx], incoming, right, left, group)
        chunks[recv_idx].add_(incoming)
    for step in range(n - 1):  # all-gather
        send_idx, recv_idx = (rank + 1 - step) % n, (rank - step) % n
        _exchange(chunks[send_idx], chunks[recv_idx], right, left, group)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def ring_all_gather(tensor: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's ``tensor`` on every rank: returns a list whose entry i is rank i's tensor.

    In step s rank r forwards the piece of rank (r - s) mod N to the right and
    receives the piece of rank (r - s - 1) mod N from the left: N-1 steps, each
    rank sends (N-1) pieces, i.e. (N-1)/N of the gathered output.
    """
    rank, n, right, left = _ring_peers(group)
    pieces = [torch.empty_like(tensor) for _ in range(n)]
    pieces[rank].copy_(tensor)
    for step in range(n - 1):
        send_idx, recv_idx = (rank - step) % n, (rank - step - 1) % n
        _exchange(pieces[send_idx], pieces[recv_idx], right, left, group)
    return pieces


def all_reduce_via_reduce_scatter(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """All-reduce as reduce-scatter followed by all-gather, with the built-in collectives; in place.

    ``reduce_scatter_tensor`` needs an input N times its output, so the
    flattened tensor is zero-padded to a multiple of N first.
    """
    n = dist.get_world_size(group)
    flat = tensor.reshape(-1)
    per_rank = math.ceil(flat.numel() / n)
    padded = torch.zeros(per_rank * n, dtype=tensor.dtype, device=tensor.device)
    padded[: flat.numel()] = flat
    mine = torch.empty(per_rank, dtype=tensor.dtype, device=tensor.device)
    with warnings.catch_warnings():  # torch >= 2.11 prefers the *_single names; 2.8 only has these
        warnings.simplefilter("ignore", FutureWarning)
        dist.reduce_scatter_tensor(mine, padded, group=group)
        dist.all_gather_into_tensor(padded, mine, group=group)
    tensor.copy_(padded[: flat.numel()].view_as(tensor))
    return tensor


def builtin_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """``dist.all_reduce`` with the same calling convention as :func:`ring_all_reduce`."""
    dist.all_reduce(tensor, group=group)
    return tensor


# ---------------------------------------------------------------- cost model

def ring_all_reduce_bytes(message_bytes: float, world_size: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``message_bytes``: 2(N-1)/N * M."""
    return 2 * (world_size - 1) * message_bytes / world_size


def ring_all_gather_bytes(output_bytes: float, world_size: int) -> float:
    """Bytes one rank sends in a ring all-gather whose gathered output is M bytes: (N-1)/N * M."""
    return (world_size - 1) * output_bytes / world_size


def ring_all_reduce_time(message_bytes, world_size: int, alpha: float, beta: float):
    """The alpha-beta model: t = 2(N-1)*alpha + 2(N-1)/N * M / beta (alpha in s, beta in bytes/s)."""
    return 2 * (world_size - 1) * alpha + ring_all_reduce_bytes(message_bytes, world_size) / beta


def fit_alpha_beta(message_bytes: Sequence[float], seconds: Sequence[float], world_size: int) -> tuple[float, float]:
    """Fit (alpha, beta) of :func:`ring_all_reduce_time` to measured times by least squares.

    The model is linear in (alpha, 1/beta). Each point is weighted by 1/t, so a
    4 KiB message (latency-bound) counts as much as a 16 MiB one (bandwidth-bound).
    """
    import numpy as np

    if world_size < 2:
        raise ValueError("an all-reduce on one rank sends nothing; fit on world_size >= 2")
    m = np.asarray(message_bytes, dtype=float)
    t = np.asarray(seconds, dtype=float)
    design = np.stack([np.full_like(m, 2.0 * (world_size - 1)), ring_all_reduce_bytes(m, world_size)], axis=1)
    (alpha, inv_beta), *_ = np.linalg.lstsq(design / t[:, None], np.ones_like(t), rcond=None)
    if inv_beta <= 0:  # noise swamped the slope: fall back to the largest message's bandwidth
        inv_beta = t[-1] / design[-1, 1]
    return max(float(alpha), 0.0), float(1.0 / inv_beta)


def bus_bandwidth(message_bytes: float, seconds: float, world_size: int) -> float:
    """All-reduce bus bandwidth in bytes/s, the nccl-tests convention: 2(N-1)/N * M / t.

    Algorithm bandwidth M/t depends on N; bus bandwidth is what each link
    carried, comparable across world sizes and with the hardware's link speed.
    """
    return ring_all_reduce_bytes(message_bytes, world_size) / seconds


# ---------------------------------------------------------------- measuring

def time_all_reduce(fn: Callable, numel: int, reps: int = 5, warmup: int = 1,
                    dtype: torch.dtype = torch.float32) -> list[float]:
    """Run inside a rank: time ``fn(tensor)`` ``reps`` times after ``warmup``; seconds per rep.

    A barrier before each rep starts all ranks together; the parent takes, per
    rep, the slowest rank (the collective is done when the last rank is).
    """
    from distlab.rank import device

    x = torch.ones(numel, dtype=dtype, device=device())
    times = []
    for i in range(warmup + reps):
        dist.barrier()
        start = time.perf_counter()
        fn(x)
        if x.is_cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def bandwidth_sweep(impls: dict[str, Callable], sizes: Sequence[int], ranks=None, world_size: int = 4,
                    reps: int = 5, warmup: int = 1, dtype: torch.dtype = torch.float32) -> list[dict]:
    """Time each all-reduce implementation at each message size (bytes) on real ranks.

    ``impls`` maps a name to a function ``f(tensor)`` that all-reduces in place
    (e.g. ``{"ring": ring_all_reduce, "gloo": builtin_all_reduce}``). ``ranks``
    is a warm :class:`distlab.Ranks` to reuse; without it one is started and
    closed. Returns one row per (impl, size): name, bytes, world_size,
    times (slowest rank per rep), median_s and busbw (bytes/s from the median).
    """
    from distlab.launcher import Ranks

    own = ranks is None
    ranks = ranks if ranks is not None else Ranks(world_size)
    element = torch.tensor([], dtype=dtype).element_size()
    rows = []
    try:
        for size in sizes:
            numel = max(1, int(size) // element)
            for name, fn in impls.items():
                run = ranks.run(time_all_reduce, args=(fn, numel, reps, warmup, dtype), show_output=False)
                per_rep = [max(rank_times[i] for rank_times in run) for i in range(reps)]
                median = statistics.median(per_rep)
                n = run.world_size
                rows.append({"name": name, "bytes": numel * element, "world_size": n, "times": per_rep,
                             "median_s": median, "busbw": bus_bandwidth(numel * element, median, n)})
    finally:
        if own:
            ranks.close()
    return rows


def _human_bytes(n: float) -> str:
    for unit, scale in (("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n:g} B"


def format_sweep(rows: list[dict], baseline: str | None = None) -> str:
    """A table of :func:`bandwidth_sweep` rows: one line per size, median time and bus GB/s per impl.

    With ``baseline`` (an impl name), a last column gives the first other
    impl's median time divided by the baseline's (> 1: slower than baseline).
    """
    names = list(dict.fromkeys(r["name"] for r in rows))
    sizes = list(dict.fromkeys(r["bytes"] for r in rows))
    by = {(r["name"], r["bytes"]): r for r in rows}
    head = f"{'size':>10}" + "".join(f"{name + ' ms':>13}{name + ' GB/s':>14}" for name in names)
    other = next((name for name in names if name != baseline), None) if baseline else None
    if other:
        head += f"{other + '/' + baseline:>14}"
    lines = [head]
    for size in sizes:
        line = f"{_human_bytes(size):>10}"
        for name in names:
            row = by[(name, size)]
            line += f"{row['median_s'] * 1e3:>13.3f}{row['busbw'] / 1e9:>14.3f}"
        if other:
            line += f"{by[(other, size)]['median_s'] / by[(baseline, size)]['median_s']:>14.2f}"
        lines.append(line)
    return "\n".join(lines)


# ---------------------------------------------------------------- comparing

def first_mismatch(expected: torch.Tensor, actual: torch.Tensor, rtol: float | None = None,
                   atol: float | None = None) -> tuple[int, float, float] | None:
    """The first flat index where ``actual`` is not close to ``expected``: (index, expected, got), else None.

    Tolerances default to a few ulps of the dtype times the magnitude of a sum
    of a handful of terms (summation order differs between algorithms).
    """
    if rtol is None or atol is None:
        eps = torch.finfo(expected.dtype).eps if expected.is_floating_point() else 0.0
        rtol = 64 * eps if rtol is None else rtol
        atol = 64 * eps if atol is None else atol
    e = expected.detach().reshape(-1).to("cpu")
    a = actual.detach().reshape(-1).to("cpu", e.dtype)
    close = torch.isclose(a, e, rtol=rtol, atol=atol, equal_nan=True)
    if bool(close.all()):
        return None
    i = int((~close).nonzero()[0])
    return i, e[i].item(), a[i].item()
