"""Stage 7: GPT-2 tokens in uint16 ``.bin`` shards, the format nanoGPT-style loaders memmap.

Every document is written as ``[<|endoftext|>, tok, tok, ...]`` so documents are
separated by token 50256 and each shard is self-contained. GPT-2's vocabulary
(50,257) fits in uint16, halving the size of int32 shards. Each shard has a JSON
index of ``(doc id, offset, length)`` spans, which is what lets purge cut one
document out. Files are written to a temporary name and renamed with
``os.replace``, so a crash never leaves a half-written shard under the real name.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

EOT = 50256
SHARD_DTYPE = np.dtype("<u2")  # uint16, little-endian
DEFAULT_SHARD_TOKENS = 1 << 20
# Where GPT-2's BPE files wait on disk, so lab 10 tokenizes offline: the copy `make install` leaves in the venv
# (from the course's shared folder, or fetched once while installing), then the shared folder beside a checkout.
VENV_TIKTOKEN = Path(sys.prefix) / "share" / "distlab" / "tiktoken_cache"
_REPO_SHARED_TIKTOKEN = Path(__file__).resolve().parents[3] / ".." / "shared" / "tiktoken_cache"


def ensure_tiktoken_cache() -> None:
    """Point tiktoken at GPT-2 files already on disk when no cache is configured: without one, tiktoken downloads
    them at first use, which fails in an offline room."""
    if os.environ.get("TIKTOKEN_CACHE_DIR"):  # tiktoken reads an empty value as "download, keep nothing"
        return
    for folder in (VENV_TIKTOKEN, _REPO_SHARED_TIKTOKEN):
        if folder.is_dir() and any(folder.iterdir()):
            os.environ["TIKTOKEN_CACHE_DIR"] = str(folder.resolve())
            return


@functools.lru_cache(maxsize=1)
def gpt2_encoding():
    ensure_tiktoken_cache()
    import tiktoken  # noqa: PLC0415  tiktoken is heavy and only encoding needs it

    return tiktoken.get_encoding("gpt2")


def encode_document(text: str) -> np.ndarray:
    """Token span of one document: end-of-text first, then its GPT-2 tokens, as uint16."""
    tokens = gpt2_encoding().encode_ordinary(text)
    return np.array([EOT, *tokens], dtype=SHARD_DTYPE)


def encode_documents(texts: Sequence[str]) -> list[np.ndarray]:
    """Batched :func:`encode_document` (tiktoken encodes a batch on several threads)."""
    batches = gpt2_encoding().encode_ordinary_batch(list(texts))
    return [np.array([EOT, *tokens], dtype=SHARD_DTYPE) for tokens in batches]


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to ``path.tmp-<pid>`` then rename: readers see the old file or the new one."""
    path = Path(path)
    temporary = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(temporary, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def atomic_write_json(path: Path, value) -> None:
    atomic_write_bytes(path, json.dumps(value, indent=1, sort_keys=True).encode("utf-8"))


def tokenize_to_bin(docs: Iterable[str], out_path) -> list[int]:
    """Write documents to one uint16 shard; returns each document's offset (its EOT)."""
    spans = [encode_document(text) for text in docs]
    offsets = np.cumsum([0] + [len(span) for span in spans[:-1]]).tolist() if spans else []
    atomic_write_bytes(Path(out_path), np.concatenate(spans).tobytes() if spans else b"")
    return offsets


def read_shard(path) -> np.ndarray:
    return np.fromfile(path, dtype=SHARD_DTYPE)


def index_path(shard_path: Path) -> Path:
    return Path(shard_path).with_suffix(".index.json")


class ShardWriter:
    """Packs document spans into shards of about ``shard_tokens`` tokens (a document is
    never split: a shard closes before the span that would overflow it)."""

    def __init__(self, directory, shard_tokens: int = DEFAULT_SHARD_TOKENS, prefix: str = "shard"):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.shard_tokens = shard_tokens
        self.prefix = prefix
        self.written: list[Path] = []
        self._spans: list[np.ndarray] = []
        self._index: list[dict] = []
        self._size = 0

    def add(self, doc_id: str, span: np.ndarray) -> tuple[str, int]:
        """Queue one span; returns (shard file name, offset) where it will live."""
        if self._spans and self._size + len(span) > self.shard_tokens:
            self.flush()
        offset = self._size
        self._spans.append(span)
        self._index.append({"id": doc_id, "offset": offset, "length": int(len(span))})
        self._size += len(span)
        return self._next_name(), offset

    def _next_name(self) -> str:
        return f"{self.prefix}_{len(self.written):05d}.bin"

    def flush(self) -> Path | None:
        if not self._spans:
            return None
        path = self.directory / self._next_name()
        write_shard(path, self._spans, self._index)
        self.written.append(path)
        self._spans, self._index, self._size = [], [], 0
        return path

    def close(self) -> list[Path]:
        self.flush()
        return self.written


def write_shard(path: Path, spans: list[np.ndarray], index: list[dict]) -> None:
    """Shard then index, each atomically; the index says which document each span is."""
    atomic_write_bytes(path, np.concatenate(spans).astype(SHARD_DTYPE).tobytes())
    atomic_write_json(index_path(path), {"shard": path.name, "dtype": "uint16-le", "eot": EOT,
                                         "tokens": int(sum(len(s) for s in spans)), "documents": index})


def read_index(shard_path) -> dict:
    with open(index_path(shard_path), encoding="utf-8") as handle:
        return json.load(handle)
