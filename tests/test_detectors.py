"""The detectors' judgement, on records as the engine hands them over (no files, no clocks)."""

from __future__ import annotations

import json
import math

import pytest

from parsers import tags
from parsers.assembler import ERROR_TAG
from parsers.records import Record
from sidecar.analysis.alerts import Alert, Alerts, WatchState
from sidecar.analysis.detectors import AlertSettings


def watch(settings: AlertSettings | None = None, live: bool = False) -> tuple[Alerts, list[Alert]]:
    alerts = Alerts(settings, live)
    seen: list[Alert] = []
    alerts.sinks.append(seen.append)
    return alerts, seen


def step(n: int, **scalars: float) -> Record:
    values = {tags.LOSS: 2.0 + 0.01 * (n % 3), tags.THROUGHPUT: 100.0 + n % 2}
    values.update({k.replace("_", "-"): v for k, v in scalars.items()})
    return Record(n, None, values, training_step=True)


def names(seen: list[Alert]) -> list[tuple[str, int | None, int, bool]]:
    return [(a.name, a.rank, a.step, a.resolved) for a in seen]


def test_one_alert_per_episode_however_long_it_lasts() -> None:
    alerts, seen = watch()
    for n in range(1, 301):
        nan = 100 <= n < 200  # a NaN loss for 100 steps
        alerts.observe(0, step(n, loss=math.nan if nan else 2.0), 0.0)
    assert names(seen) == [("nan-loss", 0, 100, False), ("nan-loss", 0, 200, True)]
    assert alerts.counts[(0, "nan-loss")] == 1


def test_tiny_losses_and_warmup_do_not_alarm_but_a_real_spike_does() -> None:
    alerts, seen = watch()
    alerts.observe(0, step(1, loss=7.0), 0.0)  # the start of training is high: warm-up
    for n in range(2, 200):
        alerts.observe(0, step(n, loss=0.010 + 0.0001 * (n % 4)), 0.0)
    alerts.observe(0, step(200, loss=0.013), 0.0)  # 30% up, but 0.003 in absolute terms
    assert seen == []
    alerts.observe(0, step(201, loss=0.5), 0.0)
    assert names(seen) == [("loss-spike", 0, 201, False)]
    assert seen[0].threshold == pytest.approx(0.21015)  # the absolute floor (median 0.01015 + 0.2) decides


def test_a_loss_that_jumped_and_stayed_up_stays_alerted() -> None:
    alerts, seen = watch()
    for n in range(1, 400):
        alerts.observe(0, step(n, loss=2.0 if n < 100 else 6.0), 0.0)
    assert names(seen) == [("loss-spike", 0, 100, False)]


def test_a_throughput_drop_names_the_checkpoint_save_that_explains_it() -> None:
    alerts, seen = watch()
    for n in range(1, 60):
        alerts.observe(0, step(n), 0.0)
    alerts.observe(0, Record(59, None, {tags.CHECKPOINT_SAVE_TIME: 12.0}, {tags.TEXT_CHECKPOINT: "saved"}), 0.0)
    alerts.observe(0, step(60, throughput=20.0), 0.0)
    alerts.observe(0, step(61), 0.0)
    assert seen == []  # one slow step is noise
    for n in range(62, 67):
        alerts.observe(0, step(n, throughput=20.0), 0.0)
    assert names(seen) == [("throughput-drop", 0, 64, False)]  # the third low step in a row
    assert "80% below its recent median; a checkpoint was saved at step 59" in seen[0].detail
    for n in range(67, 70):
        alerts.observe(0, step(n), 0.0)
    assert names(seen)[-1] == ("throughput-drop", 0, 69, True)  # three normal steps end it


def test_overflow_streak_and_its_end() -> None:
    alerts, seen = watch()
    for n in range(1, 40):
        record = step(n)
        record.overflow = 10 <= n < 25
        alerts.observe(3, record, 0.0)
    assert names(seen) == [("overflow", 3, 19, False), ("overflow", 3, 25, True)]


def test_ranks_that_disagree_for_long_enough_diverge() -> None:
    alerts, seen = watch(AlertSettings(divergence={"steps": 10, "rel": 0.3}))
    for n in range(1, 60):
        alerts.observe(0, step(n, loss=2.0), 0.0)
        apart = 20 <= n < 29 or 40 <= n < 55  # 9 steps apart: noise; 15 steps: divergence
        alerts.observe(1, step(n, loss=4.0 if apart else 2.1), 0.0)
    diverged = [a for a in seen if a.name == "divergence"]  # rank 1 also spiked, on its own
    assert names(diverged) == [("divergence", None, 49, False)]  # agreed from step 55: 10 such steps end it
    for n in range(60, 70):
        alerts.observe(0, step(n, loss=2.0), 0.0)
        alerts.observe(1, step(n, loss=2.1), 0.0)
    assert names(seen)[-1] == ("divergence", None, 64, True)
    assert len([a for a in seen if a.name == "divergence"]) == 2


def test_pipeline_stages_without_a_valid_loss_are_not_compared() -> None:
    alerts, seen = watch()
    for n in range(1, 40):
        alerts.observe(0, step(n, loss=0.0), 0.0, loss_ranks={1})  # a non-last stage prints no real loss
        alerts.observe(1, step(n, loss=2.0), 0.0, loss_ranks={1})
    assert seen == []


def test_a_rank_that_ends_early_is_behind_at_the_end_of_a_replay() -> None:
    alerts, seen = watch(AlertSettings(rank_behind={"steps": 50}))
    for n in range(1, 301):
        alerts.observe(0, step(n), 0.0)
        if n <= 200:
            alerts.observe(1, step(n), 0.0)
    alerts.check_behind()
    assert names(seen) == [("rank-behind", 1, 200, False)]
    assert "100 steps behind the furthest rank (step 300)" in seen[0].detail


def test_a_rank_behind_while_live_is_one_alert_and_resolved_once_it_catches_up() -> None:
    alerts, seen = watch(AlertSettings(rank_behind={"steps": 50}), live=True)
    for n in range(1, 301):
        alerts.observe(0, step(n), 0.0)
        alerts.observe(1, step(min(n, 200)), 0.0)  # rank 1 waits at step 200 (a slow collective)
        alerts.check_behind()  # every live round that caught up with the files
    assert names(seen) == [("rank-behind", 1, 200, False)]
    for n in range(201, 301):
        alerts.observe(1, step(n), 0.0)
        alerts.check_behind()
    assert names(seen) == [("rank-behind", 1, 200, False), ("rank-behind", 1, 250, True)]


def test_stall_uses_the_logged_step_time_and_a_floor() -> None:
    alerts, seen = watch(AlertSettings(stall={"factor": 10, "min_seconds": 5}), live=True)
    for n in range(1, 20):
        alerts.observe(0, step(n, iteration_time=2000.0), float(n))  # 2 s per step, as the log says
    assert alerts.next_check(19.0) == 5.0  # the floor first: no median is taken before it can matter
    assert alerts.next_check(24.5) == 14.5  # then 10 x 2 s after the last step
    alerts.check_stalls(38.9)
    assert seen == []
    alerts.check_stalls(39.1)
    alerts.check_stalls(50.0)
    assert names(seen) == [("stall", 0, 19, False)]
    alerts.observe(0, step(20, iteration_time=2000.0), 51.0)
    assert names(seen)[-1] == ("stall", 0, 20, True)
    replayed, quiet = watch()
    replayed.observe(0, step(1), 0.0)
    replayed.check_stalls(1e9)
    assert quiet == []  # a replay knows nothing of waiting


def test_divergence_waits_for_every_rank_known_not_just_those_seen() -> None:
    """Ranks 0 and 1 agree; rank 2, read later, does not. Judged over the ranks seen so far, the
    first steps would pass; judged over the ranks known, every step diverges, in any read order."""
    alerts, seen = watch(AlertSettings(divergence={"steps": 5}))
    known = {0, 1, 2}
    for n in range(1, 11):
        alerts.observe(0, step(n, loss=2.0), 0.0, known)
        alerts.observe(1, step(n, loss=2.0), 0.0, known)
    assert not [a for a in seen if a.name == "divergence"]
    for n in range(1, 11):
        alerts.observe(2, step(n, loss=9.0), 0.0, known)
    assert names([a for a in seen if a.name == "divergence"]) == [("divergence", None, 5, False)]


def test_a_finish_or_a_death_ends_a_stall_and_no_stall_follows_until_a_step() -> None:
    from parsers.assembler import ERROR_TAG
    from sidecar.analysis.alerts import LifecycleChange

    settings = AlertSettings.model_validate({"stall": {"min_seconds": 10}})
    alerts, seen = watch(settings, live=True)
    changes: list[LifecycleChange] = []
    alerts.lifecycle_sinks.append(changes.append)
    for n in range(1, 6):
        alerts.observe(0, step(n), float(n))
    alerts.check_stalls(20.0)
    assert names(seen) == [("stall", 0, 5, False)]
    alerts.observe(0, Record(5, None, texts={"events/training-over": "Training Over!"}), 21.0)
    assert names(seen)[1:] == [("stall", 0, 5, True)] and seen[1].detail == "the training finished"
    alerts.check_stalls(1000.0)
    assert alerts.next_check(1000.0) is None and len(seen) == 2
    alerts.observe(0, step(6), 1001.0)  # runs again: watched again
    alerts.check_stalls(1012.0)
    assert names(seen)[2:] == [("stall", 0, 6, False)]
    alerts.observe(0, Record(6, None, texts={ERROR_TAG: "Traceback (most recent call last):"}), 1013.0)
    assert names(seen)[3:] == [("stall", 0, 6, True), ("error", 0, 6, False)]
    alerts.check_stalls(5000.0)
    assert len(seen) == 5
    assert [(c.state.value, c.step) for c in changes] == [("finished", 5), ("running", 6), ("failed", 6)]


def test_a_restored_episode_is_not_raised_again_and_ends_once() -> None:
    alerts, _ = watch(live=True)
    for n in range(1, 11):
        alerts.observe(0, step(n, loss=math.nan if n > 5 else 2.0), float(n))
    saved = alerts.snapshot(0)
    assert saved is not None and saved.firing == ["nan-loss"] and saved.last_step == 10
    again, seen = watch(live=True)
    again.restore(0, saved, 100.0)
    for n in range(11, 16):
        again.observe(0, step(n, loss=math.nan), 100.0 + n)
    assert names(seen) == []
    again.observe(0, step(16, loss=2.0), 120.0)
    assert names(seen) == [("nan-loss", 0, 16, True)]


def test_every_detector_gives_numbers_as_numbers_and_a_unit_of_its_own() -> None:
    """Each kind of alert as ``--on-alert`` gets it: ``threshold`` a number (``None`` where a
    detector has none), a non-finite value as ``value_text``, the unit apart, valid strict JSON;
    the log line reads as before."""
    alerts, seen = watch(AlertSettings(stall={"factor": 10, "min_seconds": 5}, rank_behind={"steps": 10},
                                       divergence={"steps": 10, "rel": 0.3}), live=True)
    for n in range(1, 80):
        alerts.observe(0, step(n, loss=math.inf if n == 70 else 2.0, grad_norm=math.nan if n == 72 else 1.0,
                               throughput=20.0 if 70 <= n < 76 else 100.0, iteration_time=2000.0), float(n))
        if n <= 60:
            alerts.observe(1, step(n, loss=4.0 if 40 <= n < 55 else 2.1), float(n))
        record = step(n)
        record.overflow = 10 <= n < 25
        alerts.observe(2, record, float(n))
    alerts.observe(2, Record(80, None, texts={ERROR_TAG: "Traceback (most recent call last):"}), 80.0)
    alerts.check_behind()
    alerts.check_stalls(200.0)
    firing: dict[str, Alert] = {}
    for alert in seen:
        if not alert.resolved:
            firing.setdefault(alert.name, alert)
    assert sorted(firing) == ["divergence", "error", "loss-spike", "nan-grad-norm", "nan-loss", "overflow",
                              "rank-behind", "stall", "throughput-drop"]
    payloads = {name: json.loads(json.dumps(a.as_json(), allow_nan=False)) for name, a in firing.items()}
    for name, payload in payloads.items():
        none = name in ("nan-loss", "nan-grad-norm", "overflow", "error")
        assert (payload["threshold"] is None) == none, name
        assert isinstance(payload["threshold"], (int, float, type(None))), name
        assert payload["unit"] == ("s" if name == "stall" else None), name
        assert payload["message"] == firing[name].line()
    assert (payloads["nan-loss"]["value"], payloads["nan-loss"]["value_text"]) == (None, "inf")
    assert (payloads["nan-grad-norm"]["value"], payloads["nan-grad-norm"]["value_text"]) == (None, "nan")
    assert (payloads["rank-behind"]["value"], payloads["rank-behind"]["threshold"]) == (19, 10)
    assert payloads["throughput-drop"]["value"] == 20.0 and payloads["throughput-drop"]["value_text"] is None
    assert firing["stall"].line() == ("ALERT stall: rank 0, step 79: seconds since the last step = 121 "
                                      "(threshold 20 s); no new step; hung in a collective, or the worker died?")
    assert (payloads["stall"]["value"], payloads["stall"]["threshold"]) == (121, 20)
    assert firing["nan-loss"].line() == "ALERT nan-loss: rank 0, step 70: loss = inf; not a finite number"
    assert firing["rank-behind"].line() == ("ALERT rank-behind: rank 1, step 60: step = 19 (threshold 10); "
                                            "19 steps behind the furthest rank (step 79)")


def _history(n: int) -> list[tuple[int, Record]]:
    """Two ranks: a loss spike (rank 0, step 25), a throughput drop (rank 1, 60-63), overflow
    (rank 0, 40-52), and the ranks apart from step 70 (divergence after 10 steps)."""
    records = []
    for s in range(1, n + 1):
        loss0 = 9.0 if s == 25 else 2.0 + 0.01 * (s % 3)
        zero = step(s, loss=loss0 if s < 70 else 2.0, grad_norm=1.0 + 0.1 * (s % 4))
        zero.overflow = 40 <= s < 53
        one = step(s, loss=2.05 if s < 70 else 5.0, throughput=20.0 if 60 <= s < 64 else 100.0 + s % 3)
        records += [(0, zero), (1, one)]
    return records


@pytest.mark.parametrize("kill_at", [21, 24, 26, 45, 58, 62, 75])
def test_a_restart_judges_as_an_uninterrupted_run(kill_at: int) -> None:
    """Checkpointed at step ``kill_at - 3`` (the baselines through JSON, as the state file keeps
    them), killed at ``kill_at``, restarted: the steps written in between are judged again
    (``again``: written to the runs, paged no second time), the rest as new. What is paged before
    and after, and what reaches the runs, is what one uninterrupted run gives; before the
    baselines were kept, the spike at step 25 after a restart at step 24 was never raised."""
    settings = AlertSettings(divergence={"steps": 10})
    whole, paged = watch(settings)
    for rank, record in _history(90):
        whole.observe(rank, record, 0.0)

    first, first_paged = watch(settings)
    checkpoint = kill_at - 3
    saved: dict[int, WatchState] = {}
    for rank, record in _history(kill_at):
        if record.step > checkpoint and not saved:
            saved = {r: WatchState.model_validate_json(first.snapshot(r).model_dump_json()) for r in (-1, 0, 1)}
        first.observe(rank, record, 0.0)
    second, second_paged = watch(settings)
    written: list[Alert] = []
    second.writers.append(written.append)
    for r, state in saved.items():
        second.restore(r, state, 0.0)
    for rank, record in _history(90):
        if record.step > checkpoint:
            second.observe(rank, record, 0.0, again=record.step <= kill_at)
    assert names(first_paged + second_paged) == names(paged)
    assert [a for a in written if a.step > kill_at] == second_paged
    assert names([a for a in first_paged if a.step > checkpoint]) == names([a for a in written if a.step <= kill_at])


def test_the_baselines_of_a_thousand_ranks_are_small_to_keep() -> None:
    """Every detector of 1,024 ranks with full windows: the checkpoint's part stays small
    (float32 windows, base64). How long it takes is measured by bench/bench_checkpoint.py."""
    alerts, _ = watch()
    for rank in range(1024):
        for n in range(1, 121):
            alerts.observe(rank, step(n, loss=2.0 + 0.001 * n, grad_norm=1.0 + 0.001 * n), 0.0)
    text = "[" + ",".join(alerts.snapshot(rank).model_dump_json() for rank in range(1024)) + "]"
    assert len(text) < 2_000 * 1024, len(text)
    restored, _ = watch()
    restored.restore(7, WatchState.model_validate_json(alerts.snapshot(7).model_dump_json()), 0.0)
    assert list(restored.ranks[7].checks[0][2].values) == list(alerts.ranks[7].checks[0][2].values)


def test_a_loss_beyond_float32_is_not_a_finite_loss() -> None:
    """1e39 is finite as a double but inf in every event TensorBoard shows: the NaN/Inf alert
    judges the value as written."""
    alerts, seen = watch()
    for n in range(1, 30):
        alerts.observe(0, step(n, loss=1e39 if n == 20 else 2.0), 0.0)
    assert names(seen) == [("nan-loss", 0, 20, False), ("nan-loss", 0, 21, True)]
    assert seen[0].value == math.inf
