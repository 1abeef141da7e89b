"""The live loop behind ``mstb-sidecar --watch PATH --out DIR``.

One thread does everything (scan, read, parse, write, checkpoint), so there is no queue to
overflow and no writer thread to die silently; back-pressure is simply that a slow disk slows
reading, and offsets only advance past what was written. Each iteration:

    rescan (when the tree changed, else every --rescan-interval polling or 60 s with file
    events) -> read new bytes of every file -> release held records -> make events visible
    (write) -> checkpoint (every --checkpoint-interval: fsync, then state) -> ping the watchdog
    -> wait for a file event (10 s reconcile) or, polling, --poll-interval; never longer than
    the companion wait while a record is held (a head whose bar never comes is still due)

SIGTERM/SIGINT: drain what is readable (bounded by ``drain_timeout``), checkpoint, exit 0.
SIGHUP: rescan now. Open files are kept: they are followed by identity, and a renamed-away or
deleted file that still has unread bytes can only be read through its open descriptor.
A write error (disk full, read-only) ends the process with status 1 before any checkpoint could
claim the failed events, so a restart after the fix loses nothing.

Output deleted under the loop (a run directory, the event file being written, all of ``--out``)
is noticed by the checkpoint's barrier (:class:`OutputLost`) before the checkpoint could claim
it. The loop then starts over in-process: it closes the engine, drops its checkpoint, and a new
engine reads every log again from the start; the run writers skip what the runs still hold, so
what was deleted is written again and nothing twice.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import replace
from types import FrameType

from sidecar.config import SidecarConfig
from sidecar.engine import Engine, Settings
from sidecar.event_file import OutputLost
from sidecar.lock import hold
from sidecar.notify import Notifier
from sidecar.replay import settings_from
from sidecar.state import StateStore
from sidecar.wakeup import WakeUp

log = logging.getLogger(__name__)

READ_BUDGET = 1 << 20
RECONCILE_INTERVAL = 10.0  # with file events: the longest a missed event can delay a line
RESCAN_RECONCILE = 60.0  # with file events: full rescans between tree-change events


class _Signals:
    """SIGTERM/SIGINT/SIGHUP set flags and cut the loop's wait short.

    The handlers only set flags. Waking the loop with ``Event.set()`` inside a handler
    deadlocks: the handler runs in the main thread, which may hold the event's lock (inside
    ``wait``/``clear``) when the signal lands; the process then ignores even SIGTERM. Instead
    Python's C-level handler writes each signal to a pipe (``signal.set_wakeup_fd``) and a
    small thread turns that into ``wake.set()``.
    """

    def __init__(self, wake: threading.Event) -> None:
        self.stop = False
        self.reload = False
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        threading.Thread(target=_relay, args=(read_fd, wake), name="signal-wakeup", daemon=True).start()
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_reload)

    def _on_stop(self, signum: int, frame: FrameType | None) -> None:
        self.stop = True

    def _on_reload(self, signum: int, frame: FrameType | None) -> None:
        self.reload = True


def _relay(read_fd: int, wake: threading.Event) -> None:
    while os.read(read_fd, 64):
        wake.set()


def _status(engine: Engine) -> str:
    sources = list(engine.sources.values())
    lag = sum(max(s.tail.size - s.tail.offset, 0) for s in sources)
    steps = [r.stats.last_step for r in engine.ranks.values() if r.stats.last_step is not None]
    last = f", last step {max(steps)}" if steps else ""
    dropped = engine.accounting.describe()
    skipped = f", not written: {dropped}" if dropped else ""
    return f"following {len(sources)} file(s), {len(engine.ranks)} rank(s){last}, lag {lag} bytes{skipped}"


def run_daemon(config: SidecarConfig) -> int:
    settings = settings_from(config, live=True)
    engine = Engine(settings)
    notifier = Notifier()
    wake = WakeUp(config.paths, config.out, config.poll)
    signals = _Signals(wake.event)
    collector = None
    if config.metrics_port is not None:
        from sidecar.metrics import serve

        collector = serve(engine, config.metrics_host, config.metrics_port)
    try:
        engine.scan()
        log.info("watching %s (%s) -> %s; %d file(s) so far",
                 ", ".join(map(str, config.paths)), wake.mode, config.out, len(engine.sources))
        notifier.ready(_status(engine))
        while True:
            try:
                _loop(engine, config, notifier, wake, signals)
                notifier.stopping()
                _drain(engine, config.drain_timeout)
                engine.checkpoint()
                break
            except OutputLost as lost:
                engine = _start_over(engine, settings, lost)
                if collector is not None:
                    collector.engine = engine
    except OSError:
        engine.abandon()
        raise
    finally:
        wake.stop()
    engine.close()
    log.info("stopped: %s", _status(engine))
    return 0


def _start_over(engine: Engine, settings: Settings, lost: OutputLost) -> Engine:
    """A new engine that reads every log again; the old one's checkpoint may claim lost points.

    ``--from-end`` no longer applies: every file was seen already, and skipping its content now
    would leave what was deleted unwritten for good.
    """
    log.warning("%s; writing it again from the logs", lost)
    engine.close()  # fsyncs what is still on disk; saves no checkpoint
    hold(settings.out, settings.instance)  # a deleted --out took the lock file with it
    StateStore(settings.out, settings.instance).forget()
    fresh = Engine(replace(settings, from_end=False))
    fresh.scan()
    return fresh


def _loop(engine: Engine, config: SidecarConfig, notifier: Notifier, wake: WakeUp, signals: _Signals) -> None:
    # With file events, polling is only the safety net (a missed or overflowed event): the loop
    # sleeps until an event or the reconcile interval, and rescans on tree changes, so an idle
    # sidecar following a thousand files costs almost nothing. Without them, it polls.
    idle_wait = RECONCILE_INTERVAL if wake.events else config.poll_interval
    rescan_every = max(RESCAN_RECONCILE, config.rescan_interval) if wake.events else config.rescan_interval
    next_scan = next_checkpoint = time.monotonic()
    dirty = False
    while not signals.stop:
        now = time.monotonic()
        if signals.reload:
            signals.reload = False
            log.info("SIGHUP: rescanning")
            next_scan = now
        moved = wake.take_structure_change() if wake.events else engine.moved()
        if now >= next_scan or moved:
            engine.scan()
            engine.forget_gone(config.rotate_quiet)
            next_scan = now + rescan_every
        read = engine.pump(READ_BUDGET, now)
        holding = engine.tick(now)
        engine.flush()
        dirty = dirty or read > 0
        if dirty and now >= next_checkpoint:
            engine.checkpoint()
            dirty = False
            next_checkpoint = now + config.checkpoint_interval
        notifier.status(_status(engine))
        notifier.healthy()
        if read == 0:
            wake.wait(min(idle_wait, config.companion_wait) if holding else idle_wait)


def _drain(engine: Engine, timeout: float) -> None:
    """Read what the files hold right now (the trainer's last lines), within ``timeout``."""
    deadline = time.monotonic() + timeout
    engine.scan()
    while time.monotonic() < deadline:
        now = time.monotonic()
        if engine.pump(READ_BUDGET, now) == 0:
            break
    engine.tick(time.monotonic())

