"""Run metadata per rank: the ``config`` text card, TensorBoard HParams data and ``run.json``.

What a run was (:mod:`parsers.run_config`) is written once per run, and again when it changes
(a new job or attempt in the same directory prints its start-up lines again):

- a text event ``config`` (a markdown table) at the first training step read after the description
  changed (for the start-up lines: the run's first step), wherever a checkpoint falls: a replay,
  which writes it at its end, and a live run, which writes it at a checkpoint, place it alike;
- the HParams plugin's session summaries (as tensorboardX's ``summary.hparams`` makes them): hparams = the
  flattened settings. No experiment summary: without one TensorBoard builds the experiment from
  every run's session, so the columns are the union of all runs' settings, each marked whether
  it differs between runs, and the metrics are every scalar tag of the runs (the HParams tab
  shows each one's last value: the final loss and the like). With one (tensorboardX's
  ``add_hparams`` writes one), TensorBoard takes that run's columns as given and marks none as
  differing;
- ``run.json`` in the run directory (written atomically: a new file, fsync, rename), with the
  same settings, the start-up facts and the configuration hash (``partial-<hex>`` when no dump was
  read, by the rank or the job: see :data:`parsers.run_config.PARTIAL`) and the card's step.

When it is written: at each checkpoint (live: every ``--checkpoint-interval``; replay: at the
end), for ranks whose description changed and that have written a training step. Not at the
first step, because a rank's ``worker_N.log``, the only file with the full pprint dump, is read
after its ``info.log``. The dump is printed by one rank in eight only; ranks of one sidecar are
one job, so a rank without its own dump uses the newest one any rank printed (rank-specific
values in it do not enter the hash).

A training resume writes a ``SessionLog.START`` that purges every tag's points from the resume
step on, the card and HParams data too if they were written there; they are written again at
the resume step then (also when the card's step came back from the checkpoint). A START that
reached the run after the last checkpoint is read again after a restart as a copy, which says
nothing of the purge: so when a rank's run is opened, a card it no longer shows at its step is
due again (:meth:`RunMetadata.shown`; the HParams data go with it). That step is ``card_step`` in
``run.json``, written with the settings it pairs with: a SIGKILL between writing them (the card
still buffered, or purged by a later START) and the checkpoint leaves a checkpoint that knows no
card while ``run.json`` says the settings were written, so a restart takes both from ``run.json``.
A restart with no checkpoint of the rank at all (killed before its first one) trusts ``run.json``'s
settings only if the run shows their card at ``card_step``: a SIGKILL after ``run.json`` was
written but before the buffered card reached the disk leaves a ``run.json`` whose card never
existed, and the restart, reading the start-up lines again, writes it then.

Across restarts: what a rank's metadata holds (the configuration read so far, so also the global
batch size and world size the batch-derived tags need, and where its segment and card are) is
part of the checkpoint, with the offsets that passed the lines it came from (:class:`MetaState`,
:meth:`RunMetadata.snapshot`), and taken back (:meth:`RunMetadata.load`) when a log that stated it
is followed again (:class:`~sidecar.output.state.RankFacts`): a restart after those offsets
does not read the start-up lines again, and the file that held them may be rotated out by then.
Lines read again after a restart (those after the oldest held record) state the same facts
again, which changes nothing. A checkpoint from before this was kept (none for the rank) falls
back to the facts in ``run.json`` (:meth:`RunMetadata.restore`).
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from pydantic import BaseModel
from tensorboard.compat.proto import summary_pb2
from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

from parsers import tags
from parsers.records import Record
from parsers.run_config import (
    DUMP_DROPPED,
    MAX_DUMP_BYTES,
    RunConfig,
    Value,
    config_hash,
    is_run_specific,
    settings,
)
from sidecar.output.config_card import hparams, markdown
from sidecar.output.durable import write_atomic
from sidecar.output.run_writer import RunWriter, text_value

log = logging.getLogger(__name__)

CONFIG_TAG = tags.CONFIG
RUN_JSON = "run.json"


@dataclass
class _RankMeta:
    config: RunConfig = field(default_factory=RunConfig)
    dirty: bool = False
    written: dict[str, Value] | None = None  # the settings last written
    card_step: int | None = None
    due_step: int | None = None  # where the card goes: the first training step since the description changed
    segment_step: int | None = None  # first training step of the current segment
    segment_wall: float | None = None
    last_step: int | None = None
    batch: tuple[int | None, int | None] = (None, None)  # global batch size, world size
    saved: tuple[RunConfig, str] | None = None  # a copy of the config last checkpointed, and its JSON

    def config_json(self) -> str:
        """The config as JSON text for the checkpoint, made again only when it changed: an idle
        checkpoint of 1,024 ranks spent most of its time re-serialising unchanged configs."""
        if self.saved is None or self.saved[0] != self.config:
            config = copy.deepcopy(self.config)  # kept to compare with; asdict would copy it again
            values = {f.name: getattr(config, f.name) for f in fields(config)}
            self.saved = (config, json.dumps(values, default=str, ensure_ascii=False))
        return self.saved[1]


class MetaState(BaseModel):
    """One rank's metadata in the checkpoint. ``config``: its :class:`RunConfig` fields as JSON
    text (written as ``run.json`` is, so any value a dump holds survives, NaN included);
    ``job_dump``: its own dump is the one ranks without theirs use. The settings last written
    are not kept: they are ``run.json``'s, written before the checkpoint is saved."""

    config: str = "{}"
    job_dump: bool = False
    dirty: bool = False
    card_step: int | None = None
    due_step: int | None = None
    segment_step: int | None = None
    segment_wall: float | None = None
    last_step: int | None = None


class RunMetadata:
    def __init__(self) -> None:
        self._ranks: dict[int, _RankMeta] = {}
        self._job_dump: dict | None = None
        self._loaded: set[int] = set()  # ranks restored from a checkpoint (load)

    def _meta(self, rank: int) -> _RankMeta:
        meta = self._ranks.get(rank)
        if meta is None:
            meta = self._ranks[rank] = _RankMeta()
        return meta

    def config(self, rank: int) -> RunConfig:
        """The rank's description, with the job's dump when it printed none itself."""
        own = self._meta(rank).config
        return own if own.dump is not None or self._job_dump is None else replace(own, dump=self._job_dump)

    def note(self, rank: int, updates: dict[str, object]) -> None:
        """Start-up facts a stream of ``rank`` just stated."""
        meta = self._meta(rank)
        if updates.pop(DUMP_DROPPED, False):
            log.warning("rank %d: a configuration dump in the log is over %d MiB or not a Python literal; "
                        "its run metadata has the start-up lines only", rank, MAX_DUMP_BYTES >> 20)
        changed = [rank] if meta.config.update(updates) else []
        dump = updates.get("dump")
        if isinstance(dump, dict) and dump != self._job_dump:  # rare: once per job
            self._job_dump = dump
            changed += [r for r, other in self._ranks.items() if other.config.dump is None and r != rank]
        for rank_id in changed:
            other = self._ranks[rank_id]
            other.dirty = True
            facts = self.config(rank_id).facts()
            other.batch = (facts["global_batch_size"], facts["world_size"])

    def _settings(self, rank: int) -> dict[str, Value]:
        config = self.config(rank)
        values = settings(config)
        if config.dump is not self._meta(rank).config.dump:  # borrowed: its rank's own values are not this rank's
            values = {k: v for k, v in values.items() if k.startswith("run.") or not is_run_specific(k)}
        return values

    def config_hash(self, rank: int) -> str | None:
        """The hash of the rank's configuration as read so far; ``None`` before any start-up line."""
        values = self._settings(rank)
        return self._digest(rank, values) if any(v is not None for v in values.values()) else None

    def _digest(self, rank: int, values: dict[str, Value]) -> str:
        """:func:`config_hash` of ``values``, marked partial when neither the rank nor the job printed a dump."""
        return config_hash(values, partial=self.config(rank).dump is None)

    def batch(self, rank: int) -> tuple[int | None, int | None]:
        """The rank's global batch size and world size, as far as its log said."""
        meta = self._ranks.get(rank)
        return meta.batch if meta is not None else (None, None)

    def snapshot(self, ranks: set[int] | None = None) -> dict[str, MetaState]:
        """Every rank's metadata (of ``ranks``, if given) for the checkpoint."""
        return {
            str(rank): MetaState(
                config=meta.config_json(),
                job_dump=meta.config.dump is not None and meta.config.dump is self._job_dump,
                dirty=meta.dirty, card_step=meta.card_step, due_step=meta.due_step, segment_step=meta.segment_step,
                segment_wall=meta.segment_wall, last_step=meta.last_step)
            for rank, meta in self._ranks.items() if ranks is None or rank in ranks
        }

    def load(self, rank: int, state: MetaState, run_dir: Path) -> None:
        """Go on from a checkpoint's :meth:`snapshot` of ``rank``, whose run is ``run_dir`` (its
        ``run.json`` holds the settings last written)."""
        config = RunConfig()
        config.update(json.loads(state.config))
        written, card_step = _written(_load(run_dir))
        self._ranks[rank] = _RankMeta(
            config=config, dirty=state.dirty, written=written,
            card_step=card_step if card_step is not None else state.card_step, due_step=state.due_step,
            segment_step=state.segment_step, segment_wall=state.segment_wall, last_step=state.last_step)
        if state.job_dump:
            self._job_dump = config.dump
        self._loaded.add(rank)
        for rank_id in self._ranks:  # ranks without a dump of their own may borrow this one
            facts = self.config(rank_id).facts()
            self._ranks[rank_id].batch = (facts["global_batch_size"], facts["world_size"])

    def restore(self, rank: int, run_dir: Path) -> None:
        """A run that already has a ``run.json`` and no metadata in the checkpoint (one from before
        it had them; a restart that does not read the start-up lines again): its facts give the
        batch size for the batch-derived tags, and it is not rewritten unless the configuration
        read from now on differs."""
        meta = self._meta(rank)
        if meta.written is not None or meta.config != RunConfig() or rank in self._loaded:
            return
        content = _load(run_dir)
        if not isinstance(content.get("run"), dict) or not isinstance(content.get("settings"), dict):
            return
        meta.config.update(content["run"])
        meta.written, meta.card_step = _written(content)
        facts = meta.config.facts()
        meta.batch = (facts["global_batch_size"], facts["world_size"])

    def shown(self, rank: int, watermarks: dict[str, int]) -> None:
        """``rank``'s run is open and shows ``watermarks`` (the START purge applied): a card the
        checkpoint says is at a step the run no longer shows is due again. A START written after
        the last checkpoint purged it, and the restart reads that resume again as a copy."""
        meta = self._ranks.get(rank)
        if meta is not None and meta.card_step is not None and watermarks.get(CONFIG_TAG, -1) < meta.card_step:
            meta.written = None
            meta.dirty = True

    def stepped(self, rank: int, record: Record, resumed: bool) -> None:
        """A training step of ``rank`` was written (after its resume marker, if ``resumed``)."""
        meta = self._meta(rank)
        if resumed:
            if meta.card_step is not None and meta.card_step >= record.step:
                meta.written = None  # the START marker purged the card
                meta.dirty = True
            if meta.due_step is not None and meta.due_step >= record.step:
                meta.due_step = None  # its place was purged too: the resume step
            meta.segment_step = None
        if meta.segment_step is None:
            meta.segment_step, meta.segment_wall = record.step, record.wall_time
        if meta.dirty and meta.due_step is None:
            meta.due_step = record.step
        meta.last_step = record.step

    def write_due(self, writers: dict[int, RunWriter]) -> dict[int, dict[str, Value]]:
        """Write what changed for every rank that has a training step (see the module docstring).
        Returns the settings of each rank whose run has new ones, or had them already after a
        restart (the other outputs are told them then: they may not have kept them)."""
        told: dict[int, dict[str, Value]] = {}
        for rank, meta in self._ranks.items():
            writer = writers.get(rank)
            if not meta.dirty or meta.segment_step is None or writer is None:
                continue
            meta.dirty = False
            due, meta.due_step = meta.due_step, None
            config = self.config(rank)
            values = self._settings(rank)
            if values == meta.written or not any(v is not None for v in values.values()):
                continue
            digest = self._digest(rank, values)
            if meta.written is None and meta.card_step is None:  # a restart with no checkpoint of the rank
                written, card_step = _written(_load(writer.run_dir))
                if written == values and (card_step is None or writer.view.watermarks.get(CONFIG_TAG, -1) >= card_step):
                    meta.written, meta.card_step = values, card_step  # it read the start-up lines again
                    told[rank] = values
                    continue
            step = max(due if due is not None else meta.last_step, writer.view.watermarks.get(CONFIG_TAG, -1) + 1)
            wall = meta.segment_wall if meta.segment_wall is not None else 0.0
            writer.write_values(step, wall, [text_value(CONFIG_TAG, markdown(values, digest)), *_hparams_values(values)])
            _write_json(writer.run_dir,
                        {"config_hash": digest, "run": config.facts(), "settings": values, "card_step": step})
            meta.written, meta.card_step = values, step
            told[rank] = values
        return told


def _hparams_values(values: dict[str, Value]) -> list[summary_pb2.Summary.Value]:
    """The HParams plugin's session start (the settings) and end, without an experiment."""
    start = plugin_data_pb2.SessionStartInfo()
    for key, value in hparams(values).items():
        if isinstance(value, str):
            start.hparams[key].string_value = value
        elif isinstance(value, bool):
            start.hparams[key].bool_value = value
        else:
            start.hparams[key].number_value = float(value)
    end = plugin_data_pb2.SessionEndInfo(status=api_pb2.STATUS_SUCCESS)
    return [_hparams_value("_hparams_/session_start_info", plugin_data_pb2.HParamsPluginData(session_start_info=start)),
            _hparams_value("_hparams_/session_end_info", plugin_data_pb2.HParamsPluginData(session_end_info=end))]


def _hparams_value(tag: str, data: plugin_data_pb2.HParamsPluginData) -> summary_pb2.Summary.Value:
    plugin = summary_pb2.SummaryMetadata.PluginData(plugin_name="hparams", content=data.SerializeToString())
    return summary_pb2.Summary.Value(tag=tag, metadata=summary_pb2.SummaryMetadata(plugin_data=plugin))


def _load(run_dir: Path) -> dict:
    """``run_dir/run.json``, or ``{}`` when there is none (or it is not one)."""
    try:
        with open(run_dir / RUN_JSON, encoding="utf-8") as fh:
            content = json.load(fh)
    except (OSError, ValueError):
        return {}
    return content if isinstance(content, dict) else {}


def _written(content: dict) -> tuple[dict[str, Value] | None, int | None]:
    """The settings a ``run.json`` says were written, and the step of their card (``None`` in
    one from before it was kept)."""
    written, step = content.get("settings"), content.get("card_step")
    if not isinstance(written, dict):
        return None, None
    return written, step if isinstance(step, int) and not isinstance(step, bool) else None


def _write_json(run_dir: Path, content: dict) -> None:
    """``run_dir/run.json``, atomically; ``run_dir`` is a run under ``--out`` the writer made."""
    write_atomic(run_dir / RUN_JSON, json.dumps(content, indent=1, default=str, ensure_ascii=False).encode("utf-8"))
