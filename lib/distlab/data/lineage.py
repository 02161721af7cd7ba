"""Stage 9: lineage and purge.

Lineage records, for each kept document, where it came from and where it went:
``id -> source, url, hash before filtering, hash after filtering, shard, offset``.
That is what makes a takedown request answerable: :func:`purge` finds the
documents by URL, content hash or source, rewrites *only the shards that hold
them*, re-reads those shards to verify, and moves the documents to the rejection
bucket with reason ``purge:<rule>`` so the accounting still balances. The rules
are also saved in ``purges.json``, so re-running the pipeline keeps them out.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np

from distlab.data.document import Document, Outcome, Stage
from distlab.data.shards import (EOT, SHARD_DTYPE, atomic_write_bytes, atomic_write_json, read_index,
                                 read_shard, write_shard)
from distlab.data.report import STATS_FILE, RunReport
from distlab.data.urls import normalize_url

LINEAGE_FILE = "lineage.jsonl"
REJECTED_FILE = "rejected.jsonl"
PURGES_FILE = "purges.json"
SHARD_DIR = "shards"


def read_jsonl(path: Path) -> list[dict]:
    if not Path(path).exists():
        return []
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    atomic_write_bytes(Path(path), "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows).encode("utf-8"))


@dataclass
class PurgeRules:
    """Documents to remove: by (normalised) URL, by content hash (before or after), or by source."""

    urls: set = field(default_factory=set)
    hashes: set = field(default_factory=set)
    sources: set = field(default_factory=set)

    @classmethod
    def load(cls, out_dir: Path) -> "PurgeRules":
        path = Path(out_dir) / PURGES_FILE
        saved = json.loads(path.read_text()) if path.exists() else {}
        return cls(set(saved.get("urls", ())), set(saved.get("hashes", ())), set(saved.get("sources", ())))

    def save(self, out_dir: Path) -> None:
        atomic_write_json(Path(out_dir) / PURGES_FILE, {"urls": sorted(self.urls), "hashes": sorted(self.hashes),
                                                        "sources": sorted(self.sources)})

    def add(self, urls=(), hashes=(), sources=()) -> None:
        self.urls.update(normalize_url(url) for url in urls)
        self.hashes.update(hashes)
        self.sources.update(sources)

    def rule_for(self, row: dict) -> str | None:
        """Which rule removes this lineage row / document, if any."""
        if row.get("url") and normalize_url(row["url"]) in self.urls:
            return "url"
        if self.hashes & {row.get("hash_before"), row.get("hash_after")}:
            return "hash"
        if row.get("source") in self.sources:
            return "source"
        return None

    def __bool__(self) -> bool:
        return bool(self.urls or self.hashes or self.sources)


class PurgeFilter(Stage):
    """Applies saved purge rules during a run, so purged documents never come back."""

    name = "purge"

    def __init__(self, rules: PurgeRules) -> None:
        super().__init__()
        self.rules = rules

    def process(self, doc: Document) -> Outcome:
        row = {"url": doc.url, "source": doc.source, **doc.meta}
        return self.rules.rule_for(row) or doc


@dataclass
class PurgeReport:
    purged: Counter
    shards_rewritten: list[str]
    shards_removed: list[str]  # every document in them was purged
    shards_untouched: list[str]
    verified: bool

    def to_json(self) -> dict:
        return {"purged": dict(self.purged), "shards_rewritten": self.shards_rewritten,
                "shards_removed": self.shards_removed, "shards_untouched": self.shards_untouched,
                "verified": self.verified}


def purge(out_dir, urls=(), hashes=(), sources=()) -> PurgeReport:
    """Remove documents from a finished run, rewriting only the shards that hold them."""
    out_dir = Path(out_dir)
    rules = PurgeRules.load(out_dir)
    new_rules = PurgeRules()
    new_rules.add(urls, hashes, sources)
    rules.add(new_rules.urls, new_rules.hashes, new_rules.sources)
    rules.save(out_dir)

    lineage = read_jsonl(out_dir / LINEAGE_FILE)
    doomed = {row["id"]: reason for row in lineage if (reason := new_rules.rule_for(row))}
    affected = sorted({row["shard"] for row in lineage if row["id"] in doomed})
    all_shards = sorted(path.name for path in (out_dir / SHARD_DIR).glob("*.bin"))

    new_offsets: dict[str, int] = {}
    removed: list[str] = []
    verified = True
    for shard_name in affected:
        path = out_dir / SHARD_DIR / shard_name
        tokens, index = read_shard(path), read_index(path)["documents"]
        survivors = [entry for entry in index if entry["id"] not in doomed]
        spans = [tokens[e["offset"]:e["offset"] + e["length"]] for e in survivors]
        if not survivors:
            path.unlink()
            path.with_suffix(".index.json").unlink()
            removed.append(shard_name)
            continue
        new_index, offset = [], 0
        for entry in survivors:
            new_index.append({**entry, "offset": offset})
            new_offsets[entry["id"]] = offset
            offset += entry["length"]
        write_shard(path, spans, new_index)
        verified &= _verify_shard(path, dict(zip((e["id"] for e in survivors), spans)), set(doomed))

    kept_rows, purged_rows = [], []
    for row in lineage:
        if row["id"] in doomed:
            purged_rows.append({"id": row["id"], "url": row["url"], "source": row["source"],
                                "hash_before": row["hash_before"], "reason": f"purge:{doomed[row['id']]}",
                                "snippet": ""})
        else:
            kept_rows.append({**row, "offset": new_offsets.get(row["id"], row["offset"])})
    write_jsonl(out_dir / LINEAGE_FILE, kept_rows)
    write_jsonl(out_dir / REJECTED_FILE, read_jsonl(out_dir / REJECTED_FILE) + purged_rows)
    purged = Counter(row["reason"] for row in purged_rows)
    _update_stats(out_dir, purged, kept_rows)
    return PurgeReport(purged, [name for name in affected if name not in removed], removed,
                       [name for name in all_shards if name not in affected], verified)


def _verify_shard(path: Path, expected: dict[str, np.ndarray], doomed: set[str]) -> bool:
    """Re-read a rewritten shard: every survivor's span is where the index says, no purged id remains."""
    tokens, index = read_shard(path), read_index(path)["documents"]
    if any(entry["id"] in doomed for entry in index):
        return False
    for entry in index:
        span = tokens[entry["offset"]:entry["offset"] + entry["length"]]
        if span[0] != EOT or not np.array_equal(span, expected[entry["id"]].astype(SHARD_DTYPE)):
            return False
    return len(tokens) == sum(entry["length"] for entry in index)


def _update_stats(out_dir: Path, purged: Counter, kept_rows: list[dict]) -> None:
    """Move the purged documents from kept to rejected in the saved report, and re-check it."""
    if not (Path(out_dir) / STATS_FILE).exists() or not purged:
        return
    report = RunReport.load(out_dir)
    removed = sum(purged.values())
    report.rejected += purged
    report.kept = len(kept_rows)
    report.tokens = sum(row["length"] for row in kept_rows)
    report.shards = sorted(path.name for path in (Path(out_dir) / SHARD_DIR).glob("*.bin"))
    for stage in report.stages:
        if stage.name == "purge":
            stage.docs_out -= removed
        elif stage.name == "tokenize":
            stage.docs_in -= removed
            stage.docs_out -= removed
    report.check_balance()
    report.save(out_dir)
