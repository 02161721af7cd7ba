"""``distlab data``: run the pipeline, print its stats, purge documents, mix sources, make a sample."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from distlab.data.lineage import purge
from distlab.data.mix import format_mix, mix_sources
from distlab.data.pipeline import PipelineConfig, run_pipeline
from distlab.data.report import STATS_FILE, RunReport
from distlab.data.samples import GENERATED_NOTICE, generate_sample
from distlab.data.shards import DEFAULT_SHARD_TOKENS
from distlab.data.toxicity import DEFAULT_BLOCKLIST

COMMON_CRAWL_EXAMPLE = (
    "curl -sO https://data.commoncrawl.org/$(curl -s https://data.commoncrawl.org/crawl-data/CC-MAIN-2024-22/wet.paths.gz"
    " | gunzip | head -1)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="distlab data", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="filter, dedup and tokenize WET/WARC files into token shards",
                              epilog=f"Real data (needs internet): {COMMON_CRAWL_EXAMPLE}")
    run.add_argument("inputs", nargs="+", help="WET (.warc.wet.gz) or WARC (.warc.gz) files")
    run.add_argument("--out", required=True, help="output directory (shards, lineage, stats)")
    run.add_argument("--workers", type=int, default=1, help="processes over input files")
    run.add_argument("--languages", default="en", help="comma-separated lid.176 codes to keep")
    run.add_argument("--language-threshold", type=float, default=0.65)
    run.add_argument("--dedup-threshold", type=float, default=0.8)
    run.add_argument("--bands", type=int, default=16)
    run.add_argument("--rows", type=int, default=8)
    run.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS)
    run.add_argument("--blocklist", help="file with one blocked word per line (C4's list, for example)")
    run.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")

    stats = commands.add_parser("stats", help="print the stats of a finished run")
    stats.add_argument("dir")
    stats.add_argument("--format", choices=["table", "json", "csv"], default="table")

    remove = commands.add_parser("purge", help="remove documents by URL, hash or source; rewrites only affected shards")
    remove.add_argument("dir")
    remove.add_argument("--url", action="append", default=[])
    remove.add_argument("--hash", action="append", default=[], help="sha1 of the text before or after filtering")
    remove.add_argument("--source", action="append", default=[], help="input file name")

    mix = commands.add_parser("mix", help="mix shard directories to target weights under a token budget")
    mix.add_argument("--source", action="append", required=True, metavar="NAME=DIR:WEIGHT")
    mix.add_argument("--budget", type=int, required=True, help="tokens in the mixture")
    mix.add_argument("--out", required=True)
    mix.add_argument("--seed", type=int, default=0)

    sample = commands.add_parser("sample", help="write the GENERATED sample crawl (offline lab data)")
    sample.add_argument("--out", required=True)
    sample.add_argument("--seed", type=int, default=0)
    sample.add_argument("--docs-per-file", type=int, default=60)
    return parser


def main(argv: Optional[list] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "run":
        blocklist = (tuple(Path(args.blocklist).read_text(encoding="utf-8").split("\n"))
                     if args.blocklist else DEFAULT_BLOCKLIST)
        config = PipelineConfig(languages=tuple(args.languages.split(",")), language_threshold=args.language_threshold,
                                dedup_threshold=args.dedup_threshold, bands=args.bands, rows=args.rows,
                                shard_tokens=args.shard_tokens, blocklist=tuple(w for w in blocklist if w.strip()))
        report = run_pipeline(args.inputs, args.out, config, workers=args.workers, progress=not args.no_progress)
        print(report.table())
        print(f"stats: {Path(args.out) / STATS_FILE} (and stats.csv)")
    elif args.command == "stats":
        report = RunReport.load(args.dir)
        if args.format == "json":
            print(json.dumps(report.to_json(), indent=1))
        elif args.format == "csv":
            print((Path(args.dir) / "stats.csv").read_text(), end="")
        else:
            print(report.table())
    elif args.command == "purge":
        if not (args.url or args.hash or args.source):
            print("purge: give at least one --url, --hash or --source", file=sys.stderr)
            return 2
        result = purge(args.dir, args.url, args.hash, args.source)
        print(json.dumps(result.to_json(), indent=1))
        return 0 if result.verified else 1
    elif args.command == "mix":
        sources = {}
        for spec in args.source:
            name, _, rest = spec.partition("=")
            directory, _, weight = rest.rpartition(":")
            sources[name] = (directory, float(weight))
        print(format_mix(mix_sources(sources, args.budget, args.out, seed=args.seed)))
    elif args.command == "sample":
        sample = generate_sample(args.out, seed=args.seed, docs_per_file=args.docs_per_file)
        print(GENERATED_NOTICE)
        print("\n".join(str(path) for path in sample.files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
