"""Solutions → labs, the check framework, and grading notebooks end to end."""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

import distlab.grading as grading
from distlab.grading.cells import cells_to_skip, python_source
from distlab.grading.classroom import grade_notebook
from distlab.grading.registry import Exercise, all_exercises, exercises_of_lab, lab_number
from distlab.notebooks import (
    KERNELSPEC,
    NotebookError,
    build_labs,
    exercise_ids,
    make_lab,
    stale_kernelspecs,
    strip_solutions,
)

REPO = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((REPO / "solutions").glob("[0-9][0-9]_*.ipynb"))


def test_solution_blocks_become_stubs_at_their_indentation():
    source = (
        "def ring(x):\n"
        "    y = x + 1\n"
        "    # BEGIN SOLUTION 2.1\n"
        "    for i in range(3):\n"
        "        y = y * 2\n"
        "    # END SOLUTION\n"
        "    return y\n"
        "# BEGIN SOLUTION 2.2\n"
        "z = 5\n"
        "# END SOLUTION\n"
    )
    assert strip_solutions(source) == (
        "def ring(x):\n"
        "    y = x + 1\n"
        '    raise NotImplementedError("Exercise 2.1: replace this line with your solution")\n'
        "    return y\n"
        'raise NotImplementedError("Exercise 2.2: replace this line with your solution")\n'
    )


def test_one_line_answers_are_blanked_and_nbval_markers_dropped():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("# NBVAL_IGNORE_OUTPUT\nq4_1 = 1.5  # SOLUTION Q4.1\n"
                                          "answers['b'] = 'c'   # SOLUTION Q4.2\ndistlab.check('Q4.1', q4_1)")]
    assert exercise_ids(nb) == ["Q4.1", "Q4.2"]
    assert make_lab(nb).cells[0].source == ("q4_1 = ...  # your answer\nanswers['b'] = ...  # your answer\n"
                                            "distlab.check('Q4.1', q4_1)")
    nb.cells = [nbformat.v4.new_code_cell("# NBVAL_IGNORE_OUTPUT  (timings)\nx = 1\n  #NBVAL_SKIP\ny = 2")]
    assert make_lab(nb).cells[0].source == "x = 1\ny = 2"  # a marker line goes whole, comment and all


def test_unbalanced_markers_are_an_error_not_a_leak():
    with pytest.raises(NotebookError, match="unmatched '# BEGIN SOLUTION' marker at line 2"):
        strip_solutions("x = 1\n# BEGIN SOLUTION 1.1\nsecret = 42\n", "nb")
    with pytest.raises(NotebookError, match="END SOLUTION"):
        strip_solutions("secret = 42\n# END SOLUTION\n", "nb")


def test_make_lab_clears_outputs_and_keeps_everything_else():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# Title"),
                nbformat.v4.new_code_cell("# BEGIN SOLUTION 4.1\nanswer = 1\n# END SOLUTION\nprint(answer)",
                                          execution_count=3, outputs=[nbformat.v4.new_output("stream", text="1\n")])]
    lab = make_lab(nb)
    assert lab.cells[0].source == "# Title"
    assert lab.cells[1].outputs == [] and lab.cells[1].execution_count is None
    assert "answer = 1" not in lab.cells[1].source and nb.cells[1].outputs  # the solution is untouched
    assert exercise_ids(nb) == ["4.1"] and exercise_ids(lab) == []


def test_build_labs_writes_then_reports_in_sync(tmp_path):
    solutions, labs = tmp_path / "solutions", tmp_path / "labs"
    solutions.mkdir()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("# BEGIN SOLUTION 7.1\nx = 1\n# END SOLUTION")]
    nbformat.write(nb, solutions / "07_demo.ipynb")
    (labs.mkdir())
    (labs / "08_orphan.ipynb").write_text("{}")
    assert {p.name for p in build_labs(solutions, labs)} == {"07_demo.ipynb", "08_orphan.ipynb"}
    assert build_labs(solutions, labs, check_only=True) == []
    assert not (labs / "08_orphan.ipynb").exists()
    nb.cells[0].source += "\ny = 2"
    nbformat.write(nb, solutions / "07_demo.ipynb")
    assert [p.name for p in build_labs(solutions, labs, check_only=True)] == ["07_demo.ipynb"]


def test_committed_labs_are_in_sync_with_solutions():
    stale = build_labs(REPO / "solutions", REPO / "labs", check_only=True)
    assert stale == [], f"run `make labs`: out of date: {stale}"


def test_every_notebook_names_the_kernel_make_install_registers():
    """JupyterLab rewrites a notebook's kernelspec to the running kernel's when it opens it: a notebook naming
    another display name opens marked modified. The one `make install` registers is what every notebook stores."""
    from jupyter_client.kernelspec import KernelSpecManager  # noqa: PLC0415  only this test asks for kernelspecs

    installed = KernelSpecManager().get_kernel_spec(KERNELSPEC["name"])
    assert (installed.display_name, installed.language) == (KERNELSPEC["display_name"], KERNELSPEC["language"])
    notebooks = SOLUTIONS + sorted((REPO / "labs").glob("[0-9][0-9]_*.ipynb"))
    assert stale_kernelspecs(notebooks) == [], "run `make labs` (distlab notebooks tag stores the kernelspec)"


def _cell_ast(source: str) -> ast.Module:
    """A cell's syntax tree (an empty one for a cell that does not parse)."""
    try:
        return ast.parse(python_source(source))
    except SyntaxError:
        return ast.Module(body=[], type_ignores=[])


def _loaded_names(source: str) -> set[str]:
    """Names a cell assigns a saved benchmark result to (``bench = results.load("ddp")``)."""
    return {target.id for node in ast.walk(_cell_ast(source)) if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call) and ast.unparse(node.value.func).endswith("results.load")
            for target in node.targets if isinstance(target, ast.Name)}


def _reads(source: str, name: str) -> bool:
    return any(isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Load)
               for node in ast.walk(_cell_ast(source)))


def test_cells_that_print_saved_benchmark_results_are_outside_nbvals_comparison():
    """`make bench` rewrites benchmarks/results (dates, timings, the machine): `make test` afterwards stays green.

    A cell that loads saved results, and any later cell that prints from what it loaded (``bench`` a few cells
    down), keeps its assertions (nbval still runs it); only its printed figures are not compared.
    """
    loose = []
    for path in SOLUTIONS:
        loaded: set[str] = set()
        for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
            if cell.cell_type != "code":
                continue
            ignored = cell.source.startswith("# NBVAL_IGNORE_OUTPUT\n")
            prints_saved = "results.load(" in cell.source or any(_reads(cell.source, name) for name in loaded)
            if prints_saved and cell.get("outputs") and not ignored:
                loose.append(f"{path.name} cell {i}")
            loaded |= _loaded_names(cell.source)
    assert not loose, f"cells that print saved benchmark results need # NBVAL_IGNORE_OUTPUT: {loose}"


def test_check_prints_one_line_per_outcome(monkeypatch, capsys, tmp_path):
    def checker(fn):
        value = fn(3)
        if value != 9:
            raise grading.CheckFailed(f"square(3) returned {value}, expected 9")
        return "3 hidden cases"

    monkeypatch.setattr(grading, "find_exercise", lambda i: Exercise(i, "square", 2, checker))
    monkeypatch.setattr(grading, "_ledger", {})

    def stub(x):
        raise NotImplementedError("Exercise 9.1: replace this line with your solution")

    results = [grading.check("9.1", f) for f in (lambda x: x * x, lambda x: x + x, stub, lambda x: 1 / 0)]
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == [
        "✓ Exercise 9.1 square: 2/2 points (3 hidden cases)",
        "✗ Exercise 9.1 square: 0/2 points (square(3) returned 6, expected 9)",
        "· Exercise 9.1 square: 0/2 points (not attempted)",
    ]  # a crash names the student's line: here the lambda's, in this file
    assert lines[3].startswith("✗ Exercise 9.1 square: 0/2 points (raised ZeroDivisionError: division by zero "
                               "(at line ") and "lambda x: 1 / 0" in lines[3]
    assert [r.status for r in results] == ["passed", "failed", "not attempted", "failed"]
    assert [(r["id"], r["status"]) for r in json.loads(grading.ledger())] == [("9.1", "failed")]  # the latest


def test_every_exercise_has_a_solution_block_and_a_passing_stored_check():
    """nbval re-executes these notebooks and compares outputs, so the ✓ lines below are re-proved in CI."""
    exercises = all_exercises()
    assert exercises, "no exercises registered"
    for path in SOLUTIONS:
        nb = nbformat.read(path, as_version=4)
        expected = sorted(exercises_of_lab(lab_number(path)))
        assert sorted(set(exercise_ids(nb))) == expected, path.name  # an exercise may span several blocks
        outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
        for exercise_id in expected:
            e = exercises[exercise_id]
            assert f"✓ {e.label} {e.title}: {e.points}/{e.points} points" in outputs, (path.name, e.id)
        assert not re.search(r"^[✗·] (Exercise|Question) ", outputs, re.MULTILINE), path.name


def _grade_cli(*args):
    return subprocess.run([sys.executable, "-m", "distlab", "grade", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=900)


GENERATED_LABS = sorted(str(p) for p in (REPO / "labs").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("labs", [pytest.param(GENERATED_LABS[share::2], id=f"share{share}") for share in (0, 1)])
def test_generated_labs_grade_zero_and_run_to_the_end(labs, tmp_path):
    """Every generated lab runs top to bottom with its stubs in place: no cell raises, every check and
    question reports 'not attempted'. Graded as a class, with warm kernels, as many at once as cores allow;
    the labs are cut in two shares, which ``make test``'s workers grade side by side."""
    report = tmp_path / "labs.json"
    result = _grade_cli(*labs, "--json", str(report), "--all-cells")  # every cell: the demos must run too
    assert result.returncode == 1, result.stdout + result.stderr  # no notebook passes
    assert "without encryption" not in result.stderr and "To connect another client" not in result.stderr
    data = json.loads(report.read_text())
    assert data["points"] == 0 and data["notebooks_passed"] == 0 and data["notebook_count"] == len(labs)
    assert data["max_points"] == sum(e.points for e in all_exercises().values()
                                     if e.lab in {lab_number(Path(p)) for p in labs})
    for notebook in data["notebooks"]:
        assert notebook["error"] is None, notebook  # ran to the end: no dead kernel, no time limit
        assert notebook["cell_errors"] == [], (notebook["path"], notebook["cell_errors"])  # no cell raised
        assert notebook["exercises"] and {e["status"] for e in notebook["exercises"]} == {"not attempted"}
    print("seconds per generated lab: " + ", ".join(f"{Path(n['path']).stem} {n['seconds']:.0f}"
                                                     for n in data["notebooks"]) + f"; wall {data['wall_seconds']:.0f}")
    assert "every notebook must pass: not ok, exit status 1" in result.stdout


@pytest.mark.timeout(600)
def test_a_solution_graded_without_its_demo_cells_gets_full_marks(tmp_path):
    """Lab 03's solution, graded as distlab grade does (the cells tagged grader-skips that no check needs left
    out), gets every point: the same as the full run, whose ✓ lines nbval re-proves in every make test."""
    solution = REPO / "solutions" / "03_ddp.ipynb"
    result = _grade_cli(str(solution), "--json", str(tmp_path / "grade.json"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "passed the 100% threshold; every notebook must pass: ok, exit status 0" in result.stdout
    assert "(--threshold 1 (the default))" in result.stdout and "✗" not in result.stdout.split("marks:")[0]
    graded = json.loads((tmp_path / "grade.json").read_text())["notebooks"][0]
    assert graded["skipped_cells"] == len(cells_to_skip(nbformat.read(solution, as_version=4))) >= 10


def test_a_notebook_with_a_deleted_check_scores_that_exercise_as_not_run(tmp_path):
    solution = next(p for p in SOLUTIONS if exercise_ids(nbformat.read(p, as_version=4)))
    nb = make_lab(nbformat.read(solution, as_version=4))
    nb.cells = [c for c in nb.cells if "distlab.check(" not in c.source]
    path = tmp_path / solution.name
    nbformat.write(nb, path)
    grade = grade_notebook(path, cell_timeout=300)
    assert grade.exercises and {e["status"] for e in grade.exercises} == {"not run"}


def test_every_lab_opens_on_colab_and_kaggle_and_installs_itself_only_where_needed(tmp_path):
    lab = nbformat.read(REPO / "labs" / "03_ddp.ipynb", as_version=4)
    badges, install = lab.cells[1], lab.cells[2]
    assert lab.cells[0].source.startswith("# Lab 03")
    assert "colab.research.google.com/github/" in badges.source and "labs/03_ddp.ipynb" in badges.source
    assert "kaggle.com/kernels/welcome?src=https://github.com/" in badges.source
    # Not on Colab or Kaggle: the cell must not clone or pip install anything, even without distlab.
    script = tmp_path / "install_cell.py"
    fake = ("import importlib.util, subprocess\ncalls = []\nsubprocess.run = lambda argv, **k: calls.append(argv)\n"
            "importlib.util.find_spec = lambda name: None\n")
    script.write_text(fake + install.source + "\nprint(calls)")
    run = dict(capture_output=True, text=True, cwd=tmp_path, timeout=120)
    here = {name: value for name, value in os.environ.items() if name != "KAGGLE_KERNEL_RUN_TYPE"}
    done = subprocess.run([sys.executable, str(script)], **run, env=here)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr
    # On Kaggle without distlab: clone the published repository, install it pinned to the torch that is there.
    env = {**os.environ, "KAGGLE_KERNEL_RUN_TYPE": "Interactive"}
    done = subprocess.run([sys.executable, str(script)], **run, env=env)
    assert "'git', 'clone'" in done.stdout and "'-c', 'keep-torch.txt'" in done.stdout, done.stdout + done.stderr
    import torch
    assert (tmp_path / "keep-torch.txt").read_text() == f"torch=={torch.__version__}\n"


def test_shell_replies_are_awaited_in_slices_so_a_missed_wakeup_costs_a_second_not_the_time_limit():
    """nbclient#312: with widgets, a pending reply can go unnoticed until the wait's timeout ends."""
    import asyncio
    import queue
    from types import SimpleNamespace

    from distlab.runtime import kernels

    asked = []

    async def get_msg(timeout=None):
        asked.append(timeout)
        if len(asked) < 3:  # the reply "arrived" but this wait missed it: it only ends at its timeout
            raise queue.Empty
        return {"msg_type": "execute_reply"}

    channel = SimpleNamespace(get_msg=get_msg)
    kernels._poll_shell_in_slices(channel)
    assert asyncio.run(channel.get_msg(timeout=600)) == {"msg_type": "execute_reply"}
    assert len(asked) == 3 and all(t <= kernels.SHELL_POLL_SECONDS for t in asked)

    async def never(timeout=None):
        raise queue.Empty

    channel = SimpleNamespace(get_msg=never)
    kernels._poll_shell_in_slices(channel)
    with pytest.raises(queue.Empty):  # the caller's own time limit still ends the wait
        asyncio.run(channel.get_msg(timeout=0.05))
