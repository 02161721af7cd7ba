"""How a job and its result travel between the launcher and a rank: cloudpickle, with code kept whole.

A function defined in a notebook cell cannot be imported by a rank, so cloudpickle sends it by value,
code object included. Since cloudpickle 3.1.3 that code object arrives with ``co_filename`` rewritten to
``"<dynamic-code>"`` (to make payloads deterministic). The file name is exactly what a student needs
when their rank raises or hangs: tracebacks, faulthandler's dumps of a blocked rank and the "issued at"
line of every op are all built from it, and the launcher looks the source line up by it in the
notebook's own line cache. So code objects travel with :mod:`marshal`, which is how Python stores
bytecode and keeps every field, whatever cloudpickle decides to do with them.

Both ends run the same interpreter (the ranks come from the launcher's forkserver), which is what
``marshal`` requires.
"""

from __future__ import annotations

import io
import marshal
import pickle
import types

import cloudpickle


class _CodeKeepingPickler(cloudpickle.Pickler):
    """cloudpickle's pickler, except that code objects keep their file name (see the module docstring)."""

    def reducer_override(self, obj):
        # Called before the dispatch table, so this wins over cloudpickle's own code reducer.
        if type(obj) is types.CodeType:
            return marshal.loads, (marshal.dumps(obj),)
        return super().reducer_override(obj)


def dumps(obj) -> bytes:
    """Pickle ``obj`` by value where it must be, code objects with their real file names."""
    buffer = io.BytesIO()
    _CodeKeepingPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


loads = pickle.loads  # cloudpickle's payloads are plain pickles; the reducers above rebuild themselves
