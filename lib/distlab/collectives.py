"""Collectives from first principles: ring and recursive-doubling all-reduce, ring all-gather, from sends and receives.

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

The ring is bandwidth-optimal but pays 2(N-1) latencies. Recursive doubling
(:func:`tree_all_reduce`) exchanges the whole tensor with rank ``r xor 2^k`` in
log2(N) rounds: log2(N) latencies, but log2(N) * M bytes per rank. Small
messages are latency-bound and want recursive doubling; large ones are
bandwidth-bound and want the ring; :func:`crossover_bytes` is where the model says
they cost the same. (The functions keep the historical name "tree" for recursive
doubling. NCCL's *tree* algorithm is a different one, a pipelined double binary
tree whose bandwidth term is about the ring's: :func:`double_binary_tree_all_reduce_time`.)
"""

from __future__ import annotations

import math
import os
import statistics
import time
import warnings
from typing import Callable, NamedTuple, Sequence

import numpy as np
import torch
import torch.distributed as dist

from distlab.runtime.launch import Ranks
from distlab.runtime.rank import device

__all__ = [
    "hello_world", "chunk_sizes", "split_chunks", "ring_all_reduce", "ring_all_gather", "tree_all_reduce",
    "all_reduce_via_reduce_scatter", "builtin_all_reduce", "ring_all_reduce_bytes", "ring_all_gather_bytes",
    "tree_steps", "tree_all_reduce_bytes", "all_reduce_cost", "ring_all_reduce_time", "tree_all_reduce_time",
    "double_binary_tree_all_reduce_time", "in_network_all_reduce_bytes", "in_network_all_reduce_time",
    "GlooWire", "gloo_all_reduce_wire",
    "fit_alpha_beta", "crossover_bytes", "measured_crossover", "bus_bandwidth", "time_all_reduce",
    "bandwidth_sweep", "format_sweep", "human_bytes", "human_rate", "median_time", "first_mismatch", "KiB", "MiB",
    "SEGMENT_BYTES", "ring_peers",
]

KiB, MiB = 2**10, 2**20
# The pipelined ring cuts each ring step's chunk into segments of about this size, so that
# one segment is on the wire while the previous one is being added. Each segment is one more
# message, and a message posted from Python costs tens to hundreds of µs on gloo: 1 MiB segments
# lost to 2 and 4 MiB ones at every size from 4 to 64 MiB on 2 and 4 ranks, timed side by side.
SEGMENT_BYTES = 4 * MiB


# ---------------------------------------------------------------- hello, world

def hello_world() -> float:
    """Every rank adds its ``rank + 1``; all of them print and return the same sum, N(N+1)/2.

    Runs under ``distlab.launch(hello_world, 4)`` and under torchrun
    (``torchrun --nproc-per-node=4 -m distlab.torchrun distlab.collectives:hello_world``);
    if no process group exists yet it joins one from torchrun's environment
    variables (NCCL when this process has a GPU, gloo otherwise) and leaves it afterwards.
    """
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


def ring_peers(group) -> tuple[int, int, int, int]:
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

def ring_all_reduce(tensor: torch.Tensor, group=None, segment_bytes: int | None = SEGMENT_BYTES) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place with a pipelined ring of point-to-point messages; return it.

    Phase 1, reduce-scatter: in step s rank r sends chunk (r - s) mod N to the
    right and adds the chunk (r - s - 1) mod N that arrives from the left.
    After N-1 steps rank r holds the complete sum of chunk (r + 1) mod N.
    Phase 2, all-gather: in step s rank r sends chunk (r + 1 - s) mod N to the
    right and overwrites chunk (r - s) mod N with the finished one from the left.

    Pipelining: what rank r sends in step s + 1 is exactly the chunk it received
    (and reduced) in step s. So each chunk is cut into segments of about
    ``segment_bytes``, and a segment is forwarded as soon as it has arrived and been
    added, while the next segments are still on the wire: the 2(N-1) steps become one
    stream instead of 2(N-1) stop-and-wait rounds. ``segment_bytes=None`` is the plain
    ring of exercise 2.1, one message per step. Either way each rank sends
    2(N-1)/N * M bytes.
    """
    rank, n, right, left = ring_peers(group)
    if n == 1:
        return tensor
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    chunks = split_chunks(work.view(-1), n)
    pieces = max(1, -(-chunks[0].numel() * work.element_size() // segment_bytes)) if segment_bytes else 1
    segments = [split_chunks(chunk, pieces) for chunk in chunks]
    scratch = [split_chunks(buffer, pieces) for buffer in _scratch(chunks[0], min(2, n - 1))]  # chunk 0 is the largest
    sends: list = []

    def isend(segment: torch.Tensor, tag: int) -> None:
        if segment.numel():
            sends.append(dist.isend(segment, right, group=group, tag=tag))

    def irecv(segment: torch.Tensor, tag: int):
        return dist.irecv(segment, left, group=group, tag=tag) if segment.numel() else None

    # Receives from the left neighbour are posted in the order it sends — the reduce-scatter's steps,
    # then the all-gather's — since NCCL matches point-to-point messages by order, not by tag.
    # On gloo they are posted early: the first step's before any send, each later step's one step
    # ahead, all of the all-gather's right after the last reduce-scatter step's. gloo moves a message
    # at once only into a buffer its receiver has announced; a send that comes first waits for the
    # announcement and is then pushed out by gloo's I/O thread, the one also reading the other
    # direction. (An all-gather receive lands in its final place: that chunk is overwritten only after
    # this rank's contribution to it has been received downstream, reduced and brought round the ring.)
    # NCCL runs the sends and receives between two ranks in order on one stream, so with two ranks a
    # receive posted first would hold up the send queued behind it: there the sends go first.
    early = dist.get_backend(group) == "gloo"
    base = (n - 1) * pieces
    gathers: list = []

    def post_gathers() -> None:
        gathers.extend([irecv(segments[(rank - step) % n][j], base + step * pieces + j) for j in range(pieces)]
                       for step in range(n - 1))

    def post_reduce_recvs(step: int) -> list:
        into = (rank - step - 1) % n
        posted = [irecv(scratch[step % 2][j][: segments[into][j].numel()], step * pieces + j) for j in range(pieces)]
        if early and step == n - 2:
            post_gathers()
        return posted

    # reduce-scatter: receive into scratch, add, forward the reduced segment at once
    pending = post_reduce_recvs(0) if early else []
    for j, segment in enumerate(segments[rank]):
        isend(segment, j)
    if not early:
        pending = post_reduce_recvs(0)
    for step in range(n - 1):
        upcoming = post_reduce_recvs(step + 1) if step + 1 < n - 1 else []
        into = (rank - step - 1) % n
        for j, request in enumerate(pending):
            if request is None:
                continue
            request.wait()
            segments[into][j].add_(scratch[step % 2][j][: segments[into][j].numel()])
            if step + 1 < n - 1:
                isend(segments[into][j], (step + 1) * pieces + j)
        pending = upcoming
    # all-gather: forward each finished segment on arrival
    finished = (rank + 1) % n
    for j, segment in enumerate(segments[finished]):
        isend(segment, base + j)
    if not early:
        post_gathers()
    for step in range(n - 1):
        for j, request in enumerate(gathers[step]):
            if request is None:
                continue
            request.wait()
            if step + 1 < n - 1:
                isend(segments[(rank - step) % n][j], base + (step + 1) * pieces + j)
    _wait_all(sends)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


_SCRATCH: dict[tuple, torch.Tensor] = {}


def _scratch(like: torch.Tensor, count: int) -> list[torch.Tensor]:
    """``count`` receive buffers shaped like ``like``, kept between calls.

    A fresh buffer costs a page fault per 4 KiB page the first time the network writes into it —
    at 8 MiB, longer than adding the chunk it receives. Like NCCL's and gloo's own preallocated buffers,
    the ring keeps one per (device, dtype), grown to the largest chunk it has seen (the calls are
    synchronous, so one call's buffers are free when the next begins).
    """
    key = (like.device, like.dtype)
    needed = count * like.numel()
    if key not in _SCRATCH or _SCRATCH[key].numel() < needed:
        _SCRATCH[key] = torch.empty(needed, dtype=like.dtype, device=like.device)
    return list(_SCRATCH[key][:needed].view(count, -1)) if needed else [like.new_empty(0)] * count


def _wait_all(requests: list) -> None:
    for request in requests:
        request.wait()
    requests.clear()


def tree_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place by recursive doubling; return it. Latency-optimal.

    With N a power of two: in round k = 0 … log2(N)-1 rank r exchanges its whole
    (partially summed) tensor with rank r xor 2^k and adds what it receives. After
    round k each rank holds the sum over a block of 2^(k+1) ranks, so log2(N)
    rounds sum over all of them: log2(N) latencies instead of the ring's 2(N-1),
    for log2(N) * M bytes per rank instead of 2(N-1)/N * M.

    Any other N: with p the largest power of two <= N, each of the N - p extra
    ranks first hands its tensor to rank r - p (which adds it), sits out the
    rounds among the first p ranks, and receives the finished sum back: two more
    rounds. The sum order is the same on both sides of every exchange, so all ranks
    end bitwise equal.
    """
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    if n == 1:
        return tensor
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    flat = work.view(-1)
    incoming = torch.empty_like(flat)

    def peer(r: int) -> int:
        return r if group is None else dist.get_global_rank(group, r)

    p = 1 << (n.bit_length() - 1)
    if rank >= p:  # an extra rank: fold in, wait for the answer
        _wait_all([dist.isend(flat, peer(rank - p), group=group)])
        _wait_all([dist.irecv(flat, peer(rank - p), group=group)])
    else:
        if rank + p < n:
            _wait_all([dist.irecv(incoming, peer(rank + p), group=group)])
            flat.add_(incoming)
        distance = 1
        while distance < p:
            partner = rank ^ distance
            _wait_all([dist.isend(flat, peer(partner), group=group), dist.irecv(incoming, peer(partner), group=group)])
            if partner < rank:  # the lower rank's partial sum first on both sides: bitwise equal results
                incoming.add_(flat)
                flat.copy_(incoming)
            else:
                flat.add_(incoming)
            distance *= 2
        if rank + p < n:
            _wait_all([dist.isend(flat, peer(rank + p), group=group)])
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def ring_all_gather(tensor: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's ``tensor`` on every rank: returns a list whose entry i is rank i's tensor.

    In step s rank r forwards the piece of rank (r - s) mod N to the right and
    receives the piece of rank (r - s - 1) mod N from the left: N-1 steps, each
    rank sends (N-1) pieces, i.e. (N-1)/N of the gathered output.
    """
    rank, n, right, left = ring_peers(group)
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


def tree_steps(world_size: int) -> int:
    """Sequential messages of recursive doubling: log2(p) rounds among p = 2^floor(log2 N) ranks,
    plus one to fold the N - p extra ranks in and one to hand them the result."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    p = 1 << (world_size.bit_length() - 1)
    return (p.bit_length() - 1) + (2 if world_size > p else 0)


def tree_all_reduce_bytes(message_bytes: float, world_size: int) -> float:
    """The most bytes any rank sends in :func:`tree_all_reduce`: the whole M in each of its rounds."""
    p = 1 << (world_size.bit_length() - 1)
    return ((p.bit_length() - 1) + (1 if world_size > p else 0)) * message_bytes


def all_reduce_cost(algorithm: str, message_bytes, world_size: int):
    """(latencies, bytes) on the critical path of an all-reduce: the α–β model is latencies·α + bytes/β.

    ring: 2(N-1) steps of M/N bytes each; recursive doubling ("doubling", or its historical name "tree"):
    :func:`tree_steps` rounds of M each.
    """
    n = world_size
    if algorithm == "ring":
        return 2 * (n - 1), ring_all_reduce_bytes(message_bytes, n)
    if algorithm in ("doubling", "tree"):
        return tree_steps(n), tree_steps(n) * message_bytes
    raise ValueError(f"algorithm must be 'ring' or 'doubling' ('tree'), got {algorithm!r}")


def ring_all_reduce_time(message_bytes, world_size: int, alpha: float, beta: float):
    """The alpha-beta model: t = 2(N-1)*alpha + 2(N-1)/N * M / beta (alpha in s, beta in bytes/s)."""
    latencies, nbytes = all_reduce_cost("ring", message_bytes, world_size)
    return latencies * alpha + nbytes / beta


def tree_all_reduce_time(message_bytes, world_size: int, alpha: float, beta: float):
    """The alpha-beta model of recursive doubling: t = steps * (alpha + M / beta), steps = log2(N) for N = 2^k."""
    latencies, nbytes = all_reduce_cost("tree", message_bytes, world_size)
    return latencies * alpha + nbytes / beta


def double_binary_tree_all_reduce_time(message_bytes, world_size: int, alpha: float, beta: float):
    """The α–β model of NCCL's tree all-reduce, a pipelined *double binary tree* (Sanders, Speck & Träff,
    2009; NCCL 2.4), not recursive doubling: t ≈ 2·⌈log₂N⌉·α + 2·M/β.

    Two binary trees each carry half of M: a reduce up the tree, then a broadcast down, cut into small
    chunks that stream through (pipelined), so the latency is the trees' depth, up and down, not a round
    per byte. Every rank is an inner node (two children) of one tree and a leaf of the other, so it
    sends M/2 + M/2 up and 2·M/2 down: about 2·M per rank in all, close to the ring's 2(N-1)/N·M —
    not recursive doubling's log₂N·M. (NCCL builds the trees across nodes and chains the GPUs within a
    node; the pipeline's fill time, a few chunks per level, is left out.)"""
    if world_size < 2:
        return 0.0 * message_bytes
    return 2 * math.ceil(math.log2(world_size)) * alpha + 2 * message_bytes / beta


def in_network_all_reduce_bytes(message_bytes: float, world_size: int) -> float:
    """Bytes one GPU sends in an all-reduce that the switch reduces (NVLink SHARP, NCCL's NVLS algorithm): its
    whole input once, to be reduced in the switch, and its 1/N of the result once, to be multicast — (N+1)/N·M,
    about M whatever N, against the ring's 2(N-1)/N·M. NCCL's maintainers give the two halves: reduce-scatter
    sends S and receives S/N, all-gather sends S/N and receives S (NVIDIA/nccl issue #1083)."""
    return (world_size + 1) * message_bytes / world_size


def in_network_all_reduce_time(message_bytes, world_size: int, alpha: float, beta: float):
    """The α–β model of an in-switch all-reduce: two steps (reduce in the switch, multicast the result) and
    :func:`in_network_all_reduce_bytes` on each GPU's link: t ≈ 2·α + (N+1)/N·M/β."""
    if world_size < 2:
        return 0.0 * message_bytes
    return 2 * alpha + in_network_all_reduce_bytes(message_bytes, world_size) / beta


# gloo's all-reduce, as PyTorch's ProcessGroupGloo calls it (gloo::allreduce, algorithm "ring", in
# gloo/allreduce.cc): the message is cut into S segments, at least 2N, at most 1 MiB each (kMaxSegmentSize) and a
# multiple of N; each rank owns S/N of them, and each phase (reduce-scatter, all-gather) forwards the S - S/N it
# does not own, skipping empty ones. Its TCP transport (gloo/transport/tcp/pair.cc) puts a 48-byte preamble
# (struct Op: six size_t) before every data message, and every transfer is announced both ways: Pair::send sends
# a NOTIFY_SEND_READY, Pair::recv a NOTIFY_RECV_READY, each a preamble alone.
GLOO_PREAMBLE_BYTES = 48
GLOO_MAX_SEGMENT_BYTES = MiB


class GlooWire(NamedTuple):
    """What one rank's TCP sockets carry for one gloo all-reduce (see :func:`gloo_all_reduce_wire`)."""

    total: int  # bytes sent: the tensor's segments and the protocol's preambles
    tensor: int  # of which the tensor's own bytes
    sends: int  # data messages sent (each: a send-ready notice and the data's preamble)
    receives: int  # data messages received (each: a recv-ready notice sent back)

    @property
    def protocol(self) -> int:
        return self.total - self.tensor


def gloo_all_reduce_wire(message_bytes: int, world_size: int, rank: int, element_size: int = 4) -> GlooWire:
    """The bytes rank ``rank`` sends in gloo's ring all-reduce of ``message_bytes``, counted the way gloo's
    ring (``gloo/allreduce.cc``) cuts and sends the message and its TCP transport frames it (the comment above):
    what :mod:`distlab.runtime.wire` measures, for the notebooks to explain it."""
    n = world_size
    if n < 2:
        return GlooWire(0, 0, 0, 0)
    segments = -(-max(-(-message_bytes // GLOO_MAX_SEGMENT_BYTES), 2 * n) // n) * n
    owned = segments // n
    segment_bytes = -(-(-(-message_bytes // segments)) // element_size) * element_size

    def lengths(first: int) -> list[int]:  # the non-empty segments of one phase, starting at segment `first`
        spans = (min(segment_bytes, message_bytes - ((first + i) % segments) * segment_bytes)
                 for i in range(segments - owned))
        return [length for length in spans if length > 0]

    sent = lengths((rank + 1) * owned) + lengths(rank * owned)  # reduce-scatter, then all-gather
    received = lengths((rank + 2) * owned) + lengths((rank + 1) * owned)
    total = sum(sent) + GLOO_PREAMBLE_BYTES * (2 * len(sent) + len(received))
    return GlooWire(total, sum(sent), len(sent), len(received))


def fit_alpha_beta(message_bytes: Sequence[float], seconds: Sequence[float], world_size: int,
                   algorithm: str | Sequence[str] = "ring") -> tuple[float, float]:
    """Fit (alpha, beta) of the α–β model to measured all-reduce times by least squares.

    ``algorithm`` names the algorithm of every sample ("ring" or "tree"), or one per
    sample: a ring and a tree built from the same sends share one alpha and one
    beta, so fitting both together pins alpha with the tree's few large messages
    and beta with the ring's many small ones. The model is linear in (alpha, 1/beta);
    each point is weighted by 1/t, so a 4 KiB message (latency-bound) counts as much
    as a 16 MiB one (bandwidth-bound).
    """
    if world_size < 2:
        raise ValueError("an all-reduce on one rank sends nothing; fit on world_size >= 2")
    m = np.asarray(message_bytes, dtype=float)
    t = np.asarray(seconds, dtype=float)
    names = [algorithm] * len(m) if isinstance(algorithm, str) else list(algorithm)
    if len(names) != len(m):
        raise ValueError(f"{len(names)} algorithm names for {len(m)} samples")
    design = np.array([all_reduce_cost(name, size, world_size) for name, size in zip(names, m)], dtype=float)
    (alpha, inv_beta), *_ = np.linalg.lstsq(design / t[:, None], np.ones_like(t), rcond=None)
    if inv_beta <= 0:  # noise swamped the slope: fall back to the largest message's bandwidth
        largest = int(np.argmax(m))
        inv_beta = t[largest] / design[largest, 1]
    return max(float(alpha), 0.0), float(1.0 / inv_beta)


def crossover_bytes(world_size: int, alpha: float, beta: float) -> float:
    """The message size at which the α–β model says ring and tree all-reduce take equally long.

    Below it the tree's fewer latencies win, above it the ring's fewer bytes. With
    S steps and B·M bytes on each one's critical path, M* = (S_ring - S_tree)·α·β /
    (B_tree - B_ring); for N = 4 that is 8·α·β. ``inf`` when the tree never loses
    (N = 2, where both send M per rank).
    """
    s_ring, b_ring = all_reduce_cost("ring", 1.0, world_size)
    s_tree, b_tree = all_reduce_cost("tree", 1.0, world_size)
    if b_tree <= b_ring:
        return math.inf
    return max(0.0, (s_ring - s_tree) * alpha * beta / (b_tree - b_ring))


def median_time(rows: list[dict], name: str, message_bytes: int) -> float:
    """The median seconds of implementation ``name`` at ``message_bytes`` in :func:`bandwidth_sweep` rows."""
    for row in rows:
        if row["name"] == name and row["bytes"] == message_bytes:
            return row["median_s"]
    raise KeyError(f"no {name!r} row at {message_bytes} bytes")


def measured_crossover(rows: list[dict], small: str = "tree", large: str = "ring") -> float | None:
    """Where ``large`` starts to beat ``small`` in a sweep: interpolated on log(size) between the last
    size ``small`` wins and the first ``large`` wins; ``None`` when the order never flips."""
    sizes = sorted({r["bytes"] for r in rows if r["name"] in (small, large)})
    logratio = [math.log(median_time(rows, large, s) / median_time(rows, small, s)) for s in sizes]
    for i in range(1, len(sizes)):
        if logratio[i - 1] > 0 >= logratio[i]:
            a, b = logratio[i - 1], logratio[i]
            x0, x1 = math.log(sizes[i - 1]), math.log(sizes[i])
            return math.exp(x0 + (x1 - x0) * a / (a - b))
    return None


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


def human_bytes(n: float) -> str:
    """``4096`` → ``"4 KiB"``, ``5.2e6`` → ``"4.96 MiB"`` (three significant digits)."""
    for unit, scale in (("GiB", 2**30), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.3g} B"


def human_rate(bytes_per_second: float) -> str:
    """A bandwidth with the unit that keeps three significant digits: ``"5.1 MB/s"``, ``"0.36 GB/s"``."""
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_second >= 0.1 * scale:
            return f"{bytes_per_second / scale:.3g} {unit}"
    return f"{bytes_per_second:.3g} B/s"


def format_sweep(rows: list[dict], baseline: str | None = None) -> str:
    """A table of :func:`bandwidth_sweep` rows: one line per size, median time and bus bandwidth per impl.

    With ``baseline`` (an impl name), one more column per other impl gives its
    median time divided by the baseline's (> 1: slower than the baseline).
    """
    names = list(dict.fromkeys(r["name"] for r in rows))
    sizes = list(dict.fromkeys(r["bytes"] for r in rows))
    by = {(r["name"], r["bytes"]): r for r in rows}
    others = [name for name in names if name != baseline] if baseline else []
    head = f"{'size':>10}" + "".join(f"{name + ' ms':>12}{name + ' busbw':>14}" for name in names)
    head += "".join(f"{other + '/' + baseline:>12}" for other in others)
    lines = [head]
    for size in sizes:
        line = f"{human_bytes(size):>10}"
        for name in names:
            row = by[(name, size)]
            line += f"{row['median_s'] * 1e3:>12.3f}{human_rate(row['busbw']):>14}"
        line += "".join(f"{by[(o, size)]['median_s'] / by[(baseline, size)]['median_s']:>12.2f}" for o in others)
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
