"""Lines that are not step records but belong on the timeline (§5-§7 of the format reference):
eval results, checkpoint saves, lifecycle markers, the pipeline-parallel loss-validity warning,
and lines that mean trouble.
"""

from __future__ import annotations

import ast
import math
import re

from parsers.records import CheckpointLine, ErrorLine, EvalLine, Marker, MarkerLine, PipelineLine
from parsers.tags import EVAL_PREFIX, sanitize_tag
from parsers.values import parse_int64

_EVAL = re.compile(r"Eval result: (\{.*\}), eval time is (\S+) s\.?\s*$", re.S)
_NUMPY_SCALAR = re.compile(r"np\.\w+\(([^()]*)\)")
_NON_FINITE = re.compile(r"(?<![\w'\"])(-?)(nan|inf)\b")
_FINISH_SAVING = re.compile(r"Finish saving ckpt of epoch (\d+) step (\d+) using (\S+) seconds")
_SAVE_COST = re.compile(r"Save checkpoint cost time: (\S+?)s\.")
_PYNATIVE_SAVED = re.compile(r"Checkpoint saved at step (\d+) to ")
_PIPELINE_TEXT = "pipeline stages: "
_PIPELINE = re.compile(re.escape(_PIPELINE_TEXT) + r"(\d+) > 1, the loss on the last card is valid")
_ZERO_BUBBLE = "zero_bubble_v is enabled, loss is valid only on rank 0"

_MARKERS: tuple[tuple[str, Marker], ...] = (
    ("Model Compiling, Please Wait", Marker.COMPILE),
    ("Starting Training Model", Marker.TRAINING_START),
    ("Start training loop", Marker.TRAINING_START),
    ("Training Over", Marker.TRAINING_OVER),
    ("Training completed", Marker.TRAINING_OVER),
    ("Training success!", Marker.TRAINING_OVER),
    ("Start resume training from checkpoint", Marker.RESUME),
    ("Resume training starts from global step", Marker.RESUME),
)
_ERRORS = (
    "Traceback (most recent call last):",
    "terminate training",
    "stop training",
    "exit with exception",  # msrun: "Worker process <pid> exit with exception. Error code: N."
    "Distributed job exited with exception",  # and then its own RuntimeError
    "TREError",
)
# parse_marker_line finds nothing in a text that contains none of these.
NEEDLES = (*(needle for needle, _ in _MARKERS), _PIPELINE_TEXT, _ZERO_BUBBLE, *_ERRORS)


def parse_eval_line(text: str) -> EvalLine | None:
    m = _EVAL.match(text)
    if m is None:
        return None
    literal = _NON_FINITE.sub(r"'\1\2'", _NUMPY_SCALAR.sub(r"\1", m.group(1)))
    try:
        result = ast.literal_eval(literal)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    if not isinstance(result, dict):
        return None
    scalars: dict[str, float] = {}
    _flatten(result, EVAL_PREFIX, scalars)
    seconds = _float(m.group(2))
    return EvalLine(scalars, seconds)


def parse_checkpoint_line(text: str) -> CheckpointLine | None:
    m = _FINISH_SAVING.search(text)
    if m:
        return CheckpointLine(text.strip(), _float(m.group(3)))
    m = _SAVE_COST.search(text)
    if m:
        return CheckpointLine(text.strip(), _float(m.group(1)))
    if _PYNATIVE_SAVED.search(text):
        return CheckpointLine(text.strip(), None)
    return None


def parse_marker_line(text: str) -> MarkerLine | PipelineLine | ErrorLine | None:
    for needle, kind in _MARKERS:
        if needle in text:
            return MarkerLine(kind, text.strip(" ."))
    m = _PIPELINE.search(text)
    stages = parse_int64(m.group(1)) if m else None
    if stages is not None:
        return PipelineLine(stages)
    if _ZERO_BUBBLE in text:
        return PipelineLine(None, rank0_only=True)
    for needle in _ERRORS:
        if needle in text:
            return ErrorLine(text.strip())
    return None


def _flatten(value: object, prefix: str, out: dict[str, float]) -> None:
    if isinstance(value, dict):
        for key, inner in value.items():
            _flatten(inner, f"{prefix}{sanitize_tag(str(key))}/", out)
        return
    number = _float(value) if isinstance(value, (int, float, str)) and not isinstance(value, bool) else None
    if number is not None:
        out[prefix.rstrip("/")] = number


def _float(value: object) -> float | None:
    """The number, or ``None``; an integer beyond the float range is ``+/-inf`` (see :mod:`parsers.values`)."""
    try:
        return float(value)  # type: ignore[arg-type]
    except OverflowError:
        return math.inf if value > 0 else -math.inf  # type: ignore[operator]
    except (TypeError, ValueError):
        return None
