"""Solutions → labs, executing notebooks, and grading a class of them.

``solutions/NN_slug.ipynb`` is the source of truth. A lab is the same notebook
with every ``# BEGIN SOLUTION N.k`` … ``# END SOLUTION`` block replaced by a
stub that raises ``NotImplementedError("Exercise N.k: …")`` and all outputs
cleared. Grading executes a notebook headless with ``DISTLAB_GRADE_REPORT``
set, so every ``distlab.check`` call lands in a JSON-lines file we total.

Grading a class is mostly start-up: a fresh kernel imports torch and distlab,
and its first launch starts a forkserver that imports torch again, seconds of
CPU per notebook before any student code runs. A :class:`KernelFactory` pays
that once: one process imports everything and starts distlab's forkserver, and
each notebook gets a kernel *forked* from it (its own process, nothing shared
with the other students' kernels but the read-only imports and the forkserver
its ranks are started from). Several notebooks run at once where cores allow.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import nbformat

from distlab.grading import REPORT_ENV, STUB_MESSAGE
from distlab.grading.registry import exercises_of_lab, sort_key

REPO_ROOT = Path(__file__).resolve().parents[2]
SOLUTION_BLOCK = re.compile(
    r"^(?P<indent>[ \t]*)# BEGIN SOLUTION (?P<id>\d+\.\d+)[^\n]*\n(?P<body>.*?)^[ \t]*# END SOLUTION[^\n]*(?:\n|\Z)",
    re.MULTILINE | re.DOTALL,
)
# A one-line answer: ``q4_1 = 1.5  # SOLUTION Q4.1`` becomes ``q4_1 = ...  # your answer``.
SOLUTION_LINE = re.compile(
    r"^(?P<head>[ \t]*[\w.\[\]'\"]+[ \t]*=[ \t]*)(?P<value>[^\n]*?)[ \t]*#[ \t]*SOLUTION[ \t]+(?P<id>Q?\d+\.\d+)[ \t]*$",
    re.MULTILINE,
)
_MARKER = re.compile(r"#\s*(BEGIN SOLUTION|END SOLUTION|SOLUTION\b)")
# nbval's cell markers are test plumbing: solutions keep them, students never see them.
_NBVAL_LINE = re.compile(r"^[ \t]*#[ \t]*NBVAL_[A-Z_]+\b[^\n]*(?:\n|\Z)", re.MULTILINE)


# Where the course is published. The Colab and Kaggle badges and the install cell at the top of every
# lab point here: a fork that publishes its own copy changes these two lines and runs `make labs`.
COURSE_REPOSITORY = "github.com/distlab-course/distlab"
COURSE_BRANCH = "main"

class NotebookError(ValueError):
    """A solution notebook that cannot be turned into a lab (unbalanced markers…)."""


# ---------------------------------------------------------------- solutions → labs

def strip_solutions(source: str, where: str = "") -> str:
    """Replace each solution block with a stub at the block's indentation."""
    def stub(match: re.Match) -> str:
        message = STUB_MESSAGE.format(id=match["id"])
        return f'{match["indent"]}raise NotImplementedError("{message}")\n'

    stripped = SOLUTION_BLOCK.sub(stub, source)
    stripped = SOLUTION_LINE.sub(lambda m: f"{m['head']}...  # your answer", stripped)
    leftover = _MARKER.search(stripped)
    if leftover:
        line = stripped[: leftover.start()].count("\n") + 1
        raise NotebookError(f"{where}: unmatched '{leftover.group(0)}' marker at line {line} of the cell")
    return stripped


def make_lab(solution: nbformat.NotebookNode, where: str = "") -> nbformat.NotebookNode:
    lab = nbformat.from_dict(json.loads(json.dumps(solution)))
    for index, cell in enumerate(lab.cells):
        if cell.cell_type != "code":
            continue
        cell.source = _NBVAL_LINE.sub("", strip_solutions(cell.source, f"{where} cell {index}"))
        cell.outputs = []
        cell.execution_count = None
    return lab


def hosted_cells(lab_name: str) -> list[nbformat.NotebookNode]:
    """Badges that open ``labs/<lab_name>`` on Colab or Kaggle, and the cell that installs distlab there.

    A hosted runtime starts with torch but without distlab or the course's files, so the first code
    cell fetches the repository and installs it, pinned to the platform's torch (its CUDA build must
    stay). Anywhere else (``make lab``, conda, the grader, CI) the cell does nothing, so the same lab
    runs everywhere unchanged.
    """
    blob = f"{COURSE_REPOSITORY}/blob/{COURSE_BRANCH}/labs/{lab_name}"
    badges = nbformat.v4.new_markdown_cell(
        f"[![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
        f"(https://colab.research.google.com/github/{blob.removeprefix('github.com/')}) "
        f"[![Open in Kaggle](https://kaggle.com/static/images/open-in-kaggle.svg)]"
        f"(https://kaggle.com/kernels/welcome?src=https://{blob}) · on Kaggle turn on *Internet* and, "
        f"for NCCL ranks, the *GPU T4 ×2* accelerator; distlab uses every GPU it sees.")
    install = nbformat.v4.new_code_cell(
        "# Colab / Kaggle only: fetch the course and install distlab beside the platform's own torch\n"
        "import importlib.util, os, subprocess, sys\n"
        "hosted = \"google.colab\" in sys.modules or \"KAGGLE_KERNEL_RUN_TYPE\" in os.environ\n"
        "if hosted and importlib.util.find_spec(\"distlab\") is None:\n"
        "    import torch\n"
        "    with open(\"keep-torch.txt\", \"w\") as pin:  # pip must keep the platform's CUDA build of torch\n"
        "        pin.write(f\"torch=={torch.__version__}\\n\")\n"
        f"    subprocess.run([\"git\", \"clone\", \"--quiet\", \"--depth=1\", \"--branch={COURSE_BRANCH}\",\n"
        f"                    \"https://{COURSE_REPOSITORY}\", \"distlab-course\"], check=True)\n"
        "    subprocess.run([sys.executable, \"-m\", \"pip\", \"install\", \"--quiet\", \"-c\", \"keep-torch.txt\",\n"
        "                    \"-e\", \"distlab-course\"], check=True)\n"
        "    sys.path.insert(0, \"distlab-course/lib\")  # new processes see the install; this kernel needs the path")
    badges.id, install.id = "open-hosted", "install-hosted"  # fixed ids: `make labs` writes the same bytes twice
    return [badges, install]


def exercise_ids(notebook: nbformat.NotebookNode) -> list[str]:
    """Ids of every solution block and one-line answer, in notebook order."""
    return [m["id"] for cell in notebook.cells if cell.cell_type == "code"
            for pattern in (SOLUTION_BLOCK, SOLUTION_LINE) for m in pattern.finditer(cell.source)]


def build_labs(solutions_dir: Path, labs_dir: Path, check_only: bool = False) -> list[Path]:
    """Write (or, with ``check_only``, compare) every lab; return the labs that were out of date."""
    stale = []
    labs_dir.mkdir(parents=True, exist_ok=True)
    for solution_path in sorted(solutions_dir.glob("[0-9][0-9]_*.ipynb")):
        solution = nbformat.read(solution_path, as_version=4)
        lab = make_lab(solution, solution_path.name)
        after_title = int(bool(lab.cells) and lab.cells[0].cell_type == "markdown"
                          and lab.cells[0].source.startswith("# "))
        lab.cells[after_title:after_title] = hosted_cells(solution_path.name)
        text = nbformat.writes(lab) + "\n"
        lab_path = labs_dir / solution_path.name
        if not lab_path.exists() or lab_path.read_text(encoding="utf-8") != text:
            stale.append(lab_path)
            if not check_only:
                lab_path.write_text(text, encoding="utf-8")
    orphans = {p.name for p in labs_dir.glob("*.ipynb")} - {p.name for p in solutions_dir.glob("*.ipynb")}
    stale += [labs_dir / name for name in sorted(orphans)]
    if not check_only:
        for name in orphans:
            (labs_dir / name).unlink()
    return stale


# ---------------------------------------------------------------- kernels

# Started by jupyter_client as the "kernel": it asks the factory for a forked kernel, hands it its
# stdio and a lifeline (the kernel exits when this process does, however it ends), forwards signals
# (interrupts) and exits with the kernel's status. It imports nothing heavy, and has no braces:
# jupyter_client substitutes {names} in a kernel's arguments.
_KERNEL_SHIM = r"""
import json, os, signal, socket, sys
address, argv = sys.argv[1], sys.argv[2:]
sock = socket.socket(socket.AF_UNIX)
sock.connect(address)
lifeline_r, lifeline_w = os.pipe()
socket.send_fds(sock, [b"k"], [0, 1, 2, lifeline_r])
os.close(lifeline_r)
sock.sendall(json.dumps(dict(argv=argv, cwd=os.getcwd(), env=dict(os.environ))).encode() + b"\n")
stream = sock.makefile("rb")
pid = int(stream.readline())
def forward(signum, frame):
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass
for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2"):
    signal.signal(getattr(signal, name), forward)
line = stream.readline()
if not line.strip():
    forward(signal.SIGKILL, None)
sys.exit(int(line) if line.strip() else 1)
"""


class KernelFactory:
    """One process that imported ipykernel, torch, matplotlib and distlab and started distlab's
    forkserver; every kernel it makes is a fork of it, so a notebook starts warm.

    Forked kernels share nothing writable: each student's code runs in its own process,
    and its ranks are forked from the shared forkserver (which only ever imported torch).
    Linux only (it needs ``fork`` and passing file descriptors over a Unix socket).
    """

    READY_TIMEOUT = 180.0

    def __init__(self):
        if not self.available():
            raise RuntimeError("a warm kernel factory needs Linux (fork and Unix-socket fd passing)")
        self._dir = tempfile.mkdtemp(prefix="distlab-kernels-")
        self.address = os.path.join(self._dir, "factory")
        code = "import sys; from distlab.notebooks import serve_kernels; serve_kernels(sys.argv[1])"
        self._process = subprocess.Popen([sys.executable, "-c", code, self.address], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, start_new_session=True)
        import select

        ready, _, _ = select.select([self._process.stdout], [], [], self.READY_TIMEOUT)
        line = self._process.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            self.close()
            raise RuntimeError(f"the kernel factory did not start (it said {line!r})")

    @staticmethod
    def available() -> bool:
        return sys.platform.startswith("linux") and hasattr(socket, "send_fds") and hasattr(os, "fork")

    def kernel_argv(self) -> list[str]:
        return [sys.executable, "-c", _KERNEL_SHIM, self.address, "-f", "{connection_file}"]

    def close(self) -> None:
        """Stop the factory; kernels still running are ended by it."""
        if self._process.poll() is None:
            self._process.stdin.close()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process.stdout.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "KernelFactory":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve_kernels(address: str) -> None:
    """The factory process: import once, start the forkserver, then fork a kernel per request.

    Ends (and kills its kernels) when its standard input closes, i.e. when the grader ends.
    """
    import select
    import signal

    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    import ipykernel.kernelapp  # noqa: F401  what every kernel imports
    import matplotlib.pyplot  # noqa: F401
    import distlab.launcher
    from distlab.grading.registry import all_exercises

    all_exercises()  # imports every lab's checkers (and through them the topic modules)
    context = distlab.launcher._forkserver_context()
    if context.get_start_method() == "forkserver":
        # The server answers only once it has imported torch: fork one process through it now, so that
        # the kernels' first launch does not wait for those imports.
        probe = context.Process(target=os.getpid, name="distlab-factory-probe")
        probe.start()
        probe.join()
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    listener.listen(64)
    kernels: dict[int, socket.socket] = {}
    print("ready", flush=True)
    try:
        while True:
            ready, _, _ = select.select([listener, sys.stdin], [], [], 0.05)
            if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1024):
                return
            if listener in ready:
                conn, _ = listener.accept()
                _, fds, _, _ = socket.recv_fds(conn, 1, 4)
                request = json.loads(conn.makefile("rb").readline())
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    for other in [conn, *kernels.values()]:
                        other.close()
                    _become_kernel(request, fds)  # never returns
                for fd in fds:
                    os.close(fd)
                conn.sendall(f"{pid}\n".encode())
                kernels[pid] = conn
            for pid, conn in list(kernels.items()):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    try:
                        conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                    except OSError:
                        pass
                    conn.close()
                    del kernels[pid]
    finally:
        for pid in kernels:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _become_kernel(request: dict, fds: list[int]) -> None:
    """In a freshly forked child of the factory: become an IPython kernel, then exit."""
    import atexit
    import random
    import threading

    code = 1
    try:
        for target, fd in zip((0, 1, 2), fds[:3]):
            os.dup2(fd, target)
            os.close(fd)
        lifeline = fds[3]

        def exit_with_the_shim():
            while os.read(lifeline, 1):
                pass
            os._exit(1)

        threading.Thread(target=exit_with_the_shim, daemon=True, name="distlab-lifeline").start()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        random.seed()  # forked children would otherwise all draw the factory's random numbers
        import numpy

        numpy.random.seed()
        _adopt_forkserver()
        from ipykernel.kernelapp import IPKernelApp

        app = IPKernelApp.instance()
        # read from the environment when ipykernel was imported, i.e. in the factory: set it for this kernel
        app.parent_handle = int(os.environ.get("JPY_PARENT_PID") or 0)
        app.initialize(request["argv"])
        app.start()
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 0
    except BaseException:  # noqa: BLE001  reported on the kernel's stderr, then the kernel is gone
        import traceback

        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _adopt_forkserver() -> None:
    """A kernel forked from the factory starts its ranks from the factory's forkserver.

    The forked kernel inherits the server's address and "alive" pipe, but the server is
    not its child, so multiprocessing's own liveness check (``waitpid``) would fail: check
    with a signal 0 instead, and start a server of our own only if the factory's is gone.
    """
    from multiprocessing import forkserver, resource_tracker

    server = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    start_own = type(server).ensure_running.__get__(server)

    def ensure_running():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            if server._forkserver_alive_fd is not None:
                os.close(server._forkserver_alive_fd)
            server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None
            server.ensure_running = start_own
            return start_own()
        resource_tracker.ensure_running()

    server.ensure_running = ensure_running


def _kernel_manager_class(workdir: str, factory: KernelFactory | None = None):
    """An AsyncKernelManager over IPC sockets in ``workdir`` (no TCP port, so no "running over TCP
    without encryption" warning), whose kernels come from ``factory`` when one is given."""
    from jupyter_client import AsyncKernelManager
    from jupyter_client.kernelspec import KernelSpec

    class Manager(AsyncKernelManager):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            if os.name == "posix":
                self.transport = "ipc"
                self.ip = os.path.join(tempfile.mkdtemp(dir=workdir), "kernel")

        @property
        def kernel_spec(self):
            if factory is None:
                return super().kernel_spec
            return KernelSpec(argv=factory.kernel_argv(), display_name="Python 3 (distlab warm)", language="python")

    return Manager


# ---------------------------------------------------------------- execution

SHELL_POLL_SECONDS = 1.0


def _poll_shell_in_slices(channel) -> None:
    """Wait for shell replies in slices of :data:`SHELL_POLL_SECONDS` instead of one long wait.

    nbclient waits for a cell's ``execute_reply`` with a single ``get_msg(timeout=<the cell's
    whole time limit>)``. When the cell displays ipywidgets, nbclient also *sends* on the shell
    socket while that wait is pending, and the asyncio zmq poll can miss the reply's arrival
    (jupyter/nbclient#312): the kernel is idle, the reply sits in the socket, and the wait lasts
    until the time limit — a stub lab with a widget then "hung" for 600 s under load. A fresh
    poll sees the waiting message, so waiting in slices bounds that miss to one slice.
    """
    import queue

    wait = channel.get_msg

    async def get_msg(timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                return await wait(timeout=SHELL_POLL_SECONDS if left is None else min(SHELL_POLL_SECONDS, left))
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    channel.get_msg = get_msg


def _client(notebook: nbformat.NotebookNode, path: Path, manager_class, allow_errors: bool, timeout_func):
    from nbclient import NotebookClient

    class Client(NotebookClient):
        async def async_start_new_kernel_client(self):
            client = await super().async_start_new_kernel_client()
            _poll_shell_in_slices(client.shell_channel)
            return client

    return Client(notebook, timeout_func=timeout_func, allow_errors=allow_errors,
                  kernel_name=notebook.metadata.get("kernelspec", {}).get("name", "python3"),
                  kernel_manager_class=manager_class,
                  resources={"metadata": {"path": str(Path(path).resolve().parent)}})


def execute(path: Path, cell_timeout: int = 600, allow_errors: bool = False,
            env: dict[str, str] | None = None) -> nbformat.NotebookNode:
    """Run a notebook top to bottom in a fresh kernel, in its own folder; return it with outputs.

    Raises on the first cell error unless ``allow_errors``; ``env`` adds variables to the kernel's.
    """
    notebook = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory(prefix="distlab-exec-") as workdir:
        client = _client(notebook, path, _kernel_manager_class(workdir), allow_errors, lambda cell: cell_timeout)
        client.execute(env=dict(os.environ, **(env or {})))
    return notebook


# ---------------------------------------------------------------- grading

DEFAULT_THRESHOLD = 1.0  # a notebook passes with every point: a lab is done when every check is ✓
DEFAULT_TIMEOUT = 600.0  # seconds per notebook


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


def lab_number(path: Path) -> int | None:
    match = re.match(r"(\d+)_", Path(path).name)
    return int(match.group(1)) if match else None


def default_jobs(notebooks: int) -> int:
    """Notebooks graded at once: one per two cores (a lab's ranks keep about two busy), at least one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(notebooks, cores // 2))


def student_names(paths: list[str]) -> list[str]:
    """How the report names each notebook: its folder when every file has the same name
    (``submissions/alice/02_collectives.ipynb`` → ``alice``), else its file name."""
    paths = [Path(p) for p in paths]
    if len({p.name for p in paths}) == 1 and len({p.parent.name for p in paths}) == len(paths) > 1:
        return [p.parent.name for p in paths]
    stems = [p.stem for p in paths]
    return stems if len(set(stems)) == len(stems) else [str(p) for p in paths]


async def _grade_one(path: Path, student: str, manager_class, timeout: float, cell_timeout: float | None,
                     expected: dict) -> NotebookGrade:
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    grade = NotebookGrade(str(path), student)
    started = time.monotonic()
    deadline = started + timeout
    running: dict = {"cell": None, "started": {}, "seconds": {}}
    with tempfile.TemporaryDirectory(prefix="distlab-grade-") as tmp:
        report = Path(tmp) / "report.jsonl"
        report.touch()
        try:
            notebook = nbformat.read(path, as_version=4)
        except Exception as error:  # noqa: BLE001  not a notebook: a result, not a crash of the grader
            notebook = None
            grade.error = f"not a readable notebook: {_first_line(error)}"
        if notebook is not None:
            client = _client(notebook, path, manager_class, True,
                             lambda cell: max(1.0, min(cell_timeout or timeout, deadline - time.monotonic())))
            def cell_start(cell, cell_index):
                running["cell"] = cell_index
                running["started"][cell_index] = time.monotonic()

            def cell_executed(cell, cell_index, execute_reply):
                running["seconds"][cell_index] = time.monotonic() - running["started"][cell_index]

            client.on_cell_start, client.on_cell_executed = cell_start, cell_executed
            try:
                await client.async_execute(env=dict(os.environ, **{REPORT_ENV: str(report)}))
            except CellTimeoutError:
                over = "its time limit" if time.monotonic() >= deadline - 1 else "the cell time limit"
                grade.error = f"stopped after {timeout if over == 'its time limit' else cell_timeout:g} s " \
                              f"({over}) while cell {running['cell']} was running"
            except DeadKernelError:
                grade.error = f"the kernel died while cell {running['cell']} was running"
            except Exception as error:  # noqa: BLE001  a kernel that never started, a broken notebook
                grade.error = f"{type(error).__name__}: {_first_line(error)}"
            grade.cell_errors = [
                {"cell": index, "ename": output.get("ename", ""), "message": _first_line(output.get("evalue", ""))}
                for index, cell in enumerate(notebook.cells) if cell.cell_type == "code"
                for output in cell.get("outputs", []) if output.get("output_type") == "error"]
        reported = {}
        for line in report.read_text(encoding="utf-8").splitlines():
            result = json.loads(line)
            reported[result["id"]] = result  # the last check of an exercise counts
    for exercise_id in sorted(set(expected) | set(reported), key=sort_key):
        if exercise_id in reported:
            grade.exercises.append(reported[exercise_id])
        else:
            e = expected[exercise_id]
            grade.exercises.append({"id": e.id, "title": e.title, "status": "not run", "points": 0,
                                    "max_points": e.points, "detail": "its check cell never ran",
                                    "label": e.label})
    grade.seconds = time.monotonic() - started
    if running["started"]:
        grade.startup = min(running["started"].values()) - started
    slowest = sorted(running["seconds"].items(), key=lambda item: -item[1])[:3]
    grade.slowest_cells = [[index, round(seconds, 2)] for index, seconds in slowest]
    return grade


def grade_notebooks(paths, timeout: float = DEFAULT_TIMEOUT, jobs: int | None = None, warm: bool = True,
                    cell_timeout: float | None = None, progress=None) -> list[NotebookGrade]:
    """Execute each notebook headless (``jobs`` at a time, each within ``timeout`` seconds) and total its checks.

    ``warm`` forks every kernel from one :class:`KernelFactory` (Linux); ``progress(done, total, grade)``
    is called as each notebook finishes. Exercises of the notebook's lab that no check reported (a
    deleted check cell, a notebook stopped early) score 0 as "not run".
    """
    paths = [Path(p) for p in paths]
    names = student_names([str(p) for p in paths])
    jobs = jobs or default_jobs(len(paths))
    factory = None
    if warm and KernelFactory.available():
        try:
            factory = KernelFactory()
        except Exception as error:  # noqa: BLE001  grading still works, only slower
            print(f"warm kernels unavailable ({_first_line(error)}); starting a fresh kernel per notebook",
                  file=sys.stderr)

    async def grade_all() -> list[NotebookGrade]:
        gate = asyncio.Semaphore(jobs)
        done = []

        async def one(path: Path, name: str) -> NotebookGrade:
            async with gate:
                number = lab_number(path)
                grade = await _grade_one(path, name, manager_class, timeout, cell_timeout,
                                         exercises_of_lab(number) if number is not None else {})
            done.append(grade)
            if progress:
                progress(len(done), len(paths), grade)
            return grade

        return await asyncio.gather(*(one(p, n) for p, n in zip(paths, names)))

    workdir = tempfile.mkdtemp(prefix="distlab-grade-kernels-")
    try:
        manager_class = _kernel_manager_class(workdir, factory)
        return asyncio.run(grade_all())
    finally:
        if factory is not None:
            factory.close()
        shutil.rmtree(workdir, ignore_errors=True)


def grade_notebook(path: Path, timeout: float = DEFAULT_TIMEOUT, cell_timeout: float | None = None,
                   warm: bool = False) -> NotebookGrade:
    """Grade one notebook (a fresh kernel, unless ``warm``); see :func:`grade_notebooks`."""
    return grade_notebooks([path], timeout=timeout, jobs=1, warm=warm, cell_timeout=cell_timeout)[0]


def _first_line(error) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else (type(error).__name__ if isinstance(error, BaseException) else "")


# ---------------------------------------------------------------- the class report

_MARKS = {"passed": "✓", "failed": "✗", "not attempted": "·", "not run": "-"}


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
    for g in grades:
        for e in g.exercises:
            row = exercises.setdefault(e["id"], {"id": e["id"], "title": e["title"], "max_points": e["max_points"],
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


def format_report(report: dict) -> str:
    """The class report as text: per lab a ranked table of students × exercises, the exercises from
    hardest to easiest, each failure's reason, and the verdict with the threshold it applied."""
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
            marks = " ".join(f"{_MARKS.get(status.get(i), ' '):^{max(len(i), 1)}}" for i in ids)
            score = f"{n['points']}/{n['max_points']}"
            lines.append(f"{n['rank']:>4}  {n['student']:<{name_w}}  {score:>{points_w}}  "
                         f"{n['fraction']:>4.0%}  {marks}  {'pass' if n['passed'] else 'FAIL':<6}  {n['seconds']:>7.0f}"
                         + (f"  {n['error']}" if n["error"] else ""))
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
            lines += [f"  {who}  {e['id']}: {e['detail']}" for who, e in failures]
        lines.append("")
    passed, count, min_pass = report["notebooks_passed"], report["notebook_count"], report["min_pass"]
    rule = f"at least {min_pass} must pass (--min-pass)" if min_pass is not None else "every notebook must pass"
    lines.append(f"{passed} of {count} notebook(s) passed the {threshold:.0%} threshold; {rule}: "
                 f"{'ok, exit status 0' if report['ok'] else 'not ok, exit status 1'}")
    return "\n".join(lines)
