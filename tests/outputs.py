"""Everything a ``--out`` tree shows, read back as TensorBoard reads it, and the differences of two.

:func:`read_out` gives, per run (its path under ``--out``): every scalar tag's points, every text
tag's texts (TensorBoard's loaders, so a ``SessionLog.START`` purges what it should), the HParams
plugin's content per tag, and ``run.json``. :func:`differences` compares two such trees and says
in words what differs (for a test's assertion message); nothing in it knows what the sidecar
should have written, so a test compares a run it doubts with one it trusts (e.g. a live run
that was killed against a fresh uninterrupted ``replay`` of the same logs).

Values are compared as stored (float32): NaN equals NaN, ``-0.0`` differs from ``0.0``. Wall
times are not compared (a live run's alerts carry the sidecar's clock).

:func:`compare` and :func:`assert_same_outputs` take two ``--out`` directories, with each Custom
Scalars layout taken at its newest version (:func:`last_layout`): "the same event files as an
uninterrupted run", the oracle of the restart tests and of the randomized test.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tensorboard.backend.event_processing import event_accumulator, plugin_event_accumulator
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.hparams import plugin_data_pb2

RUN_JSON = "run.json"
STATE_DIR = ".mstb-sidecar"
LAYOUT_TAG = "custom_scalars__config__"


@dataclass
class RunOutput:
    """What one run shows."""

    scalars: dict[str, dict[int, float]] = field(default_factory=dict)  # tag -> step -> value
    texts: dict[str, dict[int, str]] = field(default_factory=dict)  # tag -> step -> text
    hparams: dict[str, plugin_data_pb2.HParamsPluginData] = field(default_factory=dict)  # tag -> content
    run_json: dict | None = None
    repeated: list[tuple[str, int]] = field(default_factory=list)  # (tag, step) shown twice


Tree = dict[str, RunOutput]


def read_run(run_dir: Path) -> RunOutput:
    run = RunOutput()
    if any("tfevents" in p.name for p in run_dir.iterdir() if p.is_file()):
        scalars = event_accumulator.EventAccumulator(str(run_dir), size_guidance={event_accumulator.SCALARS: 0})
        scalars.Reload()
        for tag in scalars.Tags()[event_accumulator.SCALARS]:
            points = run.scalars[tag] = {}
            for e in scalars.Scalars(tag):
                if e.step in points:
                    run.repeated.append((tag, e.step))
                points[e.step] = e.value
        plugins = plugin_event_accumulator.EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
        plugins.Reload()
        for tag in plugins.Tags()["tensors"]:
            texts = {}
            for e in plugins.Tensors(tag):
                if e.tensor_proto.string_val:
                    if e.step in texts:
                        run.repeated.append((tag, e.step))
                    texts[e.step] = e.tensor_proto.string_val[0].decode("utf-8", "replace")
            if texts:
                run.texts[tag] = texts
        if "hparams" in plugins.ActivePlugins():  # parsed: a map's serialized order is not fixed
            run.hparams = {tag: plugin_data_pb2.HParamsPluginData.FromString(content)
                           for tag, content in plugins.PluginTagToContent("hparams").items()}
    meta = run_dir / RUN_JSON
    if meta.exists():
        run.run_json = json.loads(meta.read_text(encoding="utf-8"))
    return run


def newest_layout(run_dir: Path) -> layout_pb2.Layout:
    """The Custom Scalars layout TensorBoard charts for the run (its newest), parsed (the text
    :func:`read_run` gives is decoded lossily); empty if it has none."""
    if not run_dir.is_dir():
        return layout_pb2.Layout()
    plugins = plugin_event_accumulator.EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    plugins.Reload()
    if LAYOUT_TAG not in plugins.Tags()["tensors"]:
        return layout_pb2.Layout()
    newest = max(plugins.Tensors(LAYOUT_TAG), key=lambda e: e.step)
    return layout_pb2.Layout.FromString(newest.tensor_proto.string_val[0])


def read_out(out: Path) -> Tree:
    """Every run under ``out`` (a directory with event files or a ``run.json``), by relative path."""
    if not out.is_dir():
        return {}
    tree: Tree = {}
    for run_dir in sorted([out, *out.rglob("*")]):
        if not run_dir.is_dir() or STATE_DIR in run_dir.relative_to(out).parts:
            continue
        if (run_dir / RUN_JSON).exists() or any("tfevents" in p.name for p in run_dir.iterdir()):
            tree[str(run_dir.relative_to(out))] = read_run(run_dir)
    return tree


def same_value(a: float, b: float) -> bool:
    """Equal as stored: NaN is NaN, and a zero's sign counts."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)


def _points(where: str, a: dict[int, object], b: dict[int, object], same: Callable[[object, object], bool],
            names: tuple[str, str]) -> list[str]:
    only_a = sorted(set(a) - set(b))
    only_b = sorted(set(b) - set(a))
    wrong = [(s, a[s], b[s]) for s in sorted(set(a) & set(b)) if not same(a[s], b[s])]
    found = []
    if only_a:
        found.append(f"{where}: steps only in {names[0]}: {only_a[:10]} ({len(only_a)})")
    if only_b:
        found.append(f"{where}: steps only in {names[1]}: {only_b[:10]} ({len(only_b)})")
    if wrong:
        shown = [(s, _short(x), _short(y)) for s, x, y in wrong[:5]]
        found.append(f"{where}: values differ at {len(wrong)} steps, (step, {names[0]}, {names[1]}): {shown}")
    return found


def _short(value: object) -> object:
    return value if not isinstance(value, str) or len(value) < 120 else value[:117] + "..."


def differences(a: Tree, b: Tree, names: tuple[str, str] = ("a", "b"),
                ignore: Callable[[str, str], bool] = lambda run, tag: False,
                steps: Callable[[str, str], Callable[[int], bool]] | None = None) -> list[str]:
    """What differs between two trees, one line per (run, tag) or file; empty when they agree.

    ``ignore(run, tag)`` leaves a tag out; ``steps(run, tag)``, when given, says which steps of it
    to compare (a predicate), for outputs whose extent two correct runs may legitimately differ in.
    A run only one tree has differs by what it shows (nothing, if every tag of it is left out).
    """
    found: list[str] = []
    for run in sorted(set(a) | set(b)):
        x, y = a.get(run, RunOutput()), b.get(run, RunOutput())
        for kind, same in (("scalars", same_value), ("texts", str.__eq__)):
            tags_x, tags_y = getattr(x, kind), getattr(y, kind)
            for tag in sorted(set(tags_x) | set(tags_y)):
                if ignore(run, tag):
                    continue
                keep = steps(run, tag) if steps is not None else (lambda s: True)
                px = {s: v for s, v in tags_x.get(tag, {}).items() if keep(s)}
                py = {s: v for s, v in tags_y.get(tag, {}).items() if keep(s)}
                found += _points(f"{run} {tag}", px, py, same, names)
        if x.repeated != y.repeated:
            found.append(f"{run}: (tag, step) shown twice: {names[0]} {x.repeated[:10]}, {names[1]} {y.repeated[:10]}")
        if x.hparams != y.hparams:
            found.append(f"{run}: HParams data differ ({sorted(x.hparams)} / {sorted(y.hparams)})")
        if x.run_json != y.run_json:
            found.append(f"{run}/{RUN_JSON} differs: {_json_diff(x.run_json, y.run_json, names)}")
    return found


def _json_diff(x: dict | None, y: dict | None, names: tuple[str, str]) -> str:
    if x is None or y is None:
        return f"only in {names[0] if y is None else names[1]}"
    fx, fy = _flat(x), _flat(y)
    keys = sorted(set(fx) | set(fy))
    parts = [f"{k}: {fx.get(k, '<none>')!r} / {fy.get(k, '<none>')!r}" for k in keys if fx.get(k) != fy.get(k)]
    return "; ".join(parts)[:600]


def _flat(value: object, prefix: str = "") -> dict[str, object]:
    if isinstance(value, dict):
        out: dict[str, object] = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): value}


def last_layout(tree: Tree) -> Tree:
    """``tree`` with only the newest Custom Scalars layout of each run, at step 0: TensorBoard
    charts that one, whatever its step (a live sidecar writes a new one as ranks and tags appear,
    a replay only the final one)."""
    for output in tree.values():
        points = output.texts.get(LAYOUT_TAG)
        if points:
            output.texts[LAYOUT_TAG] = {0: points[max(points)]}
    return tree


def compare(expected: Path, got: Path) -> list[str]:
    """:func:`differences` of two ``--out`` directories, each layout at its newest version."""
    return differences(last_layout(read_out(expected)), last_layout(read_out(got)), names=("expected", "got"))


def assert_same_outputs(expected: Path, got: Path) -> None:
    """Fail, listing :func:`compare`'s lines, unless ``got`` shows every output as ``expected`` does."""
    found = compare(expected, got)
    assert not found, f"{got} differs from {expected}:\n  " + "\n  ".join(found)
