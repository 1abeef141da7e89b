"""Values from the edges never end the sidecar, and each is written as TensorBoard stores it.

A loss finite as a double but beyond float32 (``1e39``, ``1e308``) is +-inf in a float32 event;
subnormals keep their float32 value (or become +-0 below float32's smallest), negative zero
keeps its sign, every NaN/Inf spelling mindformers or Python prints is read, an integer with
hundreds of digits in a value is +inf, and a step beyond int64 (2**63, 2**64) is a malformed
line, counted. Two ranks carry the same values, so the cross-rank aggregate sees them too (two
losses of ``1e308`` average to a finite double, where a plain sum overflows). Each test reads the
lines after the odd ones back with TensorBoard's loaders: replay, and a live sidecar that must go on.
"""

from __future__ import annotations

import json
import math
import re
import struct
import subprocess
from pathlib import Path

import pytest

from live_helpers import BIN, LiveEnv, tb_points, wait_until
from tb_read import texts

pytest_plugins = ["live_helpers"]

_FIXTURE = Path(__file__).parent / "fixtures" / "real" / "mf1.9-dp2" / "output" / "log"
_CALLBACK = "[mindformers/core/callback/callback.py:747] print_output_info:"
_BAR = "   0.5% |                                                  | 0.31978 samples/s/p  0:20:44 }"
_INF, _NAN = math.inf, math.nan
_F32_MAX = struct.unpack("<f", struct.pack("<f", 3.4028234663852886e38))[0]
_F32_TINY = struct.unpack("<f", struct.pack("<f", 1e-40))[0]  # a float32 subnormal
# (loss as printed, the float32 TensorBoard shows)
EDGES = [
    ("2.5", 2.5),
    ("1e39", _INF),
    ("[1e39/1e39]", _INF),
    ("-1e39", -_INF),
    ("1e308", _INF),
    ("3.4028234663852886e38", _F32_MAX),
    ("3.5e38", _INF),
    ("1e-40", _F32_TINY),
    ("1e-46", 0.0),
    ("4.9e-324", 0.0),
    ("-0.0", -0.0),
    ("  nan", _NAN),
    ("NaN", _NAN),
    ("[  nan/2.500]", _NAN),
    ("  inf", _INF),
    (" -inf", -_INF),
    ("Infinity", _INF),
    ("-Infinity", -_INF),
    ("+inf", _INF),
    ("1e400", _INF),
    ("1" + "0" * 400, _INF),
    (str(1 << 64), float(1 << 64)),
    ("2.25", 2.25),
]
POISON_STEPS = [1 << 63, 1 << 64, 10 ** 30]  # beyond int64: malformed, counted


def _stamp(i: int) -> str:
    return f"2026-11-29 16:00:{i // 1000:02d},{i % 1000:03d}"


def edge_lines(first_step: int) -> tuple[bytes, dict[int, float]]:
    """Step records (head + bar) with every edge loss from ``first_step`` on, the poison steps
    between them, and a huge token count in a throughput; and the loss each step must show."""
    out, expected = [], {}
    for i, (loss, want) in enumerate(EDGES):
        step = first_step + i
        ts = _stamp(step)
        out.append(f"[INFO] {ts} {_CALLBACK} {{ Epoch:[  1/  2], step:[{step:5d}/  100], loss: {loss}, "
                   f"per_step_time: 41ms, lr: 1e-05, overflow cond: False, loss_scale: 1.0, "
                   f"global_norm: [{loss}], train_throughput_per_npu: {1 << 70}T\n")
        out.append(f"[INFO] {ts} {_CALLBACK} {_BAR}\n")
        if i < len(POISON_STEPS):
            out.append(f"[INFO] {ts} {_CALLBACK} {{ Epoch:[  1/  2], step:[{POISON_STEPS[i]}/  100], loss: 1.0, "
                       f"per_step_time: 41ms\n")
            out.append(f"[INFO] {ts} {_CALLBACK} {_BAR}\n")
        expected[step] = want
    return "".join(out).encode(), expected


def _fixture_head(rank: int) -> bytes:
    """The genuine start-up lines and first step records of a dp2 run (steps 1-2)."""
    lines = (_FIXTURE / f"rank_{rank}" / "info.log").read_bytes().splitlines(keepends=True)
    third = next(i for i, line in enumerate(lines) if b"step:[    3/" in line)
    return b"".join(lines[:third])


def _same(got: float, want: float) -> bool:
    if math.isnan(want):
        return math.isnan(got)
    return got == want and math.copysign(1, got) == math.copysign(1, want)


def _assert_shown(out: Path, expected: dict[int, float]) -> None:
    for rank in (0, 1):
        shown = dict(tb_points(out / f"rank_{rank}"))
        wrong = {s: (shown.get(s), v) for s, v in expected.items() if s not in shown or not _same(shown[s], v)}
        assert not wrong, f"rank {rank}: step -> (shown, expected): {wrong}"
        twins = dict(tb_points(out / f"rank_{rank}" / "vs_samples", "loss_vs_samples"))
        assert all(s * 4 in twins for s in expected), "every edge step has its loss-vs-samples twin (GBS 4)"
    (run,) = (out / "aggregate").iterdir()  # named after the host in replay, the instance live
    aggregate = dict(tb_points(run, "loss/mean"))
    assert all(s in aggregate for s in expected), sorted(set(expected) - set(aggregate))


def _write_logs(root: Path) -> dict[int, float]:
    expected: dict[int, float] = {}
    for rank in (0, 1):
        log = root / "log" / f"rank_{rank}" / "info.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        edges, expected = edge_lines(3)
        log.write_bytes(_fixture_head(rank) + edges)
    return expected


def test_replay_writes_edge_values_as_float32_and_counts_poison_steps(tmp_path: Path) -> None:
    expected = _write_logs(tmp_path / "output")
    done = subprocess.run([str(BIN), "replay", str(tmp_path / "output"), "--out", str(tmp_path / "tb")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    _assert_shown(tmp_path / "tb", expected)
    assert re.search(rf"\b{2 * len(POISON_STEPS)} malformed", done.stdout), done.stdout


@pytest.mark.parametrize("wake_mode", ["poll"])
def test_live_sidecar_writes_edge_values_and_reads_on_after_them(live: LiveEnv) -> None:
    sidecar = live.sidecar().start()
    heads = {rank: live.output / "log" / f"rank_{rank}" / "info.log" for rank in (0, 1)}
    for rank, path in heads.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_fixture_head(rank))
    wait_until(lambda: all(2 in dict(tb_points(live.out / f"rank_{r}")) for r in (0, 1)), 15, "steps 1-2")
    edges, expected = edge_lines(3)
    for path in heads.values():
        with open(path, "ab") as fh:
            fh.write(edges)
    last = max(expected)
    wait_until(lambda: all(last in dict(tb_points(live.out / f"rank_{r}")) for r in (0, 1)), 15,
               "the steps after the edge values")
    assert sidecar.running(), sidecar.stderr()
    rc, _ = sidecar.stop()
    assert rc == 0 and "Traceback" not in sidecar.stderr(), sidecar.stderr()
    _assert_shown(live.out, expected)


def test_huge_integers_in_the_configuration_are_no_batch_size_and_never_end_a_replay(tmp_path: Path) -> None:
    """A pprint dump whose global batch size has 401 digits and whose device count is 2**70: no
    batch size or world size can be taken from them (``step x GBS`` is a step), the steps are
    written, and the configuration keeps the huge value, as digits where a double cannot hold it."""
    lines = ["{'runner_config': {'global_batch_size': %d}, 'device_num': %d, 'seed': %d}" % (10 ** 400, 1 << 70, 10 ** 400)]
    prefix = "{ts} - mindformers[mindformers/core/callback/callback.py:318] - INFO - "
    for step in range(1, 4):
        ts = f"2026-11-29 10:00:0{step},000"
        lines += [prefix.format(ts=ts) + f"{{ Epoch:[  1/  1], step:[{step:5d}/  100], loss: 2.5, per_step_time: 512ms",
                  prefix.format(ts=ts) + _BAR]
    log = tmp_path / "output" / "msrun_log" / "worker_0.log"
    log.parent.mkdir(parents=True)
    log.write_text("\n".join(lines) + "\n")
    done = subprocess.run([str(BIN), "replay", str(tmp_path / "output"), "--out", str(tmp_path / "tb")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    run = tmp_path / "tb" / "rank_0"
    assert dict(tb_points(run)) == {1: 2.5, 2: 2.5, 3: 2.5}
    assert tb_points(run, "batch-size") == [] and not (run / "vs_samples").exists()
    meta = json.loads((run / "run.json").read_text())
    assert meta["run"]["global_batch_size"] is None and meta["run"]["world_size"] is None
    assert meta["settings"]["seed"] == 10 ** 400


@pytest.mark.parametrize("loss", ["1e39", "[1e39/1e39]", "-1e39"])
def test_a_loss_beyond_float32_raises_the_nan_alert_as_tensorboard_shows_it(tmp_path: Path, loss: str) -> None:
    """TensorBoard shows ``1e39`` as inf: the NaN/Inf alert judges the value as written (float32),
    not the double the log printed, so it is raised at that step and resolved at the next."""
    log = tmp_path / "output" / "log" / "rank_0" / "info.log"
    log.parent.mkdir(parents=True)
    records = []
    for step in range(3, 8):
        value = loss if step == 5 else "2.5"
        records.append(f"[INFO] {_stamp(step)} {_CALLBACK} {{ Epoch:[  1/  2], step:[{step:5d}/  100], loss: {value}, "
                       f"per_step_time: 41ms, lr: 1e-05, overflow cond: False, loss_scale: 1.0, global_norm: [1.0]\n"
                       f"[INFO] {_stamp(step)} {_CALLBACK} {_BAR}\n")
    log.write_bytes(_fixture_head(0) + "".join(records).encode())
    done = subprocess.run([str(BIN), "replay", str(tmp_path / "output"), "--out", str(tmp_path / "tb")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    sign = "-" if loss.startswith("-") else ""
    assert f"ALERT nan-loss: rank 0, step 5: loss = {sign}inf" in done.stderr, done.stderr
    assert "RESOLVED nan-loss: rank 0, step 6" in done.stderr
    assert sorted(texts(tmp_path / "tb" / "rank_0")["alerts/nan-loss"]) == [5, 6]
