"""The parallel layout a rank's log states, carried in its run for the job-wide aggregate.

Why: under pipeline parallelism only the last stage's loss is valid, and which ranks that are
depends on the job's world size and stage count, which only the logs state
(:class:`~parsers.records.ParallelConfigLine`, :class:`~parsers.records.PipelineLine`). A node
sidecar sees them in its ranks' logs; ``mstb-sidecar aggregate`` sees only the event files. So
each rank's run gets a value :data:`LAYOUT_TAG` holding the layout as JSON, in the event before
the first training step written after the layout changed: once per run, and again when it
changes. What a rank's log stated, and whether its run shows it yet, is part of the checkpoint
(:class:`~sidecar.output.state_parts.NoteState`): a restart after the start-up lines does not read them again, and neither
forgets the layout nor writes it a second time. A training resume whose ``SessionLog.START``
purges the step the layout was written at makes it due again (:meth:`LayoutNote.purged`), so it
is written at the resume step, as the config card is.

The value is a string tensor like a text, but of a plugin of its own (:data:`LAYOUT_PLUGIN`),
which TensorBoard does not display: the Text tab lists the tags the README documents.

World sizes are kept one per kind (the last stated, the last derived), not merged: the reader
hands both to :meth:`~sidecar.analysis.aggregate.CrossRankAggregator.note_parallel`, whose rule
(stated wins) decides, as it does in the node sidecar.
"""

from __future__ import annotations

from pydantic import ValidationError
from tensorboard.compat.proto import summary_pb2

from parsers import tags
from parsers.records import ParallelConfigLine, PipelineLine
from sidecar.output.run_writer import text_value
from sidecar.output.state_parts import NoteState, ParallelLayout

LAYOUT_TAG = tags.PARALLEL_LAYOUT
LAYOUT_PLUGIN = "mstb-sidecar-parallel-layout"


def layout_value(layout: ParallelLayout) -> summary_pb2.Summary.Value:
    value = text_value(LAYOUT_TAG, layout.model_dump_json())
    value.metadata.plugin_data.plugin_name = LAYOUT_PLUGIN
    value.metadata.plugin_data.content = b""
    return value


def read_layout(value: summary_pb2.Summary.Value) -> ParallelLayout | None:
    """The layout a :func:`layout_value` holds; ``None`` for any other value, or a broken one."""
    if value.tag != LAYOUT_TAG or value.metadata.plugin_data.plugin_name != LAYOUT_PLUGIN or not value.tensor.string_val:
        return None
    try:
        return ParallelLayout.model_validate_json(value.tensor.string_val[0])
    except (ValidationError, ValueError):
        return None


class LayoutNote:
    """One rank's layout as its log states it, and whether its run shows that yet."""

    def __init__(self, saved: NoteState | None = None) -> None:
        self.layout = saved.layout if saved is not None else ParallelLayout()
        self._due = saved is not None and saved.due

    def snapshot(self) -> NoteState:
        return NoteState(layout=self.layout, due=self._due)

    def note(self, line: ParallelConfigLine | PipelineLine) -> None:
        if line == self.layout.pipeline:
            return  # the pipeline line repeats every step
        layout = self.layout.with_line(line)
        if layout != self.layout:
            self.layout, self._due = layout, True

    def purged(self) -> None:
        """A resume's START purged the step the run showed the layout at: write it again."""
        self._due = self._due or self.layout != ParallelLayout()

    def take(self) -> summary_pb2.Summary.Value | None:
        """The value to write before the next training step, if the layout changed."""
        if not self._due:
            return None
        self._due = False
        return layout_value(self.layout)
