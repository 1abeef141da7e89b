"""One message in, at most one typed line out: the dispatcher over all line parsers.

Most lines of a training log are neither metrics nor markers, so the dispatch looks at the
first character and a few substrings before any regex runs.
"""

from __future__ import annotations

from parsers.event_lines import parse_checkpoint_line, parse_eval_line, parse_marker_line
from parsers.parallel_lines import PREFIXES as PARALLEL_PREFIXES, parse_parallel_line
from parsers.prefix import Message
from parsers.records import ErrorLine, MalformedLine, ParsedLine
from parsers.step_lines import (
    parse_bar_line,
    parse_epoch_end_line,
    parse_epoch_line,
    parse_experimental_line,
    parse_pynative_line,
)


def parse_message(message: Message) -> ParsedLine | None:
    """The typed meaning of one message, or ``None`` for everything else."""
    text = message.text
    if message.foreign:
        if message.level in ("ERROR", "CRITICAL"):
            return ErrorLine(text.strip())
        return None
    stripped = text.lstrip()
    first = stripped[:1]
    if first == "{":
        if stripped.startswith("{ Epoch:["):
            return parse_epoch_line(stripped) or MalformedLine(text)
        if stripped.startswith("{ step:["):
            return parse_pynative_line(stripped) or MalformedLine(text)
        return None
    if first == "E":
        if stripped.startswith("Epoch:["):
            return parse_epoch_line(stripped) or MalformedLine(text)
        if stripped.startswith("Eval result:"):
            return parse_eval_line(stripped)
        if stripped.startswith("Epoch time:"):
            return parse_epoch_end_line(stripped)
        if stripped.startswith("Epoch:") or stripped.startswith("Epoch: "):
            return parse_experimental_line(stripped)
    elif first == "t" and stripped.startswith("train: Epoch:"):
        return parse_experimental_line(stripped)
    elif first == "P" and stripped.startswith("Per sink_size step time:"):
        return parse_epoch_end_line(stripped)
    elif stripped.startswith(PARALLEL_PREFIXES):
        return parse_parallel_line(stripped)
    if "samples/s/p" in text:
        return parse_bar_line(text)
    if "checkpoint" in text or "saving ckpt" in text or "Checkpoint" in text:
        parsed = parse_checkpoint_line(text)
        if parsed is not None:
            return parsed
    return parse_marker_line(text)
