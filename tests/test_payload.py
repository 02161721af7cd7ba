"""A rank's error reports name the student's file and line under every cloudpickle, old and new.

cloudpickle 3.1.3 rewrites the file name of every code object it pickles by value to "<dynamic-code>".
distlab.runtime.payload keeps it. These tests run the real report paths (a rank that raises, a deadlock, a
collective mismatch, a gloo abort) in a fresh interpreter under each cloudpickle a student may have:
the locked one, and 3.1.2 (the last release before the rewrite), which `make install` puts beside it.
"""

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import cloudpickle
import pytest

from distlab.runtime import payload

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("no_leftover_ranks")]

COMPAT = Path(sys.prefix) / "compat" / "cloudpickle-3.1.2"


def _code_objects(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def test_code_objects_keep_their_file_name_through_the_payload():
    source = "def outer(x):\n    def inner(y):\n        return y + 1\n    return inner(x) * 2\n"
    namespace = {}
    exec(compile(source, "/tmp/ipykernel_0/cell_7.py", "exec"), namespace)
    outer = namespace["outer"]
    outer.__module__ = "__main__"  # as in a notebook: cloudpickle sends it by value

    rebuilt = payload.loads(payload.dumps(outer))
    assert rebuilt(3) == 8
    assert {c.co_filename for c in _code_objects(rebuilt.__code__)} == {"/tmp/ipykernel_0/cell_7.py"}
    assert [c.co_firstlineno for c in _code_objects(rebuilt.__code__)] == [1, 2]


def test_plain_cloudpickle_is_what_the_payload_guards_against():
    """If this starts failing, cloudpickle stopped rewriting file names: the guard is still harmless."""
    namespace = {}
    exec(compile("def f():\n    return 1\n", "/tmp/cell.py", "exec"), namespace)
    namespace["f"].__module__ = "__main__"
    name = cloudpickle.loads(cloudpickle.dumps(namespace["f"])).__code__.co_filename
    version = tuple(int(part) for part in cloudpickle.__version__.split(".")[:3])
    assert name == ("<dynamic-code>" if version >= (3, 1, 3) else "/tmp/cell.py")


# The "notebook": a cell whose file exists only in the kernel's line cache, as IPython registers it.
CELL = textwrap.dedent('''\
    import torch
    import torch.distributed as dist

    def raises():
        if dist.get_rank() == 1:
            raise ValueError("bad shard on rank one")
        dist.all_reduce(torch.ones(3))

    def deadlocks():
        dist.recv(torch.empty(4), 1 - dist.get_rank())

    def mismatches():
        dist.all_reduce(torch.ones(3 + dist.get_rank()))

    def aborts():
        group = dist.new_group([0, 1])
        dist.all_reduce(torch.ones(3 if dist.get_rank() == 0 else 7), group=group)
''')

DRIVER = textwrap.dedent('''\
    import json, linecache, sys
    import cloudpickle
    import distlab

    cell, filename = sys.argv[1], "/tmp/ipykernel_4242/2718281828.py"
    linecache.cache[filename] = (len(cell), None, cell.splitlines(keepends=True), filename)
    namespace = {"__name__": "__main__"}
    exec(compile(cell, filename, "exec"), namespace)
    reports = {"cloudpickle": cloudpickle.__file__}
    for name in ("raises", "deadlocks", "mismatches", "aborts"):
        try:
            distlab.launch(namespace[name], 2, collective_timeout=3, show_output=False)
            reports[name] = "no error"
        except distlab.LaunchError as error:
            reports[name] = str(error)
    print(json.dumps(reports))
''')


CLOUDPICKLES = [pytest.param(None, id=f"installed-{cloudpickle.__version__}"), pytest.param(COMPAT, id="3.1.2")]


@pytest.mark.parametrize("extra_path", CLOUDPICKLES)
def test_every_report_names_the_cell_and_its_line(extra_path):
    if extra_path is not None and not extra_path.is_dir():
        pytest.fail(f"{extra_path} is missing: `make install` puts cloudpickle 3.1.2 there for this test")
    env = dict(os.environ)
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(extra_path), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", DRIVER, CELL], env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = json.loads(done.stdout.strip().splitlines()[-1])
    if extra_path is not None:
        assert reports["cloudpickle"].startswith(str(extra_path)), reports["cloudpickle"]
    cell = 'File "/tmp/ipykernel_4242/2718281828.py"'
    raised = reports["raises"]
    assert f'{cell}, line 6, in raises' in raised and 'raise ValueError("bad shard on rank one")' in raised, raised
    assert "<dynamic-code>" not in raised
    deadlock = reports["deadlocks"]
    assert "rank 0 was blocked at" in deadlock and "dist.recv(torch.empty(4), 1 - dist.get_rank())" in deadlock, \
        deadlock
    mismatch = reports["mismatches"]
    assert "dist.all_reduce(torch.ones(3 + dist.get_rank()))" in mismatch, mismatch
    aborted = reports["aborts"]
    assert "in aborts: dist.all_reduce(torch.ones(3 if dist.get_rank() == 0 else 7), group=group)" in aborted, \
        aborted
    for name in ("deadlocks", "mismatches", "aborts"):
        assert "<dynamic-code>" not in reports[name], reports[name]
