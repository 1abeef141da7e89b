"""Two ``--out`` trees compared output by output: the oracle of "same event files as an
uninterrupted run".

What is compared, per run (every directory under ``--out`` with event files, ``.mstb-sidecar``
aside), as TensorBoard's own plugin loader shows it (``plugin_event_accumulator``, which applies
the ``SessionLog.START`` purge, so superseded points do not count):

- every scalar tag at every step (value bit for bit as stored in float32; nan equals nan);
- every other tag (text cards, alerts, ``parallel-layout``, the HParams session data) at every
  step: the stored tensor, and the tag's plugin name and plugin content (the HParams settings
  live in the content, not the tensor);
- ``run.json`` (as parsed JSON).

Not compared: wall times (a live sidecar stamps the events it writes itself), and for the
custom-scalars layout (:data:`LATEST_ONLY`) the steps: the layout run is rewritten at each
checkpoint, so a live run has more versions than a replay, and TensorBoard reads only the
newest one. That newest value is compared.

API: :func:`read_outputs` (a tree as data), :func:`differences` (readable lines, empty when
equal), :func:`assert_same_outputs` (fails with them).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import json_format
from tensorboard.backend.event_processing import plugin_event_accumulator
from tensorboard.plugins.hparams import plugin_data_pb2
from tensorboard.util import tensor_util

SCALARS_PLUGIN = "scalars"
HPARAMS_PLUGIN = "hparams"
LATEST_ONLY = frozenset({"custom_scalars__config__"})
STATE_DIR = ".mstb-sidecar"


@dataclass
class RunOutput:
    scalars: dict[str, dict[int, float]] = field(default_factory=dict)  # tag -> step -> value
    tensors: dict[str, dict[int, bytes]] = field(default_factory=dict)  # tag -> step -> serialized tensor
    plugins: dict[str, tuple[str, object]] = field(default_factory=dict)  # tag -> (plugin, its content; HParams parsed)
    run_json: dict | None = None


def read_outputs(out: Path) -> dict[str, RunOutput]:
    """Every run under ``out`` (path relative to it) with what TensorBoard shows of it."""
    runs: dict[str, RunOutput] = {}
    for run_dir in sorted(p for p in out.rglob("*") if p.is_dir() and STATE_DIR not in p.relative_to(out).parts):
        has_events = any("tfevents" in p.name for p in run_dir.iterdir())
        run_json = run_dir / "run.json"
        if not has_events and not run_json.exists():
            continue
        run = runs[str(run_dir.relative_to(out))] = RunOutput()
        if run_json.exists():
            run.run_json = json.loads(run_json.read_text(encoding="utf-8"))
        if has_events:
            _read_events(run_dir, run)
    return runs


def _read_events(run_dir: Path, run: RunOutput) -> None:
    acc = plugin_event_accumulator.EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    acc.Reload()
    for tag in acc.Tags()["tensors"]:
        metadata = acc.SummaryMetadata(tag)
        plugin = metadata.plugin_data.plugin_name
        events = acc.Tensors(tag)
        if plugin == SCALARS_PLUGIN:
            run.scalars[tag] = {e.step: float(tensor_util.make_ndarray(e.tensor_proto).item()) for e in events}
            continue
        run.plugins[tag] = (plugin, _content(plugin, metadata.plugin_data.content))
        if tag in LATEST_ONLY:
            events = events[-1:]
            run.tensors[tag] = {-1: events[0].tensor_proto.SerializeToString()} if events else {}
        else:
            run.tensors[tag] = {e.step: e.tensor_proto.SerializeToString() for e in events}


def _content(plugin: str, content: bytes) -> object:
    """A plugin's content, comparable: HParams data parsed (a protobuf map serializes in no fixed order)."""
    if plugin != HPARAMS_PLUGIN:
        return content
    return json_format.MessageToDict(plugin_data_pb2.HParamsPluginData.FromString(content))


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def _steps(name: str, want: dict[int, object], got: dict[int, object], same, limit: int) -> list[str]:
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    wrong = sorted(s for s in set(want) & set(got) if not same(want[s], got[s]))
    out = []
    if missing:
        out.append(f"{name}: {len(missing)} step(s) missing, e.g. {missing[:limit]}")
    if extra:
        out.append(f"{name}: {len(extra)} step(s) extra, e.g. {extra[:limit]}")
    if wrong:
        shown = [(s, want[s], got[s]) if isinstance(want[s], float) else s for s in wrong[:limit]]
        out.append(f"{name}: {len(wrong)} step(s) differ, e.g. {shown}")
    return out


def differences(expected: Path | dict[str, RunOutput], got: Path | dict[str, RunOutput],
                runs: set[str] | None = None, limit: int = 10) -> list[str]:
    """What ``got`` shows differently from ``expected``, one line per run, tag and kind of
    difference (missing, extra, differing steps); empty when they are the same. ``runs``: compare
    only these runs (default: all of both)."""
    want = read_outputs(expected) if isinstance(expected, Path) else expected
    have = read_outputs(got) if isinstance(got, Path) else got
    names = sorted(set(want) | set(have)) if runs is None else sorted(runs)
    out: list[str] = []
    for name in names:
        if name not in have:
            out.append(f"run {name}: missing")
            continue
        if name not in want:
            out.append(f"run {name}: extra")
            continue
        a, b = want[name], have[name]
        kinds = (("scalar", a.scalars, b.scalars, _same), ("tensor", a.tensors, b.tensors, bytes.__eq__))
        for kind, left, right, same in kinds:
            for tag in sorted(set(left) | set(right)):
                if tag not in right:
                    out.append(f"{name} {kind} {tag}: missing ({len(left[tag])} step(s))")
                elif tag not in left:
                    out.append(f"{name} {kind} {tag}: extra ({len(right[tag])} step(s))")
                else:
                    out += _steps(f"{name} {kind} {tag}", left[tag], right[tag], same, limit)
        for tag in sorted(set(a.plugins) & set(b.plugins)):
            if a.plugins[tag] != b.plugins[tag]:
                out.append(f"{name} {tag}: plugin data differs ({a.plugins[tag][0]} / {b.plugins[tag][0]})")
        if _canonical(a.run_json) != _canonical(b.run_json):
            out.append(f"{name} run.json: {_json_diff(a.run_json, b.run_json)}")
    return out


def _canonical(content: object) -> str:
    """JSON content as comparable text (NaN equals NaN, key order aside)."""
    return json.dumps(content, sort_keys=True)


def _json_diff(a: dict | None, b: dict | None) -> str:
    if a is None or b is None:
        return "missing" if b is None else "extra"
    keys = sorted(k for k in set(a) | set(b) if _canonical(a.get(k)) != _canonical(b.get(k)))
    return f"differs in {keys}"


def assert_same_outputs(expected: Path, got: Path, runs: set[str] | None = None) -> None:
    """Fail, listing :func:`differences`, unless ``got`` shows every output as ``expected`` does."""
    found = differences(expected, got, runs)
    assert not found, f"{got} differs from {expected}:\n  " + "\n  ".join(found)
