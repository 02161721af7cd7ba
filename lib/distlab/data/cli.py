"""``distlab data``: run the pipeline, print its stats, purge documents, mix sources, make a sample.

A mistake on the command line (a missing file, a directory that is not a run, a bad
``--source`` spec, impossible LSH bands) is one line on stderr and exit code 2, found
before anything is written; a pipe closed early (``distlab data stats DIR | head``) is
not an error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from distlab.data.lineage import PurgeError, purge
from distlab.data.mix import format_mix, mix_sources, parse_source
from distlab.data.output import STATS_CSV, STATS_FILE, NotARunDirectory, RunDirectory
from distlab.data.pipeline import ENGINES, PipelineConfig, run_pipeline
from distlab.data.report import RunReport
from distlab.data.samples import GENERATED_NOTICE, generate_sample
from distlab.data.shards import DEFAULT_SHARD_TOKENS
from distlab.data.toxicity import SCORERS

COMMON_CRAWL_EXAMPLE = (
    "curl -sO https://data.commoncrawl.org/$(curl -s https://data.commoncrawl.org/crawl-data/CC-MAIN-2024-22/wet.paths.gz"
    " | gunzip | head -1)")
USAGE_ERRORS = (ValueError, OSError, NotARunDirectory, PurgeError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="distlab data", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="filter, dedup and tokenize WET/WARC files into token shards",
                              epilog=f"Real data (needs internet): {COMMON_CRAWL_EXAMPLE}")
    run.add_argument("inputs", nargs="+", help="WET (.warc.wet.gz) or WARC (.warc.gz) files")
    run.add_argument("--out", required=True, help="output directory (shards, lineage, stats)")
    run.add_argument("--workers", type=int, default=1,
                     help="processes over input files (with --engine ray and no --address: the CPUs of the local Ray)")
    run.add_argument("--engine", choices=ENGINES, default="local",
                     help="local: a process pool and one process for phase 2; ray: the same stages as Ray tasks "
                          "(pip install ray), phase 2 as hash-partitioned steps")
    run.add_argument("--address", help="with --engine ray: the Ray cluster to run on (e.g. 10.0.0.1:6379 or auto); "
                                       "inputs and --out on a filesystem every node mounts. Default: start a local Ray")
    run.add_argument("--languages", default="en", help="comma-separated lid.176 codes to keep")
    run.add_argument("--language-threshold", type=float, default=0.65)
    run.add_argument("--toxicity", choices=SCORERS, default="page",
                     help="toxicity scorer: page-level (default: the classifier's share of flagged lines plus an "
                          "adult-term rule), the classifier's worst line, or a word blocklist")
    run.add_argument("--blocklist", help="file with one blocked word per line (C4's list, for example); "
                                         "implies --toxicity blocklist")
    run.add_argument("--dedup-threshold", type=float, default=0.8)
    run.add_argument("--bands", type=int, default=16)
    run.add_argument("--rows", type=int, default=8)
    run.add_argument("--line-min-docs", type=int, default=3,
                     help="remove a line from every document when it occurs in this many documents")
    run.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS)
    run.add_argument("--no-progress", action="store_true",
                     help="no progress bars (none are drawn anyway when stderr is not a terminal, or under CI)")

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
    mix.add_argument("--target", metavar="DIR", help="shards of a target sample: choose documents by DSIR "
                                                      "importance resampling toward it instead of uniformly")

    sample = commands.add_parser("sample", help="write the GENERATED sample crawl (offline lab data)")
    sample.add_argument("--out", required=True)
    sample.add_argument("--seed", type=int, default=0)
    sample.add_argument("--docs-per-file", type=int, default=60)
    return parser


def _run(args) -> int:
    blocklist = None
    if args.blocklist:
        if not Path(args.blocklist).is_file():
            raise FileNotFoundError(f"blocklist not found: {args.blocklist}")
        words = Path(args.blocklist).read_text(encoding="utf-8").split("\n")
        blocklist = tuple(word.strip() for word in words if word.strip())
    toxicity = {"toxicity": "blocklist", "blocklist": blocklist} if blocklist else {"toxicity": args.toxicity}
    config = PipelineConfig(languages=tuple(code for code in args.languages.split(",") if code),
                            language_threshold=args.language_threshold, dedup_threshold=args.dedup_threshold,
                            bands=args.bands, rows=args.rows, line_min_documents=args.line_min_docs,
                            shard_tokens=args.shard_tokens, **toxicity)
    report = run_pipeline(args.inputs, args.out, config, workers=args.workers, progress=not args.no_progress,
                          engine=args.engine, address=args.address)
    print(report.table())
    print(f"stats: {RunDirectory(args.out).current() / STATS_FILE} (and {STATS_CSV})")
    return 0


def _stats(args) -> int:
    report = RunReport.load(args.dir)
    if args.format == "json":
        print(json.dumps(report.to_json(), indent=1))
    elif args.format == "csv":
        print((RunDirectory(args.dir).current() / STATS_CSV).read_text(), end="")
    else:
        print(report.table())
    return 0


def _purge(args) -> int:
    if not (args.url or args.hash or args.source):
        raise ValueError("give at least one --url, --hash or --source")
    result = purge(args.dir, args.url, args.hash, args.source)
    print(json.dumps(result.to_json(), indent=1))
    return 0 if result.verified else 1


def _mix(args) -> int:
    sources = {}
    for spec in args.source:
        name, directory, weight = parse_source(spec)
        sources[name] = (directory, weight)
    print(format_mix(mix_sources(sources, args.budget, args.out, seed=args.seed, target=args.target)))
    return 0


def _sample(args) -> int:
    sample = generate_sample(args.out, seed=args.seed, docs_per_file=args.docs_per_file)
    print(GENERATED_NOTICE)
    print("\n".join(str(path) for path in sample.files))
    return 0


COMMANDS = {"run": _run, "stats": _stats, "purge": _purge, "mix": _mix, "sample": _sample}


def main(argv: list | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except USAGE_ERRORS as error:
        print(f"distlab data {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
