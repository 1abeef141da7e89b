"""Per-stream record assembly: typed lines of ONE rank in, complete step records out.

What it adds to the line parsers:

- joins the r0.7+ two-line record (head + progress bar) and the r0.2-r0.6 step line with the
  epoch-end line that carries its true per-step time in sink mode;
- computes the global step ``(epoch - base) * steps_per_epoch + step`` (PyNative steps are
  already global; the experimental trainer's epoch-local steps continue across epochs), and
  never emits one beyond int64, TensorBoard's step type (:meth:`StreamAssembler.take_malformed`);
- attaches eval, checkpoint and lifecycle lines to the step of the last training step.

A held line (a head waiting for its bar) is released by its companion, by the next record,
by :meth:`flush_due` after ``companion_wait`` seconds, or by :meth:`flush` at end of input.
A head released without its bar stays *open* until the next step line: a bar that comes after
all (a stop between the two lines, a block-buffered stdout, a replay that ended between them and
goes on later) gives a ``late`` record of that step with the throughput. The open step is part of
:meth:`snapshot`, so the checkpoint that passed the head keeps it.
:attr:`pending_offset` tells the caller where the oldest held line starts, so an offset
checkpoint never skips a line whose record has not been emitted yet. Time is passed in,
never read, so the class stays pure and deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

from parsers import tags
from parsers.records import (
    BarLine,
    CheckpointLine,
    EpochEndLine,
    ErrorLine,
    EvalLine,
    Family,
    MarkerLine,
    MonitorLine,
    ParallelConfigLine,
    ParsedLine,
    PipelineLine,
    Record,
    StepLine,
)
from parsers.values import fits_int64

ERROR_TAG = "events/error"


@dataclass(slots=True)
class _Held:
    record: Record
    offset: int
    origin: object  # the caller's name for the file the held line is in
    since: float
    wants: type  # BarLine or EpochEndLine


class StreamAssembler:
    """Assembles one rank's records from one source; see the module docstring."""

    def __init__(self, companion_wait: float = 0.5) -> None:
        self.companion_wait = companion_wait
        self.last_step = 0
        self.last_wall: float | None = None
        self.family: Family | None = None
        self.pipeline: PipelineLine | None = None
        self._held: _Held | None = None
        self._open = -1  # the step last released without the bar it waited for (-1: none)
        self._r0_epoch_end: bool | None = None  # does this stream print epoch-end lines?
        self._exp_epoch = -1
        self._exp_offset = 0
        self.malformed = 0  # step lines dropped and not yet taken (take_malformed)

    @property
    def pending_offset(self) -> int | None:
        return None if self._held is None else self._held.offset

    @property
    def pending_origin(self) -> object:
        """The ``origin`` given with the held line: one stream can span a rotation chain's files,
        and a head held at the end of ``info.log.1`` is completed by a bar at the start of ``info.log``."""
        return None if self._held is None else self._held.origin

    def take_malformed(self) -> int:
        """Step lines dropped since the last call because the global step they continue to does
        not fit int64 (only the experimental trainer's running count can get there; the line
        parsers reject every other such step). The caller counts them as malformed."""
        count, self.malformed = self.malformed, 0
        return count

    def snapshot(self) -> dict[str, int]:
        """The state a restarted reader needs to number steps exactly as before."""
        return {"last_step": self.last_step, "exp_epoch": self._exp_epoch, "exp_offset": self._exp_offset,
                "open_step": self._open}

    def restore(self, snap: dict[str, int]) -> None:
        self.last_step = int(snap.get("last_step", 0))
        self._open = int(snap.get("open_step", -1))
        self._exp_epoch = int(snap.get("exp_epoch", -1))
        self._exp_offset = int(snap.get("exp_offset", 0))

    def feed(
        self, parsed: ParsedLine | None, timestamp: float | None, offset: int, now: float, origin: object = None
    ) -> list[Record]:
        if timestamp is not None:
            self.last_wall = timestamp
        if parsed is None:
            return []
        wall = timestamp if timestamp is not None else self.last_wall
        out: list[Record] = []
        if isinstance(parsed, BarLine):
            if self._held is not None and self._held.wants is BarLine:
                self._held.record.scalars[tags.THROUGHPUT] = parsed.throughput
                out.append(self._release())
            elif self._held is None and self._open >= 0:
                out.append(Record(self._open, wall, {tags.THROUGHPUT: parsed.throughput}, late=True))
                self._open = -1
            return out
        if isinstance(parsed, EpochEndLine):
            if self._held is not None and self._held.wants is EpochEndLine:
                self._r0_epoch_end = True
                self._held.record.scalars[tags.ITERATION_TIME] = parsed.per_step_ms
                out.append(self._release())
            return out
        if isinstance(parsed, MonitorLine):
            return [Record(parsed.global_step(), wall, {parsed.tag: parsed.value})]
        if isinstance(parsed, PipelineLine):
            self.pipeline = parsed
            return []
        if isinstance(parsed, ParallelConfigLine):  # start-up configuration, for the aggregate only
            return []
        if isinstance(parsed, ErrorLine):  # other threads' errors can land between a head and its bar
            return [Record(self.last_step, wall, texts={ERROR_TAG: parsed.text})]
        if self._held is not None:
            if isinstance(parsed, StepLine) and self._held.wants is EpochEndLine:
                self._learn_no_epoch_end()
            out.append(self._release())
        if isinstance(parsed, StepLine):
            out.extend(self._step(parsed, wall, offset, now, origin))
        elif isinstance(parsed, EvalLine):
            scalars = dict(parsed.scalars)
            if parsed.seconds is not None:
                scalars[tags.EVAL_TIME] = parsed.seconds
            out.append(Record(self.last_step, wall, scalars))
        elif isinstance(parsed, CheckpointLine):
            scalars = {} if parsed.seconds is None else {tags.CHECKPOINT_SAVE_TIME: parsed.seconds}
            out.append(Record(self.last_step, wall, scalars, {tags.TEXT_CHECKPOINT: parsed.text}))
        elif isinstance(parsed, MarkerLine):
            out.append(Record(self.last_step, wall, texts={f"events/{parsed.kind.value}": parsed.text}))
        return out

    def flush_due(self, now: float) -> list[Record]:
        if self._held is not None and now - self._held.since >= self.companion_wait:
            if self._held.wants is EpochEndLine:
                self._learn_no_epoch_end()
            return [self._release_open()]
        return []

    def flush(self) -> list[Record]:
        return [self._release_open()] if self._held is not None else []

    def _release_open(self) -> Record:
        """Release the held line without its companion; a head stays open for a late bar."""
        assert self._held is not None
        if self._held.wants is BarLine:
            self._open = self._held.record.step
        return self._release()

    def _step(self, line: StepLine, wall: float | None, offset: int, now: float, origin: object) -> list[Record]:
        self.family = line.family
        self._open = -1
        step = self._global_step(line)
        if not fits_int64(step):
            self.malformed += 1
            return []
        self.last_step = step
        record = Record(
            step,
            wall,
            line.scalars,
            training_step=True,
            family=line.family,
            overflow=line.overflow,
            loss_not_available=line.loss_not_available,
        )
        if line.needs_bar:
            self._held = _Held(record, offset, origin, now, BarLine)
            return []
        if line.family is Family.R0X and self._r0_epoch_end is not False:
            self._held = _Held(record, offset, origin, now, EpochEndLine)
            return []
        return [record]

    def _global_step(self, line: StepLine) -> int:
        step = line.global_step()
        if step is not None:
            return step
        # Experimental trainer: epoch-local steps of unknown epoch length continue the count.
        if line.epoch != self._exp_epoch:
            if self._exp_epoch >= 0 and line.step <= self.last_step - self._exp_offset:
                self._exp_offset = self.last_step
            self._exp_epoch = line.epoch
        return self._exp_offset + line.step

    def _learn_no_epoch_end(self) -> None:
        if self._r0_epoch_end is None:  # once seen, a late epoch-end line does not unlearn it
            self._r0_epoch_end = False

    def _release(self) -> Record:
        held = self._held
        assert held is not None
        self._held = None
        return held.record
