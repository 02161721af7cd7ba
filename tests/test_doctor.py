"""`distlab doctor`: one ✓/✗/! line per check, hints on problems, exit status 1 only on a failure."""

import pytest

from distlab import doctor
from distlab.doctor import FAIL, OK, WARN, Check


def test_parse_version():
    assert doctor.parse_version("2.13.0+cpu") == (2, 13, 0)
    assert doctor.parse_version("2.8.0a0+git1234") == (2, 8, 0)
    assert doctor.parse_version("3") == (3,)
    assert doctor.parse_version("nightly") == ()


def test_every_check_runs_here_and_nothing_fails():
    checks = doctor.run_doctor(launch=True)
    names = [c.name for c in checks]
    assert names == ["Python", "torch", "CPU cores", "CUDA GPUs", "NCCL", "gloo", "2-rank all-reduce",
                     "free port", "/dev/shm", "notebooks"]
    assert all(c.status in (OK, WARN) for c in checks), [c.line() for c in checks if c.status == FAIL]
    launch = checks[names.index("2-rank all-reduce")]
    assert launch.status == OK and "gloo, correct" in launch.detail and " s including start-up" in launch.detail


def test_main_prints_one_line_per_check(capsys):
    assert doctor.main(["--no-launch"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 10  # nine checks without the launch, then the verdict
    assert all(line[0] in "✓!✗" for line in lines[:-1])
    assert lines[-1].startswith("Ready for the labs")


def test_old_torch_fails_with_a_hint(monkeypatch):
    import torch

    monkeypatch.setattr(torch, "__version__", "2.4.1+cu121")
    check = doctor.check_torch()
    assert check.status == FAIL and "need >= 2.8" in check.detail
    assert check.line() == "✗ torch              2.4.1+cu121 (need >= 2.8)  → pip install -U 'torch>=2.8'"


def test_failure_sets_exit_status_and_verdict(monkeypatch, capsys):
    monkeypatch.setattr(doctor, "CHECKS", [doctor.check_python,
                                           lambda: Check("gloo", FAIL, "missing", "install torch from pytorch.org")])
    assert doctor.main(["--no-launch"]) == 1
    out = capsys.readouterr().out
    assert "✗ gloo               missing  → install torch from pytorch.org" in out
    assert out.rstrip().endswith("1 problem to fix before the labs will run.")


def test_a_crashing_check_is_reported_not_raised(monkeypatch):
    def check_broken():
        raise OSError("no such thing")

    monkeypatch.setattr(doctor, "CHECKS", [check_broken])
    [result] = doctor.run_doctor()
    assert result.status == FAIL and result.name == "broken" and "OSError: no such thing" in result.detail


def test_small_shm_warns(monkeypatch):
    import os
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("/dev/shm is Linux-only")

    class Small:
        f_frsize, f_blocks, f_bavail = 4096, 16384, 16000  # 64 MiB, Docker's default

    monkeypatch.setattr(os, "statvfs", lambda path: Small)
    check = doctor.check_shm()
    assert check.status == WARN and "--shm-size" in check.hint and check.line().startswith("! /dev/shm")


def test_warnings_show_their_hint_and_ok_lines_do_not():
    assert "→" not in Check("x", OK, "fine", "unused hint").line()
    assert Check("x", WARN, "meh", "do this").line().endswith("→ do this")


def test_lock_drift_compares_only_the_pins_whose_marker_holds_here(tmp_path, capsys):
    import sys

    import cloudpickle

    from distlab.cli import main

    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    lock = tmp_path / "requirements.lock"
    lock.write_text(
        "# a comment\n"
        f"cloudpickle==0.0.1 ; python_version != '{here}'\n"  # pinned for another Python: not compared
        f"cloudpickle=={cloudpickle.__version__} ; python_version == '{here}'\n"
        "    # via distlab\n"
        "not-installed-anywhere==1.0\n", encoding="utf-8")
    assert main(["lock-drift", str(lock)]) == 0
    assert capsys.readouterr().out.strip() == f"0 package(s) differ from {lock}"
    lock.write_text("cloudpickle==0.0.1\n", encoding="utf-8")
    main(["lock-drift", str(lock)])
    assert f"cloudpickle: locked 0.0.1, newest allowed {cloudpickle.__version__}" in capsys.readouterr().out
