"""The custom-scalars layout (TensorBoard's "Custom Scalars" tab), in a run of its own.

One category per metric, in :data:`parsers.tags.AGGREGATED` order (loss first), each with
"all ranks" (every rank's ``<tag>`` overlaid) and, next to it, "mean, min-max band" (the
aggregate's ``<tag>/mean`` between ``/min`` and ``/max``). A chart is there only for a tag a run
has: an empty "Matches (0)" chart says nothing.

Why a run of its own (``layout/<instance>``): the per-rank overlays must not depend on the
aggregate (``--no-aggregate``), and TensorBoard merges the layouts of all runs (categories by
title, identical charts once), so sidecars of several nodes sharing ``--out`` each add theirs.
The plugin reads the newest layout of a run, so when a tag appears that has no chart yet the
layout is written again one step later. It never shrinks: the last layout is read back at
start, so a restart that has not seen every rank yet keeps the charts of the others.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from pathlib import Path

from tensorboard.compat.proto import event_pb2
from tensorboard.plugins.custom_scalar import layout_pb2

from parsers.tags import AGGREGATED
from sidecar.output.event_file import event_files
from sidecar.output.run_writer import CUSTOM_SCALARS_TAG, RunWriter, custom_scalars_value
from sidecar.output.tfrecord import CorruptRecord, iter_records

LAYOUT_TAG = CUSTOM_SCALARS_TAG
OVERLAY = "all ranks"
BAND = "mean, min-max band"


class LayoutRun:
    """Keeps ``layout/<instance>`` showing a chart for every metric the runs have."""

    def __init__(self, writer: RunWriter) -> None:
        self.writer = writer
        self.overlays, self.bands = _charted(writer.run_dir)

    def update(self, rank_tags: Iterable[str], aggregate_tags: Iterable[str]) -> None:
        """Write the layout again if a rank run has a metric, or the aggregate a ``<metric>/mean``,
        that has no chart yet."""
        metrics = set(AGGREGATED)
        overlays = self.overlays | (metrics & set(rank_tags))
        bands = self.bands | (metrics & {t.removesuffix("/mean") for t in aggregate_tags if t.endswith("/mean")})
        if overlays == self.overlays and bands == self.bands:
            return
        self.overlays, self.bands = overlays, bands
        step = self.writer.view.watermarks.get(LAYOUT_TAG, -1) + 1
        self.writer.write_values(step, time.time(), [custom_scalars_value(_layout(overlays, bands))])


def _layout(overlays: set[str], bands: set[str]) -> layout_pb2.Layout:
    categories = []
    for tag in AGGREGATED:
        charts = []
        if tag in overlays:
            lines = layout_pb2.MultilineChartContent(tag=[f"^{re.escape(tag)}$"])
            charts.append(layout_pb2.Chart(title=f"{tag} ({OVERLAY})", multiline=lines))
        if tag in bands:
            band = layout_pb2.MarginChartContent.Series(value=f"{tag}/mean", lower=f"{tag}/min", upper=f"{tag}/max")
            charts.append(layout_pb2.Chart(title=f"{tag} ({BAND})", margin=layout_pb2.MarginChartContent(series=[band])))
        if charts:
            categories.append(layout_pb2.Category(title=tag, chart=charts))
    return layout_pb2.Layout(category=categories)


def _charted(run_dir: Path) -> tuple[set[str], set[str]]:
    """The metrics with an overlay and with a band in the run's newest layout."""
    newest = b""
    for path in event_files(run_dir):
        with open(path, "rb") as fh:
            try:
                for record in iter_records(fh):
                    for value in event_pb2.Event.FromString(record.payload).summary.value:
                        if value.tag == LAYOUT_TAG:
                            newest = b"".join(value.tensor.string_val)
            except CorruptRecord:
                pass  # TensorBoard stops reading a file here too
    overlays: set[str] = set()
    bands: set[str] = set()
    for category in layout_pb2.Layout.FromString(newest).category:
        for chart in category.chart:
            (overlays if chart.HasField("multiline") else bands).add(category.title)
    return overlays, bands
