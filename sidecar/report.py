"""The one-screen summary printed after a replay (and on request by the daemon)."""

from __future__ import annotations

from parsers import tags
from sidecar.engine import Engine

_MAIN_TAGS = (
    tags.LOSS,
    tags.LEARNING_RATE,
    tags.GRAD_NORM,
    tags.LOSS_SCALE,
    tags.ITERATION_TIME,
    tags.THROUGHPUT,
    tags.MODEL_FLOPS,
)


def summary(engine: Engine, seconds: float) -> str:
    sources = list(engine.sources.values())
    lines = [
        f"read {len(sources)} file(s), {engine.bytes_read / 1e6:.1f} MB in {seconds:.1f} s "
        f"-> {engine.settings.out}"
    ]
    if not engine.ranks and not engine.summaries.events:
        lines.append("nothing new since the last run")
        return "\n".join(lines)
    header = ("rank", "steps", "first", "last", "format", "metrics", "not written")
    rows = [header]
    for rank_id in sorted(engine.ranks):
        stats = engine.ranks[rank_id].stats
        main = [t for t in _MAIN_TAGS if t in stats.tags]
        other = len(stats.tags) - len(main)
        metrics = ", ".join(main) + (f" +{other} more" if other else "")
        rows.append(
            (
                str(rank_id),
                str(stats.records),
                "-" if stats.first_step is None else str(stats.first_step),
                "-" if stats.last_step is None else str(stats.last_step),
                ", ".join(sorted(f.value for f in stats.families)) or "-",
                metrics or "-",
                ", ".join(f"{n} {r.value}" for r, n in engine.accounting.of_rank(rank_id).items()) or "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for row in rows:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    dropped = engine.accounting.describe()
    if dropped:
        lines.append(f"not written, by reason: {dropped} (duplicate: a copy of a record already written; "
                     "superseded: from before a training resume; malformed/too-long lines; unreadable files)")
    resumes = sum(r.stats.resumes for r in engine.ranks.values())
    if resumes:
        lines.append(f"training resumed {resumes} time(s); superseded points are hidden by TensorBoard")
    if engine.aggregator is not None and engine.aggregator.writer.points_written:
        incomplete = engine.aggregator.incomplete_steps
        note = f" ({incomplete} step(s) written without every rank, see the warnings)" if incomplete else ""
        lines.append(f"cross-rank aggregate: {engine.aggregator.writer.run_dir.relative_to(engine.settings.out)}{note}")
    if engine.summaries.events:
        lines.append(f"converted {engine.summaries.events} MindSpore summary event(s) "
                     f"from {len(engine.summaries.files)} file(s)")
    alerts = sum(engine.alerts.counts.values())
    if alerts:
        lines.append(f"{alerts} alert(s) (non-finite values, errors); see the warnings above")
    return "\n".join(lines)
