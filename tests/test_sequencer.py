"""Unit tests of :class:`sidecar.analysis.sequencer.RankSequencer`: one per row of its verdict table.

Records are judged by position in their chain and by identity; timestamps going back never
change a verdict (the end-to-end cases are in ``test_clock_and_order.py``).
"""

from __future__ import annotations

from parsers.identity import WINDOW, record_identity
from parsers.records import Record
from sidecar.analysis.sequencer import RankSequencer, Verdict
from sidecar.following.chains import ChainCursor

T0 = 1_800_000_000.0


def rec(step: int, wall: float | None = None, loss: float | None = None) -> Record:
    wall = T0 + step if wall is None else wall
    return Record(step, wall, {"loss": float(step) if loss is None else loss}, training_step=True)


def judge_all(seq: RankSequencer, cursor: ChainCursor, records: list[Record]) -> list[Verdict]:
    return [seq.judge(r, cursor) for r in records]


def test_a_chain_in_position_order_is_new_whatever_its_clock() -> None:
    seq, chain = RankSequencer(), ChainCursor()
    walls = [T0, T0 + 1, T0 - 3600, T0 - 3599, T0 - 7200]  # summer time ends, NTP steps back
    verdicts = judge_all(seq, chain, [rec(s + 1, wall) for s, wall in enumerate(walls)])
    assert verdicts == [Verdict.NEW] * 5
    assert seq.last_step == 5


def test_a_step_that_goes_back_or_repeats_in_its_chain_is_a_resume_even_with_an_older_clock() -> None:
    seq, chain = RankSequencer(), ChainCursor()
    judge_all(seq, chain, [rec(s) for s in range(1, 11)])
    assert seq.judge(rec(6, T0 - 20, loss=6.5), chain) is Verdict.RESUME
    assert seq.judge(rec(7, T0 - 19, loss=7.5), chain) is Verdict.NEW
    assert seq.judge(rec(7, T0 - 10, loss=7.75), chain) is Verdict.RESUME  # the same step again


def test_a_copy_in_another_chain_is_a_duplicate_and_a_copy_of_a_dead_segment_is_superseded() -> None:
    seq, info = RankSequencer(), ChainCursor()
    first = [rec(s) for s in range(1, 11)]
    second = [rec(s, T0 + 100 + s, loss=s + 0.5) for s in range(6, 13)]
    judge_all(seq, info, first + second)
    worker = ChainCursor()
    verdicts = judge_all(seq, worker, first + second)
    assert verdicts == [Verdict.DUPLICATE] * 5 + [Verdict.SUPERSEDED] * 5 + [Verdict.DUPLICATE] * 7
    assert worker.live  # its latest record belongs to the shown segment: attached records count


def test_a_lagging_copy_of_a_dead_segment_beyond_the_last_step_is_not_new() -> None:
    """info.log went back from 20 to 10 and reached 12; worker_N.log, read later, still holds
    the dead segment's 13-20, which are above the last step but were superseded."""
    seq, info, worker = RankSequencer(), ChainCursor(), ChainCursor()
    old = [rec(s) for s in range(1, 21)]
    new = [rec(s, T0 + 100 + s, loss=s + 0.5) for s in range(10, 13)]
    judge_all(seq, info, old + new)
    verdicts = judge_all(seq, worker, old + new)
    assert verdicts == [Verdict.DUPLICATE] * 9 + [Verdict.SUPERSEDED] * 11 + [Verdict.DUPLICATE] * 3
    assert seq.last_step == 12


def test_a_new_chain_that_continues_from_an_earlier_step_is_a_resume_unless_the_run_holds_its_record() -> None:
    asked = []

    def holds(key: tuple) -> bool:
        asked.append(key)
        return key == record_identity(rec(3))

    seq = RankSequencer(holds=holds)
    judge_all(seq, ChainCursor(), [rec(s) for s in range(1, 11)])
    seq._seen.clear()  # as after a restart: only the run on disk knows the old records
    assert seq.judge(rec(3), ChainCursor()) is Verdict.DUPLICATE  # a re-read of what the run holds
    attempt = ChainCursor()
    assert seq.judge(rec(8, T0 + 500, loss=8.5), attempt) is Verdict.RESUME  # another attempt
    assert seq.judge(rec(9, T0 + 501, loss=9.5), attempt) is Verdict.NEW
    assert len(asked) == 2, "the run is asked once per new chain"


def test_a_known_chain_re_reading_past_the_window_is_a_duplicate() -> None:
    seq, chain = RankSequencer(), ChainCursor()
    judge_all(seq, chain, [rec(s) for s in range(1, WINDOW + 101)])
    restarted = ChainCursor(prev_step=50)  # restored from a checkpoint at step 50
    assert judge_all(seq, restarted, [rec(51), rec(52)]) == [Verdict.DUPLICATE] * 2


def test_identity_uses_the_loss_as_written_in_float32() -> None:
    assert record_identity(rec(1, loss=0.1)) == record_identity(rec(1, loss=0.10000000149011612))
    assert record_identity(rec(1, loss=0.1)) != record_identity(rec(1, loss=0.1001))


def test_a_step_that_goes_back_to_a_record_the_run_holds_is_a_copy_not_a_resume() -> None:
    """A copytruncate copy of what was read before a restart: the window is empty, the chain
    goes back, and the run on disk says the record is already there."""
    held = {record_identity(rec(s)) for s in range(1, 4)}
    seq = RankSequencer(last_step=3, holds=held.__contains__)
    chain = ChainCursor(prev_step=3)
    assert judge_all(seq, chain, [rec(1), rec(2), rec(3)]) == [Verdict.DUPLICATE] * 3
    assert seq.judge(rec(4), chain) is Verdict.NEW
    assert seq.judge(rec(2, T0 + 50, loss=2.5), chain) is Verdict.RESUME  # a real resume still is one
