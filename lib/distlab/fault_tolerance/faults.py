"""The faults the lab injects, each for real: a killed process, a hung rank, a flipped bit.

Nothing here simulates a failure with an exception. A killed rank sends itself
SIGKILL (no cleanup, no traceback: what a lost node looks like to the others), a
hung rank blocks in a receive nobody will ever answer, a bit flip changes one bit of
a real parameter or a real checkpoint file. Detection is left to the code under test:
the launcher's failure reports, checksums, hashes, guards.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

__all__ = ["Fault", "die", "DyingWriter", "hang_in_recv", "flip_bit", "corrupt_file", "flip_bit_on_disk"]


@dataclass(frozen=True)
class Fault:
    """Kill ``rank`` at ``step``: before the step's forward (``where="train"``), or halfway
    through writing the checkpoint taken after ``step`` updates (``where="save"``)."""

    rank: int
    step: int
    where: str = "train"

    def __post_init__(self) -> None:
        if self.where not in ("train", "save"):
            raise ValueError(f"where must be 'train' or 'save', got {self.where!r}")

    def kills_in_training(self, rank: int, step: int) -> bool:
        return self.where == "train" and rank == self.rank and step == self.step

    def kills_in_save(self, rank: int, step: int) -> bool:
        return self.where == "save" and rank == self.rank and step == self.step

    def maybe_kill(self, rank: int, step: int) -> None:
        if self.kills_in_training(rank, step):
            die()


def die() -> None:
    """SIGKILL this process: no exception, no cleanup, no flush. A signal a process sends
    itself is delivered before ``kill`` returns, so nothing after this line runs."""
    os.kill(os.getpid(), signal.SIGKILL)


class DyingWriter(FileSystemWriter):
    """A DCP writer whose rank is killed halfway through its shard.

    It writes one file per tensor and dies after half of this rank's tensors: the
    directory keeps real shard files and no metadata, as after a node lost mid-save.
    """

    def __init__(self, path: str | os.PathLike):
        super().__init__(str(path), single_file_per_rank=False, sync_files=True)

    def write_data(self, plan, planner):
        half = dataclasses.replace(plan, items=plan.items[:max(1, len(plan.items) // 2)])
        super().write_data(half, planner).wait()
        die()


def hang_in_recv(peer: int) -> None:
    """Block in a receive from ``peer`` that ``peer`` never sends: a rank stuck in communication
    (on GPUs: a kernel waiting for a peer that went into a different collective, or a lost message)."""
    dist.recv(torch.zeros(1), src=peer)


@torch.no_grad()
def flip_bit(tensor: torch.Tensor, index: int, bit: int) -> tuple[float, float]:
    """Flip bit ``bit`` of element ``index`` (of the flattened tensor), in place; return (before, after).

    For float32, bits 0-22 are the mantissa (bit 22 halves or adds half the value's
    significand), 23-30 the exponent (bit 23+k multiplies or divides the value by 2^(2^k)), 31 the sign.
    """
    flat = tensor.view(-1)
    if not 0 <= index < flat.numel():
        raise IndexError(f"index {index} is outside a tensor of {flat.numel()} elements")
    width = tensor.element_size() * 8
    if not 0 <= bit < width:
        raise ValueError(f"bit {bit} is outside a {width}-bit {tensor.dtype} element")
    ints = flat.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])
    before = float(flat[index])
    mask = 1 << bit
    if bit == width - 1:  # the sign bit: as a signed integer, flipping it is adding the minimum value
        mask = -(1 << (width - 1))
    ints[index] ^= mask
    return before, float(flat[index])


def corrupt_file(path: str | os.PathLike, offset: int | None = None) -> int:
    """Flip one bit of the byte at ``offset`` (default: the middle) of a file on disk; return the offset."""
    path = Path(path)
    size = path.stat().st_size
    offset = size // 2 if offset is None else offset
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))
    return offset


def flip_bit_on_disk(checkpoint: str | os.PathLike, tensor: torch.Tensor, index: int, bit: int) -> tuple[str, int]:
    """Flip bit ``bit`` of element ``index`` of ``tensor`` where a checkpoint stores it on disk: bit rot.

    DCP stores a tensor's raw bytes contiguously inside a rank's shard file, so the
    saved copy is found by searching the files for the tensor's bytes. Returns the
    file's name and the byte offset changed.
    """
    raw = tensor.detach().cpu().contiguous().numpy().tobytes()
    size = tensor.element_size()
    if not 0 <= index < tensor.numel() or not 0 <= bit < 8 * size:
        raise ValueError(f"element {index}, bit {bit} is outside a {tensor.numel()}-element {tensor.dtype} tensor")
    for file in sorted(Path(checkpoint).glob("*.distcp")):
        data = file.read_bytes()
        at = data.find(raw)
        if at >= 0:
            offset = at + index * size + bit // 8  # little-endian (x86, ARM): bit k lives in byte k // 8
            corrupt = bytes([data[offset] ^ (1 << (bit % 8))])
            with open(file, "r+b") as f:
                f.seek(offset)
                f.write(corrupt)
            return file.name, offset
    raise ValueError(f"{Path(checkpoint).name} holds no copy of that tensor's bytes")
