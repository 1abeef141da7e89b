"""``mstb-sidecar replay``: read every log once, write the runs, print a summary, exit.

Replay is the daemon's engine run to the end of the input: the same checkpoint makes a second
replay of the same logs add nothing, and a replay after the logs grew add only the new steps.
Output deleted while it runs (:class:`OutputLost` at a checkpoint) ends it with one error line
and status 1; its checkpoint is dropped, so running it again writes everything that is gone.
A large replay of several ranks runs in worker processes, one per core
(:mod:`sidecar.service.replay_workers`), with the same result. Ctrl-C saves the checkpoint of
what was written and exits 130 (:mod:`sidecar.service.interrupt`): the same command goes on.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import sys
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from sidecar.engine import Engine
from sidecar.output.event_file import OutputLost
from sidecar.output.sink import Sink
from sidecar.service.config import SidecarConfig
from sidecar.service.engine_settings import alert_command, settings_from
from sidecar.service.interrupt import SAVED, CtrlC
from sidecar.service import replay_workers
from sidecar.service.replay_protocol import WorkersFailed
from sidecar.service.report import summary

log = logging.getLogger(__name__)

READ_BUDGET = 1 << 20  # per file and pump; between pumps a replay checkpoints and a worker hears Ctrl-C
ALERT_DRAIN = 60.0  # seconds the end of a replay waits for --on-alert commands, at most


def _progress(total: int, show: bool) -> Any:
    """A progress bar on a terminal; otherwise a stand-in, and tqdm (35 ms to import) is not loaded."""
    if not show:
        return contextlib.nullcontext(SimpleNamespace(update=lambda n: None, reset=lambda: None))
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="replay")


def _unread(engine: Engine) -> int:
    return sum(s.tail.unread() for s in engine.sources.values())


def _replay_here(engine: Engine, bar: Any, checkpoint_every: float) -> None:
    """Every file in this process, checkpointing as it goes. Ctrl-C is taken between two reads
    (:mod:`sidecar.service.interrupt`), where a checkpoint may be saved: it is, and the
    KeyboardInterrupt goes on."""
    last_checkpoint = time.monotonic()
    with CtrlC() as ctrl_c:
        while True:
            before = engine.bytes_read
            work = engine.pump(READ_BUDGET, time.monotonic())  # bytes read and lines processed
            bar.update(engine.bytes_read - before)
            if ctrl_c.pressed:
                engine.checkpoint()
                log.warning(SAVED)
                raise KeyboardInterrupt
            if work == 0:
                break
            if time.monotonic() - last_checkpoint >= checkpoint_every:
                engine.checkpoint()
                last_checkpoint = time.monotonic()
    engine.end_of_input()


def run_replay(config: SidecarConfig, alert_exit: int, sinks: Sequence[Sink] = ()) -> int:
    """0, or ``alert_exit`` when an alert that ``--fail-on`` names was raised. With ``sinks``, in
    one process (:func:`replay_workers.shares`)."""
    started = time.monotonic()
    on_alert = alert_command(config)
    settings = settings_from(config, live=False, on_alert=on_alert, sinks=sinks)
    engine = Engine(settings)
    try:
        engine.scan()
        if not engine.sources and not engine.summaries.files:
            unreadable = engine.accounting.unreadable_paths()
            if unreadable:
                log.error("nothing could be read: %s; run as a user that can read the training logs",
                          "; ".join(f"{path}: {why.lower()}" for path, why in sorted(unreadable.items())[:3]))
                return 2
            log.warning(
                "no mindformers logs found under %s (looked for rank_N/info.log, worker_N.log, "
                "mindformer(s).log and MindSpore *_MS summaries); nothing to do",
                ", ".join(map(str, config.paths)),
            )
            return 0
        total = _unread(engine)
        gc.freeze()  # what start-up made lives to the end: collections need not walk it, nor forks copy it
        show = config.progress and not config.quiet and sys.stderr.isatty()
        groups = replay_workers.shares(engine, config.jobs, config.every)
        with _progress(total, show) as bar:
            if groups is not None:
                try:
                    replay_workers.run(engine, groups, READ_BUDGET, bar.update, config.checkpoint_interval)
                except WorkersFailed as exc:
                    log.warning("%s; replaying in one process instead%s", exc,
                                ", from the checkpoint saved on the way" if exc.checkpointed else "")
                    engine = Engine(settings)
                    engine.scan()
                    bar.reset()  # what the checkpoint says was read, if there is one; else from 0
                    bar.update(max(total - _unread(engine), 0))
                    groups = None
            if groups is None:
                _replay_here(engine, bar, config.checkpoint_interval)
        engine.checkpoint()
    except OutputLost as lost:
        engine.store.forget()
        log.error("%s; run the same command again to write it anew from the logs", lost)
        return 1
    finally:
        engine.close()
        if on_alert is not None:
            on_alert.close(ALERT_DRAIN)
    progress = engine.progress()
    if not progress.reported and not progress.summary_events and progress.lines_read:
        files = sorted(path for path, offset in progress.files.items() if offset)
        log.warning("no mindformers step record was recognised in the %d line(s) read from %s; is it a "
                    "mindformers training log? 'mstb-sidecar check PATH' shows what each file was taken for",
                    progress.lines_read, ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else ""))
    elif not config.quiet:
        print(summary(progress, time.monotonic() - started))
        print(f"open it with: tensorboard --logdir {config.bucket or config.out}")
    failed = sorted(group.value for group in config.fail_on if progress.alert_groups.get(group))
    if failed:
        log.error("failing as --fail-on asks: %s alert(s) raised (see above); the runs are written",
                  ", ".join(failed))
        return alert_exit
    return 0
