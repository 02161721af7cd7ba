"""Lab 10 end to end: accounting, resume, idempotence, atomic commits, purge, mixing and the command line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from distlab.data import pipeline as pipeline_module
from distlab.data.cli import main as data_main
from distlab.data.lineage import PurgeError, purge, read_jsonl, write_jsonl
from distlab.data.mix import ImportanceResampler, hashed_ngram_counts, mix_sources
from distlab.data.output import MANIFEST_FILE, NotARunDirectory, RunDirectory
from distlab.data.pipeline import PipelineConfig, run_pipeline, shard_paths
from distlab.data.read import parse_wet
from distlab.data.report import RunReport
from distlab.data.samples import COOKIE_BANNER, generate_sample, prose
from distlab.data.shards import EOT, ShardWriter, encode_document, gpt2_encoding, read_index, read_shard
from distlab.runtime import progress

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
SMALL_SHARDS = PipelineConfig(shard_tokens=4000)
BLOCKLIST = PipelineConfig(shard_tokens=4000, toxicity="blocklist")  # no scikit-learn import in spawned workers


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    return generate_sample(tmp_path_factory.mktemp("crawl"), seed=0, docs_per_file=30)


@pytest.fixture(scope="module")
def finished(sample, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    return run_pipeline(sample.files, out, SMALL_SHARDS), out


def run_file(out: Path, name: str) -> Path:
    return RunDirectory(out).file(name)


def shard_bytes(out: Path) -> dict:
    return {path.name: path.read_bytes() for path in shard_paths(out)}


def documents_on_disk(out: Path) -> dict:
    """id -> shard for every document in every shard file under ``out``, committed or not."""
    return {entry["id"]: path.name for path in out.rglob("shard_*.bin")
            for entry in read_index(path)["documents"]}


def test_every_record_is_kept_or_rejected_with_a_reason(sample, finished):
    report, out = finished
    lineage, rejected = read_jsonl(run_file(out, "lineage.jsonl")), read_jsonl(run_file(out, "rejected.jsonl"))
    assert report.documents_in == len(lineage) + len(rejected) == report.kept + sum(report.rejected.values())
    assert Counter(row["reason"] for row in rejected) == report.rejected
    # the awkward records of the generated sample all land in their bucket
    for reason in ("read:empty", "read:non_utf8", "read:truncated", "record_id:duplicate_record_id",
                   "url_dedup:url_duplicate", "near_dedup:near_duplicate", "language:other_language",
                   "toxicity:abuse", "toxicity:nsfw"):
        assert report.rejected[reason] >= 1, reason
    assert any(reason.startswith("quality:") for reason in report.rejected)
    assert any(reason.startswith("repetition:") for reason in report.rejected)
    # every kept document is prose (perhaps with PII, perhaps an intact record of the cut file): never spam,
    # boilerplate, foreign, toxic (abuse or NSFW spam) or a mirror copy
    kinds = Counter(sample.labels[row["id"]] for row in lineage)
    assert set(kinds) <= {"good", "pii", "truncated"}, kinds
    kept_ids = {row["id"] for row in lineage}
    close_pairs = [(a, b) for a, b, value in sample.near_duplicates if value >= 0.9]
    assert close_pairs and not any(a in kept_ids and b in kept_ids for a, b in close_pairs)
    # a cluster keeps its earliest-crawled member: the original, never the (later-crawled) mirror
    near = [row for row in rejected if row["reason"] == "near_dedup:near_duplicate"]
    assert near and all(sample.labels[row["id"]] == "near_duplicate" for row in near), near
    assert sum(row["pii"].get("email", 0) for row in lineage) >= 1
    # duplicates name the document they duplicate
    for row in rejected:
        if row["reason"].startswith(("near_dedup:", "url_dedup:", "record_id:")):
            assert row["duplicate_of"] and row["snippet"], row


def sample_files(out: Path) -> list[Path]:
    return [Path(path) for path in RunReport.load(out).inputs]


def test_line_dedup_removes_site_boilerplate_from_every_page(finished):
    report, out = finished
    counters = next(stage.counters for stage in report.stages if stage.name == "line_dedup")
    assert counters["lines_removed"] > 0 and counters["bytes_removed"] > counters["lines_removed"]
    tokens = np.concatenate([read_shard(path) for path in shard_paths(out)])
    text = gpt2_encoding().decode(tokens.tolist())
    assert COOKIE_BANNER not in text  # it was on most pages of the input
    assert sum(COOKIE_BANNER in doc.text for path in sample_files(out) for doc in parse_wet(path)) > 20
    assert sum(row["lines_removed"] for row in read_jsonl(run_file(out, "lineage.jsonl"))) > 0


def test_accounting_violation_raises(sample, tmp_path, monkeypatch):
    original = RunReport.check_balance

    def lose_one(self):
        self.kept -= 1
        return original(self)

    monkeypatch.setattr(RunReport, "check_balance", lose_one)
    with pytest.raises(Exception, match="documents in"):
        run_pipeline(sample.files[:1], tmp_path, BLOCKLIST)
    assert not (tmp_path / MANIFEST_FILE).exists()  # nothing was committed


def test_lineage_points_at_the_right_tokens(finished):
    report, out = finished
    lineage = read_jsonl(run_file(out, "lineage.jsonl"))
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
    before, lineage = shard_bytes(out), run_file(out, "lineage.jsonl").read_bytes()
    again = run_pipeline(sample.files, out, SMALL_SHARDS)
    assert again.files_resumed == len(sample.files) and again.files_processed == 0
    assert shard_bytes(out) == before and run_file(out, "lineage.jsonl").read_bytes() == lineage
    assert not list(out.rglob("*.tmp-*")) and len(list(out.glob("gen-*"))) == 1


def test_interrupted_phase_one_resumes_to_the_same_result(sample, finished, tmp_path, monkeypatch):
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
    ids = [row["id"] for row in read_jsonl(run_file(tmp_path, "lineage.jsonl"))]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("killed_in", ["shards", "commit"])
def test_a_run_killed_in_phase_two_leaves_the_previous_run_whole(sample, tmp_path, monkeypatch, killed_in):
    """Killed after writing one new shard, or with everything written but not committed: the committed
    run is still the old one, all of it, a purge verifies against what is really on disk, and the next
    run clears the debris."""
    run_pipeline(sample.files[:2], tmp_path, BLOCKLIST)
    before = {name: run_file(tmp_path, name).read_bytes() for name in ("lineage.jsonl", "stats.json")}
    old_shards = shard_bytes(tmp_path)

    def kill(*args, **kwargs):
        raise KeyboardInterrupt("SIGTERM")

    real_flush, flushes = ShardWriter.flush, []

    def kill_after_one_shard(self):
        flushes.append(real_flush(self))
        kill()

    if killed_in == "shards":
        monkeypatch.setattr(ShardWriter, "flush", kill_after_one_shard)
    else:
        monkeypatch.setattr(RunDirectory, "commit", kill)
    with pytest.raises(KeyboardInterrupt):
        run_pipeline(sample.files[:2], tmp_path, PipelineConfig(shard_tokens=1500, toxicity="blocklist"))
    monkeypatch.undo()
    assert len(list(tmp_path.glob("gen-*"))) == 2  # the half-built generation is still there...
    assert {name: run_file(tmp_path, name).read_bytes() for name in before} == before  # ...and not in force
    assert shard_bytes(tmp_path) == old_shards

    victim = read_jsonl(run_file(tmp_path, "lineage.jsonl"))[3]
    result = purge(tmp_path, urls=[victim["url"]])
    assert result.verified and result.purged == {"purge:url": 1}
    assert victim["id"] not in documents_on_disk(tmp_path)  # in no shard file at all, committed or not
    assert len(list(tmp_path.glob("gen-*"))) == 1
    RunReport.load(tmp_path).check_balance()


def test_a_bar_per_phase_one_and_per_pass_of_phase_two_only_where_a_person_watches(sample, tmp_path, monkeypatch,
                                                                                   capfd):
    run_pipeline(sample.files[:1], tmp_path / "headless", BLOCKLIST)
    assert capfd.readouterr() == ("", "")  # pytest is headless, as nbval and CI
    monkeypatch.setattr(progress, "audience", lambda: "terminal")
    report = run_pipeline(sample.files[:1], tmp_path / "watched", BLOCKLIST)
    drawn = capfd.readouterr().err.replace("\r", "\n")
    stages = {stage.name: stage for stage in report.stages}
    finished = {"phase 1 · input files": (1, "file"),
                "phase 2 · record-id + URL dedup": (stages["record_id"].docs_in, "doc"),
                "phase 2 · near dedup": (stages["near_dedup"].docs_in, "doc"),
                "phase 2 · line dedup: count lines": (stages["line_dedup"].docs_in, "doc"),
                "phase 2 · line dedup + purge": (stages["line_dedup"].docs_in, "doc"),
                "phase 2 · tokenize": (report.kept, "doc")}
    for desc, (count, unit) in finished.items():
        assert count > 0 and re.search(rf"{re.escape(desc)}: 100%\|.*\| {count}/{count} \[\d\d:\d\d<\d\d:\d\d, +"
                                       rf"(?:[\d.]+|\?)({unit}/s|s/{unit})\]", drawn), (desc, count, drawn)
    run_pipeline(sample.files[:1], tmp_path / "watched", BLOCKLIST, progress=False)  # distlab data run --no-progress
    assert capfd.readouterr() == ("", "")


def test_stale_temporaries_are_cleaned_at_start(sample, tmp_path):
    run_pipeline(sample.files[:1], tmp_path, BLOCKLIST)
    debris = [RunDirectory(tmp_path).current() / "shards" / "shard_00000.bin.tmp-99999",
              next((tmp_path / "work").iterdir()) / "kept.jsonl.tmp-12345", tmp_path / "gen-00042" / "lineage.jsonl"]
    for path in debris:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"half written")
    run_pipeline(sample.files[:1], tmp_path, BLOCKLIST)
    assert not any(path.exists() for path in debris)
    assert not list(tmp_path.rglob("*.tmp-*"))


def test_changed_config_reprocesses_only_what_it_must(sample, tmp_path):
    run_pipeline(sample.files[:2], tmp_path, PipelineConfig(shard_tokens=2000, toxicity="blocklist"))
    many = len(shard_paths(tmp_path))
    report = run_pipeline(sample.files[:2], tmp_path, PipelineConfig(shard_tokens=10**7, toxicity="blocklist",
                                                                      line_min_documents=2))
    assert report.files_resumed == 2  # shard size and line dedup are phase 2: nothing redone
    assert len(shard_paths(tmp_path)) == 1 < many
    assert len(list(tmp_path.rglob("*.index.json"))) == 1  # the old generation's shards are gone
    report = run_pipeline(sample.files[:2], tmp_path, PipelineConfig(shard_tokens=10**7, toxicity="blocklist",
                                                                      languages=("en", "de")))
    assert report.files_processed == 2


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


def test_parallel_workers_give_the_same_shards(sample, tmp_path):
    serial = run_pipeline(sample.files[:2], tmp_path / "serial", BLOCKLIST)
    parallel = run_pipeline(sample.files[:2], tmp_path / "parallel", BLOCKLIST, workers=2)
    assert shard_bytes(tmp_path / "parallel") == shard_bytes(tmp_path / "serial")
    assert parallel.rejected == serial.rejected and parallel.rejected["toxicity:blocklist"] >= 1


def test_purge_rewrites_only_affected_shards_and_sticks(sample, tmp_path):
    run_pipeline(sample.files[:3], tmp_path, BLOCKLIST)
    lineage = read_jsonl(run_file(tmp_path, "lineage.jsonl"))
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
        index = read_index(RunDirectory(tmp_path).current() / "shards" / name)["documents"]
        assert victim["id"] not in [e["id"] for e in index] and by_hash["id"] not in [e["id"] for e in index]
        tokens = read_shard(RunDirectory(tmp_path).current() / "shards" / name)
        assert len(tokens) == len(np.frombuffer(before[name], "<u2")) - (
            victim["length"] if name == victim["shard"] else by_hash["length"])
    stats = RunReport.load(tmp_path)
    stats.check_balance()
    assert stats.rejected["purge:url"] == 1 and stats.kept == len(lineage) - 2
    rerun = run_pipeline(sample.files[:3], tmp_path, BLOCKLIST)  # the purge survives a rerun
    assert rerun.rejected["purge:url"] == 1 and rerun.rejected["purge:hash"] == 1
    assert victim["id"] not in {row["id"] for row in read_jsonl(run_file(tmp_path, "lineage.jsonl"))}


def test_purge_refuses_when_lineage_and_shards_disagree(sample, tmp_path):
    run_pipeline(sample.files[:2], tmp_path, BLOCKLIST)
    lineage_path = run_file(tmp_path, "lineage.jsonl")
    rows = read_jsonl(lineage_path)
    write_jsonl(lineage_path, [{**rows[0], "shard": "shard_00099.bin"}] + rows[1:])  # lineage no longer tells the truth
    with pytest.raises(PurgeError, match="disagree"):
        purge(tmp_path, urls=[rows[0]["url"]])
    assert rows[0]["id"] in documents_on_disk(tmp_path)


def test_purge_refuses_a_directory_that_is_not_a_run(tmp_path):
    (tmp_path / "notes.txt").write_text("my files")
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(NotARunDirectory, match="not the output of"):
        purge(tmp_path, urls=["https://example.com/"])
    assert data_main(["purge", str(tmp_path), "--url", "https://example.com/"]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    with pytest.raises(NotARunDirectory, match="not a distlab data run"):  # nor is it a place to write a run
        RunDirectory(tmp_path).check_writable()


def _write_source(directory: Path, name: str, texts: list[str]) -> None:
    writer = ShardWriter(directory, shard_tokens=20_000)
    for i, text in enumerate(texts):
        writer.add(f"{name}{i}", encode_document(text))
    writer.close()


def test_mix_hits_target_weights(tmp_path):
    for name, n_docs, words in (("web", 60, 300), ("code", 6, 200), ("books", 3, 400)):
        _write_source(tmp_path / name, name, [" ".join([f"{name}{i}"] * words) for i in range(n_docs)])
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


def code_snippet(rng, n: int) -> str:
    return "\n".join(f"def f{i}(x):\n    return x * {i} + {rng.randint(0, 9)}" for i in range(n))


def test_dsir_weights_match_a_direct_count_and_select_like_the_target(tmp_path):
    import random

    rng = random.Random(0)
    pool = [(f"web{i}", prose(rng, 120)) for i in range(40)] + [(f"code{i}", code_snippet(rng, 8)) for i in range(10)]
    _write_source(tmp_path / "pool", "", [text for _, text in pool])
    _write_source(tmp_path / "target", "t", [code_snippet(rng, 8) for _ in range(5)])

    target = [encode_document(code_snippet(random.Random(n), 8))[1:] for n in range(5)]
    raw = [encode_document(text)[1:] for _, text in pool]
    resampler = ImportanceResampler(target, raw, buckets=1000)
    # the reference: the DSIR log ratio summed feature by feature
    doc = raw[-1]
    unigrams = [int(t) % 1000 for t in doc]
    bigrams = [(int(a) * 1_000_003 + int(b)) % 1000 for a, b in zip(doc, doc[1:])]
    features = Counter(unigrams + bigrams)
    direct = sum(count * resampler.log_ratio[feature] for feature, count in features.items())
    assert resampler.log_weights([doc])[0] == pytest.approx(128 * direct / sum(features.values()))
    assert hashed_ngram_counts(doc, 1000).sum() == 2 * len(doc) - 1

    budget = 1500
    uniform = mix_sources({"pool": (tmp_path / "pool", 1.0)}, budget, tmp_path / "uniform", seed=0)
    dsir = mix_sources({"pool": (tmp_path / "pool", 1.0)}, budget, tmp_path / "dsir", seed=0,
                       target=tmp_path / "target")
    assert dsir[0].selection == "dsir" and uniform[0].selection == "uniform"

    def code_fraction(directory):
        index = [e for p in sorted(directory.glob("*.bin")) for e in read_index(p)["documents"]]
        tokens = np.concatenate([read_shard(p) for p in sorted(directory.glob("*.bin"))])
        texts = [tokens[e["offset"]:e["offset"] + e["length"]] for e in index]
        return np.mean(["def " in gpt2_encoding().decode(t.tolist()) for t in texts])

    assert code_fraction(tmp_path / "dsir") > 0.9 > 0.5 > code_fraction(tmp_path / "uniform")


def test_cli_run_stats_purge_end_to_end(sample, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO / "lib")}
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "distlab.data.cli", "run", *map(str, sample.files[:2]),
                           "--out", str(out), "--no-progress", "--shard-tokens", "5000", "--toxicity", "blocklist"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "documents in" in done.stdout and "line_dedup" in done.stdout
    stats = json.loads(run_file(out, "stats.json").read_text())
    assert stats["documents_in"] == stats["kept"] + sum(stats["rejected"].values())
    assert run_file(out, "stats.csv").read_text().startswith("kind,name,docs_in")
    assert data_main(["stats", str(out), "--format", "json"]) == 0
    assert data_main(["purge", str(out), "--source", "generated-01.warc.wet.gz"]) == 0
    lineage = read_jsonl(run_file(out, "lineage.jsonl"))
    assert lineage and all(row["source"] != "generated-01.warc.wet.gz" for row in lineage)
    assert data_main(["purge", str(out)]) == 2  # nothing to purge by: refused

    reader, writer = os.pipe()
    os.close(reader)  # a reader that went away, as `| head` does
    closed = subprocess.run([sys.executable, "-m", "distlab.data.cli", "stats", str(out), "--format", "json"],
                            stdout=writer, stderr=subprocess.PIPE, text=True, env=env, timeout=120)
    os.close(writer)
    assert closed.returncode == 0 and closed.stderr == ""


@pytest.mark.parametrize("argv,message", [
    (["run", "{tmp}/missing.warc.gz", "--out", "{tmp}/out"], "input not found"),
    (["run", "{tmp}", "--out", "{tmp}/out"], "input is not a file"),
    (["run", "{file}", "--out", "{tmp}/out", "--blocklist", "{tmp}/no-list.txt"], "blocklist not found"),
    (["run", "{file}", "--out", "{tmp}/out", "--bands", "100"], "bands x rows must equal"),
    (["stats", "{tmp}/out"], "no such directory"),
    (["purge", "{tmp}/out", "--url", "x"], "no such directory"),
    (["mix", "--source", "web={tmp}", "--budget", "10", "--out", "{tmp}/out"], "NAME=DIR:WEIGHT"),
    (["mix", "--source", "web={tmp}/nowhere:1", "--budget", "10", "--out", "{tmp}/out"], "not found"),
])
def test_cli_mistakes_are_one_line_exit_2_and_write_nothing(tmp_path, capsys, argv, message):
    file = tmp_path / "input.warc.gz"
    file.write_bytes(b"")
    argv = [arg.format(tmp=tmp_path, file=file) for arg in argv]
    assert data_main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_an_empty_input_is_a_warning_not_silence(tmp_path):
    empty = tmp_path / "empty.warc.gz"
    empty.write_bytes(b"")
    report = run_pipeline([empty], tmp_path / "out", BLOCKLIST)
    assert report.documents_in == 0
    assert any("empty file" in warning for warning in report.warnings)
    assert "warning: no documents were read" in report.table()


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data (real Common Crawl samples) not present")
def test_real_common_crawl_samples(tmp_path):
    files = sorted((SHARED / "crawl").glob("*.gz")) + sorted((SHARED / "commoncrawl").glob("*one-page*.gz"))
    report = run_pipeline(files, tmp_path, PipelineConfig())
    report.check_balance()
    assert report.documents_in >= 38 and report.kept >= 1
    assert report.rejected["url_dedup:url_duplicate"] >= 1  # allenai.org is crawled three times
