"""Time as a dependency: the engine, the live loop and the wake-ups read it from a :class:`Clock`.

Production passes :data:`SYSTEM`; tests pass a :class:`FakeClock` and step it, so a test of a
companion wait, a stall threshold or an aggregate timeout advances time instead of sleeping
(mtail's ``waker.NewTest`` is the model). ``monotonic`` orders and measures waits; ``time`` is the
wall clock, used only where a wall time is written (never to order anything: log timestamps and
the wall clock are data, not an order).
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def time(self) -> float: ...


class SystemClock:
    """The process's clocks."""

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()


SYSTEM: Clock = SystemClock()


class FakeClock:
    """A clock that moves only when told (:meth:`advance`); starts at ``start`` on both scales."""

    def __init__(self, start: float = 1_000.0, wall: float = 1_700_000_000.0) -> None:
        self._now = start
        self._wall = wall

    def monotonic(self) -> float:
        return self._now

    def time(self) -> float:
        return self._wall

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a monotonic clock does not go back")
        self._now += seconds
        self._wall += seconds
