"""Chains (:mod:`sidecar.following.chains`): one rank's stream runs through a log and its rotated
backups, and chains are ordered by what their data says, not by their names.

The pieces directly (a stream holds a head until its bar, across files too; the first record a
chain holds, within the peek limit, with the start-up lines before it), and the ordering end to
end: an in-process replay of two attempts whose directory names sort the wrong way round.
"""

from __future__ import annotations

import math
from pathlib import Path

from engine_run import replay_in_process
from live_helpers import RankLog, loss_value
from sidecar.following import chains
from sidecar.following.chains import Chain, Stream, first_record, head_records
from sidecar.service.config import SidecarConfig
from tb_read import scalars

_PARALLEL = ("[INFO] 2026-11-29 09:59:00,000 [mindformers/core/parallel_config.py:62] build_parallel_config: "
             "initial parallel_config from dict: {'data_parallel': 2, 'model_parallel': 1, 'context_parallel': 1, "
             "'expert_parallel': 1, 'pipeline_stage': 1, 'micro_batch_num': 1, 'use_seq_parallel': False}\n")


def _lines(data: bytes) -> list[str]:
    return data.decode().splitlines()


def test_a_stream_holds_a_head_until_its_bar_across_files(tmp_path: Path) -> None:
    """A head at the end of ``info.log.1`` is completed by the bar at the start of ``info.log``:
    one stream runs through the chain, so the record comes out once, with the bar's throughput."""
    log = RankLog(tmp_path / "rank_0" / "info.log", 0)
    head, bar = _lines(log.record(7))
    stream = Chain("rank_0/info.log").stream(0, companion_wait=0.5)
    assert stream.feed(head, 0, 10.0, "info.log.1")[1] == []  # held: its bar is still to come
    assert stream.assembler.pending_origin == "info.log.1"  # a checkpoint must not pass it
    record, = stream.feed(bar, 0, 10.1, "info.log")[1]
    assert record.step == 7 and record.scalars["loss"] == loss_value(0, 7)
    assert "throughput" in record.scalars


def test_a_held_head_goes_after_its_companion_wait_and_a_bad_line_does_not_release_it(tmp_path: Path) -> None:
    log = RankLog(tmp_path / "rank_0" / "info.log", 0)
    head, _ = _lines(log.record(3))
    stream = Stream(companion_wait=0.5)
    assert stream.feed(head, 0, 10.0, None)[1] == []
    assert stream.feed("[INFO] 2026-11-29 10:00:00,010 [x.py:1] f: step:[ garbage", 100, 10.1, None)[1] == []
    assert stream.assembler.flush_due(10.4) == []
    record, = stream.assembler.flush_due(10.5)
    assert record.step == 3 and "throughput" not in record.scalars


def test_a_chain_keeps_one_stream_per_rank() -> None:
    chain = Chain("output/msrun_log/worker_0.log")
    assert chain.stream(0, 0.5) is chain.stream(0, 0.5)
    assert chain.stream(1, 0.5) is not chain.stream(0, 0.5)
    assert sorted(chain.streams) == [0, 1]


def test_first_record_is_the_first_training_step_of_the_oldest_file(tmp_path: Path) -> None:
    log = RankLog(tmp_path / "rank_0" / "info.log", 0)
    log.write(_PARALLEL.encode())
    log.step(5)
    log.shift()  # info.log.1: steps 1-5
    log.reopen()
    log.step(5)  # info.log: steps 6-10
    backup = log.path.with_name("info.log.1")
    startup: dict[int, list[dict[str, object]]] = {}
    step, stamp = first_record([backup, log.path], 0, None, startup)
    assert step == 1 and math.isfinite(stamp)
    assert first_record([log.path], 0, None)[0] == 6
    assert startup[0][0]["parallel_config"]["data_parallel"] == 2, startup
    assert [record.step for _, record in head_records([backup, log.path], 0, None)] == list(range(1, 11))


def test_first_record_is_none_without_a_step_or_past_the_peek(tmp_path: Path, monkeypatch) -> None:
    quiet = tmp_path / "rank_0" / "info.log"
    quiet.parent.mkdir(parents=True)
    quiet.write_text("[INFO] 2026-11-29 10:00:00,000 [x.py:1] f: loading the dataset\n" * 10)
    assert first_record([quiet], 0, None) is None
    assert first_record([tmp_path / "missing.log"], 0, None) is None  # unreadable: the engine reports it
    log = RankLog(tmp_path / "rank_1" / "info.log", 1)
    log.write(b"[INFO] 2026-11-29 10:00:00,000 [x.py:1] f: " + b"." * 2000 + b"\n")
    log.step(1)
    monkeypatch.setattr(chains, "PEEK_BYTES", 1000)  # the step lies past the look ahead
    assert first_record([log.path], 0, None) is None
    monkeypatch.setattr(chains, "PEEK_BYTES", 4000)
    assert first_record([log.path], 0, None)[0] == 1


def test_attempts_are_read_in_the_order_their_steps_say(tmp_path: Path) -> None:
    """``attempt_10`` sorts before ``attempt_9`` but resumed from it at step 6: a replay (in
    process) reads attempt 9 first, so TensorBoard shows steps 1-5 of attempt 9 and 6-10 of
    attempt 10, each once."""
    first = RankLog(tmp_path / "job" / "attempt_9" / "log" / "rank_0" / "info.log", 0)
    first.step(10)
    resumed = RankLog(tmp_path / "job" / "attempt_10" / "log" / "rank_0" / "info.log", 0,
                      start=first.clock.replace(hour=first.clock.hour + 1))
    resumed.go_back(6)
    resumed.step(5)
    config = SidecarConfig(out=tmp_path / "tb", paths=[tmp_path / "job"], instance="test", progress=False, quiet=True)
    replay_in_process(config)
    want = {s: loss_value(0, s, 0 if s < 6 else 1) for s in range(1, 11)}
    assert scalars(tmp_path / "tb" / "rank_0")["loss"] == want
