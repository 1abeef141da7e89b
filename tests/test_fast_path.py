"""The fast paths say exactly what the full parser says: on every line of every bundled log, and on
lines made to sit next to their edges (each needle, each value form a field shape takes or refuses)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parsers import fast_path, field_shapes, step_lines
from parsers.fast_path import NOT_PLAIN, TIMED, UNTIMED, Shapes, classify, plain
from parsers.line import NEEDLES, parse_message, text_of
from parsers.prefix import Cut, PrefixSplitter, cut_of
from parsers.rank_labels import RankRouter

FIXTURES = Path(__file__).parent / "fixtures"
LOGS = sorted(p for p in FIXTURES.rglob("*.log*") if p.is_file())
PREFIX = "[INFO] 2024-06-18 02:41:09,377 [mindformers/core/callback/callback.py:318] print_output_info: "
STDOUT = "2024-06-18 02:41:09,377 - mindformers[mindformers/core/callback/callback.py:318] - INFO - "


def fixture_lines() -> list[str]:
    return [line for path in LOGS for line in path.read_text("utf-8", "replace").splitlines()]


def fixture_raw_lines() -> list[bytes]:
    return [line for path in LOGS for line in path.read_bytes().split(b"\n")]


def test_a_plain_line_means_nothing_to_the_full_path() -> None:
    kinds = {NOT_PLAIN: 0, TIMED: 0, UNTIMED: 0}
    for line in fixture_lines():
        kind = plain(line)
        kinds[kind] += 1
        if kind == NOT_PLAIN:
            continue
        router = RankRouter(3)
        message = PrefixSplitter().split(line)
        assert router.route(line) == (3, line) and router.style is None, line
        assert parse_message(message) is None, line
        assert (message.timestamp is not None) == (kind == TIMED), line
    assert kinds[TIMED] > 1000 and kinds[UNTIMED] > 10  # the bundled logs are mostly plain, like real ones


@pytest.mark.parametrize("needle", NEEDLES)
@pytest.mark.parametrize("prefix", [PREFIX, STDOUT])
def test_every_needle_sends_a_line_to_the_full_parser(needle: str, prefix: str) -> None:
    assert plain(prefix + "Fetched global batch 7 from 17 shards") == TIMED
    assert plain(f"{prefix}x {needle} y") == NOT_PLAIN
    assert plain(f"{prefix}{needle}") == NOT_PLAIN


@pytest.mark.parametrize("line", [
    "[WARNING] ME(41872:1402155,MainProcess):2025-09-03-11:20:45.118.602 [a.py:1] Epoch:[1/2] step:[3/4]",
    "[INFO] DEVICE(41872,ffff8febf010,python):2025-09-03-11:20:45.118.602 [a.cc:154] checkpoint saved",
    "2026-05-06 11:32:28.350573 info 41872 [TTP controller.py:88] Training completed",
])
def test_foreign_lines_below_error_mean_nothing_whatever_they_say(line: str) -> None:
    assert plain(line) == UNTIMED
    assert parse_message(PrefixSplitter().split(line)) is None


@pytest.mark.parametrize("line", [
    "[ERROR] ME(41872:1402155,MainProcess):2025-09-03-11:20:45.118.602 [a.py:1] boom",  # foreign error
    "[CRITICAL] DEVICE(41872,ffff8febf010,python):2025-09-03-11:20:45.118.602 [a.cc:1] lost",
    "EZ9999[PID: 41872] 2026-05-06-11:32:28.350.573 (EZ9999): device lost",
    "3: " + PREFIX + "Fetched global batch",  # an srun label
    "[1,3]<stdout>:" + PREFIX + "Fetched global batch",  # an OpenMPI label
    "==> output/msrun_log/worker_3.log <==",
    "Fetched global batch 7 from 17 shards",  # no prefix, no timestamp
])
def test_labels_error_lines_and_unknown_lines_take_the_full_path(line: str) -> None:
    assert plain(line) == NOT_PLAIN


def what_classify_says(raw: bytes) -> tuple[int, str | None, Cut | None]:
    """:meth:`Shapes.classify`'s answer by :func:`classify` alone: a plain line without its text."""
    text = text_of(raw)
    kind, prefix = classify(text)
    return (kind, None, None) if kind else (kind, text, None if prefix is None else cut_of(prefix))


def test_shapes_answer_as_classify_on_every_bundled_line_the_first_time_and_after() -> None:
    shapes = Shapes()
    raws = fixture_raw_lines()

    def check_all() -> None:
        for raw in raws:
            answer = shapes.classify(raw)
            assert answer == what_classify_says(raw), raw
            _, text, cut = answer
            if text is not None and cut is not None:  # the cut splits the line as a match would
                assert PrefixSplitter().split(text, cut) == PrefixSplitter().split(text), raw

    check_all()
    known = dict(shapes._known)
    check_all()
    assert shapes._known == known  # the second time, every shape was known
    assert len(known) < len(raws) / 3  # the logs repeat their shapes, like real ones


DIGITS = st.sampled_from(b"0123456789")


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(fixture_raw_lines()), st.data())
def test_lines_of_one_shape_get_one_answer(raw: bytes, data: st.DataObject) -> None:
    """Any digit of a line changed to any other: :class:`Shapes` (taught by the first line) says what
    :func:`classify` says of the second."""
    other = bytes(data.draw(DIGITS) if 0x30 <= b <= 0x39 and data.draw(st.booleans()) else b for b in raw)
    shapes = Shapes()
    shapes.classify(raw)
    assert shapes.classify(other) == what_classify_says(other), (raw, other)


@pytest.mark.parametrize("rank", ["0", "5"])
def test_a_needle_with_a_digit_takes_the_full_path_whatever_the_digit(rank: str) -> None:
    shapes = Shapes()
    warning = f"{PREFIX}zero_bubble_v is enabled, loss is valid only on rank {rank}".encode()
    assert shapes.classify(warning.replace(rank.encode(), b"7"))[0] == NOT_PLAIN  # taught by another digit
    assert shapes.classify(warning)[0] == NOT_PLAIN
    assert plain(warning.decode()) == NOT_PLAIN


def test_the_shapes_kept_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fast_path, "KEEP_SHAPES", 50)
    shapes = Shapes()
    for n in range(500):
        line = f"{PREFIX}dataset file shard_{'x' * (n % 7)}{chr(97 + n % 26) * (n // 26)}.bin opened".encode()
        assert shapes.classify(line)[0] == TIMED
        assert len(shapes._known) <= 50
    assert shapes.classify((PREFIX + "Epoch:[1/2], step:[3/4], loss:[1.0/1.0]").encode())[0] == NOT_PLAIN


def parse(text: str, shapes: bool, monkeypatch: pytest.MonkeyPatch) -> object:
    with monkeypatch.context() as m:
        if not shapes:
            m.setattr(step_lines, "read_fields", lambda tail: None)
        return parse_message(PrefixSplitter().split(text))


def same(a: object, b: object) -> bool:
    """Equal, with NaN equal to NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or math.isnan(a) and math.isnan(b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)  # type: ignore[union-attr]
    if hasattr(a, "__slots__"):
        return all(same(getattr(a, s), getattr(b, s)) for s in a.__slots__)
    return a == b


def test_field_shapes_read_every_bundled_step_line_as_the_full_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    field_shapes._shapes.clear()
    steps = [line for line in fixture_lines() if "step:[" in line or "Step:" in line]
    for line in steps:
        full = parse(line, False, monkeypatch)
        assert same(parse(line, True, monkeypatch), full), line
        assert same(parse(line, True, monkeypatch), full), line  # the shape it taught, if any
    assert field_shapes._shapes  # the bundled logs taught shapes


@pytest.mark.parametrize("loss", ["4.2", "-1.5e-07", "1e400", "[0.5]", "[ 0.5 ]", "7ms", "3.5T", "2s", "N/A (stage)",
                                  "[4.2/4.3]", "nan", "NaN", "None", "[0.5 0.6]", "[0.5, 0.6]", "2 ms", "1_0", ".5", "5.",
                                  "1.2.3", "1e", "-", "+.5E-3", "[ 1e-3 ]", "[0.5", "0.5]", "\t4.2", "4.2\u00a0"])
@pytest.mark.parametrize("flag", ["False", "True", "[ True]", "[False]", "maybe"])
def test_field_shapes_take_what_they_can_read_exactly_and_leave_the_rest(
    loss: str, flag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    field_shapes._shapes.clear()
    taught = f"{PREFIX}{{ Epoch:[  1/  2], step:[    1/ 2000], loss: 4.201286, per_step_time: 2831ms, lr: 1.5e-07, " \
             f"overflow cond: False, loss_scale: 1.0, global_norm: [0.9189675], train_throughput_per_npu: 193.646T"
    parse(taught, True, monkeypatch)
    assert field_shapes._shapes
    line = taught.replace("loss: 4.201286", f"loss: {loss}").replace("cond: False", f"cond: {flag}")
    assert same(parse(line, True, monkeypatch), parse(line, False, monkeypatch)), line
