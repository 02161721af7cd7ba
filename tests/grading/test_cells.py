"""The grader runs only the cells a notebook's checks need: demos and benchmarks tagged grader-skips are left
out, unless the student's notebook, as it is, needs them (a helper written in a demo cell, a result read later)."""

from pathlib import Path

import nbformat
import pytest

from distlab.grading.cells import SKIP_TAG, cells_checks_need, cells_to_skip, skippable_cells
from distlab.notebooks import tag_grader_skips

REPO = Path(__file__).resolve().parents[2]


def _notebook(*sources, tagged=()):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    for i in tagged:
        nb.cells[i].metadata["tags"] = [SKIP_TAG]
    return nb


LAB = [
    "import distlab\nranks = distlab.Ranks(2)",                        # 0 set-up: the last cell reads ranks
    "def ring(x):\n    return x * SCALE  # the exercise reads a global",  # 1 the exercise
    "SCALE = 2",                                                      # 2 a global the exercise reads
    "timings = [ring(i) for i in range(10**6)]\nprint(max(timings))",  # 3 a demo: nothing reads it
    "%matplotlib inline\nimport matplotlib.pyplot as plt\nplt.plot([1, 2])",  # 4 a plot
    "distlab.check('2.1', ring)",                                     # 5 the check
    "ranks.close()",                                                  # 6 the last cell
]


def test_demos_are_skippable_and_what_the_check_reads_is_not():
    nb = _notebook(*LAB)
    assert cells_checks_need(nb) == {0, 1, 2, 5, 6}
    assert skippable_cells(nb) == [3, 4]


def test_a_tag_is_honoured_only_where_the_students_notebook_needs_nothing_from_the_cell():
    student = list(LAB)
    student[3] = "def helper(x):\n    return 2 * x\ntimings = [helper(i) for i in range(3)]"  # a helper in a demo
    student[1] = "def ring(x):\n    return helper(x)"  # ... that their answer calls
    nb = _notebook(*student, tagged=(3, 4))
    assert cells_to_skip(nb) == {4}
    nb = _notebook(*LAB, "q = timings[0]\ndistlab.check('Q2.1', q)", tagged=(3, 4))  # a result read later
    assert cells_to_skip(nb) == {4}
    assert cells_to_skip(_notebook(*LAB)) == set()  # untagged cells always run


def test_a_cell_that_does_not_parse_is_not_needed_for_its_names_but_a_check_in_it_is():
    nb = _notebook("x = (", "distlab.check('2.1', f) +", "y = 1")
    assert cells_checks_need(nb) == {1, 2}


@pytest.mark.parametrize("solution", sorted((REPO / "solutions").glob("[0-9][0-9]_*.ipynb")), ids=lambda p: p.name)
def test_each_solution_tags_exactly_the_cells_no_check_needs(solution):
    nb = nbformat.read(solution, as_version=4)
    assert tag_grader_skips(nb) == [], f"run `distlab notebooks tag {solution.relative_to(REPO)}` and `distlab labs`"
    assert cells_to_skip(nb) == set(skippable_cells(nb))
