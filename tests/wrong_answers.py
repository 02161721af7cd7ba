"""Wrong answers, shared by the tests that use them. A student's lab with one exercise answered wrong: the solution's
code for that exercise with a plausible mistake written in, every other exercise left as its stub, for the tests
that run such a lab end to end (Run All in the browser, the grader) to prove a wrong answer reaches its ✗ line and
stops nothing after it. The solution's own exercise code, for a lab's table of wrong answers, and the tests every
such table runs (:func:`checker_tests`)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import nbformat
import pytest

import distlab
from distlab.notebooks import SOLUTION_BLOCK, make_lab

REPO = Path(__file__).resolve().parents[1]


def wrong_lab(name: str, exercise_id: str, mistakes: dict[str, str]) -> nbformat.NotebookNode:
    """``labs/<name>`` as a student would have it with exercise ``exercise_id`` answered, each ``old`` text of
    its solution replaced by ``new``. Every replacement must apply, so a changed solution fails loudly here."""
    solution = nbformat.read(REPO / "solutions" / name, as_version=4)
    unused = dict(mistakes)

    def answer(match) -> str:
        if match["id"] != exercise_id:
            return match.group(0)
        body = match["body"]
        for old, new in mistakes.items():
            if old in body:
                body = body.replace(old, new)
                unused.pop(old, None)
        return body

    for cell in solution.cells:
        if cell.cell_type == "code":
            cell.source = SOLUTION_BLOCK.sub(answer, cell.source)
    assert not unused, f"{name}: exercise {exercise_id}'s solution no longer contains {list(unused)}"
    return make_lab(solution, name)


def exercise_cells(name: str, exercises) -> dict[str, str]:
    """The source of the cell of ``solutions/<name>`` that holds each exercise's solution block, by exercise id."""
    cells = nbformat.read(REPO / "solutions" / name, as_version=4).cells
    return {exercise: next(c.source for c in cells if c.cell_type == "code" and f"# BEGIN SOLUTION {exercise}\n"
                           in c.source) for exercise in exercises}


def solution_namespace(name: str, lab: int, only: tuple[str, ...] = ()) -> dict:
    """The solution notebook's import lines and every cell holding one of lab ``lab``'s exercises (``only`` these
    exercise ids, when given), run in a fresh namespace (as a kernel's globals): the right answers, exactly as the
    notebook writes them, each checked by its cell."""
    cells = nbformat.read(REPO / "solutions" / name, as_version=4).cells
    namespace = {"__name__": f"lab{lab:02d}_notebook"}
    setup = "\n".join(line for line in cells[1].source.splitlines() if not line.startswith("%"))
    imports = [ast.get_source_segment(setup, node) for node in ast.parse(setup).body
               if isinstance(node, ast.Import | ast.ImportFrom)]
    exec("\n".join(imports), namespace)  # noqa: S102  the solution notebook's own import lines
    for cell in cells:
        if cell.cell_type == "code" and f"# BEGIN SOLUTION {lab}." in cell.source and (
                not only or any(f"# BEGIN SOLUTION {exercise}\n" in cell.source for exercise in only)):
            exec(cell.source, namespace)  # noqa: S102  the solution notebook's own exercise code
    return namespace


def demo_output(notebook: Path) -> str:
    """What a solution notebook prints outside its quiz checks, for tests that no demo gives a key away.

    Timings (cells outside nbval's comparison) change with every run and can meet a key's digits by chance
    (lab 07 once printed a measured "slowest/mean 1.88" beside Q7.2's 1.875): they give nothing away."""
    return "".join(o.get("text", "") for c in nbformat.read(notebook, as_version=4).cells
                   if c.cell_type == "code" and "distlab.check(\"Q" not in c.source
                   and not c.source.startswith("# NBVAL_IGNORE_OUTPUT") for o in c.get("outputs", []))


def checker_tests(wrong: list, right: dict, notebook: Path | None = None, keys: dict | None = None) -> tuple:
    """A wrong-answer table's tests, for its module to bind under their names:

        test_wrong_answer_fails_naming_the_mistake, test_right_answer_passes, test_demos_do_not_give_the_quiz_away = \\
            checker_tests(WRONG, RIGHT, NOTEBOOK, KEYS)

    ``wrong``: rows (exercise, the mistake in words, the functions handed in, a regex its failure must match): each
    fails, naming the mistake. ``right``: exercise -> the functions of the notebook's answer: each passes. With
    ``notebook``, a third test: no quiz key is printed by the notebook's demos, ``keys`` being question id -> the
    ways the lab would print its key."""

    @pytest.mark.parametrize("exercise, mistake, functions, message", wrong, ids=[f"{w[0]} {w[1]}" for w in wrong])
    def test_wrong_answer_fails_naming_the_mistake(exercise, mistake, functions, message):
        result = distlab.check(exercise, *functions, quiet=True)
        assert result.status == "failed", f"{mistake}: {result.status} {result.detail}"
        assert re.search(message, result.detail), f"{mistake}: the message does not name it: {result.detail}"

    @pytest.mark.parametrize("exercise", sorted(right))
    def test_right_answer_passes(exercise):
        result = distlab.check(exercise, *right[exercise], quiet=True)
        assert result.status == "passed", result.detail

    if notebook is None:
        return test_wrong_answer_fails_naming_the_mistake, test_right_answer_passes

    def test_demos_do_not_give_the_quiz_away():
        printed = demo_output(notebook)
        shown = [(question, key) for question, printed_as in keys.items() for key in printed_as if key in printed]
        assert not shown, f"a demo prints a quiz key: {shown}"

    return test_wrong_answer_fails_naming_the_mistake, test_right_answer_passes, test_demos_do_not_give_the_quiz_away
