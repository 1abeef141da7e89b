"""The cross-rank aggregate is exact end to end (issue 9, item 3), through the real engine:

- ranks whose logs differ in bytes per step are averaged over every rank at every step (replay);
- a restart while ranks are apart still averages the steps that were waiting over both ranks (live);
- pipeline parallel across two nodes: node 0 (ranks 0-7 of 16, 2 stages) writes no loss aggregate,
  node 1 the mean of its ranks 8-15 (replay, one sidecar per node into one ``--out``).

Logs are real mindformers v1.9 records (graph trainer: :class:`live_helpers.RankLog`); results are
read back with TensorBoard's loaders.
"""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from live_helpers import LiveEnv, RankLog, wait_until
from sidecar.engine import LEAD, Engine, Settings
from tb_read import scalars

pytest_plugins = ["live_helpers"]

_EXTRA = (  # one more warning per step on one rank only: its log has more bytes per step
    "[WARNING] 2026-11-29 10:00:00,000 [mindformers/tools/logger.py:622] warning: /usr/local/lib/python3.11/"
    "site-packages/mindspore/common/api.py:1036: UserWarning: The input of the cell is not a Tensor, the graph "
    "will be recompiled when its value changes; use mutable() to avoid recompiling the graph every step\n"
)
_PIPELINE = ("[WARNING] 2026-11-29 10:00:00,000 [mindformers/core/callback/callback.py:531] _fix_loss_for_parallel: "
             "pipeline stages: 2 > 1, the loss on the last card is valid.\n")
_PARALLEL = ("[INFO] 2026-11-29 09:59:00,000 [mindformers/core/parallel_config.py:62] build_parallel_config: "
             "initial parallel_config from dict: {'data_parallel': 2, 'model_parallel': 4, 'context_parallel': 1, "
             "'expert_parallel': 1, 'pipeline_stage': 2, 'micro_batch_num': 4, 'use_seq_parallel': False}\n")


def _replay(roots: list[Path], out: Path, instance: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "replay", *map(str, roots), "--out", str(out), "--instance", instance,
         "-q"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    return done.stderr


def _shown(run: Path, tag: str) -> dict[int, float]:
    return scalars(run).get(tag, {}) if run.is_dir() else {}


def _steps(log: RankLog, count: int, before: str = "") -> None:
    """``count`` steps in one write, each preceded by ``before``."""
    log.write(b"".join(before.encode() + log.take() for _ in range(count)))


def _pynative(rank: int, steps: int, before: str = "", first: int = 1, bump: float = 0.0) -> bytes:
    """v1.9 PyNative one-line records (~215 bytes a step) of steps ``first``..``steps``, each
    preceded by ``before``; the loss is ``rank * 100_000 + step + bump``."""
    start = datetime(2026, 11, 29, 10, 0, 0)
    lines = []
    for step in range(first, steps + 1):
        ts = (start + timedelta(seconds=step)).strftime("%Y-%m-%d %H:%M:%S,000")
        lines.append(f"{before}[INFO] {ts} [mindformers/pynative/callback/loss_callback.py:143] _print_log: "
                     f"{{ step:[{step:5d}/100000], loss: {rank * 100_000 + step + bump:10.6f}, per_step_time:    512ms, "
                     f"lr: 1.000000e-05, grad_norm:   0.500000, throughput: 140.07T }}\n")
    return "".join(lines).encode()


def test_replay_of_ranks_with_uneven_bytes_per_step_averages_every_rank(tmp_path: Path) -> None:
    """12k steps; rank 1 prints an extra warning per step, so one read of rank 0's log reaches 12k
    steps ahead of rank 1. The old 10,000-step cap then wrote 2,000 steps' mean from rank 0 alone;
    now every step is the mean of both ranks, and none was written without a rank."""
    steps = 12_000
    for rank, before in ((0, ""), (1, _EXTRA)):
        log = tmp_path / "output" / "log" / f"rank_{rank}" / "info.log"
        log.parent.mkdir(parents=True)
        log.write_bytes(_pynative(rank, steps, before))
    stderr = _replay([tmp_path / "output"], tmp_path / "tb", "node")
    mean = scalars(tmp_path / "tb" / "aggregate" / "node")["loss/mean"]
    assert mean == {s: 50_000.0 + s for s in range(1, steps + 1)}
    assert "written without rank" not in stderr


@pytest.mark.parametrize("wake_mode", ["inotify"])
def test_restart_while_ranks_are_apart_keeps_what_the_aggregate_waits_for(live: LiveEnv) -> None:
    """Rank 1 is 50 steps behind when the sidecar stops; after the restart its steps 51-100 are
    averaged with rank 0's, which were read before the stop (they live only in the checkpoint)."""
    logs = [live.info_log(r) for r in (0, 1)]
    _steps(logs[0], 100)
    _steps(logs[1], 50)
    agg = live.out / "aggregate" / "test"
    sidecar = live.sidecar("--aggregate-timeout", "600").start()
    wait_until(lambda: len(_shown(live.out / "rank_0", "loss")) == 100 and len(_shown(agg, "loss/mean")) == 50, 10,
               "rank 0's 100 steps and 50 aggregate steps")
    rc, _ = sidecar.stop()
    assert rc == 0, sidecar.stderr()
    _steps(logs[1], 50)
    sidecar.start()
    wait_until(lambda: len(_shown(agg, "loss/mean")) == 100, 10, "100 aggregate steps")
    sidecar.stop()
    assert scalars(agg)["loss/mean"] == {s: 50_000.0 + s for s in range(1, 101)}


def _node(root: Path, ranks: range, steps: int) -> None:
    for rank in ranks:
        log = RankLog(root / "output" / "log" / f"rank_{rank}" / "info.log", rank)
        log.write(_PARALLEL.encode())
        _steps(log, steps, _PIPELINE)


def test_pipeline_parallel_across_two_nodes(tmp_path: Path) -> None:
    """World 16 (dp 2 * mp 4 * pp 2, from the logged parallel_config), 2 stages: the valid loss is on
    ranks 8-15. Node 0 once wrote the mean of ranks 4-7 (stage 0) as the loss; now it writes none."""
    out = tmp_path / "tb"
    _node(tmp_path / "node0", range(0, 8), 20)
    _node(tmp_path / "node1", range(8, 16), 20)
    _replay([tmp_path / "node0" / "output"], out, "node0")
    _replay([tmp_path / "node1" / "output"], out, "node1")
    node0, node1 = scalars(out / "aggregate" / "node0"), scalars(out / "aggregate" / "node1")
    assert node0["iteration-time/mean"] == {s: 512.0 for s in range(1, 21)}
    assert not [tag for tag in node0 if tag.startswith("loss/")]
    assert node1["loss/mean"] == {s: 1_150_000.0 + s for s in range(1, 21)}


def _engine_peak(root: Path, out: Path) -> int:
    """Replay ``root`` through the engine; the most steps the aggregate held at once."""
    engine = Engine(Settings(out=out, roots=[root], instance="node"))
    engine.scan()
    peak = 0
    while engine.pump(4 << 20, time.monotonic()):
        peak = max(peak, engine.aggregator.pending_steps())
    engine.end_of_input()
    engine.checkpoint()
    engine.close()
    return peak


def test_the_aggregate_holds_a_bounded_number_of_steps_by_design(tmp_path: Path) -> None:
    """Rank 1's log has ten times the bytes per step, and rank 0 goes back to a checkpoint at
    step 100 of 3,000 while rank 1 (read more slowly) is still far from its own resume. Every
    aggregate step is still the mean over both ranks of the final segment, and the aggregate
    never held much more than LEAD steps: the engine reads the ranks it waits for."""
    steps, back = 3_000, 100
    for rank, before in ((0, ""), (1, _EXTRA * 4)):
        log = tmp_path / "output" / "log" / f"rank_{rank}" / "info.log"
        log.parent.mkdir(parents=True)
        log.write_bytes(_pynative(rank, steps, before) + _pynative(rank, steps, before, first=back, bump=0.5))
    peak = _engine_peak(tmp_path / "output", tmp_path / "tb")
    mean = scalars(tmp_path / "tb" / "aggregate" / "node")["loss/mean"]
    assert mean == {s: 50_000.0 + s + (0.5 if s >= back else 0.0) for s in range(1, steps + 1)}
    assert peak <= 2 * LEAD, f"the aggregate held {peak} steps at once"
