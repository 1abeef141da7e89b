"""A rank's lifecycle from its records: running, finished (``Training Over!``) or failed.

The last record that says something decides: a training step, a start or resume marker mean
running; a finish marker (``.........Training Over!.............`` of the graph trainer, the
PyNative trainer's ``Training completed``, §6 of the format reference) means finished; an error
line (a traceback, a NaN/Inf abort, msrun's ``Worker process ... exit with exception``, §7) means
failed. Checkpoint, eval and compile lines say nothing: a save logged after ``Training Over!`` is
still a finished job. A job that logs steps again after a finish or a failure (a relaunch
appending to the same file) is running again.

Pure: records in, a verdict out; who keeps the state is :mod:`sidecar.analysis.alerts`.
"""

from __future__ import annotations

from enum import Enum

from parsers.assembler import ERROR_TAG
from parsers.records import Marker, Record


class Lifecycle(str, Enum):
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"


_RUNNING_TAGS = (f"events/{Marker.TRAINING_START.value}", f"events/{Marker.RESUME.value}")
_FINISHED_TAG = f"events/{Marker.TRAINING_OVER.value}"


def lifecycle_of(record: Record) -> Lifecycle | None:
    """What ``record`` says of its rank's lifecycle, or ``None`` when it says nothing.
    A record with several texts: failure before finish before running (an error logged with
    the finish is still an error)."""
    if record.training_step:
        return Lifecycle.RUNNING
    texts = record.texts
    if not texts:
        return None
    if ERROR_TAG in texts:
        return Lifecycle.FAILED
    if _FINISHED_TAG in texts:
        return Lifecycle.FINISHED
    if any(tag in texts for tag in _RUNNING_TAGS):
        return Lifecycle.RUNNING
    return None
