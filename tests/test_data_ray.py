"""Lab 10's pipeline on Ray (``--engine ray``): a two-node Ray cluster on this machine gives the local engine's answer
byte for byte on real Common Crawl pages, survives a worker killed mid-file and a driver killed mid-run, and its
runs can be purged.

One cluster (two nodes of one CPU each, started with ``ray.cluster_utils.Cluster``) serves the module; the last
fixture step proves that none of its processes outlive it.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

from distlab.data.lineage import purge, read_jsonl
from distlab.data.output import LINEAGE_FILE, REJECTED_FILE, WORK_DIR, RunDirectory
from distlab.data.phases import file_key
from distlab.data.pipeline import PipelineConfig, run_pipeline
from distlab.data.ray_engine import RayEngine
from distlab.data.read import parse_wet
from distlab.data.samples import SampleRecord, edit_words, truncate_file, write_records
from distlab.runtime import progress

ray = pytest.importorskip("ray", reason="Ray is in the test extra (pip install -e '.[test]'); the engine needs it")

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
CONFIG = PipelineConfig(shard_tokens=4000, toxicity="blocklist")  # no scikit-learn import in every Ray worker
RAY_PROCESSES = ("raylet", "gcs_server", "ray::", "plasma", "dashboard", "runtime_env", "log_monitor", "monitor.py")

pytestmark = pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data (real Common Crawl samples) not present")


def ray_processes() -> list[psutil.Process]:
    """The Ray processes this test session started (the cluster's daemons and workers are its descendants)."""
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            command = " ".join(proc.cmdline())
            if proc.status() != psutil.STATUS_ZOMBIE and any(name in command for name in RAY_PROCESSES):
                found.append(proc)
        except psutil.NoSuchProcess:
            pass
    return found


# What Ray adds below its root for its longest socket: /ray-XXXXXXXX (the fixture's folder),
# /session_2026-11-29_11-14-51_403943_<pid up to 7 digits>, /sockets/plasma_store.1.
_RAY_SOCKET_SUFFIX = len("/ray-XXXXXXXX") + len("/session_2026-11-29_11-14-51_403943_4194304") + len(
    "/sockets/plasma_store.1")


def short_temp_root() -> str:
    """The machine's temporary folder, or ``/tmp`` where that path is too long (macOS's ``/var/folders/…``, a
    fresh machine's scratch folder): Ray's socket paths, made under it, must fit in 107 bytes (``man 7 unix``)."""
    temp = tempfile.gettempdir()
    return temp if len(os.fsencode(temp)) + _RAY_SOCKET_SUFFIX <= 107 else "/tmp"


@pytest.fixture(scope="module")
def cluster():
    """Two nodes in a Ray root of the module's own, as on a machine that never ran Ray.

    ``Cluster`` writes the head's address to ``ray/ray_current_cluster`` under Ray's *default* root
    (``$RAY_TMPDIR``, else ``$TMPDIR`` on Linux, else ``/tmp``: ``ray._private.utils.write_ray_address``) even
    when the nodes are given a ``temp_dir``, and fails where that folder does not exist. So the default root is
    pointed at the fixture's own folder for the module, its ``ray/`` made here, and both removed afterwards:
    nothing is read from, or left in, the machine's ``/tmp/ray``."""
    from ray.cluster_utils import Cluster

    temp = tempfile.mkdtemp(prefix="ray-", dir=short_temp_root())
    os.mkdir(os.path.join(temp, "ray"))
    before = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = temp
    node = {"num_cpus": 1, "object_store_memory": 100 * 2**20, "temp_dir": temp}
    started = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False, "no_monitor": True})
    started.add_node(**node)
    ray.init(address=started.address, log_to_driver=False, logging_level="ERROR")
    try:
        yield started
    finally:
        ours = ray_processes()  # before shutdown: Ray's agents outlive their raylet briefly, reparented to init
        ray.shutdown()
        started.shutdown()
        if before is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = before
        _, left = psutil.wait_procs(ours, timeout=15)
        for proc in left:  # an agent that did not follow its raylet: ours, so end it (and say so below)
            proc.kill()
        psutil.wait_procs(left, timeout=5)
        shutil.rmtree(temp, ignore_errors=True)
        assert not [proc for proc in ours if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE]
        assert not left, f"Ray processes outlived the cluster's shutdown by 15 s: {[p.pid for p in left]}"


@pytest.fixture(scope="module")
def crawl(tmp_path_factory) -> list[Path]:
    """Real pages: two Dolma WARC samples, a Common Crawl WET page, a cut copy of a Common Crawl WARC (corrupt: its
    last records are lost, the others read), and a mirror of the first sample's pages - rewritten URLs, a later
    crawl date, 2% of the words edited - made here, labelled as such, so near dedup has clusters to resolve."""
    directory = tmp_path_factory.mktemp("crawl")
    files = []
    for name in ("crawl/dolma_sample-0000.warc.gz", "crawl/dolma_sample-0001.warc.gz",
                 "commoncrawl/CC-MAIN-2024-22-one-page.warc.wet.gz"):
        files.append(Path(shutil.copy(SHARED / name, directory)))
    cut = Path(shutil.copy(SHARED / "commoncrawl/CC-MAIN-2020-34-head.warc.gz", directory / "cut-CC-MAIN.warc.gz"))
    truncate_file(cut, keep_fraction=0.6)
    rng = random.Random(0)
    pages = [doc for doc in parse_wet(files[0]) if len(doc.text.split()) > 150][:12]
    mirror = [SampleRecord("mirror", edit_words(rng, doc.text, 0.02), f"https://mirror.example/copy/{i}",
                           f"<urn:uuid:00000000-0000-4000-8000-{i:012d}>", date="2030-01-01T00:00:00Z")
              for i, doc in enumerate(pages)]
    write_records(directory / "mirror-of-dolma-0000.warc.wet.gz", mirror)
    return [*files, directory / "mirror-of-dolma-0000.warc.wet.gz", cut]


@pytest.fixture(scope="module")
def reference(crawl, tmp_path_factory):
    out = tmp_path_factory.mktemp("local")
    return run_pipeline(crawl, out, CONFIG), out


def outputs(out: Path) -> dict:
    """Everything a run's answer consists of, as bytes: shards (and indexes), lineage, rejections."""
    run = RunDirectory(out)
    files = {path.name: path.read_bytes() for path in sorted((run.current() / "shards").iterdir())}
    return {**files, **{name: run.file(name).read_bytes() for name in (LINEAGE_FILE, REJECTED_FILE)}}


def answer(report) -> dict:
    """A report without its timings: what two engines must agree on."""
    return {"documents_in": report.documents_in, "kept": report.kept, "rejected": dict(report.rejected),
            "tokens": report.tokens, "shards": report.shards, "warnings": report.warnings,
            "stages": [(s.name, s.docs_in, s.docs_out, dict(s.counters)) for s in report.stages]}


def test_the_cluster_keeps_its_address_in_a_root_of_its_own(cluster):
    """What failed on a fresh machine: the address file goes to the module's Ray root, never the machine's."""
    from ray._common.utils import get_ray_address_file

    address_file = Path(get_ray_address_file(None))
    assert address_file.read_text().strip() == cluster.gcs_address
    assert address_file.parent == Path(os.environ["RAY_TMPDIR"], "ray") != Path(tempfile.gettempdir(), "ray")


def test_two_nodes_give_the_local_answer_byte_for_byte_and_purge_alike(cluster, crawl, reference, tmp_path):
    local, local_out = reference
    assert [node["Resources"]["CPU"] for node in ray.nodes() if node["Alive"]] == [1.0, 1.0]
    out = tmp_path / "ray"
    report = run_pipeline(crawl, out, CONFIG, engine="ray")
    report.check_balance()
    assert answer(report) == answer(local)
    assert outputs(out) == outputs(local_out)
    # every distributed step had work to do on these pages
    assert report.rejected["near_dedup:near_duplicate"] >= 5 and report.rejected["url_dedup:url_duplicate"] >= 1
    assert next(s for s in report.stages if s.name == "line_dedup").counters["lines_removed"] > 0
    assert report.rejected["read:truncated"] == 1 and report.kept > 20  # the cut file cost its last record only
    mirrors = [row for row in read_jsonl(RunDirectory(out).file(REJECTED_FILE))
               if row["reason"] == "near_dedup:near_duplicate"]
    assert all(row["url"].startswith("https://mirror.example/") for row in mirrors)  # the later crawl goes

    # purge works on a run of either engine, and leaves the same bytes
    shutil.copytree(local_out, tmp_path / "local")
    victim = read_jsonl(RunDirectory(out).file(LINEAGE_FILE))[5]
    for run in (out, tmp_path / "local"):
        result = purge(run, urls=[victim["url"]])
        assert result.verified and result.purged == {"purge:url": 1}
    assert outputs(out) == outputs(tmp_path / "local")
    assert victim["id"] not in {row["id"] for row in read_jsonl(RunDirectory(out).file(LINEAGE_FILE))}


def test_a_worker_killed_mid_file_is_retried_without_double_counting(cluster, crawl, reference, tmp_path):
    local, local_out = reference
    done = {}
    runner = threading.Thread(target=lambda: done.update(report=run_pipeline(crawl, tmp_path, CONFIG, engine="ray")))
    runner.start()
    killed, deadline = None, time.monotonic() + 120
    while killed is None and runner.is_alive() and time.monotonic() < deadline:
        for proc in ray_processes():
            try:
                if proc.cmdline()[0].startswith("ray::process_file"):  # Ray titles a worker by its running task
                    proc.send_signal(signal.SIGKILL)
                    killed = proc.pid
                    break
            except (psutil.NoSuchProcess, IndexError):
                pass
        time.sleep(0.01)
    runner.join(timeout=300)
    assert killed is not None, "no phase-1 task was seen running: nothing was killed"
    report = done["report"]
    assert not psutil.pid_exists(killed) or psutil.Process(killed).status() == psutil.STATUS_ZOMBIE
    assert report.files_processed == len(crawl) and answer(report) == answer(local)
    assert outputs(tmp_path) == outputs(local_out)


def test_an_interrupted_run_resumes_from_its_finished_files(cluster, crawl, reference, tmp_path):
    """Ctrl-C (a real SIGINT to this process) as soon as one file is finished: nothing is committed, and the run
    started again does only the files that were not finished by then."""
    local, local_out = reference

    def interrupt_after_one_file():
        deadline = time.monotonic() + 120
        while not (finished := len(list((tmp_path / WORK_DIR).glob("*/done.json")))) and time.monotonic() < deadline:
            time.sleep(0.005)
        if finished < len(crawl):  # still in phase 1 (else the run is not interrupted, and pytest.raises says so)
            os.kill(os.getpid(), signal.SIGINT)

    watcher = threading.Thread(target=interrupt_after_one_file)
    watcher.start()
    with pytest.raises(KeyboardInterrupt):
        run_pipeline(crawl, tmp_path, CONFIG, engine="ray")
    watcher.join()
    assert RunDirectory(tmp_path).manifest() is None  # nothing was committed
    report = run_pipeline(crawl, tmp_path, CONFIG, engine="ray")
    assert report.files_resumed >= 1 and report.files_processed >= 1
    assert report.files_resumed + report.files_processed == len(crawl)
    assert answer(report) == answer(local) and outputs(tmp_path) == outputs(local_out)


def test_phase_one_shows_its_bar_of_files_where_a_person_watches_and_none_headless(cluster, crawl, tmp_path,
                                                                                    monkeypatch, capfd):
    one_page = [path for path in crawl if "one-page" in path.name]
    with RayEngine() as engine:  # the module's cluster, already connected: the engine neither starts nor stops it
        headless = list(engine.phase_one(one_page, tmp_path / "headless", CONFIG))
        assert capfd.readouterr() == ("", "")  # pytest is headless, as nbval and CI
        monkeypatch.setattr(progress, "audience", lambda: "terminal")
        watched = list(engine.phase_one(one_page, tmp_path / "watched", CONFIG))
    assert [(s["documents_in"], s["rejected"]) for s in watched] == [(s["documents_in"], s["rejected"])
                                                                      for s in headless]
    assert (tmp_path / "watched" / file_key(one_page[0]) / "done.json").is_file()
    drawn = capfd.readouterr().err.replace("\r", "\n")
    assert re.search(r"phase 1 · input files: 100%\|.*\| 1/1 \[", drawn), drawn

