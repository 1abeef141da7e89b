"""The cross-rank aggregate: completion rule, pipeline-parallel loss validity, timeouts, resumes, NaN."""

from __future__ import annotations

import math
from pathlib import Path

from parsers.records import PipelineLine, Record
from sidecar.aggregate import CrossRankAggregator
from tb_read import scalars, texts


def step(step: int, loss: float | None, ms: float = 500.0, wall: float = 1000.0) -> Record:
    values = {"iteration-time": ms} if loss is None else {"loss": loss, "iteration-time": ms}
    return Record(step, wall + step, values, training_step=True)


def test_a_step_is_written_once_every_rank_reported_it(tmp_path: Path) -> None:
    agg = CrossRankAggregator(tmp_path / "agg", timeout=1e9)
    agg.ready = True
    agg.expected = {0, 1}
    agg.observe(0, step(1, 2.0), now=0)
    agg.observe(0, step(2, 3.0), now=0)
    agg.writer.flush()
    assert not (tmp_path / "agg").exists() or "loss/mean" not in scalars(tmp_path / "agg")
    agg.observe(1, step(1, 4.0, ms=700), now=0)
    agg.close()
    shown = scalars(tmp_path / "agg")
    assert shown["loss/mean"] == {1: 3.0} and shown["loss/spread"] == {1: 2.0}
    assert shown["iteration-time/slowest-rank"] == {1: 1.0}
    assert "custom_scalars__config__" in texts(tmp_path / "agg")


def test_live_timeout_writes_what_arrived(tmp_path: Path) -> None:
    agg = CrossRankAggregator(tmp_path / "agg", timeout=5)
    agg.ready = True
    agg.expected = {0, 1}
    agg.observe(0, step(1, 2.0), now=0)
    agg.flush_due(now=4)
    agg.flush_due(now=6)
    agg.close()
    assert scalars(tmp_path / "agg")["loss/mean"] == {1: 2.0}


def test_pipeline_parallel_uses_only_last_stage_loss(tmp_path: Path) -> None:
    agg = CrossRankAggregator(tmp_path / "agg", timeout=1e9)
    agg.ready = True
    agg.expected = {0, 1, 2, 3}
    agg.note_pipeline(PipelineLine(2))
    for rank, value in enumerate([99.0, 98.0, 2.0, 4.0]):
        agg.observe(rank, step(1, value), now=0)
    agg.flush()
    agg.close()
    shown = scalars(tmp_path / "agg")
    assert shown["loss/mean"] == {1: 3.0} and shown["iteration-time/mean"] == {1: 500.0}


def test_loss_ranks_override(tmp_path: Path) -> None:
    agg = CrossRankAggregator(tmp_path / "agg", timeout=1e9, loss_ranks={0})
    agg.ready = True
    agg.expected = {0, 1}
    agg.note_pipeline(PipelineLine(2))
    for rank, value in enumerate([1.0, 5.0]):
        agg.observe(rank, step(1, value), now=0)
    agg.flush()
    agg.close()
    assert scalars(tmp_path / "agg")["loss/mean"] == {1: 1.0}


def test_non_last_stage_without_loss_does_not_block(tmp_path: Path) -> None:
    agg = CrossRankAggregator(tmp_path / "agg", timeout=1e9)
    agg.ready = True
    agg.observe(0, step(1, None), now=0)
    agg.observe(1, step(1, 2.5), now=0)
    agg.observe(0, step(2, None), now=0)
    agg.observe(1, step(2, 2.5), now=0)
    agg.close()
    assert scalars(tmp_path / "agg")["loss/mean"] == {1: 2.5, 2: 2.5}


def test_a_nan_rank_makes_the_mean_nan_not_hidden(tmp_path: Path) -> None:
    agg = CrossRankAggregator(tmp_path / "agg", timeout=1e9)
    agg.ready = True
    agg.observe(0, step(1, math.nan), now=0)
    agg.observe(1, step(1, 2.0), now=0)
    agg.flush()
    agg.close()
    shown = scalars(tmp_path / "agg")
    assert math.isnan(shown["loss/mean"][1]) and shown["loss/min"][1] == 2.0


def test_resume_supersedes_the_aggregate(tmp_path: Path) -> None:
    agg = CrossRankAggregator(tmp_path / "agg", timeout=1e9)
    agg.ready = True
    for s in (1, 2, 3):
        for rank in (0, 1):
            agg.observe(rank, step(s, float(s)), now=0)
    agg.observe(0, step(2, 20.0, wall=5000), now=0, resumed=True)
    agg.observe(1, step(2, 20.0, wall=5000), now=0, resumed=True)
    agg.observe(0, step(3, 30.0, wall=5000), now=0)
    agg.observe(1, step(3, 30.0, wall=5000), now=0)
    agg.flush()
    agg.close()
    assert scalars(tmp_path / "agg")["loss/mean"] == {1: 1.0, 2: 20.0, 3: 30.0}
