"""Step-record lines of every mindformers version (``mindformers-log-formats.md`` §2-§4).

Three families share one tolerant key/value tail parser:

- r0.2-r0.6 ``Epoch:[e/E], step:[s/S], loss:[cur/avg], time:X ms, lr:..., overflow cond: ..``
  (r0.2 has no ``overflow cond`` and prints 0-based epochs);
- r0.7+ graph trainer ``{ Epoch:[e/E], step:[s/S], loss: X, per_step_time: Nms, ...`` whose
  progress bar ``  12.0% |███   | 6.81 samples/s/p  3:04:05 }`` follows on its own line;
- v1.9+ PyNative ``{ step:[s/S], loss: X, per_step_time: Nms, ..., throughput: T }`` (global step),
  and the v1.3-v1.6 experimental ``Epoch: e, Step: s, Loss: X, ..., Time: X ms``.

TrainingStateMonitor lines also start ``Epoch:[`` but have no comma after ``step:[...]``.

A step, epoch or epoch length that does not fit int64, or a global step it implies that does
not, makes the line malformed (see :mod:`parsers.values`): such a step cannot be written.
"""

from __future__ import annotations

import re

from parsers.field_shapes import learn, read_fields
from parsers.records import BarLine, EpochEndLine, Family, MalformedLine, MonitorLine, StepLine
from parsers.tags import KEY_TAGS, sanitize_tag, tag_for_key
from parsers.values import fits_int64, parse_bool, parse_int64, parse_number, split_fields

_EPOCH_STEP = re.compile(r"\{? ?Epoch:\[\s*(-?\d+)/\s*(\d+)\], step:\[\s*(\d+)/\s*(\d+)\](,? ?)(.*)", re.S)
_PYNATIVE = re.compile(r"\{ step:\[\s*(\d+)/\s*(\d+)\], (.*?)\s*\}?\s*$", re.S)
_EXPERIMENTAL = re.compile(r"(?:train: )?Epoch: ?(\d+), Step: ?(\d+), (Loss: ?.*)", re.S)
_MONITOR_TAIL = re.compile(r"(\S[^:]*?): (.+)")
_EPOCH_END = re.compile(
    r"(?:Epoch time|Per sink_size step time): \S+ ms, per step time: (\S+) ms", re.S
)
_PP_PLACEHOLDER_NORM = "NaN"  # PyNative prints this literal when no norm was supplied


def parse_epoch_line(text: str) -> StepLine | MonitorLine | None:
    """``Epoch:[..`` / ``{ Epoch:[..`` lines: r0.x steps, graph heads, monitor lines."""
    m = _EPOCH_STEP.match(text)
    if m is None:
        return None
    epoch, epochs, step, steps = map(parse_int64, m.group(1, 2, 3, 4))
    if epoch is None or epochs is None or step is None or steps is None:
        return None
    comma, tail = m.group(5), m.group(6)
    if not comma.startswith(","):
        mm = _MONITOR_TAIL.match(tail)
        if mm is None:
            return None
        value = parse_number(mm.group(2))
        if value is None:
            return None
        monitor = MonitorLine(epoch, steps, step, sanitize_tag(mm.group(1)), value)
        return monitor if fits_int64(monitor.global_step()) else None
    head = text.startswith("{")
    line, overflow_cond = _from_tail(Family.GRAPH if head else Family.R0X, step, epoch, steps, tail)
    line.needs_bar = head
    if not head and not overflow_cond:
        line.epoch_base = 0  # r0.2 prints cur_epoch_num - 1
    implied = line.global_step()
    return line if implied is None or fits_int64(implied) else None


def parse_pynative_line(text: str) -> StepLine | None:
    m = _PYNATIVE.match(text)
    if m is None:
        return None
    step = parse_int64(m.group(1))
    return None if step is None else _from_tail(Family.PYNATIVE, step, None, None, m.group(3))[0]


def parse_experimental_line(text: str) -> StepLine | MalformedLine | None:
    """``None`` for other ``Epoch: ...`` text; a record whose numbers do not fit is malformed."""
    m = _EXPERIMENTAL.match(text)
    if m is None:
        return None
    epoch, step = parse_int64(m.group(1)), parse_int64(m.group(2))
    if epoch is None or step is None:
        return MalformedLine(text)
    line = _from_fields(Family.EXPERIMENTAL, step, epoch, None, split_fields(m.group(3)))
    line.epoch_base = 0
    return line


def parse_bar_line(text: str) -> BarLine | None:
    """The progress bar: ``  %4.1f%% |...| %.5f samples/s/p  ETA }``."""
    end = text.find(" samples/s/p")
    if end < 0 or not text.rstrip().endswith("}"):
        return None
    value = parse_number(text[:end].rsplit(" ", 1)[-1])
    return None if value is None else BarLine(value)


def parse_epoch_end_line(text: str) -> EpochEndLine | None:
    m = _EPOCH_END.match(text)
    if m is None:
        return None
    value = parse_number(m.group(1))
    return None if value is None else EpochEndLine(value)


def _from_tail(family: Family, step: int, epoch: int | None, steps: int | None, tail: str) -> tuple[StepLine, bool]:
    """The step line of a ``key: value, ...`` tail, and whether the tail has ``overflow cond``:
    by a known shape (:mod:`parsers.field_shapes`) when one matches, else field by field."""
    fields = read_fields(tail)
    if fields is not None:
        line = StepLine(family, step, epoch, steps, fields.scalars)
        line.overflow = fields.overflow
        return line, fields.overflow_cond
    pairs = split_fields(tail)
    line = _from_fields(family, step, epoch, steps, pairs)
    learn(tail)
    return line, any(key == "overflow cond" for key, _ in pairs)


def _from_fields(
    family: Family, step: int, epoch: int | None, steps: int | None, fields: list[tuple[str, str]]
) -> StepLine:
    scalars: dict[str, float] = {}
    line = StepLine(family, step, epoch, steps, scalars)
    for key, raw in fields:
        if key == "overflow cond" or key == "finite_grads":
            flag = parse_bool(raw)
            line.overflow = bool(flag) if key == "overflow cond" else flag is False
            continue
        tag = KEY_TAGS.get(key) or tag_for_key(key)
        if tag is None:
            continue
        if key == "loss":
            if raw.startswith("N/A"):
                line.loss_not_available = True
                continue
            if raw.startswith("[") and "/" in raw:
                raw = raw[1:].split("/", 1)[0]  # loss:[cur/avg]
        elif key == "grad_norm" and raw == _PP_PLACEHOLDER_NORM:
            continue
        value = parse_number(raw)
        if value is not None:
            scalars[tag] = value
    return line
