"""The checkpoint: built from the engine (:meth:`CheckpointPart.state`), checked at start
(:func:`trusted`), taken back (the alerts' state here; files, streams and facts where they are
opened), and the parts replay workers hand over (:meth:`CheckpointPart.adopt`).

Contract (points 1 and 4 of the invariant of :mod:`sidecar.engine.hub`): every sink is synced
(TensorBoard first: what the others were handed is durable in the runs) before the offsets that
passed what they were handed are saved, and each sink's ``sync()`` is saved with them; a file's
offset is its :meth:`~sidecar.engine.sources.Source.safe_offset`; what later output depends on
(each rank's run metadata and layout, the aggregate's waiting steps, open alert episodes) is
saved with the offsets that passed the lines it came from. A worker saves only its own ranks.
A state that does not describe the runs on disk is not trusted: every log is read again, and the
run writers drop what the runs already show.
"""

from __future__ import annotations

import logging
from pathlib import Path

from sidecar.analysis.accounting import Accounting
from sidecar.analysis.alerts import WatchState
from sidecar.following.tailer import STDIN_NAME
from sidecar.output.state import FileState, RankFacts, RunState, State, StreamState, runs_match
from sidecar.engine.delivery import RankStats
from sidecar.engine.sources import Source

log = logging.getLogger(__name__)


class CheckpointPart:
    """The engine's part that saves and takes back its state (a mixin of :class:`Engine`)."""

    def _restore_alerts(self) -> None:
        """The checkpoint's lifecycles and open alert episodes (:meth:`Alerts.restore`)."""
        now, mine = self.settings.clock.monotonic(), self.settings.ranks
        for key, run in self._restored.runs.items():
            if run.alerts is not None and (mine is None or int(key) in mine):
                self.alerts.restore(int(key), run.alerts, now)
        if self._restored.together is not None or self._restored.firing:
            self.alerts.restore(-1, self._restored.together or WatchState(firing=self._restored.firing), now)

    def files(self) -> dict[str, int]:
        """Every file followed, here or by replay workers: path -> offset read to."""
        found = {f.path: f.offset for part in self.adopted for f in part.files}
        found.update((str(s.tail.path), s.tail.offset) for s in self.sources.values())
        return found

    def adopt(self, part: State, stats: dict[int, RankStats], accounting: Accounting) -> None:
        """What a worker read and wrote: its checkpoint part (saved with this engine's), its
        ranks' figures and its counts."""
        self.adopted.append(part)
        self.stats.update(stats)
        self.accounting.merge(accounting)

    def checkpoint(self, parts: list[State] | None = None) -> None:
        """Durability barrier for events, then the offsets that depend on them. ``parts``: those
        replay workers handed over while they read, instead of their last ones (:attr:`adopted`)."""
        parts = self.adopted if parts is None else parts
        marks = [rank.writer.view.watermarks for rank in self.ranks.values()]
        marks += [run.watermarks for part in parts for run in part.runs.values()]
        if self.layout is not None:
            self.layout.update((t for m in marks for t in m),
                               self.aggregator.writer.view.watermarks if self.aggregator is not None else ())
        self.store.save(self.state(parts))

    def state(self, parts: list[State] | None = None) -> State:
        """Sync every writer and describe what they hold and where each file was read to, with the
        parts replay workers handed over (``parts``, by default :attr:`adopted`)."""
        for rank_id, values in self.meta.write_due({rank_id: rank.writer for rank_id, rank in self.ranks.items()}).items():
            self.tensorboard.meta(self.ranks[rank_id].name, rank_id, values)
        mine = self.settings.ranks  # a worker hands over only its own ranks
        state = State(summaries=self.summaries.offsets(), facts=self._facts(mine))
        for part in self.adopted if parts is None else parts:
            state.files += part.files
            state.runs.update(part.runs)
            state.facts.update(part.facts)
            for key, streams in part.chains.items():
                state.chains.setdefault(key, {}).update(streams)
        handed = set(state.runs)
        for sink in self.sinks:  # TensorBoard first: what the others were handed is durable in the runs
            saved = sink.sync()
            if saved is not None:
                state.sinks[sink.name] = saved
        if self.aggregator is not None:
            state.aggregate, state.aggregate_run = self.aggregator.snapshot(), self.aggregate_run
        elif self._placing:  # not placed yet: what the checkpoint had of it still holds
            state.aggregate, state.aggregate_run = self._restored.aggregate, self._restored.aggregate_run
        for rank_id, rank in self.ranks.items():
            view = rank.writer.view  # synced above
            state.runs[str(rank_id)] = RunState(name=rank.name, file=view.file, size=view.size,
                                                watermarks=dict(view.watermarks))
        for key, run_state in self._restored.runs.items():
            if mine is None or int(key) in mine:
                state.runs.setdefault(key, run_state)
        for key, facts in self._restored.facts.items():  # of logs not followed again (yet)
            if mine is None or int(key) in mine:
                state.facts.setdefault(key, facts)
        for chain in self.chains.values():
            if chain.key == str(STDIN_NAME):  # a stream is not read again: after a restart its steps begin anew
                continue
            # a rank this chain gave no line yet since the restart keeps its stream as restored (_stream)
            streams = {r: s for r, s in self._restored.chains.get(chain.key, {}).items() if mine is None or int(r) in mine}
            state.chains[chain.key] = streams | {
                str(rank): StreamState(assembler=s.assembler.snapshot(), prev_step=s.cursor.prev_step, live=s.cursor.live)
                for rank, s in chain.streams.items()
            }
        for key, streams in self._restored.chains.items():
            state.chains.setdefault(key, {r: s for r, s in streams.items() if mine is None or int(r) in mine})
        for key, run_state in state.runs.items():  # but those replay workers observed, and handed over
            if key not in handed and (watch := self.alerts.snapshot(int(key))) is not None:
                state.runs[key] = run_state.model_copy(update={"alerts": watch})
        state.together = self.alerts.snapshot(-1)
        state.firing = state.together.firing if state.together is not None else []
        for source in self.sources.values():
            file_state = self._file_state(source)
            if file_state is not None:
                state.files.append(file_state)
        return state

    def _facts(self, mine: set[int] | None) -> dict[str, RankFacts]:
        """Each rank's (of ``mine``, if given) metadata and layout, with the chains that stated them."""
        metas = self.meta.snapshot(mine)
        ranks = {int(key) for key in metas} | {rank for rank in self._layouts if mine is None or rank in mine}
        return {
            str(rank): RankFacts(chains=sorted(self._fed.get(rank, ())), meta=metas.get(str(rank)),
                                 layout=note.snapshot() if (note := self._layouts.get(rank)) is not None else None)
            for rank in ranks
        }

    def _file_state(self, source: Source) -> FileState | None:
        tail = source.tail
        if tail.stream:  # cannot be read again: only its chain's state is kept
            return None
        offset = source.safe_offset()
        held = offset != tail.offset
        saved_offset, tail.offset = tail.offset, offset
        try:
            head, marker = tail.fingerprint()
        except OSError:
            return None
        finally:
            tail.offset = saved_offset
        return FileState(
            path=str(tail.path),
            dev=tail.identity.dev,
            ino=tail.identity.ino,
            offset=offset,
            skipping=tail.skipping and not held,
            head=head,
            marker=marker,
            marker_kind=2,
        )


def trusted(state: State, out: Path) -> State:
    """The restored state, if it describes the runs on disk; else a fresh start, with a warning.

    A state copied from another job, rolled back, or left after the runs were deleted would
    claim points the runs do not have, and its offsets would skip them for good. Reading every
    log again instead loses nothing: the run writers drop what the runs already show.
    """
    lost = runs_match(out, state)
    if not lost:
        return state
    log.warning("the checkpoint does not match the runs in %s (%s); reading every log again from the start, "
                "points the runs already show are not written twice", out, "; ".join(lost.values()))
    return State()
