"""The value grammar (§2.3) and the tolerant key/value splitter (§14)."""

from __future__ import annotations

import math

import pytest

from parsers.tags import sanitize_tag, tag_for_key
from parsers.values import parse_bool, parse_int64, parse_number, split_fields


@pytest.mark.parametrize(
    "text,value",
    [
        ("2.5", 2.5), ("  nan", math.nan), ("  inf", math.inf), (" -inf", -math.inf), ("[1.5624999e-05]", 1.5624999e-05),
        ("[0.]", 0.0), ("4.7999997e-06", 4.7999997e-06), ("1893ms", 1893.0), ("488.201 ms", 488.201),
        ("238.114T", 238.114), ("  88.41T", 88.41), ("(2.500000e-06,2.500000e-06,)", 2.5e-06), ("[nan]", math.nan),
        ("1.0737418e+09", 1.0737418e09), ("1073741800.0", 1073741800.0), ("[ 2.7341568 ]", 2.7341568),
    ],
)
def test_numbers(text: str, value: float) -> None:
    got = parse_number(text)
    assert got is not None
    assert (math.isnan(got) and math.isnan(value)) or got == value


@pytest.mark.parametrize(
    "text", ["None", "unavailable", "[0.51 0.49]", "Not Set LR.", "CPU Mode Not Support Compute LR Now.", "", "N/A (x)",
             "[ True]", "abc", "ms", "T"]
)
def test_not_exactly_one_number(text: str) -> None:
    assert parse_number(text) is None


@pytest.mark.parametrize("text,value", [("False", False), ("True", True), ("[ True]", True), ("[False]", False), ("x", None)])
def test_bools(text: str, value: bool | None) -> None:
    assert parse_bool(text) is value


def test_split_fields_respects_brackets_parens_and_missing_spaces() -> None:
    text = ("loss:[3.872/4.015], time:488.201 ms, lr:[1e-05], overflow cond: [ True], "
            "loss: N/A (non-last PP stage, refer to last stage), Learning_rate: (2e-06,2e-06,), junk, future_key: 7")
    assert split_fields(text) == [
        ("loss", "[3.872/4.015]"), ("time", "488.201 ms"), ("lr", "[1e-05]"), ("overflow cond", "[ True]"),
        ("loss", "N/A (non-last PP stage, refer to last stage)"), ("learning_rate", "(2e-06,2e-06,)"), ("", "junk"),
        ("future_key", "7"),
    ]


def test_tag_vocabulary_matches_mindformers() -> None:
    assert [tag_for_key(k) for k in ("loss", "lr", "global_norm", "loss_scale", "per_step_time",
                                     "train_throughput_per_npu", "lm loss", "mtp_3_loss", "epoch")] == [
        "loss", "learning-rate", "grad-norm", "loss-scale", "iteration-time", "model-flops-throughput-per-npu",
        "lm-loss", "mtp-3-loss", None,
    ]


def test_tags_from_log_content_are_sanitised() -> None:
    assert sanitize_tag("local_norm/model.layers.3.w") == "local_norm/model.layers.3.w"
    assert sanitize_tag("a b<c>\n") == "a_b_c_"
    assert sanitize_tag("/leading/and/trailing/") == "leading/and/trailing"
    assert len(sanitize_tag("x" * 1000)) == 200
    assert sanitize_tag("  ") == "_"


@pytest.mark.parametrize(
    "text,value",
    [("0", 0), ("  42", 42), ("-7", -7), ("000123", 123), (str((1 << 63) - 1), (1 << 63) - 1), (str(-(1 << 63)), -(1 << 63)),
     (str(1 << 63), None), (str(-(1 << 63) - 1), None), ("99999999999999999999999", None), ("9" * 5000, None),
     ("0" * 5000 + "5", 5), ("1.5", None), ("", None), ("x", None)],
)
def test_int64_counts(text: str, value: int | None) -> None:
    assert parse_int64(text) == value

