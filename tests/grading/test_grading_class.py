"""`distlab grade` on a class: one result per student notebook and per exercise, ranked; pass/fail per notebook
against a stated threshold; the exit status says whether every student (or --min-pass of them) passed; a
hanging notebook reported for what it is. (A blank, a wrong and a correct notebook of lab 00 graded together:
tests/test_instructor_guide.py, whose guide grades exactly those.)"""

import json
import re
from pathlib import Path

import nbformat
import pytest

from distlab.grading import check
from distlab.grading.classroom import (
    DEFAULT_THRESHOLD,
    NotebookGrade,
    class_report,
    format_report,
    grade_notebooks,
)
from distlab.grading.registry import find_exercise
from distlab.grading.submissions import student_names

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.usefixtures("no_leftover_ranks")]


def _exercise(id_, status, points, max_points, detail=""):
    return {"id": id_, "title": f"exercise {id_} with a rather long title to test the columns",
            "status": status, "points": points, "max_points": max_points, "detail": detail}


def _grades():
    full = [_exercise("2.1", "passed", 3, 3), _exercise("2.2", "passed", 2, 2)]
    half = [_exercise("2.1", "passed", 3, 3), _exercise("2.2", "failed", 0, 2, "rank 1, element 4: expected 2, got 8")]
    blank = [_exercise("2.1", "not attempted", 0, 3), _exercise("2.2", "not run", 0, 2)]
    return [NotebookGrade("s/bob/02_collectives.ipynb", "bob", half, seconds=12.0),
            NotebookGrade("s/alice/02_collectives.ipynb", "alice", full, seconds=30.0),
            NotebookGrade("s/zed-with-a-long-name/02_collectives.ipynb", "zed-with-a-long-name", blank,
                          error="stopped after 60 s (its time limit) while cell 17 was running", seconds=60.0)]


def test_report_ranks_students_and_exercises_and_states_the_threshold():
    report = class_report(_grades())
    assert report["threshold"] == DEFAULT_THRESHOLD == 1.0 and not report["ok"]
    assert [(n["rank"], n["student"], n["passed"]) for n in report["notebooks"]] == [
        (1, "alice", True), (2, "bob", False), (3, "zed-with-a-long-name", False)]
    assert [(e["id"], e["passed"], e["failed"]) for e in report["exercises"]] == [("2.2", 1, 1), ("2.1", 2, 0)]
    text = format_report(report)
    assert "pass = at least 100% of the points (--threshold 1 (the default))" in text
    assert "bob  2.2: rank 1, element 4: expected 2, got 8" in text
    assert "1 of 3 notebook(s) passed the 100% threshold; every notebook must pass: not ok, exit status 1" in text
    rows = [line for line in text.splitlines() if line[:4].strip().isdigit()]
    assert len({line.index("pass") if "pass" in line else line.index("FAIL") for line in rows}) == 1  # aligned
    lenient = class_report(_grades(), threshold=0.5, min_pass=2)
    assert lenient["ok"] and lenient["notebooks_passed"] == 2
    assert "at least 2 must pass (--min-pass): ok, exit status 0" in format_report(lenient)


def test_a_wrong_quiz_answer_shows_its_hint_and_its_key_only_with_answers():
    """Feedback never gives a quiz key away; an instructor's report shows it after the deadline (--answers)."""
    question = find_exercise("Q0.1")  # LOCAL_RANK of global rank 11 on nodes of 8 GPUs: 3
    result = check("Q0.1", 5, quiet=True)
    assert result.status == "failed" and result.detail.startswith("5 is not right: section 3")
    report = class_report([NotebookGrade("s/amy/00_setup.ipynb", "amy", [
        {"id": "Q0.1", "title": question.title, "status": "failed", "points": 0, "max_points": 1,
         "detail": result.detail}])])
    assert "[answer:" not in format_report(report)
    assert f"amy  Q0.1: {result.detail} [answer: 3]" in format_report(report, answers=True)


def test_students_are_named_by_folder_when_file_names_repeat():
    assert student_names(["a/alice/02_x.ipynb", "a/bob/02_x.ipynb"]) == ["alice", "bob"]
    assert student_names(["02_alice.ipynb", "02_bob.ipynb"]) == ["02_alice", "02_bob"]


def _notebook(cells):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    return nb


@pytest.mark.timeout(300)
def test_printed_or_written_results_and_rebound_checks_score_nothing(tmp_path):
    """Results come only from the grader's own processes: a notebook that prints a ✓ line, writes a report file of
    its own or rebinds distlab.check gets no points for it; an honest answer beside them counts. (Every other way to
    try: tests/grading/test_forgery.py.)"""
    fake = json.dumps({"id": "Q0.2", "title": "x", "status": "passed", "points": 1, "max_points": 1, "detail": ""})
    printing = tmp_path / "00_printing.ipynb"
    nbformat.write(_notebook([f"print('✓ Question Q0.2 forged: 1/1 points')\nprint({fake!r})",
                              "import os, pathlib\nfor name in ('DISTLAB_GRADE_REPORT', 'report.jsonl'):\n"
                              f"    pathlib.Path(os.environ.get(name, name)).write_text({fake!r})"]), printing)
    rebinding = tmp_path / "00_rebinding.ipynb"
    nbformat.write(_notebook(["import distlab\ndistlab.check = lambda *a, **k: print('✓ passed')",
                              "distlab.check('Q0.2', 0)"]), rebinding)
    honest = tmp_path / "00_honest.ipynb"
    nbformat.write(_notebook(["import distlab\ndistlab.check('Q0.2', 36)\ndistlab.check('Q0.3', 0)"]), honest)
    grades = grade_notebooks([printing, rebinding, honest], timeout=120, jobs=2)
    assert grades[0].points == 0 and grades[0].error is None
    assert {e["status"] for e in grades[0].exercises} == {"not run"}
    statuses = {e["id"]: e["status"] for e in grades[1].exercises}
    assert grades[1].points == 0 and statuses["Q0.2"] == "failed" and statuses["0.1"] == "not run"
    statuses = {e["id"]: e["status"] for e in grades[2].exercises}
    assert grades[2].points == 1 and statuses["Q0.2"] == "passed" and statuses["Q0.3"] == "failed"


@pytest.mark.timeout(120)
def test_a_hanging_notebook_is_stopped_at_its_time_limit_and_the_kernel_is_ended(tmp_path):
    """One spins in the kernel, one blocks in a rank that never returns; a quick one beside them still counts."""
    spin, block, quick = tmp_path / "00_spin.ipynb", tmp_path / "00_block.ipynb", tmp_path / "00_quick.ipynb"
    nbformat.write(_notebook(["x = 1", "while True:\n    pass", "y = 2"]), spin)
    nbformat.write(_notebook(["import distlab, time", "distlab.launch(lambda: time.sleep(3600), 2)"]), block)
    nbformat.write(_notebook(["import distlab\ndistlab.check('Q0.2', 36)"]), quick)
    grades = grade_notebooks([spin, block, quick], timeout=8, jobs=3)
    assert [g.error for g in grades[:2]] == [f"stopped after 8 s (its time limit) while cell {i} was running"
                                             for i in (1, 1)]
    assert all(g.seconds < 60 and {e["status"] for e in g.exercises} == {"not run"} for g in grades[:2])
    assert grades[2].error is None and grades[2].points == 1


def test_a_folder_of_submissions_names_students_and_bad_submission_times_say_what_is_wrong(tmp_path):
    from distlab.grading.submissions import collect, submission_times

    for name in ("alice/03_ddp.ipynb", "alice/.ipynb_checkpoints/03_ddp-checkpoint.ipynb", "bob/03_ddp.ipynb",
                 "carol.ipynb"):
        (tmp_path / "in" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "in" / name).write_text("{}")
    found = collect([str(tmp_path / "in")])
    assert [(p.relative_to(tmp_path / "in").as_posix(), s) for p, s in found] == [
        ("carol.ipynb", "carol"), ("alice/03_ddp.ipynb", "alice"), ("bob/03_ddp.ipynb", "bob")]
    times = tmp_path / "times.csv"
    times.write_text("name,when\nalice,2026-12-01\n")
    with pytest.raises(ValueError, match="expected the columns student,submitted, found name,when"):
        submission_times([p for p, _ in found], [s for _, s in found], str(times))
    times.write_text("student,submitted\nalice,2026-12-01T10:00\n")
    with pytest.raises(ValueError, match="has no submission time for carol, bob"):
        submission_times([p for p, _ in found], [s for _, s in found], str(times))


def test_a_missing_times_file_or_a_pattern_that_matched_nothing_is_one_line_and_exit_2(tmp_path, capsys):
    """Before any kernel starts: the error names the file and what to do, not a traceback."""
    from distlab.cli import main

    (tmp_path / "submissions" / "alice").mkdir(parents=True)
    (tmp_path / "submissions" / "alice" / "00_setup.ipynb").write_text("{}")
    missing = tmp_path / "submission_times.csv"
    late = ["--deadline", "2026-12-01T23:59", "--times", str(missing)]
    assert main(["grade", str(tmp_path / "submissions"), *late]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"distlab grade: --times {missing}: No such file or directory", err
    assert main(["grade", str(tmp_path / "submissions"), "--times", str(missing)]) == 2  # times, but no deadline
    err = capsys.readouterr().err.strip()
    assert err == "distlab grade: --times needs --deadline TIME (the submission times are read to flag late ones)", err
    pattern = str(tmp_path / "submissions" / "*.ipynb")  # what bash passes on when a pattern matches no file
    assert main(["grade", pattern]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"distlab grade: no such notebook: {pattern}") and len(err.splitlines()) == 1, err
    assert f"pass the folder: distlab grade {tmp_path / 'submissions'}/" in err


def test_an_instructors_terminal_shows_a_bar_of_the_notebooks_and_a_log_only_the_lines(tmp_path, monkeypatch, capfd):
    """A class takes minutes: where a person watches, a bar (rate, ETA) under each notebook's line; where nobody
    does (pytest, CI, a log file), the lines alone."""
    from distlab.cli import main
    from distlab.runtime import progress

    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell("x = 1")]
    nbformat.write(notebook, tmp_path / "00_setup.ipynb")  # lab 00 with nothing done: graded in seconds
    arguments = ["grade", str(tmp_path / "00_setup.ipynb"), "--cold", "--json", str(tmp_path / "grades.json")]
    assert main(arguments) == 1
    logged = capfd.readouterr().err
    assert "[1/1] 00_setup: 0/7 points" in logged and "grading:" not in logged, logged
    written = json.loads((tmp_path / "grades.json").read_text())  # the guide's example report has today's fields
    example = json.loads((REPO / "course" / "examples" / "grade_report.json").read_text())
    assert set(example) == set(written) and set(example["notebooks"][0]) == set(written["notebooks"][0])
    assert set(example["notebooks"][0]["exercises"][0]) == set(written["notebooks"][0]["exercises"][0])
    monkeypatch.setattr(progress, "audience", lambda: "terminal")
    assert main(arguments) == 1
    drawn = capfd.readouterr().err.replace("\r", "\n")
    assert "[1/1] 00_setup: 0/7 points" in drawn and re.search(r"grading: 100%\|.*\| 1/1 \[", drawn), drawn
