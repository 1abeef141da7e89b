"""Reading output back the way TensorBoard does, for assertions.

Two views: :func:`scalars` uses TensorBoard's own ``EventAccumulator`` (which applies its START
purge, i.e. what a user sees); :func:`raw_points` decodes every event record with TensorBoard's
``EventFileLoader`` and keeps duplicates, so a test can prove nothing was written twice.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

from outputs import read_run


def scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} as TensorBoard's loader shows it (no downsampling)."""
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    out: dict[str, dict[int, float]] = {}
    for tag in acc.Tags()["scalars"]:
        points = acc.Scalars(tag)
        steps = [p.step for p in points]
        assert len(steps) == len(set(steps)), f"{run_dir} {tag}: TensorBoard shows a step twice"
        out[tag] = {p.step: p.value for p in points}
    return out


def texts(run_dir: Path) -> dict[str, dict[int, str]]:
    """tag -> {step: text} as TensorBoard shows them: read as :func:`outputs.read_run` reads them
    (its plugin accumulator applies a START's purge to texts; the plain one keeps them); none for
    a run not written yet."""
    return read_run(run_dir).texts if run_dir.is_dir() else {}


Event = tuple[str, int, object, "float | None"]


def all_events(out: Path, clock: tuple[float, float] = (math.inf, -math.inf)) -> dict[str, list[Event]]:
    """Every run under ``out``: its (tag, step, value or serialized text, wall time), sorted, as
    ``EventAccumulator`` shows them; a wall time within ``clock`` (taken from the clock while the
    output was written, not from a log) is ``None``."""
    found: dict[str, list[Event]] = {}
    for run in sorted(p for p in out.rglob("*") if p.is_dir() and any(p.glob("*tfevents*"))):
        acc = EventAccumulator(str(run), size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        points: list[Event] = []
        for tag in acc.Tags()["scalars"]:
            points += [(tag, e.step, "nan" if math.isnan(e.value) else e.value, e.wall_time) for e in acc.Scalars(tag)]
        for tag in acc.Tags()["tensors"]:
            points += [(tag, e.step, e.tensor_proto.SerializeToString(), e.wall_time) for e in acc.Tensors(tag)]
        found[str(run.relative_to(out))] = sorted(
            (t, s, v, None if w is not None and clock[0] <= w <= clock[1] else w) for t, s, v, w in points)
    return found


def raw_points(run_dir: Path) -> Counter[tuple[str, int]]:
    """(tag, step) -> how many times it is in the files, ignoring TensorBoard's purge."""
    counts: Counter[tuple[str, int]] = Counter()
    for path in sorted(run_dir.glob("*tfevents*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                counts[(value.tag, event.step)] += 1
    return counts


def same_float32(a: float, b: float) -> bool:
    """Values pass through float32 ``simple_value``; compare at that precision."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return math.isclose(a, b, rel_tol=2e-7, abs_tol=1e-30)
