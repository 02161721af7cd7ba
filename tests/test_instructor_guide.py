"""The instructor guide is run as written: every command in its ``bash`` blocks, in a scratch class.

The scratch folder looks like a clone with a class in it: the repository's Makefile, pyproject and
installed ``.venv`` (so ``make install`` is the no-op it is on a set-up machine),
``submissions/<student>/`` with one finished lab 00 (the solution), one blank one (the lab as handed out)
and one with exercise 0.2 wrong, and the LMS's ``submission_times.csv`` (carol submitted late). The grade
command must rank them: one passes. Before the term's ``--changed`` command carol resubmits a fixed
notebook: exactly hers is regraded, and every export shows the class.
"""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import nbformat
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
    for name in ("Makefile", "pyproject.toml", "requirements.lock", "lib", "labs", ".venv"):
        (tmp_path / name).symlink_to(REPO / name)
    for student, source in (("alice", REPO / "solutions"), ("bob", REPO / "labs"), ("carol", REPO / "solutions")):
        (tmp_path / "submissions" / student).mkdir(parents=True)
        shutil.copy(source / "00_setup.ipynb", tmp_path / "submissions" / student)
    _edit(tmp_path / "submissions" / "carol" / "00_setup.ipynb", RIGHT, WRONG)
    (tmp_path / "submission_times.csv").write_text(
        "student,submitted\nalice,2026-11-30T10:00:00\nbob,2026-12-01T23:00:00+00:00\ncarol,2026-12-02T09:15:00\n")
    return tmp_path


RIGHT, WRONG = "return total / dist.get_world_size()", "return total"  # exercise 0.2: the mean, or the sum


def _edit(path: Path, old: str, new: str) -> None:
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        cell.source = cell.source.replace(old, new)
    nbformat.write(nb, path)


@pytest.mark.timeout(900)
def test_every_command_in_the_guide_runs_as_written(scratch_class, no_leftover_ranks):
    env = {**os.environ, "PATH": f"{REPO / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    for command in guide_commands():
        if "--changed" in command:  # carol resubmits, fixed, before the regrade
            _edit(scratch_class / "submissions" / "carol" / "00_setup.ipynb", WRONG, RIGHT)
        done = subprocess.run(["bash", "-c", command], cwd=scratch_class, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, (f"`{command}` exited {done.returncode}:\n"
                                      f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        if "--changed" in command:
            regrade = done
        elif "--json grades.json" in command:
            first = done
    # The first grading: lab 00's real notebooks, correct (alice, the solution), blank (bob, the generated lab) and
    # wrong (carol, exercise 0.2 returning the sum), graded together, each marked for what it is.
    report = json.loads((scratch_class / "grades.json").read_text())
    by = {n["student"]: n for n in report["notebooks"]}
    assert {s: n["passed"] for s, n in by.items()} == {"alice": True, "bob": False, "carol": False}, by
    assert by["alice"]["rank"] == 1 and by["alice"]["cell_errors"] == [] and report["notebooks_passed"] == 1
    assert {e["status"] for e in by["bob"]["exercises"]} == {"not attempted"} and by["bob"]["error"] is None
    failed = {e["id"]: e for e in by["carol"]["exercises"] if e["status"] == "failed"}
    assert list(failed) == ["0.2"] and "divide by the world size" in failed["0.2"]["detail"]
    assert "carol  0.2: rank 0, element 0" in first.stdout, first.stdout[-2000:]
    term = json.loads((scratch_class / "term.json").read_text())
    by = {n["student"]: n for n in term["notebooks"]}
    assert {s: (n["passed"], n["reused"], n["late"]) for s, n in by.items()} == {
        "alice": (True, True, False), "bob": (False, True, False), "carol": (True, False, True)}
    assert re.search(r"^graded 1 in \d+ s; 2 unchanged$", regrade.stdout, re.MULTILINE), regrade.stdout[-2000:]
    rows = (scratch_class / "grades.csv").read_text().splitlines()
    assert rows[0].startswith("student,lab,points,max_points,passed,late,submitted,0.1,0.2,")
    assert [r.split(",")[:2] for r in rows[1:]] == [["alice", "0"], ["bob", "0"], ["carol", "0"]]
    scope = json.loads((scratch_class / "gradescope" / "00_setup" / "carol" / "results.json").read_text())
    assert scope["score"] == by["carol"]["points"] and "after the deadline" in scope["output"]
    assert {t["number"] for t in scope["tests"]} >= {"0.1", "0.2", "Q0.1"}
    feedback = (scratch_class / "feedback" / "bob" / "00_setup.md").read_text()
    assert feedback.startswith("# bob: lab 00") and "· Exercise 0.2 " in feedback and "[answer" not in feedback
