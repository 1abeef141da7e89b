"""``--mlflow TRACKING_URI``: every run's points, settings and texts in an MLflow tracking server, exactly once.

A :class:`~sidecar.output.sink.Sink`. Each run the hub hands over (a rank's, the aggregate) is one
MLflow run in the experiment ``experiment`` (``--job``), named as its path under ``--out``, tagged
``rank`` (``aggregate`` for the aggregate), ``host``, ``instance``, ``mstb.run`` and, once the
settings are known, ``config_hash``. What maps to what (docs/mlflow.md):

- a scalar point: a metric at its global step, the log's wall time as its timestamp;
- a text event (config card, alert, lifecycle, checkpoint): a run tag named as the TensorBoard tag,
  holding the latest text; ``events/lifecycle/finished|failed|running`` also set the run's status
  (FINISHED, FAILED, RUNNING); the aggregate ends when every rank run has, FAILED if one did;
- a resume: MLflow cannot replace points, so the later ones are logged beside the superseded ones
  at the same steps, and the metric ``mstb/resumed-at`` marks the step training went back to;
- the settings (``run.json``): params, see :mod:`sidecar.output.mlflow_sender`.

Exactly once: everything is spooled (:mod:`sidecar.output.mlflow_spool`) as operations, one JSON
array a line: ``["n", run, rank]`` a run written to, ``["m", run, key, value, step, ts_ms]``,
``["t", run, tag, text, step]``, ``["s", run, status, ts_ms]``, ``["r", run, step, ts_ms]``,
``["p", run, settings]``, and at each seal ``["a", run, file, offset]``: where the run holds the
last event taken from it since the last seal. :meth:`MLflowSink.sync` seals them durably, and
only sealed segments are sent. The sink's durable state, which a restart reads back before anything is written, is
in the marks: a point or resume handed ``again`` at or before the run's last position taken is
not spooled again; nor is a point at or under its key's mark (the highest step spooled since the
run's last resume). Positions are needed because a run handed again from its start (one the
checkpoint has no view of: a rank's ``vs samples`` twins, the aggregate) repeats its superseded
segments, whose steps may lie past the newest segment's marks. Never blocking: the engine's
thread only appends to the spool; the sending thread (:class:`~sidecar.output.mlflow_sender.Sender`)
does the network. Past :data:`QUEUE_LIMIT` unsent points new ones are dropped and counted.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path

from parsers import tags as tb_tags
from parsers.records import Record
from sidecar.output.mlflow_sender import STATUS, Sender
from sidecar.output.mlflow_spool import Spool, digest, spool_dir
from sidecar.output.run_meta import RUN_JSON
from sidecar.output.run_writer import CUSTOM_SCALARS_TAG
from sidecar.output.sink import Position, SinkState

log = logging.getLogger(__name__)

QUEUE_LIMIT = 2_000_000  # points spooled and not sent (about 100 bytes each on disk)
COUNTS = ("sent", "rejected", "dropped-queue-full", "retries", "artifacts-failed")
TERMINAL = ("FINISHED", "FAILED")


def _run_json(run_dir: Path) -> dict:
    try:
        content = json.loads((run_dir / RUN_JSON).read_bytes())
    except (OSError, ValueError):
        return {}
    return content if isinstance(content, dict) else {}


def _taken(marks: dict, at: Position | None) -> bool:
    """Is what the run holds at ``at`` spooled already (the run was taken up to there or past)?"""
    taken = marks.get("at")
    return at is not None and taken is not None and Position(*taken) >= at


def _ms(wall_time: float | None) -> int:
    return int(round((wall_time if wall_time is not None else time.time()) * 1000))


class MLflowSink:
    name = "mlflow"

    def __init__(self, uri: str, out: Path, instance: str, experiment: str, drain_timeout: float,
                 limit: int = QUEUE_LIMIT) -> None:
        self.uri, self.out = uri, out
        self.spool = Spool(spool_dir(out, instance), limit)
        self.counts = dict.fromkeys(COUNTS, 0)
        self.sender = Sender(uri, experiment, instance, self.spool, self.counts)
        self.drain_timeout = drain_timeout
        self._ranks: dict[str, int | None] = {}  # runs written to by this process
        self._open = False
        self._full_logged = False
        self._moved: set[str] = set()  # runs taken further since the last seal (_taking)
        self._ranks_status: str | None = None  # what the runs that are not one rank's follow (_follow_ranks)

    def restore(self, state: SinkState | None) -> None:
        """Read the spool; a checkpoint that knows segments the spool lacks means the spool was lost:
        every point is then checked against the server before it is sent."""
        if self._open:
            return
        self.spool.open()
        sealed = int(state.get("segment", 0)) if isinstance(state, dict) else 0
        if sealed > self.spool.upto:
            log.warning("the MLflow spool in %s is behind the checkpoint (deleted?); what is read again is "
                        "checked against the server before it is sent", self.spool.dir)
            self.sender.verify_all = True
            if isinstance(state.get("runs"), dict) and not self.spool.sent.get("runs"):
                self.spool.sent = {"uri": self.uri, "experiment": state.get("experiment"), "runs": state["runs"]}
        self._start()

    def _start(self) -> None:
        if not self._open:
            self._open = True
            if not self.spool.opened:
                self.spool.open()
            self.sender.start()

    def _run(self, run: str, rank: int | None) -> dict:
        if run not in self._ranks:
            self._start()
            self._ranks[run] = rank
            self.spool.add(["n", run, rank])
        return self.spool.mark(run)

    def write(self, run: str, rank: int | None, record: Record, again: bool = False,
              at: Position | None = None) -> None:
        texts = {key: text for key, text in record.texts.items() if key != CUSTOM_SCALARS_TAG}  # TensorBoard's own
        if not record.scalars and not texts:
            return
        marks = self._run(run, rank)
        if again and _taken(marks, at):
            return
        keys, step, ts = marks["keys"], record.step, _ms(record.wall_time)
        for key, value in record.scalars.items():
            if step > keys.get(key, -1) and self._room():
                self.spool.add(["m", run, key, float(value), step, ts])
        for key, text in texts.items():
            if step <= keys.get(key, -1):
                continue
            self.spool.add(["t", run, key, text, step])
            status = STATUS.get(key[len(tb_tags.LIFECYCLE_PREFIX):]) if key.startswith(tb_tags.LIFECYCLE_PREFIX) else None
            if status is not None:
                self._status(run, status, ts)
                self._follow_ranks(ts)
        if rank is None and self._ranks_status is not None:
            self._status(run, self._ranks_status, ts)
        self._taking(run, at)

    def _taking(self, run: str, at: Position | None) -> None:
        """The run is taken up to ``at``: marked now, spooled (``a``) once per seal, after what it covers."""
        if at is not None:
            self.spool.mark(run)["at"] = [at.file, at.offset]
            self._moved.add(run)

    def _room(self) -> bool:
        if self.spool.room() > 0:
            return True
        self.counts["dropped-queue-full"] += 1
        if not self._full_logged:
            self._full_logged = True
            log.warning("MLflow at %s: %d points wait to be sent (%s); new points are dropped and counted until "
                        "it takes them", self.uri, self.spool.limit, self.sender.describe() or "it is slow")
        return False

    def _status(self, run: str, status: str, ts: int) -> None:
        if self.spool.mark(run).get("status") != status:
            self.spool.add(["s", run, status, ts])

    def _follow_ranks(self, ts: int) -> None:
        """The runs that are not one rank's (the aggregate, twins) end when every rank run has ended,
        FAILED if one failed, and run again with a rank that does."""
        ranks = [self.spool.mark(run).get("status") for run, rank in self._ranks.items() if rank is not None]
        if ranks and all(status in TERMINAL for status in ranks):
            self._ranks_status = "FAILED" if "FAILED" in ranks else "FINISHED"
        else:
            self._ranks_status = None if "RUNNING" not in ranks else "RUNNING"
        for run, rank in self._ranks.items():
            if rank is None and self._ranks_status is not None:
                self._status(run, self._ranks_status, ts)

    def resume(self, run: str, rank: int | None, step: int, wall_time: float | None, again: bool = False,
               at: Position | None = None) -> None:
        marks = self._run(run, rank)
        ts = _ms(wall_time)
        if again and (_taken(marks, at) if at is not None else marks.get("resume") == [step, ts]):
            return  # spooled before the restart (without a position: judged by step and time)
        self.spool.add(["r", run, step, ts])  # a new one, even at the step and time of the last
        self._taking(run, at)

    def meta(self, run: str, rank: int | None, settings: Mapping[str, object]) -> None:
        """The settings, with the configuration hash ``run.json`` states beside them (written first)."""
        marks = self._run(run, rank)
        content = {"settings": json.loads(json.dumps(dict(settings), default=str)),
                   "config_hash": _run_json(self.out / run).get("config_hash")}
        if marks.get("settings") != digest(content):
            self.spool.add(["p", run, content])

    def flush(self) -> None:
        """Nothing to do: the spool is written as it comes and sealed by :meth:`sync`."""

    def sync(self) -> SinkState | None:
        """Seal what was handed over (durable before this returns) and let the sender have it."""
        if not self._open:
            return None
        for run in self._moved:
            self.spool.add(["a", run, *self.spool.mark(run)["at"]])
        self._moved.clear()
        if self.spool.seal() is not None:
            self.sender.wake()
        return {"segment": self.spool.upto, "experiment": self.sender.experiment_id,
                "runs": dict(self.sender.ids)}

    def health(self) -> Mapping[str, int]:
        """Counts by reason, and ``queued``: points spooled, not sent yet; ``seconds-failing``: how long the
        server has failed for (0 when it answers)."""
        since = self.sender.failing_since
        return {**self.counts, "queued": self.spool.limit - self.spool.room(),
                "seconds-failing": int(time.monotonic() - since) if since is not None else 0}

    def close(self) -> None:
        """Send what is sealed while the server takes it (stop once it made no progress for the drain
        timeout); what is left stays in the spool for the next start."""
        if not self._open:
            return
        self.spool.close()
        self.sender.stop(self.drain_timeout)
        left = self.spool.limit - self.spool.room()
        if left:
            log.warning("MLflow at %s: %d point(s) not sent yet (%s); they stay in %s and are sent at the next "
                        "start with this --out and --instance", self.uri, left,
                        self.sender.describe() or "the server is slow", self.spool.dir)
        self._open = False  # a later start (a new engine after --out was deleted) opens it again
        self.sender = Sender(self.uri, self.sender.experiment, self.sender.instance, self.spool, self.counts)
        self._ranks.clear()
        self._moved.clear()
