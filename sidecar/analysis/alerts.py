"""Alerts: trouble a person watching a multi-day run wants to hear about at once, one per episode.

Per rank: non-finite loss or grad norm, loss and grad-norm spikes, throughput drops (naming a
checkpoint save at that step when the log reports one), fp16 overflow streaks, error lines
(tracebacks, NaN/Inf aborts, worker exits), and, live only, a stall (:mod:`.detectors`).
Across ranks: a rank more than N steps behind the furthest one, and ranks whose loss at the same
step spreads beyond a tolerance (data-parallel ranks that should agree; only the ranks whose
loss the aggregate counts, so pipeline stages that print no valid loss are left out). A step is
judged once each of those ranks known has a loss there, and its alert carries the lowest rank's
wall time, so the verdict does not depend on the order the ranks are read in (replay workers
relay the losses to one check: :mod:`sidecar.service.replay_workers`).

Every alert and every "resolved" is an :class:`Alert` handed to each sink in order: the
sidecar's log (a warning naming rank, step, metric, value and threshold; stderr, so journald
keeps it), and what the engine and service add: a TensorBoard text event, ``--on-alert``. Error
lines have no end, so they are one alert each. Benign lines that look alarming (the every-step
pipeline warning, PyNative's ``grad_norm: NaN`` placeholder) never get here: the parsers do not
turn them into values.

"Behind" compares ranks by what was read, so it is judged only when reading has caught up
(live) or at the end of the input (replay): mid-backlog one rank's file is simply read first.

Each rank has a lifecycle (:mod:`parsers.lifecycle`): running, finished or failed. A finished or
failed rank is not stalled: its stall clock stops (an open stall episode is resolved) until it
logs a step again, and a relaunch that logs a start marker is judged from its first step, as a
new job is. Every change but the first start is a :class:`LifecycleChange` for the sinks.

What outlives a restart (:meth:`Alerts.snapshot`, checkpointed with the offsets that passed the
records): each rank's lifecycle and last step, and every detector's state (:mod:`.baselines`:
episodes, windows), so that a restart judges as an uninterrupted run: an episode raised before
a SIGKILL is not raised again after it, and a spike is judged against the same baseline. A record
a run shows that was written after the checkpoint (before a kill) is judged again (``again``):
its verdicts go to the sinks that write the runs (:attr:`Alerts.writers`, which write nothing
twice) but page no one a second time (the log, ``--on-alert``). One that a resume written
before the kill superseded (``superseded``) is judged for the baselines alone: the resume's
START purged its step's alert events, and writing them again would show them after it. Other
records read again after a restart (the run already shows them) move the lifecycle but raise
nothing. A restarted sidecar counts a running rank's wait for its next step from its own start.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from parsers import tags
from parsers.assembler import ERROR_TAG
from parsers.lifecycle import Lifecycle, lifecycle_of
from parsers.records import Record
from sidecar.analysis.detectors import AlertSettings, Episode, Group
from sidecar.analysis.watch import RankWatch, as_written, episodes_state, load_episodes
from sidecar.output.state_parts import Baselines, PendingLosses, WatchState

log = logging.getLogger("mstb_sidecar.alerts")

DIVERGENCE_STEPS = 1024  # steps whose per-rank losses wait for the last rank, at most
CHECKPOINT_NEAR = 2  # a save at most this many steps before a drop explains it


@dataclass(frozen=True)
class Alert:
    """One alert or its resolution. ``rank`` is ``None`` for the ranks together; ``threshold`` is
    ``None`` where there is none (NaN, overflow, errors); ``unit`` is that of ``value`` and
    ``threshold`` when the metric's name does not say it (``"s"`` for a stall)."""

    name: str  # "loss-spike", "nan-grad-norm", ...: the TensorBoard tag is alerts/<name>
    group: Group
    rank: int | None
    step: int
    metric: str
    value: float | None
    threshold: float | None
    detail: str
    resolved: bool = False
    wall_time: float | None = None
    unit: str | None = None

    def line(self) -> str:
        where = f"rank {self.rank}" if self.rank is not None else "all ranks"
        if self.resolved:
            return f"RESOLVED {self.name}: {where}, step {self.step}: {self.detail}"
        value = "" if self.value is None else f" = {self.value:.6g}"
        unit = f" {self.unit}" if self.unit else ""
        limit = "" if self.threshold is None else f" (threshold {self.threshold:.6g}{unit})"
        return f"ALERT {self.name}: {where}, step {self.step}: {self.metric}{value}{limit}; {self.detail}"

    def as_json(self) -> dict[str, object]:
        """The ``--on-alert`` payload (its schema is in docs/alerts.md): numbers as JSON numbers,
        ``null`` for none; a NaN or infinite value (not JSON) is ``null`` with ``value_text``."""
        finite = self.value is None or math.isfinite(self.value)
        return {"alert": self.name, "group": self.group.value, "state": "resolved" if self.resolved else "firing",
                "rank": self.rank, "step": self.step, "metric": self.metric,
                "value": self.value if finite else None, "value_text": None if finite else str(self.value),
                "threshold": self.threshold, "unit": self.unit, "detail": self.detail, "message": self.line()}


@dataclass(frozen=True)
class LifecycleChange:
    """A rank's lifecycle moved (not its first start): ``text`` is the line that moved it."""

    rank: int
    step: int
    state: Lifecycle
    was: Lifecycle | None
    text: str
    wall_time: float | None

    def line(self) -> str:
        said = f": {self.text[:300]}" if self.text else ""
        if self.state is Lifecycle.RUNNING:
            had = f" (it had {self.was.value})" if self.was is not None else ""
            return f"rank {self.rank}: training is running again at step {self.step}{had}{said}"
        what = "finished" if self.state is Lifecycle.FINISHED else "died"
        return f"rank {self.rank}: training {what} at step {self.step}{said}"


Sink = Callable[[Alert], None]
LifecycleSink = Callable[[LifecycleChange], None]
LossSink = Callable[[int, int, float, float | None, set[int] | None, bool], None]  # rank, step, loss, wall, ranks, again


@dataclass(slots=True)
class _StepLosses:
    wall: float | None  # of the lowest rank with a loss there, whichever rank came last
    wall_rank: int
    losses: dict[int, float] = field(default_factory=dict)  # rank -> loss
    fresh: bool = False  # a loss came from a record not judged before a restart: its verdict is news


class Alerts:
    """Runs the detectors over each rank's records and hands what they find to the sinks."""

    def __init__(self, settings: AlertSettings | None = None, live: bool = False) -> None:
        self.settings = settings or AlertSettings()
        self.live = live
        self.sinks: list[Sink] = [self._log]
        self.writers: list[Sink] = []  # sinks that write nothing twice: they also get what is judged again
        self.lifecycle_sinks: list[LifecycleSink] = [self._log_lifecycle]
        self.counts: Counter[tuple[int, str]] = Counter()  # (rank or -1, name) -> alerts raised
        self.groups: Counter[Group] = Counter()
        self.active: dict[tuple[int, str], bool] = {}  # (rank or -1, name) -> firing now
        self.raised = 0  # alerts and resolutions so far: --every keeps the steps at which this grows
        self.started: dict[tuple[int, str], float] = {}  # (rank or -1, name) -> monotonic time of the last start
        self.ranks: dict[int, RankWatch] = {}
        self._losses: dict[int, _StepLosses] = {}  # step -> the ranks' losses, for divergence
        # Where each loss goes: the divergence check here, or a replay worker's relay to the one
        # that sees every rank (sidecar.service.replay_workers).
        self.loss_sink: LossSink = self.note_loss
        self._again = False  # the verdicts being emitted are of records judged again (observe's ``again``)
        self._superseded = False  # ... of a record judged again that its run no longer shows (observe's)
        self._divergence_on = self.settings.divergence.enabled
        self._loss_ranks: set[int] = set()  # ranks whose loss the divergence check has seen
        self._divergence = Episode(after=self.settings.divergence.steps, clear=self.settings.divergence.steps)

    def relay(self, losses: LossSink, alerts: Sink, instead_of: Collection[Sink]) -> None:
        """Hand on what is judged or told where every rank's alerts meet, in another process (a
        replay worker's relay to its parent, :mod:`sidecar.service.replay_child`): each loss to
        ``losses`` instead of the divergence check here, each alert to ``alerts`` instead of the
        sinks ``instead_of`` (``--on-alert``, run once for the job). The log and the runs' text
        events stay here, with the ranks they are about."""
        self.loss_sink = losses
        self.sinks = [sink for sink in self.sinks if sink not in instead_of] + [alerts]

    def watch(self, rank: int) -> RankWatch:
        entry = self.ranks.get(rank)
        if entry is None:
            entry = self.ranks[rank] = RankWatch(self.settings)
        return entry

    # -- per record ------------------------------------------------------------------------
    def observe(self, rank: int, record: Record, now: float, loss_ranks: set[int] | None = None,
                seen: bool = False, again: bool = False, superseded: bool = False) -> None:
        """One record as written to the rank's run; ``loss_ranks``: whose loss the aggregate counts
        (``None``: every rank), or an empty set for no divergence check (no aggregate). ``seen``:
        a record without a training step that the run already shows (read again after a restart).
        ``again``: a training step the run shows that was written after the checkpoint the
        detectors were restored from: judged, but what it raises was paged before the restart.
        ``superseded``: such a record that a resume the run shows went back past since: judged for
        the baselines only, since its step's events were purged (an uninterrupted run's too)."""
        watch = self.ranks.get(rank) or self.watch(rank)
        state = lifecycle_of(record)
        if state is not None:
            if state is not watch.lifecycle:
                self._lifecycle(rank, watch, state, record, seen or again)
            if not record.training_step and watch.stall is not None:
                watch.stall.arrived = None  # finished, died or (re)starting: no stall before the next step
        if record.texts:
            error = record.texts.get(ERROR_TAG)
            if error is not None and self.settings.errors.enabled and not (seen or again):
                self._emit(Alert("error", Group.ERROR, rank, record.step, "log", None, None, error[:300],
                                 wall_time=record.wall_time))
            if tags.TEXT_CHECKPOINT in record.texts:
                watch.checkpoint_step = record.step
        if not record.training_step:
            return
        self._again, self._superseded = again, again and superseded
        scalars = record.scalars
        watch.last_step, watch.arrived = record.step, now
        if watch.stall is not None and self.live:
            ms = scalars.get(tags.ITERATION_TIME)
            if watch.stall.arrival(now, None if ms is None else ms / 1000.0) == "end":
                self._emit(Alert("stall", Group.STALL, rank, record.step, "step", None, None,
                                 "a new step arrived", resolved=True, wall_time=record.wall_time))
        isfinite = math.isfinite
        for metric, nan, spike in watch.checks:
            value = scalars.get(metric)
            if value is None:
                continue
            value = as_written(value)
            if nan is not None and not (nan.idle and isfinite(value)):
                verdict = nan.update(not isfinite(value))
                if verdict:
                    self._level(f"nan-{metric}", Group.NAN, rank, record, metric, value, verdict, math.nan,
                                "not a finite number" if verdict == "start" else f"{metric} is finite again ({value:.6g})")
            if spike is not None:
                verdict = spike.judge(value)
                if verdict:
                    self._level(f"{metric}-spike", Group.SPIKE, rank, record, metric, value, verdict, spike.threshold,
                                f"{value / spike.median:.1f}x the recent median {spike.median:.6g}" if verdict == "start"
                                else f"{metric} back under {spike.threshold:.6g}")
        drop = watch.drop
        if drop is not None:
            metric = tags.THROUGHPUT if tags.THROUGHPUT in scalars else tags.MODEL_FLOPS
            value = scalars.get(metric)
            verdict = None if value is None else drop.judge(as_written(value))
            if verdict:
                saved = watch.checkpoint_step
                near = saved is not None and 0 <= record.step - saved <= CHECKPOINT_NEAR + drop.settings.steps
                cause = f"; a checkpoint was saved at step {saved}" if near else ""
                self._level("throughput-drop", Group.THROUGHPUT, rank, record, metric, value, verdict, drop.threshold,
                            f"{1 - value / drop.median:.0%} below its recent median{cause}" if verdict == "start"
                            else f"{metric} back above {drop.threshold:.6g}")
        overflow = watch.overflow
        if overflow is not None and (record.overflow or not overflow.idle):
            verdict = overflow.update(record.overflow)
            if verdict:
                self._level("overflow", Group.OVERFLOW, rank, record, "overflow", None, verdict, math.nan,
                            f"{overflow.after} overflowed updates in a row (loss scale too high?)"
                            if verdict == "start" else "an update was applied again")
        if self._divergence_on and (loss_ranks is None or rank in loss_ranks):
            loss = scalars.get(tags.LOSS)
            if loss is not None:
                self.loss_sink(rank, record.step, loss, record.wall_time, loss_ranks, again)
        self._again = self._superseded = False

    def _lifecycle(self, rank: int, watch: RankWatch, state: Lifecycle, record: Record, seen: bool) -> None:
        """Move a rank's lifecycle. A record the run already shows (a copy in another file, or read
        again after a restart) moves it too, so the state ends where the log does, but says nothing:
        the change was told when the record was first read (a copy in ``worker_N.log`` of a
        finished ``info.log`` would otherwise say "running again")."""
        was, watch.lifecycle = watch.lifecycle, state
        stall = watch.stall
        if state is not Lifecycle.RUNNING and stall is not None and stall.episode.update(False) == "end":
            self._emit(Alert("stall", Group.STALL, rank, record.step, "step", None, None,
                             f"the training {'finished' if state is Lifecycle.FINISHED else 'died'}",
                             resolved=True, wall_time=record.wall_time))
        if seen or was is None and state is Lifecycle.RUNNING:
            return  # told before, or the ordinary start
        text = next(iter(record.texts.values()), "")
        change = LifecycleChange(rank, record.step, state, was, text, record.wall_time)
        for sink in self.lifecycle_sinks:
            sink(change)

    def _level(self, name: str, group: Group, rank: int, record: Record, metric: str, value: float | None,
               verdict: str, threshold: float, detail: str) -> None:
        limit = None if threshold != threshold else threshold
        self._emit(Alert(name, group, rank, record.step, metric, value, limit, detail, resolved=verdict == "end",
                         wall_time=record.wall_time))

    # -- across ranks ----------------------------------------------------------------------
    def note_loss(self, rank: int, step: int, loss: float, wall: float | None, ranks: set[int] | None,
                  again: bool = False) -> None:
        """One rank's loss at ``step``; once each of ``ranks`` (``None``: those with a loss so far) has
        one there, judge the spread. Known ranks, not those so far, make the verdict independent of
        the order the ranks are read in. A verdict on losses that were all judged before a restart
        (``again``, or restored) was paged then."""
        entry = self._losses.get(step)
        if entry is None:
            entry = self._losses[step] = _StepLosses(wall, rank)
        elif rank < entry.wall_rank:
            entry.wall, entry.wall_rank = wall, rank
        entry.fresh = entry.fresh or not again
        losses = entry.losses
        losses[rank] = as_written(loss)
        self._loss_ranks.add(rank)
        if len(losses) < max(len(self._loss_ranks if ranks is None else ranks), 2):
            if len(self._losses) > DIVERGENCE_STEPS:
                del self._losses[next(iter(self._losses))]  # the first step noted: no scan on the hot path
            return
        del self._losses[step]
        s = self.settings.divergence
        finite = sorted(v for v in losses.values() if math.isfinite(v))
        if len(finite) < 2:
            return
        median = finite[len(finite) // 2]
        spread, limit = finite[-1] - finite[0], max(s.abs, s.rel * abs(median))
        verdict = self._divergence.update(spread > limit)
        if verdict:
            self._again = not entry.fresh
            ranks = sorted(sorted(losses), key=losses.__getitem__)  # ties: the lower rank
            detail = (f"loss from {finite[0]:.6g} (rank {ranks[0]}) to {finite[-1]:.6g} (rank {ranks[-1]}) "
                      f"for {s.steps} steps" if verdict == "start" else "the ranks' losses agree again")
            self._emit(Alert("divergence", Group.DIVERGENCE, None, step, "loss spread", spread, limit,
                             detail, resolved=verdict == "end", wall_time=entry.wall))
            self._again = False

    def check_behind(self, front: int | None = None) -> None:
        """Judge how far each rank trails (call when reading has caught up, or at the end);
        ``front``: the furthest step of all ranks, when some are followed elsewhere."""
        if not self.settings.rank_behind.enabled:
            return
        steps = {rank: w.last_step for rank, w in self.ranks.items() if w.last_step is not None}
        if front is None:
            if len(steps) < 2:
                return
            front = max(steps.values())
        limit = self.settings.rank_behind.steps
        for rank, step in sorted(steps.items()):
            watch = self.ranks[rank]
            gap = front - step
            if gap <= limit and watch.behind.idle:
                continue  # in step, as before (called every live round: most ranks are)
            verdict = watch.behind.update(gap > limit)
            if verdict:
                detail = (f"{gap} steps behind the furthest rank (step {front})" if verdict == "start"
                          else "caught up with the other ranks")
                self._emit(Alert("rank-behind", Group.BEHIND, rank, step, "step", gap,
                                 limit, detail, resolved=verdict == "end"))

    def check_stalls(self, now: float) -> None:
        """Live: a rank with no new step for too long (a hang in a collective, a dead worker)."""
        for rank, watch in sorted(self.ranks.items()):
            if watch.stall is not None and watch.stall.check(now) == "start" and watch.last_step is not None:
                limit = watch.stall.limit()
                self._emit(Alert("stall", Group.STALL, rank, watch.last_step, "seconds since the last step",
                                 round(now - (watch.arrived or now), 1), round(limit),
                                 "no new step; hung in a collective, or the worker died?", unit="s"))

    def next_check(self, now: float) -> float | None:
        """Seconds until the next stall could be due (the live loop wakes by then)."""
        due = [w.stall.due(now) - now for w in self.ranks.values()
               if w.stall is not None and w.stall.arrived is not None and not w.stall.episode.active]
        return max(min(due), 0.0) if due else None

    # -- across restarts -------------------------------------------------------------------
    def snapshot(self, rank: int) -> WatchState | None:
        """What :meth:`restore` needs of ``rank`` (``-1``: the ranks together), or ``None`` for a
        rank nothing was observed of."""
        watch = self.ranks.get(rank)
        firing = sorted(name for (key, name), on in self.active.items() if key == rank and on)
        if rank < 0:
            losses = [PendingLosses(step=step, wall=e.wall, wall_rank=e.wall_rank, losses=e.losses)
                      for step, e in self._losses.items()]
            return WatchState(firing=firing, baselines=Baselines(
                episodes=episodes_state({"divergence": self._divergence}), losses=losses,
                loss_ranks=sorted(self._loss_ranks)))
        if watch is None:
            return WatchState(firing=firing) if firing else None
        return WatchState(lifecycle=watch.lifecycle, last_step=watch.last_step, firing=firing,
                          baselines=watch.baselines())

    def restore(self, rank: int, saved: WatchState, now: float) -> None:
        """A checkpointed :meth:`snapshot` of ``rank``; its open episodes stay open (not raised
        again), and a running rank's wait for its next step counts from ``now``."""
        episodes = {"divergence": self._divergence} if rank < 0 else {}
        saved_baselines = saved.baselines
        if rank >= 0:
            watch = self.watch(rank)
            watch.lifecycle, watch.last_step = saved.lifecycle, saved.last_step
            if saved_baselines is not None:
                watch.load(saved_baselines)
            if saved.lifecycle is Lifecycle.RUNNING and saved.last_step is not None:
                watch.arrived = now
                if watch.stall is not None and self.live:
                    watch.stall.arrived = now
            episodes = watch.episodes()
        elif saved_baselines is not None:
            load_episodes(episodes, saved_baselines.episodes)
            self._loss_ranks.update(saved_baselines.loss_ranks)
            for p in saved_baselines.losses:
                self._losses[p.step] = _StepLosses(p.wall, p.wall_rank, dict(p.losses))
        for name in saved.firing:
            episode = episodes.get(name)
            if episode is not None:
                episode.active, episode.idle = True, False
                self.active[(rank, name)] = True

    def only(self, ranks: set[int]) -> None:
        """Forget what was restored of ranks outside ``ranks``: a replay worker's share, none in
        the parent (the workers judge every rank; the ranks together stay)."""
        self.ranks = {rank: watch for rank, watch in self.ranks.items() if rank in ranks}
        self.active = {key: on for key, on in self.active.items() if key[0] < 0 or key[0] in ranks}

    # -- sinks -----------------------------------------------------------------------------
    def _emit(self, alert: Alert) -> None:
        key = (-1 if alert.rank is None else alert.rank, alert.name)
        self.active[key] = not alert.resolved
        if self._superseded:
            return  # written and purged before the restart, as in an uninterrupted run
        for sink in self.writers:
            sink(alert)
        if self._again:
            return  # paged before the restart
        self.raised += 1
        if not alert.resolved:
            self.started[key] = time.monotonic()
            self.counts[key] += 1
            self.groups[alert.group] += 1
        for sink in self.sinks:
            sink(alert)

    @staticmethod
    def _log_lifecycle(change: LifecycleChange) -> None:
        (log.warning if change.state is Lifecycle.FAILED else log.info)("%s", change.line())

    @staticmethod
    def _log(alert: Alert) -> None:
        # Episodes bound themselves; error lines can come by the thousand, so they are rate-limited.
        limit = {"rate_key": (alert.rank, alert.name)} if alert.group is Group.ERROR else None
        log.warning("%s", alert.line(), extra=limit)
