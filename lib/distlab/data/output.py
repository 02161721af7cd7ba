"""A run's output directory, committed atomically as a whole.

A run writes many files - token shards and their indexes, ``lineage.jsonl``,
``rejected.jsonl``, ``stats.json`` - and they are only meaningful together: a purge
that reads a lineage from one run and shards from another can "verify" a document
away that is still on disk. So every run (and every purge) builds a complete new
*generation* directory, ``gen-NNNNN/``, and then commits it by atomically replacing
``manifest.json``, the one file that says which generation is current. A process
killed at any moment leaves the previous generation in force; the half-built one,
and any ``*.tmp-PID`` file, is removed when the directory is next opened for writing.
Everything reads through the manifest::

    out/
      manifest.json          the commit point: generation, config, inputs, shards, purge rules
      gen-00003/             the current generation
        shards/shard_00000.bin (+ .index.json)
        lineage.jsonl  rejected.jsonl  stats.json  stats.csv
      work/                  per-input-file results of phase 1 (resumable cache)
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from distlab.data.shards import atomic_write_json

MANIFEST_FILE = "manifest.json"
WORK_DIR = "work"
SHARD_DIR = "shards"
LINEAGE_FILE = "lineage.jsonl"
REJECTED_FILE = "rejected.jsonl"
STATS_FILE = "stats.json"
STATS_CSV = "stats.csv"
_GENERATION_PREFIX = "gen-"


class NotARunDirectory(ValueError):
    """The directory holds no committed run (no ``manifest.json``)."""


def generation_name(number: int) -> str:
    return f"{_GENERATION_PREFIX}{number:05d}"


class RunDirectory:
    """The committed generation of a run directory, and the means to commit the next one."""

    def __init__(self, root) -> None:
        self.root = Path(root)

    # -- reading -------------------------------------------------------------------------
    def manifest(self) -> dict | None:
        path = self.root / MANIFEST_FILE
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None

    def require(self, action: str = "read") -> dict:
        """The manifest, or a one-line error saying why this is not a run directory."""
        if not self.root.exists():
            raise NotARunDirectory(f"cannot {action} {self.root}: no such directory")
        if not self.root.is_dir():
            raise NotARunDirectory(f"cannot {action} {self.root}: not a directory")
        manifest = self.manifest()
        if manifest is None or not (self.root / manifest.get("generation", "?")).is_dir():
            raise NotARunDirectory(f"cannot {action} {self.root}: it is not the output of `distlab data run` "
                                   f"(no committed {MANIFEST_FILE})")
        return manifest

    def current(self, action: str = "read") -> Path:
        """The directory of the committed generation."""
        return self.root / self.require(action)["generation"]

    def file(self, name: str) -> Path:
        """A file of the committed generation: ``LINEAGE_FILE``, ``REJECTED_FILE``, ``STATS_FILE``..."""
        return self.current() / name

    def shard_paths(self) -> list[Path]:
        return [self.current() / SHARD_DIR / name for name in self.require()["shards"]]

    # -- writing -------------------------------------------------------------------------
    def check_writable(self) -> None:
        """Refuse a directory that holds something else: we delete stale generations in it."""
        if self.root.exists() and not self.root.is_dir():
            raise NotADirectoryError(f"output {self.root} exists and is not a directory")
        if self.root.is_dir() and any(self.root.iterdir()) and self.manifest() is None \
                and not (self.root / WORK_DIR).is_dir():
            raise NotARunDirectory(f"output {self.root} is a non-empty directory that is not a distlab data run: "
                                   "choose a new or empty directory")

    def clean(self) -> list[Path]:
        """Remove what an interrupted run or purge left: uncommitted generations and ``*.tmp-*`` files."""
        if not self.root.is_dir():
            return []
        manifest = self.manifest()
        current = manifest.get("generation") if manifest else None
        removed = []
        for path in self.root.glob(f"{_GENERATION_PREFIX}*"):
            if path.is_dir() and path.name != current:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        for path in self.root.rglob("*.tmp-*"):
            if path.is_file():
                path.unlink(missing_ok=True)
                removed.append(path)
        return removed

    def begin(self) -> Path:
        """A fresh, empty directory for the next generation (not visible until :meth:`commit`)."""
        manifest = self.manifest()
        number = (manifest.get("number", 0) if manifest else 0) + 1
        staging = self.root / generation_name(number)
        if staging.exists():
            shutil.rmtree(staging)
        (staging / SHARD_DIR).mkdir(parents=True)
        return staging

    def commit(self, staging: Path, manifest: dict) -> None:
        """Make ``staging`` the current generation (one atomic rename of the manifest), then drop the old one."""
        number = int(staging.name[len(_GENERATION_PREFIX):])
        atomic_write_json(self.root / MANIFEST_FILE, {**manifest, "generation": staging.name, "number": number})
        self.clean()


def link_or_copy(source: Path, target: Path) -> None:
    """Carry an unchanged file into a new generation without copying its bytes where the filesystem allows."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)
