"""The cross-rank aggregate: completion rule (no cap), pipeline-parallel loss validity across nodes, timeouts and
steps written without a rank, resumes while ranks are apart, NaN, snapshot/restore through the state file."""

from __future__ import annotations

import math
from pathlib import Path

from parsers.records import ParallelConfigLine, PipelineLine, Record
from sidecar.analysis.aggregate import CrossRankAggregator
from sidecar.output.state import State, StateStore
from tb_read import all_events, raw_points, same_float32, scalars, texts


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
    agg.expected = {0, 1}
    agg.observe(0, step(1, None), now=0)
    agg.observe(1, step(1, 2.5), now=0)
    agg.observe(0, step(2, None), now=0)
    agg.observe(1, step(2, 2.5), now=0)
    agg.close()
    assert scalars(tmp_path / "agg")["loss/mean"] == {1: 2.5, 2: 2.5}


def test_a_nan_rank_makes_the_mean_nan_not_hidden(tmp_path: Path) -> None:
    agg = CrossRankAggregator(tmp_path / "agg", timeout=1e9)
    agg.ready = True
    agg.expected = {0, 1}
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


# -- exactness (issue 9, item 3) ----------------------------------------------------------------
def loss_of(rank: int, step: int, segment: int = 0) -> Record:
    """A loss that names rank, step and segment exactly in float32 (the mean of two is exact too)."""
    return Record(step, 1000.0 + step + 10_000 * segment, {"loss": rank * 100_000.0 + step + 0.25 * segment},
                  training_step=True)


def two_ranks(path: Path, timeout: float = float("inf")) -> CrossRankAggregator:
    agg = CrossRankAggregator(path, timeout=timeout)
    agg.ready = True
    agg.expected = {0, 1}
    return agg


def test_no_cap_one_rank_20k_steps_ahead_still_averages_both(tmp_path: Path) -> None:
    """60k steps, rank 0 read 20k steps ahead of rank 1 throughout: every step waits for both."""
    agg = two_ranks(tmp_path / "agg")
    for s in range(1, 20_001):
        agg.observe(0, loss_of(0, s), now=0)
    peak = 0
    for s in range(1, 40_001):
        agg.observe(0, loss_of(0, s + 20_000), now=0)
        agg.observe(1, loss_of(1, s), now=0)
        peak = max(peak, agg.pending_steps())
    for s in range(40_001, 60_001):
        agg.observe(1, loss_of(1, s), now=0)
    assert peak == 20_000 and agg.pending_steps() == 0
    agg.flush()
    agg.close()
    assert agg.incomplete_steps == 0
    shown = scalars(tmp_path / "agg")
    assert shown["loss/mean"] == {s: 50_000.0 + s for s in range(1, 60_001)}
    assert shown["loss/spread"] == {s: 100_000.0 for s in range(1, 60_001)}


def test_live_timeout_counts_steps_written_without_a_rank_and_names_it(tmp_path: Path, caplog) -> None:
    """Live, a dead rank is left out after the timeout: counted, and one warning naming it (not one per step)."""
    agg = CrossRankAggregator(tmp_path / "agg", timeout=5)
    agg.ready = True
    agg.expected = {0, 1, 2}
    for s in range(1, 101):
        agg.observe(0, loss_of(0, s), now=0)
        agg.observe(1, loss_of(1, s), now=0)
    agg.flush_due(now=4)
    assert agg.waiting_for() == {2} and agg.pending_steps() == 100
    agg.flush_due(now=5)
    agg.close()
    assert agg.incomplete_steps == 100 and agg.pending_steps() == 0
    warnings = [r.getMessage() for r in caplog.records if "written without rank" in r.getMessage()]
    assert len(warnings) == 1 and "without rank(s) 2 (no report within 5 s)" in warnings[0]
    assert scalars(tmp_path / "agg")["loss/mean"] == {s: 50_000.0 + s for s in range(1, 101)}


def test_end_of_replay_counts_the_steps_a_finished_rank_never_reported(tmp_path: Path, caplog) -> None:
    agg = two_ranks(tmp_path / "agg")
    for s in range(1, 11):
        agg.observe(0, loss_of(0, s), now=0)
    for s in range(1, 8):
        agg.observe(1, loss_of(1, s), now=0)
    agg.flush()
    agg.close()
    assert agg.incomplete_steps == 3
    assert any("step 8 written without rank(s) 1 (the input ended" in r.getMessage() for r in caplog.records)
    mean = scalars(tmp_path / "agg")["loss/mean"]
    assert mean == {**{s: 50_000.0 + s for s in range(1, 8)}, 8: 8.0, 9: 9.0, 10: 10.0}


def _feed(agg: CrossRankAggregator, events: list[tuple[int, Record, bool]]) -> None:
    for rank, record, resumed in events:
        agg.observe(rank, record, now=0, resumed=resumed)


def _apart() -> list[tuple[int, Record, bool]]:
    """Rank 0 read 50 steps ahead of rank 1; rank 0's step 75 and rank 1's step 75 have a NaN loss."""
    nan = Record(75, 1075.0, {"loss": math.nan}, training_step=True)
    events = [(0, nan if s == 75 else loss_of(0, s), False) for s in range(1, 51)]
    for s in range(1, 51):
        events += [(0, nan if s + 50 == 75 else loss_of(0, s + 50), False), (1, loss_of(1, s), False)]
    return events + [(1, nan if s == 75 else loss_of(1, s), False) for s in range(51, 101)]


def _same(a: dict[str, dict[int, float]], b: dict[str, dict[int, float]]) -> bool:
    return a.keys() == b.keys() and all(
        a[t].keys() == b[t].keys() and all(same_float32(a[t][s], b[t][s]) for s in a[t]) for t in a
    )


def _with_a_restart(tmp_path: Path, events: list[tuple[int, Record, bool]], cut: int) -> tuple[int, CrossRankAggregator]:
    """``events`` into run ``whole`` in one go, and into run ``restarted`` with a checkpoint and a
    restart after the first ``cut``: the steps waiting at the restart, and the restarted aggregator."""
    whole = two_ranks(tmp_path / "whole")
    _feed(whole, events)
    whole.flush()
    whole.close()
    first = two_ranks(tmp_path / "restarted")
    _feed(first, events[:cut])
    store = StateStore(tmp_path / "out", "test")
    store.save(State(aggregate=first.snapshot()))
    first.close()
    second = two_ranks(tmp_path / "restarted")
    restored = store.load().aggregate
    assert restored is not None
    second.restore(restored)
    waiting = second.pending_steps()
    _feed(second, events[cut:])
    second.flush()
    second.close()
    return waiting, second


def test_snapshot_restore_mid_way_gives_the_points_of_an_uninterrupted_run(tmp_path: Path) -> None:
    """Restart while rank 1 is 50 steps behind: the 50 waiting steps (a NaN among them) come through the
    state file and are still averaged over both ranks, exactly as without the restart."""
    events = _apart()
    cut = 75  # rank 0 at step 88, rank 1 at 38: steps 38-88 wait
    waiting, second = _with_a_restart(tmp_path, events, cut)
    assert waiting == 51
    assert _same(scalars(tmp_path / "restarted"), scalars(tmp_path / "whole"))
    assert second.incomplete_steps == 0
    assert scalars(tmp_path / "restarted")["loss/mean"][60] == 50_060.0

    control = two_ranks(tmp_path / "no-snapshot")  # what a restart without it wrote: one rank's mean
    _feed(control, events[cut:])
    control.flush()
    control.close()
    assert scalars(tmp_path / "no-snapshot")["loss/mean"][60] == 100_060.0


def test_a_restored_step_takes_its_lowest_ranks_wall_time_when_that_rank_reports_after_the_restart(
        tmp_path: Path) -> None:
    """Steps waiting at the restart with rank 1's values only: rank 0's reports after it give them
    rank 0's wall time, as without the restart (a step's wall time is its lowest rank's)."""
    def record(rank: int, step: int) -> Record:
        return Record(step, 1000.0 + step + 60.0 * rank, {"loss": float(100 * rank + step)}, training_step=True)

    events = [(1, record(1, s), False) for s in range(1, 11)] + [(0, record(0, s), False) for s in range(1, 11)]
    assert _with_a_restart(tmp_path, events, 10)[0] == 10
    runs = all_events(tmp_path)
    assert runs["restarted"] == runs["whole"]
    assert {wall for _, _, _, wall in runs["restarted"]} == {1000.0 + s for s in range(1, 11)}


def test_restored_steps_wait_a_fresh_timeout_live(tmp_path: Path) -> None:
    """The missing rank's lines may be in its file, unread while the sidecar was down: a restored step
    is written without it only ``timeout`` seconds after the restart, not at once."""
    agg = CrossRankAggregator(tmp_path / "agg", timeout=5)
    agg.ready = True
    agg.expected = {0, 1}
    agg.observe(0, loss_of(0, 1), now=0)
    snapshot = agg.snapshot()
    agg.close()
    again = CrossRankAggregator(tmp_path / "agg", timeout=5)
    again.ready = True
    again.expected = {0, 1}
    again.restore(snapshot)
    again.flush_due(now=1000)
    again.flush_due(now=1004)
    assert again.pending_steps() == 1
    again.flush_due(now=1005)
    again.close()
    assert again.pending_steps() == 0 and again.incomplete_steps == 1
    assert scalars(tmp_path / "agg")["loss/mean"] == {1: 1.0}


def test_a_reread_of_an_emitted_step_after_restart_starts_no_step(tmp_path: Path) -> None:
    """A re-read after a restart (or a rank later than the timeout) for a step already written must not
    create a one-rank step that then counts as complete; later steps are still averaged over both."""
    agg = two_ranks(tmp_path / "agg")
    for s in range(1, 11):
        agg.observe(0, loss_of(0, s), now=0)
        agg.observe(1, loss_of(1, s), now=0)
    snapshot = agg.snapshot()
    agg.close()
    again = two_ranks(tmp_path / "agg")
    again.restore(snapshot)
    for s in range(5, 11):
        again.observe(0, loss_of(0, s), now=0)
    assert again.pending_steps() == 0 and again.snapshot().pending == []
    again.observe(0, loss_of(0, 11), now=0)
    again.observe(1, loss_of(1, 11), now=0)
    again.close()
    assert scalars(tmp_path / "agg")["loss/mean"] == {s: 50_000.0 + s for s in range(1, 12)}
    assert max(raw_points(tmp_path / "agg").values()) == 1


def test_resume_while_ranks_are_apart_waits_for_every_rank_to_go_back(tmp_path: Path) -> None:
    """Rank 0 resumes at 50 while rank 1 still reads its old segment (70-100): those old records are
    superseded; the new segment's 50-100 are averaged over both ranks' new values."""
    agg = two_ranks(tmp_path / "agg")
    events = [(r, loss_of(r, s), False) for s in range(1, 70) for r in (0, 1)]
    events += [(0, loss_of(0, s), False) for s in range(70, 101)]
    events += [(0, loss_of(0, 50, segment=1), True)]
    events += [(0, loss_of(0, s, segment=1), False) for s in range(51, 81)]
    events += [(1, loss_of(1, s), False) for s in range(70, 101)]
    events += [(1, loss_of(1, 50, segment=1), True)]
    events += [(1, loss_of(1, s, segment=1), False) for s in range(51, 101)]
    events += [(0, loss_of(0, s, segment=1), False) for s in range(81, 101)]
    _feed(agg, events)
    assert agg.pending_steps() == 0
    agg.close()
    mean = scalars(tmp_path / "agg")["loss/mean"]
    assert mean == {**{s: 50_000.0 + s for s in range(1, 50)}, **{s: 50_000.25 + s for s in range(50, 101)}}
    assert texts(tmp_path / "agg")["events/resume"].keys() == {50}


# -- pipeline parallel across nodes -------------------------------------------------------------
def _node(path: Path, ranks: range, parallel: list[ParallelConfigLine]) -> CrossRankAggregator:
    agg = CrossRankAggregator(path, timeout=1e9)
    agg.ready = True
    agg.expected = set(ranks)
    for line in parallel:
        agg.note_parallel(line)
    agg.note_pipeline(PipelineLine(2))
    for s in (1, 2):
        for rank in ranks:
            agg.observe(rank, step(s, float(rank), ms=100.0 + rank), now=0)
    agg.close()
    return agg


def test_pipeline_node0_of_two_has_no_valid_loss_and_writes_none(tmp_path: Path, caplog) -> None:
    """World 16, 2 stages: the last stage is ranks 8-15, all on node 1. Node 0 (ranks 0-7) writes no
    loss/* at all (not the mean of its upper half, which is stage 0) and says so once."""
    _node(tmp_path / "node0", range(8), [ParallelConfigLine(16, derived=True)])
    shown = scalars(tmp_path / "node0")
    assert not [t for t in shown if t.startswith("loss/")]
    assert shown["iteration-time/mean"] == {1: 103.5, 2: 103.5}
    said = [r.getMessage() for r in caplog.records if "no loss/* written" in r.getMessage()]
    assert len(said) == 1 and "rank(s) 8-15" in said[0]

    _node(tmp_path / "node1", range(8, 16), [ParallelConfigLine(16, derived=True)])
    assert scalars(tmp_path / "node1")["loss/mean"] == {1: 11.5, 2: 11.5}


def test_a_stated_device_num_wins_over_the_derived_world_size(tmp_path: Path) -> None:
    """The parallel_config dict is the yaml's (data-parallel mode resets it); a device_num line is the run's."""
    agg = _node(tmp_path / "agg", range(8), [ParallelConfigLine(8), ParallelConfigLine(16, derived=True)])
    assert agg.valid_loss_ranks() == {4, 5, 6, 7}
    assert scalars(tmp_path / "agg")["loss/mean"] == {1: 5.5, 2: 5.5}


def test_without_a_logged_world_size_the_highest_rank_is_used_and_said_once(tmp_path: Path, caplog) -> None:
    agg = _node(tmp_path / "agg", range(8), [])
    assert agg.valid_loss_ranks() == {4, 5, 6, 7}
    assert sum("states no world size" in r.getMessage() for r in caplog.records) == 1


def test_a_logged_world_size_below_the_ranks_seen_is_not_used(tmp_path: Path, caplog) -> None:
    """r0.6-r0.8 print RANK_SIZE as device_num, which is 1 under msrun without it."""
    agg = _node(tmp_path / "agg", range(8), [ParallelConfigLine(1)])
    assert agg.valid_loss_ranks() == {4, 5, 6, 7}
    assert any("logged world size 1 is below the ranks seen" in r.getMessage() for r in caplog.records)


def test_a_step_is_the_same_whichever_rank_is_read_first(tmp_path: Path) -> None:
    """Its wall time is its lowest rank's, ties for the slowest rank go to the lower rank, the mean
    is exact: one engine reading the ranks in any order, or replay workers relaying them, agree."""
    shown = []
    for order in ([0, 1, 2], [2, 1, 0], [1, 2, 0]):
        out = tmp_path / "".join(map(str, order))
        agg = CrossRankAggregator(out / "agg", timeout=1e9)
        agg.ready, agg.expected = True, {0, 1, 2}
        for rank in order:
            agg.observe(rank, Record(1, 1000.0 + rank, {"loss": [0.1, 0.2, 0.3][rank], "iteration-time": 700.0},
                                     training_step=True), now=0)
        agg.close()
        shown.append(all_events(out))
    assert shown[0] == shown[1] == shown[2]
    by_tag = {tag: (value, wall) for tag, _, value, wall in shown[0]["agg"]}
    assert by_tag["iteration-time/slowest-rank"] == (0.0, 1000.0)  # all three at 700 ms: rank 0
    assert same_float32(by_tag["loss/mean"][0], (0.1 + 0.2 + 0.3) / 3)
