"""``make test`` runs the suite as a fresh machine would (``tests/fresh_machine.py``): proved here by planting the
leftovers that made an earlier release pass on our machines and fail on a new one, running a part of the suite
through the runner, and checking that the part neither saw them nor changed anything outside its scratch folder."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fresh_machine import PREFIX, fresh_environment

REPO = Path(__file__).resolve().parents[1]
RUNNER = REPO / "tests" / "fresh_machine.py"


def test_every_machine_wide_location_moves_into_the_scratch_folder_and_a_shells_settings_are_dropped(tmp_path):
    machine = {"HOME": "/home/student", "TMPDIR": "/var/tmp", "PATH": "/usr/bin", "OMP_NUM_THREADS": "3",
               "DISTLAB_BACKEND": "nccl", "RANK": "3", "WORLD_SIZE": "8", "MASTER_PORT": "29500",
               "JUPYTER_PATH": "/opt/jupyter", "XDG_CACHE_HOME": "/home/student/.cache", "RAY_ADDRESS": "auto",
               "TORCHINDUCTOR_CACHE_DIR": "/home/student/.inductor", "FTLANG_CACHE": "/home/student/.ft"}
    env = fresh_environment(tmp_path, machine)
    moved = ("HOME", "TMPDIR", "TMP", "TEMP", "RAY_TMPDIR", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME",
             "XDG_STATE_HOME", "XDG_RUNTIME_DIR", "JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR",
             "IPYTHONDIR", "MPLCONFIGDIR")
    assert all(Path(env[name]).is_relative_to(tmp_path) for name in moved), env
    assert not {"DISTLAB_BACKEND", "RANK", "WORLD_SIZE", "MASTER_PORT", "JUPYTER_PATH", "RAY_ADDRESS",
                "TORCHINDUCTOR_CACHE_DIR", "FTLANG_CACHE"} & env.keys()
    # kept: the hardware's settings, the program path, and pip's download cache (it only saves downloads)
    assert env["PATH"] == "/usr/bin" and env["OMP_NUM_THREADS"] == "3" and env["PYTHONNOUSERSITE"] == "1"
    assert env["PIP_CACHE_DIR"] == "/home/student/.cache/pip"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "run", "tmp"]


def tree(root: Path) -> dict[str, tuple]:
    """Every path under ``root`` with its size and modification time: what a run must leave exactly as it was."""
    return {str(p.relative_to(root)): (p.is_dir(), p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


@pytest.mark.timeout(600)
def test_a_part_of_the_suite_run_fresh_sees_no_leftovers_and_leaves_nothing_behind(tmp_path):
    """A machine whose temporary folder holds the ``ray/`` folder an earlier ``ray.init()`` left (with a stale
    cluster address in it) and whose home holds an IPython startup file (every kernel would run it): the Ray
    fixture that once failed only where ``/tmp/ray`` was missing, and a grading run that starts a kernel and
    ranks, pass through the runner, and neither folder changes (without the runner, the fixture writes its
    address over the stale one and each kernel runs the startup file, which leaves a mark in the home)."""
    machine_tmp, machine_home = tmp_path / "tmp", tmp_path / "home"
    (machine_tmp / "ray").mkdir(parents=True)
    (machine_tmp / "ray" / "ray_current_cluster").write_text("127.0.0.1:1")  # a cluster long gone
    startup = machine_home / ".ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True)
    (startup / "00-leftover.py").write_text(f"open({str(machine_home / 'a-leftover-startup-file-ran')!r}, 'w')\n")
    before = {"tmp": tree(machine_tmp), "home": tree(machine_home)}
    env = {**os.environ, "TMPDIR": str(machine_tmp), "HOME": str(machine_home)}
    part = ["tests/test_data_ray.py::test_the_cluster_keeps_its_address_in_a_root_of_its_own",
            "tests/test_notebooks.py::test_a_notebook_with_a_deleted_check_scores_that_exercise_as_not_run"]
    done = subprocess.run([sys.executable, str(RUNNER), "--", sys.executable, "-m", "pytest", "-q",
                           "-p", "no:cacheprovider", *part], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=540)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "2 passed" in done.stdout, done.stdout[-2000:]
    assert {"tmp": tree(machine_tmp), "home": tree(machine_home)} == before  # scratch removed, leftovers untouched
    assert not [p for p in machine_tmp.iterdir() if p.name.startswith(PREFIX)]


def test_a_failed_run_keeps_its_scratch_folder_and_says_where(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, str(RUNNER), "--", sys.executable, "-c",
                           "import os, tempfile, sys; open(os.path.join(tempfile.gettempdir(), 'left'), 'w');"
                           "sys.exit(3)"], env=env, capture_output=True, text=True, timeout=60)
    kept = [p for p in tmp_path.iterdir() if p.name.startswith(PREFIX)]
    assert done.returncode == 3 and len(kept) == 1 and (kept[0] / "tmp" / "left").is_file()
    assert f"its scratch folder is kept: {kept[0]}" in done.stderr
    assert subprocess.run([sys.executable, str(RUNNER)], capture_output=True, text=True).returncode == 2


def test_a_run_started_with_ctrl_c_ignored_gets_it_back(tmp_path):
    """A script's background job (`make test &`) starts with SIGINT ignored, which exec passes on: the runner gives
    the suite a person's Ctrl-C, so the interrupt tests test the launcher, not how the suite was started."""
    shown = "import signal; print(signal.getsignal(signal.SIGINT), signal.pthread_sigmask(signal.SIG_BLOCK, []))"
    done = subprocess.run([sys.executable, str(RUNNER), "--", sys.executable, "-c", shown], capture_output=True,
                          text=True, env={**os.environ, "TMPDIR": str(tmp_path)}, timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "<built-in function default_int_handler> set()", done.stdout
