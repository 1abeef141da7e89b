"""What the live sidecar tells an operator: the status line, paths it waits for, its decisions.

The status line (systemd's ``STATUS=``, the periodic log line, SIGUSR1) is built from the engine's
snapshot (:class:`~sidecar.engine.Progress`: its own counters, :mod:`sidecar.analysis.accounting`),
so it never disagrees with the replay summary or the metrics endpoint. ``-v`` logs the sidecar's decisions (a file followed, renamed, let go; a rank
found), read off the engine between iterations, rather than the file events that led to them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from parsers.lifecycle import Lifecycle
from sidecar.analysis.aggregate import rank_ranges
from sidecar.engine import Engine, Progress
from sidecar.following.tailer import STDIN, Identity
from sidecar.output.tensorboard import TensorBoardSink

TENSORBOARD = TensorBoardSink.name

log = logging.getLogger(__name__)

MAX_STEP_GROUPS = 4  # a 1024-rank job must still fit one line


class Described(Protocol):
    """An output beside the runs (``--remote-write``, the ``--out`` bucket) with its own status."""

    def describe(self) -> str: ...


def status_line(progress: Progress, waiting: list[Path], others: Sequence[Described] = ()) -> str:
    """``following 4 file(s), 2 rank(s), last step 16 (rank 0-1), training finished (rank 1), lag 0 bytes,
    not written: ..., remote write: ..., mlflow: 12 sent``"""
    parts = [f"following {progress.following} file(s)", f"{len(progress.written_here)} rank(s)"]
    steps = _last_steps(progress)
    if steps:
        parts.append(f"last step {steps}")
    ended = _ended(progress)
    if ended:
        parts.append(ended)
    parts.append(f"lag {progress.lag_bytes} bytes")
    dropped = progress.accounting.describe()
    if dropped:
        parts.append(f"not written: {dropped}")
    parts += [other.describe() for other in others]
    parts += sink_health(progress)
    line = ", ".join(parts)
    if waiting:
        line = f"waiting for {', '.join(map(str, waiting))} to appear; {line}"
    return line


def sink_health(progress: Progress) -> list[str]:
    """``mlflow: 1200 sent, 40 queued, 3 retries``: each output beside the event files (whose
    points the rest of the line describes) that counts anything."""
    return [f"{name}: {told}" for name, counts in progress.sinks.items() if name != TENSORBOARD and (told := _health(counts))]


def _health(counts: Mapping[str, int]) -> str:
    """A sink's counts that are not 0: ``1200 sent, 40 queued, 3 retries``."""
    return ", ".join(f"{n} {reason}" for reason, n in counts.items() if n)


def _last_steps(progress: Progress) -> str:
    """Last step per rank, ranks with the same step grouped: ``16 (rank 0-6), 15 (rank 7)``;
    past :data:`MAX_STEP_GROUPS` the lowest step (the rank that lags) is kept."""
    by_step: dict[int, list[int]] = {}
    for rank_id in sorted(progress.written_here):
        last = progress.ranks[rank_id].last_step
        if last is not None:
            by_step.setdefault(last, []).append(rank_id)
    groups = [f"{step} (rank {rank_ranges(ranks, ',')})" for step, ranks in sorted(by_step.items(), reverse=True)]
    if len(groups) > MAX_STEP_GROUPS:
        groups = [*groups[:MAX_STEP_GROUPS - 1], f"... lowest {groups[-1]}"]
    return ", ".join(groups)


def _ended(progress: Progress) -> str:
    """``training finished (rank 0-6), failed (rank 7)``: ranks written that are not running (as
    the rank count and last steps, of this start; the metrics also show those restored)."""
    by_state: dict[Lifecycle, list[int]] = {}
    for rank_id in sorted(progress.written_here):
        lifecycle = progress.ranks[rank_id].lifecycle
        if lifecycle is not None and lifecycle is not Lifecycle.RUNNING:
            by_state.setdefault(lifecycle, []).append(rank_id)
    said = [f"{state.value} (rank {rank_ranges(ranks, ',')})" for state, ranks in sorted(by_state.items())]
    return f"training {', '.join(said)}" if said else ""


class Waiting:
    """``--watch`` paths that do not exist yet (the sidecar starts before the job): said once
    when waiting starts and once when each appears, with a warning if one is still missing after
    ``grace`` seconds (a typo in the path looks just like a job that has not started)."""

    def __init__(self, paths: list[Path], grace: float, now: float) -> None:
        self.missing = [p for p in paths if p != STDIN and not p.exists()]
        self._grace = grace
        self._since = now
        self._warned = False
        if self.missing:
            log.info("waiting for %s to appear (does not exist yet; the job creates it)",
                     ", ".join(map(str, self.missing)))

    def check(self, now: float) -> bool:
        """Returns whether a missing path appeared."""
        if not self.missing:
            return False
        appeared = [p for p in self.missing if p.exists()]
        for path in appeared:
            log.info("%s appeared; following it", path)
        self.missing = [p for p in self.missing if p not in appeared]
        if self.missing and not self._warned and now - self._since >= self._grace:
            self._warned = True
            log.warning("%s still does not exist after %.0f s; check --watch (and the job's output_dir) if the "
                        "job has started. Still waiting.", ", ".join(map(str, self.missing)), now - self._since)
        return bool(appeared)

    def next_check(self, now: float) -> float | None:
        """Seconds until the missing-path warning is due (the loop must wake by then, however
        long it would otherwise wait), or None when nothing is due."""
        if not self.missing or self._warned:
            return None
        return max(0.0, self._since + self._grace - now)


class Decisions:
    """Logs at debug level (``-v``) what changed in the engine since the last look."""

    def __init__(self, from_end: bool) -> None:
        self._from_end = from_end  # else a file first read past its start resumes a checkpoint
        self._paths: dict[Identity, Path] = {}
        self._ranks: set[int] = set()

    def observe(self, engine: Engine) -> None:
        if not log.isEnabledFor(logging.DEBUG):
            return
        for identity, source in engine.sources.items():
            before, path = self._paths.get(identity), source.tail.path
            if before is None:
                offset = source.tail.offset
                where = ("from the start" if not offset else f"from byte {offset}" if self._from_end
                         else f"resuming at byte {offset} (checkpoint)")
                log.debug("following %s as rank %d, %s", path, source.candidate.rank, where)
            elif before != path:
                log.debug("%s is now %s (rotated); reading it to the end", before, path)
        for identity in self._paths.keys() - engine.sources.keys():
            log.debug("let go of %s (gone, or renamed away and read to the end)", self._paths[identity])
        self._paths = {identity: s.tail.path for identity, s in engine.sources.items()}
        for rank_id in sorted(engine.ranks.keys() - self._ranks):
            log.debug("rank %d found: writing %s", rank_id, engine.ranks[rank_id].writer.run_dir)
        self._ranks = set(engine.ranks)
