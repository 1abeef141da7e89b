"""The live loop behind ``mstb-sidecar --watch PATH --out DIR``.

One thread does everything (scan, read, parse, write, checkpoint), so there is no queue to
overflow and no writer thread to die silently; back-pressure is simply that a slow disk slows
reading, and offsets only advance past what was written. Each iteration:

    rescan (when the tree changed, else every --rescan-interval polling or 60 s with file
    events) -> read new bytes of every file -> release held records -> make events visible
    (write) -> checkpoint (every --checkpoint-interval, after a read or an alert: fsync, then
    state) -> ping the watchdog
    -> wait for a file event (10 s reconcile) or, polling, --poll-interval; never longer than
    the companion wait while a record is held (a head whose bar never comes is still due), nor
    past the next checkpoint while what was read is in none (not until the reconcile)

With file events, a round that read everything there was waits for the next event rather than
looking again (events that came meanwhile end the wait at once), and the next read comes no
sooner than ``--min-read-interval`` after the last (:class:`~sidecar.following.wakeup.WakeUp`). Polling, once nothing has been
read for ``QUIET_AFTER`` seconds the waits and the rescans back off, and so does the look at
each file that has not grown for that long (:attr:`sidecar.following.tailer.FileTail.backoff`):
a thousand idle files cost under 1% of a core. The first line read puts them back to their
intervals.

The wait is also never longer than half of systemd's ``WatchdogSec`` (``$WATCHDOG_USEC``), so
an idle sidecar pings in time however low an admin sets it, nor than the next status line.

A ``--watch`` path that does not exist yet is waited for (:class:`sidecar.service.status.Waiting`): the
sidecar is READY at once, so a training unit ordered after it can start and create it.

SIGTERM/SIGINT: drain what is readable (bounded by ``drain_timeout``), checkpoint, push the last
values (``--remote-write``, bounded by ``drain_timeout`` too), exit 0. The end of standard input
(``--watch -``) stops it the same way. Stopped either way, a stream's held records are released
(:meth:`Engine.drain`: what was read of it is never read again, and a cut last line is counted
malformed); the aggregate's steps that still wait for a rank stay in the checkpoint, not written
without it: a stream that broke mid-job (``kubectl logs -f`` losing its connection) and is fed
again after a restart completes them.
SIGUSR1: log the status line now. SIGHUP: rescan now. Open files are kept: they are followed by
identity, and a renamed-away or deleted file that still has unread bytes can only be read
through its open descriptor.
Signals only set flags (:class:`sidecar.service.signals.Requests`) that the loop reads between
rounds. Time comes from a :class:`~sidecar.following.clock.Clock` and the wait from a
:class:`~sidecar.following.waker.Waker`, both passed in: ``tests/test_stepped_loop.py`` runs this
loop in-process with a fake clock and a manual waker and steps it round by round.
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
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from sidecar.engine import Engine, Settings
from sidecar.following.clock import SYSTEM, Clock
from sidecar.following.tailer import QUIET_AFTER, STDIN
from sidecar.following.waker import Waker
from sidecar.following.wakeup import WakeUp
from sidecar.output.event_file import OutputLost
from sidecar.output.lock import hold
from sidecar.output.sink import Sink
from sidecar.service.config import SidecarConfig
from sidecar.service.engine_settings import alert_command, settings_from
from sidecar.service.notify import Notifier
from sidecar.service.signals import Requests, install
from sidecar.service.status import Decisions, Described, Waiting, status_line

if TYPE_CHECKING:
    from sidecar.output.upload import Uploader
    from sidecar.service.metrics import EngineCollector, TrainingGauges
    from sidecar.service.remote_write import RemoteWrite

log = logging.getLogger(__name__)

READ_BUDGET = 1 << 20
RECONCILE_INTERVAL = 10.0  # with file events: the longest a missed event can delay a line
RESCAN_RECONCILE = 60.0  # with file events: full rescans between tree-change events
POLL_IDLE_MAX = 4.0  # polling: the longest wait once nothing has been read for a while
FILE_IDLE_MAX = 2.0  # polling: the longest wait between looks at a quiet file (under the above: due at each wake)
RESCAN_IDLE_MAX = 30.0  # polling: the longest time between rescans once nothing has been read for a while
NOTIFY_STATUS_EVERY = 1.0  # systemd STATUS= at most this often (it changes with every step)


class MetricsUnavailable(Exception):
    """``--metrics-port`` cannot be served (in use, bad host), or ``--remote-write``'s credential
    file can no longer be read (gone since the options were checked): a misuse, not an output failure."""


def run_daemon(config: SidecarConfig, sinks: Sequence[Sink] = (), clock: Clock = SYSTEM, wake: Waker | None = None,
               requests: Requests | None = None, uploader: Uploader | None = None) -> int:
    """The loop, on the process's clock, file events and signals; a test passes a
    :class:`~sidecar.following.clock.FakeClock`, a :class:`~sidecar.following.waker.ManualWaker`
    and its own :class:`Requests` (then no signal handler is installed) and steps it. ``sinks``: outputs
    besides TensorBoard and the training gauges (:mod:`sidecar.output.sink`)."""
    on_alert = alert_command(config)
    settings = settings_from(config, live=True, on_alert=on_alert, sinks=sinks)
    settings.clock = clock
    gauges = _gauges(config)
    if gauges is not None:
        settings.sinks.append(gauges)
    engine = Engine(settings)
    notifier = Notifier(clock)
    if wake is None:
        wake = WakeUp(config.paths, config.out, config.poll, config.min_read_interval, clock)
    if requests is None:
        requests = Requests()
        install(requests, wake.wake)
    collector, pusher = _publish(engine, config, notifier, wake, gauges, uploader)
    others = [o for o in (pusher, uploader) if o is not None]  # what the status line shows beside the engine
    waiting = Waiting(config.paths, config.wait_grace, clock.monotonic())
    try:
        engine.scan()
        log.info("watching %s (%s) -> %s; %d file(s) so far",
                 ", ".join(map(str, config.paths)), wake.mode,
                 f"{config.bucket} (staged in {config.out})" if config.bucket else config.out, len(engine.sources))
        notifier.ready(status_line(engine.progress(), waiting.missing, others))
        if pusher is not None:
            pusher.start()
        while True:
            try:
                _loop(engine, config, notifier, wake, requests, waiting, others, clock)
                notifier.stopping()
                _drain(engine, config.drain_timeout, clock)
                if STDIN in config.paths:  # what was read of a stream is never read again: release it
                    engine.drain()
                engine.checkpoint()
                if pusher is not None:
                    pusher.close(config.drain_timeout)  # the last values, drained, as the checkpoint has them
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
        if on_alert is not None:
            on_alert.close(config.drain_timeout)
    engine.close()
    log.info("stopped: %s", status_line(engine.progress(), waiting.missing, others))
    return 0


def _gauges(config: SidecarConfig) -> TrainingGauges | None:
    """The training gauges' sink, when metrics are served or pushed."""
    if config.metrics_port is None and config.remote_write is None:
        return None
    from sidecar.service.metrics import TrainingGauges

    return TrainingGauges()


def _publish(engine: Engine, config: SidecarConfig, notifier: Notifier, wake: Waker, gauges: TrainingGauges | None,
             uploader: Uploader | None) -> tuple[EngineCollector | None, RemoteWrite | None]:
    """The one registry that ``--metrics-port`` serves and ``--remote-write`` pushes, when either is on."""
    if gauges is None:
        return None, None
    from sidecar.service.metrics import registry_for, serve

    job = config.job or config.bucket or str(config.out.resolve())
    collector, registry = registry_for(engine, job, gauges)
    if uploader is not None:
        from sidecar.service.bucket_out import BucketCollector

        registry.register(BucketCollector(uploader, job))
    pusher = None
    if config.remote_write is not None:
        from sidecar.service.remote_auth import Credentials
        from sidecar.service.remote_write import RemoteWrite, RemoteWriteCollector

        try:
            credentials = Credentials(config.remote_write_basic_auth_user, config.remote_write_password_file,
                                      config.remote_write_bearer_token_file)
        except ValueError as exc:  # read when the options were checked; gone or emptied since
            wake.stop()
            raise MetricsUnavailable(f"--remote-write: {exc}; give a readable credential file") from None
        pusher = RemoteWrite(config.remote_write, registry, config.remote_write_interval,
                             config.remote_write_queue, config.instance, config.remote_write_headers, credentials)
        registry.register(RemoteWriteCollector(pusher, job))
    if config.metrics_port is not None:
        try:
            serve(registry, config.metrics_host, config.metrics_port, notifier)
        except OSError as exc:
            wake.stop()
            raise MetricsUnavailable(
                f"cannot serve metrics on {config.metrics_host}:{config.metrics_port}: {exc.strerror or exc}; "
                "choose another --metrics-port (or --metrics-host), or stop what uses it") from None
    return collector, pusher


def _start_over(engine: Engine, settings: Settings, lost: OutputLost) -> Engine:
    """A new engine that reads every log again; the old one's checkpoint may claim lost points.

    ``--from-end`` no longer applies: every file was seen already, and skipping its content now
    would leave what was deleted unwritten for good.
    """
    log.warning("%s; writing it again from the logs", lost)
    engine.close()  # fsyncs what is still on disk; saves no checkpoint
    hold(settings.out, settings.instance)  # a deleted --out took the lock file with it
    engine.store.forget()
    fresh = Engine(replace(settings, from_end=False))
    fresh.scan()
    return fresh


def _loop(engine: Engine, config: SidecarConfig, notifier: Notifier, wake: Waker, requests: Requests,
          waiting: Waiting, others: list[Described], clock: Clock) -> None:
    # With file events, polling is only the safety net (a missed or overflowed event): the loop
    # sleeps until an event or the reconcile interval, and rescans on tree changes, so an idle
    # sidecar following a thousand files costs almost nothing. Without them, it polls.
    # Polling, the wait and the rescan interval double per round after QUIET_AFTER seconds
    # without input, up to POLL_IDLE_MAX and RESCAN_IDLE_MAX (see the module docstring).
    ping = notifier.watchdog_interval or RECONCILE_INTERVAL
    idle_wait = min(RECONCILE_INTERVAL, ping)
    rescan_every = max(RESCAN_RECONCILE, config.rescan_interval)
    next_scan = next_checkpoint = next_notify = clock.monotonic()
    next_status = next_scan + config.status_interval if config.status_interval else float("inf")
    decisions = Decisions(config.from_end)
    dirty = False
    stale = True  # systemd's STATUS= does not show the latest step yet
    quiet, last_read = 0, clock.monotonic()  # rounds since the loop went quiet, and when it was not
    while not requests.stop:
        if engine.input_ended():
            log.info("standard input ended; stopping")
            break
        now = clock.monotonic()
        if requests.reload:
            requests.reload = False
            log.info("SIGHUP: rescanning")
            next_scan = now
        appeared = waiting.check(now)
        moved = wake.take_structure_change() if wake.events else engine.moved()
        if not wake.events:
            idle_wait = min(_backed_off(config.poll_interval, quiet, POLL_IDLE_MAX), ping)
            rescan_every = _backed_off(config.rescan_interval, quiet, RESCAN_IDLE_MAX)
        if now >= next_scan or moved or appeared:
            engine.scan()
            for source in engine.sources.values() if not wake.events else ():
                source.tail.backoff = FILE_IDLE_MAX
            engine.forget_gone(config.rotate_quiet)
            next_scan = now + rescan_every
        decisions.observe(engine)
        raised = engine.alerts.raised
        waiting_steps = engine.aggregator.pending_steps() if engine.aggregator is not None else 0
        read = engine.pump(READ_BUDGET, now)
        if read:
            quiet, last_read = 0, now
            if not wake.events:  # back from a quiet spell: new files are looked for at the usual pace
                next_scan = min(next_scan, now + config.rescan_interval)
        elif now - last_read >= QUIET_AFTER:
            quiet += 1
        holding = engine.tick(now)
        engine.flush()
        # An episode opened by time (a stall) is kept too, and steps the aggregate wrote at its
        # timeout (the checkpoint also brings the layout's band charts up to date).
        dirty = dirty or read > 0 or engine.alerts.raised != raised or \
            engine.aggregator is not None and engine.aggregator.pending_steps() != waiting_steps
        if dirty and now >= next_checkpoint:
            engine.checkpoint()
            dirty = False
            next_checkpoint = now + config.checkpoint_interval
        # With file events, a round that read all there was waits for the next event (already
        # queued if the writers went on meanwhile) instead of looking again at once.
        idle = read == 0 or wake.events and not any(source.active for source in engine.sources.values())
        stale = stale or read > 0
        report = requests.report or now >= next_status
        if report or notifier.enabled and stale and now >= next_notify:  # built only when it goes somewhere
            status = status_line(engine.progress(), waiting.missing, others)
            notifier.status(status)
            stale, next_notify = False, now + NOTIFY_STATUS_EVERY
            if report:
                requests.report = False
                log.info("status: %s", status)
                next_status = now + config.status_interval if config.status_interval else float("inf")
        notifier.healthy()
        if idle:
            wait = min(idle_wait, config.companion_wait) if holding else idle_wait
            aggregate_due = engine.aggregator.next_due(now) if engine.aggregator is not None else None
            # a stall alert, the missing-path warning, a step the aggregate writes at its timeout
            for due in (engine.alerts.next_check(now), waiting.next_check(now), aggregate_due):
                wait = wait if due is None else min(wait, due + 0.05)
            if notifier.enabled and stale:
                wait = min(wait, next_notify - now)  # systemd's status is brought up to date once quiet
            if dirty:  # what was read since the last checkpoint is saved when it is due, not at the reconcile
                wait = min(wait, next_checkpoint - now)
            wake.wait(max(0.0, min(wait, next_status - now)))


def _backed_off(base: float, quiet: int, cap: float) -> float:
    """``base`` doubled per quiet round, up to ``cap`` (or ``base`` itself if that is longer)."""
    return min(base * 2 ** min(quiet, 16), max(base, cap))


def _drain(engine: Engine, timeout: float, clock: Clock) -> None:
    """Read what the files hold right now (the trainer's last lines), within ``timeout``."""
    deadline = clock.monotonic() + timeout
    engine.scan()
    while clock.monotonic() < deadline:
        if engine.pump(READ_BUDGET, clock.monotonic()) == 0:
            break
    engine.tick(clock.monotonic())

