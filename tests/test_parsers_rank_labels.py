"""Rank labels of combined streams: srun, OpenMPI, tail -f headers, user patterns."""

from __future__ import annotations

import pytest

from parsers.rank_labels import RankRouter

LINE = "2026-11-29 10:00:01,000 - mindformers - INFO - { Epoch:[  1/  1], step:[    1/   10], loss: 1.0"


@pytest.mark.parametrize(
    "labelled,rank",
    [
        (f"3: {LINE}", 3),
        (f" 3: {LINE}", 3),
        (f"12: {LINE}", 12),
        (f"[1,3]<stdout>:{LINE}", 3),
        (f"[1,3]<stderr>: {LINE}", 3),
    ],
)
def test_labels_are_detected_and_stripped(labelled: str, rank: int) -> None:
    assert RankRouter(0).route(labelled) == (rank, LINE)


def test_tail_headers_name_the_rank_of_the_lines_that_follow() -> None:
    router = RankRouter(0)
    assert router.route("==> output/msrun_log/worker_3.log <==") == (3, "")
    assert router.route(LINE) == (3, LINE)
    assert router.route("") == (3, "")
    assert router.route("==> /x/output/log/rank_5/info.log <==") == (5, "")
    assert router.route(LINE) == (5, LINE)


def test_unlabelled_lines_continue_the_last_labelled_rank() -> None:
    router = RankRouter(0)
    router.route(f"2: {LINE}")
    assert router.route("Traceback (most recent call last):") == (2, "Traceback (most recent call last):")
    assert router.route("  File \"x.py\", line 1") == (2, "  File \"x.py\", line 1")


def test_plain_lines_starting_with_digits_are_not_mistaken_for_labels() -> None:
    router = RankRouter(4)
    assert router.route("12: some value in a pretty-printed dict") == (4, "12: some value in a pretty-printed dict")
    assert router.style is None


def test_once_a_style_is_detected_other_shapes_are_content() -> None:
    router = RankRouter(0)
    router.route(f"[1,2]<stdout>:{LINE}")
    assert router.route(f"5: {LINE}") == (2, f"5: {LINE}")


def test_user_pattern_with_named_group() -> None:
    router = RankRouter(0, r"^\[r(?P<rank>\d+)\] ")
    assert router.route(f"[r7] {LINE}") == (7, LINE)
    assert router.route("continuation") == (7, "continuation")


def test_user_pattern_needs_a_rank_group() -> None:
    with pytest.raises(ValueError):
        RankRouter(0, r"^\d+ ")


@pytest.mark.parametrize(
    "line", [f"{'9' * 5000}: {LINE}", f"[1,{'9' * 5000}]<stdout>:{LINE}", f"99999999999999999999999: {LINE}"],
    ids=["srun-5000-digits", "mpi-5000-digits", "srun-beyond-int64"],
)
def test_labels_that_are_no_rank_are_content(line: str) -> None:
    assert RankRouter(4).route(line) == (4, line)


def test_a_user_pattern_matching_no_number_is_no_label() -> None:
    router = RankRouter(0, r"^\[(?P<rank>\w+)\] ")
    assert router.route(f"[r7] {LINE}") == (0, f"[r7] {LINE}")
    assert router.route(f"[7] {LINE}") == (7, LINE)
