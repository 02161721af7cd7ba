"""The Jupyter kernels notebooks run in: forked warm from one factory process, and the client that drives them.

A fresh kernel imports torch and distlab, and its first launch starts a forkserver that imports torch
again: seconds of CPU per notebook before any of its cells runs. A :class:`KernelFactory` pays that
once: one process imports everything (and whatever modules its caller names, e.g. every lab's checkers)
and starts distlab's forkserver, and each notebook gets a kernel *forked* from it (its own process,
nothing shared with the other kernels but the read-only imports and the forkserver its ranks are
started from). :func:`kernel_manager_class` and :func:`notebook_client` run a notebook on such a kernel,
or on a fresh one. The factory itself is a :class:`ForkFactory`, which ``distlab grade`` also uses for the
processes that grade each exercise apart from the student's kernel (:mod:`distlab.grading.isolation`).

Linux only for the factory (``fork`` and file descriptors passed over a Unix socket); everywhere else
kernels start fresh. Who preloads what is the caller's business: this module imports nothing of
distlab outside the runtime.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import queue
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing import forkserver, resource_tracker
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy

from distlab.runtime import confine, group
from distlab.runtime.group import forkserver_context
from distlab.runtime.output import HEADLESS_ENV

if TYPE_CHECKING:  # only annotations name it: importing nbformat imports jsonschema, which compiles a grammar
    import nbformat  # (about a second of CPU) in every grading and factory process that never reads a notebook

__all__ = ["ForkFactory", "KernelFactory", "serve_forks", "adopt_forkserver", "disown_forkserver",
           "kernel_manager_class", "notebook_client", "SHELL_POLL_SECONDS"]

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


class ForkFactory:
    """One process that imported ipykernel's and distlab's dependencies and the modules in ``preload``, and started
    distlab's forkserver; each request forks a child of it that runs ``child`` (``"module:function"``, called
    with the request and the file descriptors that came with it), so the child starts warm.

    ``preload`` names what every child will import anyway (a grader passes the labs' checker modules, and
    through them the topics'): imported once here, before the forks, it costs each child nothing; ``rank_preload``
    what every rank its children start will import (a grading process's jobs unpickle the checker's workers).
    Forked children share nothing writable, and their ranks are forked from the shared forkserver (which only
    ever imported torch). ``env`` is the factory's whole environment, and so its children's: a factory whose
    children run students' code gets one without the grader's secrets
    (:func:`~distlab.runtime.confine.clean_environment`); ``isolated`` starts it with ``python -I``, so it imports
    only from the installation (:func:`~distlab.runtime.confine.import_path`).
    The factory's memory cannot be read by its children's processes, and it ends the processes they leave behind
    (:mod:`distlab.runtime.confine`). Linux only (``fork`` and passing file descriptors over a Unix socket).
    """

    READY_TIMEOUT = 180.0

    def __init__(self, child: str, preload: Sequence[str] = (), env: dict | None = None, isolated: bool = False,
                 rank_preload: Sequence[str] = ()):
        if not self.available():
            raise RuntimeError("a warm factory needs Linux (fork and Unix-socket fd passing)")
        self._dir = tempfile.mkdtemp(prefix="distlab-forks-")
        self.address = os.path.join(self._dir, "factory")
        code = ("import sys, json; from distlab.runtime.kernels import serve_forks; "
                "serve_forks(*sys.argv[1:3], **json.loads(sys.argv[3]))")
        flags = ["-I"] if isolated else []  # -I: no current folder, PYTHON* variables or user site on its path
        lists = json.dumps({"preload": list(preload), "rank_preload": list(rank_preload)})
        self._process = subprocess.Popen([sys.executable, *flags, "-c", code, self.address, child, lists],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
                                         env=env)
        self.pid = self._process.pid
        ready, _, _ = select.select([self._process.stdout], [], [], self.READY_TIMEOUT)
        line = self._process.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            self.close()
            raise RuntimeError(f"the factory did not start (it said {line!r})")

    @staticmethod
    def available() -> bool:
        return sys.platform.startswith("linux") and hasattr(socket, "send_fds") and hasattr(os, "fork")

    def fork(self, request: dict, fds: Sequence[int]) -> tuple[socket.socket, int]:
        """Fork a child for ``request`` (JSON), handing it ``fds``; the connection (which says the child's exit
        status when it ends, then closes) and the child's pid."""
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(self.address)
        socket.send_fds(sock, [b"k"], list(fds))
        sock.sendall(json.dumps(request).encode() + b"\n")
        stream = sock.makefile("rb")
        return sock, int(stream.readline())

    def close(self) -> None:
        """Stop the factory; children still running are ended by it."""
        if self._process.poll() is None:
            self._process.stdin.close()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process.stdout.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class KernelFactory(ForkFactory):
    """A :class:`ForkFactory` of IPython kernels: each notebook gets a kernel forked from it, so it starts warm
    (:func:`kernel_manager_class` asks it for one through :data:`_KERNEL_SHIM`)."""

    def __init__(self, preload: Sequence[str] = (), env: dict | None = None):
        super().__init__("distlab.runtime.kernels:_become_kernel", ("ipykernel.kernelapp", "matplotlib.pyplot",
                                                                    *preload), env)

    def kernel_argv(self) -> list[str]:
        return [sys.executable, "-c", _KERNEL_SHIM, self.address, "-f", "{connection_file}"]


def serve_forks(address: str, child: str, preload: Sequence[str] = (), rank_preload: Sequence[str] = ()) -> None:
    """The factory process: import once (``preload`` too), start the forkserver (which imports ``rank_preload``
    too, so the ranks the children start have it), then fork a child per request that runs ``child``
    (``"module:function"``, which never returns).

    Ends (and kills its children) when its standard input closes, i.e. when its owner ends. Every second it ends
    the processes its children left behind: as a subreaper it adopts them, and any child of it that is neither
    one it forked nor the forkserver is such an orphan.
    """
    # A kernel factory preloads matplotlib.pyplot, which chooses its backend when it is imported: set it first.
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    confine.seal_memory()
    confine.keep_orphans()
    for module in preload:
        importlib.import_module(module)
    module, function = child.split(":")
    become = getattr(importlib.import_module(module), function)
    group.preload(*rank_preload)
    context = forkserver_context()
    server_pid = _start_forkserver() if context.get_start_method() == "forkserver" else None
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    listener.listen(64)
    children: dict[int, socket.socket] = {}
    print("ready", flush=True)
    swept = time.monotonic()
    try:
        while True:
            ready, _, _ = select.select([listener, sys.stdin], [], [], 0.05)
            if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1024):
                return
            if listener in ready:
                conn, _ = listener.accept()
                _, fds, _, _ = socket.recv_fds(conn, 1, 8)
                request = json.loads(conn.makefile("rb").readline())
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    for other in [conn, *children.values()]:
                        other.close()
                    become(request, fds)  # never returns
                    os._exit(1)
                for fd in fds:
                    os.close(fd)
                conn.sendall(f"{pid}\n".encode())
                children[pid] = conn
            for pid, conn in list(children.items()):
                try:
                    done, status = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:  # collected already: its status is lost, and the shim ends its kernel
                    done, status = pid, 1 << 8
                if done:
                    try:
                        conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                    except OSError:
                        pass
                    conn.close()
                    del children[pid]
            if time.monotonic() - swept > 1.0:
                swept = time.monotonic()
                if context.get_start_method() == "forkserver":
                    server_pid = _revive_forkserver(server_pid)
                tracker = getattr(resource_tracker._resource_tracker, "_pid", None)  # multiprocessing's helper
                _end_strays(set(children) | {server_pid, tracker})
    finally:
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _end_strays(known: set) -> None:
    """Kill the factory's children it did not fork (orphans it adopted) and collect them; the children it forked
    are collected by the serving loop, which must see their exit status."""
    for pid in confine.children():
        if pid in known:
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, PermissionError, ChildProcessError):
            pass


def _become_kernel(request: dict, fds: list[int]) -> None:
    """In a freshly forked child of the factory: become an IPython kernel, then exit."""
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
        confine.seal_memory(False)  # the factory's memory is sealed; a kernel's is the student's own
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        random.seed()  # forked children would otherwise all draw the factory's random numbers
        numpy.random.seed()
        adopt_forkserver()
        from ipykernel.kernelapp import IPKernelApp  # noqa: PLC0415  imported by the factory before it forked

        app = IPKernelApp.instance()
        # read from the environment when ipykernel was imported, i.e. in the factory: set it for this kernel
        app.parent_handle = int(os.environ.get("JPY_PARENT_PID") or 0)
        app.initialize(request["argv"])
        app.start()
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 0
    except BaseException:  # noqa: BLE001  reported on the kernel's stderr, then the kernel is gone
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def adopt_forkserver() -> None:
    """A kernel forked from the factory starts its ranks from the factory's forkserver.

    The forked kernel inherits the server's address and "alive" pipe, but the server is
    not its child, so multiprocessing's own liveness check (``waitpid``) would fail: check
    that the process is there and not a zombie instead, and start a server of our own only if
    the factory's is gone.
    """
    server = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return

    def ensure_running():
        if not _running(pid):
            disown_forkserver()
            return server.ensure_running()
        resource_tracker.ensure_running()

    server.ensure_running = ensure_running


def disown_forkserver() -> None:
    """Forget the forkserver this process inherited (a dead one, or one a process of a student's must not share):
    its next launch starts a server of its own."""
    server = getattr(forkserver, "_forkserver", None)
    if server is None:
        return
    if server._forkserver_alive_fd is not None:
        try:
            os.close(server._forkserver_alive_fd)
        except OSError:
            pass
    server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None
    server.__dict__.pop("ensure_running", None)  # multiprocessing's own again, for a server of this process


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended (a zombie, not yet collected by its parent, has)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    status = confine.process_status(pid)
    return status is None or status[0] != "Z"  # no /proc: signal 0 is all there is


def _revive_forkserver(pid: int | None) -> int | None:
    """The factory's forkserver, started again if it died (CPython's ends when a client disconnects before it has
    sent its descriptors, as one a student's code killed would), so the next child finds one; its pid."""
    if pid is None or _running(pid):
        return pid
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
    disown_forkserver()
    return _start_forkserver()


def _start_forkserver() -> int:
    """Start the factory's forkserver, which every child it forks will share, without waiting for it; its pid.

    The server imports torch and its preload list (seconds) before it answers: meanwhile the factory says it is
    ready and its children start (a kernel's first cells, a grader's reading), and a child's first launch waits
    only for what is left of those imports. Waiting here instead would add them to every grading run's start."""
    forkserver.ensure_running()
    return forkserver._forkserver._forkserver_pid


def kernel_manager_class(workdir: str, factory: KernelFactory | None = None):
    """An AsyncKernelManager over IPC sockets in ``workdir`` (no TCP port, so no "running over TCP
    without encryption" warning), whose kernels come from ``factory`` when one is given and run headless
    (:data:`~distlab.runtime.output.HEADLESS_ENV`)."""
    from jupyter_client import AsyncKernelManager  # noqa: PLC0415  only running a notebook needs jupyter_client
    from jupyter_client.kernelspec import KernelSpec  # noqa: PLC0415  as above

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

        async def start_kernel(self, **kw):
            # Nobody watches these kernels live: rank output as plain text and no progress bars
            # (distlab.runtime.output.audience), so an executed notebook holds what nbval compares.
            kw["env"] = {**(kw.get("env") or os.environ), HEADLESS_ENV: "1"}
            return await super().start_kernel(**kw)

    return Manager


# ---------------------------------------------------------------- driving a notebook

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


def notebook_client(notebook: nbformat.NotebookNode, path: Path, manager_class, allow_errors: bool, timeout_func):
    """An nbclient client that runs ``notebook`` in its own folder on ``manager_class``'s kernels
    (:func:`kernel_manager_class`), each cell within ``timeout_func(cell)`` seconds, waiting for shell
    replies in slices (:func:`_poll_shell_in_slices`)."""
    from nbclient import NotebookClient  # noqa: PLC0415  only running a notebook needs nbclient

    class Client(NotebookClient):
        async def async_start_new_kernel_client(self):
            client = await super().async_start_new_kernel_client()
            _poll_shell_in_slices(client.shell_channel)
            return client

    return Client(notebook, timeout_func=timeout_func, allow_errors=allow_errors,
                  kernel_name=notebook.metadata.get("kernelspec", {}).get("name", "python3"),
                  kernel_manager_class=manager_class,
                  resources={"metadata": {"path": str(Path(path).resolve().parent)}})
