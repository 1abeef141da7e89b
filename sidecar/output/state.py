"""The checkpoint: where each followed file was read to, what each run already holds, and what
later output depends on that the lines before those offsets stated (each rank's run metadata,
its parallel layout, the aggregate's waiting steps), and what each rank's alerts need after a
restart (lifecycle, last step, the detectors' episodes and baselines); the parts analysis fills are
typed in :mod:`sidecar.output.state_parts`.
Parts added later are absent in checkpoints written before they were kept; those load as before.

Written atomically (temp file, fsync, rename, fsync of the directory), and only after the
event files were synced, so it never claims more than is durably on disk. A state file that
is missing, torn or from another version is a warning and a fresh start: reading the logs again
from the beginning is safe because the run writers drop every point a run already has.

A state whose runs are no longer on disk (output deleted, :func:`runs_match`) claims points
that are gone; it is dropped (:meth:`StateStore.forget`) so that the logs are read again.

One file per sidecar instance (``state-<instance>.json``): several sidecars (one per node)
can share one ``--out`` without touching each other's checkpoints. And one per experiment
(``state-<instance>@<experiment>.json``, :func:`sidecar.output.run_names.experiment`) when
``--run-name`` puts experiments side by side in one ``--out``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, Field, ValidationError

from sidecar.output.durable import write_atomic
from sidecar.output.event_file import vanished
from sidecar.output.run_meta import MetaState
from sidecar.output.state_parts import AggregateState, NoteState, WatchState

log = logging.getLogger(__name__)

STATE_DIR = ".mstb-sidecar"
VERSION = 2
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


class FileState(BaseModel):
    path: str
    dev: int
    ino: int
    offset: int = Field(ge=0)
    skipping: bool = False
    head: str
    marker: str
    # 2: whole lines before the offset (sidecar.following.tailer.marker_start); a checkpoint
    # without it (1) holds the 64 bytes before the offset, still verified as such once
    marker_kind: int = 1


class StreamState(BaseModel):
    """One rank's stream through one chain: line numbering and its place in position order."""

    assembler: dict[str, int] = {}
    prev_step: int | None = None
    live: bool = True


class RunState(BaseModel):
    name: str = ""  # the run's path under --out (--run-name); empty: rank_<key>
    file: str = ""
    size: int = Field(0, ge=0)
    watermarks: dict[str, int] = {}
    alerts: WatchState | None = None  # the rank's lifecycle and open alert episodes (None: before they were kept)


class RankFacts(BaseModel):
    """What a rank's log stated that later output depends on, and the chains (live file paths)
    whose lines stated it: a restart takes it back when it follows one of them again, not for
    the same rank number of other logs (another experiment replayed into the same ``--out``)."""

    chains: list[str] = []
    meta: MetaState | None = None  # run metadata: configuration, so global batch and world size
    layout: NoteState | None = None  # the parallel layout


class State(BaseModel):
    version: int = VERSION
    files: list[FileState] = []
    chains: dict[str, dict[str, StreamState]] = {}  # chain (live file path) -> rank -> stream
    runs: dict[str, RunState] = {}
    summaries: dict[str, int] = {}  # MindSpore summary file "dev:ino" -> offset
    aggregate: AggregateState | None = None  # what the cross-rank aggregate still waits for
    firing: list[str] = []  # alerts about the ranks together whose episode is on
    together: WatchState | None = None  # the divergence check's state (None: before it was kept)
    aggregate_run: str = ""  # the aggregate's run, that ``aggregate`` is of; empty: aggregate/<instance>
    facts: dict[str, RankFacts] = {}  # rank -> what its start-up lines stated so far
    sinks: dict[str, dict[str, Any]] = {}  # sink name -> what its sync() returned (sidecar.output.sink)


def instance_name(raw: str) -> str:
    """A file-name-safe instance name (it may come from a hostname or the user)."""
    return _UNSAFE.sub("_", raw)[:64] or "default"


def runs_match(out: Path, state: State) -> dict[str, str]:
    """Rank key -> why its checkpointed run (``RunState.file``/``size``) is no longer on disk:
    the file or ``rank_<key>`` is gone, or the file is shorter. Empty when every run is there."""
    lost = {key: vanished(out / (run.name or f"rank_{key}"), run.file, run.size) for key, run in state.runs.items()}
    return {key: why for key, why in lost.items() if why is not None}


M = TypeVar("M", bound=BaseModel)


class StateStore:
    def __init__(self, out_dir: Path, instance: str, experiment: str = "") -> None:
        name = instance_name(instance)
        if experiment:  # readable, and distinct however the name was cut or made safe
            digest = hashlib.sha256(experiment.encode()).hexdigest()[:8]
            name = f"{name}@{_UNSAFE.sub('_', experiment)[:48]}-{digest}"
        self.path = out_dir / STATE_DIR / f"state-{name}.json"

    def load(self) -> State:
        return self.load_as(State, VERSION)

    def load_as(self, model: type[M], version: int) -> M:
        """The checkpoint as ``model``, or a fresh one (with a warning) when it is unreadable,
        corrupt or of another version. ``model`` has a ``version`` field."""
        try:
            raw = self.path.read_bytes()  # decoded by json.loads: bad UTF-8 is corruption too
        except FileNotFoundError:
            return model()
        except OSError as exc:
            log.warning("cannot read state file %s (%s); starting from the beginning", self.path, exc)
            return model()
        try:
            state = model.model_validate(json.loads(raw))
        except (ValueError, ValidationError) as exc:
            log.warning("state file %s is corrupt (%s); starting from the beginning, points already "
                        "written are not repeated", self.path, str(exc).splitlines()[0])
            return model()
        if getattr(state, "version", None) != version:
            log.warning("state file %s has version %s; starting afresh", self.path, getattr(state, "version", None))
            return model()
        return state

    def forget(self) -> None:
        """Drop the checkpoint (it claims output that is gone): the next start reads every log again."""
        self.path.unlink(missing_ok=True)

    def save(self, state: BaseModel) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path, state.model_dump_json().encode())
