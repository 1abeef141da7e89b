"""Alerts: things a person watching a multi-day run wants to hear about at once.

Non-finite loss or grad norm, fp16 overflow streaks, and error lines (tracebacks, NaN/Inf aborts,
worker exits) go to the sidecar's own log (stderr, so journald keeps them) as warnings, and are
counted per rank for the summary and the metrics endpoint. Benign lines that look alarming (the
every-step pipeline warning, PyNative's ``grad_norm: NaN`` placeholder) never get here: the
parsers do not turn them into values.
"""

from __future__ import annotations

import logging
import math
from collections import Counter

from parsers import tags
from parsers.assembler import ERROR_TAG
from parsers.records import Record

log = logging.getLogger("mstb_sidecar.alerts")

OVERFLOW_STREAK = 10  # consecutive skipped updates before we call it a problem


class Alerts:
    def __init__(self) -> None:
        self.counts: Counter[tuple[int, str]] = Counter()
        self._overflow_streak: Counter[int] = Counter()
        self.raised = 0  # alerts so far: --every keeps the steps at which this grows

    def observe(self, rank: int, record: Record) -> None:
        for tag in (tags.LOSS, tags.GRAD_NORM):
            value = record.scalars.get(tag)
            if value is not None and not math.isfinite(value):
                self._raise(rank, f"non-finite-{tag}", "rank %d step %d: %s is %s", rank, record.step, tag, value)
        if record.training_step:
            streak = self._overflow_streak[rank] + 1 if record.overflow else 0
            self._overflow_streak[rank] = streak
            if streak == OVERFLOW_STREAK:
                self._raise(rank, "overflow", "rank %d step %d: %d overflowed steps in a row (loss scale too high?)",
                            rank, record.step, streak)
        error = record.texts.get(ERROR_TAG)
        if error is not None:
            self._raise(rank, "error", "rank %d near step %d: %s", rank, record.step, error[:300])

    def _raise(self, rank: int, kind: str, fmt: str, *args: object) -> None:
        self.counts[(rank, kind)] += 1
        self.raised += 1
        log.warning(fmt, *args, extra={"rate_key": (rank, kind)})
