"""Shared test set-up: offline tokenizer files, and a guard that no rank process outlives a test."""

import os
import time
from pathlib import Path

import pytest
import torch

from processes import rank_processes

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


@pytest.fixture
def no_leftover_ranks():
    """Fail the test if any rank process is still alive shortly after it ends."""
    yield
    deadline = time.monotonic() + 5
    while rank_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    left = rank_processes()
    assert not left, f"rank processes left behind: {[(p.pid, p.name()) for p in left]}"


@pytest.fixture(autouse=True)
def references_are_right_answers(request, monkeypatch):
    """Tests prove a checker right by handing it the library's own answer (and wrong answers built on it), which
    `distlab.check` scores 0 for a student (`grading/integrity.py`). Here that detection is off, except in tests
    marked `pass_through`, which test it."""
    if request.node.get_closest_marker("pass_through") is None:
        from distlab import grading

        monkeypatch.setattr(grading, "reference_use", lambda student_code, references: None)
