"""Whose code a stack frame runs: the library's, or the user's.

Three reports point a student at their own line and must agree on where the library stops: a rank's
traceback hides the library frames after the user's last one (:func:`distlab.runtime.rank.describe_error`),
every async op records the line that issued it (``issued at`` in :mod:`distlab.runtime.comm`), and a
crashed or blocked rank's faulthandler dump is searched for the call it was in
(:func:`distlab.runtime.diagnose.abort_details`). The rule lives here once, so that they cannot drift.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import threading

import torch

_LIBRARY_PREFIXES = (
    os.path.dirname(os.path.abspath(torch.__file__)),  # no separator: torchgen, torchvision… beside it count too
    os.path.dirname(os.path.abspath(__file__)) + os.sep,  # distlab's runtime; the topic packages are course code
    os.path.dirname(os.path.abspath(multiprocessing.__file__)) + os.sep,
)
_THREADING = os.path.abspath(threading.__file__)
_NO_FILE = "<string>"  # the forkserver's `python -c` bootstrap: no file, so no line to show anyone


@functools.lru_cache(maxsize=1024)  # asked per frame of every async op: a handful of distinct files
def is_library_frame(filename: str) -> bool:
    """True for a frame in torch, distlab's runtime, multiprocessing or threading; False for the user's code."""
    if filename == _NO_FILE:
        return True
    path = os.path.abspath(filename)
    return path.startswith(_LIBRARY_PREFIXES) or path == _THREADING
