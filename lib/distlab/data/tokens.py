"""Token shards on disk: flat little-endian uint16 ``.bin`` files, read by memory map.

Why this format: it is what nanoGPT-style pipelines write, it needs no parser, and
``np.memmap`` lets every rank open the same files without loading them into RAM. Batches
are random windows chosen from (seed, step) alone, so a data-parallel rank can compute its
slice of the *global* batch with no communication and the reference trainer sees exactly
the same global batch.
"""

from __future__ import annotations

import copy
import os
from typing import Sequence

import numpy as np
import torch

__all__ = ["write_token_bin", "TokenShardLoader"]

_DTYPE = np.dtype("<u2")


def write_token_bin(tokens, path) -> int:
    """Write token ids as uint16 little-endian; returns the number of tokens written.

    Raises ValueError for ids outside [0, 65535] (uint16 would silently wrap them)."""
    array = np.asarray(tokens.cpu() if isinstance(tokens, torch.Tensor) else tokens).reshape(-1)
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got dtype {array.dtype}")
    if array.size and (array.min() < 0 or array.max() >= 65536):
        raise ValueError(f"token ids must lie in [0, 65535] for uint16 shards; "
                         f"got min {array.min()}, max {array.max()}")
    array.astype(_DTYPE).tofile(os.fspath(path))
    return int(array.size)


class TokenShardLoader:
    """Random ``seq_len + 1`` windows from one or more ``.bin`` shards.

    ``get_batch(step)`` → ``(x, y)`` int64 ``[batch_size, seq_len]`` with ``y`` = ``x`` shifted
    by one; the same (seed, step) always gives the same batch. A window never crosses a shard
    boundary. ``shard(rank, world_size)`` gives the loader for one data-parallel rank.
    """

    def __init__(self, paths: str | os.PathLike | Sequence[str | os.PathLike], seq_len: int, batch_size: int,
                 seed: int = 0):
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        self.paths = [os.fspath(p) for p in paths]
        if not self.paths:
            raise ValueError("no shard paths given")
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len={seq_len} and batch_size={batch_size} must be positive")
        self.seq_len, self.global_batch_size, self.seed = seq_len, batch_size, seed
        self.rank, self.world_size = 0, 1
        self._maps = []
        for path in self.paths:
            size = os.path.getsize(path) // _DTYPE.itemsize
            if size < seq_len + 1:
                raise ValueError(f"shard {path} holds {size} tokens; a window needs seq_len+1={seq_len + 1}")
            self._maps.append(np.memmap(path, dtype=_DTYPE, mode="r", shape=(size,)))
        windows = np.array([len(m) - seq_len for m in self._maps], dtype=np.int64)  # valid starts per shard
        self._cumulative = np.cumsum(windows)

    @property
    def batch_size(self) -> int:
        """Rows this loader returns: the global batch divided by ``world_size``."""
        return self.global_batch_size // self.world_size

    @property
    def num_tokens(self) -> int:
        return int(sum(len(m) for m in self._maps))

    def _window_starts(self, step: int) -> list[tuple[int, int]]:
        rng = np.random.default_rng([self.seed, step])
        picks = rng.integers(0, int(self._cumulative[-1]), size=self.global_batch_size)
        shards = np.searchsorted(self._cumulative, picks, side="right")
        offsets = picks - np.concatenate([[0], self._cumulative[:-1]])[shards]
        return list(zip(shards.tolist(), offsets.tolist()))

    def get_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        starts = self._window_starts(step)
        lo = self.rank * self.batch_size
        rows = [np.asarray(self._maps[s][o : o + self.seq_len + 1], dtype=np.int64)
                for s, o in starts[lo : lo + self.batch_size]]
        tokens = torch.from_numpy(np.stack(rows))
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def shard(self, rank: int, world_size: int) -> "TokenShardLoader":
        """Loader for rank ``rank``: rows ``rank·B/N … (rank+1)·B/N`` of the same global batch."""
        if self.world_size != 1:
            raise ValueError("this loader is already a shard; shard the global loader instead")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        if self.global_batch_size % world_size:
            raise ValueError(f"batch_size={self.global_batch_size} is not divisible by world_size={world_size}")
        local = copy.copy(self)
        local.rank, local.world_size = rank, world_size
        return local

    def __repr__(self) -> str:
        return (f"TokenShardLoader({len(self.paths)} shard(s), {self.num_tokens} tokens, seq_len={self.seq_len}, "
                f"batch_size={self.batch_size}, rank={self.rank}/{self.world_size}, seed={self.seed})")
