"""Stage 9: lineage and purge.

Lineage records, for each kept document, where it came from and where it went:
``id -> source, url, hash before filtering, hash after filtering, shard, offset``.
That is what makes a takedown request answerable: :func:`purge` finds the documents
by URL, content hash or source, rewrites *only the shards that hold them* into a new
generation of the run (the others are carried over unchanged), re-reads every shard
of that generation from disk to verify that no purged document remains and every
other span is intact, and only then commits it. The documents move to the rejection
bucket with reason ``purge:<rule>`` so the accounting still balances, and the rules
are kept in the manifest, so re-running the pipeline keeps them out.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np

from distlab.data.document import Document, Outcome, Stage, text_hash
from distlab.data.output import LINEAGE_FILE, REJECTED_FILE, SHARD_DIR, RunDirectory, link_or_copy
from distlab.data.report import RunReport
from distlab.data.shards import (
    EOT,
    SHARD_DTYPE,
    atomic_write_bytes,
    gpt2_encoding,
    index_path,
    read_index,
    read_shard,
    write_shard,
)
from distlab.data.urls import normalize_url


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
    def from_json(cls, saved: dict | None) -> "PurgeRules":
        saved = saved or {}
        return cls(set(saved.get("urls", ())), set(saved.get("hashes", ())), set(saved.get("sources", ())))

    def to_json(self) -> dict:
        return {"urls": sorted(self.urls), "hashes": sorted(self.hashes), "sources": sorted(self.sources)}

    @classmethod
    def load(cls, out_dir) -> "PurgeRules":
        """The rules committed with the run in ``out_dir`` (none for a new directory)."""
        return cls.from_json((RunDirectory(out_dir).manifest() or {}).get("purges"))

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
        doc.meta["hash_after"] = text_hash(doc.text)
        row = {"url": doc.url, "source": doc.source, "hash_before": doc.meta.get("hash_before"),
               "hash_after": doc.meta["hash_after"]}
        return self.rules.rule_for(row) or doc


class PurgeError(ValueError):
    """The run directory cannot be purged as asked (its shards and lineage disagree)."""


@dataclass
class PurgeReport:
    purged: Counter
    shards_rewritten: list[str]
    shards_removed: list[str]  # every document in them was purged
    shards_untouched: list[str]
    verified: bool
    problems: list[str] = field(default_factory=list)  # why verification failed, if it did

    def to_json(self) -> dict:
        return {"purged": dict(self.purged), "shards_rewritten": self.shards_rewritten,
                "shards_removed": self.shards_removed, "shards_untouched": self.shards_untouched,
                "verified": self.verified, **({"problems": self.problems} if self.problems else {})}


def kept_text(out_dir, doc_id: str) -> str | None:
    """The text a run kept for ``doc_id``, decoded from its span in the shards (None if it was not kept)."""
    run = RunDirectory(out_dir)
    row = next((row for row in read_jsonl(run.file(LINEAGE_FILE)) if row["id"] == doc_id), None)
    if row is None:
        return None
    tokens = read_shard(run.current() / SHARD_DIR / row["shard"])[row["offset"] + 1:row["offset"] + row["length"]]
    return gpt2_encoding().decode(tokens.tolist())


def shard_contents(directory: Path, names: list[str]) -> dict[str, list[dict]]:
    """What the shards on disk hold: shard name -> its index entries (id, offset, length)."""
    return {name: read_index(directory / SHARD_DIR / name)["documents"] for name in names}


def purge(out_dir, urls=(), hashes=(), sources=()) -> PurgeReport:
    """Remove documents from a finished run, rewriting only the shards that hold them.

    Where a document lives is read from the shard indexes on disk (not trusted from the
    lineage alone); the two must agree, or the purge refuses. The new generation is
    committed only if re-reading all its shards shows no purged document left."""
    run = RunDirectory(out_dir)
    manifest = run.require("purge")
    run.clean()
    current = run.current()
    lineage = read_jsonl(current / LINEAGE_FILE)
    on_disk = shard_contents(current, manifest["shards"])
    located = {entry["id"]: name for name, entries in on_disk.items() for entry in entries}
    listed = {row["id"]: row["shard"] for row in lineage}
    if located != listed:
        differ = sorted(set(located.items()) ^ set(listed.items()))[:3]
        raise PurgeError(f"cannot purge {run.root}: its lineage and the shards on disk disagree (e.g. {differ}); "
                         "re-run `distlab data run` to rebuild it")

    new_rules = PurgeRules()
    new_rules.add(urls, hashes, sources)
    doomed = {row["id"]: reason for row in lineage if (reason := new_rules.rule_for(row))}
    affected = sorted({located[doc_id] for doc_id in doomed})

    staging = run.begin()
    kept_spans: dict[str, np.ndarray] = {}
    new_offsets: dict[str, int] = {}
    written, removed = [], []
    for name in manifest["shards"]:
        source, target = current / SHARD_DIR / name, staging / SHARD_DIR / name
        if name not in affected:
            link_or_copy(source, target)
            link_or_copy(index_path(source), index_path(target))
            written.append(name)
            continue
        tokens = read_shard(source)
        survivors = [entry for entry in on_disk[name] if entry["id"] not in doomed]
        if not survivors:
            removed.append(name)
            continue
        spans = [tokens[e["offset"]:e["offset"] + e["length"]] for e in survivors]
        index, offset = [], 0
        for entry, span in zip(survivors, spans):
            index.append({**entry, "offset": offset})
            new_offsets[entry["id"]] = offset
            kept_spans[entry["id"]] = span
            offset += len(span)
        write_shard(target, spans, index)
        written.append(name)

    kept_rows, purged_rows = [], []
    for row in lineage:
        if row["id"] in doomed:
            purged_rows.append({"id": row["id"], "url": row["url"], "source": row["source"],
                                "hash_before": row["hash_before"], "reason": f"purge:{doomed[row['id']]}",
                                "snippet": ""})
        else:
            kept_rows.append({**row, "offset": new_offsets.get(row["id"], row["offset"])})
    problems = verify_shards(staging, written, kept_rows, set(doomed), kept_spans)
    if problems:
        run.clean()  # the staged generation is dropped: the run stays as it was
        return PurgeReport(Counter(), [], [], manifest["shards"], False, problems)

    write_jsonl(staging / LINEAGE_FILE, kept_rows)
    write_jsonl(staging / REJECTED_FILE, read_jsonl(current / REJECTED_FILE) + purged_rows)
    purged = Counter(row["reason"] for row in purged_rows)
    report = RunReport.load(out_dir)
    _move_to_rejected(report, purged, kept_rows, written)
    report.save(staging)
    rules = PurgeRules.from_json(manifest.get("purges"))
    rules.urls |= new_rules.urls
    rules.hashes |= new_rules.hashes
    rules.sources |= new_rules.sources
    run.commit(staging, {**manifest, "shards": written, "purges": rules.to_json()})
    return PurgeReport(purged, [name for name in affected if name not in removed], removed,
                       [name for name in written if name not in affected], True)


def verify_shards(directory: Path, names: list[str], lineage: list[dict], doomed: set[str],
                  rewritten: dict[str, np.ndarray]) -> list[str]:
    """Re-read every shard of a generation from disk. Problems found (empty list: verified):
    a purged id still indexed, a span that does not start with EOT or differs from what was
    kept, token counts that do not add up, or lineage rows without their span."""
    problems = []
    where = {}
    for name in names:
        path = directory / SHARD_DIR / name
        tokens, entries = read_shard(path), read_index(path)["documents"]
        if len(tokens) != sum(entry["length"] for entry in entries):
            problems.append(f"{name}: {len(tokens)} tokens on disk, index says {sum(e['length'] for e in entries)}")
        for entry in entries:
            where[entry["id"]] = (name, entry["offset"])
            span = tokens[entry["offset"]:entry["offset"] + entry["length"]]
            if entry["id"] in doomed:
                problems.append(f"{name}: purged document {entry['id']} is still there")
            elif not len(span) or span[0] != EOT:
                problems.append(f"{name}: the span of {entry['id']} does not start with end-of-text")
            elif entry["id"] in rewritten and not np.array_equal(span, rewritten[entry["id"]].astype(SHARD_DTYPE)):
                problems.append(f"{name}: the tokens of {entry['id']} changed")
    for row in lineage:
        if where.get(row["id"]) != (row["shard"], row["offset"]):
            problems.append(f"lineage says {row['id']} is at {row['shard']}:{row['offset']}, "
                            f"disk says {where.get(row['id'])}")
    return problems[:10]


def _move_to_rejected(report: RunReport, purged: Counter, kept_rows: list[dict], shards: list[str]) -> None:
    """Move the purged documents from kept to rejected in the report, and re-check it."""
    removed = sum(purged.values())
    report.rejected += purged
    report.kept = len(kept_rows)
    report.tokens = sum(row["length"] for row in kept_rows)
    report.shards = list(shards)
    for stage in report.stages:
        if stage.name == "purge":
            stage.docs_out -= removed
        elif stage.name == "tokenize":
            stage.docs_in -= removed
            stage.docs_out -= removed
    report.check_balance()
