"""Shared test set-up: offline tokenizer files, and a guard that no rank process outlives a test."""

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from processes import rank_processes, shared_ranks_end_here

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

if "TIKTOKEN_CACHE_DIR" not in os.environ and (SHARED / "tiktoken_cache").is_dir():
    os.environ["TIKTOKEN_CACHE_DIR"] = str(SHARED / "tiktoken_cache")


@pytest.fixture
def one_thread():
    """Tiny ops run fastest on one thread, and stay fast on a loaded machine; restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", autouse=True)
def warm_groups_end_with_their_module():
    """Warm groups (``Ranks.shared``, ``launch(warm=True)``, the checkers' too) serve a module's tests, so a rank
    start is paid once per module; they end with it, and no rank may be left. Without this a module whose checks
    left warm ranks behind failed the next module's ``no_leftover_ranks`` (a fresh machine's make test once did,
    on three idle ranks of a 3-rank check), and whether a test passed depended on which tests ran before it."""
    yield from shared_ranks_end_here()


@pytest.fixture
def no_leftover_ranks():
    """Fail the test if any rank process is still alive shortly after it ends."""
    yield
    deadline = time.monotonic() + 5
    while rank_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    left = rank_processes()
    assert not left, f"rank processes left behind: {[(p.pid, p.name()) for p in left]}"


def _interrupt_disposition():
    return signal.getsignal(signal.SIGINT), frozenset(signal.pthread_sigmask(signal.SIG_BLOCK, []))


_SESSION_INTERRUPTS = _interrupt_disposition()


@pytest.fixture(autouse=True)
def interrupts_left_as_found():
    """Every test leaves Ctrl-C as it found it: the SIGINT handler and the blocked signals. A process that ignores
    or blocks SIGINT passes that on to every process it starts, so a later test's "interrupt a launch" would
    wait out its ranks instead (a make test once failed that way, far from the test that changed it)."""
    yield
    after = _interrupt_disposition()
    assert after == _SESSION_INTERRUPTS, (f"SIGINT's handler and mask are {after} after this test (or a fixture of "
                                          f"its module), not {_SESSION_INTERRUPTS} as the session began")


@pytest.fixture(autouse=True)
def references_are_right_answers(request, monkeypatch):
    """Tests prove a checker right by handing it the library's own answer (and wrong answers built on it), which
    `distlab.check` scores 0 for a student (`grading/integrity.py`). Here that detection is off, except in tests
    marked `pass_through`, which test it."""
    if request.node.get_closest_marker("pass_through") is None:
        from distlab import grading

        monkeypatch.setattr(grading, "reference_use", lambda student_code, references: None)


# The modules that take longest, in the order `make test`'s workers should start them (pytest-xdist hands out whole
# modules, in the order they are collected): started last, one of them would end the run alone on one worker.
LONGEST_FIRST = ("test_notebooks.py", "test_data_ray.py", "test_instructor_guide.py", "test_cluster.py",
                 "test_launcher_faults.py", "test_fresh_machine.py", "test_browser.py", "test_launcher.py",
                 "test_grading_class.py", "test_gpu_check.py", "test_ddp.py", "test_payload.py")

# Tests whose parameters may each run on whichever worker is free, beside the rest of their module: shares of a long
# test (the generated labs are graded in two shares, the reference seeds lab by lab).
RUN_APART = ("tests/test_notebooks.py::test_generated_labs_grade_zero_and_run_to_the_end",
             "tests/grading/test_reference_seeds.py::"
             "test_each_reference_passes_under_another_seed_and_its_cases_cover_its_edges")


def scope_of(nodeid: str) -> str:
    """The unit ``make test`` hands a worker a test in: its module, or the test itself when it is in RUN_APART."""
    return nodeid if nodeid.split("[", 1)[0] in RUN_APART else nodeid.split("::", 1)[0]


def pytest_xdist_make_scheduler(config, log):
    """Under ``make test`` (``-n …``) a test module runs whole on one worker, so its module-scoped fixtures (warm
    ranks, a Ray cluster, a graded class) start once, as in a serial run. Our own scheduler, not ``--dist loadgroup``:
    pytest 9.2 reads a test's id from a field pytest-xdist 3.8's ``xdist_group`` does not rewrite, so the groups
    silently fell apart and each worker set up the same module fixtures again (the forgery suite graded its 24
    notebooks twice, 50 s each)."""
    from xdist.scheduler import LoadScopeScheduling  # noqa: PLC0415  only a run with workers has a scheduler

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    return ModuleScheduling(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The longest modules go first (``LONGEST_FIRST``); within a module, the order the tests are written in."""
    def rank(item):
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable
