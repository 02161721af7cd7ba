"""Lab 10 end to end: accounting, resume, idempotence, purge, mixing and the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from distlab.data import pipeline as pipeline_module
from distlab.data.cli import main as data_main
from distlab.data.lineage import purge, read_jsonl
from distlab.data.mix import mix_sources
from distlab.data.pipeline import PipelineConfig, run_pipeline, shard_paths
from distlab.data.report import RunReport
from distlab.data.samples import generate_sample
from distlab.data.shards import EOT, ShardWriter, encode_document, read_index, read_shard

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
SMALL_SHARDS = PipelineConfig(shard_tokens=4000)


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    return generate_sample(tmp_path_factory.mktemp("crawl"), seed=0, docs_per_file=40)


@pytest.fixture(scope="module")
def finished(sample, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    return run_pipeline(sample.files, out, SMALL_SHARDS), out


def shard_bytes(out: Path) -> dict:
    return {path.name: path.read_bytes() for path in shard_paths(out)}


def test_every_record_is_kept_or_rejected_with_a_reason(sample, finished):
    report, out = finished
    lineage, rejected = read_jsonl(out / "lineage.jsonl"), read_jsonl(out / "rejected.jsonl")
    assert report.documents_in == len(lineage) + len(rejected) == report.kept + sum(report.rejected.values())
    assert Counter(row["reason"] for row in rejected) == report.rejected
    # the awkward records of the generated sample all land in their bucket
    for reason in ("read:empty", "read:non_utf8", "read:truncated_or_corrupt", "record_id:duplicate_record_id",
                   "url_dedup:url_duplicate", "near_dedup:near_duplicate", "language:other_language",
                   "toxicity:blocklist"):
        assert report.rejected[reason] >= 1, reason
    assert any(reason.startswith("quality:") for reason in report.rejected)
    assert any(reason.startswith("repetition:") for reason in report.rejected)
    # every kept document is a good page (prose, perhaps with PII, perhaps a copy), never spam or foreign
    kinds = Counter(sample.labels[row["id"]] for row in lineage)
    assert set(kinds) <= {"good", "pii", "near_duplicate"}, kinds
    kept_ids = {row["id"] for row in lineage}
    close_pairs = [(a, b) for a, b, value in sample.near_duplicates if value >= 0.9]
    assert close_pairs and not any(a in kept_ids and b in kept_ids for a, b in close_pairs)
    assert sum(row["pii"].get("email", 0) for row in lineage) >= 1


def test_accounting_violation_raises(sample, tmp_path, monkeypatch):
    original = RunReport.check_balance

    def lose_one(self):
        self.kept -= 1
        return original(self)

    monkeypatch.setattr(RunReport, "check_balance", lose_one)
    with pytest.raises(Exception, match="documents in"):
        run_pipeline(sample.files[:1], tmp_path, SMALL_SHARDS)


def test_lineage_points_at_the_right_tokens(finished):
    report, out = finished
    lineage = read_jsonl(out / "lineage.jsonl")
    assert report.tokens == sum(row["length"] for row in lineage) == sum(len(read_shard(p)) for p in shard_paths(out))
    shards = {path.name: read_shard(path) for path in shard_paths(out)}
    assert len(shards) > 1 and all(len(tokens) <= 4000 or len(read_index(p)["documents"]) == 1
                                   for p, tokens in zip(shard_paths(out), shards.values()))
    for row in lineage:
        span = shards[row["shard"]][row["offset"]:row["offset"] + row["length"]]
        assert span[0] == EOT and EOT not in span[1:].tolist()
        assert row["hash_before"] and row["hash_after"]
    scrubbed = [row for row in lineage if row["pii"]]
    assert scrubbed and all(row["hash_before"] != row["hash_after"] for row in scrubbed)


def test_rerun_is_idempotent_and_resumes_without_redoing_files(sample, finished):
    report, out = finished
    before, lineage = shard_bytes(out), (out / "lineage.jsonl").read_bytes()
    again = run_pipeline(sample.files, out, SMALL_SHARDS)
    assert again.files_resumed == len(sample.files) and again.files_processed == 0
    assert shard_bytes(out) == before and (out / "lineage.jsonl").read_bytes() == lineage
    assert not list(out.rglob("*.tmp-*"))


def test_interrupted_run_resumes_to_the_same_result(sample, finished, tmp_path, monkeypatch):
    _, reference = finished
    real = pipeline_module.process_file
    calls = []

    def crash_on_third(path, work_root, config):
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt("simulated kill")
        return real(path, work_root, config)

    monkeypatch.setattr(pipeline_module, "process_file", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        run_pipeline(sample.files, tmp_path, SMALL_SHARDS)
    monkeypatch.setattr(pipeline_module, "process_file", real)
    resumed = run_pipeline(sample.files, tmp_path, SMALL_SHARDS)
    assert resumed.files_resumed == 2 and resumed.files_processed == len(sample.files) - 2
    assert shard_bytes(tmp_path) == shard_bytes(reference)
    ids = [row["id"] for row in read_jsonl(tmp_path / "lineage.jsonl")]
    assert len(ids) == len(set(ids))


def test_changed_config_reprocesses_and_removes_stale_shards(sample, tmp_path):
    run_pipeline(sample.files[:2], tmp_path, PipelineConfig(shard_tokens=2000))
    many = len(shard_paths(tmp_path))
    report = run_pipeline(sample.files[:2], tmp_path, PipelineConfig(shard_tokens=10**7, languages=("en", "de")))
    assert report.files_processed == 2 and len(shard_paths(tmp_path)) == 1 < many
    assert len(list((tmp_path / "shards").glob("*.index.json"))) == 1


def test_crash_while_writing_a_shard_keeps_the_old_file(tmp_path, monkeypatch):
    writer = ShardWriter(tmp_path, shard_tokens=100)
    writer.add("a", encode_document("first version"))
    [path] = writer.close()
    old = path.read_bytes()

    def boom(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    writer = ShardWriter(tmp_path, shard_tokens=100)
    writer.add("b", encode_document("second version, different"))
    with pytest.raises(OSError):
        writer.close()
    assert path.read_bytes() == old


def test_parallel_workers_give_the_same_shards(sample, finished, tmp_path):
    _, reference = finished
    report = run_pipeline(sample.files, tmp_path, SMALL_SHARDS, workers=2)
    assert shard_bytes(tmp_path) == shard_bytes(reference)
    assert {s.name for s in report.stages} >= {"read", "language", "near_dedup", "tokenize"}


def test_purge_rewrites_only_affected_shards_and_sticks(sample, tmp_path):
    run_pipeline(sample.files, tmp_path, SMALL_SHARDS)
    lineage = read_jsonl(tmp_path / "lineage.jsonl")
    by_shard = Counter(row["shard"] for row in lineage)
    victim = next(row for row in lineage if by_shard[row["shard"]] > 1)
    by_hash = next(row for row in lineage if row["shard"] != victim["shard"] and by_shard[row["shard"]] > 1)
    before = shard_bytes(tmp_path)
    result = purge(tmp_path, urls=[victim["url"]], hashes=[by_hash["hash_after"]])
    assert result.verified and result.purged == {"purge:url": 1, "purge:hash": 1}
    assert set(result.shards_rewritten) == {victim["shard"], by_hash["shard"]}
    after = shard_bytes(tmp_path)
    for name in result.shards_untouched:
        assert after[name] == before[name]
    for name in result.shards_rewritten:  # re-read: the purged spans are gone, the others intact
        index = read_index(tmp_path / "shards" / name)["documents"]
        assert victim["id"] not in [e["id"] for e in index] and by_hash["id"] not in [e["id"] for e in index]
        tokens = read_shard(tmp_path / "shards" / name)
        assert len(tokens) == len(np.frombuffer(before[name], "<u2")) - (
            victim["length"] if name == victim["shard"] else by_hash["length"])
    stats = RunReport.load(tmp_path)
    stats.check_balance()
    assert stats.rejected["purge:url"] == 1 and stats.kept == len(lineage) - 2
    rerun = run_pipeline(sample.files, tmp_path, SMALL_SHARDS)  # the purge survives a rerun
    assert rerun.rejected["purge:url"] == 1 and rerun.rejected["purge:hash"] == 1
    assert victim["id"] not in {row["id"] for row in read_jsonl(tmp_path / "lineage.jsonl")}


def test_mix_hits_target_weights(tmp_path):
    sources = {}
    for name, n_docs, words in (("web", 60, 300), ("code", 6, 200), ("books", 3, 400)):
        writer = ShardWriter(tmp_path / name, shard_tokens=20_000)
        for i in range(n_docs):
            writer.add(f"{name}{i}", encode_document(" ".join([f"{name}{i}"] * words)))
        writer.close()
    weights = {"web": 0.7, "code": 0.2, "books": 0.1}
    shares = mix_sources({n: (tmp_path / n, w) for n, w in weights.items()}, 30_000, tmp_path / "mix", seed=0)
    total = sum(s.tokens for s in shares)
    assert abs(total - 30_000) < 2_000
    for share in shares:
        assert abs(share.tokens / total - weights[share.name]) < 0.03
    assert {s.name: s.epochs > 1 for s in shares} == {"web": False, "code": True, "books": True}
    mixed = np.concatenate([read_shard(p) for p in sorted((tmp_path / "mix").glob("*.bin"))])
    assert len(mixed) == total and (mixed == EOT).sum() == sum(s.documents for s in shares)
    assert json.loads((tmp_path / "mix" / "mix.json").read_text())[0]["source"] == "web"


def test_cli_run_stats_purge_end_to_end(sample, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "lib")}
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "distlab.data.cli", "run", *map(str, sample.files), "--out", str(out),
                           "--no-progress", "--shard-tokens", "5000"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "documents in" in done.stdout and "near_dedup" in done.stdout
    stats = json.loads((out / "stats.json").read_text())
    assert stats["documents_in"] == stats["kept"] + sum(stats["rejected"].values())
    assert (out / "stats.csv").read_text().startswith("kind,name,docs_in")
    assert data_main(["stats", str(out), "--format", "json"]) == 0
    assert data_main(["purge", str(out), "--source", "generated-01.warc.wet.gz"]) == 0
    lineage = read_jsonl(out / "lineage.jsonl")
    assert lineage and all(row["source"] != "generated-01.warc.wet.gz" for row in lineage)
    assert data_main(["purge", str(out)]) == 2  # nothing to purge by: refused


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data (real Common Crawl samples) not present")
def test_real_common_crawl_samples(tmp_path):
    files = sorted(SHARED.rglob("*.gz"))
    report = run_pipeline(files, tmp_path, PipelineConfig(languages=("en", "de", "zh", "ru", "nl", "es")))
    report.check_balance()
    assert report.documents_in >= 50 and report.kept >= 1
