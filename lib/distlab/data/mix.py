"""Stage 8: mix several token sources to target weights under a token budget.

Training sets are mixtures (e.g. web 70%, code 10%, books 5%, ...). Given each
source's shards and a target weight, we sample whole documents until each source
reaches its share of the budget; a source too small for its share is repeated (its
``epochs`` exceed 1), which is exactly what a mixture table hides and a report should
show. The mixed documents are shuffled together into new shards.

*Which* documents a source contributes is uniform at random by default. With a
``target`` sample, documents are drawn by **DSIR** importance resampling (Xie et al.
2023, "Data Selection for Language Models via Importance Resampling"): fit a
bag-of-hashed-n-grams model to the target sample and one to the raw source, weight each
document by the likelihood ratio p_target(x) / p_raw(x), and sample without replacement
in proportion to the weights (Gumbel top-k). We hash GPT-2 token unigrams and bigrams
(the paper hashes word n-grams; token ids need no detokenising and work the same way).
DoReMi (Xie et al. 2023, "Optimizing Data Mixtures") answers the other question - the
*weights* of whole domains, learned by a small proxy model - and is not done here.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from distlab.data.output import RunDirectory
from distlab.data.shards import ShardWriter, atomic_write_json, read_index, read_shard

DSIR_BUCKETS = 10_000  # the paper's hashed feature space
_BIGRAM_PRIME = 1_000_003


@dataclass
class SourceShare:
    name: str
    target: float  # normalised target weight
    tokens: int  # tokens taken
    documents: int
    available_tokens: int
    selection: str = "uniform"

    @property
    def epochs(self) -> float:
        return self.tokens / max(self.available_tokens, 1)


def source_documents(directory) -> list[tuple]:
    """(shard path, offset, length) of every document in a directory of shards, or in a run's committed shards."""
    run = RunDirectory(directory)
    if run.manifest() is not None:
        paths = run.shard_paths()
    elif Path(directory).is_dir():
        paths = sorted(Path(directory).rglob("*.bin"))
    else:
        raise ValueError(f"source directory not found: {directory}")
    spans = []
    for path in paths:
        if path.with_suffix(".index.json").exists():
            spans += [(path, entry["offset"], entry["length"]) for entry in read_index(path)["documents"]]
    return spans


def document_tokens(documents: Sequence[tuple]) -> list[np.ndarray]:
    """The token spans of (shard path, offset, length) documents, without their leading end-of-text token."""
    cache: dict = {}
    return [cache.setdefault(path, read_shard(path))[offset + 1:offset + length] for path, offset, length in documents]


def hashed_ngram_counts(tokens: np.ndarray, buckets: int = DSIR_BUCKETS) -> np.ndarray:
    """DSIR's features of one document: counts of its hashed token unigrams and bigrams."""
    ids = np.asarray(tokens, dtype=np.int64)
    hashed = [ids % buckets]
    if len(ids) > 1:
        hashed.append((ids[:-1] * _BIGRAM_PRIME + ids[1:]) % buckets)
    return np.bincount(np.concatenate(hashed), minlength=buckets)


class ImportanceResampler:
    """DSIR: log importance weights of raw documents toward a target sample.

    Both distributions are smoothed categorical models over the hashed features. For a
    fixed-length example the paper's log weight is sum_j count_j * (log p_target_j -
    log p_raw_j); it selects among fixed-length examples. Documents are not all one length:
    a raw sum ranks every short page above every long one. So we score a document as a
    ``chunk_tokens``-token example with its own n-gram mix: ``chunk_tokens`` times the mean
    log ratio over its n-grams (for documents of exactly that length, the paper's weight)."""

    def __init__(self, target: Sequence[np.ndarray], raw: Sequence[np.ndarray], buckets: int = DSIR_BUCKETS,
                 smoothing: float = 1.0, chunk_tokens: int = 128):
        if not len(target) or not len(raw):
            raise ValueError("DSIR needs a non-empty target sample and raw pool")
        self.buckets, self.chunk_tokens = buckets, chunk_tokens
        target_counts = sum(hashed_ngram_counts(t, buckets) for t in target) + smoothing
        raw_counts = sum(hashed_ngram_counts(r, buckets) for r in raw) + smoothing
        self.log_ratio = np.log(target_counts / target_counts.sum()) - np.log(raw_counts / raw_counts.sum())

    def log_weights(self, documents: Sequence[np.ndarray]) -> np.ndarray:
        weights = []
        for doc in documents:
            counts = hashed_ngram_counts(doc, self.buckets)
            weights.append(self.chunk_tokens * (counts @ self.log_ratio) / max(counts.sum(), 1))
        return np.array(weights)

    def order(self, documents: Sequence[np.ndarray], rng: np.random.Generator) -> np.ndarray:
        """All documents in the order of sampling without replacement proportionally to their weights.

        Gumbel top-k: adding independent Gumbel noise to log weights and sorting is exactly
        sequential weighted sampling without replacement."""
        keys = self.log_weights(documents) + rng.gumbel(size=len(documents))
        return np.argsort(-keys, kind="stable")


def mix_sources(sources: dict, budget_tokens: int, out_dir, seed: int = 0, shard_tokens: int = 1 << 20,
                target=None) -> list[SourceShare]:
    """``sources`` maps name -> (directory of shards, weight). Returns achieved shares.

    ``target`` (a directory of shards, or a list of token arrays) switches each source's
    choice of documents from uniform to DSIR importance resampling toward it. Every
    source is checked before anything is written."""
    if budget_tokens <= 0:
        raise ValueError(f"the token budget must be positive, got {budget_tokens}")
    if not sources:
        raise ValueError("give at least one source")
    for name, (_, weight) in sources.items():
        if not weight > 0:
            raise ValueError(f"source {name!r} has weight {weight}: weights must be positive")
    documents = {name: source_documents(directory) for name, (directory, _) in sources.items()}
    for name, docs in documents.items():
        if not docs:
            raise ValueError(f"source {name!r} has no shards in {sources[name][0]}")
    target_tokens = document_tokens(source_documents(target)) if isinstance(target, (str, Path)) else target
    if target_tokens is not None and not len(target_tokens):
        raise ValueError(f"the DSIR target {target} holds no documents")

    rng, numpy_rng = random.Random(seed), np.random.default_rng(seed)
    total_weight = sum(weight for _, weight in sources.values())
    chosen, shares = [], []
    for name, (_, weight) in sources.items():
        pool = documents[name]
        target_share = budget_tokens * weight / total_weight
        if target_tokens is not None:
            tokens = document_tokens(pool)
            ranked = ImportanceResampler(target_tokens, tokens).order(tokens, numpy_rng)
            epoch_order = lambda: [pool[i] for i in ranked]  # noqa: E731  (the same ranking every epoch)
        else:
            epoch_order = lambda: rng.sample(pool, len(pool))  # noqa: E731
        taken = count = 0
        order: list = []
        while taken < target_share:
            if not order:
                order = list(reversed(epoch_order()))  # a new epoch over this source; pop() takes from the front
            document = order.pop()
            if taken + document[2] > target_share and target_share - taken < document[2] / 2:
                break  # this document would overshoot more than it fills
            chosen.append((name, *document))
            taken += document[2]
            count += 1
        shares.append(SourceShare(name, weight / total_weight, taken, count, sum(d[2] for d in pool),
                                  "dsir" if target_tokens is not None else "uniform"))
    rng.shuffle(chosen)
    writer, cache = ShardWriter(Path(out_dir), shard_tokens, prefix="mix"), {}
    for number, (name, path, offset, length) in enumerate(chosen):
        tokens = cache.setdefault(path, read_shard(path))
        writer.add(f"{name}:{number}", tokens[offset:offset + length])
    writer.close()
    atomic_write_json(Path(out_dir) / "mix.json", mix_table(shares))
    return shares


def mix_table(shares: list[SourceShare]) -> list[dict]:
    total = sum(share.tokens for share in shares) or 1
    return [{"source": s.name, "target": round(s.target, 4), "achieved": round(s.tokens / total, 4),
             "tokens": s.tokens, "documents": s.documents, "epochs": round(s.epochs, 3), "selection": s.selection}
            for s in shares]


def format_mix(shares: list[SourceShare]) -> str:
    rows = [f"{'source':<10}{'target':>8}{'achieved':>10}{'tokens':>10}{'docs':>7}{'epochs':>8}  selection"]
    rows += [f"{r['source']:<10}{r['target']:>8.1%}{r['achieved']:>10.1%}{r['tokens']:>10}{r['documents']:>7}"
             f"{r['epochs']:>8.2f}  {r['selection']}" for r in mix_table(shares)]
    return "\n".join(rows)


def parse_source(spec: str) -> tuple[str, str, float]:
    """``NAME=DIR:WEIGHT`` -> (name, directory, weight), with a one-line error for anything else."""
    name, equals, rest = spec.partition("=")
    directory, colon, weight = rest.rpartition(":")
    try:
        value = float(weight)
    except ValueError:
        value = None
    if not (name and equals and directory and colon and value is not None):
        raise ValueError(f"--source {spec!r}: expected NAME=DIR:WEIGHT, e.g. web=out/web:0.7")
    return name, directory, value
