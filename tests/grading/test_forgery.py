"""Grades no student can forge: notebooks that try, graded together as ``distlab grade`` grades a class, score what
the untouched lab scores (0) on every exercise they did not solve, and the lab's solution graded beside them scores
full marks.

Each forger is the untouched generated lab (its stubs, blank quiz answers and demos) with one cell a student who
wants the marks without the work would add: the cell issue 43 found (it patched the kernel's ledger) and the same
cell run by ``exec`` from text no search of the sources finds, a ``json.dumps`` that rewrites every status it
writes, rebinding or patching the checkers in the kernel (``sys.modules``, ``gc``, ``builtins``, an import hook),
functions that patch the checker, ``torch.distributed`` or the reply channel when the grader calls them (on ranks
and in the sandbox), values, tensors and quiz answers that lie about equality (and a ``repr`` that hands the grader
code instead of an answer), a kernel that prints a passing line and exits, results files, a daemon that outlives
the notebook, reading the grader's environment and memory, ending the grader's forkserver, and editing an installed
checker. Lab 00 is the cheapest real lab (its checks run on ranks); lab 01's run in the sandbox (single-process
functions). All notebooks of a kind are graded in one run, so the suite pays for one kernel factory and one grader
factory. A count the student's own process takes of its calls is theirs to rewrite: a rank that rewrites its log of
collectives is caught by the kernel's counters of its sockets, read from the grading process.
"""

import base64
import json
import os
import time
from pathlib import Path

import nbformat
import pytest

from distlab.grading import classroom, wiretap
from distlab.grading.classroom import InstallationChanged, grade_notebooks
from distlab.grading.registry import exercises_of_lab

REPO = Path(__file__).resolve().parents[2]
LAB00, LAB01 = REPO / "labs" / "00_setup.ipynb", REPO / "labs" / "01_memory_math.ipynb"
SOLUTION00, SOLUTION01 = REPO / "solutions" / "00_setup.ipynb", REPO / "solutions" / "01_memory_math.ipynb"
SECRET_VARIABLE = "COURSE_API_TOKEN"  # stands for the instructor's credentials in the grader's environment
pytestmark = [pytest.mark.usefixtures("no_leftover_ranks")]


def _forger(lab: Path, attack: str, where: str = "last") -> nbformat.NotebookNode:
    """The untouched generated lab (its stubs, blank quiz answers and demos) with one cell added, as a student would
    add it: at the end (to change what the lab's cells reported, or to hand in definitions and check lines of its
    own, the latest of which counts), or ``where="first"``, right after the lab's import cell (to change what the
    lab's own check lines then check)."""
    notebook = nbformat.read(lab, as_version=4)
    cell = nbformat.v4.new_code_cell(attack)
    if where == "first":
        imports = next(i for i, c in enumerate(notebook.cells)
                       if c.cell_type == "code" and "import distlab" in c.source)
        notebook.cells.insert(imports + 1, cell)
    else:
        notebook.cells.append(cell)
    return notebook


# ---------------------------------------------------------------- what the forgers add

ISSUE_43_CELL = """import sys
m = sys.modules['distlab.' + 'grading']
book = getattr(m, '_' + 'ledger')
for r in book.values():
    r.status, r.points, r.detail = 'passed', r.max_points, 'ok'
"""

EXEC_BUILT_STRING = """import base64
# the issue's cell again, as text no search of the sources finds: decoded, then executed
exec(base64.b64decode(b"{payload}").decode())
"""

JSON_DUMPS = """import json
encode = json.JSONEncoder.encode
def passing(self, obj):  # whatever this kernel writes as JSON after this cell (json.dumps too) reads as passed
    text = encode(self, obj)
    for status in ('"not attempted"', '"failed"', '"not run"'):
        text = text.replace(status, '"passed"')
    return text
json.JSONEncoder.encode = passing
"""

QUIZ_LIARS = """import builtins


class Anything(float):  # equal to every answer key, if the grader compared the kernel's object
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = float.__hash__


q0_1 = q0_2 = q0_3 = q0_4 = q0_5 = Anything(0.0)
# the text the grader reads back for each answer: code, if the grader evaluated it rather than read it as data
builtins.repr = lambda obj: "__import__('os').system('touch {marker}') or 3"
"""

REBIND_CHECK = """import distlab, distlab.grading
def forged(exercise_id, *code, quiet=False):
    print(f"✓ Exercise {exercise_id}: 1/1 points (forged)")
distlab.check = distlab.grading.check = forged
"""

PATCH_CHECKERS = """import os, sys
os.environ.pop("DISTLAB_CHECKS_DEFERRED", None)  # run the kernel's own checks, on patched checkers
from distlab.grading.registry import Exercise
from distlab.grading import quiz
for name in ("distlab.grading.lab00", "distlab.grading.lab01"):
    module = sys.modules.get(name) or __import__(name, fromlist=["EXERCISES"])
    module.EXERCISES[:] = [Exercise(e.id, e.title, e.points, lambda *a: "forged") for e in module.EXERCISES]
    for attr in dir(module):
        if attr.startswith("check_"):
            setattr(module, attr, lambda *a: "forged")
sys.modules["distlab.grading.registry"].find_exercise.__globals__["exercises_of_lab"] = (
    lambda lab: {e.id: e for m in ("lab00", "lab01") for e in sys.modules["distlab.grading." + m].EXERCISES})
"""

GC_OBJECTS = """import gc
from distlab.grading.contract import CheckResult
from distlab.grading.registry import Exercise
for obj in gc.get_objects():
    if isinstance(obj, Exercise):
        object.__setattr__(obj, "checker", lambda *a: "forged")
    elif isinstance(obj, CheckResult):
        obj.status, obj.points = "passed", obj.max_points
    elif isinstance(obj, dict) and obj.get("status") in ("not attempted", "failed") and "max_points" in obj:
        obj.update(status="passed", points=obj["max_points"])
"""

BUILTINS = """import builtins
real_isinstance = builtins.isinstance
builtins.NotImplementedError = type("NotImplementedError", (Exception,), {})  # stubs no longer read as stubs
class Lenient(AssertionError):
    pass
import distlab.grading.contract as contract
contract.CheckFailed.__init__ = lambda self, *a: None
builtins.AssertionError = Lenient
"""

IMPORT_HOOK = """import importlib.abc, importlib.util, sys
class Forged(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.startswith("distlab.grading.lab0"):
            return importlib.util.spec_from_loader(name, self)
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        from distlab.grading.registry import Exercise
        module.EXERCISES = [Exercise(f"0.{k}", "forged", 1, lambda *a: "forged") for k in (1, 2)]
sys.meta_path.insert(0, Forged())
for name in list(sys.modules):
    if name.startswith("distlab.grading.lab0"):
        del sys.modules[name]
"""

PATCH_ON_CALL_RANKS = """def rank_sum():
    import sys, torch, torch.distributed as d
    for module in list(sys.modules.values()):  # the checker, the harness, the contract: whatever is loaded here
        for name in ("CheckFailed",):
            if hasattr(module, name) and getattr(module, "__name__", "").startswith("distlab"):
                setattr(module, name, type("Nothing", (Exception,), {}))
    d.all_reduce = lambda tensor, *a, **k: None
    return 99, 99, 99


def mean_across_ranks(tensor):
    import torch.distributed as d
    d.all_reduce = lambda tensor, *a, **k: None  # the reference all-reduce, if the rank computed one, sums nothing
    return tensor / d.get_world_size()


result = distlab.check("0.1", rank_sum)
result = distlab.check("0.2", mean_across_ranks)
"""

LIARS = """class Anything:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    def __index__(self):
        return 0


class AnyTensor(torch.Tensor):
    def __eq__(self, other):
        return torch.ones_like(self, dtype=torch.bool)
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        result = super().__torch_function__(func, types, args, kwargs or {})
        return result.zero_() if isinstance(result, torch.Tensor) and result.is_floating_point() else result


def rank_sum():
    return Anything(), Anything(), Anything()


def mean_across_ranks(tensor):
    return tensor.as_subclass(AnyTensor)


result = distlab.check("0.1", rank_sum)
result = distlab.check("0.2", mean_across_ranks)
"""

EXIT_AFTER_PRINT = """import os
for line in ("✓ Exercise 0.1 ranks, world size and a first all-reduce: 1/1 points",
             "✓ Exercise 0.2 the mean across ranks: 1/1 points", "7/7 points"):
    print(line, flush=True)
os._exit(0)
"""

CRAFTED_RANK_REPLY = """def rank_sum():
    import os, pickle, distlab.runtime.payload as payload
    class Payload:
        def __reduce__(self):
            return os.system, ("touch {marker}",)
    payload.dumps = lambda value: pickle.dumps(Payload())  # what the rank sends back: code, if the grader ran it
    return 0, 0, 0


result = distlab.check("0.1", rank_sum)
"""

CRAFTED_SANDBOX_REPLY = """def bytes_per_param(zero_stage, world_size):
    import gc, os, pickle
    from multiprocessing.connection import Connection
    class Payload:
        def __reduce__(self):
            return os.system, ("touch {marker}",)
    for conn in [o for o in gc.get_objects() if isinstance(o, Connection)]:  # the sandbox's line to the grader
        conn.send_bytes(pickle.dumps(("ok", Payload())))
    os._exit(0)


result = distlab.check("1.1", bytes_per_param)
"""

PATCH_ON_CALL_SANDBOX = """def bytes_per_param(zero_stage, world_size):
    import builtins, math, sys
    checker = sys.modules.get("distlab.grading.lab01")
    if checker is not None:
        checker._compare = lambda *a, **k: None
        checker.bytes_per_param = lambda *a, **k: type("T", (), {"total": 0})()
    math.isclose = lambda *a, **k: True
    builtins.float = lambda *a: 0.0
    return 0


result = distlab.check("1.1", bytes_per_param)
"""

LIAR_NUMBER = """class Sixteen(float):
    def __eq__(self, other):
        return True
    def __sub__(self, other):
        return 0.0
    __rsub__ = __sub__


def bytes_per_param(zero_stage, world_size):
    return Sixteen(0.0)


def activation_bytes_per_layer(seq_len, batch, d_model, n_head):
    return Sixteen(0.0)


result = distlab.check("1.1", bytes_per_param)
result = distlab.check("1.2", activation_bytes_per_layer)
"""

EXIT_IN_SANDBOX = """def bytes_per_param(zero_stage, world_size):
    import os
    print("✓ Exercise 1.1: 2/2 points", flush=True)
    os._exit(0)


result = distlab.check("1.1", bytes_per_param)
"""

DEFINITION_SIDE_EFFECT = """import sys


class Quiet:  # a class body runs where the definitions are loaded: it patches whatever checker is there
    for name in list(sys.modules):
        if name.startswith("distlab.grading.lab01"):
            sys.modules[name].__dict__.update(_compare=lambda *a, **k: None, _number=lambda *a, **k: 0.0)


def bytes_per_param(zero_stage, world_size, quiet=Quiet):
    return 0


result = distlab.check("1.1", bytes_per_param)
"""

RESULTS_FILES = """import json, os, pathlib
fake = {{"id": "0.1", "title": "x", "status": "passed", "points": 1, "max_points": 1, "detail": "forged"}}
report = {{"notebooks": [{{"student": "forger", "points": 7, "max_points": 7, "exercises": [fake]}}]}}
for folder in (os.getcwd(), os.path.expanduser("~"), os.path.dirname(os.getcwd()), {outside!r}):
    for name in ("report.jsonl", "grades.json", "results.json", "ledger.json"):
        try:
            pathlib.Path(folder, name).write_text(json.dumps(report))
        except OSError:
            pass
print(json.dumps(fake))
"""

DAEMON = """import os, sys, time
if os.fork() == 0:  # a double fork in a session of its own: no parent of it is left to end it
    os.setsid()
    if os.fork() == 0:
        open({pid_file!r}, "w").write(str(os.getpid()))
        end = time.time() + 120
        while time.time() < end:  # keep rewriting what the grader writes last: the report
            try:
                open({target!r}, "w").write("forged by a daemon")
            except OSError:
                pass
            time.sleep(0.05)
    os._exit(0)
time.sleep(0.5)
"""

SNOOP = """import json, os
found = {{"environ": dict(os.environ), "cwd": os.getcwd(), "listing": sorted(os.listdir(".")),
          "parent_listing": sorted(os.listdir(".."))}}
try:
    with open(f"/proc/{grader_pid}/mem", "rb") as memory:
        memory.read(1)
    found["grader_memory"] = "read"
except OSError as error:
    found["grader_memory"] = type(error).__name__
try:
    found["grader_environ"] = open(f"/proc/{grader_pid}/environ", "rb").read().decode(errors="replace")
except OSError as error:
    found["grader_environ"] = type(error).__name__
open({out!r}, "w").write(json.dumps(found))
"""

KILL_THE_FORKSERVER = """def rank_sum():
    import os, socket
    server = os.getppid()  # the grader's forkserver: every rank is its child, and later exercises need it
    sockets = {os.readlink(f"/proc/{server}/fd/{fd}")[8:-1] for fd in os.listdir(f"/proc/{server}/fd")
               if os.readlink(f"/proc/{server}/fd/{fd}").startswith("socket:")}
    for line in open("/proc/net/unix").read().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[6] in sockets and fields[7].startswith("@"):
            client = socket.socket(socket.AF_UNIX)
            client.connect("\\0" + fields[7][1:])
            client.close()  # no descriptors sent: CPython's forkserver ends
    return 0, 0, 0


result = distlab.check("0.1", rank_sum)
"""

FORGED_COUNT = """def rank_sum():
    import torch.distributed as d
    from distlab.runtime import comm
    stats = comm.current_log().ops["all_reduce"]  # the rank's own count of its calls: no all-reduce was made
    stats.calls, stats.payload_bytes = stats.calls + 1, stats.payload_bytes + 8  # as the solution's int64 would
    return d.get_rank(), d.get_world_size(), d.get_world_size() * (d.get_world_size() - 1) // 2


result = distlab.check("0.1", rank_sum)
"""

TOUCH_THE_CHECKER = """import os
os.utime({checker!r})  # as a student editing an installed checker would: the file changes, what grades is theirs
"""


# ---------------------------------------------------------------- grading them, once per kind


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """Every forger, the two untouched labs and the two solutions, graded in one run of what ``distlab grade`` runs
    (:func:`grade_notebooks`, in this process: the snooping forger reads this process's memory; the seconds are
    reported)."""
    folder = tmp_path_factory.mktemp("forgery")
    marker = folder / "pwned"
    lab00 = {
        "untouched00": nbformat.read(LAB00, as_version=4),
        "issue43": _forger(LAB00, ISSUE_43_CELL),
        "exec": _forger(LAB00, EXEC_BUILT_STRING.format(payload=base64.b64encode(ISSUE_43_CELL.encode()).decode())),
        "json": _forger(LAB00, JSON_DUMPS, where="first"),
        "rebind": _forger(LAB00, REBIND_CHECK, where="first"),
        "checkers": _forger(LAB00, PATCH_CHECKERS, where="first"),
        "gc": _forger(LAB00, GC_OBJECTS),
        "builtins": _forger(LAB00, BUILTINS, where="first"),
        "hook": _forger(LAB00, IMPORT_HOOK, where="first"),
        "on_call": _forger(LAB00, PATCH_ON_CALL_RANKS),
        "liars": _forger(LAB00, LIARS),
        "quiz_liars": _forger(LAB00, QUIZ_LIARS.format(marker=marker)),
        "exit": _forger(LAB00, EXIT_AFTER_PRINT),
        "rank_reply": _forger(LAB00, CRAFTED_RANK_REPLY.format(marker=marker)),
        "files": _forger(LAB00, RESULTS_FILES.format(outside=str(folder))),
        "daemon": _forger(LAB00, DAEMON.format(pid_file=str(folder / "daemon.pid"),
                                               target=str(folder / "report.json"))),
        "snoop": _forger(LAB00, SNOOP.format(grader_pid=os.getpid(), out=str(folder / "snooped.json"))),
        "count": _forger(LAB00, FORGED_COUNT),
        "forkserver": _forger(LAB00, KILL_THE_FORKSERVER),
    }
    lab01 = {
        "untouched01": nbformat.read(LAB01, as_version=4),
        "sandbox_reply": _forger(LAB01, CRAFTED_SANDBOX_REPLY.format(marker=marker)),
        "sandbox_patch": _forger(LAB01, PATCH_ON_CALL_SANDBOX),
        "liar_number": _forger(LAB01, LIAR_NUMBER),
        "sandbox_exit": _forger(LAB01, EXIT_IN_SANDBOX),
        "side_effect": _forger(LAB01, DEFINITION_SIDE_EFFECT),
    }
    paths = {}
    for lab, notebooks in ((LAB00, lab00), (LAB01, lab01)):
        for name, notebook in notebooks.items():
            paths[name] = folder / name / lab.name
            paths[name].parent.mkdir()
            nbformat.write(notebook, paths[name])
    for name, solution in (("solved00", SOLUTION00), ("solved01", SOLUTION01)):
        paths[name] = folder / name / solution.name
        paths[name].parent.mkdir()
        paths[name].write_bytes(solution.read_bytes())
    os.environ[SECRET_VARIABLE] = "instructor-only"
    started = time.monotonic()
    try:
        grades = grade_notebooks(list(paths.values()), timeout=120, students=list(paths), seed=4343)
    finally:
        del os.environ[SECRET_VARIABLE]
    seconds = time.monotonic() - started
    print(f"graded {len(paths)} notebooks in {seconds:.0f} s")
    (folder / "report.json").write_text(json.dumps({g.student: g.points for g in grades}))
    return {g.student: g for g in grades}, folder, marker


FORGERS = ["issue43", "exec", "json", "rebind", "checkers", "gc", "builtins", "hook", "on_call", "liars",
           "quiz_liars", "exit", "rank_reply", "files", "daemon", "snoop", "forkserver", "sandbox_reply",
           "sandbox_patch", "liar_number", "sandbox_exit", "side_effect"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("forger", FORGERS)
def test_a_forger_scores_what_the_untouched_lab_scores(graded, forger):
    grades, _, _ = graded
    grade = grades[forger]
    lab = 1 if "01_" in grade.path else 0
    untouched = grades[f"untouched0{lab}"]
    assert untouched.error is None and untouched.points == 0 and untouched.max_points == grade.max_points > 0
    assert {e["id"] for e in grade.exercises} == set(exercises_of_lab(lab)), grade.exercises
    assert grade.points == untouched.points, [
        (e["id"], e["status"], e["detail"]) for e in grade.exercises if e["points"]]
    assert all(e["status"] in ("not attempted", "failed", "not run") for e in grade.exercises)


@pytest.mark.timeout(900)
@pytest.mark.skipif(not wiretap.available(), reason="the kernel's per-socket counters are read through Linux's "
                    "sock_diag: elsewhere 0.1 reads the ranks' own count (course/instructor_guide.md says so)")
def test_a_rank_that_rewrites_its_own_count_of_collectives_scores_nothing(graded):
    """A count the rank takes of its own calls is the student's to rewrite: 0.1 holds it against the bytes the
    kernel counted on the ranks' sockets (distlab.grading.wiretap), and a record that disagrees scores 0."""
    grades, _, _ = graded
    exercise = {e["id"]: e for e in grades["count"].exercises}["0.1"]
    assert exercise["status"] == "failed" and "disagrees with what the kernel saw" in exercise["detail"], exercise


@pytest.mark.timeout(900)
def test_the_solutions_graded_beside_them_score_full_marks(graded):
    """Graded after every forger (one of them ended the grader's forkserver, which the factory starts again)."""
    grades, _, _ = graded
    for name in ("solved00", "solved01"):
        grade = grades[name]
        assert grade.error is None and grade.points == grade.max_points > 0, [
            (e["id"], e["status"], e["detail"]) for e in grade.exercises if e["status"] != "passed"]


@pytest.mark.timeout(900)
def test_the_issue_43_cell_changes_nothing(graded):
    """The issue's attempt (the kernel's ledger rewritten) against the untouched lab: 0/7, as without the cell."""
    grades, _, _ = graded
    assert grades["issue43"].max_points == 7 and grades["issue43"].points == 0
    statuses = {name: [(e["id"], e["status"]) for e in grades[name].exercises] for name in ("issue43", "untouched00")}
    assert statuses["issue43"] == statuses["untouched00"] and {s for _, s in statuses["issue43"]} == {"not attempted"}


@pytest.mark.timeout(900)
def test_what_forgers_tried_to_run_in_the_grader_never_ran(graded):
    """Crafted replies from a rank and from the sandbox would have run ``touch`` in the grading process."""
    grades, _, marker = graded
    assert not marker.exists()
    replies = {e["id"]: e for name in ("rank_reply", "sandbox_reply") for e in grades[name].exercises}
    assert replies["0.1"]["status"] == replies["1.1"]["status"] == "failed"


@pytest.mark.timeout(900)
def test_a_daemon_the_notebook_started_is_ended_before_anything_is_graded(graded):
    _, folder, _ = graded
    pid = int((folder / "daemon.pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    report = (folder / "report.json").read_text()
    time.sleep(0.3)
    assert (folder / "report.json").read_text() == report and "forged" not in report


@pytest.mark.timeout(900)
def test_a_notebook_sees_no_secret_no_classmate_and_not_the_graders_memory(graded):
    _, folder, _ = graded
    found = json.loads((folder / "snooped.json").read_text())
    assert SECRET_VARIABLE not in found["environ"] and "instructor-only" not in json.dumps(found)
    assert found["environ"]["HOME"].startswith(found["cwd"]) and found["listing"] == ["00_setup.ipynb", "home", "tmp"]
    assert not any(name.endswith(".ipynb") for name in found["parent_listing"])  # no classmate beside it
    if os.geteuid() != 0:  # root may read any process's memory: grade as a user (course/instructor_guide.md)
        assert found["grader_memory"] == "PermissionError" and found["grader_environ"] == "PermissionError"


@pytest.mark.timeout(300)
def test_a_notebook_that_edits_an_installed_checker_stops_the_grading(tmp_path, monkeypatch):
    """No grade of that run counts: the checker that would grade every later notebook may be the student's. (The
    installation stands in a folder of this test's: editing the real one would stop every grading run beside it;
    that the real one is watched is tests/grading/test_integrity.py's.)"""
    installed = tmp_path / "installed"
    installed.mkdir()
    (installed / "lab00.py").write_text("EXERCISES = []\n")
    monkeypatch.setattr(classroom, "_PACKAGE", installed)
    path = tmp_path / "00_setup.ipynb"
    nbformat.write(_forger(LAB00, TOUCH_THE_CHECKER.format(checker=str(installed / "lab00.py"))), path)
    with pytest.raises(InstallationChanged, match=r"lab00\.py \(attributes changed\)"):
        grade_notebooks([path], timeout=60)
