"""Documents, stages and the ledger: the three things every pipeline step shares.

A :class:`Document` flows through a chain of :class:`Stage` objects. A stage either
returns the document (possibly changed) or a short reason string; a rejected document
goes to the :class:`Ledger` with ``"stage:rule"`` as its reason. The ledger is how the
pipeline proves that nothing was lost: ``documents in == kept + sum(rejected)``.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Iterator


def text_hash(text: str) -> str:
    """Content hash used by lineage and purge (sha1 of the UTF-8 text, hex)."""
    return hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass
class Document:
    """One web page: its text plus where it came from (kept through every stage)."""

    id: str  # WARC-Record-ID
    text: str
    url: str = ""
    date: str = ""
    source: str = ""  # the input file it was read from
    meta: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"id": self.id, "url": self.url, "date": self.date, "source": self.source,
                "text": self.text, "meta": self.meta}

    @classmethod
    def from_json(cls, row: dict) -> "Document":
        return cls(row["id"], row["text"], row.get("url", ""), row.get("date", ""),
                   row.get("source", ""), row.get("meta", {}))


class AccountingError(RuntimeError):
    """Documents went missing: in != kept + rejected. Always a bug, never data."""


@dataclass
class StageStats:
    """What one stage saw: documents in/out, time spent inside it, and free counters."""

    name: str
    docs_in: int = 0
    docs_out: int = 0
    seconds: float = 0.0
    counters: Counter = field(default_factory=Counter)

    @property
    def docs_per_second(self) -> float:
        return self.docs_in / self.seconds if self.seconds > 0 else float("inf")

    def merge(self, other: "StageStats") -> None:
        self.docs_in += other.docs_in
        self.docs_out += other.docs_out
        self.seconds += other.seconds
        self.counters.update(other.counters)

    def to_json(self) -> dict:
        return {"name": self.name, "docs_in": self.docs_in, "docs_out": self.docs_out,
                "seconds": self.seconds, "counters": dict(self.counters)}

    @classmethod
    def from_json(cls, row: dict) -> "StageStats":
        return cls(row["name"], row["docs_in"], row["docs_out"], row["seconds"], Counter(row["counters"]))


class Ledger:
    """Counts every document that enters and every rejection with its reason.

    Rejections are kept as rows (id, url, source, hash, reason, snippet, and where a
    stage left one: the document it duplicates, the read error, the evidence) so a run
    can write them to a rejection bucket and a notebook can show samples per rule.
    """

    def __init__(self, keep_rows: bool = True, snippet_chars: int = 300):
        self.documents_in = 0
        self.rejected: Counter = Counter()
        self.rows: list[dict] = []
        self.keep_rows = keep_rows
        self.snippet_chars = snippet_chars

    def admit(self, count: int = 1) -> None:
        self.documents_in += count

    def reject(self, doc: Document, reason: str) -> None:
        self.rejected[reason] += 1
        if self.keep_rows:
            self.rows.append({
                "id": doc.id, "url": doc.url, "source": doc.source, "reason": reason,
                "hash_before": doc.meta.get("hash_before", text_hash(doc.text)),
                "snippet": doc.text[: self.snippet_chars],
                **{key: doc.meta[key] for key in ("duplicate_of", "error", "evidence") if key in doc.meta},
            })

    @property
    def total_rejected(self) -> int:
        return sum(self.rejected.values())

    def check_balance(self, kept: int) -> None:
        """Raise unless every admitted document was kept or rejected exactly once."""
        if self.documents_in != kept + self.total_rejected:
            raise AccountingError(
                f"documents in ({self.documents_in}) != kept ({kept}) + rejected "
                f"({self.total_rejected}: {dict(self.rejected)})")

    def samples(self, reason: str, k: int = 3) -> list[dict]:
        return [row for row in self.rows if row["reason"] == reason][:k]


Outcome = Document | str


class Stage:
    """A pipeline block: ``process`` returns the document to keep or a rejection rule.

    Calling a stage on an iterable of documents yields the kept ones, sends the others
    to the ledger as ``"<stage name>:<rule>"`` and times only this stage's own work, so
    a chain of generators still gives a per-stage throughput.
    """

    name = "stage"

    def __init__(self) -> None:
        self.stats = StageStats(self.name)

    def process(self, doc: Document) -> Outcome:
        raise NotImplementedError

    def __call__(self, docs: Iterable[Document], ledger: Ledger) -> Iterator[Document]:
        stats = self.stats
        for doc in docs:
            start = time.perf_counter()
            outcome = self.process(doc)
            stats.seconds += time.perf_counter() - start
            stats.docs_in += 1
            if isinstance(outcome, str):
                ledger.reject(doc, f"{self.name}:{outcome}")
            else:
                stats.docs_out += 1
                yield outcome


def run_stages(docs: Iterable[Document], stages: Iterable[Stage], ledger: Ledger) -> Iterator[Document]:
    """Chain stages lazily: documents stream through, one at a time."""
    for stage in stages:
        docs = stage(docs, ledger)
    return iter(docs)
