"""Replay on several cores: ranks split across forked workers, the aggregate kept in one place.

Contract: the runs, the aggregate and the checkpoint are those a one-process replay writes
(``tests/test_replay_workers.py`` compares every event of both). Replay is CPU-bound Python, so
one process uses one core however many ranks there are.

How:

- The parent discovers the files (:meth:`Engine.scan`) and splits the ranks into shares of about
  equal bytes (all of a rank's files stay together), then forks one worker per share. A worker is
  the same engine restricted to its share (:meth:`Engine.restrict`): it reads, parses, sequences
  and writes its ranks' runs and raises their alerts.
- What needs every rank goes to the parent through a pipe, in batches
  (:class:`~sidecar.service.replay_child.Relay`; the messages are typed in
  :mod:`sidecar.service.replay_protocol`): each training step for the aggregate, marked when its
  loss was written (the divergence check), each alert for ``--on-alert``, pipeline and world-size
  notes, the ranks seen, the bytes read. The worker's side is :mod:`sidecar.service.replay_child`.
- Pace, so memory stays flat however long the logs: each worker keeps its ranks within
  :data:`~sidecar.engine.LEAD` steps of each other as one engine does (the relay answers the
  engine's "how far apart" questions from its ranks' progress); while the aggregate holds more
  than that, the parent reads only the workers whose ranks it waits for, and the others block on
  their full pipe.
- End: a worker that read everything releases its held records, reports its ranks' last steps
  and waits; the parent writes the rest of the aggregate and sends back the furthest step of
  all ranks, against which each worker judges its ranks behind; then each worker syncs its runs
  and hands over its part of the checkpoint, its counts and its ranks' figures. The parent saves
  one checkpoint, as a one-process replay does.

Checkpoints while reading, every ``--checkpoint-interval``: the parent asks each worker for its
part (:data:`~sidecar.service.replay_protocol.Word.PART`), which it hands over between two reads,
after the batch that covers what it describes (:meth:`Engine.state <sidecar.engine.Engine.state>`: its runs synced, its files' offsets
before any record it holds, and what its ranks' start-up lines stated: run metadata, parallel
layout, :class:`~sidecar.output.state.RankFacts`). Once every part is in, the parent saves them
with the aggregate as it is then, which holds at least every step the parts cover; a step read
again after a restart is one the aggregate ignores or overwrites with the same values. So a replay that is killed goes on from
there next time. No part is asked for once a worker has read everything: the end's checkpoint
is near.

Guard: a line of a rank outside a worker's share (a labelled line in another rank's file) stops
that worker before it writes anything for that rank (:class:`~sidecar.engine.ForeignRank`); so
does any other failure of a worker. The parent then stops every worker and replays in one
process. Before the first checkpoint it deletes the event files this replay's processes made
(their names carry the pid; nothing else was written yet: no checkpoint, no run metadata) and
starts from the beginning, so the result is exactly a one-process replay's; after one, it goes on
from that checkpoint, as after a crash
(:attr:`~sidecar.service.replay_protocol.WorkersFailed.checkpointed`).

Interrupted (Ctrl-C): the parent tells each worker to stop, which it does after its current read,
without releasing the records it holds; it syncs its runs and hands over its part of the
checkpoint. The parent applies every item that came before that part, so the aggregate holds each
step the workers wrote (the steps not written yet wait in its snapshot), saves one checkpoint and
exits 130: the next replay goes on from there. A worker that does not answer within
:data:`STOP_WAIT` is killed, and no checkpoint is saved then: as after any crash, the next replay
goes on from the last one (or reads everything again) and writes only what the runs do not show yet.

Used when it pays and is safe: ``--jobs`` above 1 (unset: the cores this process may use, and
only for at least :data:`PARALLEL_FROM` bytes to read), two or more ranks, every file's rank named
by its path (a combined stream's labels can name any rank), no ``--rank-pattern``, no MindSpore
summaries (their runs are not a rank's), ``--every 1`` (thinning keeps the steps of alerts, and
divergence is judged in the parent), no sinks besides TensorBoard (:attr:`Settings.sinks
<sidecar.engine.Settings.sinks>`: a sink is one object with one part of the checkpoint and, often,
one connection; forked copies would each send a share and save a part that knows only it).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, Pipe, wait
from pathlib import Path

from parsers import tags
from parsers.records import PipelineLine
from sidecar.analysis.alerts import Alert
from sidecar.engine import LEAD, Engine
from sidecar.output.event_file import made_by
from sidecar.output.state import State
from sidecar.service.interrupt import SAVED, CtrlC
from sidecar.service.replay_child import child
from sidecar.service.replay_protocol import (
    Batch,
    Done,
    Failed,
    Final,
    Front,
    Part,
    StepSeen,
    ToParent,
    ToWorker,
    Word,
    WorkersFailed,
)

log = logging.getLogger(__name__)

PARALLEL_FROM = 8 << 20  # bytes to read below which forking costs more than it saves
STOP_WAIT = 30.0  # seconds an interrupted replay waits for its workers' parts


def shares(engine: Engine, jobs: int | None, every: int) -> list[set[int]] | None:
    """The ranks of each worker, or ``None`` to replay in this process (see the module docstring).
    ``jobs``: ``--jobs``; unset, the usable cores, and only for inputs of :data:`PARALLEL_FROM`."""
    wanted = jobs or len(os.sched_getaffinity(0))
    if wanted < 2 or every != 1 or engine.summaries.files or engine.settings.rank_pattern or engine.settings.sinks:
        return None
    if not all(source.candidate.ranked for source in engine.sources.values()):
        return None
    sizes: dict[int, int] = {}
    for source in engine.sources.values():
        rank = source.candidate.rank
        sizes[rank] = sizes.get(rank, 0) + source.tail.unread()
    if len(sizes) < 2 or jobs is None and sum(sizes.values()) < PARALLEL_FROM:
        return None
    groups: list[tuple[int, set[int]]] = [(0, set()) for _ in range(min(wanted, len(sizes)))]
    for rank, size in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0])):  # largest first, to the lightest
        i = min(range(len(groups)), key=lambda g: groups[g][0])
        groups[i] = (groups[i][0] + size, groups[i][1] | {rank})
    return [ranks for _, ranks in groups]


@dataclass
class _Worker:
    pid: int
    conn: Connection
    ranks: set[int]
    exited: int  # a pidfd: readable once the worker is gone
    pumped: bool = False
    done: bool = False
    last_steps: dict[int, int] | None = None
    part: State | None = None  # its answer to the pending PART


@dataclass
class _Checkpoints:
    """The checkpoints saved while the workers read (see the module docstring)."""

    every: float
    due: float  # time.monotonic() of the next request
    asked: bool = False
    saved: bool = False


def run(engine: Engine, groups: list[set[int]], budget: int, progress: Callable[[int], None],
        checkpoint_every: float) -> None:
    """Replay every file with one worker per share of ``groups``; ``engine`` gets what they did.
    Raises :class:`WorkersFailed` with the output as it was before or as its checkpoint says (see
    the module docstring)."""
    workers: list[_Worker] = []
    started = time.time()
    checkpoints = _Checkpoints(checkpoint_every, time.monotonic() + checkpoint_every)
    parent = os.getpid()
    with CtrlC() as ctrl_c:
        try:
            for ranks in groups:
                parent_end, child_end = Pipe()
                pid = os.fork()
                if pid == 0:
                    for fd in [parent_end.fileno()] + [w.conn.fileno() for w in workers] + [w.exited for w in workers]:
                        os.close(fd)  # only the parent talks to the other workers
                    child(engine, ranks, child_end, budget, parent)  # never returns
                child_end.close()
                workers.append(_Worker(pid, parent_end, ranks, os.pidfd_open(pid)))
            engine.hand_over()
            _collect(engine, workers, progress, ctrl_c, checkpoints)
        except WorkersFailed as failed:
            for worker in workers:
                _stop(worker)
            engine.abandon()
            failed.checkpointed = checkpoints.saved
            if not checkpoints.saved:
                _undo(engine.settings.out, [os.getpid(), *(w.pid for w in workers)], started)
            raise
        except KeyboardInterrupt:
            ctrl_c.release()  # a second Ctrl-C ends the hand-over
            _interrupted(engine, workers)
            raise
        except BaseException:
            for worker in workers:
                _stop(worker)
            raise
        finally:
            for worker in workers:
                os.close(worker.exited)
    for worker in workers:
        os.waitpid(worker.pid, 0)


def _collect(engine: Engine, workers: list[_Worker], progress: Callable[[int], None], ctrl_c: CtrlC,
             checkpoints: _Checkpoints) -> None:
    """Every worker's batches until each has read everything, with checkpoints on the way; Ctrl-C
    is taken between two messages (see :mod:`sidecar.service.interrupt`)."""
    aggregator = engine.aggregator
    while not all(w.done for w in workers):
        if ctrl_c.pressed:
            raise KeyboardInterrupt
        busy = [w for w in workers if not w.done]
        ready = wait([w.conn for w in _readable(engine, busy)] + [w.exited for w in busy])
        for worker in busy:
            if worker.exited in ready and worker.conn not in ready:
                _receive(worker)  # a worker that failed or was killed while another was read
            if worker.conn not in ready:
                continue
            message = _receive(worker)
            if isinstance(message, Done):
                worker.done, worker.last_steps = True, message.last_steps
                continue
            if isinstance(message, Part):
                worker.part = message.state
                _save_if_whole(engine, workers, checkpoints)
                continue
            progress(_apply(engine, worker, message))
            if aggregator is not None and all(w.pumped for w in workers):
                aggregator.ready = True
                aggregator.flush_due(0.0)
        if not checkpoints.asked and time.monotonic() >= checkpoints.due and not any(w.done for w in workers):
            for worker in workers:
                _send(worker, Word.PART)
            checkpoints.asked = True
    engine.finish()
    lasts = [step for w in workers for step in (w.last_steps or {}).values()]
    front = max(lasts) if len(lasts) >= 2 else None
    for worker in workers:
        _send(worker, Front(front))
    if aggregator is not None:
        aggregator.writer.sync()  # its fsync while the workers do theirs (the checkpoint's is then free)
    for worker in workers:
        while isinstance(final := _receive(worker), Part):
            pass  # it answered a request it got after its end
        _adopt(engine, final)


def _save_if_whole(engine: Engine, workers: list[_Worker], checkpoints: _Checkpoints) -> None:
    """Once every worker handed over its part, the checkpoint (see the module docstring)."""
    parts = [w.part for w in workers if w.part is not None]
    if len(parts) < len(workers):
        return
    engine.checkpoint(parts)
    for worker in workers:
        worker.part = None
    checkpoints.asked, checkpoints.saved = False, True
    checkpoints.due = time.monotonic() + checkpoints.every


def _apply(engine: Engine, worker: _Worker, batch: Batch) -> int:
    """A worker's batch: its steps to the aggregate and the divergence check, its alerts to
    ``--on-alert``, what it learnt of the ranks and the layout. Returns the bytes it says it read."""
    aggregator, alerts = engine.aggregator, engine.alerts
    worker.pumped = worker.pumped or batch.pumped
    if aggregator is not None and batch.expected:
        aggregator.expected |= batch.expected
    for item in batch.items:
        if isinstance(item, StepSeen):
            if aggregator is not None:
                aggregator.observe_step(item.rank, item.step, item.wall, item.scalars, 0.0, item.resumed)
                if item.written and item.rank in (compared := aggregator.compared_ranks()):
                    alerts.note_loss(item.rank, item.step, item.scalars[tags.LOSS], item.wall, compared, item.again)
        elif isinstance(item, Alert):
            for sink in engine.settings.alert_sinks:
                sink(item)
        elif aggregator is not None:
            (aggregator.note_pipeline if isinstance(item, PipelineLine) else aggregator.note_parallel)(item)
    return batch.read


def _adopt(engine: Engine, final: Final) -> None:
    """A worker's last word: its part of the checkpoint, its ranks' figures, its counts."""
    engine.adopt(final.part, final.stats, final.accounting)
    engine.alerts.counts.update(final.counts)
    engine.alerts.groups.update(final.groups)
    engine.bytes_read += final.read
    engine.lines_read += final.lines


def _interrupted(engine: Engine, workers: list[_Worker]) -> None:
    """Ctrl-C: every worker hands over what it wrote and one checkpoint is saved (see the module
    docstring). Anything going wrong on the way (a worker gone, a second Ctrl-C) leaves no checkpoint."""
    try:
        for worker in workers:
            _send(worker, Word.STOP)
        deadline = time.monotonic() + STOP_WAIT
        for worker in workers:
            while True:
                if not worker.conn.poll(max(deadline - time.monotonic(), 0.0)):
                    raise WorkersFailed(f"replay worker {worker.pid} did not stop in time")
                message = _receive(worker)
                if isinstance(message, Final):
                    _adopt(engine, message)
                    break
                if isinstance(message, Batch):
                    _apply(engine, worker, message)
        engine.checkpoint()
        log.warning(SAVED)
    except BaseException as exc:  # noqa: BLE001 - the interrupt goes on either way
        for worker in workers:
            _stop(worker)
        why = "Ctrl-C again" if isinstance(exc, KeyboardInterrupt) else str(exc)
        log.warning("interrupted: no checkpoint saved (%s); the next replay goes on from the last checkpoint, "
                    "if any", why)


def _readable(engine: Engine, busy: list[_Worker]) -> list[_Worker]:
    """The workers to read next: while the aggregate holds more than LEAD steps, only those with
    a rank it waits for (unless none of them has anything more to say)."""
    aggregator = engine.aggregator
    if aggregator is not None and aggregator.pending_steps() > LEAD:
        waited = aggregator.waiting_for()
        chosen = [w for w in busy if w.ranks & waited]
        if chosen:
            return chosen
    return busy


def _receive(worker: _Worker) -> ToParent:
    try:
        message = worker.conn.recv()
    except (EOFError, OSError):
        raise _gone(worker) from None
    if isinstance(message, Failed):
        raise message.error
    return message


def _send(worker: _Worker, word: ToWorker) -> None:
    try:
        worker.conn.send(word)
    except OSError:  # it ended: why, if it said so before
        while True:
            _receive(worker)  # raises what it reported, or that it said nothing


def _gone(worker: _Worker) -> WorkersFailed:
    return WorkersFailed(f"replay worker {worker.pid} ended without a word (killed?)")


def _undo(out: Path, pids: list[int], since: float) -> None:
    """Delete the event files ``pids`` made under ``out`` since ``since`` (symbolic links not followed)."""
    for top, _, names in os.walk(out):
        for name in names:
            if made_by(name, pids, since):
                os.unlink(os.path.join(top, name))


def _stop(worker: _Worker) -> None:
    try:
        os.kill(worker.pid, signal.SIGKILL)
        os.waitpid(worker.pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
