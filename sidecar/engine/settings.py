"""What an engine is told (:class:`Settings`), and the names its parts share.

Contract: :class:`Settings` is all an engine depends on from outside (paths, options, the outputs
besides TensorBoard, the clock); :class:`CrossRank` is what sees every rank's steps (the
aggregator, or a replay worker's relay to it). Nothing here does I/O.

Invariant: an engine's settings change after it is made only by
:meth:`~sidecar.engine.sources.SourcesPart.restrict` (a replay worker's share of the ranks).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from parsers.custom_metrics import CustomMetric
from parsers.records import MalformedLine, ParallelConfigLine, PipelineLine, Record
from sidecar.analysis.alerts import Alert
from sidecar.analysis.detectors import AlertSettings, Group
from sidecar.following.clock import SYSTEM, Clock
from sidecar.output import run_names
from sidecar.output.sink import Sink

SCAN_PASSES = 4
LEAD = 256  # steps the aggregate may hold before only the ranks it waits for are read
TOTAL_READ = 8 << 20  # bytes read ahead over all files at once (split between them)
MIN_READ = 64 << 10
RANK_RUN = re.compile(r"rank_(\d+)")
CROSS_RANK = (Group.BEHIND, Group.DIVERGENCE)  # alerts that also go to the aggregate run
NOTED = {MalformedLine, PipelineLine, ParallelConfigLine}  # parsed lines the hub's _note looks at


@dataclass
class Settings:
    out: Path
    roots: list[Path]
    default_rank: int = 0
    instance: str = "default"
    from_end: bool = False
    max_line: int = 1 << 20
    companion_wait: float = 0.5
    rank_pattern: str | None = None
    aggregate: bool = True
    aggregate_timeout: float = float("inf")  # replay waits for every rank; live gives up after this
    loss_ranks: set[int] | None = None
    alerts: AlertSettings = field(default_factory=AlertSettings)
    alert_sinks: list[Callable[[Alert], None]] = field(default_factory=list)  # besides the log and the runs
    live: bool = False
    run_name: str = run_names.DEFAULT
    label: str | None = None
    job: str | None = None  # --job: the {job} of --run-name
    every: int = 1  # --every: keep every N-th step per tag (sidecar.output.thinning)
    max_file_bytes: int | None = None  # --max-event-file-mb
    metrics: list[CustomMetric] = field(default_factory=list)  # the config file's metrics:
    ranks: set[int] | None = None  # follow only these ranks (a replay worker's share, sidecar.service.replay_workers)
    sinks: list[Sink] = field(default_factory=list)  # outputs besides TensorBoard, fed what it writes
    clock: Clock = SYSTEM  # the engine's only source of time


class ForeignRank(Exception):
    """A line of a rank outside :attr:`Settings.ranks` (a labelled line in another rank's file):
    this engine must not write that rank's run, another one does."""


class CrossRank(Protocol):
    """What sees every rank's training steps: the aggregator, or a replay worker's relay to it."""

    expected: set[int]

    def observe(self, rank: int, record: Record, now: float, resumed: bool = False) -> None: ...

    def note_pipeline(self, line: PipelineLine) -> None: ...

    def note_parallel(self, line: ParallelConfigLine) -> None: ...

    def pending_steps(self) -> int: ...

    def waits_for(self, rank: int) -> bool: ...

    def compared_ranks(self) -> set[int]: ...
