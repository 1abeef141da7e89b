"""One message in, at most one typed line out: the dispatcher over all line parsers.

Most lines of a training log are neither metrics nor markers, so the dispatch looks at the
first character and a few substrings before any regex runs. :data:`NEEDLES` lists every
substring the dispatch or the start-up collector (:mod:`parsers.run_config`) looks for: a
mindformers message that contains none of them means nothing, and neither does a foreign line below :data:`ERROR_LEVELS` (:mod:`parsers.fast_path`
relies on both).
"""

from __future__ import annotations

from parsers.event_lines import NEEDLES as EVENT_NEEDLES, parse_checkpoint_line, parse_eval_line, parse_marker_line
from parsers.parallel_lines import PREFIXES as PARALLEL_PREFIXES, parse_parallel_line
from parsers.prefix import Message
from parsers.records import ErrorLine, MalformedLine, ParsedLine
from parsers.run_config import PREFIXES as STARTUP_PREFIXES
from parsers.step_lines import (
    parse_bar_line,
    parse_epoch_end_line,
    parse_epoch_line,
    parse_experimental_line,
    parse_pynative_line,
)

ERROR_LEVELS = ("ERROR", "CRITICAL")  # a foreign line at these levels is an error line; others mean nothing
_GRAPH_HEAD = "{ Epoch:["
_PYNATIVE_HEAD = "{ step:["
_EPOCH = "Epoch:["
_EVAL = "Eval result:"
_EPOCH_TIME = "Epoch time:"
_EXPERIMENTAL = "Epoch:"
_EXPERIMENTAL_TRAIN = "train: Epoch:"
_SINK_TIME = "Per sink_size step time:"
_BAR = "samples/s/p"
_CHECKPOINT = ("checkpoint", "saving ckpt", "Checkpoint")
NEEDLES = (
    _GRAPH_HEAD, _PYNATIVE_HEAD, _EPOCH, _EVAL, _EPOCH_TIME, _EXPERIMENTAL, _EXPERIMENTAL_TRAIN, _SINK_TIME,
    *PARALLEL_PREFIXES, _BAR, *_CHECKPOINT, *EVENT_NEEDLES, *STARTUP_PREFIXES,  # start-up lines: run metadata
)


def text_of(raw: bytes) -> str:
    """A log line as text: invalid UTF-8 is replaced, never fatal; ``\\r\\n`` endings are fine."""
    text = raw.decode("utf-8", "replace")
    return text[:-1] if text.endswith("\r") else text


def parse_message(message: Message) -> ParsedLine | None:
    """The typed meaning of one message, or ``None`` for everything else."""
    text = message.text
    if message.foreign:
        if message.level in ERROR_LEVELS:
            return ErrorLine(text.strip())
        return None
    stripped = text.lstrip()
    first = stripped[:1]
    if first == "{":
        if stripped.startswith(_GRAPH_HEAD):
            return parse_epoch_line(stripped) or MalformedLine(text)
        if stripped.startswith(_PYNATIVE_HEAD):
            return parse_pynative_line(stripped) or MalformedLine(text)
        return None
    if first == "E":
        if stripped.startswith(_EPOCH):
            return parse_epoch_line(stripped) or MalformedLine(text)
        if stripped.startswith(_EVAL):
            return parse_eval_line(stripped)
        if stripped.startswith(_EPOCH_TIME):
            return parse_epoch_end_line(stripped)
        if stripped.startswith(_EXPERIMENTAL):
            return parse_experimental_line(stripped)
    elif first == "t" and stripped.startswith(_EXPERIMENTAL_TRAIN):
        return parse_experimental_line(stripped)
    elif first == "P" and stripped.startswith(_SINK_TIME):
        return parse_epoch_end_line(stripped)
    elif stripped.startswith(PARALLEL_PREFIXES):
        return parse_parallel_line(stripped)
    if _BAR in text:
        return parse_bar_line(text)
    if any(needle in text for needle in _CHECKPOINT):
        parsed = parse_checkpoint_line(text)
        if parsed is not None:
            return parsed
    return parse_marker_line(text)
