"""Which files carry training metrics, which rank each belongs to, and in what order to read them.

Recognised (``mindformers-log-formats.md`` §10-§11):

- ``rank_N/info.log`` and its rotated backups ``info.log.1`` ... ``.5`` (r0.6+);
- ``rank_N/mindformers.log`` (r0.2-r0.3 INFO file) and ``rank_N/mindformer.log`` (rank-table
  stdout capture), plus their backups;
- msrun's ``worker_N.log``;
- r0.3 rank-table copies ``mf_parallelN/...`` (the device index is the rank on one node);
- any file named explicitly on the command line.

``error.log`` is left out: every line in it is also in ``info.log``. The rank is the innermost
``rank_N`` / ``mf_parallelN`` / ``worker_N.log`` in the path, else the caller's default.
Within one rotation chain the oldest backup is read first, so steps come out in order.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

_LOG_NAME = re.compile(r"(?:info\.log|mindformers?\.log|worker_\d+\.log)(?:\.(\d+))?")
# MindSpore SummaryRecord files: <prefix>.out.events.summary.<seconds>.<device>.<host>_MS / _lineage
SUMMARY_NAME = re.compile(r".*\.out\.events\.summary\.(\d+)\..*(_MS|_lineage)")
_RANK_PART = re.compile(r"rank_(\d+)|mf_parallel(\d+)|worker_(\d+)\.log(?:\.\d+)?")
MAX_DEPTH = 8


@dataclass(frozen=True, slots=True)
class Candidate:
    """A file to follow. ``chain`` groups a live log with its rotated backups.

    ``ranked``: the rank comes from the path (not the default); ``summary``: a MindSpore
    summary file (converted by :mod:`sidecar.ms_follow`), not a log.
    """

    path: Path
    rank: int
    chain: str
    backup: int  # 0 for the live file, N for ``.N`` (older as N grows)
    ranked: bool = False
    summary: bool = False

    def order(self) -> tuple[int, str, int]:
        return (self.rank, self.chain, -self.backup)


def rank_of(path: Path) -> int | None:
    """The innermost rank named by the path, or ``None``."""
    for part in reversed(path.parts):
        m = _RANK_PART.fullmatch(part)
        if m:
            return int(next(g for g in m.groups() if g is not None))
    return None


def discover(roots: list[Path], default_rank: int = 0, exclude: Path | None = None) -> list[Candidate]:
    """Every metric-bearing log under ``roots``, in reading order.

    A root that does not exist (now) yields nothing: the command line checks the paths once at
    start, and a live sidecar must outlive a job directory that is removed and made again.
    """
    found: dict[Path, Candidate] = {}
    for root in roots:
        if root.is_file():
            found[root] = _candidate(root, default_rank)
            continue
        for path in _walk(root, exclude.resolve() if exclude else None, 0):
            if _LOG_NAME.fullmatch(path.name) or SUMMARY_NAME.fullmatch(path.name):
                found.setdefault(path, _candidate(path, default_rank))
    return sorted(found.values(), key=Candidate.order)


def _candidate(path: Path, default_rank: int) -> Candidate:
    rank = rank_of(path)
    m = _LOG_NAME.fullmatch(path.name)
    backup = int(m.group(1)) if m and m.group(1) else 0
    chain = str(path.with_suffix("")) if backup else str(path)
    summary = SUMMARY_NAME.fullmatch(path.name) is not None
    return Candidate(path, default_rank if rank is None else rank, chain, backup, rank is not None, summary)


def _walk(directory: Path, exclude: Path | None, depth: int):
    if depth > MAX_DEPTH:
        return
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return  # unreadable or vanished mid-walk: the next rescan tries again
    for entry in entries:
        path = Path(entry.path)
        try:
            if entry.is_dir(follow_symlinks=False):
                if exclude is None or path.resolve() != exclude:
                    yield from _walk(path, exclude, depth + 1)
            elif entry.is_file():
                yield path
        except OSError:
            continue
