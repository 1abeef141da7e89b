"""The cross-rank view: one run with per-step mean, min, max and spread of every metric over ranks.

Completion. A step's aggregate is written once every rank has reported it or moved past it
(ranks come from paths and stream labels, known once every file was read once). Replay waits
for every rank however far one rank's reading runs ahead: nothing caps the steps waiting (the
engine reads ranks in step-lockstep, which bounds them by design; :meth:`pending_steps` and
:meth:`waiting_for` say what waits). Live, a step is written without the ranks that have not
reported it ``timeout`` seconds after its first report (a dead rank must not stall the view); at
the end of a replay everything waiting is written. A step written without a rank is counted
(``incomplete_steps``) and logged, naming the ranks (rate-limited).

Whatever order the ranks' records arrive in (one engine, or replay workers relaying them), a
step's point is the same: its wall time is its lowest rank's, the mean an exact sum, and ties
for the slowest rank go to the lower rank.

Order. Steps are written in increasing order, and a record for a step at or below the last one
written is ignored (a re-read after a restart, a rank later than the timeout): it must not start
a one-rank step that then counts as complete. A training resume is the exception: the first rank
to go back cuts the aggregate at that step; every other rank counts as not past it until it goes
back too, and its records of the superseded segment from that step on are ignored meanwhile.

Restart. :meth:`snapshot` / :meth:`restore` carry what still waits (per-rank values), each rank's
progress, the resume bookkeeping and the parallel layout through the checkpoint, so a restart
while ranks are apart writes the same points as an uninterrupted run. Restored steps wait a
fresh ``timeout`` (the missing rank's lines may be in its file, unread while the sidecar was down).

Loss validity. Under pipeline parallelism (mindformers warns ``pipeline stages: P > 1`` every
step; non-last PyNative stages print ``loss: N/A``) only the last stage's loss is valid: ranks
``>= world - world/P``, with the job's world size as the log states it at start-up
(:class:`~parsers.records.ParallelConfigLine`), or the highest rank seen + 1 when it states
none (said once). A sidecar that follows no last-stage rank (node 0 of a multi-node job) writes
no ``loss/*`` aggregate and says so once. Zero-bubble-V: rank 0 only. ``loss_ranks`` overrides
all of this. For ``iteration-time`` the slowest rank is recorded too.

The run is ``aggregate/<instance>``: sidecars on several nodes sharing one ``--out`` each write
their own, over the ranks they follow. Under ``--run-name`` it is the experiment's, beside its
rank runs (:func:`sidecar.output.run_names.beside`); when that path needs the configuration hash,
:class:`EarlyNotes` keeps what is learnt before it is known. The custom-scalars layout that charts it is in a run of
its own (:mod:`sidecar.output.layout`); an earlier version's layout in this run is replaced by an empty
one, or TensorBoard would merge its charts (for every metric, present or not) into the new ones.
"""

from __future__ import annotations

import heapq
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from tensorboard.plugins.custom_scalar import layout_pb2

from parsers import tags
from parsers.records import ParallelConfigLine, PipelineLine, Record
from sidecar.output.run_writer import RunWriter, custom_scalars_value
from sidecar.output.state_parts import AggregateState, PendingStep

log = logging.getLogger(__name__)

AGGREGATED_TAGS = frozenset(tags.AGGREGATED)
SLOWEST = f"{tags.ITERATION_TIME}/slowest-rank"
_NAMES = {tag: (f"{tag}/mean", f"{tag}/min", f"{tag}/max", f"{tag}/spread") for tag in tags.AGGREGATED}
WARN_EVERY = 60.0  # at most one warning about steps written without a rank per this many seconds


@dataclass(slots=True)
class _Step:
    first_seen: float  # inf: restored, its timeout starts at the next look with a clock
    wall: float  # of the lowest rank that reported it
    wall_rank: int
    ranks: dict[int, dict[str, float]] = field(default_factory=dict)  # rank -> its scalars (any tags)

    def by_tag(self) -> dict[str, dict[int, float]]:
        """tag -> rank -> value of the aggregated tags, ranks in order."""
        out: dict[str, dict[int, float]] = {}
        for rank in sorted(self.ranks):
            for tag, value in self.ranks[rank].items():
                if tag in AGGREGATED_TAGS:
                    by_rank = out.get(tag)
                    if by_rank is None:  # not setdefault: it would make a dict per value
                        by_rank = out[tag] = {}
                    by_rank[rank] = value
        return out


class CrossRankAggregator:
    def __init__(self, run_dir: Path, timeout: float, loss_ranks: set[int] | None = None,
                 writer: RunWriter | None = None) -> None:
        self.writer = writer if writer is not None else RunWriter(run_dir)  # the engine's comes from its sink
        self.timeout = timeout
        self.loss_ranks = loss_ranks
        self.expected: set[int] = set()  # ranks known from paths and stream labels
        self.ready = False  # set once every file was read once: only then is ``expected`` complete
        self.last_step: dict[int, int] = {}  # rank -> newest step it reported in the current segment
        self.reporters: dict[str, set[int]] = {}  # tag -> ranks that ever reported it
        self.pipeline: PipelineLine | None = None
        self.parallel: ParallelConfigLine | None = None
        self.incomplete_steps = 0  # steps written without every rank (live timeout, end of replay)
        self._pending: dict[int, _Step] = {}
        self._order: list[int] = []  # heap of the pending steps
        self._emitted = max((s for t, s in self.writer.view.watermarks.items() if t.endswith("/mean")), default=-1)
        self._retire_old_layout()
        self._resumed_at: int | None = None
        self._emitted_since_resume = False
        self._behind: set[int] = set()  # ranks that have not gone back to ``_resumed_at`` yet
        # How many ranks the oldest pending step still waits for, kept up to date as ranks advance
        # (a full count only when that step or the number of ranks changes).
        self._front: int | None = None
        self._front_sizes = (0, 0)
        self._front_missing = 0
        self._unstamped = False  # restored steps wait for a clock to start their timeout
        self._keys: dict[int, frozenset[str]] = {}  # rank -> the tags of its last step, for ``reporters``
        self._warned_at = -math.inf
        self._said: set[str] = set()

    # -- input -----------------------------------------------------------------------------
    def observe(self, rank: int, record: Record, now: float, resumed: bool = False) -> None:
        """A training-step record of ``rank`` (new, or a duplicate of one already written, which
        completes a step that a restart interrupted; ``resumed``: the rank went back in steps)."""
        if record.training_step:  # a copy: the engine adds derived tags to the record later
            self.observe_step(rank, record.step, record.wall_time, dict(record.scalars), now, resumed)

    def observe_step(self, rank: int, step: int, wall_time: float | None, scalars: dict[str, float], now: float,
                     resumed: bool = False) -> None:
        """:meth:`observe` of a training step's parts (as a replay worker relays them); ``scalars``
        is kept, not copied."""
        if resumed:
            self._resume(rank, step, wall_time)
        elif self._resumed_at is not None and step >= self._resumed_at and rank in self._behind:
            return  # superseded: this rank has not gone back to the resume step yet
        self._advance(rank, step)
        if step <= self._emitted:
            return
        entry = self._pending.get(step)
        if entry is None:
            entry = self._pending[step] = _Step(now, wall_time or 0.0, rank)
            heapq.heappush(self._order, step)
        elif rank < entry.wall_rank:
            entry.wall, entry.wall_rank = wall_time or 0.0, rank
        entry.ranks[rank] = scalars  # taken apart per tag once, when the step is written
        if scalars.keys() != self._keys.get(rank):  # the tags a rank reports rarely change
            self._keys[rank] = frozenset(scalars)
            for tag in scalars.keys() & AGGREGATED_TAGS:
                self.reporters.setdefault(tag, set()).add(rank)
        self._write_due(now)

    def note_pipeline(self, line: PipelineLine) -> None:
        self.pipeline = line

    def note_parallel(self, line: ParallelConfigLine) -> None:
        """The world size from a start-up line; one that states device_num wins over a derived one."""
        if _replaces(self.parallel, line):
            self.parallel = line

    # -- output ----------------------------------------------------------------------------
    def flush_due(self, now: float) -> None:
        self._write_due(now)

    def next_due(self, now: float) -> float | None:
        """Seconds until the oldest waiting step is written without the ranks it waits for (live:
        the loop wakes by then, when nothing else would), or ``None`` if none waits."""
        if not self._order or math.isinf(self.timeout):
            return None
        return max(self._pending[self._order[0]].first_seen + self.timeout - now, 0.0)

    def flush(self) -> None:
        """End of input: write everything still waiting."""
        self._write_due(None)

    def close(self) -> None:
        self.writer.close()

    # -- state -----------------------------------------------------------------------------
    def pending_steps(self) -> int:
        """Steps waiting for a rank (for status and metrics)."""
        return len(self._pending)

    def waits_for(self, rank: int) -> bool:
        """Does the oldest waiting step wait for ``rank``? (Cheap: asked for every line read.)"""
        return bool(self._order) and self.last_step.get(rank, -1) < self._order[0]

    def waiting_for(self) -> set[int]:
        """The ranks the oldest waiting step waits for: reading them is what lets it be written."""
        return set(self._missing(self._order[0])) if self._order else set()

    def snapshot(self) -> AggregateState:
        return AggregateState(
            pending=[PendingStep(step=s, wall=e.wall, values=e.by_tag()) for s, e in sorted(self._pending.items())],
            last_step=self.last_step,
            reporters={tag: sorted(ranks) for tag, ranks in self.reporters.items()},
            pipeline=self.pipeline,
            parallel=self.parallel,
            emitted=self._emitted,
            resumed_at=self._resumed_at,
            emitted_since_resume=self._emitted_since_resume,
            behind=sorted(self._behind),
            incomplete_steps=self.incomplete_steps,
        )

    def restore(self, state: AggregateState) -> None:
        """Continue from a :meth:`snapshot` of the last checkpoint. Steps the run already holds
        (written after that checkpoint, before a crash) are not waited for again."""
        self._emitted = max(self._emitted, state.emitted)
        self._pending = {p.step: _restored(p) for p in state.pending if p.step > self._emitted}
        self._order = sorted(self._pending)
        self.last_step = dict(state.last_step)
        self.reporters = {tag: set(ranks) for tag, ranks in state.reporters.items()}
        self.pipeline, self.parallel = state.pipeline, state.parallel
        self._resumed_at, self._emitted_since_resume = state.resumed_at, state.emitted_since_resume
        self._behind = set(state.behind)
        self.incomplete_steps = state.incomplete_steps
        self._front = None
        self._unstamped = bool(self._pending)

    # -- completion ------------------------------------------------------------------------
    def _advance(self, rank: int, step: int) -> None:
        old = self.last_step.get(rank, -1)
        if step > old:
            self.last_step[rank] = step
            if self._front is not None and old < self._front <= step:
                self._front_missing -= 1

    def _resume(self, rank: int, step: int, wall: float | None) -> None:
        """Training went back to ``step`` on ``rank``; see "Order" in the module docstring."""
        self._front = None
        if rank in self._behind:  # it follows the rank that went back first
            self._behind.discard(rank)
            self.last_step[rank] = step - 1
            return
        for stale in [s for s in self._pending if s >= step]:
            del self._pending[stale]
        self._order = sorted(self._pending)
        self.last_step = {r: min(s, step - 1) for r, s in self.last_step.items()}
        self._behind = (set(self.last_step) | self.expected) - {rank}  # also ranks not read yet
        self._emitted = min(self._emitted, step - 1)
        if self._resumed_at != step or self._emitted_since_resume:  # not a repeat of the same resume
            self.writer.resume(step, wall, f"training resumed at step {step}")
            self._resumed_at, self._emitted_since_resume = step, False

    def _complete(self, step: int) -> bool:
        """Has every rank reported ``step`` or moved past it?"""
        if not self.ready:
            return False
        sizes = (len(self.expected), len(self.last_step))
        if step != self._front or sizes != self._front_sizes:
            self._front, self._front_sizes = step, sizes
            self._front_missing = len(self._missing(step))
        return self._front_missing == 0

    def _missing(self, step: int) -> list[int]:
        return sorted(r for r in self.expected | self.last_step.keys() if self.last_step.get(r, -1) < step)

    def _write_due(self, now: float | None) -> None:
        """Write waiting steps in step order while the oldest is complete, or overdue (live:
        ``now`` given), or always (``now`` is ``None``: the end of a replay)."""
        if now is not None and self._unstamped:
            self._unstamped = False
            for entry in self._pending.values():
                entry.first_seen = min(entry.first_seen, now)
        while self._order:
            step = self._order[0]
            entry = self._pending[step]
            complete = self._complete(step)
            if not complete and now is not None and now - entry.first_seen < self.timeout:
                return
            heapq.heappop(self._order)
            del self._pending[step]
            missing = [] if complete else self._missing(step)
            if missing:
                self._incomplete(step, missing, now is None)
            self._emit(step, entry)

    def _incomplete(self, step: int, missing: list[int], at_end: bool) -> None:
        self.incomplete_steps += 1
        clock = time.monotonic()
        if clock - self._warned_at < WARN_EVERY:
            return
        self._warned_at = clock
        why = "the input ended before they reported it" if at_end else f"no report within {self.timeout:g} s"
        log.warning("aggregate: step %d written without rank(s) %s (%s); %d step(s) so far written without "
                    "every rank", step, rank_ranges(missing), why, self.incomplete_steps)

    # -- values ----------------------------------------------------------------------------
    def valid_loss_ranks(self) -> set[int] | None:
        """Ranks whose loss counts, or ``None`` for all of them (see the module docstring)."""
        if self.loss_ranks is not None:
            return self.loss_ranks
        pipeline = self.pipeline
        if pipeline is None:
            return None
        if pipeline.rank0_only:
            return {0}
        if not pipeline.stages:
            return None
        world = self._world_size()
        per_stage = max(world // pipeline.stages, 1)
        return set(range(world - per_stage, world))

    def compared_ranks(self) -> set[int]:
        """The ranks whose losses the divergence check compares: the valid ones, of every rank known
        (from the paths and lines read, not just those that reported so far)."""
        valid = self.valid_loss_ranks()
        return self.expected if valid is None else valid

    def _world_size(self) -> int:
        seen = max(self.expected | self.last_step.keys(), default=0) + 1
        if self.parallel is None:
            self._once("no-world", "aggregate: the log states no world size; the last pipeline stage is "
                       "taken from the highest rank seen (world %d); pass --loss-ranks if this sidecar does "
                       "not follow every rank", seen)
            return seen
        if self.parallel.world_size < seen:
            self._once("small-world", "aggregate: the logged world size %d is below the ranks seen (world %d); "
                       "using %d", self.parallel.world_size, seen, seen)
            return seen
        return self.parallel.world_size

    def _emit(self, step: int, entry: _Step) -> None:
        scalars: dict[str, float] = {}
        values_of = entry.by_tag()
        valid_loss = self.valid_loss_ranks() if tags.LOSS in values_of else None
        for tag, by_rank in values_of.items():
            if tag == tags.LOSS and valid_loss is not None:
                by_rank = {r: v for r, v in by_rank.items() if r in valid_loss}
                if not by_rank and valid_loss.isdisjoint(self.expected | self.last_step.keys()):
                    self._once("no-loss", "aggregate: no loss/* written: the valid loss is on rank(s) %s (the "
                               "last pipeline stage, or --loss-ranks) and this sidecar follows none of them",
                               rank_ranges(valid_loss))
            if not by_rank:
                continue
            mean, low, high, spread = _NAMES[tag]
            values = list(by_rank.values())
            if all(map(math.isfinite, values)):
                finite = values
                scalars[mean] = _mean(values)
            else:
                finite = [v for v in values if math.isfinite(v)]
                scalars[mean] = math.nan  # a non-finite rank must show, not be averaged away
            if finite:
                scalars[low] = lowest = min(finite)
                scalars[high] = highest = max(finite)
                scalars[spread] = highest - lowest
            if tag == tags.ITERATION_TIME:
                scalars[SLOWEST] = float(max(sorted(by_rank), key=by_rank.__getitem__))  # ties: the lower rank
        self._emitted = step
        if scalars:
            self.writer.write(Record(step, entry.wall or None, scalars))
            self._emitted_since_resume = True

    def _once(self, key: str, message: str, *args: object) -> None:
        if key not in self._said:
            self._said.add(key)
            log.warning(message, *args)

    def _retire_old_layout(self) -> None:
        """Earlier versions wrote their layout here at step 0; the plugin reads a run's newest
        layout, so an empty one at step 1 takes its place (once: the watermark is then 1)."""
        value = custom_scalars_value(layout_pb2.Layout())
        if self.writer.view.watermarks.get(value.tag) == 0:
            self.writer.write_values(1, time.time(), [value])


class EarlyNotes:
    """What the aggregate learns before its run can be placed (a ``--run-name`` whose experiment part
    holds ``{config_hash}``, known once a rank's start-up lines were read): the ranks and the parallel
    layout, handed to the aggregator once it is made (:meth:`hand_to`), after its restored snapshot,
    which they are newer than. It sees no step: the engine places the aggregate before it hands it
    the first one."""

    def __init__(self) -> None:
        self.expected: set[int] = set()
        self.pipeline: PipelineLine | None = None
        self.parallel: ParallelConfigLine | None = None

    def observe(self, rank: int, record: Record, now: float, resumed: bool = False) -> None:
        raise RuntimeError("a training step before the aggregate's run was placed")

    def note_pipeline(self, line: PipelineLine) -> None:
        self.pipeline = line

    def note_parallel(self, line: ParallelConfigLine) -> None:
        if _replaces(self.parallel, line):
            self.parallel = line

    def pending_steps(self) -> int:
        return 0

    def waits_for(self, rank: int) -> bool:
        return False

    def compared_ranks(self) -> set[int]:
        return set()

    def hand_to(self, aggregator: CrossRankAggregator) -> None:
        aggregator.expected |= self.expected
        if self.pipeline is not None:
            aggregator.note_pipeline(self.pipeline)
        if self.parallel is not None:
            aggregator.note_parallel(self.parallel)


def _replaces(kept: ParallelConfigLine | None, line: ParallelConfigLine) -> bool:
    """Does ``line`` replace the world-size line ``kept``? The last one that states device_num wins
    over every derived one; among derived ones, the last."""
    return kept is None or not line.derived or kept.derived


def _restored(pending: PendingStep) -> _Step:
    """A step that waited at the checkpoint. Its wall time is that of the lowest rank that had
    reported it, so a lower rank reporting it after the restart still sets it."""
    by_rank = _by_rank(pending.values)
    return _Step(math.inf, pending.wall, min(by_rank, default=-1), by_rank)


def _by_rank(values: dict[str, dict[int, float]]) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for tag, by_rank in values.items():
        for rank, value in by_rank.items():
            out.setdefault(rank, {})[tag] = value
    return out


def rank_ranges(ranks: set[int] | list[int], sep: str = ", ") -> str:
    """``0-7, 9``: runs of consecutive ranks as ranges (a node's ranks are one line, not a thousand)."""
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and runs[-1][1] == rank - 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return sep.join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _mean(values: list[float]) -> float:
    """The exact mean of finite values; their sum can overflow (two ranks at ``1e308``) where
    the mean does not, so then the parts are divided first."""
    try:
        return math.fsum(values) / len(values)
    except OverflowError:
        return math.fsum(v / len(values) for v in values)
