"""mindformers' ``batch-size``, ``B-samples-per-day`` and ``<tag> vs samples`` tags, from the log.

mindformers' graph trainer (v1.4+, ``MFLossMonitor.print_output_info``) writes, with its
TensorBoard on: ``batch-size`` = the global batch size at each global step; ``B-samples-per-day``
= throughput (samples/s per device) x group size x 86400 / 1e9 at each step; and for
``learning-rate``, ``batch-size``, ``loss``, ``grad-norm`` (and ``loss-scale``, ``iteration-time``,
``throughput`` with its flags) a twin ``"<tag> vs samples"`` at step = global step x global batch
size, which tensorboardX's ``_clean_tag`` stores as ``<tag>_vs_samples``. The global batch size
and the world size come from the start-up lines (:mod:`parsers.run_config`); without them there
are none of these tags.

Where the twins go: a run of their own, ``<rank run>/vs_samples``, not the rank's run as
mindformers does. A training resume at step S writes a ``SessionLog.START`` at S into the rank's
run, and TensorBoard then drops every tag's points with step >= S, which in the rank's run would
also drop the twins of steps S/GBS .. S-1 (their steps are x GBS). In their own run they get
their own START, at S x GBS, which drops exactly the twins a resume supersedes. Tag names are
mindformers', so TensorBoard's Scalars tab shows them in the same card as mindformers' own.

Across a SIGKILL: the twins' run reaches the disk no later than the rank's run
(:meth:`RunWriter.derive <sidecar.output.run_writer.RunWriter.derive>`), since a restart derives
twins only from records the rank's run does not show yet.
"""

from __future__ import annotations

from collections.abc import Callable

from parsers import tags
from parsers.records import Record
from parsers.values import INT64_MAX
from sidecar.output.run_writer import RunWriter

B_SAMPLES_PER_DAY = "B-samples-per-day"
SAMPLES_RUN = "vs_samples"
TWINNED = (tags.LEARNING_RATE, tags.BATCH_SIZE, tags.LOSS, tags.LOSS_SCALE, tags.GRAD_NORM, tags.ITERATION_TIME,
           tags.THROUGHPUT)
SECONDS_PER_DAY = 86400


def twin_tag(tag: str) -> str:
    """tensorboardX's stored name of ``"<tag> vs samples"``."""
    return f"{tag}_vs_samples"


class SampleTags:
    """Adds the batch-derived tags to a rank's training records and writes their twins.

    ``batch(rank)`` is the rank's (global batch size, world size), either ``None`` when unknown;
    ``writer(rank)`` the writer of its twins' run.
    """

    def __init__(self, batch: Callable[[int], tuple[int | None, int | None]], writer: Callable[[int], RunWriter]) -> None:
        self._batch = batch
        self._writer = writer

    def derive(self, rank: int, record: Record) -> None:
        """Add ``batch-size`` and ``B-samples-per-day`` to a training record (a ``late`` part of
        one gets the latter only: the step has its batch size already)."""
        gbs, world = self._batch(rank)
        if gbs is None:
            return
        scalars = record.scalars
        if record.training_step:
            scalars.setdefault(tags.BATCH_SIZE, float(gbs))
        throughput = scalars.get(tags.THROUGHPUT)
        if throughput is not None and world is not None:
            scalars[B_SAMPLES_PER_DAY] = throughput * world * SECONDS_PER_DAY / 1e9

    def twins(self, rank: int, record: Record) -> None:
        """Write the twins of the record's scalars (those ``--every`` kept) at step x GBS."""
        gbs, _ = self._batch(rank)
        if gbs is None:
            return
        samples = record.step * gbs
        twins = {twin_tag(tag): value for tag, value in record.scalars.items() if tag in TWINNED}
        if twins and samples <= INT64_MAX:
            self._writer(rank).write(Record(samples, record.wall_time, scalars=twins))

    def open(self, rank: int) -> None:
        """Open the twins' run without writing: a writer opened after a restart hands the other
        outputs what the run holds past the checkpoint, which they may have lost with the process."""
        if self._batch(rank)[0] is not None:
            self._writer(rank)

    def resume(self, rank: int, step: int, wall_time: float | None) -> None:
        """The rank's training went back to ``step``: supersede the twins from ``step x GBS`` on."""
        gbs, _ = self._batch(rank)
        if gbs is not None and step * gbs <= INT64_MAX:
            self._writer(rank).resume(step * gbs, wall_time, f"training resumed at step {step} ({step * gbs} samples)")
