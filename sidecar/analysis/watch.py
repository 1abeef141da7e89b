"""One rank's alert detectors (:class:`RankWatch`), and their state as the checkpoint keeps it
(:class:`~sidecar.output.state_parts.WatchState`, :class:`~sidecar.output.state_parts.Baselines`), so that a restart judges as an uninterrupted run would (issue 26: a spike
an uninterrupted run raises at step 25 is raised after a SIGKILL at step 20 too).

What is kept, per rank: its lifecycle and last step, every episode that is not idle (bad and
normal observations in a row, whether it is on), each level detector's window
(:class:`sidecar.analysis.detectors.LevelDetector`: its values, the warm-up values still to skip,
how many are new since its median, the median and threshold it judges against), the stall
detector's step times and the step of the last checkpoint save a drop may name; for the ranks
together, the divergence episode, the losses still waiting for a rank and the ranks that gave
one. The detectors judge float32 values (:func:`as_written`, as the events hold them), so a window
is packed as float32 (base64): about 1.4 KB a rank with the default windows, microseconds to pack.

Contract: a snapshot is taken with the writers' sync of the same checkpoint, so it covers
exactly the records its runs held then; what a run shows beyond that (written after it, before
a kill) is judged again after the restart, without paging again (:mod:`sidecar.analysis.alerts`).
A checkpoint from before baselines were kept restores the lifecycle and open episodes only.
"""

from __future__ import annotations

import base64
import struct
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from parsers import tags
from parsers.lifecycle import Lifecycle
from sidecar.analysis.detectors import AlertSettings, DropDetector, Episode, LevelDetector, SpikeDetector, StallDetector
from sidecar.output.scalar_event import float32
from sidecar.output.state_parts import Baselines, LevelState

T = TypeVar("T")

_F32 = struct.Struct("<f")


def as_written(value: float) -> float:
    """``value`` as a float32 event holds it: beyond the float32 range +-inf (``1e39`` is inf),
    below its smallest subnormal +-0, and otherwise rounded to float32."""
    return _F32.unpack(float32(value))[0]


def _pack(values: list[float] | deque[float], code: str) -> str:
    return base64.b64encode(struct.pack(f"<{len(values)}{code}", *values)).decode() if values else ""


def _unpack(text: str, code: str) -> list[float]:
    raw = base64.b64decode(text)
    return list(struct.unpack(f"<{len(raw) // struct.calcsize(code)}{code}", raw))


def episodes_state(episodes: dict[str, Episode]) -> dict[str, tuple[int, int, bool]]:
    return {name: (e.bad, e.normal, e.active) for name, e in episodes.items() if not e.idle}


def load_episodes(episodes: dict[str, Episode], saved: dict[str, tuple[int, int, bool]]) -> None:
    """Every episode of ``episodes`` as saved (idle if it is not there)."""
    for name, episode in episodes.items():
        bad, normal, on = saved.get(name, (0, 0, False))
        episode.bad, episode.normal, episode.active = bad, normal, on
        episode.idle = not on and not bad


def level_state(detector: LevelDetector) -> LevelState:
    return LevelState.model_construct(values=_pack(detector.values, "f"), skip=detector.skip, new=detector.new,
                                      median=detector.median, threshold=detector.threshold)  # typed already


def load_level(detector: LevelDetector, saved: LevelState) -> None:
    detector.values.extend(_unpack(saved.values, "f"))  # a smaller window (changed settings) keeps the newest
    detector.skip, detector.new = saved.skip, saved.new
    detector.median, detector.threshold = saved.median, saved.threshold


def stall_state(detector: StallDetector) -> str:
    return _pack(detector.step_seconds, "d")


def load_stall(detector: StallDetector, saved: str) -> None:
    detector.step_seconds.extend(_unpack(saved, "d"))
    detector.reset_limit()


class RankWatch:
    """One rank's detectors and the latest values (also the metrics endpoint's gauges)."""

    def __init__(self, s: AlertSettings) -> None:
        def on(enabled: bool, make: Callable[[], T]) -> T | None:
            return make() if enabled else None

        # (metric, its NaN episode, its spike detector), in the order they are judged
        self.checks = [(tags.LOSS, on(s.nan.enabled, Episode), on(s.loss_spike.enabled, lambda: SpikeDetector(s.loss_spike))),
                       (tags.GRAD_NORM, on(s.nan.enabled, Episode),
                        on(s.grad_norm_spike.enabled, lambda: SpikeDetector(s.grad_norm_spike)))]
        self.drop = on(s.throughput_drop.enabled, lambda: DropDetector(s.throughput_drop))
        self.stall = on(s.stall.enabled, lambda: StallDetector(s.stall))
        self.overflow = on(s.overflow.enabled, lambda: Episode(after=s.overflow.streak))
        self.behind = Episode()
        self.last_step: int | None = None
        self.arrived: float | None = None  # monotonic time of the latest step
        self.checkpoint_step: int | None = None
        self.lifecycle: Lifecycle | None = None

    def episodes(self) -> dict[str, Episode]:
        """Alert name -> its episode, for those this rank judges."""
        found = {f"nan-{metric}": nan for metric, nan, _ in self.checks if nan is not None}
        found.update((f"{metric}-spike", spike.episode) for metric, _, spike in self.checks if spike is not None)
        for name, detector in (("throughput-drop", self.drop), ("stall", self.stall)):
            if detector is not None:
                found[name] = detector.episode
        if self.overflow is not None:
            found["overflow"] = self.overflow
        found["rank-behind"] = self.behind
        return found

    def levels(self) -> dict[str, LevelDetector]:
        found: dict[str, LevelDetector] = {f"{metric}-spike": spike for metric, _, spike in self.checks
                                           if spike is not None}
        if self.drop is not None:
            found["throughput-drop"] = self.drop
        return found

    def baselines(self) -> Baselines:
        return Baselines.model_construct(  # every field typed already: no validation, 1,024 ranks per checkpoint
            episodes=episodes_state(self.episodes()), levels={name: level_state(d) for name, d in self.levels().items()},
            step_seconds=stall_state(self.stall) if self.stall is not None else "", checkpoint_step=self.checkpoint_step,
            losses=[], loss_ranks=[])

    def load(self, saved: Baselines) -> None:
        load_episodes(self.episodes(), saved.episodes)
        for name, detector in self.levels().items():
            if name in saved.levels:
                load_level(detector, saved.levels[name])
        if self.stall is not None:
            load_stall(self.stall, saved.step_seconds)
        self.checkpoint_step = saved.checkpoint_step
