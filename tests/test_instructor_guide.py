"""The instructor guide and the README are run as written, each command from a terminal that activated nothing.

Every ``bash`` block of the guide is typed into a fresh terminal (one bash session per block, with no virtual
environment on PATH, as after a clone and ``make install``), line after line; each line must exit 0. The
README's commands are the guide's (run there) or a command no test can run here, listed below with why.

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
import select
import shutil
import subprocess
import time
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[1]
GUIDE = REPO / "course" / "instructor_guide.md"
README = REPO / "README.md"
BASH_BLOCK = re.compile(r"^[ \t]*```bash\n(.*?)^[ \t]*```", re.MULTILINE | re.DOTALL)
TRAILING_COMMENT = re.compile(r"\s+#\s.*$")
# README commands no test runs as written here, each with the reason; every other README command must be one of
# the guide's, which the test below runs.
NOT_RUN_HERE = {
    "make lab": "opens JupyterLab and waits for the user",
    "make test": "is the whole suite this test is part of",
    "conda env create -f environment.yml": "needs conda, which the course machines do not have",
    "conda activate distlab": "needs conda",
    'python tools/install_torch.py "torch==2.13.0"': ("installs torch into a conda environment; "
                                                      "tests/test_install_torch.py runs its choice with --dry-run"),
    "pip install --no-deps -e .": "installs distlab into a conda environment (make install does it here)",
    'TIKTOKEN_CACHE_DIR="$CONDA_PREFIX/share/distlab/tiktoken_cache" python -c "import tiktoken; '
    'tiktoken.get_encoding(\'gpt2\')"': "fetches GPT-2's files into a conda environment (make install does it here)",
    "jupyter lab labs/": "opens JupyterLab and waits for the user",
    "torchrun --nproc-per-node=8 -m distlab.torchrun distlab.data_parallel:train steps=100":
        "needs 8 GPUs; tests/test_cluster.py runs course/cluster.md's torchrun lines",
    "torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\":
        "needs two nodes; tests/test_cluster.py runs course/cluster.md's torchrun lines",
    "-m distlab.torchrun distlab.data_parallel:train steps=100": "the continuation of the line above",
}


def blocks(path: Path) -> list[list[str]]:
    """Each bash block of ``path``, as the lines a reader types (comments and blank lines left out)."""
    return [[TRAILING_COMMENT.sub("", line.strip()) for line in block.splitlines()
             if line.strip() and not line.strip().startswith("#")]
            for block in BASH_BLOCK.findall(path.read_text(encoding="utf-8"))]


def guide_commands() -> list[str]:
    return [line for block in blocks(GUIDE) for line in block]


def unactivated_environment() -> dict[str, str]:
    """This process's environment without any virtual environment: what a new terminal has after a clone."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "CONDA_PREFIX", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                                  if p and not (Path(p) / "activate").exists() and not (Path(p) / "distlab").exists())
    assert shutil.which("distlab", path=env["PATH"]) is None
    return env


class Terminal:
    """One bash session in which a reader types a block's lines: what a line sets up (an activated venv) stays
    for the next, and each line's status and output are read back."""

    def __init__(self, cwd: Path, env: dict[str, str], logs: Path):
        self.logs, self.count = logs, 0
        self.shell = subprocess.Popen(["bash", "--noprofile", "--norc"], cwd=cwd, env=env, text=True,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def run(self, line: str, timeout: float) -> tuple[int, str]:
        self.count += 1
        log = self.logs / f"line{self.count}.log"
        self.shell.stdin.write(f"{{ {line}\n}} >{log} 2>&1 </dev/null; echo \"__status=$?\"\n")
        self.shell.stdin.flush()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if select.select([self.shell.stdout], [], [], deadline - time.monotonic())[0]:
                answer = self.shell.stdout.readline()
                if answer.startswith("__status="):
                    return int(answer.split("=")[1]), log.read_text(errors="replace")
                if not answer:
                    break
        raise AssertionError(f"`{line}` did not finish within {timeout:.0f} s:\n{log.read_text(errors='replace')}")

    def close(self) -> None:
        self.shell.stdin.close()
        self.shell.wait(timeout=30)


def test_the_guide_has_commands_for_checking_installing_and_grading():
    commands = guide_commands()
    assert any(c.startswith("distlab doctor") for c in commands)
    assert any("make install" in c for c in commands)
    assert any(c.startswith("distlab grade") for c in commands)


def test_every_readme_command_is_run_by_the_guide_test_or_says_why_not():
    run = set(guide_commands())
    readme = [line for block in blocks(README) for line in block]
    unaccounted = [line for line in readme if line not in run and line not in NOT_RUN_HERE]
    assert not unaccounted, ("README commands that no test runs: make each one of the guide's (run below) or add "
                             f"it to NOT_RUN_HERE with the reason: {unaccounted}")
    assert [line for line in readme if line.startswith("distlab grade")], "the README shows no grading command"
    stale = set(NOT_RUN_HERE) - set(readme)
    assert not stale, f"NOT_RUN_HERE lists commands the README no longer has: {stale}"


def test_readme_and_guide_never_call_the_venvs_tools_before_activating_it():
    """A line that runs distlab, jupyter or python in a block that has not activated the venv fails with
    "command not found" on a fresh machine (python: on Debian there is only python3)."""
    for path in (README, GUIDE):
        for block in blocks(path):
            for line in block:
                if line.startswith("source .venv/bin/activate") or line.startswith("conda activate"):
                    break
                tool = line.split()[0]
                assert tool not in ("distlab", "jupyter", "python"), f"{path.name}: `{line}` before activating"


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
def test_every_command_in_the_guide_runs_as_written(scratch_class, no_leftover_ranks, tmp_path):
    env = unactivated_environment()
    logs = tmp_path / "logs"
    logs.mkdir()
    for block in blocks(GUIDE):
        terminal = Terminal(scratch_class, env, logs)
        try:
            for command in block:
                if "--changed" in command:  # carol resubmits, fixed, before the regrade
                    _edit(scratch_class / "submissions" / "carol" / "00_setup.ipynb", WRONG, RIGHT)
                status, output = terminal.run(command, timeout=600)
                assert status == 0, f"`{command}` exited {status}, nothing activated first:\n{output[-3000:]}"
                if "--changed" in command:
                    regrade = output
                elif "--json grades.json" in command:
                    first = output
        finally:
            terminal.close()
    # The first grading: lab 00's real notebooks, correct (alice, the solution), blank (bob, the generated lab) and
    # wrong (carol, exercise 0.2 returning the sum), graded together, each marked for what it is.
    report = json.loads((scratch_class / "grades.json").read_text())
    by = {n["student"]: n for n in report["notebooks"]}
    assert {s: n["passed"] for s, n in by.items()} == {"alice": True, "bob": False, "carol": False}, by
    assert by["alice"]["rank"] == 1 and by["alice"]["cell_errors"] == [] and report["notebooks_passed"] == 1
    assert {e["status"] for e in by["bob"]["exercises"]} == {"not attempted"} and by["bob"]["error"] is None
    failed = {e["id"]: e for e in by["carol"]["exercises"] if e["status"] == "failed"}
    assert list(failed) == ["0.2"] and "divide by the world size" in failed["0.2"]["detail"]
    assert "carol  0.2: rank 0 (world size 2" in first, first[-2000:]
    term = json.loads((scratch_class / "term.json").read_text())
    by = {n["student"]: n for n in term["notebooks"]}
    assert {s: (n["passed"], n["reused"], n["late"]) for s, n in by.items()} == {
        "alice": (True, True, False), "bob": (False, True, False), "carol": (True, False, True)}
    assert re.search(r"^graded 1 in \d+ s; 2 unchanged$", regrade, re.MULTILINE), regrade[-2000:]
    rows = (scratch_class / "grades.csv").read_text().splitlines()
    assert rows[0].startswith("student,lab,points,max_points,passed,late,submitted,0.1,0.2,")
    assert [r.split(",")[:2] for r in rows[1:]] == [["alice", "0"], ["bob", "0"], ["carol", "0"]]
    scope = json.loads((scratch_class / "gradescope" / "00_setup" / "carol" / "results.json").read_text())
    assert scope["score"] == by["carol"]["points"] and "after the deadline" in scope["output"]
    assert {t["number"] for t in scope["tests"]} >= {"0.1", "0.2", "Q0.1"}
    feedback = (scratch_class / "feedback" / "bob" / "00_setup.md").read_text()
    assert feedback.startswith("# bob: lab 00") and "· Exercise 0.2 " in feedback and "[answer" not in feedback
