"""Fuzzing every parser: random bytes and mutated genuine log lines never raise, and a line a
parser rejects is counted.

The genuine lines are every line of the bundled logs (``tests/fixtures/real``, ``tests/fixtures/
versions``); a mutation replaces a number with one from the edges (beyond float32 or int64, NaN
and Inf spellings, 5000 digits), inserts launcher labels, prefixes, brackets or odd bytes, cuts,
deletes, repeats, or splices two lines into one (a torn line). :func:`parse_everything` hands one
line to every public parser in ``parsers/`` and checks the rejection contract: a line that starts
like a step record comes out as a record or a :class:`~parsers.records.MalformedLine`, never as
nothing, and a custom metric that matched but could not be read is counted. The end-to-end test
replays a file of mutated lines: exit 0, no traceback, and the summary's malformed count is what
the parsers rejected, its written steps what they read.

Bounded for CI (:data:`EXAMPLES` examples per test, a fixed seed, no example database);
``MSTB_FUZZ_EXAMPLES`` searches longer. Inputs that found a bug are kept as ``@example``.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from live_helpers import BIN
from parsers import step_lines, tags
from parsers.assembler import StreamAssembler
from parsers.custom_metrics import MAX_TEXT, CustomMatcher, CustomMetric
from parsers.event_lines import parse_checkpoint_line, parse_eval_line, parse_marker_line
from parsers.fast_path import NOT_PLAIN, Shapes, classify, plain
from parsers.field_shapes import learn, read_fields
from parsers.line import parse_message, text_of
from parsers.literal import read_literal
from parsers.parallel_lines import parse_parallel_line
from parsers.prefix import PrefixSplitter
from parsers.rank_labels import RankRouter
from parsers.records import MalformedLine, Record
from parsers.run_config import StartupCollector, parse_startup_line
from parsers.torn import tears
from parsers.values import parse_bool, parse_int64, parse_number, split_fields
from sidecar.following.chains import Stream

EXAMPLES = int(os.environ.get("MSTB_FUZZ_EXAMPLES", "200"))
FIXTURES = Path(__file__).parent / "fixtures"
CORPUS = sorted({line for path in sorted([*FIXTURES.glob("real/**/*.log"), *FIXTURES.glob("versions/**/*.log")])
                 for line in path.read_bytes().splitlines() if line.strip()})
EDGES = ["nan", "NaN", "  nan", "-inf", "inf", "Infinity", "-Infinity", "1e39", "-1e39", "1e308", "1e400",
         "4.9e-324", "1e-40", "-0.0", "-0", str(1 << 63), str(1 << 64), str(-(1 << 63) - 1), "9" * 30,
         "9" * 5000, "0" * 5000 + "1", "None", "N/A", "[nan]", "[1e39/1e39]", "[ True]", "1.2.3", "1e", "-"]
INSERTS = ["[", "]", "{", "}", "(", ")", ",", ", ", ":", ": ", "/", " ", "\t", "\r", "\x00", "\udcff", "é", "█",
           "'", '"', "[1,3]<stdout>:", "12: ", "==> output/msrun_log/worker_3.log <==", " samples/s/p ", " }",
           "[INFO] 2024-06-18 02:41:09,377 [mindformers/core/callback/callback.py:318] print_output_info: ",
           "2024-06-18 02:41:09,377 - mindformers[callback.py:310] - ERROR - ", "{ Epoch:[", "{ step:[",
           "Epoch:[", "loss: ", "Eval result: ", "Traceback (most recent call last):", "{'", "global_batch_size = "]
_NUMBER = re.compile(rb"-?\d+(?:\.\d+)?(?:e-?\d+)?")
_TRACEBACK = re.compile(r"^Traceback \(most recent call last\):$", re.M)  # a quoted log line is no traceback
_STEP_HEADS = ("{ Epoch:[", "{ step:[", "Epoch:[")
_METRICS = [CustomMetric(name="tokens", regex=r"step (?P<step>\S+) tokens/s: (?P<value>\S+)", tag="tokens-per-s"),
            CustomMetric(name="note", regex=r"note (?P<step>\d+) (?P<rank>\S+) (?P<value>.*)", tag="note", kind="text")]


def _settings(examples: int = EXAMPLES, shrink: bool = True) -> settings:
    """``shrink``: off where an example costs a replay (seconds each): the failing file is printed
    as found, and shrinking it by hand beats minutes of Hypothesis."""
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    phases=[Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else []),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A genuine line, mutated one to four times."""
    line = draw(st.sampled_from(CORPUS))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(line)))
        op = draw(st.sampled_from(["number", "insert", "cut", "delete", "repeat", "splice", "byte"]))
        if op == "number":
            numbers = list(_NUMBER.finditer(line))
            if numbers:
                m = draw(st.sampled_from(numbers))
                line = line[:m.start()] + draw(st.sampled_from(EDGES)).encode() + line[m.end():]
        elif op == "insert":
            line = line[:at] + draw(st.sampled_from(INSERTS)).encode("utf-8", "surrogateescape") + line[at:]
        elif op == "cut":
            line = line[:at]
        elif op == "delete":
            line = line[:at] + line[at + draw(st.integers(1, 20)):]
        elif op == "repeat":
            line = line[:at] + line[max(0, at - 20):at] + line[at:]
        elif op == "splice":  # a torn line: the head of this one, the rest of another
            other = draw(st.sampled_from(CORPUS))
            line = line[:at] + other[draw(st.integers(0, len(other))):]
        else:
            line = line[:at] + bytes([draw(st.integers(0, 255))]) + line[at + 1:]
    return line.replace(b"\n", b" ")


def parse_everything(raw: bytes) -> None:
    """One line through every parser; see the module docstring for what is checked."""
    for labels in (True, False):
        at = tears(raw, labels)
        assert at == sorted(set(at)) and all(0 < a < len(raw) for a in at)
        assert not at or tears(raw[at[-1]:], labels) == [], "the rest of a torn line is whole (the engine reads it)"
    text = text_of(raw)
    kind, _ = classify(text)
    assert plain(text) == kind
    assert Shapes().classify(raw)[0] in (kind, 3)  # 3: torn, split before the fast path asks again
    for router in (RankRouter(0), RankRouter(0, r"R(?P<rank>\d+)\| ")):
        router.route(text)
    message = PrefixSplitter().split(text)
    parsed = parse_message(message)
    if kind != NOT_PLAIN:
        assert parsed is None, f"the fast path passed over a line the full parser reads: {parsed!r}"
    if not message.foreign and message.text.lstrip().startswith(_STEP_HEADS):
        assert parsed is not None, "a line that starts like a step record is read or counted as malformed"
    collector = StartupCollector()
    collector.feed(message)
    collector.flush()
    body = message.text
    for parse in (step_lines.parse_epoch_line, step_lines.parse_pynative_line, step_lines.parse_experimental_line,
                  step_lines.parse_bar_line, step_lines.parse_epoch_end_line, parse_eval_line, parse_checkpoint_line,
                  parse_marker_line, parse_parallel_line, parse_startup_line, read_literal, read_fields, learn,
                  split_fields, parse_number, parse_int64, parse_bool, tags.sanitize_tag, tags.tag_for_key):
        if body:
            parse(body)
            parse(body.lstrip())
    for key, value in split_fields(body):
        tags.tag_for_key(key)
        if value:
            parse_number(value)
    matcher = CustomMatcher(_METRICS)
    found = matcher.match(message)
    matched = not message.foreign and any(re.search(m.regex, message.text[:MAX_TEXT]) for m in _METRICS)
    assert (found is not None) + matcher.malformed == matched, "a custom metric that matched is read or counted"
    assert found is None or isinstance(found[1], Record)
    assembler = StreamAssembler()
    for record in [*assembler.feed(parsed if not isinstance(parsed, MalformedLine) else None, message.timestamp, 0, 0.0),
                   *assembler.flush()]:
        assert isinstance(record.step, int)


@_settings()
@given(st.binary(max_size=400))
def test_random_bytes_never_raise(raw: bytes) -> None:
    parse_everything(raw.replace(b"\n", b""))


@_settings()
@given(mutated())
@example(b"[INFO] 2026-11-29 15:53:14,176 [mindformers/core/callback/callback.py:747] print_output_info: "
         b"{ Epoch:[  1/  2], step:[    1/  100], loss:[1e39/1e39], per_step_time: 6254ms")
def test_mutated_genuine_lines_never_raise(raw: bytes) -> None:
    parse_everything(raw)


# -- end to end ------------------------------------------------------------------------------------


def oracle(data: bytes) -> tuple[int, int]:
    """(training-step records, malformed lines) the parsers make of a file, line by line: the
    torn pieces of a line (:mod:`parsers.torn`), lines parsed as malformed, and steps the
    assembler refuses (beyond int64) are malformed."""
    router = RankRouter(0)
    streams: dict[int, Stream] = {}
    records = malformed = 0
    for raw in data.split(b"\n")[:-1]:
        if at := tears(raw):
            for begin, end in zip([0, *at], at):
                router.route(text_of(raw[begin:end]))
            malformed += len(at)
            raw = raw[at[-1]:]
        rank, body = router.route(text_of(raw))
        stream = streams.setdefault(rank, Stream(math.inf))
        parsed, out = stream.feed(body, 0, 0.0, None)
        malformed += isinstance(parsed, MalformedLine) + stream.assembler.take_malformed()
        records += sum(r.training_step for r in out)
    for stream in streams.values():
        records += sum(r.training_step for r in stream.assembler.flush())
    return records, malformed


def _summary_counts(summary: str) -> tuple[int, Counter[str]]:
    """(step records written, dropped by reason) from a replay summary."""
    written = sum(int(m.group(1)) for m in re.finditer(r"^\d+\s+(\d+)\s", summary, re.M))
    by_reason = re.search(r"not written, by reason: ([^(]*)\(", summary.replace("\n", " "))
    dropped: Counter[str] = Counter()
    for part in (by_reason.group(1).split(",") if by_reason else []):
        count, reason = part.split()
        dropped[reason] += int(count)
    return written, dropped


_BASE = (FIXTURES / "real" / "mf1.9-single" / "output" / "log" / "rank_0" / "info.log").read_bytes().splitlines()
_HEADS = [i for i, line in enumerate(_BASE) if b"step:[" in line]  # step heads; each bar follows its head


@_settings(max(5, EXAMPLES // 30), shrink=False)
@given(st.lists(st.tuples(st.integers(0, len(_BASE) - 1), mutated()), min_size=10, max_size=80))
# The bugs of issue 26 as mutations: a loss beyond float32 ended the replay (record identity),
# and a torn head before a resumed step hid that step (here step 3's cut head, then step 2's).
@example([(_HEADS[2], re.sub(rb"loss:\[[^/]*/", b"loss:[1e39/", _BASE[_HEADS[2]]))])
@example([(_HEADS[2] + 1, _BASE[_HEADS[2]][:-60] + _BASE[_HEADS[1]])])
def test_replay_of_mutated_lines_counts_every_rejected_line(tmp_path_factory, mutations) -> None:
    """A genuine log with some of its lines mutated, replayed: nothing raises, the summary
    counts as malformed exactly the lines the parsers reject, and every training record read is
    written or counted (as a duplicate or superseded: mutations make copies and resumes)."""
    lines = list(_BASE)
    for at, line in mutations:
        lines[at] = line
    data = b"\n".join(lines) + b"\n"
    out = tmp_path_factory.mktemp("fuzz")
    log = out / "output" / "log" / "rank_0" / "info.log"
    log.parent.mkdir(parents=True)
    log.write_bytes(data)
    done = subprocess.run([str(BIN), "replay", str(out / "output"), "--out", str(out / "tb"), "--no-progress"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and not _TRACEBACK.search(done.stderr), done.stderr
    written, dropped = _summary_counts(done.stdout)
    records, malformed = oracle(data)
    assert dropped["malformed"] == malformed, done.stdout
    assert written <= records <= written + dropped["duplicate"] + dropped["superseded"], done.stdout
