"""Stage 8: mix several token sources to target weights under a token budget.

Training sets are mixtures (e.g. web 70%, code 10%, books 5%, ...). Given each
source's shards and a target weight, we sample whole documents at random until each
source reaches its share of the budget; a source too small for its share is
repeated (its ``epochs`` exceed 1), which is exactly what a mixture table hides and
a report should show. The mixed documents are shuffled together into new shards.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from distlab.data.shards import ShardWriter, atomic_write_json, read_index, read_shard


@dataclass
class SourceShare:
    name: str
    target: float  # normalised target weight
    tokens: int  # tokens taken
    documents: int
    available_tokens: int

    @property
    def epochs(self) -> float:
        return self.tokens / max(self.available_tokens, 1)


def source_documents(directory) -> list[tuple]:
    """(shard path, offset, length) of every document in a directory of shards."""
    spans = []
    for path in sorted(Path(directory).rglob("*.bin")):
        if path.with_suffix(".index.json").exists():
            spans += [(path, entry["offset"], entry["length"]) for entry in read_index(path)["documents"]]
    return spans


def mix_sources(sources: dict, budget_tokens: int, out_dir, seed: int = 0,
                shard_tokens: int = 1 << 20) -> list[SourceShare]:
    """``sources`` maps name -> (directory of shards, weight). Returns achieved shares."""
    rng = random.Random(seed)
    total_weight = sum(weight for _, weight in sources.values())
    chosen, shares = [], []
    for name, (directory, weight) in sources.items():
        documents = source_documents(directory)
        if not documents:
            raise ValueError(f"source {name!r} has no shards in {directory}")
        target = budget_tokens * weight / total_weight
        available = sum(length for _, _, length in documents)
        taken = count = 0
        order: list = []
        while taken < target:
            if not order:
                order = rng.sample(documents, len(documents))  # a new epoch over this source
            document = order.pop()
            if taken + document[2] > target and target - taken < document[2] / 2:
                break  # this document would overshoot more than it fills
            chosen.append((name, *document))
            taken += document[2]
            count += 1
        shares.append(SourceShare(name, weight / total_weight, taken, count, available))
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
             "tokens": s.tokens, "documents": s.documents, "epochs": round(s.epochs, 3)} for s in shares]


def format_mix(shares: list[SourceShare]) -> str:
    rows = [f"{'source':<10}{'target':>8}{'achieved':>10}{'tokens':>10}{'docs':>7}{'epochs':>8}"]
    rows += [f"{r['source']:<10}{r['target']:>8.1%}{r['achieved']:>10.1%}{r['tokens']:>10}{r['documents']:>7}{r['epochs']:>8.2f}"
             for r in mix_table(shares)]
    return "\n".join(rows)
