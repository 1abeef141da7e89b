"""``--every N``: keep every N-th step per tag of a rank's run, for month-long runs.

Kept, per tag: the points at steps divisible by N (the same steps on every rank, so overlays and
the aggregate line up), the tag's first point in the run, non-finite values (NaN, inf: what an
alert is about), every point of a step at which an alert was raised (non-finite loss or grad norm,
an overflow streak, an error line), and the tag's last point: the newest point not kept is held
and written when the input ends (replay) or the sidecar stops (live), unless a later point of the
tag was kept meanwhile. Texts (events, the config card) are never thinned, nor is the aggregate.

A record none of whose points is kept is counted as ``thinned``: the accounting shows it.
"""

from __future__ import annotations

import math

from parsers.records import Record
from sidecar.output.event_scan import RunView


class Thinner:
    """One rank run's filter; ``shown`` is the run's view (its tags are the ones written)."""

    def __init__(self, every: int, shown: RunView) -> None:
        self.every = every
        self._shown = shown
        self._held: dict[str, tuple[int, float | None, float]] = {}  # tag -> newest point not kept

    def thin(self, record: Record, alert: bool) -> bool:
        """Drop from ``record.scalars`` what is not kept; returns whether any scalar is left."""
        if not record.scalars:
            return True
        aligned = record.step % self.every == 0
        kept: dict[str, float] = {}
        for tag, value in record.scalars.items():
            if aligned or alert or tag not in self._shown.watermarks or not math.isfinite(value):
                kept[tag] = value
                held = self._held.get(tag)
                if held is not None and held[0] <= record.step:
                    del self._held[tag]
            else:
                self._held[tag] = (record.step, record.wall_time, value)
        record.scalars = kept
        return bool(kept)

    def resumed(self, step: int) -> None:
        """Training went back to ``step``: held points from ``step`` on were superseded."""
        self._held = {tag: held for tag, held in self._held.items() if held[0] < step}

    def last_points(self) -> list[Record]:
        """The held last points, one record per step, oldest first; forgets them."""
        by_step: dict[int, Record] = {}
        for tag, (step, wall_time, value) in self._held.items():
            by_step.setdefault(step, Record(step, wall_time, training_step=True)).scalars[tag] = value
        self._held.clear()
        return [by_step[step] for step in sorted(by_step)]
