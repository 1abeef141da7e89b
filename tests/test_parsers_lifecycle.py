"""The lifecycle verdict of each kind of line the format reference lists (§6, §7), as the
assembler turns it into a record: :func:`parsers.lifecycle.lifecycle_of`."""

from __future__ import annotations

import pytest

from parsers.assembler import StreamAssembler
from parsers.event_lines import parse_checkpoint_line, parse_marker_line
from parsers.lifecycle import Lifecycle, lifecycle_of
from parsers.records import Record


@pytest.mark.parametrize(("line", "state"), [
    (".........Training Over!.............", Lifecycle.FINISHED),
    ("Training completed. Final checkpoint saved.", Lifecycle.FINISHED),
    ("Traceback (most recent call last):", Lifecycle.FAILED),
    ("There is nan in loss with value nan, terminate training.", Lifecycle.FAILED),
    ("Worker process 41872 exit with exception. Error code: 1.", Lifecycle.FAILED),
    ("RuntimeError: Distributed job exited with exception. Please check logs in directory: out.", Lifecycle.FAILED),
    (".........Starting Training Model..........", Lifecycle.RUNNING),
    (".............Start resume training from checkpoint..................", Lifecycle.RUNNING),
    (".........Model Compiling, Please Wait a Moment...........", None),
    ("Finish saving ckpt of epoch 1 step 1000 using 27.418 seconds", None),
])
def test_lifecycle_of_each_kind_of_line(line: str, state: Lifecycle | None) -> None:
    parsed = parse_marker_line(line) or parse_checkpoint_line(line)
    records = StreamAssembler().feed(parsed, None, 0, 0.0)
    assert [lifecycle_of(r) for r in records] == [state]


def test_a_step_is_running_and_a_record_without_texts_says_nothing() -> None:
    assert lifecycle_of(Record(5, None, {"loss": 2.0}, training_step=True)) is Lifecycle.RUNNING
    assert lifecycle_of(Record(5, None, {"eval/PerplexityMetric/loss": 2.0})) is None
