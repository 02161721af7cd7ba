"""Measuring context-parallel attention: peak memory per rank, and the exactness/timing worker for torchrun."""

from __future__ import annotations

import statistics
import time
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from distlab.context_parallel.blocks import SEQ_DIM, layout_positions
from distlab.context_parallel.ring import ring_attention
from distlab.context_parallel.ulysses import _check_heads, ulysses_attention, usp_attention, usp_groups, usp_positions
from distlab.runtime import comm
from distlab.runtime.rank import device as rank_device


class PeakMemory(TorchDispatchMode):
    """Peak bytes of the tensors allocated inside a ``with PeakMemory(device) as peak:`` block.

    On CUDA the caching allocator's own statistics. On a CPU, which keeps none, every tensor an
    operator creates in the block is counted until its storage is freed (a dispatch mode sees
    each op's outputs): the peak of what was alive at once, like ``torch.cuda.max_memory_allocated``.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        super().__init__()
        self.device = torch.device(device)
        self.bytes = 0
        self._live: dict[int, int] = {}
        self._current = 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._baseline = torch.cuda.memory_allocated(self.device)
            return self
        return super().__enter__()

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self._baseline
            return None
        return super().__exit__(*exc)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """Leave our ``__torch_dispatch__`` unwrapped: torch >= 2.10 wraps it in ``torch._disable_dynamo``,
        whose first call imports dynamo (seconds per rank) for a mode that is never compiled."""
        return False

    def _freed(self, key: int) -> None:
        self._current -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in tree_leaves(result):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self._live:
                    self._live[key] = storage.nbytes()
                    self._current += storage.nbytes()
                    self.bytes = max(self.bytes, self._current)
                    weakref.finalize(storage, self._freed, key)
        return result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def verify(method: str = "ring", batch: int = 1, heads: int = 4, seq_len: int = 256, head_dim: int = 16,
           causal: bool = True, layout: str = "zigzag", ulysses_size: int = 2, dtype: str = "float32",
           seed: int = 0, repeats: int = 1, check: bool = True) -> dict:
    """Run one context-parallel attention forward and backward on every rank; the torchrun entry point.

        torchrun --nproc-per-node=8 -m distlab.torchrun distlab.context_parallel:verify method=ring seq_len=8192
        torchrun --nproc-per-node=8 -m distlab.torchrun distlab.context_parallel:verify method=usp ulysses_size=4 \
            seq_len=131072 dtype=bfloat16 check=False repeats=5

    Every rank draws the same full Q, K, V and output gradient from ``seed``, keeps its shard and
    runs ``method`` (ring, ulysses or usp). With ``check`` it compares its output and gradients with
    ``F.scaled_dot_product_attention`` on the full sequence (max abs error; every rank computes the
    full attention for that, so keep it for sizes one device can hold). Returns this rank's errors,
    the median seconds of forward + backward, and bytes sent per forward + backward.
    """
    if method not in ("ring", "ulysses", "usp"):
        raise ValueError(f"method must be ring, ulysses or usp, got {method!r}")
    rank, world, dev = dist.get_rank(), dist.get_world_size(), rank_device()
    if method == "ulysses":
        layout = "contiguous"
        _check_heads(heads, world)
    torch_dtype = getattr(torch, dtype)
    generator = torch.Generator().manual_seed(seed)
    full = [torch.randn(batch, heads, seq_len, head_dim, generator=generator) for _ in range(4)]
    full = [t.to(dev, torch_dtype) for t in full]
    groups = usp_groups(ulysses_size) if method == "usp" else ()
    if method == "usp":
        positions = usp_positions(seq_len, world, ulysses_size, rank, layout).to(dev)
    else:
        positions = layout_positions(seq_len, world, rank, layout).to(dev)
    q, k, v, dout = (t.index_select(SEQ_DIM, positions) for t in full)
    times, sent = [], []
    for _ in range(repeats):
        q_, k_, v_ = (t.detach().clone().requires_grad_() for t in (q, k, v))
        before = comm.snapshot()
        dist.barrier()
        start = time.perf_counter()
        if method == "ring":
            out = ring_attention(q_, k_, v_, causal, layout)
        elif method == "ulysses":
            out = ulysses_attention(q_, k_, v_, causal)
        else:
            out = usp_attention(q_, k_, v_, causal, layout, *groups)
        out.backward(dout)
        _sync(dev)
        times.append(time.perf_counter() - start)
        sent.append(comm.since(before).total())
    result = {"rank": rank, "world_size": world, "method": method, "causal": causal, "layout": layout,
              "device": str(dev), "dtype": dtype, "seconds": statistics.median(times), "bytes_sent": sent[-1]}
    if check:
        ref = [t.detach().clone().requires_grad_() for t in full[:3]]
        ref_out = F.scaled_dot_product_attention(*ref, is_causal=causal)
        ref_out.backward(full[3])
        pick = lambda t: t.detach().index_select(SEQ_DIM, positions).float()  # noqa: E731
        result["forward_error"] = (out.detach().float() - pick(ref_out)).abs().max().item()
        result["grad_error"] = max((mine.grad.float() - pick(theirs.grad)).abs().max().item()
                                   for mine, theirs in zip((q_, k_, v_), ref))
    return result


