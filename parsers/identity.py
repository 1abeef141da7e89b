"""A step record's identity: what makes two copies of it the same record.

Two readers need the same answer: the rank sequencer (:mod:`sidecar.analysis.sequencer`), which
judges records as they are read, and the read-back of a run's event files
(:mod:`sidecar.output.event_scan`), which tells what a run already holds. So the identity is made
here, below both, from what both have: the step, the line's own timestamp and the loss as the
event stores it (float32; a finite loss beyond float32 is +-inf there and here, never an error).
Both remember at most :data:`WINDOW` identities.
"""

from __future__ import annotations

import struct

from parsers import tags
from parsers.records import Record
from parsers.values import float32

WINDOW = 2048

Identity = tuple[int, float | None, int | None]

_BITS = struct.Struct("<I")


def identity(step: int, wall: float | None, loss: float | None) -> Identity:
    """Step, timestamp, and the loss's float32 bits (``None``: no loss)."""
    bits = None if loss is None else _BITS.unpack(float32(loss))[0]
    return (step, wall, bits)


def record_identity(record: Record) -> Identity:
    return identity(record.step, record.wall_time, record.scalars.get(tags.LOSS))
