"""The instructor guide is run as written: every command in its ``bash`` blocks, in a scratch class.

The scratch folder looks like a clone with a class in it: the repository's Makefile, pyproject and
installed ``.venv`` (so ``make install`` is the no-op it is on a set-up machine) and
``submissions/<student>/`` with one finished lab 00 (the solution) and one blank one (the lab as
handed out). The grade command must rank them: one passes, one does not.
"""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GUIDE = REPO / "course" / "instructor_guide.md"
BASH_BLOCK = re.compile(r"^[ \t]*```bash\n(.*?)^[ \t]*```", re.MULTILINE | re.DOTALL)


def guide_commands() -> list[str]:
    return [line.strip() for block in BASH_BLOCK.findall(GUIDE.read_text(encoding="utf-8"))
            for line in block.splitlines() if line.strip() and not line.strip().startswith("#")]


def test_the_guide_has_commands_for_checking_installing_and_grading():
    commands = guide_commands()
    assert any(c.startswith("distlab doctor") for c in commands)
    assert any("make install" in c for c in commands)
    assert any(c.startswith("distlab grade") for c in commands)


@pytest.fixture
def scratch_class(tmp_path):
    for name in ("Makefile", "pyproject.toml", "requirements.lock", "lib", ".venv"):
        (tmp_path / name).symlink_to(REPO / name)
    for student, source in (("alice", REPO / "solutions"), ("bob", REPO / "labs")):
        (tmp_path / "submissions" / student).mkdir(parents=True)
        shutil.copy(source / "00_setup.ipynb", tmp_path / "submissions" / student)
    return tmp_path


@pytest.mark.timeout(900)
def test_every_command_in_the_guide_runs_as_written(scratch_class, no_leftover_ranks):
    env = {**os.environ, "PATH": f"{REPO / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    for command in guide_commands():
        done = subprocess.run(["bash", "-c", command], cwd=scratch_class, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, (f"`{command}` exited {done.returncode}:\n"
                                      f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    report = json.loads((scratch_class / "grades.json").read_text())
    passed = {n["student"]: n["passed"] for n in report["notebooks"]}
    assert passed == {"alice": True, "bob": False}, passed
