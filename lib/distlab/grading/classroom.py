"""Grading a class: run every student's notebook headless, grade its exercises apart, report per student and exercise.

Grades come only from processes the students' code cannot reach. In order:

1. **Run.** Every notebook (read once, before any runs, so none can change another) is copied into a private
   folder and run top to bottom in its own kernel, forked warm from a :class:`~distlab.runtime.kernels.KernelFactory`,
   with an environment that holds no secret (:func:`~distlab.runtime.confine.clean_environment`); several at once
   where cores allow. A ``distlab.check`` there only says that the grader checks it apart. What the run gives the
   grade: which cells ran, the cells that raised, and, asked of the kernel after the last cell, each quiz answer
   as plain text (a number typed by the student is their answer whatever route it takes).
2. **Clear.** Every process the notebooks left is ended (the grader adopts orphans: ``setsid`` and double forks
   included), and the files Python imports from must be as they were
   (:class:`~distlab.runtime.confine.InstallationWatch`): a notebook that edited an installed module (a checker)
   or dropped a ``.pth`` file stops the grading.
3. **Grade.** Each exercise whose check line ran is graded in a process of its own forked from a factory that
   never ran a student's code, on the statements its check line needs (:mod:`distlab.grading.definitions`), the
   student's code at arm's length in a sandbox and on ranks (:mod:`distlab.grading.isolation`). Quiz answers are
   marked here, in the grader's process, varied ones against the student's own numbers
   (:func:`~distlab.grading.quiz.remark`). Exercises of the lab with no check line that ran score 0 as "not run".
4. **Report.** :func:`class_report` and :func:`format_report` turn the grades into the JSON and the text
   ``distlab grade`` prints; the exports (:mod:`distlab.grading.submissions`) are written from them, by the
   grader, after every student's process has ended.
"""

from __future__ import annotations

import ast
import asyncio
import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from queue import Empty

import nbformat
from nbclient.exceptions import CellTimeoutError, DeadKernelError
from nbclient.util import ensure_async

from distlab.grading import DEFERRED_VARIABLE, outcome
from distlab.grading.cells import cells_to_skip
from distlab.grading.contract import MARKS, CheckResult, first_line
from distlab.grading.definitions import check_lines, quiz_expressions
from distlab.grading.isolation import ExerciseGraders
from distlab.grading.quiz import remark
from distlab.grading.registry import all_exercises, exercises_of_lab, lab_modules, lab_number, sort_key
from distlab.grading.submissions import content_hash, student_names
from distlab.runtime import confine
from distlab.runtime.kernels import KernelFactory, kernel_manager_class, notebook_client

__all__ = ["DEFAULT_THRESHOLD", "DEFAULT_TIMEOUT", "NotebookGrade", "default_jobs", "grade_notebooks", "grade_notebook",
           "class_report", "format_report", "InstallationChanged"]

InstallationChanged = confine.InstallationChanged
# distlab's own files, watched too: an editable install lies outside the folders on sys.path
_PACKAGE = Path(__file__).resolve().parents[1]

DEFAULT_THRESHOLD = 1.0  # a notebook passes with every point: a lab is done when every check is ✓
DEFAULT_TIMEOUT = 600.0  # seconds per notebook
ANSWER_WAIT = 30.0  # seconds the kernel gets to answer the grader's request for the quiz answers
EXERCISE_TIMEOUT = 300.0  # seconds an exercise's grading process may take at least (--timeout when that is more)
_ANSWER_LIMIT = 10_000  # characters of a quiz answer's text the grader reads


@dataclass
class NotebookGrade:
    path: str
    student: str = ""
    exercises: list[dict] = field(default_factory=list)
    error: str | None = None  # execution stopped early: a time limit, a dead kernel
    cell_errors: list[dict] = field(default_factory=list)  # cells that raised: cell, ename, message
    seconds: float = 0.0  # running the notebook and grading its exercises
    startup: float = 0.0  # seconds before the first cell ran: kernel start and connection
    slowest_cells: list[list] = field(default_factory=list)  # [cell index, seconds], the three slowest
    sha256: str = ""  # the notebook's content when graded: ``--changed`` regrades only what differs
    submitted: str | None = None  # ISO time, when a deadline was given
    late: bool | None = None  # submitted after the deadline (None: no deadline given)
    reused: bool = False  # taken from the previous report (``--changed``): same student, same content
    skipped_cells: int = 0  # demo and benchmark cells no check needs, left out (:mod:`distlab.grading.cells`)
    seed: int | None = None  # the seed of the hidden cases it was graded on (``distlab grade --seed`` replays it)
    graded_seconds: float = 0.0  # of ``seconds``, grading the exercises apart

    @property
    def points(self) -> int:
        return sum(e["points"] for e in self.exercises)

    @property
    def max_points(self) -> int:
        return sum(e["max_points"] for e in self.exercises)

    @property
    def fraction(self) -> float:
        return self.points / self.max_points if self.max_points else 0.0

    @property
    def lab(self) -> int | None:
        return lab_number(Path(self.path))


@dataclass
class _Run:
    """What running one notebook gave the grader: the notebook as read, the cells that ran, its quiz answers."""

    path: Path
    grade: NotebookGrade
    notebook: nbformat.NotebookNode | None = None
    ran: set = field(default_factory=set)
    answers: dict = field(default_factory=dict)  # question id -> ("ok", text) | (error name, message)


def default_jobs(notebooks: int) -> int:
    """Notebooks graded at once: one per two cores (a lab's ranks keep about two busy), at least one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(notebooks, cores // 2))


# ---------------------------------------------------------------- 1. run each notebook

async def _ask_answers(kc, expressions: dict[str, str], wait: float) -> dict | None:
    """The quiz answers, as the kernel's plain text of each expression (the grader's own execute request after the
    last cell), or None when the kernel did not answer."""
    if not expressions:
        return {}
    plain = "__import__('distlab.runtime.payload', fromlist=['plain']).plain"
    asked = {question: f"repr({plain}({expression}))" for question, expression in expressions.items()}
    msg_id = await ensure_async(kc.execute("", silent=True, store_history=False, user_expressions=asked))
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            msg = await ensure_async(kc.shell_channel.get_msg(timeout=1))
        except Empty:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        found = {}
        for question, value in (msg["content"].get("user_expressions") or {}).items():
            if not isinstance(value, dict) or question not in asked:
                continue
            if value.get("status") == "ok":
                found[question] = ("ok", str(value.get("data", {}).get("text/plain", ""))[:_ANSWER_LIMIT])
            else:
                found[question] = (str(value.get("ename", "error")), first_line(str(value.get("evalue", ""))))
        return found
    return None


async def _run_then_ask(client, env: dict, skip: set[int], expressions) -> tuple[dict | None, CellTimeoutError | None]:
    """Run every cell but ``skip`` as nbclient's ``async_execute`` does, then, in the same kernel, ask for the quiz
    answers (:func:`_ask_answers`; ``expressions`` maps each question to what to ask, given the cells that ran).

    A cell past its time limit interrupts the kernel (a loop or a launch ends with KeyboardInterrupt) and the
    answers are asked for all the same."""
    stopped = None
    async with client.async_setup_kernel(env=env):
        info = await client.async_wait_for_reply(await ensure_async(client.kc.kernel_info()))
        if info is not None and "language_info" in info["content"]:
            client.nb.metadata["language_info"] = info["content"]["language_info"]
        try:
            for index, cell in enumerate(client.nb.cells):
                if index not in skip:
                    await client.async_execute_cell(cell, index, execution_count=client.code_cells_executed + 1)
        except CellTimeoutError as error:
            stopped = error
            await ensure_async(client.km.interrupt_kernel())
        answers = await _ask_answers(client.kc, expressions(), ANSWER_WAIT)
    return answers, stopped


async def _run_one(run: _Run, manager_class, timeout: float, cell_timeout: float | None, all_cells: bool,
                   folder: Path, questions: list[str]) -> None:
    """Run ``run``'s notebook in ``folder`` (a private copy), recording what ran, what raised and its answers."""
    grade, notebook = run.grade, run.notebook
    started = time.monotonic()
    deadline = started + timeout
    running: dict = {"cell": None, "started": {}, "seconds": {}}
    folder.mkdir(parents=True)
    copy = folder / run.path.name
    nbformat.write(notebook, copy)
    client = notebook_client(notebook, copy, manager_class, True,
                             lambda cell: max(1.0, min(cell_timeout or timeout, deadline - time.monotonic())))

    def cell_start(cell, cell_index):
        running["cell"] = cell_index
        running["started"][cell_index] = time.monotonic()

    def cell_executed(cell, cell_index, execute_reply):
        running["seconds"][cell_index] = time.monotonic() - running["started"][cell_index]

    client.on_cell_start, client.on_cell_executed = cell_start, cell_executed
    try:
        skip = set() if all_cells else cells_to_skip(notebook)
        grade.skipped_cells = len(skip)
        env = confine.clean_environment(folder, **{DEFERRED_VARIABLE: "1"})
        answers, stopped = await _run_then_ask(
            client, env, skip, lambda: quiz_expressions(notebook, set(running["seconds"]), questions))
        run.answers = answers or {}
        if stopped is not None:
            over = "its time limit" if time.monotonic() >= deadline - 1 else "the cell time limit"
            grade.error = f"stopped after {timeout if over == 'its time limit' else cell_timeout:g} s " \
                          f"({over}) while cell {running['cell']} was running"
        elif answers is None:
            grade.error = f"the kernel did not answer the grader within {ANSWER_WAIT:g} s after the last cell"
    except DeadKernelError:
        grade.error = f"the kernel died while cell {running['cell']} was running"
    except Exception as error:  # noqa: BLE001  a kernel that never started, a broken notebook
        grade.error = f"{type(error).__name__}: {first_line(error)}"
    # A cell counts as run once the kernel replied for it (a cell that raised included): not the one a time limit
    # or a dead kernel stopped, whose check line may never have been reached.
    run.ran = set(running["seconds"])
    grade.cell_errors = [
        {"cell": index, "ename": output.get("ename", ""), "message": first_line(output.get("evalue", ""))}
        for index, cell in enumerate(notebook.cells) if cell.cell_type == "code"
        for output in cell.get("outputs", []) if output.get("output_type") == "error"]
    grade.seconds = time.monotonic() - started
    if running["started"]:
        grade.startup = min(running["started"].values()) - started
    slowest = sorted(running["seconds"].items(), key=lambda item: -item[1])[:3]
    grade.slowest_cells = [[index, round(seconds, 2)] for index, seconds in slowest]


def _read(path: Path, student: str, seed: int | None) -> _Run:
    grade = NotebookGrade(str(path), student, seed=seed)
    try:
        data = path.read_bytes()
        grade.sha256 = content_hash(path)
        notebook = nbformat.reads(data.decode("utf-8"), as_version=4)
    except Exception as error:  # noqa: BLE001  not a notebook: a result, not a crash of the grader
        notebook = None
        grade.error = f"not a readable notebook: {first_line(error) or type(error).__name__}"
    return _Run(path, grade, notebook)


# ---------------------------------------------------------------- 3. grade each exercise apart

def _not_run(exercise, detail: str) -> dict:
    """An exercise the grader could not score, with the same fields as every scored one (the report's readers and
    exports take every entry alike)."""
    return asdict(CheckResult(exercise.id, exercise.title, "not run", 0, exercise.points, detail, exercise.label))


def _quiz_result(exercise, answer) -> dict:
    """A question marked here, in the grader's own process, on the answer's plain text from the kernel."""
    if answer is None:
        return _not_run(exercise, "its cell never ran")
    kind, text = answer
    if kind == "NameError":
        return _not_run(exercise, "its cell never ran")
    if kind != "ok":
        return {**_not_run(exercise, ""), "status": "failed", "detail": f"its answer could not be read ({kind}: "
                                                                          f"{text})"}
    value = _answer_value(text)
    return asdict(outcome(exercise, value))


def _answer_value(text: str):
    """The value of a quiz answer from the kernel's text: the ``repr`` of the answer, itself shown as a ``repr``.
    Literals only (never evaluated): a number, a string, ``None``, ``...``, ``inf``/``nan``; else the text itself."""
    try:
        inner = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text
    if not isinstance(inner, str):
        return inner
    special = {"Ellipsis": ..., "inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}
    if inner in special:
        return special[inner]
    try:
        return ast.literal_eval(inner)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return inner


def _grade_exercises(run: _Run, graders: ExerciseGraders, seed: int | None, secret: bytes | None,
                     timeout: float, watch: confine.InstallationWatch) -> None:
    grade, notebook = run.grade, run.notebook
    started = time.monotonic()
    number = lab_number(run.path)
    expected = exercises_of_lab(number) if number is not None else {}
    lines = check_lines(notebook, run.ran) if notebook is not None else {}
    known = all_exercises() if any(i not in expected for i in lines) else expected
    ids = sorted(set(expected) | {i for i in lines if i in known}, key=sort_key)
    for exercise_id in ids:
        exercise = known[exercise_id]
        line = lines.get(exercise_id)
        if exercise.is_quiz:
            entry = _quiz_result(exercise, run.answers.get(exercise_id)) if notebook is not None and (
                run.ran) else _not_run(exercise, "its cell never ran")
        elif line is None:
            entry = _not_run(exercise, "its check cell never ran")
        else:
            request = {"exercise": exercise_id, "seed": seed, "expressions": list(line.expressions),
                       "definitions": line.definitions.to_json()}
            entry = graders.grade(request, timeout) or {
                **_not_run(exercise, ""), "status": "failed",
                "detail": f"its grading did not finish within {timeout:g} s (or ended without a result)"}
            changed = watch.changes()
            if changed:
                raise InstallationChanged(f"while {grade.student}'s exercise {exercise_id} was graded, files Python "
                                          f"imports from changed: {'; '.join(changed[:3])}: no grade of this run "
                                          "counts")
        grade.exercises.append(entry)
    if secret is not None:  # varied quiz questions: marked here, against the student's numbers
        grade.exercises = [remark(entry, grade.student, secret) for entry in grade.exercises]
    grade.graded_seconds = time.monotonic() - started
    grade.seconds += grade.graded_seconds


# ---------------------------------------------------------------- the class, start to end

def grade_notebooks(paths, timeout: float = DEFAULT_TIMEOUT, jobs: int | None = None, warm: bool = True,
                    cell_timeout: float | None = None, progress=None,
                    students: list[str] | None = None, all_cells: bool = False, secret: bytes | None = None,
                    seed: int | None = None) -> list[NotebookGrade]:
    """Run each notebook headless (``jobs`` at a time, each within ``timeout`` seconds), then grade its exercises
    apart (the module's docstring); the grades in the order of ``paths``.

    ``seed`` (the grader's, fresh per grading run) draws every check's hidden cases; without it they are the
    fixed self-study ones. With the course ``secret`` each varied quiz question is marked against the student's
    own numbers (:func:`~distlab.grading.quiz.remark`), whatever the notebook asked.

    ``warm`` forks every kernel from one :class:`KernelFactory` (Linux); ``progress(done, total, grade)``
    is called as each notebook's grade is final. Cells no check needs are left out
    (:func:`~distlab.grading.cells.cells_to_skip`) unless ``all_cells``. Raises :class:`InstallationChanged`
    when a notebook changed a file Python imports from: no grade of that run can be trusted.
    """
    paths = [Path(p) for p in paths]
    names = students or student_names([str(p) for p in paths])
    jobs = jobs or default_jobs(len(paths))
    runs = [_read(path, name, seed) for path, name in zip(paths, names)]  # before any notebook runs
    base = Path(tempfile.mkdtemp(prefix="distlab-grade-"))
    before = set(confine.descendants())  # a caller's own processes (a test session's ranks) are not the students'
    sealed, adopting = confine.seal_memory(), confine.keep_orphans()
    watching: list = []  # set up beside the kernel factory's start: it walks every folder Python imports from
    watcher = threading.Thread(target=lambda: watching.append(confine.InstallationWatch(roots=(str(_PACKAGE),))))
    watcher.start()

    def watch() -> confine.InstallationWatch:
        watcher.join()
        return watching[0]

    def cleared(when: str) -> None:
        confine.end_descendants(spare=tuple(before))
        changed = watch().changes()
        if changed:
            raise InstallationChanged(f"{when}, files Python imports from changed: {'; '.join(changed[:3])}: a "
                                      "notebook may have changed what grades it; no grade of this run counts")

    try:
        _run_all(runs, base, timeout, jobs, warm, cell_timeout, all_cells, watch)
        cleared("while the notebooks ran")
        graders = ExerciseGraders(_checkers_of(paths), confine.clean_environment(base / "graders", **{
            DEFERRED_VARIABLE: "1"}))
        done, lock = [], threading.Lock()

        def grade_one(run: _Run) -> None:
            _grade_exercises(run, graders, seed, secret, max(timeout, EXERCISE_TIMEOUT), watch())
            with lock:
                done.append(run)
                if progress:
                    progress(len(done), len(runs), run.grade)

        try:
            with ThreadPoolExecutor(max_workers=jobs) as pool:
                list(pool.map(grade_one, runs))
        finally:
            graders.close()
        cleared("while exercises were graded")
    finally:
        watcher.join()
        for made in watching:
            made.close()
        confine.end_descendants(spare=tuple(before))
        if adopting:
            confine.keep_orphans(False)
        if sealed:
            confine.seal_memory(False)
        shutil.rmtree(base, ignore_errors=True)
    return [run.grade for run in runs]


def _run_all(runs: list[_Run], base: Path, timeout: float, jobs: int, warm: bool, cell_timeout: float | None,
             all_cells: bool, watch) -> None:
    """Step 1 for every notebook, ``jobs`` at a time, each in its private folder under ``base``; the installation
    is watched (``watch()`` waits for it) before the first cell runs."""
    factory = None
    if warm and KernelFactory.available():
        try:  # the kernels import their labs' checkers (and through them the topics'): once, in the factory
            factory = KernelFactory(preload=_checkers_of([r.path for r in runs]),
                                    env=confine.clean_environment(base / "kernels", **{DEFERRED_VARIABLE: "1"}))
        except Exception as error:  # noqa: BLE001  grading still works, only slower
            print(f"warm kernels unavailable ({first_line(error) or type(error).__name__}); starting a fresh "
                  "kernel per notebook", file=sys.stderr)

    async def run_all() -> None:
        gate = asyncio.Semaphore(jobs)

        async def one(index: int, run: _Run) -> None:
            if run.notebook is None:
                return
            number = lab_number(run.path)
            questions = [i for i, e in (exercises_of_lab(number) if number is not None else {}).items() if e.is_quiz]
            async with gate:
                await _run_one(run, manager_class, timeout, cell_timeout, all_cells, base / "notebooks" / str(index),
                               questions)

        await asyncio.gather(*(one(i, run) for i, run in enumerate(runs)))

    workdir = base / "connections"
    workdir.mkdir()
    try:
        manager_class = kernel_manager_class(str(workdir), factory)
        watch()
        asyncio.run(run_all())
    finally:
        if factory is not None:
            factory.close()


def _checkers_of(paths: list[Path]) -> list[str]:
    """The checker modules of the labs these notebooks belong to (every lab's when a name does not say its lab):
    what their kernels and grading processes import. The other labs' would cost every grading run seconds, and
    their topics would ask the forkserver to preload modules these ranks never use."""
    numbers = {lab_number(p) for p in paths}
    return [f"distlab.grading.{name}" for name in lab_modules() if None in numbers or int(name[3:]) in numbers]


def grade_notebook(path: Path, timeout: float = DEFAULT_TIMEOUT, cell_timeout: float | None = None,
                   warm: bool = False, all_cells: bool = False) -> NotebookGrade:
    """Grade one notebook (a fresh kernel, unless ``warm``); see :func:`grade_notebooks`."""
    return grade_notebooks([path], timeout=timeout, jobs=1, warm=warm, cell_timeout=cell_timeout,
                           all_cells=all_cells)[0]


# ---------------------------------------------------------------- the class report


def class_report(grades: list[NotebookGrade], threshold: float = DEFAULT_THRESHOLD,
                 min_pass: int | None = None) -> dict:
    """Per-student and per-exercise results as JSON-ready data, and whether the class is ``ok``:
    every notebook passed (at least ``threshold`` of its points), or at least ``min_pass`` did."""
    students = sorted(grades, key=lambda g: (g.lab if g.lab is not None else -1, -g.fraction, g.student))
    rank: dict[int | None, int] = {}
    notebooks = []
    for g in students:
        rank[g.lab] = rank.get(g.lab, 0) + 1
        notebooks.append(dict(asdict(g), lab=g.lab, rank=rank[g.lab], points=g.points, max_points=g.max_points,
                              fraction=round(g.fraction, 4), passed=g.fraction >= threshold - 1e-9,
                              seconds=round(g.seconds, 1), startup=round(g.startup, 2)))
    exercises = {}
    known = all_exercises()
    for g in grades:
        for e in g.exercises:
            varied = known[e["id"]].variation if e["id"] in known else None
            title = varied.template if varied is not None else e["title"]  # "... on {ranks} ranks": per student
            row = exercises.setdefault(e["id"], {"id": e["id"], "title": title, "max_points": e["max_points"],
                                                 "passed": 0, "failed": 0, "not attempted": 0, "not run": 0})
            row[e["status"]] = row.get(e["status"], 0) + 1
    for row in exercises.values():
        attempts = row["passed"] + row["failed"] + row["not attempted"] + row["not run"]
        row["pass_rate"] = round(row["passed"] / attempts, 4) if attempts else 0.0
    passed = sum(n["passed"] for n in notebooks)
    total, maximum = sum(g.points for g in grades), sum(g.max_points for g in grades)
    return {
        "threshold": threshold, "min_pass": min_pass, "notebooks_passed": passed, "notebook_count": len(grades),
        "ok": passed == len(grades) if min_pass is None else passed >= min_pass,
        "points": total, "max_points": maximum, "fraction": round(total / maximum, 4) if maximum else 0.0,
        "seconds": round(sum(g.seconds for g in grades), 1),
        "exercises": sorted(exercises.values(), key=lambda r: (r["pass_rate"], sort_key(r["id"]))),
        "notebooks": notebooks,
    }


def _key_note(key) -> str:
    """`` [answer: 1.5]`` for a quiz key, "" for none; numbers as short as they are exact (``%g``)."""
    if key is None:
        return ""
    return f" [answer: {key:g}]" if isinstance(key, float | int) else f" [answer: {key}]"


def format_report(report: dict, answers: bool = False) -> str:
    """The class report as text: per lab a ranked table of students × exercises, the exercises from
    hardest to easiest, each failure's reason, and the verdict with the threshold it applied.

    A failed quiz question shows its hint, never its key; ``answers`` (``distlab grade --answers``, for an
    instructor after the deadline) adds the key beside each wrong answer: the student's own, for a question
    graded with per-student numbers."""
    keys = {i: e.answer for i, e in all_exercises().items() if e.is_quiz} if answers else {}
    threshold, lines = report["threshold"], []
    default = " (the default)" if threshold == DEFAULT_THRESHOLD else ""
    labs = list(dict.fromkeys(n["lab"] for n in report["notebooks"]))
    for lab in labs:
        rows = [n for n in report["notebooks"] if n["lab"] == lab]
        ids = sorted({e["id"] for n in rows for e in n["exercises"]}, key=sort_key)
        name_w = max([len("student")] + [len(n["student"]) for n in rows])
        points_w = max([len("points")] + [len(f"{n['points']}/{n['max_points']}") for n in rows])
        head = f"{'rank':>4}  {'student':<{name_w}}  {'points':>{points_w}}  {'%':>4}  " + " ".join(
            f"{i:^{max(len(i), 1)}}" for i in ids) + "  result  seconds"
        title = f"lab {lab:02d}" if lab is not None else "notebooks"
        lines += [f"{title}: {len(rows)} notebook(s); pass = at least {threshold:.0%} of the points "
                  f"(--threshold {threshold:g}{default})", head]
        for n in rows:
            status = {e["id"]: e["status"] for e in n["exercises"]}
            marks = " ".join(f"{MARKS.get(status.get(i), ' '):^{max(len(i), 1)}}" for i in ids)
            score = f"{n['points']}/{n['max_points']}"
            lines.append(f"{n['rank']:>4}  {n['student']:<{name_w}}  {score:>{points_w}}  "
                         f"{n['fraction']:>4.0%}  {marks}  {'pass' if n['passed'] else 'FAIL':<6}  {n['seconds']:>7.0f}"
                         + ("  late" if n.get("late") else "") + (f"  {n['error']}" if n["error"] else ""))
        lines.append("marks: ✓ passed  ✗ failed  · not attempted  - not run")
        lab_ids = set(ids)
        rows_e = [r for r in report["exercises"] if r["id"] in lab_ids]
        if rows_e:
            title_w = max(len(r["title"]) for r in rows_e)
            lines.append("exercises, hardest first:")
            for r in rows_e:
                lines.append(f"  {r['id']:<6}{r['title']:<{title_w}}  {r['max_points']:>2} pt  passed "
                             f"{r['passed']:>3}/{len(rows):<3}  failed {r['failed']:>3}  not attempted "
                             f"{r['not attempted']:>3}  not run {r['not run']:>3}")
        failures = [(n["student"], e) for n in rows for e in n["exercises"] if e["status"] == "failed"]
        if failures:
            lines.append("why checks failed:")
            key = (lambda e: e.get("answer", keys.get(e["id"]))) if answers else (lambda e: None)
            lines += [f"  {who}  {e['id']}: {e['detail']}{_key_note(key(e))}" for who, e in failures]
        lines.append("")
    passed, count, min_pass = report["notebooks_passed"], report["notebook_count"], report["min_pass"]
    rule = f"at least {min_pass} must pass (--min-pass)" if min_pass is not None else "every notebook must pass"
    lines.append(f"{passed} of {count} notebook(s) passed the {threshold:.0%} threshold; {rule}: "
                 f"{'ok, exit status 0' if report['ok'] else 'not ok, exit status 1'}")
    return "\n".join(lines)
