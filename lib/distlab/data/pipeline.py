"""The whole pipeline, parallel over input files, resumable and accounted for.

Two phases, like datatrove's multi-step FineWeb recipe:

1. **Per input file, in parallel** (``multiprocessing``): read -> language ->
   Gopher quality -> Gopher repetition -> toxicity -> PII, then the MinHash signature
   and GPT-2 tokens of every survivor. Results go to ``work/<file>/`` and a
   ``done.json`` marker is written last (atomically), so an interrupted run resumes
   without redoing - or duplicating - finished files.
2. **Over the whole corpus, in input order**: record-id dedup -> URL dedup -> near
   dedup (LSH over the stored signatures) -> saved purge rules -> token shards,
   lineage, rejection bucket and the stats report. This phase is cheap and always
   rerun from the stored results, so reruns are idempotent.

After every run ``documents in == kept + sum(rejected by reason)`` is checked.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np

from distlab.data.dedup import DEFAULT_BANDS, DEFAULT_NUM_PERM, DEFAULT_ROWS, DEFAULT_THRESHOLD, Deduper, NearDedup
from distlab.data.document import Document, Ledger, Stage, StageStats, run_stages, text_hash
from distlab.data.language import DEFAULT_LANGUAGES, DEFAULT_MAX_CHARS, DEFAULT_THRESHOLD as LANG_THRESHOLD
from distlab.data.language import LanguageFilter
from distlab.data.lineage import (LINEAGE_FILE, REJECTED_FILE, SHARD_DIR, PurgeFilter, PurgeRules, read_jsonl,
                                  write_jsonl)
from distlab.data.pii import PiiScrubber
from distlab.data.quality import GOPHER, GopherQualityFilter, GopherQualityRules
from distlab.data.read import DEFAULT_MAX_DOC_BYTES, WarcReader
from distlab.data.repetition import GOPHER_REPETITION, GopherRepetitionFilter, GopherRepetitionRules
from distlab.data.report import RunReport
from distlab.data.shards import (DEFAULT_SHARD_TOKENS, SHARD_DTYPE, ShardWriter, atomic_write_bytes,
                                 atomic_write_json, encode_documents)
from distlab.data.toxicity import DEFAULT_BLOCKLIST, BlocklistScorer, ToxicityFilter
from distlab.data.urls import RecordIdDedup, UrlDedup

WORK_DIR = "work"
MANIFEST_FILE = "manifest.json"


@dataclass
class PipelineConfig:
    """Every knob of a run. Its fingerprint invalidates done-markers when it changes."""

    languages: tuple = DEFAULT_LANGUAGES
    language_threshold: float = LANG_THRESHOLD
    language_max_chars: int = DEFAULT_MAX_CHARS
    max_doc_bytes: int = DEFAULT_MAX_DOC_BYTES
    quality: GopherQualityRules = GOPHER
    repetition: GopherRepetitionRules = GOPHER_REPETITION
    blocklist: tuple = DEFAULT_BLOCKLIST
    dedup_threshold: float = DEFAULT_THRESHOLD
    num_perm: int = DEFAULT_NUM_PERM
    bands: int = DEFAULT_BANDS
    rows: int = DEFAULT_ROWS
    shard_tokens: int = DEFAULT_SHARD_TOKENS

    def fingerprint(self) -> str:
        return hashlib.sha1(json.dumps(asdict(self), sort_keys=True, default=str).encode()).hexdigest()[:16]

    def document_stages(self) -> list[Stage]:
        """Stages that look at one document at a time (run in parallel, per file)."""
        return [LanguageFilter(self.languages, self.language_threshold, self.language_max_chars),
                GopherQualityFilter(self.quality), GopherRepetitionFilter(self.repetition),
                ToxicityFilter(BlocklistScorer(self.blocklist)), PiiScrubber()]

    def deduper(self) -> Deduper:
        return Deduper(self.dedup_threshold, self.num_perm, self.bands, self.rows)


STAGE_ORDER = ("read", "language", "quality", "repetition", "toxicity", "pii",
               "record_id", "url_dedup", "near_dedup", "purge", "tokenize")


def _file_key(path: Path) -> str:
    return f"{path.name}-{hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]}"


def _input_identity(path: Path) -> dict:
    info = path.stat()
    return {"path": str(path.resolve()), "size": info.st_size, "mtime_ns": info.st_mtime_ns}


def process_file(path: str, work_root: str, config: PipelineConfig) -> dict:
    """Phase 1 for one input file; returns (and stores in done.json) its summary."""
    path, work = Path(path), Path(work_root) / _file_key(Path(path))
    work.mkdir(parents=True, exist_ok=True)
    ledger, reader, stages = Ledger(), WarcReader(config.max_doc_bytes), config.document_stages()
    survivors = list(run_stages(reader(str(path), ledger), stages, ledger))

    signature_stats, token_stats = StageStats("near_dedup"), StageStats("tokenize")
    start = time.perf_counter()
    deduper = config.deduper()
    rows = []
    for doc in survivors:
        doc.meta["hash_after"] = text_hash(doc.text)
        rows.append({"id": doc.id, "url": doc.url, "date": doc.date, "source": doc.source,
                     "meta": {**doc.meta, "minhash": deduper.signature(doc.text).hashvalues.tolist()}})
    signature_stats.seconds = time.perf_counter() - start

    start = time.perf_counter()
    spans = encode_documents([doc.text for doc in survivors])
    offset = 0
    for row, span in zip(rows, spans):
        row["token_offset"], row["token_length"] = offset, len(span)
        offset += len(span)
    atomic_write_bytes(work / "tokens.bin", np.concatenate(spans).tobytes() if spans else b"")
    token_stats.seconds = time.perf_counter() - start

    ledger.check_balance(len(survivors))
    write_jsonl(work / "kept.jsonl", rows)
    write_jsonl(work / REJECTED_FILE, ledger.rows)
    summary = {"input": _input_identity(path), "config": config.fingerprint(),
               "documents_in": ledger.documents_in, "kept": len(survivors), "rejected": dict(ledger.rejected),
               "stages": [s.stats.to_json() for s in [reader, *stages]] + [signature_stats.to_json(), token_stats.to_json()]}
    atomic_write_json(work / "done.json", summary)  # the marker: written last
    return summary


def _finished_summary(path: Path, work_root: Path, config: PipelineConfig) -> Optional[dict]:
    marker = work_root / _file_key(path) / "done.json"
    if not marker.exists():
        return None
    summary = json.loads(marker.read_text())
    if summary["input"] != _input_identity(path) or summary["config"] != config.fingerprint():
        return None  # the input or the configuration changed: redo this file
    return summary


def _unique_inputs(inputs: Sequence) -> list[Path]:
    seen, unique = set(), []
    for item in inputs:
        path = Path(item)
        if path.resolve() not in seen:
            seen.add(path.resolve())
            unique.append(path)
    return unique


def run_pipeline(inputs: Sequence, out_dir, config: Optional[PipelineConfig] = None, workers: int = 1,
                 progress: bool = False) -> RunReport:
    """Run both phases over WET/WARC ``inputs`` into ``out_dir``; returns the checked report."""
    config = config or PipelineConfig()
    out_dir, started = Path(out_dir), time.perf_counter()
    work_root = out_dir / WORK_DIR
    work_root.mkdir(parents=True, exist_ok=True)
    paths = _unique_inputs(inputs)
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"input files not found: {missing}")

    summaries = {path: _finished_summary(path, work_root, config) for path in paths}
    pending = [path for path, summary in summaries.items() if summary is None]
    for path, summary in zip(pending, _run_phase_one(pending, work_root, config, workers, progress)):
        summaries[path] = summary

    report = _run_phase_two(paths, work_root, out_dir, config, summaries)
    report.files_processed, report.files_resumed = len(pending), len(paths) - len(pending)
    report.wall_seconds = time.perf_counter() - started
    report.check_balance()
    report.save(out_dir)
    return report


def _run_phase_one(pending: list[Path], work_root: Path, config: PipelineConfig, workers: int,
                   progress: bool) -> Iterator[dict]:
    """Summaries of ``pending`` in order; in a process pool when workers > 1."""
    from tqdm.auto import tqdm

    job = partial(process_file, work_root=str(work_root), config=config)
    bar = tqdm(total=len(pending), desc="input files", unit="file", disable=not progress)
    if workers <= 1 or len(pending) <= 1:
        for path in pending:
            yield job(str(path))
            bar.update()
    else:
        context = multiprocessing.get_context("spawn")  # no fork of a threaded parent (notebooks, tiktoken)
        with context.Pool(min(workers, len(pending))) as pool:
            for summary in pool.imap(job, [str(path) for path in pending]):
                bar.update()
                yield summary
    bar.close()


def _stored_documents(paths: list[Path], work_root: Path) -> Iterator[Document]:
    """Phase-1 survivors, text-free: their signature and token span ride in ``meta``."""
    for path in paths:
        work = work_root / _file_key(path)
        tokens = np.fromfile(work / "tokens.bin", dtype=SHARD_DTYPE)
        for row in read_jsonl(work / "kept.jsonl"):
            start = row["token_offset"]
            meta = {**row["meta"], "tokens": tokens[start:start + row["token_length"]]}
            yield Document(row["id"], "", row["url"], row["date"], row["source"], meta)


def _run_phase_two(paths: list[Path], work_root: Path, out_dir: Path, config: PipelineConfig,
                   summaries: dict) -> RunReport:
    ledger = Ledger()
    corpus_stages = [RecordIdDedup(), UrlDedup(), NearDedup(config.deduper()), PurgeFilter(PurgeRules.load(out_dir))]
    shard_dir = out_dir / SHARD_DIR
    writer = ShardWriter(shard_dir, config.shard_tokens)
    tokenize = StageStats("tokenize")
    lineage = []
    for doc in run_stages(_stored_documents(paths, work_root), corpus_stages, ledger):
        start = time.perf_counter()
        span = doc.meta.pop("tokens")
        shard, offset = writer.add(doc.id, span)
        lineage.append({"id": doc.id, "url": doc.url, "date": doc.date, "source": doc.source,
                        "hash_before": doc.meta["hash_before"], "hash_after": doc.meta["hash_after"],
                        "language": doc.meta.get("language"), "pii": doc.meta.get("pii", {}),
                        "shard": shard, "offset": offset, "length": len(span)})
        tokenize.docs_in += 1
        tokenize.docs_out += 1
        tokenize.seconds += time.perf_counter() - start
    written = writer.close()
    for stale in set(shard_dir.glob("*.bin")) - set(written):  # left by an earlier, larger run
        stale.unlink()
        stale.with_suffix(".index.json").unlink(missing_ok=True)

    rejected_rows = [row for path in paths for row in read_jsonl(work_root / _file_key(path) / REJECTED_FILE)]
    write_jsonl(out_dir / LINEAGE_FILE, lineage)
    write_jsonl(out_dir / REJECTED_FILE, rejected_rows + ledger.rows)

    stages: dict[str, StageStats] = {name: StageStats(name) for name in STAGE_ORDER}
    for summary in summaries.values():
        for row in summary["stages"]:
            stages[row["name"]].merge(StageStats.from_json(row))
    for stage in corpus_stages:
        stages[stage.name].merge(stage.stats)
    stages["tokenize"].merge(tokenize)

    rejected = sum((Counter(s["rejected"]) for s in summaries.values()), Counter()) + ledger.rejected
    report = RunReport(documents_in=sum(s["documents_in"] for s in summaries.values()), kept=len(lineage),
                       rejected=rejected, stages=[stages[name] for name in STAGE_ORDER],
                       tokens=int(sum(row["length"] for row in lineage)),
                       shards=[path.name for path in written], inputs=[str(p) for p in paths])
    atomic_write_json(out_dir / MANIFEST_FILE, {"config": asdict(config), "fingerprint": config.fingerprint(),
                                                "inputs": [summaries[p]["input"] for p in paths],
                                                "shards": report.shards})
    return report


def shard_paths(out_dir) -> list[Path]:
    """The token shards of a finished run, in order (what a training loader reads)."""
    return sorted((Path(out_dir) / SHARD_DIR).glob("*.bin"))
