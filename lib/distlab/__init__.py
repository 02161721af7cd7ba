"""distlab: learn distributed LLM training by running real torch.distributed ranks from notebook cells.

Where things live (CONTRIBUTING.md has the table): ``runtime/`` starts and watches the ranks and imports
nothing else of distlab; the shared course code (``model``, ``reference``, ``memory``, ``flops``, ``claims``,
``results``) sits above it; then one module or package per topic; ``grading/`` and the tooling
(``notebooks``, ``cli``, ``doctor``, ``torchrun``) on top.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

from distlab.claims import ClaimFailed, claim
from distlab.grading import check, needs
from distlab.runtime import trace
from distlab.runtime.launch import (
    CollectiveTimeout,
    LaunchError,
    LaunchInterrupted,
    LaunchTimeout,
    RankCrashed,
    RankFailed,
    Ranks,
    ReturnValueError,
    Run,
    UnmatchedCommunication,
    last_run,
    launch,
    shutdown,
)
from distlab.runtime.rank import device
from distlab.runtime.timeline import counter, span

__all__ = [
    "check", "needs", "claim", "ClaimFailed", "launch", "Ranks", "Run", "shutdown", "device", "span",
    "LaunchError", "RankFailed", "RankCrashed", "CollectiveTimeout", "LaunchTimeout", "LaunchInterrupted",
    "UnmatchedCommunication", "ReturnValueError", "last_run", "counter", "trace",
]

# Modules that moved when the package was laid out as runtime / topics / grading. Notebooks, scripts and
# `python -m distlab.torchrun distlab.mesh:train` commands written against the old paths keep working for a term,
# with a DeprecationWarning naming the new path: the old name is the same module object (its state included),
# imported only when someone asks for it. The course itself uses the new paths (tests/test_layout.py).
MOVED_MODULES = {
    "distlab.launcher": "distlab.runtime.launch",
    "distlab.rank": "distlab.runtime.rank",
    "distlab.comm": "distlab.runtime.comm",
    "distlab.timeline": "distlab.runtime.timeline",
    "distlab.reaper": "distlab.runtime.reaper",
    "distlab.mesh": "distlab.parallel3d.grid",
    "distlab.planner": "distlab.parallel3d.planner",
    "distlab.tokens": "distlab.data.tokens",
}


def _warn_moved(old: str) -> None:
    """A DeprecationWarning naming the new path, told at the line that named the old one: the first frame outside
    importlib and this module (a notebook cell, a script, ``distlab.torchrun``), so Jupyter and ``python`` show it
    the way they show any DeprecationWarning of the user's own code."""
    frame = sys._getframe(1)
    while frame.f_back is not None and (frame.f_code.co_filename == __file__
                                        or "importlib" in frame.f_code.co_filename):
        frame = frame.f_back
    warnings.warn_explicit(f"{old} moved to {MOVED_MODULES[old]}: import that (the old path goes after this term)",
                           DeprecationWarning, frame.f_code.co_filename, frame.f_lineno,
                           module=frame.f_globals.get("__name__", ""),
                           registry=frame.f_globals.setdefault("__warningregistry__", {}))


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves an old module path (:data:`MOVED_MODULES`) to the module at its new one, and says so."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED_MODULES:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        _warn_moved(spec.name)
        module = importlib.import_module(MOVED_MODULES[spec.name])
        spec.loader_state = module.__spec__  # importlib is about to stamp the old name's spec on it
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state  # already executed under its new name: keep its own spec


sys.meta_path.append(_MovedModuleFinder())


def load_ipython_extension(ipython) -> None:
    """``%load_ext distlab``: the ``%%ranks`` cell magic (:mod:`distlab.runtime.magic`)."""
    from distlab.runtime import magic  # noqa: PLC0415  IPython's magic machinery only for a notebook that asks

    magic.load_ipython_extension(ipython)


def unload_ipython_extension(ipython) -> None:
    from distlab.runtime import magic  # noqa: PLC0415  as above

    magic.unload_ipython_extension(ipython)


def __getattr__(name: str):
    """``distlab.timeline.plot(...)`` after a bare ``import distlab``, as before the move (with the warning)."""
    if f"distlab.{name}" in MOVED_MODULES:
        return importlib.import_module(f"distlab.{name}")
    raise AttributeError(f"module 'distlab' has no attribute {name!r}")
