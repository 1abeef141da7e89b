"""``mstb-sidecar check PATH...``: what the sidecar would follow, and why it would skip anything.

A dry run for the question "why is rank 3 missing?" before (or instead of) starting the daemon:
the same discovery the engine uses, then the start of each file through the same parsers, so
the rank and format it prints are what a replay would use. Nothing is written, not even ``--out``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from sidecar.following.chains import PEEK_BYTES, head_records
from sidecar.following.discovery import Candidate, discover
from sidecar.following.tailer import BINARY, TEXT_PEEK, looks_binary
from sidecar.service.config import SidecarConfig


@dataclass
class Finding:
    candidate: Candidate
    ranks: list[int]  # the ranks its step records were routed to (a combined stream has several)
    formats: list[str]
    first_step: int | None
    problem: str | None  # why it cannot be followed, or None


def inspect(candidate: Candidate, rank_pattern: str | None) -> Finding:
    """Parse the first :data:`PEEK_BYTES` of a file as the engine would."""
    try:
        size = os.stat(candidate.path).st_size
        with open(candidate.path, "rb") as fh:
            binary = looks_binary(fh.read(TEXT_PEEK))
    except OSError as exc:
        return Finding(candidate, [candidate.rank], [], None, f"unreadable: {(exc.strerror or str(exc)).lower()}")
    if binary:
        return Finding(candidate, [candidate.rank], [], None, f"not recognised: {BINARY}")
    ranks: set[int] = set()
    formats: set[str] = set()
    first: int | None = None
    for rank, record in head_records([candidate.path], candidate.rank, rank_pattern):
        ranks.add(rank)
        first = record.step if first is None else first
        if record.family is not None:
            formats.add(record.family.value)
    if not ranks:
        where = "it" if size < PEEK_BYTES else f"its first {PEEK_BYTES >> 20} MiB"
        return Finding(candidate, [candidate.rank], [], None,
                       f"not recognised: no mindformers step record in {where} (yet)")
    return Finding(candidate, sorted(ranks), sorted(formats), first, None)


def run_check(config: SidecarConfig, out: TextIO) -> bool:
    """Print the report; returns whether every file found can be followed (and one was found)."""
    unlisted: dict[Path, OSError] = {}
    candidates = discover(config.paths, config.rank, None, unlisted)
    findings = [inspect(c, config.rank_pattern) for c in candidates if not c.summary]
    summaries = [c for c in candidates if c.summary]
    rows = [("rank", "first step", "file", "format")]
    for f in findings:
        rank = ",".join(map(str, f.ranks)) + ("" if f.candidate.ranked or config.rank_pattern else " (--rank)")
        rows.append((rank, "-" if f.first_step is None else str(f.first_step), str(f.candidate.path),
                     f.problem or ", ".join(f.formats)))
    followable = sum(f.problem is None for f in findings)
    print(f"would follow {followable} of {len(findings)} log file(s) under {', '.join(map(str, config.paths))}",
          file=out)
    if findings:
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        for row in rows:
            print("  " + "  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3], file=out)
    for path, exc in sorted(unlisted.items()):
        print(f"unreadable directory {path}: {(exc.strerror or str(exc)).lower()} (the logs below it are not seen)",
              file=out)
    if summaries:
        print(f"and {len(summaries)} MindSpore summary file(s) to convert", file=out)
    if not candidates:
        print("no mindformers logs found (looked for rank_N/info.log, worker_N.log, mindformer(s).log "
              "and MindSpore *_MS summaries)", file=out)
    print("nothing was written", file=out)
    return bool(candidates) and followable == len(findings) and not unlisted
