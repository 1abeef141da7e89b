"""Anomaly detectors: when a rank's curve, or the ranks together, look like trouble.

Each detector judges one series and keeps an *episode*: it answers ``start`` once when trouble
begins and ``end`` once when it is over, never once per step, so a NaN that lasts an hour is one
alert and one "resolved". Detectors are pure (values and times in, verdicts out); where the
alerts go is :mod:`sidecar.analysis.alerts`.

Spikes and drops are judged against a robust baseline (median and MAD of the last ``window``
values outside episodes; values inside an episode are kept out of it, so a loss that jumped and
stayed up stays alerted instead of becoming the new normal). A detector stays silent until it
has ``warmup`` values, and a deviation must also clear an absolute and a relative floor, so tiny
losses late in training (0.010 -> 0.013) do not alarm. Log timestamps are never used: live
waits are measured on the sidecar's monotonic clock, step times come from the log's own
``iteration-time`` values. Detectors judge values as the events hold them (float32: a finite
``1e39`` is inf, so not a finite loss). Their state is checkpointed (:mod:`.baselines`).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from enum import Enum

from pydantic import BaseModel, ConfigDict, Field

MAD_SCALE = 1.4826  # MAD of a normal distribution -> its standard deviation


class Group(str, Enum):
    """What ``--fail-on`` names: every alert belongs to one group."""

    NAN = "nan"
    SPIKE = "spike"
    STALL = "stall"
    BEHIND = "behind"
    THROUGHPUT = "throughput"
    DIVERGENCE = "divergence"
    OVERFLOW = "overflow"
    ERROR = "error"


class _Settings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    enabled: bool = True


class SpikeSettings(_Settings):
    window: int = Field(100, ge=5, description="recent values the baseline is taken from")
    warmup: int = Field(20, ge=3, description="values seen before the first judgement")
    z: float = Field(6.0, gt=0, description="robust z-score (MADs above the median) that counts as a spike")
    min_delta: float = Field(0.2, ge=0, description="absolute rise over the median that a spike needs at least")
    min_ratio: float = Field(1.25, ge=1, description="value / median that a spike needs at least")
    clear: int = Field(5, ge=1, description="normal values in a row that end the episode")


class DropSettings(_Settings):
    window: int = Field(50, ge=5)
    skip: int = Field(20, ge=0, description="first values of a run ignored: compilation and warm-up are slower")
    warmup: int = Field(10, ge=3)
    drop: float = Field(0.4, gt=0, lt=1, description="fraction below the recent median that counts as a drop")
    steps: int = Field(3, ge=1, description="low steps in a row before the alert (one slow step is noise)")
    clear: int = Field(3, ge=1)


class StallSettings(_Settings):
    factor: float = Field(10.0, gt=1, description="a rank stalls after this many of its median step times")
    min_seconds: float = Field(120.0, gt=0, description="and at least this long without a new step")


class BehindSettings(_Settings):
    steps: int = Field(100, ge=1, description="steps a rank may trail the furthest rank")


class DivergenceSettings(_Settings):
    rel: float = Field(0.5, gt=0, description="loss spread (max-min) over |median| across ranks that counts")
    abs: float = Field(0.5, ge=0, description="and at least this absolute spread")
    steps: int = Field(20, ge=1, description="diverged steps in a row before the alert")


class OverflowSettings(_Settings):
    streak: int = Field(10, ge=1, description="skipped (overflowed) updates in a row")


class AlertSettings(BaseModel):
    """The ``alerts:`` section of the config file; every detector is on by default."""

    model_config = ConfigDict(extra="forbid")
    nan: _Settings = _Settings()
    loss_spike: SpikeSettings = SpikeSettings()
    grad_norm_spike: SpikeSettings = SpikeSettings(min_delta=1.0, min_ratio=2.0)
    throughput_drop: DropSettings = DropSettings()
    stall: StallSettings = StallSettings()
    rank_behind: BehindSettings = BehindSettings()
    divergence: DivergenceSettings = DivergenceSettings()
    overflow: OverflowSettings = OverflowSettings()
    errors: _Settings = _Settings()


class Episode:
    """Trouble that starts once and ends once: ``update`` returns "start", "end" or ``None``.

    It starts after ``after`` bad observations in a row and ends after ``clear`` good ones.
    ``idle`` (no episode, no bad observation pending) lets a caller skip the call for a good one.
    """

    def __init__(self, after: int = 1, clear: int = 1) -> None:
        self.after = after
        self.clear = clear
        self.active = False
        self.idle = True
        self.bad = 0
        self.normal = 0

    def update(self, bad: bool) -> str | None:
        verdict = None
        if bad:
            self.normal = 0
            self.bad += 1
            if not self.active and self.bad >= self.after:
                self.active = True
                verdict = "start"
        else:
            self.bad = 0
            if self.active:
                self.normal += 1
                if self.normal >= self.clear:
                    self.active, self.normal = False, 0
                    verdict = "end"
        self.idle = not self.active and not self.bad
        return verdict


class LevelDetector:
    """A value far from its recent level: ``judge`` returns the episode's verdict; ``threshold``
    and ``median`` are what it was judged against.

    The baseline's median and MAD are recomputed once a quarter of its window is new, not per
    value: two sorts per metric and step would be most of a replay's time, and a robust level
    barely moves in a few values.
    """

    above = True  # a spike is above its threshold, a drop below

    def __init__(self, window: int, warmup: int, after: int, clear: int, skip: int = 0) -> None:
        self.values: deque[float] = deque(maxlen=window)
        self.warmup = warmup
        self.skip = skip
        self.episode = Episode(after, clear)
        self.median = math.nan
        self.threshold = math.nan
        self._refresh = max(window // 4, 1)
        self.new = 0

    def limit(self, median: float, mad: float) -> float:
        raise NotImplementedError

    def judge(self, value: float) -> str | None:
        if not math.isfinite(value):
            return None  # the NaN detector's business; keeps the baseline clean
        values = self.values
        if len(values) < self.warmup:
            if self.skip:
                self.skip -= 1
            else:
                values.append(value)
            return None
        if self.new >= self._refresh or self.threshold != self.threshold:
            self.median = median = statistics.median(values)
            mad = MAD_SCALE * statistics.median([abs(v - median) for v in values])
            self.threshold, self.new = self.limit(median, mad), 0
        bad = value > self.threshold if self.above else value < self.threshold
        episode = self.episode
        verdict = episode.update(bad) if bad or not episode.idle else None
        if not bad and not episode.active:
            values.append(value)
            self.new += 1
        return verdict


class SpikeDetector(LevelDetector):
    def __init__(self, settings: SpikeSettings) -> None:
        super().__init__(settings.window, settings.warmup, 1, settings.clear)
        self.settings = settings

    def limit(self, median: float, mad: float) -> float:
        s = self.settings
        return max(median + s.z * mad, median + s.min_delta, median * s.min_ratio)


class DropDetector(LevelDetector):
    above = False

    def __init__(self, settings: DropSettings) -> None:
        super().__init__(settings.window, settings.warmup, settings.steps, settings.clear, settings.skip)
        self.settings = settings

    def limit(self, median: float, mad: float) -> float:
        return (1 - self.settings.drop) * median


class StallDetector:
    """No new step for ``factor`` x the rank's median step time (at least ``min_seconds``).

    Step times are the log's ``iteration-time`` values when it prints them, else the gaps
    between the steps' arrivals; "since" is the arrival of the rank's last step (monotonic).
    """

    def __init__(self, settings: StallSettings) -> None:
        self.settings = settings
        self.step_seconds: deque[float] = deque(maxlen=20)
        self.arrived: float | None = None
        self.episode = Episode()
        self._limit: float | None = None  # of the current step times (checked every loop round)

    def reset_limit(self) -> None:
        """The step times changed (restored from a checkpoint): the limit is taken again."""
        self._limit = None

    def arrival(self, now: float, step_seconds: float | None) -> str | None:
        if step_seconds is None and self.arrived is not None:
            step_seconds = now - self.arrived
        if step_seconds is not None and math.isfinite(step_seconds) and step_seconds >= 0:
            self.step_seconds.append(step_seconds)
            self.reset_limit()
        self.arrived = now
        return self.episode.update(False)

    def limit(self) -> float:
        if self._limit is None:
            median = statistics.median(self.step_seconds) if self.step_seconds else 0.0
            self._limit = max(self.settings.factor * median, self.settings.min_seconds)
        return self._limit

    def due(self, now: float) -> float:
        """The monotonic time a stall could start: the limit after the last arrival; before
        ``min_seconds`` have passed, that (the limit is at least this), with no median taken."""
        assert self.arrived is not None
        soonest = self.arrived + self.settings.min_seconds
        return soonest if now < soonest else self.arrived + self.limit()

    def check(self, now: float) -> str | None:
        if self.arrived is None or self.episode.active:
            return None
        waited = now - self.arrived  # the limit is at least min_seconds: a median only when it can matter
        if waited <= self.settings.min_seconds:
            return None  # no stall, and none to end (checked every live round)
        return self.episode.update(waited > self.limit())
