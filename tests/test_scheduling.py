"""``make test``'s scheduling (:mod:`scheduling`), proved on a real pytest-xdist run with the Makefile's flags: a module
runs whole on one worker (a silent change in pytest once let every module's tests scatter, fixtures set up on both)."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import scheduling
from scheduling import RUN_APART

import conftest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent

# A module of six tests sharing one module fixture; each records which process set it up and ran them.
PROBE = textwrap.dedent("""
    import os
    import pytest

    RECORD = os.environ["SCHEDULING_RECORD"]

    @pytest.fixture(scope="module")
    def module_setup():
        with open(RECORD, "a") as record:
            record.write(f"setup {os.getpid()}\\n")

    @pytest.mark.parametrize("n", range(6))
    def test_probe(module_setup, n):
        with open(RECORD, "a") as record:
            record.write(f"test {os.getpid()}\\n")
""")


def test_a_module_runs_whole_on_one_worker(tmp_path):
    """The suite's scheduler in a conftest of its own (the suite's conftest imports torch, seconds per worker)."""
    (tmp_path / "conftest.py").write_text(f"import sys\nsys.path.insert(0, {str(TESTS)!r})\nimport scheduling\n\n\n"
                                          "def pytest_xdist_make_scheduler(config, log):\n"
                                          "    return scheduling.make_scheduler(config, log)\n")
    (tmp_path / "test_probe.py").write_text(PROBE)
    makefile = (REPO / "Makefile").read_text()
    flags = re.search(r"\$\(XDIST\) (--dist \S+(?: --no-loadscope-reorder)?) tests", makefile).group(1).split()
    record = tmp_path / "record.txt"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", *flags,
                           "test_probe.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "SCHEDULING_RECORD": str(record)})
    assert done.returncode == 0 and "6 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    events = [line.split() for line in record.read_text().splitlines()]
    setups = [pid for kind, pid in events if kind == "setup"]
    assert len(setups) == 1, f"the module's fixture was set up on several workers: {events}"
    assert {pid for kind, pid in events if kind == "test"} == set(setups), events


def test_the_suites_hook_is_this_scheduler_and_only_run_apart_tests_leave_their_module(monkeypatch):
    monkeypatch.setattr(scheduling, "make_scheduler", lambda config, log: ("ours", config, log))
    assert conftest.pytest_xdist_make_scheduler("config", "log") == ("ours", "config", "log")
    apart = f"{RUN_APART[0]}[share1]"
    assert scheduling.scope_of(apart) == apart
    assert scheduling.scope_of("tests/test_ddp.py::test_x[4]") == "tests/test_ddp.py"
