"""A graded class: per-student quiz numbers and hidden cases drawn by the grader.

Quiz: each student's numbers come from an HMAC of their name under the course secret; the chapter's answer fails
them, the right answer to their own numbers passes, two students are asked different numbers, and the grader
marks each answer against the numbers it derives from the name and the secret, whatever the notebook asked.
Self-study (no release) asks and marks the chapter's numbers, as before.

Hidden cases: under the grader's seed a correct solution still passes and one that only fits the self-study cases
fails; the report records the seed.
"""

import json
import math
import random
from pathlib import Path

import nbformat
import pytest

from distlab import memory
from distlab.grading import check, quiz
from distlab.grading.classroom import class_report, grade_notebooks
from distlab.grading.harness import GRADE_SEED_VARIABLE, lab_seed
from distlab.grading.lab01 import _world_sizes, check_bytes_per_param
from distlab.grading.registry import all_exercises
from distlab.grading.release import release

ROOT = Path(__file__).resolve().parents[2]
SECRET = b"a course secret of the tests, 64 characters would be better here"

# Each varied question's answer, written out from its numbers (closed forms beside the library's formulas).
ANSWERS = {
    "Q1.2": lambda ranks: 16 / ranks,
    "Q1.4": lambda preset, ranks, stage: memory.PRESETS[preset].n_params
    * {1: 4 + 12 / ranks, 2: 2 + 14 / ranks, 3: 16 / ranks}[stage] / 2**30,
    "Q1.5": lambda bits: bits / 8,
    "Q2.2": lambda billions, gpus: 2 * (gpus - 1) / gpus * billions * 2e9 / 450e9 * 1e3,
    "Q2.4": lambda ranks, alpha_us, beta_gbs: (2 * (ranks - 1) - math.log2(ranks)) * alpha_us * beta_gbs * 1e3
    / (math.log2(ranks) - 2 * (ranks - 1) / ranks) / 1e6,
    "Q2.5": lambda ranks: math.floor(math.log2(ranks)) + (0 if ranks & (ranks - 1) == 0 else 2),
    "Q3.1": lambda billions, gpus: 2 * (gpus - 1) / gpus * billions * 2,
    "Q3.2": lambda ranks: ranks,
    # many small tensors: 1 MiB in the first bucket, 25 MiB in each later one, the rest in the last
    "Q3.3": lambda megabytes: 1 + math.ceil((megabytes * 1e6 - 2**20) / (25 * 2**20)),
    "Q3.5": lambda billions, tokens: 6 * billions * 1e9 * tokens / 989e12,
    "Q4.1": lambda ranks: 2 + 14 / ranks,
    "Q4.4": lambda billions, gpus: billions * 16 / gpus,
    "Q4.8": lambda ranks: ranks,
    "Q6.1": lambda p, m: (p - 1) / (m + p - 1),
    "Q6.2": lambda percent, p: -(-(p - 1) * (100 - percent) // percent),
    "Q6.3": lambda p, m, v: (p - 1) / (v * m + p - 1),
    "Q6.4": lambda rank, p: p - rank,
    "Q6.5": lambda seq, micro_batch: micro_batch * seq * 8192 * 2 / 2**20,
    "Q9.3": lambda scale: scale / 2,  # GradScaler's backoff halves the scale
    "Q9.5": lambda rows, cols: rows * cols / 128,
    "Q9.7": lambda percent: 1 / (1 - percent / 100 + percent / 100 * 989 / 1979),  # H100 bf16 and fp8 peaks
    "Q11.1": lambda pp, m: (pp - 1) / (m + pp - 1),
    "Q11.2": lambda preset, gpus: 2 * (gpus - 1) / gpus * memory.PRESETS[preset].n_params * 2 / 450e9 * 1e3,
    # 6·N (N without the embedding lookup) + 12·n_layer·d_model·seq_len FLOPs per token, at 40% of 989 TFLOP/s
    "Q11.3": lambda trillions, gpus: (6 * (memory.PRESETS["405B"].n_params - 128256 * 16384) + 12 * 126 * 16384 * 8192)
    * trillions * 1e12 / (gpus * 989e12 * 0.4) / 86400,
    "Q11.4": lambda tflops: tflops / 989,
    "Q11.7": lambda grid: grid.dp * grid.tp,  # one pipeline per (DP, TP) pair
    "Q11.8": lambda m: m,  # ZeRO-2 reduce-scatters each micro-batch's gradients
    "Q5.2": lambda tokens: tokens * 8192 * 2 / 2**20,
    "Q5.4": lambda tp: (10 + 24 / tp) / 34,  # Korthikanti's 34 values per s·b·h, attention scores not kept
    "Q5.5": lambda mib, gpus, gbs: 2 * (gpus - 1) / gpus * mib * 2**20 / (gbs * 1e9) * 1e3,
    "Q7.1": lambda n: n - 1,
    "Q7.2": lambda n: max(r + 1 / 2 for r in range(n)) / (sum(r + 1 / 2 for r in range(n)) / n),
    "Q7.3": lambda n: n / 2,
    "Q7.4": lambda heads, kv_heads: max(d for d in range(1, kv_heads + 1) if heads % d == 0 and kv_heads % d == 0),
    "Q7.5": lambda heads, kv_heads: 2 * 989e12 * kv_heads / (2 * 450e9 * heads),
    "Q7.6": lambda thousands, cp: 80 * 2 * (thousands * 1024 // cp) * 8192 / 2**30,
    "Q8.6": lambda ep: 256 / ep,
    "Q10.1": lambda j, bands, rows: 1 - (1 - j**rows) ** bands,
    "Q10.2": lambda k, j: math.sqrt(j * (1 - j) / k),
    "Q10.5": lambda trillions: trillions * 2,
    "Q12.2": lambda stall: math.sqrt(2 * stall * 54 * 24 / 419 * 3600) / 60,
    "Q12.7": lambda saved, loaded: saved / loaded,
    "Q13.1": lambda steps, batch, seq_len: steps * batch * seq_len,
    "Q13.2": lambda pp, m: (pp - 1) / (m + pp - 1),
    "Q13.3": lambda step, every: step % every,  # the relaunch loads the checkpoint of the last multiple of every
    "Q13.4": lambda params, dp: params * 8 / dp,  # fp32 Adam: two 4-byte moments, sharded over DP by ZeRO-1
    "Q13.5": lambda mb, ranks: 2 * (ranks - 1) / ranks * mb * 1e6,
}
VARIED = {i: e for i, e in all_exercises().items() if e.variation is not None}


def _entry(question_id: str, given: float, status: str = "passed") -> dict:
    """A ledger entry as a kernel reports it (its own mark is what the grader must not trust)."""
    exercise = VARIED[question_id]
    return {"id": question_id, "title": exercise.title, "status": status, "points": 1, "max_points": 1,
            "detail": "correct", "label": exercise.label, "given": given}


def test_every_numeric_question_varies_or_says_why_not():
    """A registry walk over every lab: a numeric question either varies per student or says in ``fixed`` why it
    cannot, never both and never neither."""
    unmarked = set()
    for exercise in all_exercises().values():
        if exercise.is_quiz and not isinstance(exercise.answer, str):
            assert not (exercise.variation is not None and exercise.fixed), exercise.id
            if exercise.variation is None and not exercise.fixed:
                unmarked.add(exercise.id)
    assert not unmarked, sorted(unmarked)
    assert set(VARIED) == set(ANSWERS)


def test_self_study_asks_each_varied_question_as_its_solution_notebook_printed_it():
    """``given`` is the chapter's numbers: each varied question's title with them is the one the executed solution
    notebook's check printed, so varying a question changed nothing a self-study reader sees."""
    printed = {}
    for path in sorted(ROOT.glob("solutions/[0-9][0-9]_*.ipynb")):
        cells = nbformat.read(path, as_version=4).cells
        printed[int(path.name[:2])] = "".join(o.get("text", "") for c in cells if c.cell_type == "code"
                                              for o in c.outputs)
    for question_id, exercise in VARIED.items():
        assert exercise.title == exercise.variation.title(exercise.variation.given)
        assert f"Question {question_id} {exercise.title}: " in printed[exercise.lab], question_id


@pytest.mark.parametrize("question_id", sorted(ANSWERS))
def test_a_copied_chapter_answer_fails_and_the_right_answer_to_the_students_numbers_passes(question_id):
    variation = VARIED[question_id].variation
    for student in ("alice", "bob", "carol", "dmitri"):
        numbers = variation.numbers(question_id, quiz.student_token(SECRET, student))
        right = ANSWERS[question_id](**numbers)
        chapter = quiz.remark(_entry(question_id, VARIED[question_id].answer), student, SECRET)
        assert chapter["status"] == "failed" and chapter["points"] == 0 and "is not right" in chapter["detail"]
        own = quiz.remark(_entry(question_id, right, status="failed"), student, SECRET)
        assert own["status"] == "passed" and own["points"] == 1, (student, numbers, own)
        assert own["title"] == variation.title(numbers) and own["answer"] == pytest.approx(right)
    # self-study: the chapter's numbers, asked and marked as the chapter prints them
    assert VARIED[question_id].checker(ANSWERS[question_id](**variation.given)) == "correct"


def test_two_students_get_different_numbers_and_another_secret_other_ones():
    def asked(student, secret=SECRET):
        token = quiz.student_token(secret, student)
        return [e.variation.title(e.variation.numbers(i, token)) for i, e in VARIED.items()]

    assert asked("alice") != asked("bob")
    assert asked("alice") != asked("alice", b"another course's secret, as long as it needs")
    assert asked("alice") == asked("alice")  # a regrade asks the same numbers


def test_the_released_notebook_asks_the_students_numbers_and_the_grader_marks_against_them(tmp_path, monkeypatch):
    """Each student's copy asks their numbers (its quiz cell and the check lines); the grader derives them again
    from name and secret: alice answering with another student's token (their numbers) scores nothing."""
    lab = tmp_path / "01_memory_math.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("**Q1.2** ZeRO-3 on 64 ranks: bytes per parameter per rank?"),
        nbformat.v4.new_code_cell('q1_2 = ...  # your answer\ndistlab.check("Q1.2", q1_2)')]), lab)
    def ranks(student):
        return VARIED["Q1.2"].variation.numbers("Q1.2", quiz.student_token(SECRET, student))["ranks"]

    # a few numbers to draw from, so two students may be asked the same: take one who is not
    other = next(name for name in ("bob", "carol", "dmitri", "erin") if ranks(name) != ranks("alice"))
    release([lab], ["alice", other], SECRET, tmp_path / "release")
    monkeypatch.setattr(quiz, "_student", {})  # this kernel's student, set by the released cell
    for student in ("alice", other):
        cells = nbformat.read(tmp_path / "release" / student / lab.name, as_version=4).cells
        numbers = VARIED["Q1.2"].variation.numbers("Q1.2", quiz.student_token(SECRET, student))
        asked = f"ZeRO-3 bytes per parameter per rank on {numbers['ranks']} ranks"
        assert cells[0].source.endswith(f"> **Your numbers** ({student}): {asked}")
        assert f"your_numbers({student!r}, {quiz.student_token(SECRET, student)!r}, lab=1)" in cells[1].source
        exec(cells[1].source, {})  # noqa: S102  the released cell, as the student's kernel runs it
        result = check("Q1.2", 16 / numbers["ranks"], quiet=True)
        assert result.status == "passed" and result.title == asked and result.given == 16 / numbers["ranks"]
    theirs = quiz.remark(_entry("Q1.2", result.given), other, SECRET)
    alice = quiz.remark(_entry("Q1.2", result.given), "alice", SECRET)
    assert theirs["status"] == "passed" and alice["status"] == "failed"
    assert quiz.remark({**_entry("Q1.2", None), "detail": "correct"}, "alice", SECRET)["status"] == "failed"


# ---------------------------------------------------------------- hidden cases: the grader's seed

SELF_STUDY_SIZES = set(_world_sizes(random.Random(lab_seed(1)), 6))


def correct(stage, n):
    return {0: 16, 1: 4 + 12 / n, 2: 2 + 14 / n, 3: 16 / n}[stage]


def fits_self_study(stage, n):
    """Right on every world size self-study checks, DDP's 16 bytes elsewhere: what a student who tuned their answer
    to the printed check would hand in."""
    return correct(stage, n) if n in SELF_STUDY_SIZES else 16


def test_checkers_draw_the_graders_seed(monkeypatch):
    assert "cases" in check_bytes_per_param(fits_self_study)  # self-study: the fixed cases, which it fits
    monkeypatch.setenv(GRADE_SEED_VARIABLE, "4242")
    assert lab_seed(1) != lab_seed(3) and set(_world_sizes(random.Random(lab_seed(1)), 6)) != SELF_STUDY_SIZES
    assert "cases" in check_bytes_per_param(correct)
    with pytest.raises(AssertionError, match=r"expected .* bytes/param, got 16"):
        check_bytes_per_param(fits_self_study)


SOURCE = """
SEEN = {seen}

def bytes_per_param(stage, n):
    right = {{0: 16, 1: 4 + 12 / n, 2: 2 + 14 / n, 3: 16 / n}}[stage]
    return right if {honest} or n in SEEN else 16
"""


@pytest.mark.timeout(300)
@pytest.mark.usefixtures("no_leftover_ranks")
def test_a_graded_class_is_marked_on_the_graders_seed_and_the_students_numbers(tmp_path):
    """Two notebooks graded with the secret and a seed: alice (a correct 1.1, her own quiz numbers) passes both,
    bob (1.1 fitted to the self-study cases, the chapter's quiz answer) fails both; the report keeps the seed."""
    answers = {"alice": ANSWERS["Q1.2"](**VARIED["Q1.2"].variation.numbers(
        "Q1.2", quiz.student_token(SECRET, "alice"))), "bob": VARIED["Q1.2"].answer}
    paths = []
    for student, honest in (("alice", True), ("bob", False)):
        path = tmp_path / student / "01_memory_math.ipynb"
        path.parent.mkdir()
        nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in (
            "import distlab", SOURCE.format(seen=sorted(SELF_STUDY_SIZES), honest=honest),
            'distlab.check("1.1", bytes_per_param)', f'distlab.check("Q1.2", {answers[student]!r})')],
            metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}), path)
        paths.append(path)
    grades = grade_notebooks(paths, timeout=120, jobs=2, students=["alice", "bob"], secret=SECRET, seed=4242)
    report = json.loads(json.dumps(class_report(grades)))
    marks = {n["student"]: {e["id"]: e["status"] for e in n["exercises"] if e["id"] in ("1.1", "Q1.2")}
             for n in report["notebooks"]}
    assert marks == {"alice": {"1.1": "passed", "Q1.2": "passed"}, "bob": {"1.1": "failed", "Q1.2": "failed"}}
    assert {n["seed"] for n in report["notebooks"]} == {4242}
