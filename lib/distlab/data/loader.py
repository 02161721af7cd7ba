"""From token shards to training batches: held-out documents, a DP-sharded stream that resumes exactly, and the
baseline a trained model has to beat.

Lab 10 ends with shards of documents; a training run needs three more things, and each is easy to get subtly wrong:

* **Validation held out by document** (:func:`split_documents`). Cutting the token stream at 90% leaks: the tail
  of a document lands in training and its head in validation, or a boilerplate line repeats across the cut. Each
  document goes wholly to one side, chosen by a hash of its id, so the split does not depend on shard order.
* **A loader whose position is its whole state** (:class:`ResumableTokenLoader`). The stream is cut into
  windows of ``seq_len + 1`` tokens (each window's last token is the next one's first: the target of one, the
  input of the other), visited in an order drawn from ``(seed, epoch)`` alone (a corpus read front to back
  trains on one source at a time); step ``k`` takes the next ``batch_size`` windows of that order and DP rank
  ``d`` keeps rows ``d·B/dp … (d+1)·B/dp``. The position counts *global* windows, so it is the same number on
  every rank, it and the epoch are all a checkpoint must hold, and a restart continues with exactly the windows
  an uninterrupted run would have read: none twice, none skipped.
  A random-window loader (:class:`~distlab.data.tokens.TokenShardLoader`) needs no state but reads some tokens
  twice and others never in an epoch.
* **The unigram baseline** (:func:`unigram_loss`): the cross-entropy of predicting every validation token from the
  training set's token frequencies alone. A model whose validation loss is not below it has learned frequencies,
  not language.

:func:`compact_vocabulary` keeps the tokens the training split uses (a small corpus touches a few thousand of
GPT-2's 50,257), so a CPU-sized model does not spend most of its parameters and FLOPs on rows it never sees.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from distlab.data.shards import SHARD_DTYPE, read_index, read_shard, write_shard

__all__ = ["DocumentSplit", "split_documents", "window_order", "ResumableTokenLoader", "compact_vocabulary",
           "unigram_loss"]


@dataclass(frozen=True)
class DocumentSplit:
    """Where the split wrote its two shards, and how many documents and tokens each holds."""

    train: Path
    val: Path
    documents: dict[str, int]
    tokens: dict[str, int]


def _is_validation(doc_id: str, fraction: float, seed: int) -> bool:
    digest = hashlib.sha1(f"{seed}:{doc_id}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split_documents(shard_paths: Sequence[str | os.PathLike], out_dir: str | os.PathLike, val_fraction: float = 0.1,
                    seed: int = 0) -> DocumentSplit:
    """Write ``train.bin`` and ``val.bin`` (with their indexes) under ``out_dir``, each document wholly on one side.

    A document goes to validation when a hash of ``(seed, its id)`` falls below ``val_fraction``. With few documents
    the hash may leave a side empty: then the last document goes to validation, or the first to training, and the
    one-line error for fewer than two documents says why no split exists.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction} must lie strictly between 0 and 1")
    documents = []
    for path in shard_paths:
        tokens, index = read_shard(path), read_index(path)
        documents += [(d["id"], tokens[d["offset"]:d["offset"] + d["length"]]) for d in index["documents"]]
    if len(documents) < 2:
        raise ValueError(f"{len(documents)} document(s) in {len(shard_paths)} shard(s): a split by document needs "
                         f"at least two")
    side = [_is_validation(doc_id, val_fraction, seed) for doc_id, _ in documents]
    if all(side):
        side[0] = False
    if not any(side):
        side[-1] = True
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths, counts, sizes = {}, {}, {}
    for name, wanted in (("train", False), ("val", True)):
        chosen = [(doc_id, span) for (doc_id, span), v in zip(documents, side) if v == wanted]
        offsets = np.cumsum([0] + [len(span) for _, span in chosen[:-1]]).tolist()
        index = [{"id": doc_id, "offset": int(o), "length": int(len(span))}
                 for (doc_id, span), o in zip(chosen, offsets)]
        paths[name] = out / f"{name}.bin"
        write_shard(paths[name], [span for _, span in chosen], index)
        counts[name], sizes[name] = len(chosen), int(sum(len(span) for _, span in chosen))
    return DocumentSplit(paths["train"], paths["val"], counts, sizes)


def compact_vocabulary(train_tokens: np.ndarray, multiple_of: int = 64) -> tuple[np.ndarray, int]:
    """``(mapping, vocab_size)``: ``mapping[gpt2_id]`` is the token's id in a vocabulary of the ids the training
    tokens use, every other id maps to one "unseen" id; ``vocab_size`` is padded up to ``multiple_of`` (as
    Megatron pads GPT-2's 50,257 to 50,304) so tensor parallelism can split it."""
    seen = np.unique(np.asarray(train_tokens))
    unseen = len(seen)
    mapping = np.full(2**16, unseen, dtype=np.int64)
    mapping[seen] = np.arange(len(seen))
    return mapping, int(math.ceil((unseen + 1) / multiple_of) * multiple_of)


def unigram_loss(train_tokens: np.ndarray, val_tokens: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats per token) of the validation targets under the training tokens' frequencies, add-one
    smoothed so a token unseen in training costs ``log`` of the vocabulary rather than infinity. Targets are the
    tokens a model predicts: all but the first of each window, here all but the first of the stream."""
    counts = np.bincount(np.asarray(train_tokens, dtype=np.int64), minlength=vocab_size).astype(np.float64)
    probs = (counts + 1.0) / (counts.sum() + vocab_size)
    return float(-np.log(probs[np.asarray(val_tokens[1:], dtype=np.int64)]).mean())


def window_order(windows: int, seed: int | None, epoch: int) -> torch.Tensor:
    """The order epoch ``epoch`` visits ``windows`` windows in: a permutation drawn from ``(seed, epoch)`` alone, so
    no generator state has to be saved (``seed=None``: stream order)."""
    if seed is None:
        return torch.arange(windows)
    return torch.randperm(windows, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


class ResumableTokenLoader:
    """Consecutive ``seq_len + 1``-token windows of a token stream, ``batch_size`` (global) per step, each DP rank
    its own rows, with an exact ``state_dict``.

    ``paths``: uint16 shards (lab 10's, or :func:`split_documents`'s), read in order as one stream; ``mapping``
    (from :func:`compact_vocabulary`) renumbers the tokens. An epoch is ``(tokens - 1) // seq_len`` windows in
    the order ``randperm`` draws from ``(seed, epoch)`` (``seed=None``: in stream order); a step never straddles
    two epochs (the last, incomplete batch of an epoch is dropped, as ``drop_last`` does).
    """

    def __init__(self, paths: str | os.PathLike | Sequence[str | os.PathLike], seq_len: int, batch_size: int,
                 dp_rank: int = 0, dp_size: int = 1, mapping: np.ndarray | None = None, seed: int | None = 0):
        paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len={seq_len} and batch_size={batch_size} must be positive")
        if dp_size < 1 or not 0 <= dp_rank < dp_size or batch_size % dp_size:
            raise ValueError(f"DP rank {dp_rank} of {dp_size}: the global batch of {batch_size} sequences must "
                             f"split evenly over dp={dp_size} ranks")
        stream = np.concatenate([np.fromfile(p, dtype=SHARD_DTYPE) for p in paths]).astype(np.int64)
        self.tokens = torch.from_numpy(mapping[stream] if mapping is not None else stream)
        self.seq_len, self.batch_size, self.dp_rank, self.dp_size = seq_len, batch_size, dp_rank, dp_size
        self.windows = (len(self.tokens) - 1) // seq_len
        if self.windows < batch_size:
            raise ValueError(f"{len(self.tokens):,} tokens make {self.windows} windows of {seq_len + 1}: fewer than "
                             f"one batch of {batch_size}")
        self.steps_per_epoch = self.windows // batch_size
        self.seed = seed
        self.epoch, self.position = 0, 0
        self.order = self._order(0)

    def _order(self, epoch: int) -> torch.Tensor:
        return window_order(self.windows, self.seed, epoch)

    @property
    def rows(self) -> int:
        """Sequences this DP rank gets per step."""
        return self.batch_size // self.dp_size

    @property
    def tokens_seen(self) -> int:
        """Input tokens the whole job (every DP rank) has trained on."""
        return (self.epoch * self.steps_per_epoch * self.batch_size + self.position) * self.seq_len

    def window(self, k: int) -> torch.Tensor:
        return self.tokens[k * self.seq_len:k * self.seq_len + self.seq_len + 1]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(x, y)`` of the next step, ``[rows, seq_len]`` int64, ``y`` = ``x`` shifted by one."""
        if self.position + self.batch_size > self.steps_per_epoch * self.batch_size:
            self.epoch, self.position = self.epoch + 1, 0
            self.order = self._order(self.epoch)
        first = self.position + self.dp_rank * self.rows
        batch = torch.stack([self.window(int(k)) for k in self.order[first:first + self.rows]])
        self.position += self.batch_size
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seq_len": self.seq_len,
                "batch_size": self.batch_size, "tokens": len(self.tokens), "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        """Continue where ``state`` was taken. The DP size may differ (the position counts global windows); the
        stream, window and global batch must not, or the same position would name other tokens."""
        mine = (self.seq_len, self.batch_size, len(self.tokens), self.seed)
        theirs = (int(state["seq_len"]), int(state["batch_size"]), int(state["tokens"]), state["seed"])
        if mine != theirs:
            raise ValueError(f"the saved loader read {theirs[2]:,} tokens in windows of {theirs[0]} + 1, "
                             f"{theirs[1]} per step, order seed {theirs[3]}; this one {mine[2]:,}, {mine[0]} + 1, "
                             f"{mine[1]}, seed {mine[3]}: its position would name other tokens")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.order = self._order(self.epoch)

    def __repr__(self) -> str:
        return (f"ResumableTokenLoader({len(self.tokens):,} tokens, {self.windows} windows of {self.seq_len} + 1, "
                f"batch {self.batch_size} (DP rank {self.dp_rank} of {self.dp_size}: {self.rows} rows), "
                f"order seed {self.seed}, epoch {self.epoch}, position {self.position})")
