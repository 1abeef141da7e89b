"""Per-stream assembly: two-line records, epoch-end timing, global steps, attached records, held offsets."""

from __future__ import annotations

from parsers import tags
from parsers.assembler import StreamAssembler
from parsers.line import parse_message
from parsers.prefix import PrefixSplitter
from parsers.records import Record

HEAD = "{ Epoch:[  2/  3], step:[   %d/  100], loss: 2.5, per_step_time: 500ms, lr: 1e-05, overflow cond: False, loss_scale: 1.0"
BAR = "  12.0% |██████       | 6.81 samples/s/p  3:04:05 }"


def feed(asm: StreamAssembler, lines: list[str], now: float = 0.0) -> list[Record]:
    sp = PrefixSplitter()
    out: list[Record] = []
    for i, line in enumerate(lines):
        m = sp.split(line)
        out.extend(asm.feed(parse_message(m), m.timestamp, i * 100, now))
    return out


def test_head_is_held_until_its_bar_and_gets_the_throughput() -> None:
    asm = StreamAssembler()
    assert feed(asm, [HEAD % 5]) == []
    assert asm.pending_offset == 0
    (record,) = feed(asm, [BAR])
    assert asm.pending_offset is None
    assert record.step == 105 and record.training_step
    assert record.scalars[tags.THROUGHPUT] == 6.81 and record.scalars[tags.LOSS] == 2.5


def test_foreign_and_unrelated_lines_between_head_and_bar_do_not_break_the_join() -> None:
    asm = StreamAssembler()
    lines = [HEAD % 5, "[WARNING] ME(1:2,MainProcess):2025-01-01-00:00:00.000.000 [x.py:1] hello", "some info", BAR]
    (record,) = feed(asm, lines)
    assert tags.THROUGHPUT in record.scalars


def test_missing_bar_is_released_by_the_next_record_by_time_or_at_end() -> None:
    asm = StreamAssembler(companion_wait=0.5)
    records = feed(asm, [HEAD % 5, HEAD % 6])
    assert [r.step for r in records] == [105] and tags.THROUGHPUT not in records[0].scalars
    assert asm.flush_due(now=0.4) == []
    assert [r.step for r in asm.flush_due(now=0.6)] == [106]
    feed(asm, [HEAD % 7])
    assert [r.step for r in asm.flush()] == [107]


def test_r0x_sink_mode_takes_per_step_time_from_the_epoch_end_line() -> None:
    asm = StreamAssembler()
    step = "Epoch:[  1/  2], step:[   %d/  400], loss:[1.936/2.104], time:2210.478 ms, lr:[1e-05], overflow cond: False, loss_scale: 1.0"
    end = "Per sink_size step time: 2224.902 ms, per step time: 556.226 ms, avg loss: 1.936"
    records = feed(asm, [step % 4, end, step % 8, end])
    assert [(r.step, r.scalars[tags.ITERATION_TIME]) for r in records] == [(4, 556.226), (8, 556.226)]


def test_r0x_non_sink_mode_learns_there_is_no_epoch_end_and_stops_holding() -> None:
    asm = StreamAssembler()
    step = "Epoch:[  1/  2], step:[   %d/  400], loss:[1.936/2.104], time:%d.5 ms, lr:[1e-05], overflow cond: False, loss_scale: 1.0"
    assert feed(asm, [step % (1, 100)]) == []
    records = feed(asm, [step % (2, 200)])
    assert [r.step for r in records] == [1, 2]  # the second is no longer held
    epoch_avg = "Epoch time: 9999.000 ms, per step time: 99.990 ms, avg loss: 1.9"
    records = feed(asm, [step % (3, 300), epoch_avg])
    assert [(r.step, r.scalars[tags.ITERATION_TIME]) for r in records] == [(3, 300.5)]


def test_r02_zero_based_epochs() -> None:
    asm = StreamAssembler()
    records = feed(asm, ["Epoch:[  1/  3], step:[   40/  800], loss:[3.8/4.0], time:488.201 ms, lr:3.75e-05",
                         "Epoch:[  1/  3], step:[   41/  800], loss:[3.8/4.0], time:488.201 ms, lr:3.75e-05"])
    assert records[0].step == 840


def test_experimental_epoch_local_steps_continue_across_epochs() -> None:
    asm = StreamAssembler()
    line = "Epoch: %d, Step: %d, Loss: 1.0, Finite_grads: True, Loss_scale: 1.0, Learning_rate: 1e-05, Time: 1.0 ms"
    records = feed(asm, [line % (0, 1), line % (0, 2), line % (0, 3), line % (1, 1), line % (1, 2)])
    assert [r.step for r in records] == [1, 2, 3, 4, 5]


def test_eval_checkpoint_and_markers_attach_to_the_last_training_step() -> None:
    asm = StreamAssembler()
    records = feed(asm, [
        ".........Starting Training Model..........",
        HEAD % 5, BAR,
        "Eval result: {'PerplexityMetric': {'PPL': 6.5}}, eval time is 2.000000 s.",
        "Finish saving ckpt of epoch 2 step 105 using 3.500 seconds",
    ])
    assert [(r.step, r.training_step) for r in records] == [(0, False), (105, True), (105, False), (105, False)]
    assert records[0].texts == {"events/training-start": "Starting Training Model"}
    assert records[2].scalars == {"eval/PerplexityMetric/PPL": 6.5, tags.EVAL_TIME: 2.0}
    assert records[3].scalars == {tags.CHECKPOINT_SAVE_TIME: 3.5}
    assert "events/checkpoint" in records[3].texts


def test_eval_line_releases_a_head_whose_bar_never_came() -> None:
    asm = StreamAssembler()
    records = feed(asm, [HEAD % 5, "Eval result: {'M': {'a': 1.0}}, eval time is 1.0 s."])
    assert [(r.step, r.training_step) for r in records] == [(105, True), (105, False)]


def test_timestamps_come_from_lines_and_carry_over_to_unprefixed_ones() -> None:
    asm = StreamAssembler()
    records = feed(asm, [
        "2024-06-18 02:41:09,377 - mindformers - INFO - " + HEAD % 5,
        "2024-06-18 02:41:09,378 - mindformers - INFO - " + BAR,
        "{ step:[  200/  500], loss: 1.0, per_step_time: 1ms }",
    ])
    assert records[0].wall_time is not None
    assert records[1].wall_time == records[0].wall_time + 0.001


def test_snapshot_restores_step_numbering() -> None:
    asm = StreamAssembler()
    line = "Epoch: %d, Step: %d, Loss: 1.0, Finite_grads: True, Loss_scale: 1.0, Learning_rate: 1e-05, Time: 1.0 ms"
    feed(asm, [line % (0, 1), line % (0, 2), line % (1, 1)])
    fresh = StreamAssembler()
    fresh.restore(asm.snapshot())
    assert [r.step for r in feed(fresh, [line % (1, 2)])] == [4]


def test_an_experimental_count_running_past_int64_is_dropped_and_counted() -> None:
    asm = StreamAssembler()
    line = "Epoch: %d, Step: %d, Loss: 1.0, Finite_grads: True, Loss_scale: 1.0, Learning_rate: 1e-05, Time: 1.0 ms"
    top = (1 << 63) - 1  # fits, but the next epoch's count would continue past it
    records = feed(asm, [line % (0, top), line % (1, 1), line % (1, 2)])
    assert [r.step for r in records] == [top]
    assert asm.take_malformed() == 2 and asm.take_malformed() == 0



def test_a_bar_after_its_head_was_released_gives_the_step_its_throughput_late() -> None:
    asm = StreamAssembler(companion_wait=0.5)
    feed(asm, [HEAD % 5])
    (released,) = asm.flush_due(1.0)
    assert tags.THROUGHPUT not in released.scalars
    (late,) = feed(asm, [BAR])
    assert late.late and not late.training_step
    assert late.step == 105 and late.scalars == {tags.THROUGHPUT: 6.81}
    assert feed(asm, [BAR]) == []  # one bar per head


def test_the_open_head_survives_a_checkpoint_and_a_new_step_closes_it() -> None:
    asm = StreamAssembler()
    feed(asm, [HEAD % 5])
    asm.flush()  # a replay that ended between the head and its bar
    restored = StreamAssembler()
    restored.restore(asm.snapshot())
    (late,) = feed(restored, [BAR])
    assert late.late and late.step == 105 and late.scalars[tags.THROUGHPUT] == 6.81
    feed(restored, [HEAD % 6])
    restored.flush()
    feed(restored, [HEAD % 7, BAR])  # released by its bar: nothing left open
    assert feed(restored, [BAR]) == []
    closed = StreamAssembler()
    feed(closed, [HEAD % 5])
    closed.flush()
    feed(closed, [HEAD % 6])  # the next head: the bar that follows is its own
    assert [r.step for r in feed(closed, [BAR])] == [106]
