"""Typed records: what one log line says (``*Line``) and what one rank's stream means (``Record``).

Line types are what :func:`parsers.line.parse_message` returns for a single message. They are
not yet useful on their own: a graph-trainer step is two lines (head and progress bar), an r0.x
step may be followed by its epoch-end timing line, and eval/checkpoint lines carry no global step.
:class:`parsers.assembler.StreamAssembler` turns a stream of them into :class:`Record` values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Family(str, Enum):
    """Which mindformers step-record shape a line has (reported in the replay summary)."""

    R0X = "r0.2-r0.6 one-line"
    GRAPH = "r0.7+ graph trainer"
    PYNATIVE = "v1.9+ PyNative trainer"
    EXPERIMENTAL = "v1.3-v1.6 experimental PyNative"


@dataclass(slots=True)
class StepLine:
    """A training-step record (or the head line of a two-line one).

    ``epoch``/``steps`` are ``None`` when the line's step is already global (PyNative).
    ``needs_bar``: a graph-trainer head; its progress-bar line follows.
    ``epoch_base``: 1 for every version but r0.2, whose epochs print 0-based.
    """

    family: Family
    step: int
    epoch: int | None
    steps: int | None
    scalars: dict[str, float]
    needs_bar: bool = False
    epoch_base: int = 1
    overflow: bool = False
    loss_not_available: bool = False

    def global_step(self) -> int | None:
        """``(epoch - epoch_base) * steps + step``, or the step when it is already global;
        ``None`` when it depends on the stream (the experimental trainer's epoch-local steps)."""
        if self.epoch is None:
            return self.step
        if self.steps is None:
            return None
        return (self.epoch - self.epoch_base) * self.steps + self.step


@dataclass(slots=True)
class BarLine:
    """The r0.7+ progress-bar line that closes a two-line step record."""

    throughput: float


@dataclass(slots=True)
class EpochEndLine:
    """r0.2-r0.6 ``... per step time: X ms ...`` line that follows a step line in sink mode."""

    per_step_ms: float


@dataclass(slots=True)
class MonitorLine:
    """TrainingStateMonitor ``Epoch:[e/E], step:[s/S] <tag>: <value>`` (v1.5+)."""

    epoch: int
    steps: int
    step: int
    tag: str
    value: float

    def global_step(self) -> int:
        return (self.epoch - 1) * self.steps + self.step


@dataclass(slots=True)
class EvalLine:
    """``Eval result: {...}, eval time is T s.``: metrics keyed ``eval/<Metric>/<key>``."""

    scalars: dict[str, float]
    seconds: float | None


@dataclass(slots=True)
class CheckpointLine:
    """A finished checkpoint save, with its duration when the line states one."""

    text: str
    seconds: float | None


class Marker(str, Enum):
    """Lifecycle moments worth a text event (tag ``events/<value>``)."""

    COMPILE = "compile"
    TRAINING_START = "training-start"
    TRAINING_OVER = "training-over"
    RESUME = "resume"


@dataclass(slots=True)
class MarkerLine:
    kind: Marker
    text: str


@dataclass(slots=True)
class PipelineLine:
    """Which ranks' loss is valid: ``pipeline stages: P > 1`` or the zero-bubble-V warning."""

    stages: int | None
    rank0_only: bool = False


@dataclass(slots=True)
class ParallelConfigLine:
    """The job's world size, from a start-up line (:mod:`parsers.parallel_lines`).

    ``derived``: dp*mp*cp*pp of the parallel_config dict, exact under semi_auto_parallel only;
    a line that states device_num wins over it.
    """

    world_size: int
    derived: bool = False


@dataclass(slots=True)
class ErrorLine:
    """A line that means trouble (traceback, NaN/Inf abort, worker exit)."""

    text: str


@dataclass(slots=True)
class MalformedLine:
    """Starts like a step record but does not parse: counted as a bad line, then skipped."""

    text: str


ParsedLine = (
    StepLine
    | BarLine
    | EpochEndLine
    | MonitorLine
    | EvalLine
    | CheckpointLine
    | MarkerLine
    | PipelineLine
    | ParallelConfigLine
    | ErrorLine
    | MalformedLine
)


@dataclass(slots=True)
class Record:
    """Everything one rank reported about one global step, ready to become one TensorBoard event.

    ``training_step`` marks step records proper: only they move a stream's step forward
    (and backwards, on a training resume). Eval, checkpoint and marker records are attached
    to the step of the last training step seen on the stream; a ``late`` one carries what a
    progress bar added to a step whose head was released without it.
    """

    step: int
    wall_time: float | None
    scalars: dict[str, float] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)
    training_step: bool = False
    family: Family | None = None
    overflow: bool = False
    loss_not_available: bool = False
    late: bool = False  # the rest of a step already released: its bar, read after the head was let go
