"""What the live loops wait on between rounds: a :class:`Waker`, passed in like the :class:`Clock`.

Production: :class:`~sidecar.following.wakeup.WakeUp` (file events, or polling) for the node
daemon, :class:`TimerWaker` (polling only) for the job aggregate. Both return from
:meth:`Waker.wait` at its timeout or earlier when :meth:`Waker.wake` is called (from the signal
relay thread; see :mod:`sidecar.service.signals`).

Tests: :class:`ManualWaker`, after mtail's ``waker.NewTest``. The loop runs in a thread and its
wait blocks until the test calls :meth:`ManualWaker.step`, which moves a
:class:`~sidecar.following.clock.FakeClock` (by the wait the loop asked for, or as told), lets one
round run, and returns once the loop waits again (or has ended). Between two steps the loop is
parked, so the test reads its output without racing it, and no test sleeps to let time pass.

Contract of every waker: :meth:`wait` never blocks past its timeout in the waker's own time
(for :class:`ManualWaker`, the test's steps are that time); :meth:`wake` is safe from any thread
and is never lost (a wake before the wait ends the next wait at once); :meth:`stop` is final.
"""

from __future__ import annotations

import os
import select
import threading
from typing import Protocol

from sidecar.following.clock import FakeClock


class Waker(Protocol):
    mode: str  # for the log line: "inotify+poll", "poll", "manual", ...

    @property
    def events(self) -> bool:
        """File events are in use: a round that read everything waits for the next event, and
        :meth:`take_structure_change` says when to rescan (else the loop polls and backs off)."""
        ...

    def wait(self, timeout: float) -> None: ...

    def wake(self) -> None: ...

    def take_structure_change(self) -> bool: ...

    def stop(self) -> None: ...


class Bell:
    """:meth:`set` wakes a wait from another thread (the signal relay), as a pipe a wait selects on."""

    def __init__(self) -> None:
        self.read_fd, self._write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def set(self) -> None:
        try:
            os.write(self._write_fd, b"!")
        except BlockingIOError:
            pass  # already rung

    def take(self) -> bool:
        rang = False
        try:
            while os.read(self.read_fd, 512):
                rang = True
        except BlockingIOError:
            pass
        return rang


class TimerWaker:
    """Polling only: :meth:`wait` sleeps ``timeout`` or until :meth:`wake`."""

    mode = "poll"
    events = False

    def __init__(self) -> None:
        self._bell = Bell()

    def wait(self, timeout: float) -> None:
        if not self._bell.take():
            select.select([self._bell.read_fd], [], [], max(0.0, timeout))
            self._bell.take()

    def wake(self) -> None:
        self._bell.set()

    def take_structure_change(self) -> bool:
        return False

    def stop(self) -> None:
        pass  # the bell stays open: the signal relay may still ring it


class ManualWaker:
    """The test's waker: each :meth:`wait` parks the loop until :meth:`step` (see the module docstring).

    ``events``: whether the loop runs as with file events (the test tells it of new files with
    :meth:`changed`, as inotify would) or as polling. :attr:`timeouts` keeps every wait the loop
    asked for, so a test can assert when the loop means to wake.
    """

    mode = "manual"

    def __init__(self, clock: FakeClock, events: bool = True) -> None:
        self.clock = clock
        self.events = events
        self.timeouts: list[float] = []
        self._cond = threading.Condition()
        self._parked = False  # the loop is inside wait()
        self._permits = 0  # wakes not taken by a wait yet
        self._rounds = 0  # waits returned
        self._changed = False
        self._stopped = False

    # -- the loop's side -------------------------------------------------------------------
    def wait(self, timeout: float) -> None:
        with self._cond:
            self.timeouts.append(timeout)
            self._parked = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._permits > 0)
            self._permits -= 1
            self._parked = False
            self._rounds += 1

    def wake(self) -> None:
        with self._cond:
            self._permits += 1
            self._cond.notify_all()

    def take_structure_change(self) -> bool:
        with self._cond:
            changed, self._changed = self._changed, False
            return changed

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    # -- the test's side -------------------------------------------------------------------
    def changed(self) -> None:
        """A file or directory was created, moved or deleted: the next round rescans."""
        with self._cond:
            self._changed = True

    def parked(self, timeout: float = 10.0) -> None:
        """Until the loop waits (or has stopped); fails after ``timeout`` real seconds."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._parked or self._stopped, timeout):
                raise AssertionError(f"the loop did not reach its wait within {timeout:g} s")

    def step(self, advance: float | None = None, timeout: float = 10.0) -> float:
        """One round: move the clock by ``advance`` seconds (``None``: the whole wait the loop
        asked for, i.e. nothing woke it), wake the loop, and return once it waits again or has
        stopped. Returns the seconds the clock moved."""
        self.parked(timeout)
        with self._cond:
            if self._stopped:
                raise AssertionError("the loop has stopped")
            seconds = self.timeouts[-1] if advance is None else advance
            rounds = self._rounds
            self.clock.advance(seconds)
            self._permits += 1
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._stopped or self._rounds > rounds and self._parked, timeout):
                raise AssertionError(f"the loop did not finish its round within {timeout:g} s")
        return seconds

    @property
    def stopped(self) -> bool:
        with self._cond:
            return self._stopped
