"""``mstb-sidecar aggregate --out DIR``: the job-wide aggregate (:mod:`sidecar.analysis.job_aggregate`),
live until SIGTERM/SIGINT, or ``--once``.

Live, one thread polls every ``--poll-interval`` (and wakes when a waiting step's
``--aggregate-timeout`` is up): look for new rank runs, read a round of every run, write the
steps that are due (complete, or late past the timeout), make them visible, checkpoint (fsync,
then state) at most every ``--checkpoint-interval`` once anything was read or written, tell systemd
(``Type=notify``: READY, STATUS, watchdog pings at half of ``$WATCHDOG_USEC``). It polls rather
than watching file events: a poll costs a directory listing and a ``stat`` per run, the node
sidecars' files may be on a network filesystem written by other hosts, and TensorBoard itself
reloads every 5 s.

Time, the wait and the stop request are passed in as for the node daemon
(:func:`sidecar.service.daemon.run_daemon`), so a test steps this loop too.

SIGTERM/SIGINT: read what the runs hold now (for at most ``drain_timeout``), checkpoint, exit 0;
steps still waiting for a rank wait in the checkpoint. The aggregate run deleted under it
(:class:`OutputLost` at a checkpoint): start over from the rank runs, as the node daemon does.

``--once``: read everything there is, write every step still waiting with the ranks that
reported it (those without every rank are counted and marked), checkpoint, exit 0; deleted
output ends it with status 1 and a dropped checkpoint, like ``replay``.
"""

from __future__ import annotations

import logging
import time

from sidecar.analysis.job_aggregate import JOB, JobAggregate
from sidecar.following.clock import SYSTEM, Clock
from sidecar.following.waker import TimerWaker, Waker
from sidecar.output.event_file import OutputLost
from sidecar.output import run_names
from sidecar.output.lock import hold
from sidecar.service.config import SidecarConfig
from sidecar.service.notify import Notifier
from sidecar.service.signals import Requests, install

log = logging.getLogger(__name__)


def run_job_aggregate(config: SidecarConfig, once: bool, clock: Clock = SYSTEM, wake: Waker | None = None,
                      requests: Requests | None = None) -> int:
    """0, or 2 for a ``--run-name`` it cannot follow (one line). ``clock``, ``wake`` and
    ``requests`` as for :func:`sidecar.service.daemon.run_daemon` (a test steps the loop)."""
    if run_names.needs_hash(config.run_name):
        log.error("--run-name %s: the aggregate cannot follow {config_hash} outside {rank}'s path component (the "
                  "hash is read from the logs, not from the runs); tell experiments apart by {label} or {job}",
                  config.run_name)
        return 2
    loss_ranks = set(config.loss_ranks) if config.loss_ranks is not None else None
    if once:
        return _once(config, loss_ranks)
    if wake is None:
        wake = TimerWaker()
    if requests is None:
        requests = Requests()
        install(requests, wake.wake, reload=False)
    notifier = Notifier(clock)
    job = _job(config, config.aggregate_timeout, loss_ranks)
    try:
        job.scan()
        log.info("aggregating the rank runs in %s into %s; %d rank run(s) so far",
                 config.out, job.run_dir, len(job.runs))
        notifier.ready(job.status())
        while True:
            try:
                _follow(job, config, notifier, wake, requests, clock)
                break
            except OutputLost as lost:
                log.warning("%s; writing it again from the rank runs", lost)
                job.close()
                hold(config.out, JOB)  # a deleted --out took the lock file with it
                job.store.forget()
                job = _job(config, config.aggregate_timeout, loss_ranks)
                job.scan()
    except OSError:
        job.abandon()
        raise
    finally:
        wake.stop()
    job.close()
    log.info("stopped: %s", job.status())
    return 0


def _follow(job: JobAggregate, config: SidecarConfig, notifier: Notifier, wake: Waker, requests: Requests,
            clock: Clock) -> None:
    idle_wait = min(config.poll_interval, notifier.watchdog_interval or config.poll_interval)
    next_checkpoint = clock.monotonic()
    next_status = next_checkpoint + config.status_interval if config.status_interval else float("inf")
    written = job.aggregator.writer.points_written
    dirty = False
    while not requests.stop:
        now = clock.monotonic()
        job.check()
        job.scan()
        read = job.pump(now)
        job.flush_due(now)
        job.flush()
        # what changed since the last checkpoint, not just in this round: a change that came
        # before the interval was up must not wait for the next one to be checkpointed
        dirty = dirty or read > 0 or job.aggregator.writer.points_written != written
        written = job.aggregator.writer.points_written
        if dirty and now >= next_checkpoint:
            job.checkpoint()
            dirty, next_checkpoint = False, now + config.checkpoint_interval
        status = job.status()
        notifier.status(status)
        if now >= next_status:
            log.info("status: %s", status)
            next_status = now + config.status_interval
        notifier.healthy()
        if read == 0:  # wakes by the oldest waiting step's timeout, and by a checkpoint that is due
            now = clock.monotonic()
            wait = idle_wait
            for due in (job.aggregator.next_due(now), next_checkpoint - now if dirty else None):
                wait = wait if due is None else min(wait, max(due, 0.0) + 0.05)
            wake.wait(wait)
    notifier.stopping()
    deadline = clock.monotonic() + config.drain_timeout
    while clock.monotonic() < deadline and job.pump(clock.monotonic()):
        pass
    job.flush_due(clock.monotonic())
    job.checkpoint()


def _job(config: SidecarConfig, timeout: float, loss_ranks: set[int] | None) -> JobAggregate:
    return JobAggregate(config.out, timeout, loss_ranks, config.run_name, config.label, config.job)


def _once(config: SidecarConfig, loss_ranks: set[int] | None) -> int:
    job = _job(config, float("inf"), loss_ranks)
    try:
        job.scan()
        while job.pump(time.monotonic()):
            pass
        job.finish()
        job.checkpoint()
    except OutputLost as lost:
        job.store.forget()
        log.error("%s; run the same command again to write it anew from the rank runs", lost)
        return 1
    except OSError:
        job.abandon()
        raise
    finally:
        job.close()
    if not job.runs:
        log.warning("no rank runs (--run-name %s) under %s; nothing to aggregate", config.run_name, config.out)
    elif not config.quiet:
        print(f"read {job.events_read} event(s) of {len(job.runs)} rank run(s) -> {job.run_dir}: {job.status()}")
    return 0
