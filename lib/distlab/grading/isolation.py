"""Grading an exercise where the student's code cannot reach the grader: a process of its own, and the student's
code held at arm's length beside it.

``distlab grade`` runs a notebook for its outputs, then grades each of its exercises in a *grading process*
forked from a factory that never ran a student's code (:class:`ExerciseGraders`). That process runs the lab's
checker as a notebook would, with one difference: what the checker is handed is not the student's functions
and classes but stand-ins (:class:`SealedCode`), and the student's code itself runs only

* in the **sandbox**, a child of the grading process that executes the statements the exercise needs (read from
  the notebook by :mod:`distlab.grading.definitions`) and answers the checker's calls: a call of a student's
  function or class there is a message, and only plain data comes back (:func:`distlab.runtime.payload.loads_plain`;
  an object that is not plain data stays there, and the checker gets a :class:`SealedObject` for it); and
* on the **ranks** of the checker's jobs, where a stand-in, unpickled, executes the same statements
  (:func:`rebuild`); what the ranks send back is read as plain data too
  (:func:`~distlab.runtime.payload.distrust_results`).

So a function that patches modules, globals or builtins, or the checker itself, while it runs, patches the
sandbox or a rank: nothing the checker reads or compares. The grading process is undumpable (no process of the
user may read or trace it), adopts and ends whatever its children leave behind, and answers only over a pipe the
grader handed it. Its result, one JSON line, is the only result ``distlab grade`` counts.

A checker part that cannot work on values alone (autograd through what the student returned, an optimizer the
student's code steps, a count taken while it runs) runs in the sandbox as a whole, through
:func:`~distlab.grading.harness.run_isolated`, and hands back what the checker compares.
"""

from __future__ import annotations

import ast
import builtins
import io
import json
import linecache
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from dataclasses import asdict, fields, is_dataclass, replace
from multiprocessing.connection import Connection

import cloudpickle

from distlab.grading.contract import CheckFailed, CheckResult, first_line
from distlab.grading.definitions import Definitions, cell_filename
from distlab.grading.harness import GRADE_SEED_VARIABLE, JOB_TIMEOUT, LONG_JOB_TIMEOUT
from distlab.runtime import confine, payload
from distlab.runtime.kernels import ForkFactory, adopt_forkserver, disown_forkserver

__all__ = ["SealedCode", "SealedObject", "ExerciseGraders", "grade_exercise", "rebuild", "materialize"]

# Seconds one call into the student's code in the sandbox may take: as long as a job on ranks may.
CALL_TIMEOUT = JOB_TIMEOUT
# Seconds a part of a checker run in the sandbox as a whole (run_isolated) may take.
RUN_TIMEOUT = LONG_JOB_TIMEOUT
_REPR_LIMIT = 300  # characters of a sandboxed object's repr that a failure message may quote


# ---------------------------------------------------------------- the student's statements, executed (untrusted side)

_MODULES: dict[str, types.ModuleType] = {}


class _NoShell:
    """``get_ipython()`` outside a kernel: a cell magic (``%%ranks``, ``%%time``) the statements call does nothing."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def materialize(definitions: Definitions) -> types.ModuleType:
    """The module the exercise's statements define, executed in this process once (an untrusted one: the sandbox,
    a rank). A statement that raises is skipped, as the kernel went on past a cell that raised."""
    key = definitions.digest()
    if key in _MODULES:
        return _MODULES[key]
    module = types.ModuleType(f"distlab_submission_{key}")
    module.__dict__.update(display=print, get_ipython=_NoShell)
    sys.modules[module.__name__] = module
    _MODULES[key] = module
    for cell, source, lines in definitions.cells:
        filename = cell_filename(cell)
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        wanted = set(lines)
        for node in ast.parse(source).body:
            if node.lineno not in wanted:
                continue
            try:
                exec(compile(ast.Module(body=[node], type_ignores=[]), filename, "exec"), module.__dict__)
            except Exception:  # noqa: BLE001, S110  the kernel raised here too and ran on: so does the sandbox
                pass
    return module


def rebuild(definitions: list, expression: str, pieces: dict):
    """The student's object a :class:`SealedCode` stands for, in this (untrusted) process: what it unpickles as
    on a rank, and what the sandbox resolves it to."""
    from distlab.grading.harness import with_reference  # noqa: PLC0415  only where the student's code runs

    module = materialize(Definitions.from_json(definitions))
    value = eval(compile(expression, "<check line>", "eval"), module.__dict__)  # noqa: S307  the student's own
    return with_reference(value, **pieces) if pieces else value


def rebuild_object(definitions: list, data: bytes):
    """An object that lived in the sandbox, sent on to a rank: its statements executed there first."""
    materialize(Definitions.from_json(definitions))
    return payload.loads(data)


# ---------------------------------------------------------------- the sandbox (untrusted side)

def _plain_tree(value):
    """``value`` with every tensor and number plain (:func:`~distlab.runtime.payload.plain`), inside the containers
    and library records that hold them: what the sandbox sends back."""
    value = payload.plain(value)
    kind = type(value)
    if kind in (list, tuple, set, frozenset):
        return kind(_plain_tree(item) for item in value)
    if kind is dict:
        return {_plain_tree(k): _plain_tree(v) for k, v in value.items()}
    if payload.is_record_class(kind):
        if is_dataclass(value) and all(f.init for f in fields(value)):
            return replace(value, **{f.name: _plain_tree(getattr(value, f.name)) for f in fields(value)})
        if isinstance(value, tuple):
            return kind(*(_plain_tree(item) for item in value))
    return value


class _HandlePickler(pickle.Pickler):
    """Pickles plain data; any other object stays in the sandbox and is sent as a handle."""

    def __init__(self, file, handles: dict):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._handles = handles

    def reducer_override(self, obj):
        return payload.tensor_reduce(obj) or NotImplemented

    def persistent_id(self, obj):
        if payload.is_plain(obj) or isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)):
            return None  # a class or function goes by name: the grader rebuilds only those it allows
        self._handles[id(obj)] = obj
        return ("handle", id(obj))


def _serve(conn: Connection, definitions: Definitions) -> None:
    """The sandbox: execute the exercise's statements, then answer the grading process's requests until it
    closes the connection. Everything here is the student's to change; the grading process trusts none of it."""
    handles: dict[int, object] = {}
    materialize(definitions)

    def resolve(pid):
        kind, *rest = pid
        return rebuild(definitions.to_json(), *rest) if kind == "code" else handles[rest[0]]

    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            unpickler = pickle.Unpickler(io.BytesIO(data))
            unpickler.persistent_load = resolve
            op, target, args, kwargs = unpickler.load()
            if op == "call":
                value = target(*args, **kwargs)
            elif op == "getattr":
                value = getattr(target, args[0])
            elif op == "run":
                value = target(*args)
            elif op == "repr":
                value = repr(target)[:_REPR_LIMIT]
            elif op == "len":
                value = len(target)
            elif op == "iter":
                value = list(target)
            elif op == "getitem":
                value = target[args[0]]
            elif op == "bool":
                value = bool(target)
            else:  # "export": the object itself, for a rank
                value = payload.dumps(target)
            buffer = io.BytesIO()
            _HandlePickler(buffer, handles).dump(("ok", _plain_tree(value)))
            reply = buffer.getvalue()
        except BaseException as error:  # noqa: BLE001  the student's error is the answer
            from distlab.runtime.rank import describe_error  # noqa: PLC0415  only the sandbox describes errors

            reply = pickle.dumps(("error", {**describe_error(error, in_op=None),
                                             "exc_module": type(error).__module__}))
        try:
            conn.send_bytes(reply)
        except (BrokenPipeError, OSError):
            return


def _start_sandbox(definitions: Definitions) -> tuple[Connection, int]:
    """Fork the sandbox from this (grading) process; its end of a socket pair is all it keeps."""
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the sandbox
        try:
            ours.close()
            keep = theirs.fileno()
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            os.closerange(3, keep)
            os.closerange(keep + 1, 1 << 16)
            confine.seal_memory(False)  # the student's own process: nothing of the grader's to protect here
            disown_forkserver()  # ranks the student's statements start come from a server of its own
            os.environ.pop(GRADE_SEED_VARIABLE, None)
            sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115  the process's life
            _serve(Connection(os.dup(keep)), definitions)
        finally:
            os._exit(0)
    theirs.close()
    return Connection(os.dup(ours.fileno())), pid


class SandboxEnded(RuntimeError):
    """The student's code ended the sandbox (``os._exit``, a signal, a crash): nothing more can be asked of it."""


class StudentError(Exception):
    """An exception the student's code raised in the sandbox, of a type the grading process does not rebuild
    (the student's own, or a library's); :attr:`exc_type` names it."""


def _rebuilt_error(info: dict) -> BaseException:
    """The student's exception, as the checker would have seen it: a builtin or distlab's one rebuilt with its message
    (a checker may expect a ``ValueError`` or a ``CheckpointError``), any other as a :class:`StudentError` of the
    same name. It carries the
    student's line (``student_line``), which :func:`~distlab.grading.contract.describe_error` shows."""
    exc_type, message = str(info.get("exc_type", "Exception")), str(info.get("message", ""))
    if exc_type == "CheckFailed":  # a part of the checker run beside the code found a mistake (it only ever fails)
        return CheckFailed(message)
    kind = getattr(builtins, exc_type, None)
    module = sys.modules.get(str(info.get("exc_module", ""))) if str(info.get("exc_module", "")).startswith(
        "distlab.") else None
    if module is not None:  # the library's own (CheckpointError): a checker may catch it by its type
        kind = getattr(module, exc_type, None)
    error: BaseException | None = None
    if isinstance(kind, type) and issubclass(kind, Exception):
        try:
            error = kind(message)
        except Exception:  # noqa: BLE001  a builtin that wants other arguments (UnicodeDecodeError)
            error = None
    if error is None:
        error = type(exc_type if exc_type.isidentifier() else "StudentError", (StudentError,), {})(message)
    error.exc_type = exc_type
    frames = [f for f in info.get("frames", []) if str(f[0]).startswith("<notebook cell")]
    if frames:
        _, lineno, _, line = frames[-1]
        error.student_line = f"line {lineno}: {str(line or '').strip()}".rstrip(": ")
    return error


class _RequestPickler(cloudpickle.Pickler):
    """What the grading process sends the sandbox: cloudpickle, stand-ins as references to the sandbox's own
    objects, tensors as bytes (:func:`~distlab.runtime.payload.tensor_reduce`)."""

    def __init__(self, file, sandbox):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._sandbox = sandbox

    def persistent_id(self, obj):
        if isinstance(obj, (SealedCode, SealedObject)) and obj._sandbox is self._sandbox:
            return obj._reference()
        return None

    def reducer_override(self, obj):
        reduced = payload.tensor_reduce(obj)
        return reduced if reduced is not None else super().reducer_override(obj)


class Sandbox:
    """The grading process's side of the sandbox: requests out (pickled, with stand-ins as references), plain data
    back (:func:`~distlab.runtime.payload.loads_plain`, with handles for what is not), within a time limit."""

    def __init__(self, definitions: Definitions):
        self.definitions = definitions
        self._conn, self._pid = _start_sandbox(definitions)
        self._ended: str | None = None

    def _pickle(self, message) -> bytes:
        buffer = io.BytesIO()
        _RequestPickler(buffer, self).dump(message)
        return buffer.getvalue()

    def ask(self, op: str, target, args=(), kwargs=None, timeout: float = CALL_TIMEOUT):
        if self._ended:
            raise SandboxEnded(self._ended)
        self._conn.send_bytes(self._pickle((op, target, tuple(args), dict(kwargs or {}))))
        if not self._conn.poll(timeout):
            self.close()
            self._ended = f"your code did not finish within {timeout:g} s (an endless loop?)"
            raise CheckFailed(self._ended)
        try:
            data = self._conn.recv_bytes()
        except (EOFError, OSError):
            _, status = os.waitpid(self._pid, 0)
            self._ended = (f"your code ended the process it ran in (exit status "
                           f"{os.waitstatus_to_exitcode(status)}): it may not call os._exit, exit or kill itself")
            raise SandboxEnded(self._ended) from None
        kind, value = payload.loads_plain(data, persistent_load=lambda pid: SealedObject(self, pid[1]))
        if kind == "error":
            raise _rebuilt_error(value if isinstance(value, dict) else {})
        return value

    def close(self) -> None:
        if self._pid:
            try:
                os.kill(self._pid, signal.SIGKILL)
                os.waitpid(self._pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
            self._pid = 0
            self._conn.close()


# ---------------------------------------------------------------- stand-ins the checker holds (trusted side)

class _Sealed:
    """What both stand-ins share: calling, attributes, containers, and running a part of a checker beside them."""

    _sandbox: Sandbox

    def __call__(self, *args, **kwargs):
        return self._sandbox.ask("call", self, args, kwargs)

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)  # protocols (pickle, copy, inspect) are answered here, never by the student
        return self._sandbox.ask("getattr", self, (name,))

    def __len__(self) -> int:
        return int(self._sandbox.ask("len", self))

    def __iter__(self):
        return iter(self._sandbox.ask("iter", self))

    def __getitem__(self, key):
        return self._sandbox.ask("getitem", self, (key,))

    def __bool__(self) -> bool:
        return bool(self._sandbox.ask("bool", self))

    def run_beside(self, job, *args):
        """``job(*args)`` in the sandbox, the stand-ins among ``args`` the student's objects: its plain result."""
        return self._sandbox.ask("run", job, args, timeout=RUN_TIMEOUT)


class SealedCode(_Sealed):
    """What the checker is handed for an expression of the check line (``ring_all_reduce``): calls and attributes
    are asked of the sandbox; pickled for a rank, it becomes the student's object there (:func:`rebuild`)."""

    def __init__(self, sandbox: Sandbox, expression: str, pieces: dict | None = None):
        self._sandbox, self._expression, self._pieces = sandbox, expression, dict(pieces or {})
        self.__name__ = self.__qualname__ = expression

    def _reference(self):
        return ("code", self._expression, self._pieces)

    def stub_messages(self) -> list[str]:
        """The lab's stub messages still in the code this stands for (read from its source, never run)."""
        return self._sandbox.definitions.stub_messages(self._expression) if self._expression.isidentifier() else []

    def with_reference(self, **pieces) -> SealedCode:
        """The same code with the global names in ``pieces`` bound to the library's versions, where it runs
        (:func:`~distlab.grading.harness.with_reference`)."""
        return SealedCode(self._sandbox, self._expression, {**self._pieces, **pieces})

    def __reduce__(self):
        return rebuild, (self._sandbox.definitions.to_json(), self._expression, self._pieces)

    def __repr__(self) -> str:
        return self._expression


class SealedObject(_Sealed):
    """An object the student's code made or returned that is not plain data: it stays in the sandbox."""

    def __init__(self, sandbox: Sandbox, handle: int):
        self._sandbox, self._handle = sandbox, handle

    def _reference(self):
        return ("handle", self._handle)

    def __reduce__(self):
        return rebuild_object, (self._sandbox.definitions.to_json(), self._sandbox.ask("export", self))

    def __repr__(self) -> str:
        return str(self._sandbox.ask("repr", self))


# ---------------------------------------------------------------- the grading process (trusted side)

def grade_exercise(request: dict) -> dict:
    """Grade one exercise in this process (forked for it, or started for it): the result as a dict.

    ``request``: ``exercise`` (its id), ``seed`` (of the hidden cases, or None), ``expressions`` (what the check
    line hands the checker, as source text) and ``definitions`` (:meth:`Definitions.to_json`)."""
    from distlab.grading import outcome  # noqa: PLC0415  the package imports nothing of this module
    from distlab.grading.registry import find_exercise  # noqa: PLC0415  as above
    from distlab.runtime.launch import shutdown  # noqa: PLC0415  only a grading process ends its ranks here

    confine.seal_memory()
    confine.keep_orphans()
    payload.distrust_results()
    folder = tempfile.mkdtemp(prefix="distlab-exercise-")
    os.chdir(folder)
    definitions = Definitions.from_json(request.get("definitions", []))
    sandbox = Sandbox(definitions)  # forked before the seed is set: it never holds it
    try:
        if request.get("seed") is not None:
            os.environ[GRADE_SEED_VARIABLE] = str(request["seed"])
        exercise = find_exercise(request["exercise"])
        code = [SealedCode(sandbox, expression) for expression in request.get("expressions", [])]
        result = outcome(exercise, *code)
    except BaseException as error:  # noqa: BLE001  a fault of the grader's own: reported, never a pass
        result = CheckResult(request.get("exercise", "?"), "", "failed", 0, 0,
                             f"the grader failed: {type(error).__name__}: {first_line(error)}")
        traceback.print_exc()
    finally:
        sandbox.close()
        shutdown()
        confine.end_descendants()
    return asdict(result)


def _become_grader(request: dict, fds: list[int]) -> None:
    """A child of the :class:`ExerciseGraders` factory: grade ``request``, write the result to ``fds[0]`` (a pipe
    only the grader reads), and exit; ``fds[1]`` closes when the grader is gone, and so does this process."""
    code = 1
    try:
        result_fd, lifeline = fds[0], fds[1]

        def exit_with_the_grader():
            while os.read(lifeline, 1):
                pass
            os._exit(1)

        threading.Thread(target=exit_with_the_grader, daemon=True, name="distlab-lifeline").start()
        os.dup2(2, 1)  # the factory's stdout is the pipe it said "ready" on, which nobody reads any more
        adopt_forkserver()
        result = grade_exercise(request)
        with os.fdopen(result_fd, "w") as out:
            out.write(json.dumps(result) + "\n")
        code = 0
    except BaseException:  # noqa: BLE001  reported on stderr; the grader sees no result and says so
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


class ExerciseGraders:
    """The processes ``distlab grade`` grades exercises in: forked from one factory that imported the labs'
    checkers (and never ran a student's code), with an environment that holds no secret; where fork and fd passing
    are missing, each is started fresh (slower, the same isolation). The factory starts with the first exercise."""

    def __init__(self, checker_modules: list[str], env: dict):
        self._env, self._modules = env, ["distlab.grading.isolation", *checker_modules]
        self._factory = None
        self._starting = threading.Lock()

    def _started(self) -> ForkFactory | None:
        """The factory, started by the first exercise that needs it (a class whose notebooks reached no check line
        starts none)."""
        with self._starting:
            if self._factory is None and ForkFactory.available():
                self._factory = ForkFactory("distlab.grading.isolation:_become_grader", self._modules, env=self._env,
                                            isolated=True, rank_preload=self._modules)
            return self._factory

    def grade(self, request: dict, timeout: float) -> dict | None:
        """The result of one exercise (:func:`grade_exercise`), or None when the grading process gave none within
        ``timeout`` seconds (it is ended then, with everything it started)."""
        factory = self._started()
        if factory is None:
            return self._grade_fresh(request, timeout)
        result_r, result_w = os.pipe()
        lifeline_r, lifeline_w = os.pipe()
        try:
            sock, pid = factory.fork(request, [result_w, lifeline_r])
        finally:
            os.close(result_w)
            os.close(lifeline_r)
        try:
            data = _read_until(result_r, timeout)
            if data is None:
                confine.end_descendants(pid)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            sock.settimeout(30)
            try:
                sock.makefile("rb").readline()  # its exit status: the factory has collected it
            except OSError:
                pass
            sock.close()
        finally:
            os.close(result_r)
            os.close(lifeline_w)
        return _parse_result(data)

    def _grade_fresh(self, request: dict, timeout: float) -> dict | None:
        code = "import json, sys; from distlab.grading.isolation import grade_exercise; " \
               "print(json.dumps(grade_exercise(json.loads(sys.stdin.readline()))))"
        try:
            done = subprocess.run([sys.executable, "-I", "-c", code], input=json.dumps(request) + "\n",
                                  capture_output=True, text=True, timeout=timeout, env=self._env)
        except subprocess.TimeoutExpired:
            return None
        lines = done.stdout.strip().splitlines()
        return _parse_result(lines[-1].encode()) if lines else None

    def close(self) -> None:
        with self._starting:
            if self._factory is not None:
                self._factory.close()
                self._factory = None


def _read_until(fd: int, timeout: float) -> bytes | None:
    """All a pipe carries until its writer closes it, or None past ``timeout`` seconds."""
    import select  # noqa: PLC0415  only the grader waits on a grading process

    chunks, deadline = [], time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            return None
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _parse_result(data: bytes | None) -> dict | None:
    if not data or not data.strip():
        return None
    try:
        result = json.loads(data.strip().splitlines()[-1])
    except ValueError:
        return None
    return result if isinstance(result, dict) else None
