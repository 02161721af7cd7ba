"""Grading a class: run every student's notebook headless, total its checks, report per student and exercise.

Each notebook runs top to bottom in its own kernel; then the grader asks that kernel, in a request of its own,
for the results its ``distlab.check`` calls kept (:func:`distlab.grading.ledger`; after a time limit, once the
kernel is interrupted), so nothing the notebook prints or writes counts as a result. A notebook that rebinds
distlab's grading functions scores nothing. Exercises of the notebook's lab that no check reported score 0 as
"not run". Kernels are forked warm from one
:class:`~distlab.runtime.kernels.KernelFactory` that imported every lab's checkers once, and several
notebooks run at once where cores allow. :func:`class_report` and :func:`format_report` turn the
grades into the JSON and the text ``distlab grade`` prints.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from queue import Empty

import nbformat
from nbclient.exceptions import CellTimeoutError, DeadKernelError
from nbclient.util import ensure_async

from distlab.grading.cells import cells_to_skip
from distlab.grading.contract import MARKS, first_line
from distlab.grading.harness import GRADE_SEED_VARIABLE
from distlab.grading.quiz import remark
from distlab.grading.registry import all_exercises, exercises_of_lab, lab_modules, lab_number, sort_key
from distlab.grading.submissions import content_hash, student_names
from distlab.runtime.kernels import KernelFactory, kernel_manager_class, notebook_client

__all__ = ["DEFAULT_THRESHOLD", "DEFAULT_TIMEOUT", "NotebookGrade", "default_jobs", "grade_notebooks", "grade_notebook",
           "class_report", "format_report"]

DEFAULT_THRESHOLD = 1.0  # a notebook passes with every point: a lab is done when every check is ✓
DEFAULT_TIMEOUT = 600.0  # seconds per notebook
LEDGER_WAIT = 30.0  # seconds the kernel gets to answer the grader's request (after an interrupt, if it timed out)
# What the grader evaluates in the student's kernel after the last cell, as a user expression of its own request.
LEDGER_EXPRESSION = "__import__('distlab.grading', fromlist=['ledger']).ledger()"
# Code that rebinds distlab's checking (``distlab.check = ...``, ``grading._ledger[...] = ...``, setattr on it).
TAMPERING = re.compile(r"\bdistlab\.(?:grading\.)?\w+(?:\[[^]\n]*\])?\s*=(?!=)|\b_ledger\b|"
                       r"setattr\(\s*distlab\b|\bgrading\.\w+\s*=(?!=)")


@dataclass
class NotebookGrade:
    path: str
    student: str = ""
    exercises: list[dict] = field(default_factory=list)
    error: str | None = None  # execution stopped early: a time limit, a dead kernel
    cell_errors: list[dict] = field(default_factory=list)  # cells that raised: cell, ename, message
    seconds: float = 0.0
    startup: float = 0.0  # seconds before the first cell ran: kernel start and connection
    slowest_cells: list[list] = field(default_factory=list)  # [cell index, seconds], the three slowest
    sha256: str = ""  # the notebook's content when graded: ``--changed`` regrades only what differs
    submitted: str | None = None  # ISO time, when a deadline was given
    late: bool | None = None  # submitted after the deadline (None: no deadline given)
    reused: bool = False  # taken from the previous report (``--changed``): same student, same content
    skipped_cells: int = 0  # demo and benchmark cells no check needs, left out (:mod:`distlab.grading.cells`)
    seed: int | None = None  # the seed of the hidden cases it was graded on (``distlab grade --seed`` replays it)

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


def default_jobs(notebooks: int) -> int:
    """Notebooks graded at once: one per two cores (a lab's ranks keep about two busy), at least one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(notebooks, cores // 2))


async def _ask_ledger(kc, wait: float) -> list[dict] | None:
    """The kernel's check results, from the reply to the grader's own execute request (None: no reply)."""
    msg_id = await ensure_async(kc.execute("", silent=True, store_history=False,
                                           user_expressions={"ledger": LEDGER_EXPRESSION}))
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            msg = await ensure_async(kc.shell_channel.get_msg(timeout=1))
        except Empty:
            continue
        if msg["parent_header"].get("msg_id") == msg_id:
            value = msg["content"].get("user_expressions", {}).get("ledger", {})
            return json.loads(ast.literal_eval(value["data"]["text/plain"])) if value.get("status") == "ok" else []
    return None


async def _run_then_ask(client, env: dict, skip: set[int]) -> tuple[list[dict] | None, CellTimeoutError | None]:
    """Run every cell but ``skip`` as nbclient's ``async_execute`` does, then, in the same kernel, ask for the ledger.

    A cell past its time limit interrupts the kernel (a loop or a launch ends with KeyboardInterrupt) and the
    ledger is asked for all the same, so the checks that ran before it still count."""
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
        results = await _ask_ledger(client.kc, LEDGER_WAIT)
    return results, stopped


def _tampering(notebook: nbformat.NotebookNode) -> str | None:
    """Why this notebook's results cannot be trusted (a cell rebinds distlab's grading), or None."""
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type == "code" and (found := TAMPERING.search(cell.source)):
            return f"cell {index} changes distlab's grading ({found.group(0).strip()!r}): its checks score nothing"
    return None


async def _grade_one(path: Path, student: str, manager_class, timeout: float, cell_timeout: float | None,
                     expected: dict, all_cells: bool, secret: bytes | None = None,
                     seed: int | None = None) -> NotebookGrade:
    grade = NotebookGrade(str(path), student, sha256=content_hash(path) if path.is_file() else "", seed=seed)
    started = time.monotonic()
    deadline = started + timeout
    running: dict = {"cell": None, "started": {}, "seconds": {}}
    reported: dict[str, dict] = {}
    try:
        notebook = nbformat.read(path, as_version=4)
    except Exception as error:  # noqa: BLE001  not a notebook: a result, not a crash of the grader
        notebook = None
        grade.error = f"not a readable notebook: {first_line(error) or type(error).__name__}"
    if notebook is not None and (why := _tampering(notebook)):
        notebook, grade.error = None, why
    if notebook is not None:
        client = notebook_client(notebook, path, manager_class, True,
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
            env = dict(os.environ) if seed is None else {**os.environ, GRADE_SEED_VARIABLE: str(seed)}
            results, stopped = await _run_then_ask(client, env, skip)
            reported = {r["id"]: r for r in results or []}
            if stopped is not None:
                over = "its time limit" if time.monotonic() >= deadline - 1 else "the cell time limit"
                grade.error = f"stopped after {timeout if over == 'its time limit' else cell_timeout:g} s " \
                              f"({over}) while cell {running['cell']} was running"
            elif results is None:
                grade.error = f"the kernel did not answer the grader within {LEDGER_WAIT:g} s after the last cell"
        except DeadKernelError:
            grade.error = f"the kernel died while cell {running['cell']} was running"
        except Exception as error:  # noqa: BLE001  a kernel that never started, a broken notebook
            grade.error = f"{type(error).__name__}: {first_line(error)}"
        grade.cell_errors = [
            {"cell": index, "ename": output.get("ename", ""), "message": first_line(output.get("evalue", ""))}
            for index, cell in enumerate(notebook.cells) if cell.cell_type == "code"
            for output in cell.get("outputs", []) if output.get("output_type") == "error"]
    for exercise_id in sorted(set(expected) | set(reported), key=sort_key):
        if exercise_id in reported:
            grade.exercises.append(reported[exercise_id])
        else:
            e = expected[exercise_id]
            grade.exercises.append({"id": e.id, "title": e.title, "status": "not run", "points": 0,
                                    "max_points": e.points, "detail": "its check cell never ran",
                                    "label": e.label})
    if secret is not None:  # varied quiz questions: marked here, against the student's numbers
        grade.exercises = [remark(entry, student, secret) for entry in grade.exercises]
    grade.seconds = time.monotonic() - started
    if running["started"]:
        grade.startup = min(running["started"].values()) - started
    slowest = sorted(running["seconds"].items(), key=lambda item: -item[1])[:3]
    grade.slowest_cells = [[index, round(seconds, 2)] for index, seconds in slowest]
    return grade


def grade_notebooks(paths, timeout: float = DEFAULT_TIMEOUT, jobs: int | None = None, warm: bool = True,
                    cell_timeout: float | None = None, progress=None,
                    students: list[str] | None = None, all_cells: bool = False, secret: bytes | None = None,
                    seed: int | None = None) -> list[NotebookGrade]:
    """Execute each notebook headless (``jobs`` at a time, each within ``timeout`` seconds) and total its checks.

    ``seed`` (the grader's, fresh per grading run) draws every check's hidden cases; without it they are the
    fixed self-study ones. With the course ``secret`` each varied quiz question is marked against the student's
    own numbers (:func:`~distlab.grading.quiz.remark`), whatever the notebook asked.

    ``warm`` forks every kernel from one :class:`KernelFactory` (Linux); ``progress(done, total, grade)``
    is called as each notebook finishes. Exercises of the notebook's lab that no check reported (a
    deleted check cell, a notebook stopped early) score 0 as "not run". Cells no check needs are left out
    (:func:`~distlab.grading.cells.cells_to_skip`) unless ``all_cells``.
    """
    paths = [Path(p) for p in paths]
    names = students or student_names([str(p) for p in paths])
    jobs = jobs or default_jobs(len(paths))
    factory = None
    if warm and KernelFactory.available():
        try:  # the kernels import their labs' checkers (and through them the topics'): once, in the factory
            factory = KernelFactory(preload=_checkers_of(paths))
        except Exception as error:  # noqa: BLE001  grading still works, only slower
            print(f"warm kernels unavailable ({first_line(error) or type(error).__name__}); starting a fresh "
                  "kernel per notebook", file=sys.stderr)

    async def grade_all() -> list[NotebookGrade]:
        gate = asyncio.Semaphore(jobs)
        done = []

        async def one(path: Path, name: str) -> NotebookGrade:
            async with gate:
                number = lab_number(path)
                grade = await _grade_one(path, name, manager_class, timeout, cell_timeout,
                                         exercises_of_lab(number) if number is not None else {}, all_cells,
                                         secret, seed)
            done.append(grade)
            if progress:
                progress(len(done), len(paths), grade)
            return grade

        return await asyncio.gather(*(one(p, n) for p, n in zip(paths, names)))

    workdir = tempfile.mkdtemp(prefix="distlab-grade-kernels-")
    try:
        manager_class = kernel_manager_class(workdir, factory)
        return asyncio.run(grade_all())
    finally:
        if factory is not None:
            factory.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _checkers_of(paths: list[Path]) -> list[str]:
    """The checker modules of the labs these notebooks belong to (every lab's when a name does not say its lab):
    what their kernels import. The other labs' would cost every grading run seconds, and their topics would ask
    the forkserver to preload modules these ranks never use."""
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
