"""What both engines of the pipeline run (:mod:`distlab.data.pipeline`'s local one and :mod:`distlab.data.ray_engine`).

Phase 1 for one input file (:func:`process_file`, with its ``done.json`` marker that makes a run resumable), the
configuration it runs with (:class:`PipelineConfig`), the phase-1 results read back (:func:`file_documents`), near
dedup in crawl order (:func:`near_dedup`), the form phase 2's outcome is handed over in (:class:`Selection`) and the
progress bars both draw (:func:`files_bar`, :func:`documents_bar`: where a person watches, silent under nbval and CI).
The pipeline chooses an engine and writes the output; each engine imports this module, and neither imports the
other, so an engine is added or changed without touching what the other runs.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from distlab.data.dedup import DEFAULT_BANDS, DEFAULT_NUM_PERM, DEFAULT_ROWS, DEFAULT_THRESHOLD, Deduper, NearDedup
from distlab.data.document import Document, Ledger, Stage, StageStats, run_stages
from distlab.data.language import DEFAULT_LANGUAGES, DEFAULT_MAX_CHARS, LanguageFilter
from distlab.data.language import DEFAULT_THRESHOLD as LANG_THRESHOLD
from distlab.data.line_dedup import DEFAULT_MIN_DOCUMENTS
from distlab.data.lineage import read_jsonl, write_jsonl
from distlab.data.output import REJECTED_FILE
from distlab.data.pii import PiiScrubber
from distlab.data.quality import GOPHER, GopherQualityFilter, GopherQualityRules
from distlab.data.read import DEFAULT_MAX_DOC_BYTES, WarcReader
from distlab.data.repetition import GOPHER_REPETITION, GopherRepetitionFilter, GopherRepetitionRules
from distlab.data.shards import DEFAULT_SHARD_TOKENS, atomic_write_json
from distlab.data.toxicity import DEFAULT_BLOCKLIST, SCORERS, ToxicityFilter, make_scorer
from distlab.data.toxicity import DEFAULT_THRESHOLD as TOXICITY_THRESHOLD
from distlab.runtime.progress import progress

__all__ = ["PipelineConfig", "file_key", "input_identity", "process_file", "finished_summary", "Selection",
           "crawl_order", "near_dedup", "stored_documents", "stored_count", "file_documents", "files_bar",
           "documents_bar"]

# Knobs that only phase 2 uses: changing them must not redo phase 1.
_PHASE_TWO_FIELDS = ("dedup_threshold", "bands", "rows", "line_min_documents", "shard_tokens")


@dataclass
class PipelineConfig:
    """Every knob of a run. Its phase-1 fingerprint invalidates done-markers when it changes."""

    languages: tuple = DEFAULT_LANGUAGES
    language_threshold: float = LANG_THRESHOLD
    language_max_chars: int = DEFAULT_MAX_CHARS
    max_doc_bytes: int = DEFAULT_MAX_DOC_BYTES
    quality: GopherQualityRules = GOPHER
    repetition: GopherRepetitionRules = GOPHER_REPETITION
    toxicity: str = "page"  # page-level classifier share + adult terms; "classifier" (worst line) or "blocklist"
    blocklist: tuple = DEFAULT_BLOCKLIST
    toxicity_threshold: float = TOXICITY_THRESHOLD
    dedup_threshold: float = DEFAULT_THRESHOLD
    num_perm: int = DEFAULT_NUM_PERM
    bands: int = DEFAULT_BANDS
    rows: int = DEFAULT_ROWS
    line_min_documents: int = DEFAULT_MIN_DOCUMENTS
    shard_tokens: int = DEFAULT_SHARD_TOKENS

    def validate(self) -> "PipelineConfig":
        """Raise a one-line ValueError for settings that cannot work, before any work starts."""
        if self.bands < 1 or self.rows < 1 or self.bands * self.rows != self.num_perm:
            raise ValueError(f"LSH bands x rows must equal the {self.num_perm} MinHash permutations, "
                             f"got {self.bands} x {self.rows} = {self.bands * self.rows} (e.g. 16 x 8, 32 x 4)")
        if self.toxicity not in SCORERS:
            raise ValueError(f"unknown toxicity scorer {self.toxicity!r}: choose one of {', '.join(SCORERS)}")
        for name in ("language_threshold", "dedup_threshold", "toxicity_threshold"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1], got {getattr(self, name)}")
        if self.line_min_documents < 2:
            raise ValueError(f"line_min_documents must be at least 2, got {self.line_min_documents}")
        if self.shard_tokens < 1:
            raise ValueError(f"shard_tokens must be positive, got {self.shard_tokens}")
        if not self.languages:
            raise ValueError("give at least one language to keep")
        return self

    def fingerprint(self) -> str:
        """Hash of the settings phase 1 depends on."""
        settings = {k: v for k, v in asdict(self).items() if k not in _PHASE_TWO_FIELDS}
        return hashlib.sha1(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def document_stages(self) -> list[Stage]:
        """Stages that look at one document at a time (run in parallel, per file)."""
        return [LanguageFilter(self.languages, self.language_threshold, self.language_max_chars),
                GopherQualityFilter(self.quality), GopherRepetitionFilter(self.repetition),
                ToxicityFilter(make_scorer(self.toxicity, self.blocklist, self.toxicity_threshold),
                               self.toxicity_threshold), PiiScrubber()]

    def deduper(self) -> Deduper:
        return Deduper(self.dedup_threshold, self.num_perm, self.bands, self.rows)



# ---------------------------------------------------------------- phase 1, per input file

def file_key(path: Path) -> str:
    """The folder under ``work/`` that holds an input file's phase-1 results: its name and a hash of its path."""
    return f"{path.name}-{hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]}"


def input_identity(path: Path) -> dict:
    """What a done-marker records of its input, so that a changed file is processed again."""
    info = path.stat()
    return {"path": str(path.resolve()), "size": info.st_size, "mtime_ns": info.st_mtime_ns}


def process_file(path: str, work_root: str, config: PipelineConfig) -> dict:
    """Phase 1 for one input file; returns (and stores in done.json) its summary."""
    path, work = Path(path), Path(work_root) / file_key(Path(path))
    work.mkdir(parents=True, exist_ok=True)
    ledger, reader, stages = Ledger(), WarcReader(config.max_doc_bytes), config.document_stages()
    survivors = list(run_stages(reader(str(path), ledger), stages, ledger))

    signature_stats = StageStats("near_dedup")
    start = time.perf_counter()
    deduper = config.deduper()
    rows = [{"id": doc.id, "url": doc.url, "date": doc.date, "source": doc.source, "text": doc.text,
             "meta": {**doc.meta, "minhash": deduper.signature(doc.text).hashvalues.tolist()}} for doc in survivors]
    signature_stats.seconds = time.perf_counter() - start

    ledger.check_balance(len(survivors))
    write_jsonl(work / "kept.jsonl", rows)
    write_jsonl(work / REJECTED_FILE, ledger.rows)
    summary = {"input": input_identity(path), "config": config.fingerprint(),
               "documents_in": ledger.documents_in, "kept": len(survivors), "rejected": dict(ledger.rejected),
               "warnings": reader.warnings,
               "stages": [s.stats.to_json() for s in [reader, *stages]] + [signature_stats.to_json()]}
    atomic_write_json(work / "done.json", summary)  # the marker: written last
    return summary


def finished_summary(path: Path, work_root: Path, config: PipelineConfig) -> dict | None:
    """The summary a finished phase 1 stored for ``path``, or None when it must run (again)."""
    marker = work_root / file_key(path) / "done.json"
    if not marker.exists():
        return None
    summary = json.loads(marker.read_text())
    if summary["input"] != input_identity(path) or summary["config"] != config.fingerprint():
        return None  # the input or the configuration changed: redo this file
    return summary


# ---------------------------------------------------------------- what phase 2 shares

@dataclass
class Selection:
    """What phase 2 decided, in the engine-independent form the output is written from.

    ``documents``: (document, token span) for every survivor in input order (the document's text may be dropped:
    lineage needs only its fields), perhaps a generator that fetches them as the writer goes; the other fields are
    complete once it is consumed. ``rejected_rows``: phase 2's rejections in the order the local engine meets them
    (record id and URL in input order, near dedup in crawl order, line dedup and purge in input order), the
    canonical order of ``rejected.jsonl``; ``stages``: the stats of phase 2's stages.
    """

    documents: Iterable
    rejected_rows: list
    rejected: Counter
    stages: list
    tokenize_seconds: float


def crawl_order(docs: Sequence[Document]) -> list[int]:
    """Indices of ``docs`` earliest-crawled first, ties in input order: the order near dedup sees them in.

    Near dedup keeps the first member of a cluster it sees, and a mirror copies a page after it is published."""
    return sorted(range(len(docs)), key=lambda i: (not docs[i].date, docs[i].date, i))


def near_dedup(docs: Sequence[Document], stage: NearDedup, ledger: Ledger, shown: bool = False) -> list[Document]:
    """Run ``stage`` over ``docs`` (in input order) in crawl order; the survivors, back in input order. ``shown``:
    a bar of the documents compared (the local engine's pass over the corpus; a Ray partition draws none)."""
    in_crawl_order = documents_bar((docs[i] for i in crawl_order(docs)), "near dedup", shown, total=len(docs))
    survivors = {id(doc) for doc in run_stages(in_crawl_order, [stage], ledger)}
    return [doc for doc in docs if id(doc) in survivors]


def stored_documents(paths: list[Path], work_root: Path) -> Iterator[Document]:
    """Phase-1 survivors with their text; the MinHash signature rides in ``meta``."""
    for path in paths:
        yield from file_documents(path, work_root)


def stored_count(paths: list[Path], work_root: Path) -> int:
    """How many documents :func:`stored_documents` yields, as the files' done markers recorded them."""
    return sum(json.loads((work_root / file_key(path) / "done.json").read_text())["kept"] for path in paths)


def file_documents(path: Path, work_root: Path) -> Iterator[Document]:
    """The phase-1 survivors of one input file."""
    for row in read_jsonl(work_root / file_key(path) / "kept.jsonl"):
        yield Document(row["id"], row["text"], row["url"], row["date"], row["source"], row["meta"])


# ---------------------------------------------------------------- progress, the same in both engines

def files_bar(count: int, shown: bool):
    """Phase 1's bar: input files done of ``count`` (updated by hand as each file's summary arrives)."""
    return progress(total=count, desc="phase 1 · input files", unit="file", disable=not shown)


def documents_bar(docs: Iterable, what: str, shown: bool, total: int | None = None):
    """``docs`` counted by a bar of phase 2's pass ``what`` over the corpus (``docs`` None: updated by hand)."""
    return progress(docs, total=total, desc=f"phase 2 · {what}", unit="doc", disable=not shown)
