"""Eval, checkpoint, lifecycle, pipeline-parallel and error lines (§4-§7 of the reference)."""

from __future__ import annotations

import math

import pytest

from parsers.line import parse_message
from parsers.prefix import Message
from parsers.records import CheckpointLine, ErrorLine, EvalLine, Marker, MarkerLine, PipelineLine


def _parse(text: str, foreign: bool = False, level: str | None = None):
    return parse_message(Message(text, level=level, foreign=foreign))


def test_eval_result_dict_becomes_eval_tags() -> None:
    parsed = _parse("Eval result: {'PerplexityMetric': {'loss': 1.8862, 'PPL': 6.5945}}, eval time is 21.509340 s.")
    assert parsed == EvalLine({"eval/PerplexityMetric/loss": 1.8862, "eval/PerplexityMetric/PPL": 6.5945}, 21.50934)


def test_eval_result_with_numpy2_reprs_and_nan() -> None:
    parsed = _parse("Eval result: {'Acc': {'acc': np.float32(0.5), 'x': nan, 'name': 'abc', 'n': -inf}}, "
                    "eval time is 1.000000 s.")
    assert isinstance(parsed, EvalLine)
    assert parsed.scalars["eval/Acc/acc"] == 0.5
    assert math.isnan(parsed.scalars["eval/Acc/x"]) and parsed.scalars["eval/Acc/n"] == -math.inf
    assert "eval/Acc/name" not in parsed.scalars


def test_eval_result_that_is_not_a_literal_is_ignored() -> None:
    assert _parse("Eval result: {'a': __import__('os')}, eval time is 1.0 s.") is None


@pytest.mark.parametrize(
    "text,seconds",
    [
        ("Finish saving ckpt of epoch 1 step 1000 using 27.418 seconds", 27.418),
        ("Save checkpoint cost time: 3.125s.", 3.125),
        ("Checkpoint saved at step 500 to /ckpt/step_500 (async=False, remove_redundancy=True)", None),
    ],
)
def test_checkpoint_saves(text: str, seconds: float | None) -> None:
    assert _parse(text) == CheckpointLine(text, seconds)


def test_other_checkpoint_keys_are_not_separate_saves() -> None:
    assert _parse("Finish saving network of epoch 1 step 1000 using 2.1 seconds") is None


@pytest.mark.parametrize(
    "text,kind",
    [
        (".........Model Compiling, Please Wait a Moment...........", Marker.COMPILE),
        (".........Starting Training Model..........", Marker.TRAINING_START),
        ("Start training loop...", Marker.TRAINING_START),
        (".........Training Over!.............", Marker.TRAINING_OVER),
        ("Training completed. Final checkpoint saved.", Marker.TRAINING_OVER),
        (".............Start resume training from checkpoint..................", Marker.RESUME),
        ("Resume training starts from global step 1000, epoch 1, step 1000.", Marker.RESUME),
    ],
)
def test_lifecycle_markers(text: str, kind: Marker) -> None:
    parsed = _parse(text)
    assert isinstance(parsed, MarkerLine) and parsed.kind is kind


def test_pipeline_parallel_validity() -> None:
    assert _parse("pipeline stages: 4 > 1, the loss on the last card is valid.") == PipelineLine(4)
    assert _parse("When zero_bubble_v is enabled, loss is valid only on rank 0") == PipelineLine(None, rank0_only=True)


@pytest.mark.parametrize(
    "text",
    [
        "Traceback (most recent call last):",
        "There is nan in loss with value nan, terminate training.",
        "Current global norm 12.5 is greater equal than threshold 10.0, stop training...",
    ],
)
def test_error_lines(text: str) -> None:
    assert _parse(text) == ErrorLine(text)


def test_foreign_errors_are_errors_but_foreign_warnings_are_not() -> None:
    assert isinstance(_parse("[ERROR] DEVICE(1,7f,python):x] boom", foreign=True, level="ERROR"), ErrorLine)
    assert _parse("[WARNING] ME(1:2,MainProcess):x] meh", foreign=True, level="WARNING") is None


def test_eval_values_beyond_float_are_infinite() -> None:
    big = "9" * 400  # a Python int literal that float() cannot convert
    parsed = _parse(f"Eval result: {{'M': {{'a': {big}, 'b': -{big}, 'c': 1e400}}}}, eval time is 1e400 s.")
    assert parsed == EvalLine({"eval/M/a": math.inf, "eval/M/b": -math.inf, "eval/M/c": math.inf}, math.inf)


def test_a_pipeline_stage_count_beyond_int64_is_no_pipeline_information() -> None:
    assert _parse(f"pipeline stages: {'9' * 5000} > 1, the loss on the last card is valid.") is None
