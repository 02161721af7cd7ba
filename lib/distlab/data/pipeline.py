"""The whole pipeline, parallel over input files, resumable, accounted for and committed atomically.

Two phases, like datatrove's multi-step FineWeb recipe:

1. **Per input file, in parallel** (``multiprocessing``): read -> language ->
   Gopher quality -> Gopher repetition -> toxicity -> PII, then the MinHash signature
   of every survivor. Results go to ``work/<file>/`` and a ``done.json`` marker is
   written last (atomically), so an interrupted run resumes without redoing - or
   duplicating - finished files.
2. **Over the whole corpus, in input order**: record-id dedup -> URL dedup -> near
   dedup (LSH over the stored signatures) -> line dedup (lines repeated across
   documents; it needs the whole corpus) -> saved purge rules -> GPT-2 token shards,
   lineage, rejection bucket and the stats report. This phase is cheap and always
   rerun from the stored results, so reruns are idempotent. It builds a new
   generation of the output directory and commits it with one atomic rename
   (:mod:`distlab.data.output`): a run killed here leaves the previous run intact.

Two engines run these phases with the same stage objects and give the same answer: the local one
(:class:`LocalEngine`: a process pool for phase 1, phase 2 in this process) and Ray
(:mod:`distlab.data.ray_engine`: tasks per file, phase 2 as hash-partitioned steps), chosen by
``run_pipeline(engine=...)``. Both hand phase 2's outcome over as a :class:`Selection`, from which this module
writes the generation.

After every run ``documents in == kept + sum(rejected by reason)`` is checked.
Everything that can be checked before work starts (inputs, output directory,
configuration) is, with a one-line error.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import time
from collections import Counter
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from tqdm.auto import tqdm

from distlab.data.dedup import DEFAULT_BANDS, DEFAULT_NUM_PERM, DEFAULT_ROWS, DEFAULT_THRESHOLD, Deduper, NearDedup
from distlab.data.document import Document, Ledger, Stage, StageStats, run_stages
from distlab.data.language import DEFAULT_LANGUAGES, DEFAULT_MAX_CHARS, LanguageFilter
from distlab.data.language import DEFAULT_THRESHOLD as LANG_THRESHOLD
from distlab.data.line_dedup import DEFAULT_MIN_DOCUMENTS, LineDedup
from distlab.data.lineage import PurgeFilter, PurgeRules, read_jsonl, write_jsonl
from distlab.data.output import LINEAGE_FILE, REJECTED_FILE, SHARD_DIR, WORK_DIR, RunDirectory
from distlab.data.pii import PiiScrubber
from distlab.data.quality import GOPHER, GopherQualityFilter, GopherQualityRules
from distlab.data.read import DEFAULT_MAX_DOC_BYTES, WarcReader
from distlab.data.repetition import GOPHER_REPETITION, GopherRepetitionFilter, GopherRepetitionRules
from distlab.data.report import RunReport
from distlab.data.shards import DEFAULT_SHARD_TOKENS, ShardWriter, atomic_write_json, encode_documents
from distlab.data.toxicity import DEFAULT_BLOCKLIST, SCORERS, ToxicityFilter, make_scorer
from distlab.data.toxicity import DEFAULT_THRESHOLD as TOXICITY_THRESHOLD
from distlab.data.urls import RecordIdDedup, UrlDedup

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


STAGE_ORDER = ("read", "language", "quality", "repetition", "toxicity", "pii",
               "record_id", "url_dedup", "near_dedup", "line_dedup", "purge", "tokenize")


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

    signature_stats = StageStats("near_dedup")
    start = time.perf_counter()
    deduper = config.deduper()
    rows = [{"id": doc.id, "url": doc.url, "date": doc.date, "source": doc.source, "text": doc.text,
             "meta": {**doc.meta, "minhash": deduper.signature(doc.text).hashvalues.tolist()}} for doc in survivors]
    signature_stats.seconds = time.perf_counter() - start

    ledger.check_balance(len(survivors))
    write_jsonl(work / "kept.jsonl", rows)
    write_jsonl(work / REJECTED_FILE, ledger.rows)
    summary = {"input": _input_identity(path), "config": config.fingerprint(),
               "documents_in": ledger.documents_in, "kept": len(survivors), "rejected": dict(ledger.rejected),
               "warnings": reader.warnings,
               "stages": [s.stats.to_json() for s in [reader, *stages]] + [signature_stats.to_json()]}
    atomic_write_json(work / "done.json", summary)  # the marker: written last
    return summary


def _finished_summary(path: Path, work_root: Path, config: PipelineConfig) -> dict | None:
    marker = work_root / _file_key(path) / "done.json"
    if not marker.exists():
        return None
    summary = json.loads(marker.read_text())
    if summary["input"] != _input_identity(path) or summary["config"] != config.fingerprint():
        return None  # the input or the configuration changed: redo this file
    return summary


def check_inputs(inputs: Sequence) -> list[Path]:
    """The input files, each once, in order; a one-line error for anything that is not a file."""
    seen, unique = set(), []
    for item in inputs:
        path = Path(item)
        if not path.exists():
            raise FileNotFoundError(f"input not found: {path}")
        if not path.is_file():
            raise IsADirectoryError(f"input is not a file: {path} (give the WET/WARC files inside it)")
        if path.resolve() not in seen:
            seen.add(path.resolve())
            unique.append(path)
    if not unique:
        raise ValueError("no input files given")
    return unique


ENGINES = ("local", "ray")


def run_pipeline(inputs, out_dir, config: PipelineConfig | None = None, workers: int = 1,
                 progress: bool = False, engine: str = "local", address: str | None = None) -> RunReport:
    """Run both phases over WET/WARC ``inputs`` into ``out_dir``; returns the checked report.

    ``engine="ray"`` runs the same stages as Ray tasks (:mod:`distlab.data.ray_engine`) on the cluster at
    ``address``, or on a Ray instance it starts on this machine with ``workers`` CPUs; the answer is the same."""
    config = (config or PipelineConfig()).validate()
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}: choose one of {', '.join(ENGINES)}")
    if address and engine != "ray":
        raise ValueError("--address names a Ray cluster: give it with --engine ray")
    if engine == "ray":
        try:
            from distlab.data.ray_engine import RayEngine  # noqa: PLC0415  Ray is optional: imported only when chosen
        except ModuleNotFoundError as missing:
            if missing.name != "ray":
                raise
            raise ValueError('--engine ray needs Ray: pip install "distlab[ray]" (or pip install ray)') from None
        runner = RayEngine(workers, address)
    else:
        runner = LocalEngine(workers)
    paths = check_inputs(inputs)
    run = RunDirectory(out_dir)
    run.check_writable()
    started = time.perf_counter()
    work_root = run.root / WORK_DIR
    work_root.mkdir(parents=True, exist_ok=True)
    run.clean()

    summaries = {path: _finished_summary(path, work_root, config) for path in paths}
    pending = [path for path, summary in summaries.items() if summary is None]
    with runner:
        for path, summary in zip(pending, runner.phase_one(pending, work_root, config, progress)):
            summaries[path] = summary
        rules = PurgeRules.from_json((run.manifest() or {}).get("purges"))
        selection = runner.phase_two(paths, work_root, config, rules)
        report, staging, manifest = _write_generation(paths, work_root, run, config, summaries, rules, selection)
    report.files_processed, report.files_resumed = len(pending), len(paths) - len(pending)
    report.wall_seconds = time.perf_counter() - started
    report.check_balance()
    report.save(staging)
    run.commit(staging, manifest)  # the run becomes visible here, all of it at once
    return report


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


def near_dedup(docs: Sequence[Document], stage: NearDedup, ledger: Ledger) -> list[Document]:
    """Run ``stage`` over ``docs`` (in input order) in crawl order; the survivors, back in input order."""
    survivors = {id(doc) for doc in run_stages((docs[i] for i in crawl_order(docs)), [stage], ledger)}
    return [doc for doc in docs if id(doc) in survivors]


class LocalEngine:
    """Phase 1 in a process pool over input files, phase 2 in this process."""

    def __init__(self, workers: int = 1) -> None:
        self.workers = workers

    def __enter__(self) -> "LocalEngine":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def phase_one(self, pending: list[Path], work_root: Path, config: PipelineConfig,
                  progress: bool) -> Iterator[dict]:
        """Summaries of ``pending`` in order; in a process pool when workers > 1."""
        job = partial(process_file, work_root=str(work_root), config=config)
        bar = tqdm(total=len(pending), desc="input files", unit="file", disable=not progress)
        if self.workers <= 1 or len(pending) <= 1:
            for path in pending:
                yield job(str(path))
                bar.update()
        else:
            context = multiprocessing.get_context("spawn")  # no fork of a threaded parent (notebooks, tiktoken)
            with context.Pool(min(self.workers, len(pending))) as pool:
                for summary in pool.imap(job, [str(path) for path in pending]):
                    bar.update()
                    yield summary
        bar.close()

    def phase_two(self, paths: list[Path], work_root: Path, config: PipelineConfig, rules: PurgeRules) -> Selection:
        """The corpus-level stages over the stored phase-1 results, all in memory, in input order."""
        ledger = Ledger()
        exact_dedup = [RecordIdDedup(), UrlDedup()]
        exact = list(run_stages(stored_documents(paths, work_root), exact_dedup, ledger))
        near = NearDedup(config.deduper())
        distinct = near_dedup(exact, near, ledger)
        line_dedup = LineDedup(config.line_min_documents, config.quality.min_words)
        start = time.perf_counter()
        line_dedup.fit(distinct)
        line_dedup.stats.seconds += time.perf_counter() - start
        purge_filter = PurgeFilter(rules)
        kept = list(run_stages(distinct, [line_dedup, purge_filter], ledger))
        start = time.perf_counter()
        spans = encode_documents([doc.text for doc in kept])
        return Selection(zip(kept, spans), ledger.rows, ledger.rejected,
                         [stage.stats for stage in [*exact_dedup, near, line_dedup, purge_filter]],
                         time.perf_counter() - start)


def stored_documents(paths: list[Path], work_root: Path) -> Iterator[Document]:
    """Phase-1 survivors with their text; the MinHash signature rides in ``meta``."""
    for path in paths:
        yield from file_documents(path, work_root)


def file_documents(path: Path, work_root: Path) -> Iterator[Document]:
    """The phase-1 survivors of one input file."""
    for row in read_jsonl(work_root / _file_key(path) / "kept.jsonl"):
        yield Document(row["id"], row["text"], row["url"], row["date"], row["source"], row["meta"])


def _write_generation(paths: list[Path], work_root: Path, run: RunDirectory, config: PipelineConfig,
                      summaries: dict, rules: PurgeRules, selection: Selection) -> tuple[RunReport, Path, dict]:
    """Shards, lineage, rejections and stats of a selection into a new, uncommitted generation."""
    staging = run.begin()
    start = time.perf_counter()
    writer = ShardWriter(staging / SHARD_DIR, config.shard_tokens)
    lineage = []
    for doc, span in selection.documents:
        shard, offset = writer.add(doc.id, span)
        lineage.append({"id": doc.id, "url": doc.url, "date": doc.date, "source": doc.source,
                        "hash_before": doc.meta["hash_before"], "hash_after": doc.meta["hash_after"],
                        "language": doc.meta.get("language"), "pii": doc.meta.get("pii", {}),
                        "lines_removed": doc.meta.get("lines_removed", 0),
                        "shard": shard, "offset": offset, "length": len(span)})
    written = writer.close()
    tokenize = StageStats("tokenize", docs_in=len(lineage), docs_out=len(lineage),
                          seconds=selection.tokenize_seconds + time.perf_counter() - start)

    rejected_rows = [row for path in paths for row in read_jsonl(work_root / _file_key(path) / REJECTED_FILE)]
    write_jsonl(staging / LINEAGE_FILE, lineage)
    write_jsonl(staging / REJECTED_FILE, rejected_rows + selection.rejected_rows)

    stages: dict[str, StageStats] = {name: StageStats(name) for name in STAGE_ORDER}
    for summary in summaries.values():
        for row in summary["stages"]:
            stages[row["name"]].merge(StageStats.from_json(row))
    for stats in [*selection.stages, tokenize]:
        stages[stats.name].merge(stats)

    rejected = sum((Counter(s["rejected"]) for s in summaries.values()), Counter()) + selection.rejected
    warnings = [warning for path in paths for warning in summaries[path].get("warnings", [])]
    documents_in = sum(s["documents_in"] for s in summaries.values())
    if documents_in == 0:
        warnings.append(f"no documents were read from {len(paths)} input file(s): are they WET/WARC files?")
    report = RunReport(documents_in=documents_in, kept=len(lineage), rejected=rejected,
                       stages=[stages[name] for name in STAGE_ORDER],
                       tokens=int(sum(row["length"] for row in lineage)),
                       shards=[path.name for path in written], inputs=[str(p) for p in paths], warnings=warnings)
    manifest = {"config": asdict(config), "fingerprint": config.fingerprint(),
                "inputs": [summaries[p]["input"] for p in paths], "shards": report.shards, "purges": rules.to_json()}
    return report, staging, manifest


def shard_paths(out_dir) -> list[Path]:
    """The token shards of the committed run in ``out_dir``, in order (what a training loader reads)."""
    return RunDirectory(out_dir).shard_paths()
