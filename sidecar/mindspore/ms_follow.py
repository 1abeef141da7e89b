"""MindSpore summary files among the watched paths, converted into TensorBoard runs as they grow.

A summary directory is one run, named after the directory: mindformers' ``output/summary/rank_N``
becomes ``rank_N`` and shares that rank's run writer, so the converted ``loss/auto`` sits beside the
log-derived curves of the rank (tags differ, so one writer per run keeps every rule of
:mod:`sidecar.output.run_writer`). Offsets are checkpointed with the log offsets; re-converted records
after a crash are dropped by the run writer's watermarks. The ``_lineage`` file's training
parameters become one text event ``lineage`` at the run's newest step whenever the file grows.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from parsers.records import Record
from parsers.tags import sanitize_tag
from sidecar.mindspore.ms_summary import MsSummaryFile, read_lineage
from sidecar.output.run_writer import RunWriter

log = logging.getLogger(__name__)

LINEAGE_TAG = "lineage"
_RUN_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def run_name(summary_file: Path) -> str:
    """The run for a summary file: its directory's name, made safe as one path component."""
    name = _RUN_UNSAFE.sub("_", summary_file.parent.name).strip("._") or "summary"
    return name[:100]


@dataclass
class _Followed:
    path: Path
    run: str
    reader: MsSummaryFile | None  # None for a lineage file
    lineage_size: int = 0


class SummaryFollower:
    def __init__(self, writer_for: Callable[[str], RunWriter], restored: dict[str, int]) -> None:
        self._writer_for = writer_for
        self._restored = restored  # "dev:ino" -> offset
        self.files: dict[str, _Followed] = {}
        self.events = 0

    def add(self, path: Path) -> None:
        try:
            st = os.stat(path)
        except OSError:
            return
        key = f"{st.st_dev}:{st.st_ino}"
        if key in self.files:
            self.files[key].path = path
            return
        lineage = path.name.endswith("_lineage")
        reader = None if lineage else MsSummaryFile(path, self._restored.pop(key, 0))
        self.files[key] = _Followed(path, run_name(path), reader)

    def pump(self) -> int:
        """Convert what is new in every followed file; returns the number of events converted."""
        converted = 0
        for followed in self.files.values():
            try:
                converted += self._pump_one(followed)
            except OSError as exc:
                if isinstance(exc, FileNotFoundError):
                    continue  # gone; its points are already written
                raise
        self.events += converted
        return converted

    def _pump_one(self, followed: _Followed) -> int:
        writer = self._writer_for(followed.run)
        if followed.reader is None:
            size = followed.path.stat().st_size
            if size != followed.lineage_size:
                followed.lineage_size = size
                params = read_lineage(followed.path)
                if params:
                    text = "\n".join(f"| {sanitize_tag(k)} | {v} |" for k, v in sorted(params.items()))
                    table = "| parameter | value |\n|---|---|\n" + text
                    writer.write(Record(max(writer.max_step, 0), None, texts={LINEAGE_TAG: table}))
            return 0
        events = followed.reader.read_new()
        for event in events:
            writer.write_values(event.step, event.wall_time, event.values)
        return len(events)

    def offsets(self) -> dict[str, int]:
        """``dev:ino`` -> offset of every summary file, for the checkpoint."""
        return {key: f.reader.offset for key, f in self.files.items() if f.reader is not None}
