"""The run report: the accounting, the funnel and per-stage throughput, as JSON and CSV."""

from __future__ import annotations

import csv
import io
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from distlab.data.document import AccountingError, StageStats
from distlab.data.output import STATS_CSV, STATS_FILE, RunDirectory
from distlab.data.shards import atomic_write_bytes, atomic_write_json


@dataclass
class RunReport:
    documents_in: int = 0
    kept: int = 0
    rejected: Counter = field(default_factory=Counter)
    stages: list = field(default_factory=list)  # StageStats in pipeline order
    wall_seconds: float = 0.0
    files_processed: int = 0
    files_resumed: int = 0
    tokens: int = 0
    shards: list = field(default_factory=list)
    inputs: list = field(default_factory=list)
    warnings: list = field(default_factory=list)  # empty or unreadable inputs: said, not silently counted

    def check_balance(self) -> None:
        """The guarantee of every run: documents in = kept + rejected by reason."""
        total = sum(self.rejected.values())
        if self.documents_in != self.kept + total:
            raise AccountingError(f"documents in ({self.documents_in}) != kept ({self.kept}) + "
                                  f"rejected ({total}): {dict(self.rejected)}")

    @property
    def docs_per_second(self) -> float:
        return self.documents_in / self.wall_seconds if self.wall_seconds else float("inf")

    def funnel(self) -> list[tuple[str, int, float]]:
        """(stage, documents left after it, fraction of the input) in pipeline order."""
        rows = []
        for stage in self.stages:
            if stage.name == "tokenize":
                continue
            rows.append((stage.name, stage.docs_out, stage.docs_out / max(self.documents_in, 1)))
        return rows

    def rejected_by_stage(self) -> Counter:
        by_stage: Counter = Counter()
        for reason, count in self.rejected.items():
            by_stage[reason.split(":")[0]] += count
        return by_stage

    def to_json(self) -> dict:
        return {"documents_in": self.documents_in, "kept": self.kept, "rejected": dict(sorted(self.rejected.items())),
                "stages": [s.to_json() for s in self.stages], "wall_seconds": self.wall_seconds,
                "docs_per_second": self.docs_per_second, "files_processed": self.files_processed,
                "files_resumed": self.files_resumed, "tokens": self.tokens, "shards": self.shards,
                "inputs": self.inputs, "warnings": self.warnings}

    @classmethod
    def from_json(cls, row: dict) -> "RunReport":
        return cls(row["documents_in"], row["kept"], Counter(row["rejected"]),
                   [StageStats.from_json(s) for s in row["stages"]], row["wall_seconds"],
                   row["files_processed"], row["files_resumed"], row["tokens"], row["shards"], row["inputs"],
                   row.get("warnings", []))

    @classmethod
    def load(cls, out_dir) -> "RunReport":
        """The report of the committed run in ``out_dir`` (read through its manifest)."""
        return cls.from_json(json.loads((RunDirectory(out_dir).current("read the stats of") / STATS_FILE).read_text()))

    def save(self, directory) -> None:
        """stats.json (everything) and stats.csv (one row per stage, then one per reason) into ``directory``."""
        atomic_write_json(Path(directory) / STATS_FILE, self.to_json())
        buffer = io.StringIO()
        writer = csv.writer(buffer)
        writer.writerow(["kind", "name", "docs_in", "docs_out", "rejected", "seconds", "docs_per_second"])
        for stage in self.stages:
            writer.writerow(["stage", stage.name, stage.docs_in, stage.docs_out, stage.docs_in - stage.docs_out,
                             f"{stage.seconds:.4f}", f"{stage.docs_per_second:.1f}"])
        for reason, count in sorted(self.rejected.items()):
            writer.writerow(["reason", reason, "", "", count, "", ""])
        atomic_write_bytes(Path(directory) / STATS_CSV, buffer.getvalue().encode("utf-8"))

    def table(self, timings: bool = True) -> str:
        """Human-readable summary: accounting line, per-stage table, reasons."""
        lines = [f"documents in {self.documents_in} = kept {self.kept} + rejected {sum(self.rejected.values())}"
                 f"   ({self.tokens:,} tokens in {len(self.shards)} shards)"]
        header = f"{'stage':<12}{'in':>8}{'out':>8}{'kept %':>8}"
        lines.append(header + (f"{'seconds':>10}{'docs/s':>10}" if timings else ""))
        for stage in self.stages:
            kept = 100 * stage.docs_out / max(stage.docs_in, 1)
            row = f"{stage.name:<12}{stage.docs_in:>8}{stage.docs_out:>8}{kept:>7.1f}%"
            if timings:
                row += f"{stage.seconds:>10.3f}{stage.docs_per_second:>10.0f}"
            lines.append(row)
        if timings:
            lines.append(f"wall {self.wall_seconds:.2f} s, {self.docs_per_second:.0f} documents/s end to end")
        lines.append("rejections by reason:")
        by_count = sorted(self.rejected.items(), key=lambda kv: (-kv[1], kv[0]))
        lines += [f"  {reason:<34}{count:>6}" for reason, count in by_count]
        lines += [f"warning: {warning}" for warning in self.warnings]
        return "\n".join(lines)

