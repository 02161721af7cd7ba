"""Keeping code we do not trust in its place: an environment without secrets, a private folder, no process left
behind, no file of the installation changed unseen, and no way into the memory of the process that keeps score.

``distlab grade`` runs every student's code with the grader's own user id, so the operating system does not keep
them apart; these are what a process of the same user can still be denied (Linux; elsewhere each is a no-op and
says so in :func:`available`):

* :func:`clean_environment`: the variables a notebook needs (``PATH``, locale, the CUDA/NCCL/thread settings,
  the venv), never the instructor's tokens, keys or the course secret, with ``HOME`` and ``TMPDIR`` inside the
  notebook's own folder;
* :func:`keep_orphans` and :func:`end_descendants`: a process that makes itself a subreaper adopts every process
  its children leave behind (a ``setsid``, a double fork), so ending its descendants ends them all;
* :func:`seal_memory`: a process that is not dumpable cannot be traced nor its memory read by another process of
  the same user (``/proc/PID/mem``, ``ptrace``), whatever ``kernel.yama.ptrace_scope`` says;
* :class:`InstallationWatch`: inotify on every folder Python imports from, so a notebook that edits an installed
  module (distlab's checkers included) or drops a ``.pth`` file is seen before anything imports it again.

What a process of the same user can still do (read the user's files, signal their processes, connect to local
sockets) is for the operating system to forbid: a container or a user of its own (course/instructor_guide.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import struct
import sys
import time
from multiprocessing import resource_tracker
from pathlib import Path

__all__ = ["available", "clean_environment", "keep_orphans", "seal_memory", "children", "descendants",
           "end_descendants", "import_path", "InstallationWatch", "InstallationChanged"]

# Variables a notebook's processes keep: how to find programs and libraries, the locale, the accelerator and thread
# settings, the Python environment. Everything else (tokens, keys, cloud credentials, the course secret) stays out.
_KEPT = {"PATH", "LANG", "LANGUAGE", "TZ", "TERM", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "CONDA_PREFIX",
         "CONDA_DEFAULT_ENV", "PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "TIKTOKEN_CACHE_DIR", "MPLBACKEND"}
_KEPT_PREFIXES = ("LC_", "CUDA_", "NCCL_", "NVIDIA_", "OMP_", "MKL_", "OPENBLAS_", "GLOO_", "DISTLAB_")
_PR_SET_DUMPABLE, _PR_SET_CHILD_SUBREAPER = 4, 36


def available() -> bool:
    """Whether this system confines anything: Linux (``prctl``, ``/proc``, inotify)."""
    return sys.platform.startswith("linux") and os.path.isdir("/proc/self")


def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def clean_environment(folder: str | os.PathLike, **extra: str) -> dict[str, str]:
    """The environment of a process that runs untrusted code: the variables above, ``HOME`` and ``TMPDIR`` in
    ``folder`` (its ``home`` and ``tmp``, created), and ``extra``. Variables named like the grader's own
    (``DISTLAB_GRADE_*``) are dropped."""
    env = {name: value for name, value in os.environ.items()
           if (name in _KEPT or name.startswith(_KEPT_PREFIXES)) and not name.startswith("DISTLAB_GRADE")}
    home, tmp = Path(folder, "home"), Path(folder, "tmp")
    for made in (home, tmp):
        made.mkdir(parents=True, exist_ok=True)
    env.update(HOME=str(home.resolve()), TMPDIR=str(tmp.resolve()), **extra)
    return env


def keep_orphans(keep: bool = True) -> bool:
    """Make this process adopt the processes its descendants leave behind (``PR_SET_CHILD_SUBREAPER``); ``keep``
    False stops it (a test process that graded a class goes back to being an ordinary one)."""
    if not available():
        return False
    return _libc().prctl(_PR_SET_CHILD_SUBREAPER, 1 if keep else 0, 0, 0, 0) == 0


def seal_memory(sealed: bool = True) -> bool:
    """Make this process undumpable: no other process of this user may trace it or read its memory (``sealed``
    False undoes it, for a process forked from a sealed one that runs a student's code)."""
    if not available():
        return False
    return _libc().prctl(_PR_SET_DUMPABLE, 0 if sealed else 1, 0, 0, 0) == 0


def process_status(pid: int | str) -> tuple[str, int] | None:
    """The state letter (``"Z"``: a zombie) and the parent's pid of process ``pid``, from ``/proc/PID/stat``; None
    when it cannot be read (the process is gone, or there is no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after its last ')'
    state, ppid = stat[stat.rindex(b")") + 2:].split()[:2]
    return state.decode(), int(ppid)


def _children_table() -> dict[int, list[int]]:
    table: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        status = process_status(entry.name)
        if status is not None:
            table.setdefault(status[1], []).append(int(entry.name))
    return table


def children(pid: int | None = None) -> list[int]:
    """The processes whose parent is ``pid`` (this process by default)."""
    return _children_table().get(pid or os.getpid(), []) if available() else []


def descendants(pid: int | None = None) -> list[int]:
    """Every process below ``pid`` (this process by default), children first."""
    if not available():
        return []
    table, found, queue = _children_table(), [], [pid or os.getpid()]
    while queue:
        for child in table.get(queue.pop(0), []):
            found.append(child)
            queue.append(child)
    return found


def end_descendants(pid: int | None = None, spare: tuple[int, ...] = (), seconds: float = 10.0) -> int:
    """SIGKILL every process below ``pid`` except ``spare`` (and theirs), until none is left; the number ended.

    Orphans reach ``pid`` only if it (or a process between) is a subreaper (:func:`keep_orphans`). A process that
    keeps forking is stopped first (SIGSTOP), so it cannot outrun the kill. Raises ``RuntimeError`` if processes
    are still there after ``seconds``."""
    if not available():
        return 0
    tracker = getattr(getattr(resource_tracker, "_resource_tracker", None), "_pid", None)
    spare = (*spare, *([tracker] if tracker else []))  # this process's own multiprocessing helper
    ended: set[int] = set()
    deadline = time.monotonic() + seconds
    while True:
        spared = set(spare)
        for kept in spare:
            spared.update(descendants(kept))
        left = [p for p in descendants(pid) if p not in spared]
        if not left:
            return len(ended)
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(left)} process(es) could not be ended: {left[:5]}")
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for victim in left:
                try:
                    os.kill(victim, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        ended.update(left)
        for victim in left:  # those that are this process's children (adopted orphans too), collected: no zombie
            try:
                os.waitpid(victim, os.WNOHANG)
            except ChildProcessError:
                pass
        time.sleep(0.01)


# ---------------------------------------------------------------- the installation, watched

class InstallationChanged(RuntimeError):
    """A file Python imports from changed while untrusted code ran: what grades are computed by may be theirs."""


_IN_MODIFY, _IN_ATTRIB, _IN_CLOSE_WRITE, _IN_MOVED_FROM, _IN_MOVED_TO = 0x2, 0x4, 0x8, 0x40, 0x80
_IN_CREATE, _IN_DELETE, _IN_DELETE_SELF, _IN_MOVE_SELF, _IN_Q_OVERFLOW = 0x100, 0x200, 0x400, 0x800, 0x4000
_IN_NONBLOCK, _IN_CLOEXEC = 0o4000, 0o2000000
_EVENTS = (_IN_MODIFY | _IN_ATTRIB | _IN_CLOSE_WRITE | _IN_MOVED_FROM | _IN_MOVED_TO | _IN_CREATE | _IN_DELETE
           | _IN_DELETE_SELF | _IN_MOVE_SELF)


def import_path() -> list[str]:
    """The folders a fresh ``python -I`` of this interpreter imports from: the standard library and the installed
    packages, never the current folder or ``PYTHONPATH`` (what a process started isolated can be changed through)."""
    import json  # noqa: PLC0415  light; only a grader asks
    import subprocess  # noqa: PLC0415  as above

    done = subprocess.run([sys.executable, "-I", "-c", "import sys, json; print(json.dumps(sys.path))"],
                          capture_output=True, text=True, timeout=60, check=True)
    return [p for p in json.loads(done.stdout) if p]


class InstallationWatch:
    """Watch every folder of :func:`import_path` (and ``roots``) for a change to what Python imports;
    :meth:`changes` lists them. A compiled module Python itself caches (a new ``__pycache__/*.pyc`` whose code is
    exactly its source's) is no change; a ``.pyc`` with other code is one, since Python would run it in place of
    the source.

    Watching starts when the object is made; inotify sees writes of any process, those of a process that has since
    ended included. Linux only: elsewhere :meth:`changes` reports nothing and ``active`` is False."""

    def __init__(self, roots: tuple[str, ...] = ()):
        self._fd, self._paths, self.active = -1, {}, False
        if not available():
            return
        libc = _libc()
        fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            return
        self._fd, self._libc = fd, libc
        folders = {os.path.realpath(p) for p in (*import_path(), *roots) if p and os.path.isdir(p)}
        for top in sorted(folders):
            for folder, subfolders, _ in os.walk(top):
                # another interpreter's packages (the base Python's, under a venv's stdlib) are not imported here
                subfolders[:] = [s for s in subfolders if not s.endswith(".dist-info") and not (
                    s in ("site-packages", "dist-packages") and os.path.join(folder, s) not in folders)]
                wd = libc.inotify_add_watch(fd, os.fsencode(folder), _EVENTS)
                if wd >= 0:
                    self._paths[wd] = folder
        self.active = bool(self._paths)

    def changes(self) -> list[str]:
        """What changed since the watch began (or since the last call): each path, with what happened to it."""
        if self._fd < 0:
            return []
        masks: dict[str, int] = {}
        while True:
            try:
                data = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                break
            offset = 0
            while offset < len(data):
                wd, mask, _, size = struct.unpack_from("iIII", data, offset)
                name = data[offset + 16: offset + 16 + size].rstrip(b"\0").decode(errors="replace")
                offset += 16 + size
                if mask & _IN_Q_OVERFLOW:
                    masks["(too many changes to list: inotify's queue overflowed)"] = 0
                    continue
                path = os.path.join(self._paths.get(wd, "?"), name)
                if mask & _IN_CREATE and os.path.isdir(path):
                    self._paths[self._libc.inotify_add_watch(self._fd, os.fsencode(path), _EVENTS)] = path
                masks[path] = masks.get(path, 0) | mask
        cached = _compiled_by_python([p for p in masks if Path(p).parent.name == "__pycache__"])
        cached |= {p for p in masks if Path(p).name == "__pycache__" and os.path.isdir(p)}  # Python makes it too
        return sorted(f"{path} ({_describe(mask)})" if mask else path
                      for path, mask in masks.items() if path not in cached)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _describe(mask: int) -> str:
    names = [(_IN_CREATE, "created"), (_IN_DELETE, "deleted"), (_IN_MODIFY, "written"), (_IN_CLOSE_WRITE, "written"),
             (_IN_ATTRIB, "attributes changed"), (_IN_MOVED_FROM, "moved away"), (_IN_MOVED_TO, "moved in"),
             (_IN_DELETE_SELF, "folder deleted"), (_IN_MOVE_SELF, "folder moved")]
    return ", ".join(dict.fromkeys(word for bit, word in names if mask & bit)) or hex(mask)


# Run apart: ``marshal.loads`` of a file a student may have written is not to be trusted with the grader's process.
_VERIFY = r"""
import importlib.util, json, marshal, os, struct, sys
found = []
for path in json.loads(sys.stdin.read()):
    name = os.path.basename(path)
    if not name.endswith(".pyc"):  # Python imports nothing else from __pycache__ ("x.pyc.<id>": its temporary)
        found.append(path)
        continue
    parts = name.split(".")
    source = os.path.join(os.path.dirname(os.path.dirname(path)), parts[0] + ".py")
    try:
        data, code, stat = open(path, "rb").read(), open(source, "rb").read(), os.stat(source)
        flags, mtime, size = struct.unpack("<III", data[4:16])
        optimize = int(parts[2][4:]) if parts[2].startswith("opt-") else 0
        fresh = flags != 0 or (mtime == int(stat.st_mtime) & 0xFFFFFFFF and size == stat.st_size & 0xFFFFFFFF)
        if (data[:4] == importlib.util.MAGIC_NUMBER and parts[1] == sys.implementation.cache_tag and fresh
                and marshal.loads(data[16:]) == compile(code, source, "exec", dont_inherit=True, optimize=optimize)):
            found.append(path)
    except (OSError, ValueError, EOFError, TypeError, SyntaxError, struct.error, IndexError):
        pass
print(json.dumps(found))
"""


def _compiled_by_python(paths: list[str]) -> set[str]:
    """Those of ``paths`` (in ``__pycache__`` folders) that are what Python itself writes there: a ``.pyc`` whose
    header matches its source's size and time and whose code is the source's, compiled (code objects compare
    equal; their bytes need not), or a file Python never imports. Checked in a process of its own."""
    import json  # noqa: PLC0415  light
    import subprocess  # noqa: PLC0415  as above

    if not paths:
        return set()
    try:
        done = subprocess.run([sys.executable, "-I", "-B", "-c", _VERIFY], input=json.dumps(paths),
                              capture_output=True, text=True, timeout=120)
        return set(json.loads(done.stdout)) if done.returncode == 0 else set()
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return set()
