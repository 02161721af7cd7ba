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
``run_pipeline(engine=...)``. What both run (phase 1 per file, the configuration, near dedup in crawl order) is
:mod:`distlab.data.phases`, below both engines. Both hand phase 2's outcome over as a
:class:`~distlab.data.phases.Selection`, from which this module writes the generation.

After every run ``documents in == kept + sum(rejected by reason)`` is checked.
Everything that can be checked before work starts (inputs, output directory,
configuration) is, with a one-line error.
"""

from __future__ import annotations

import multiprocessing
import time
from collections import Counter
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Iterator, Sequence

from distlab.data.dedup import NearDedup
from distlab.data.document import Ledger, StageStats, run_stages
from distlab.data.line_dedup import LineDedup
from distlab.data.lineage import PurgeFilter, PurgeRules, read_jsonl, write_jsonl
from distlab.data.output import LINEAGE_FILE, REJECTED_FILE, SHARD_DIR, WORK_DIR, RunDirectory
from distlab.data.phases import (
    PipelineConfig,
    Selection,
    documents_bar,
    file_key,
    files_bar,
    finished_summary,
    near_dedup,
    process_file,
    stored_count,
    stored_documents,
)
from distlab.data.report import RunReport
from distlab.data.shards import ShardWriter, encode_documents
from distlab.data.urls import RecordIdDedup, UrlDedup

TOKENIZE_BATCH = 1024  # documents per tiktoken call: the tokenize bar moves, and tiktoken's threads stay busy
STAGE_ORDER = ("read", "language", "quality", "repetition", "toxicity", "pii",
               "record_id", "url_dedup", "near_dedup", "line_dedup", "purge", "tokenize")


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
                 progress: bool = True, engine: str = "local", address: str | None = None) -> RunReport:
    """Run both phases over WET/WARC ``inputs`` into ``out_dir``; returns the checked report.

    ``engine="ray"`` runs the same stages as Ray tasks (:mod:`distlab.data.ray_engine`) on the cluster at
    ``address``, or on a Ray instance it starts on this machine with ``workers`` CPUs; the answer is the same.
    ``progress``: bars with rate and ETA where a person watches (:mod:`distlab.runtime.progress`; never under
    nbval, pytest or CI): the input files of phase 1 and, on the local engine, each pass of phase 2 over the
    documents; ``False`` draws none (a benchmark that times the run)."""
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
        runner = RayEngine(workers, address, progress)
    else:
        runner = LocalEngine(workers, progress)
    paths = check_inputs(inputs)
    run = RunDirectory(out_dir)
    run.check_writable()
    started = time.perf_counter()
    work_root = run.root / WORK_DIR
    work_root.mkdir(parents=True, exist_ok=True)
    run.clean()

    summaries = {path: finished_summary(path, work_root, config) for path in paths}
    pending = [path for path, summary in summaries.items() if summary is None]
    with runner:
        # strict: the engine's generator runs to its end (its bar closes there), and must yield one summary per file
        for path, summary in zip(pending, runner.phase_one(pending, work_root, config), strict=True):
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


class LocalEngine:
    """Phase 1 in a process pool over input files, phase 2 in this process; ``progress``: draw their bars."""

    def __init__(self, workers: int = 1, progress: bool = True) -> None:
        self.workers, self.progress = workers, progress

    def __enter__(self) -> "LocalEngine":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def phase_one(self, pending: list[Path], work_root: Path, config: PipelineConfig) -> Iterator[dict]:
        """Summaries of ``pending`` in order; in a process pool when workers > 1."""
        job = partial(process_file, work_root=str(work_root), config=config)
        with files_bar(len(pending), self.progress) as bar:
            if self.workers <= 1 or len(pending) <= 1:
                for path in pending:
                    summary = job(str(path))
                    bar.update()
                    yield summary
            else:
                context = multiprocessing.get_context("spawn")  # no fork of a threaded parent (notebooks, tiktoken)
                with context.Pool(min(self.workers, len(pending))) as pool:
                    for summary in pool.imap(job, [str(path) for path in pending]):
                        bar.update()
                        yield summary

    def phase_two(self, paths: list[Path], work_root: Path, config: PipelineConfig, rules: PurgeRules) -> Selection:
        """The corpus-level stages over the stored phase-1 results, all in memory, in input order.

        A bar per pass over the documents: record-id and URL dedup (streamed through one pass), near dedup, the
        count of line dedup, line dedup with the purge rules, tokenization."""
        ledger = Ledger()
        exact_dedup = [RecordIdDedup(), UrlDedup()]
        stored = documents_bar(stored_documents(paths, work_root), "record-id + URL dedup", self.progress,
                               total=stored_count(paths, work_root))
        exact = list(run_stages(stored, exact_dedup, ledger))
        near = NearDedup(config.deduper())
        distinct = near_dedup(exact, near, ledger, shown=self.progress)
        line_dedup = LineDedup(config.line_min_documents, config.quality.min_words)
        start = time.perf_counter()
        line_dedup.fit(documents_bar(distinct, "line dedup: count lines", self.progress))
        line_dedup.stats.seconds += time.perf_counter() - start
        purge_filter = PurgeFilter(rules)
        kept = list(run_stages(documents_bar(distinct, "line dedup + purge", self.progress), [line_dedup, purge_filter],
                               ledger))
        start = time.perf_counter()
        spans = []
        with documents_bar(None, "tokenize", self.progress, total=len(kept)) as bar:
            for first in range(0, len(kept), TOKENIZE_BATCH):
                batch = kept[first:first + TOKENIZE_BATCH]
                spans += encode_documents([doc.text for doc in batch])
                bar.update(len(batch))
        return Selection(zip(kept, spans), ledger.rows, ledger.rejected,
                         [stage.stats for stage in [*exact_dedup, near, line_dedup, purge_filter]],
                         time.perf_counter() - start)


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

    rejected_rows = [row for path in paths for row in read_jsonl(work_root / file_key(path) / REJECTED_FILE)]
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
