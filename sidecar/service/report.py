"""The one-screen summary printed after a replay (and on request by the daemon).

It fits :data:`WIDTH` columns: the table holds only short per-rank figures; what is long and
mostly the same on every rank (the record format, the tags written) is listed once per group
of ranks that share it, wrapped. Every column is explained under the table.
"""

from __future__ import annotations

import textwrap
from collections import Counter

from parsers import tags
from sidecar.analysis.accounting import Reason
from sidecar.analysis.aggregate import rank_ranges
from sidecar.engine import Progress, RankProgress
from sidecar.service.status import sink_health

WIDTH = 100
COLLAPSE = 3  # more tags than this under one prefix are listed as ``prefix/* (N tags)``
SHORT = {  # the "not written" column's abbreviations, explained in the legend
    Reason.DUPLICATE: ("dup", "a copy of a record already written"),
    Reason.SUPERSEDED: ("sup", "from before a training resume"),
    Reason.MALFORMED: ("bad", "a line that starts like a step record but does not parse, or a cut-off line"),
    Reason.TOO_LONG: ("long", "a line over --max-line-bytes"),
    Reason.THINNED: ("thin", "not kept by --every"),
    Reason.DELETED_UNREAD: ("gone", "deleted by the writer's rotation before it was read"),
    Reason.UNREADABLE: ("unread", "a file that could not be read"),
}
HEADER = ("rank", "steps", "first", "last", "tags", "not written")
COLUMNS = ("steps = step records written; first, last = global steps; tags = tags in the rank's run; "
           "not written = records read but not written, and why")


def summary(progress: Progress, seconds: float) -> str:
    lines = [
        f"read {len(progress.files)} file(s), {progress.bytes_read / 1e6:.1f} MB in {seconds:.1f} s "
        f"-> {progress.out}"
    ]
    stats = {rank: progress.ranks[rank] for rank in sorted(progress.reported)}
    if not stats and not progress.summary_events:
        lines.append("nothing new since the last run")
        return "\n".join(lines)
    lines += _table(progress, stats)
    lines += _groups(stats)
    lines += _wrap(f"columns: {COLUMNS}")
    dropped = progress.accounting.totals()
    if dropped:
        legend = "; ".join(f"{SHORT[r][0]} = {r.value}: {SHORT[r][1]}" for r in Reason if dropped[r])
        lines += _wrap(f"not written, by reason: {progress.accounting.describe()} ({legend})")
    lines += _resumes(stats)
    aggregate = progress.aggregate
    if aggregate is not None and aggregate.points:
        note = f" ({aggregate.incomplete} step(s) written without every rank, see the warnings)" \
            if aggregate.incomplete else ""
        lines.append(f"cross-rank aggregate: {aggregate.run}{note}")
    if progress.summary_events:
        lines.append(f"converted {progress.summary_events} MindSpore summary event(s) "
                     f"from {progress.summary_files} file(s)")
    lines += _wrap("; ".join(sink_health(progress)))
    raised = progress.alerts
    if raised:
        kinds = Counter[str]()
        for (_, name), count in raised.items():
            kinds[name] += count
        lines += _wrap(f"{sum(raised.values())} alert(s): " + ", ".join(f"{n} {name}" for name, n in sorted(kinds.items()))
                       + "; see the ALERT lines above and the alerts/ text tags")
    return "\n".join(lines)


def _table(progress: Progress, ranks: dict[int, RankProgress]) -> list[str]:
    rows = [HEADER]
    for rank_id, stats in ranks.items():
        dropped = progress.accounting.of_rank(rank_id)
        rows.append((
            str(rank_id),
            str(stats.records),
            "-" if stats.first_step is None else str(stats.first_step),
            "-" if stats.last_step is None else str(stats.last_step),
            str(len(stats.tags)),
            ", ".join(f"{n} {SHORT[r][0]}" for r, n in dropped.items()) or "-",
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    numeric = range(1, 5)  # steps, first, last, tags: right-aligned

    def line(row: tuple[str, ...]) -> str:
        return "  ".join(c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))

    return [line(row).rstrip() for row in rows]


def _groups(ranks: dict[int, RankProgress]) -> list[str]:
    """``ranks 0-7: r0.7+ graph trainer; tags: loss, ...``, once per distinct (format, tags)."""
    groups: dict[tuple[str, str], list[int]] = {}
    for rank_id, stats in ranks.items():
        formats = ", ".join(sorted(f.value for f in stats.families)) or "no step records"
        groups.setdefault((formats, _tag_list(stats.tags)), []).append(rank_id)
    lines: list[str] = []
    for (formats, tag_list), ranks in groups.items():
        lines += _wrap(f"{_who(ranks)}: {formats}; tags: {tag_list or '-'}")
    return lines


def _tag_list(written: frozenset[str]) -> str:
    """Main metrics first, then the rest by name; a crowd under one prefix (``local_norm/<param>``)
    as ``local_norm/* (N tags)``."""
    main = [t for t in tags.MAIN if t in written]
    rest = sorted(written - set(main))
    prefixes = Counter(t.split("/", 1)[0] for t in rest if "/" in t)
    shown: list[str] = []
    for tag in rest:
        prefix = tag.split("/", 1)[0]
        if "/" in tag and prefixes[prefix] > COLLAPSE:
            crowd = f"{prefix}/* ({prefixes[prefix]} tags)"
            if crowd not in shown:
                shown.append(crowd)
        else:
            shown.append(tag)
    return ", ".join(main + shown)


def _resumes(ranks: dict[int, RankProgress]) -> list[str]:
    """``training resumed: rank 0 once; ranks 2-3 twice each``: counted per rank."""
    by_count: dict[int, list[int]] = {}
    for rank_id, stats in ranks.items():
        if stats.resumes:
            by_count.setdefault(stats.resumes, []).append(rank_id)
    if not by_count:
        return []
    parts = []
    for count, ranks in sorted(by_count.items()):
        times = {1: "once", 2: "twice"}.get(count, f"{count} times")
        parts.append(f"{_who(ranks)} {times}" + (" each" if len(ranks) > 1 else ""))
    return _wrap(f"training resumed: {'; '.join(parts)} (superseded points are hidden by TensorBoard)")


def _who(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_ranges(ranks)}"


def _wrap(text: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)
