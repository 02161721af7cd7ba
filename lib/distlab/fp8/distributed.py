"""FP8 weights across ranks: one scale for a sharded tensor, and half the bytes of a bf16 all-gather.

Under FSDP (or tensor parallelism) each rank holds a slice of a weight. FSDP gathers the
full weight before using it; with FP8 matmuls it can gather the FP8 copy instead — one
byte per element instead of bf16's two (torchao's FP8 all-gather for FSDP2). For one
per-tensor scale the ranks must first agree on the amax of the **whole** weight: a single
all-reduce (MAX) of their local amaxes. A rank that scaled its slice by its own amax
would write FP8 codes that mean something else under the scale the others use.

``all_gather_fp8`` runs on every rank of a group (a ``distlab.launch`` job, or torchrun):

    torchrun --nproc-per-node=4 -m distlab.torchrun distlab.fp8.distributed:demo
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distlab.fp8.formats import FORMATS, Format
from distlab.fp8.scaling import quantize
from distlab.runtime import comm
from distlab.runtime.rank import device

__all__ = ["global_amax", "all_gather_fp8", "demo"]


def global_amax(shard: torch.Tensor, group=None) -> torch.Tensor:
    """The amax of the whole sharded tensor on every rank: one all-reduce (MAX) of the local amaxes."""
    amax = shard.detach().abs().amax().float().reshape(1)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def all_gather_fp8(shard: torch.Tensor, fmt: Format | str = "e4m3", group=None,
                   shared_scale: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast this rank's row-slice to FP8 and all-gather the FP8 bytes; returns ``(q_full, scales)``.

    ``scales`` holds the scale each rank used (one per rank, gathered too). With
    ``shared_scale`` they are all the scale of the whole tensor, so ``q_full`` with
    ``scales[0]`` is exactly what one process quantising the full tensor would hold.
    ``shared_scale=False`` scales each slice by its own amax: the mistake the all-reduce prevents.
    """
    fmt = fmt if isinstance(fmt, Format) else FORMATS[fmt]
    amax = global_amax(shard, group) if shared_scale else None
    q, scale = quantize(shard, fmt, amax=amax)
    world = dist.get_world_size(group)
    gathered = torch.empty((world * shard.shape[0], shard.shape[1]), dtype=torch.uint8, device=shard.device)
    dist.all_gather_into_tensor(gathered, q.contiguous().view(torch.uint8), group=group)  # gloo/NCCL move bytes
    scales = torch.empty(world, dtype=torch.float32, device=shard.device)
    dist.all_gather_into_tensor(scales, scale.reshape(1), group=group)
    return gathered.view(fmt.dtype), scales


def demo(rows: int = 512, cols: int = 256, seed: int = 0) -> dict:
    """Every rank builds the same weight, keeps its row-slice, and all-gathers it in FP8 and in bf16.

    Returns what rank-0 code would compare: whether the FP8 gather equals quantising the full
    weight in one process, and the bytes each gather put on the wire (from distlab's comm
    log when run under ``distlab.launch``).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if rows % world:
        raise ValueError(f"rows={rows} must be divisible by the world size {world}")
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=generator) * torch.logspace(-2, 1, rows).unsqueeze(1)
    shard = weight.chunk(world)[rank].to(device())
    reference, ref_scale = quantize(weight, "e4m3")
    out = {}
    for label, shared in (("shared scale", True), ("own scale", False)):
        before = comm.snapshot()
        q, scales = all_gather_fp8(shard, "e4m3", shared_scale=shared)
        q, scales = q.cpu(), scales.cpu()
        as_one = q.float() * scales[0]  # a consumer that takes the gathered tensor with one scale
        out[label] = {
            "codes_equal": bool(torch.equal(q.view(torch.uint8), reference.view(torch.uint8))),
            "scales_equal": bool(torch.equal(scales, ref_scale.reshape(1).expand(world))),
            "relative_error": float((as_one - weight).norm() / weight.norm()),
            "payload_bytes": comm.since(before).total("payload_bytes", "all_gather")}
    before = comm.snapshot()
    full = torch.empty(rows, cols, dtype=torch.bfloat16, device=shard.device)
    dist.all_gather_into_tensor(full, shard.bfloat16())
    out["bf16"] = {"payload_bytes": comm.since(before).total("payload_bytes", "all_gather")}
    return out
