"""Shared test set-up: offline tokenizer files, and a guard that no rank process outlives a test."""

import os
import signal
import time
from pathlib import Path

import pytest
import torch

import scheduling

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

def pytest_xdist_make_scheduler(config, log):
    """Under ``make test`` (``-n …``) each module runs whole on one worker (:mod:`scheduling`)."""
    return scheduling.make_scheduler(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The longest modules go first (``LONGEST_FIRST``); within a module, the order the tests are written in."""
    def rank(item):
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable
