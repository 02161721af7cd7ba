"""Lab 10's pipeline on a Ray cluster: the same stage objects, phase 1 as tasks, phase 2 as shuffles.

``distlab data run --engine ray [--address ADDR]`` (or ``run_pipeline(..., engine="ray")``). Nothing here
re-implements a filter: every decision is made by the stage classes the local engine runs; this module only
decides *which documents meet in one process*, so that each stage still sees everything it needs.

* **Phase 1**: :func:`~distlab.data.phases.process_file` is a Ray task per input file. It streams the file's
  records through the per-document stages and writes ``work/<file>/`` with its ``done.json`` marker last, so a
  task whose worker dies is simply run again by Ray (``max_retries``): its half-written files are replaced, and
  its summary reaches the driver once. A run started again skips the files whose markers are there.
* **Record-id and URL dedup** keep the first document per key. Documents are shuffled by a hash of the key
  into partitions (equal keys meet in one partition) and each partition runs the stage over its documents in
  input order: the first per key is the same one the local engine keeps.
* **Near dedup** keeps, in crawl order, a document unless it matches an earlier kept one among its LSH
  candidates (documents that share a band). Every document's band keys are shuffled by a hash of the band; a
  band shared by several documents links them; the connected components of those links are what can interact,
  so each component goes whole to one partition, where :class:`~distlab.data.dedup.NearDedup` runs over it in
  crawl order. A chain A~B~C with A !~ C keeps A and C in both engines.
* **Line dedup**: each partition counts the document frequency of its documents' lines, split by a hash of
  the line into count partitions; each count partition sums its counts and keeps its repeated lines; the
  union is handed to every partition with the same :class:`~distlab.data.line_dedup.LineDedup` object.
* **Tokenization** runs in the last partitions, which hold contiguous ranges of input files, so the driver
  writes their spans in input order as they arrive: the shards, lineage and ``rejected.jsonl`` are
  byte-identical to the local engine's (rejections of phase 2 in the order the local engine meets them).

Where data lives: phase 1 reads the inputs and writes ``--out/work`` on the node that runs the task, so on a
cluster the inputs and the output directory must be on a filesystem every node mounts (NFS, a mounted bucket),
and every node needs distlab installed (``pip install "distlab[ray]"``).
"""

from __future__ import annotations

import time
import zlib
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import ray

from distlab.data.dedup import NearDedup
from distlab.data.document import Document, Ledger, Stage, StageStats, run_stages
from distlab.data.line_dedup import LineDedup, document_frequencies
from distlab.data.lineage import PurgeFilter, PurgeRules
from distlab.data.phases import PipelineConfig, Selection, file_documents, files_bar, near_dedup, process_file
from distlab.data.shards import encode_documents
from distlab.data.urls import RecordIdDedup, UrlDedup, normalize_url

# A worker killed mid-file (OOM killer, a lost node) is a system failure: Ray runs the task again this many times.
TASK_RETRIES = 3


def _partition(key: str, parts: int) -> int:
    """A hash every process agrees on (Python's ``hash`` of a string changes from one process to the next)."""
    return zlib.crc32(key.encode("utf-8", "surrogatepass")) % parts


class _KeyedLedger(Ledger):
    """A ledger that remembers each rejection's sort key, so rows from many partitions merge in a canonical order."""

    def __init__(self, keys: dict) -> None:
        super().__init__()
        self.keys, self.keyed = keys, []

    def reject(self, doc: Document, reason: str) -> None:
        super().reject(doc, reason)
        self.keyed.append(self.keys[id(doc)])

    def report(self, stages: list[Stage], seconds: float = 0.0) -> dict:
        return {"rows": list(zip(self.keyed, self.rows)), "rejected": self.rejected,
                "stages": [stage.stats for stage in stages], "seconds": seconds}


def _split(items: list, key: Callable, parts: int) -> list[list] | list:
    """``items`` cut into ``parts`` lists by ``key``; a bare list for one part (Ray returns one object then)."""
    out = [[] for _ in range(parts)]
    for item in items:
        out[key(item)].append(item)
    return out if parts > 1 else out[0]


def _merge(pieces) -> list:
    return sorted((item for piece in pieces for item in piece), key=lambda item: item[0])


@ray.remote
def _load(path: str, work_root: str, number: int) -> list:
    """One input file's phase-1 survivors, each with its position (file number, row): input order."""
    return [((number, row), doc) for row, doc in enumerate(file_documents(Path(path), Path(work_root)))]


@ray.remote
def _route_by_key(block: list, field: str, parts: int):
    """Shuffle documents by a hash of the key their dedup stage compares (the id, or the normalised URL)."""
    def key(item):
        doc = item[1]
        value = doc.id if field == "id" else (normalize_url(doc.url) or doc.id)  # no URL: near dedup judges it
        return _partition(value, parts)
    return _split(block, key, parts)


@ray.remote(num_returns=2)
def _first_per_key(stage: Stage, *pieces) -> tuple[list, dict]:
    """Run a keep-the-first stage over one partition in input order: the survivors and the partition's report."""
    items = _merge(pieces)
    ledger = _KeyedLedger({id(doc): position for position, doc in items})
    kept = {id(doc) for doc in run_stages((doc for _, doc in items), [stage], ledger)}
    return [item for item in items if id(item[1]) in kept], ledger.report([stage])


@ray.remote
def _band_keys(block: list, bands: int, rows: int, parts: int):
    """(band, band's hash values, position) per document and band, shuffled by a hash of the band."""
    keys = []
    for position, doc in block:
        values = np.asarray(doc.meta["minhash"], dtype=np.uint32)
        keys += [(band, values[band * rows:(band + 1) * rows].tobytes(), position) for band in range(bands)]
    return _split(keys, lambda key: zlib.crc32(key[1]) % parts, parts)


@ray.remote
def _band_links(*pieces) -> list:
    """Pairs of positions that share a band (LSH candidates): each bucket's members linked to its first."""
    buckets: dict = {}
    for band, values, position in (key for piece in pieces for key in piece):
        buckets.setdefault((band, values), []).append(position)
    return [(members[0], other) for members in buckets.values() if len(members) > 1 for other in members[1:]]


def _components(links: list) -> dict:
    """Position -> the smallest position of its connected component (union-find), for linked positions only."""
    parent: dict = {}

    def root(x):
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in links:
        ra, rb = root(a), root(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    return {x: root(x) for x in parent}


@ray.remote
def _route_by_component(block: list, components: dict, parts: int):
    """Shuffle documents so that each LSH component lands whole in one partition."""
    def key(item):
        file, row = components.get(item[0], item[0])
        return (file * 1_000_003 + row) % parts
    return _split(block, key, parts)


@ray.remote(num_returns=2)
def _near_partition(config: PipelineConfig, *pieces) -> tuple[list, dict]:
    """NearDedup over whole components, in crawl order (earliest crawl first, ties in input order)."""
    items = _merge(pieces)
    docs = [doc for _, doc in items]
    ledger = _KeyedLedger({id(doc): (not doc.date, doc.date, position) for position, doc in items})
    stage = NearDedup(config.deduper())
    kept = {id(doc) for doc in near_dedup(docs, stage, ledger)}
    return [item for item in items if id(item[1]) in kept], ledger.report([stage])


@ray.remote
def _route_by_file(block: list, files: int, parts: int):
    """Shuffle documents back into contiguous ranges of input files, so they can be written in input order."""
    return _split(block, lambda item: item[0][0] * parts // files, parts)


@ray.remote
def _line_frequencies(parts: int, *pieces) -> list:
    """This partition's documents (merged, in input order), the seconds spent counting, and their lines'
    document frequencies split by a hash of the line into ``parts`` counts."""
    items = _merge(pieces)
    start = time.perf_counter()
    split = [Counter() for _ in range(parts)]
    for line, count in document_frequencies(doc.text for _, doc in items).items():
        split[_partition(line, parts)][line] = count
    return [items, time.perf_counter() - start, *split]


@ray.remote
def _repeated_lines(stage: LineDedup, *counts) -> set:
    """One line partition: the counts of every document partition summed -> the lines the stage removes."""
    return stage.repeated_lines(sum(counts, Counter()))


@ray.remote
def _finish(items: list, line_dedup: LineDedup, purge_filter: PurgeFilter) -> tuple[list, list, dict]:
    """Line dedup, purge rules and GPT-2 tokens for one range of input files, in input order."""
    for stage in (line_dedup, purge_filter):
        stage.stats = StageStats(stage.name)  # this copy's own counts; the driver adds them up
    ledger = _KeyedLedger({id(doc): position for position, doc in items})
    kept = list(run_stages((doc for _, doc in items), [line_dedup, purge_filter], ledger))
    start = time.perf_counter()
    spans = encode_documents([doc.text for doc in kept])
    seconds = time.perf_counter() - start
    for doc in kept:
        doc.text = ""  # the driver writes lineage from the fields and shards from the spans
    return kept, spans, ledger.report([line_dedup, purge_filter], seconds)


process_file_task = ray.remote(max_retries=TASK_RETRIES)(process_file)


def connect(address: str | None = None, workers: int = 1) -> None:
    """Join the Ray cluster at ``address``, or start a Ray instance on this machine with ``workers`` CPUs (what
    ``--engine ray`` does without ``--address``). Workers' output stays in Ray's logs: the run's report says it all."""
    options = {"address": address} if address else {"num_cpus": workers}
    ray.init(include_dashboard=False, log_to_driver=False, logging_level="ERROR", **options)


class RayEngine:
    """Runs both phases on Ray: the cluster at ``address``, one already connected, or a local one it starts.

    ``progress``: phase 1's bar of input files (phase 2 is shuffles Ray schedules as a whole: no bar of its own)."""

    def __init__(self, workers: int = 1, address: str | None = None, progress: bool = True) -> None:
        self.workers, self.address, self.progress, self.started = workers, address, progress, False

    def __enter__(self) -> "RayEngine":
        if not ray.is_initialized():
            connect(self.address, self.workers)
            self.started = True
        self.parts = max(1, int(ray.cluster_resources().get("CPU", 1)))
        return self

    def __exit__(self, *exc) -> None:
        if self.started:
            ray.shutdown()

    def phase_one(self, pending: list[Path], work_root: Path, config: PipelineConfig) -> Iterator[dict]:
        """A task per pending file, as many running as the cluster has CPUs; their summaries in input order.

        Submitting only as CPUs free up (not every file at once) is what makes an interrupt stop the run: the
        tasks already running finish their files (a resumed run skips them), and no queued one starts after."""
        config_ref = ray.put(config)
        submitted, running = [], set()
        with files_bar(len(pending), self.progress) as bar:
            for k in range(len(pending)):
                while True:
                    while len(submitted) < len(pending) and len(running) < self.parts:
                        submitted.append(process_file_task.remote(str(pending[len(submitted)]), str(work_root),
                                                                  config_ref))
                        running.add(submitted[-1])
                    if submitted[k] not in running:
                        break
                    ready, _ = ray.wait(list(running), num_returns=1)
                    running.difference_update(ready)
                bar.update()
                yield ray.get(submitted[k])

    def _shuffle(self, route, blocks: list, *args) -> list[list]:
        """Route every block into ``parts`` pieces: piece lists per destination partition."""
        routed = [route.options(num_returns=self.parts).remote(block, *args, self.parts) for block in blocks]
        if self.parts == 1:
            return [routed]
        return [[pieces[k] for pieces in routed] for k in range(self.parts)]

    def phase_two(self, paths: list[Path], work_root: Path, config: PipelineConfig, rules: PurgeRules) -> Selection:
        """The corpus-level stages as Ray steps; the same Selection the local engine makes."""
        blocks = [_load.remote(str(path), str(work_root), number) for number, path in enumerate(paths)]
        reports = {"exact": [], "near": []}
        for field, stage in (("id", RecordIdDedup()), ("url", UrlDedup())):
            outputs = [_first_per_key.remote(stage, *pieces) for pieces in self._shuffle(_route_by_key, blocks, field)]
            blocks = [survivors for survivors, _ in outputs]
            reports["exact"] += ray.get([report for _, report in outputs])

        band_pieces = self._shuffle(_band_keys, blocks, config.bands, config.rows)
        links = [link for part in ray.get([_band_links.remote(*pieces) for pieces in band_pieces]) for link in part]
        components = ray.put(_components(links))
        outputs = [_near_partition.remote(config, *pieces)
                   for pieces in self._shuffle(_route_by_component, blocks, components)]
        blocks = [survivors for survivors, _ in outputs]
        reports["near"] = ray.get([report for _, report in outputs])

        counted = [_line_frequencies.options(num_returns=self.parts + 2).remote(self.parts, *pieces)
                   for pieces in self._shuffle(_route_by_file, blocks, len(paths))]
        line_dedup = LineDedup(config.line_min_documents, config.quality.min_words)
        start = time.perf_counter()
        repeated = ray.get([_repeated_lines.remote(line_dedup, *[split[2 + k] for split in counted])
                            for k in range(self.parts)])
        line_dedup.use(set().union(*repeated))
        line_dedup.stats.seconds += sum(ray.get([split[1] for split in counted])) + time.perf_counter() - start
        purge_filter = PurgeFilter(rules)
        stage_refs = ray.put(line_dedup), ray.put(purge_filter)
        finishing = [_finish.remote(split[0], *stage_refs) for split in counted]
        selection = Selection(documents=iter(()), rejected_rows=[], rejected=Counter(), stages=[],
                              tokenize_seconds=0.0)
        selection.documents = _collect(selection, finishing, reports, [line_dedup, purge_filter])
        return selection


def _collect(selection: Selection, finishing: list, reports: dict, stages: list[Stage]) -> Iterator[tuple]:
    """The kept documents and their spans, range of input files after range, as the writer asks for them (the
    driver holds one range's tokens at a time); then the rest of ``selection``: rejections and stage stats."""
    finished = []
    for ref in finishing:
        kept, spans, report = ray.get(ref)
        finished.append(report)
        yield from zip(kept, spans)
    stats: dict[str, StageStats] = {}
    for report in [*reports["exact"], *reports["near"], *finished]:
        selection.rejected += report["rejected"]
        for row in report["stages"]:
            stats.setdefault(row.name, StageStats(row.name)).merge(row)
    for stage in stages:  # the driver's copies hold what was counted once (repeated lines, the count's seconds)
        stats.setdefault(stage.name, StageStats(stage.name)).merge(stage.stats)
    selection.stages = list(stats.values())
    selection.tokenize_seconds = sum(report["seconds"] for report in finished)
    for group in (reports["exact"], reports["near"], finished):  # each step's rejections in the local engine's order
        pairs = sorted((pair for report in group for pair in report["rows"]), key=lambda pair: pair[0])
        selection.rejected_rows += [row for _, row in pairs]
