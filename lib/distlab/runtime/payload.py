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

import builtins
import io
import marshal
import pickle
import sys
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


# ---------------------------------------------------------------- what may come back from a student's process
#
# A process that ran a student's code (a rank of a grading job, the sandbox of :mod:`distlab.grading.isolation`)
# is the student's: whatever it sends back may be crafted. ``pickle.loads`` of it would run any function the
# pickle names, in the grader. So a grading process reads such bytes with :func:`loads_plain`, which rebuilds plain
# data only: Python's scalars, strings and containers, plain tensors and numpy arrays, torch's dtypes, devices and
# sizes, and records of the library (distlab's dataclasses, named tuples and enums); anything else is refused.

PLAIN_SCALARS = (type(None), bool, int, float, complex, str, bytes, bytearray, type(...), range, slice)
_CONTAINERS = (tuple, list, dict, set, frozenset)
_BUILTIN_GLOBALS = {"set", "frozenset", "complex", "range", "slice", "bytearray", "int", "float", "bool", "str",
                    "bytes", "list", "tuple", "dict", "object"}
_OTHER_GLOBALS = {("collections", "OrderedDict"), ("collections", "Counter"), ("collections", "deque"),
                  ("collections", "defaultdict"), ("torch", "Size"), ("torch", "device"),
                  ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"),
                  ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "scalar"),
                  ("numpy._core.multiarray", "scalar"), ("fractions", "Fraction"), ("decimal", "Decimal"),
                  ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "Path")}
# Library packages whose records (dataclasses, named tuples, enums) are data a grader may receive.
_RECORD_PACKAGES = ("distlab.",)


def _storage_from_bytes(data: bytes):
    """``torch.storage._load_from_bytes`` without its ``weights_only=False``: a storage, never code."""
    import torch  # noqa: PLC0415  torch is imported by everything that reads results; payload itself is light

    return torch.load(io.BytesIO(data), weights_only=True)


def _tensor(storage, storage_offset, size, stride, dtype=None):
    """A plain tensor on ``storage``: what torch's own rebuilders make, without the gradient flag, the backward
    hooks or the metadata a crafted pickle would set (a hook is a function the grader would call)."""
    import torch  # noqa: PLC0415  see _storage_from_bytes

    untyped = storage if isinstance(storage, torch.UntypedStorage) else storage._untyped_storage
    tensor = torch.empty((0,), dtype=dtype or storage.dtype, device=untyped.device)
    return tensor.set_(untyped, int(storage_offset), tuple(int(n) for n in size), tuple(int(n) for n in stride))


def tensor_reduce(tensor):
    """A CPU tensor as its dtype, shape and bytes (and whether it requires grad): how the grader and the sandbox
    send tensors to each other. torch's own pickling cannot carry every dtype (float8 storages do not unpickle)
    and reads the bytes through ``torch.load``; this is plain bytes both ways. None for a tensor it does not
    carry (another device, a sparse layout, a subclass), which pickles as torch pickles it."""
    import torch  # noqa: PLC0415  see _storage_from_bytes

    if type(tensor) is not torch.Tensor or tensor.device.type != "cpu" or tensor.layout != torch.strided:
        return None
    flat = tensor.detach().contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return tensor_from_bytes, (str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), data,
                               bool(tensor.requires_grad))


def tensor_from_bytes(dtype: str, shape, data: bytes, requires_grad: bool = False):
    """The tensor :func:`tensor_reduce` sent (a copy of the bytes, so it is writable)."""
    import torch  # noqa: PLC0415  see _storage_from_bytes

    kind = getattr(torch, str(dtype), None)
    if not isinstance(kind, torch.dtype):
        raise pickle.UnpicklingError(f"refused: a tensor of dtype {dtype!r}")
    shape = tuple(int(n) for n in shape)
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(kind) if data else torch.empty(0, dtype=kind)
    tensor = flat.reshape(shape)
    return tensor.requires_grad_(True) if requires_grad and tensor.is_floating_point() else tensor


# torch's rebuilders, as the grader runs them: plain tensors only (a Parameter arrives as its data).
_TENSOR_REBUILDERS = {
    "_rebuild_tensor_v2": lambda storage, offset, size, stride, *_: _tensor(storage, offset, size, stride),
    "_rebuild_tensor_v3": lambda storage, offset, size, stride, requires_grad, hooks, dtype, *_: _tensor(
        storage, offset, size, stride, dtype),
    "_rebuild_parameter": lambda data, *_: data,
}


def is_record_class(cls) -> bool:
    """A library class whose instances are plain data: a dataclass, a named tuple or an enum of distlab's."""
    import dataclasses  # noqa: PLC0415  light, and only the grader asks
    import enum  # noqa: PLC0415  as above

    if not isinstance(cls, type) or not str(getattr(cls, "__module__", "")).startswith(_RECORD_PACKAGES):
        return False
    named_tuple = issubclass(cls, tuple) and hasattr(cls, "_fields")
    return dataclasses.is_dataclass(cls) or named_tuple or issubclass(cls, enum.Enum)


def is_plain(value) -> bool:
    """Whether ``value`` itself (not what it contains) is plain data :func:`loads_plain` rebuilds."""
    import torch  # noqa: PLC0415  see _storage_from_bytes

    kind = type(value)
    if kind in PLAIN_SCALARS or kind in _CONTAINERS or is_record_class(kind):
        return True
    if kind is torch.Tensor:
        return not value.requires_grad and value.layout == torch.strided
    if kind in (torch.Size, torch.device, torch.dtype):
        return True
    if (kind.__module__, kind.__qualname__) in _OTHER_GLOBALS:
        return True
    numpy = sys.modules.get("numpy")
    return numpy is not None and (kind is numpy.ndarray and value.dtype != object or isinstance(value, numpy.generic)
                                  or isinstance(value, numpy.dtype))


def plain(value):
    """``value`` as plain data, for comparing what a student's code returned: a tensor detached and as a plain
    ``torch.Tensor`` (never a subclass whose ``__eq__``, ``__torch_function__`` or attributes could lie), a
    number as a Python number, a string as ``str``, and lists, tuples and dicts of them rebuilt; anything else
    as it is."""
    import numbers  # noqa: PLC0415  light

    import torch  # noqa: PLC0415  see _storage_from_bytes

    kind = type(value)
    if kind in PLAIN_SCALARS:
        return value
    if isinstance(value, torch.Tensor):
        if kind is torch.Tensor and not value.requires_grad:
            return value
        with torch._C.DisableTorchFunctionSubclass():
            return torch.Tensor.detach(value)
    if isinstance(value, numbers.Number) and not isinstance(value, (tuple, list, dict)):
        generic = getattr(value, "item", None) if kind.__module__ == "numpy" else None
        if generic is not None:
            return generic()
        if isinstance(value, bool):
            return bool(value)
        for python in (int, float, complex):
            if isinstance(value, numbers.Integral if python is int else numbers.Real if python is float else
                          numbers.Complex):
                return python(value)
    if isinstance(value, str):
        return str.__str__(value)
    if kind in (list, tuple):
        return kind(plain(item) for item in value)
    if kind is dict:
        return {plain(k): plain(v) for k, v in value.items()}
    return value


class PlainUnpickler(pickle.Unpickler):
    """An unpickler that builds plain data only (see the section's comment); ``persistent_load`` answers the
    handles a sender put in place of objects it may not send (:mod:`distlab.grading.isolation`)."""

    def __init__(self, file, persistent_load=None):
        super().__init__(file)
        self._persistent = persistent_load

    def find_class(self, module: str, name: str):
        import torch  # noqa: PLC0415  see _storage_from_bytes

        if "." in name:  # ``os.path`` through ``pathlib``: attribute chains reach anything
            raise pickle.UnpicklingError(f"refused: {module}.{name}")
        if module == "builtins" and name in _BUILTIN_GLOBALS:
            return getattr(builtins, name)
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _storage_from_bytes
        if module == "torch._utils" and name in _TENSOR_REBUILDERS:
            return _TENSOR_REBUILDERS[name]
        if (module, name) == (__name__, "tensor_from_bytes"):
            return tensor_from_bytes
        if (module, name) in _OTHER_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module.startswith(_RECORD_PACKAGES) and module in sys.modules:
            found = getattr(sys.modules[module], name, None)
            if is_record_class(found) and found.__module__ == module:
                return found
        raise pickle.UnpicklingError(f"refused: {module}.{name} is not plain data")

    def persistent_load(self, pid):
        if self._persistent is None:
            raise pickle.UnpicklingError("refused: a persistent reference")
        return self._persistent(pid)


def loads_plain(data: bytes, persistent_load=None):
    """Plain data from ``data`` sent by a process that ran a student's code; raises ``UnpicklingError`` for anything
    else (see the section's comment)."""
    return PlainUnpickler(io.BytesIO(data), persistent_load).load()


_distrusted = False


def distrust_results() -> None:
    """From now on, this process reads what ranks send back as a student's: with :func:`loads_plain`
    (a grading process calls it before its first job; it is never undone)."""
    global _distrusted
    _distrusted = True


def results_distrusted() -> bool:
    return _distrusted


def load_result(data: bytes):
    """A rank's return value: :func:`loads_plain` once :func:`distrust_results` was called, else :data:`loads`."""
    return loads_plain(data) if _distrusted else loads(data)
