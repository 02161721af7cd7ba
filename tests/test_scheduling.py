"""How ``make test`` hands tests to its workers: a module whole to one worker, so its module-scoped fixtures start
once; a test in ``RUN_APART`` parameter by parameter. Proved on a real pytest-xdist run with the Makefile's flags
(a silent change in pytest once let every module's tests scatter: fixtures set up on both workers)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import RUN_APART, scope_of

REPO = Path(__file__).resolve().parents[1]
PROBE = os.environ.get("DISTLAB_SCHEDULING_PROBE")  # set only by the test below, for the run it starts


@pytest.fixture(scope="module")
def module_setup():
    with open(PROBE, "a") as record:
        record.write(f"setup {os.getpid()}\n")


@pytest.mark.skipif(not PROBE, reason="a probe, run by test_a_module_runs_whole_on_one_worker")
@pytest.mark.parametrize("n", range(6))
def test_probe(module_setup, n):
    with open(PROBE, "a") as record:
        record.write(f"test {os.getpid()}\n")


def test_a_module_runs_whole_on_one_worker(tmp_path):
    makefile = (REPO / "Makefile").read_text()
    flags = re.search(r"\$\(XDIST\) (--dist \S+(?: --no-loadscope-reorder)?) tests", makefile).group(1).split()
    record = tmp_path / "record.txt"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", *flags,
                           "tests/test_scheduling.py::test_probe"], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "DISTLAB_SCHEDULING_PROBE": str(record)})
    assert done.returncode == 0 and "6 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    events = [line.split() for line in record.read_text().splitlines()]
    setups = [pid for kind, pid in events if kind == "setup"]
    assert len(setups) == 1, f"the module's fixture was set up on several workers: {events}"
    assert {pid for kind, pid in events if kind == "test"} == set(setups), events


def test_only_the_tests_run_apart_are_split_from_their_module():
    apart = f"{RUN_APART[0]}[share1]"
    assert scope_of(apart) == apart
    assert scope_of("tests/test_ddp.py::test_x[4]") == "tests/test_ddp.py"
