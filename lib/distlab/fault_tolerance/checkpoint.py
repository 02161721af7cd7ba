"""Checkpoints that are either complete or absent: DCP shards, a commit by rename, a verified load.

``torch.distributed.checkpoint`` (DCP) writes one file per rank plus a ``.metadata``
file that describes every tensor's global shape and where each shard lives; that is
what lets a checkpoint written by 4 ranks load into 2 (the loader reads whichever
byte ranges its new shards need). What DCP does not decide is which checkpoint a
restarted job should trust. A rank killed while writing leaves some shard files
behind, and a job that loads them as if complete trains on garbage. So:

* every checkpoint is written into ``step_00000012.partial/`` and committed, once
  every rank's shards are on disk, by one ``rename`` to ``step_00000012/`` (atomic on
  POSIX file systems) after rank 0 wrote a manifest with a CRC-32 of every file;
* :func:`latest_checkpoint` only ever returns committed directories, and
  :func:`verify_checkpoint` names what is wrong with any other path: missing,
  partial, incomplete, corrupted (a checksum differs) or, with a target state,
  incompatible (a missing key or a different shape);
* :func:`save_checkpoint` blocks until the checkpoint is committed;
  :func:`async_save_checkpoint` only copies the state (``dcp.async_save``'s staging)
  and writes and commits it on a background thread: the training loop's stall is the
  copy, not the write.

Rank 0 checksums the files of every rank, which assumes a file system all ranks
share (NFS, Lustre, a bucket mount): the common case for cluster checkpoints.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import threading
import time
import warnings
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from distlab.fault_tolerance.faults import DyingWriter
from distlab.runtime.subgroups import subgroup
from distlab.runtime.timeline import span

__all__ = [
    "CheckpointError", "MANIFEST", "PARTIAL_SUFFIX", "checkpoint_path", "list_checkpoints", "latest_checkpoint",
    "partial_checkpoints", "verify_checkpoint", "check_compatible", "checkpoint_group", "save_checkpoint",
    "async_save_checkpoint", "PendingCheckpoint", "load_checkpoint", "read_checkpoint", "flat_state", "TrainState",
]

MANIFEST = "distlab.json"
PARTIAL_SUFFIX = ".partial"
_NAME = re.compile(r"^step_(\d{8})$")
_CHUNK = 1 << 22


class CheckpointError(ValueError):
    """A checkpoint that must not be loaded; the one-line message says why and what to do."""


# ---------------------------------------------------------------- where checkpoints live

def checkpoint_path(root: str | os.PathLike, step: int) -> Path:
    """The committed directory of the checkpoint taken after ``step`` optimizer steps."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    return Path(root) / f"step_{step:08d}"


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Committed checkpoints under ``root`` as ``(step, path)``, oldest first (a missing root has none)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _NAME.match(entry.name)
        if match and entry.is_dir() and (entry / MANIFEST).is_file():
            found.append((int(match[1]), entry))
    return sorted(found)


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest committed checkpoint under ``root``; partial ones are never candidates."""
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def partial_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Checkpoints whose writing never finished (a rank died, or the job was killed, while saving)."""
    root = Path(root)
    return sorted(p for p in root.glob(f"step_*{PARTIAL_SUFFIX}") if p.is_dir()) if root.is_dir() else []


# ---------------------------------------------------------------- verification

def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def verify_checkpoint(path: str | os.PathLike, checksums: bool = True) -> dict:
    """The checkpoint's manifest, or :class:`CheckpointError` naming what is wrong with it.

    ``path`` is a checkpoint directory, or a root of them (its latest committed one is used).
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}: the directory does not exist")
    if not _NAME.match(path.name) and not path.name.endswith(PARTIAL_SUFFIX):
        latest = latest_checkpoint(path)
        if latest is None:
            partial = partial_checkpoints(path)
            raise CheckpointError(f"no complete checkpoint in {path}" + (
                f": only partial ones ({', '.join(p.name for p in partial)}), whose writing never finished"
                if partial else ""))
        path = latest
    if path.name.endswith(PARTIAL_SUFFIX) or not (path / MANIFEST).is_file():
        committed = latest_checkpoint(path.parent)
        raise CheckpointError(
            f"{path.name} is a partial checkpoint: its writing never finished (a rank died or the job was killed "
            f"while saving), so it was never committed"
            + (f"; the last complete one is {committed.name}" if committed is not None else ""))
    manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    for name, expected in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{path.name} is incomplete: {name} is missing (it was written and later deleted?)")
        if checksums and _crc32(file) != expected:
            raise CheckpointError(
                f"{path.name} is corrupted: {name} has CRC-32 {_crc32(file):#010x} but {expected:#010x} was "
                f"recorded when it was written; restore it or load an older checkpoint")
    return dict(manifest, path=str(path))


def flat_state(state: dict) -> dict[str, Any]:
    """``state`` keyed as DCP stores it: ``Stateful`` values through their ``state_dict()``, nested keys joined
    by dots (``train.model.blocks.0.attn.qkv.weight``, ``train.step``): the keys :func:`read_checkpoint` returns,
    so what a rank holds can be compared with what a checkpoint holds, key by key."""
    plain = {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state.items()}
    flat, _ = flatten_state_dict(plain)
    return flat


def _flat_tensors(state: dict) -> dict[str, tuple[int, ...]]:
    """``{dcp key: global shape}`` for every tensor in ``state``, keyed as DCP flattens it."""
    return {k: tuple(v.shape) for k, v in flat_state(state).items() if isinstance(v, torch.Tensor)}


def check_compatible(path: str | os.PathLike, state: dict) -> None:
    """Raise :class:`CheckpointError` naming the first key that is missing, unexpected or of another shape.

    Compares DCP's metadata (global shapes, so a checkpoint saved by 4 ranks matches a
    state sharded over 2) with what ``state`` would load. Keys under a top-level entry
    the state does not ask for are ignored.
    """
    path = Path(path)
    stored = {k: tuple(v.size) for k, v in FileSystemReader(str(path)).read_metadata().state_dict_metadata.items()
              if hasattr(v, "size")}
    wanted = _flat_tensors(state)
    tops = {k.split(".")[0] for k in wanted}
    for key, shape in wanted.items():
        if key not in stored:
            raise CheckpointError(f"{path.name} does not fit this model: it has no {key} (the state expects "
                                  f"shape {shape}); was it saved from another model?")
        if stored[key] != shape:
            raise CheckpointError(f"{path.name} does not fit this model: {key} has shape {stored[key]} in the "
                                  f"checkpoint but {shape} here")
    extra = sorted(k for k in stored if k.split(".")[0] in tops and k not in wanted)
    if extra:
        raise CheckpointError(f"{path.name} does not fit this model: the checkpoint holds {extra[0]} "
                              f"(and {len(extra) - 1} more) that this state does not have")


# ---------------------------------------------------------------- saving

def checkpoint_group():
    """A gloo group of all ranks for checkpoint coordination (``None`` without a process group).

    DCP coordinates a save with collectives (plans gathered to rank 0, metadata
    broadcast). An async save runs them on a background thread while training runs its
    own collectives: on one shared group the two streams interleave differently on
    different ranks and deadlock. A group of their own keeps them apart, and gloo
    lets an NCCL job stage its checkpoint in host memory (``dcp.async_save`` needs a CPU backend).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return subgroup(range(dist.get_world_size()), backend="gloo", purpose="checkpoint")


@contextmanager
def _one_process_is_intended(group):
    """Without a process group DCP works on one process and warns that it assumes so; here that is the intent
    (reading a sharded checkpoint in a notebook), so that warning is not shown."""
    with warnings.catch_warnings():
        if group is None:
            warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized")
        yield


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _prepare(root: str | os.PathLike, step: int, group) -> tuple[Path, Path]:
    """Rank 0 clears a stale partial directory of this step (debris of a save a crash interrupted); no rank goes on
    before it has.

    The barrier is needed: each rank's DCP plan creates the directory (``mkdir(exist_ok=True)``), and a rank whose
    ``mkdir`` found it made by another, then looked again after rank 0's ``rmtree`` had removed it, raised
    ``FileExistsError`` (a 4-rank capstone test on a busy machine: ``File exists: '.../step_00000002.partial'``).
    """
    final = checkpoint_path(root, step)
    partial = final.with_name(final.name + PARTIAL_SUFFIX)
    if _rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True, exist_ok=True)
    if group is not None:
        dist.barrier(group=group)
    return partial, final


def _commit(partial: Path, final: Path, step: int, world_size: int, meta: dict) -> Path:
    """Rank 0, once every rank's shards are written: manifest with checksums, then one rename."""
    files = {p.name: _crc32(p) for p in sorted(partial.iterdir()) if p.is_file()}
    manifest = {"step": step, "world_size": world_size, "files": files, "saved_at": time.time(), **meta}
    with open(partial / MANIFEST, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():  # an older save of the same step (a rolled-back run): replaced as a whole
        shutil.rmtree(final)
    os.replace(partial, final)
    _fsync_dir(final.parent)
    return final


def _writer(partial: Path, step: int, fault=None) -> FileSystemWriter:
    if fault is not None and fault.kills_in_save(_rank(), step):
        return DyingWriter(partial)
    return FileSystemWriter(str(partial), sync_files=True)


def save_checkpoint(state: dict, root: str | os.PathLike, step: int, *, meta: dict | None = None,
                    fault=None) -> Path:
    """Write ``state`` (a DCP state dict; ``Stateful`` values allowed) on every rank; return the committed path.

    Collective: every rank calls it. Returns once the checkpoint is committed, so a
    crash after it returns can always resume from it. ``fault`` (see
    :class:`~distlab.fault_tolerance.faults.Fault`) kills a rank mid-write, for the lab.
    """
    group = checkpoint_group()
    partial, final = _prepare(root, step, group)
    with _one_process_is_intended(group):
        dcp.save(state, storage_writer=_writer(partial, step, fault), process_group=group, no_dist=group is None)
    if _rank() == 0:
        _commit(partial, final, step, _world(), meta or {})
    if group is not None:
        dist.barrier(group=group)  # nobody reads it back before it is committed
    return final


class PendingCheckpoint:
    """An async save in flight: ``wait()`` returns the committed path (or raises the save's error)."""

    def __init__(self, upload, partial: Path, final: Path, step: int, meta: dict):
        self.step, self.path = step, final
        self.started = time.perf_counter()
        self.finished: float | None = None
        self._partial, self._meta, self._world, self._rank = partial, meta, _world(), _rank()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._span = span("background write", kind="comm")  # on this rank's timeline: off the critical path
        self._span.__enter__()
        upload.add_done_callback(self._finish)  # runs on the writer thread when its last collective returns

    def _finish(self, upload) -> None:
        try:
            upload.result()
            if self._rank == 0:  # rank 0's save returns after every rank reported its shards written
                _commit(self._partial, self.path, self.step, self._world, self._meta)
        except BaseException as error:  # re-raised by wait(), on the training thread
            self._error = error
        finally:
            self.finished = time.perf_counter()
            self._span.__exit__(None, None, None)
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Path:
        if not self._done.wait(timeout):
            raise TimeoutError(f"the async save of step {self.step} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self.path


def async_save_checkpoint(state: dict, root: str | os.PathLike, step: int, *, meta: dict | None = None,
                          previous: PendingCheckpoint | None = None) -> PendingCheckpoint:
    """Stage ``state`` in host memory and return at once; a background thread writes and commits it.

    Collective. ``previous`` (the last pending save) is waited for first: two saves in
    flight would double the staging memory, and a job must never get ahead of its
    checkpoints by more than one. The stall of the training loop is this wait plus the
    staging copy; call :meth:`PendingCheckpoint.wait` before the job ends.
    """
    if previous is not None:
        previous.wait()
    group = checkpoint_group()
    partial, final = _prepare(root, step, group)
    with _one_process_is_intended(group):
        response = dcp.async_save(state, storage_writer=FileSystemWriter(str(partial), sync_files=True),
                                  process_group=group, no_dist=group is None)
    upload = getattr(response, "upload_completion", response)  # torch >= 2.9 may return an AsyncSaveResponse
    return PendingCheckpoint(upload, partial, final, step, meta or {})


# ---------------------------------------------------------------- loading

def load_checkpoint(state: dict, path: str | os.PathLike, *, verify: bool = True) -> dict:
    """Load ``path`` (a checkpoint, or a root: its latest) into ``state`` in place; return the manifest.

    Collective. Rank 0 checks the checkpoint (committed, checksums, shapes) and every
    rank raises the same :class:`CheckpointError` if it is unusable, before any tensor is read.
    """
    group = checkpoint_group()
    verdict: list[Any] = [None]
    if _rank() == 0:
        try:
            manifest = verify_checkpoint(path, checksums=verify)
            check_compatible(manifest["path"], state)
            verdict[0] = ("ok", manifest)
        except CheckpointError as error:
            verdict[0] = ("error", str(error))
    if group is not None:
        dist.broadcast_object_list(verdict, src=0, group=group)
    outcome, value = verdict[0]
    if outcome == "error":
        raise CheckpointError(value)
    with _one_process_is_intended(group):
        dcp.load(state, storage_reader=FileSystemReader(value["path"]), process_group=group, no_dist=group is None)
    return value


def read_checkpoint(path: str | os.PathLike, verify: bool = True) -> dict[str, Any]:
    """Everything a checkpoint holds, read in this one process: ``{flattened key: tensor or value}``.

    Keys are DCP's (``train.model.blocks.0.attn.qkv.weight``, ``train.step``…); sharded
    tensors come back whole. For inspection and tests: it materialises the full state.
    """
    manifest = verify_checkpoint(path, checksums=verify)
    with tempfile.TemporaryDirectory(prefix="distlab-read-") as tmp:
        dcp_to_torch_save(manifest["path"], os.path.join(tmp, "state.pt"))
        nested = torch.load(os.path.join(tmp, "state.pt"), weights_only=False)
    return flat_state(nested)


# ---------------------------------------------------------------- what a training job saves

class TrainState:
    """Everything a job needs to continue exactly: weights, optimizer state, data position, step.

    A DCP ``Stateful``: ``dcp.save``/``dcp.load`` call :meth:`state_dict` and
    :meth:`load_state_dict`. Weights and optimizer state go through
    ``torch.distributed.checkpoint.state_dict`` (canonical parameter names, so the
    same checkpoint loads into DDP, FSDP or a single process, at any world size).
    ``data`` is any object with ``state_dict()``/``load_state_dict()`` (a sampler).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, data=None, step: int = 0):
        self.model, self.optimizer, self.data, self.step = model, optimizer, data, step

    def state_dict(self) -> dict:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        out = {"model": model_state, "optim": optim_state, "step": self.step}
        if self.data is not None:
            out["data"] = self.data.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.step = int(state["step"])
        if self.data is not None and "data" in state:
            self.data.load_state_dict(state["data"])
