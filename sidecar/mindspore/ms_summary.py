"""Read MindSpore ``SummaryRecord``/``SummaryCollector`` files as TensorBoard values.

MindSpore frames its files exactly like TensorBoard (TFRecord) but its ``Summary.Value`` is not
TensorFlow's: the scalar sits in field 3 instead of 2, the histogram in field 9 (TF's
``metadata``) and the tensor uses anf_ir's ``TensorProto``. Stock TensorBoard therefore drops
everything but images, silently. This module decodes MindSpore's messages and re-expresses them
as TensorBoard ``Summary.Value`` protos; it needs no MindSpore at runtime.

The field numbers come from MindSpore's own ``mindspore/ccsrc/utils/summary.proto`` and
``anf_ir.proto``; ``tests/test_ms_summary.py`` checks them against files real MindSpore wrote.
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError
from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary

from sidecar.following.discovery import SUMMARY_NAME
from sidecar.output.tfrecord import CorruptRecord, iter_records

log = logging.getLogger(__name__)

# The subset of MindSpore's summary.proto / anf_ir.proto / lineage.proto (2.x, package
# mindspore.irpb) that conversion needs. Only field numbers and wire types must match; the
# names are ours. Everything is optional (MindSpore's `required` is not enforced on read), nested
# messages are flattened, map<> fields are spelled as their wire-identical repeated entries,
# the DataType enum is read as int32, and the lineage fields are named as the keys that
# read_lineage() returns. Dynamic descriptors, rather than protoc output, keep this working on
# every protobuf runtime from 4.x to 7.x (generated code is tied to its generator's version).
_PROTO = """
message Event { double wall_time = 1; int64 step = 2; string version = 3; bytes graph_def = 4;
  Summary summary = 5; }
message Summary { repeated Value value = 1; }
message Value { string tag = 1; float scalar_value = 3; Image image = 4; Tensor tensor = 8;
  Histogram histogram = 9; bytes loss_landscape = 10; }
message Image { int32 height = 1; int32 width = 2; int32 colorspace = 3; bytes encoded_image = 4; }
message Histogram { repeated Bucket buckets = 1; int64 nan_count = 2; int64 pos_inf_count = 3;
  int64 neg_inf_count = 4; double max = 5; double min = 6; double sum = 7; int64 count = 8; }
message Bucket { double left = 1; double width = 2; int64 count = 3; }
message Tensor { repeated int64 dims = 1; int32 data_type = 2; repeated float float_data = 3;
  repeated int32 int32_data = 4; repeated int64 int64_data = 5; repeated double double_data = 6;
  repeated uint64 uint64_data = 7; }
message LineageEvent { double wall_time = 1; int64 step = 2; TrainLineage train_lineage = 6;
  UserDefinedInfo user_defined_info = 10; }
message TrainLineage { HyperParameters hyper_parameters = 1; TrainDataset train_dataset = 2;
  Algorithm algorithm = 3; Model model = 4; }
message HyperParameters { string optimizer = 1; float learning_rate = 2; string loss_function = 3;
  int32 epoch = 4; string parallel_mode = 5; int32 device_num = 6; int32 batch_size = 8; }
message TrainDataset { string train_dataset_path = 1; int32 train_dataset_size = 2; }
message Algorithm { string network = 1; float final_loss = 2; }
message Model { string model_path = 3; int64 model_size = 4; }
message UserDefinedInfo { repeated UserDefinedInfo user_info = 1; repeated Int32Entry map_int32 = 3;
  repeated StrEntry map_str = 4; repeated DoubleEntry map_double = 5; }
message Int32Entry { string key = 1; int32 value = 2; }
message StrEntry { string key = 1; string value = 2; }
message DoubleEntry { string key = 1; double value = 2; }
"""
_PACKAGE = "mstb.mindspore"
_F = descriptor_pb2.FieldDescriptorProto
_SCALAR_TYPES = {
    "double": _F.TYPE_DOUBLE, "float": _F.TYPE_FLOAT, "int32": _F.TYPE_INT32,
    "int64": _F.TYPE_INT64, "uint64": _F.TYPE_UINT64, "string": _F.TYPE_STRING,
    "bytes": _F.TYPE_BYTES,
}


def _message_classes(source: str) -> dict[str, Any]:
    """Build message classes from the mini-proto above in a private descriptor pool."""
    fdp = descriptor_pb2.FileDescriptorProto(name="mstb_mindspore.proto", package=_PACKAGE)
    for name, body in re.findall(r"message (\w+) \{([^}]*)\}", source):
        msg = fdp.message_type.add(name=name)
        for rep, ftype, fname, num in re.findall(r"(repeated )?(\w+) (\w+) = (\d+);", body):
            field = msg.field.add(name=fname, number=int(num),
                                  label=_F.LABEL_REPEATED if rep else _F.LABEL_OPTIONAL)
            if ftype in _SCALAR_TYPES:
                field.type = _SCALAR_TYPES[ftype]
            else:
                field.type, field.type_name = _F.TYPE_MESSAGE, f".{_PACKAGE}.{ftype}"
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(fdp.SerializeToString())
    get_class = getattr(message_factory, "GetMessageClass", None)  # protobuf >= 4.22
    if get_class is None:
        get_class = message_factory.MessageFactory(pool).GetPrototype  # type: ignore[attr-defined]
    return {m.name: get_class(pool.FindMessageTypeByName(f"{_PACKAGE}.{m.name}"))
            for m in fdp.message_type}


_MSG = _message_classes(_PROTO)

# A record header's u64 length is < 2**32 (tfrecord caps it far lower), so its bytes 4..7
# are zero; resync only tries offsets where they are.
_ZERO_HIGH_BYTES = b"\0\0\0\0"
_SCAN_BYTES = 1 << 20
_MAX_BINS = 90  # MindSpore's own cap for histogram buckets


class ConvertedEvent(NamedTuple):
    """One MindSpore Event as TensorBoard values; all values share step and wall time."""

    step: int
    wall_time: float
    values: list[Summary.Value]


def find_summary_files(directory: str | Path) -> list[Path]:
    """The ``*_MS`` summary and ``*_lineage`` files in ``directory``, oldest first.

    The name embeds the ``SummaryRecord`` creation time in whole seconds, so that (then the
    name) is the write order; the directory's subdirectories are not searched (one dir = one run).
    """
    found = []
    for path in Path(directory).iterdir():
        match = SUMMARY_NAME.fullmatch(path.name)
        if match and path.is_file():
            found.append((int(match.group(1)), path.name, path))
    return [path for _, _, path in sorted(found)]


class _RecordFollower:
    """Tails one TFRecord file by offset, skipping over corrupt stretches.

    Resync strategy: after a CRC failure at offset ``o``, scan forward from ``o + 1`` for the
    first offset where a complete record verifies (both CRCs), or where one may still be
    completing at the end of the file, and go on from there. The corrupt stretch (normally one
    record) is counted once in ``corrupt_records``. Unlike MindInsight, which stops the file,
    this keeps the rest of the training visible.
    """

    def __init__(self, path: str | Path, offset: int = 0) -> None:
        self.path = Path(path)
        self.offset = offset
        self.corrupt_records = 0
        self._resyncing = False

    def payloads(self) -> Iterator[bytes]:
        """Yield payloads of records completed since the last call; a partial tail waits."""
        with open(self.path, "rb") as fh:  # read-only: inputs are chmod 0400 once closed
            if os.fstat(fh.fileno()).st_size < self.offset:
                # A SummaryRecord opened in the same second in the same dir reuses the name and
                # truncates the file (open 'w'); start over rather than wait forever.
                log.warning("%s shrank below offset %d; rereading from 0", self.path, self.offset)
                self.offset, self._resyncing = 0, False
                self._restarted()
            while True:
                try:
                    for record in iter_records(fh, self.offset):
                        self.offset, self._resyncing = record.end, False
                        yield record.payload
                    return
                except CorruptRecord as exc:
                    if not self._resyncing:
                        self.corrupt_records += 1
                        log.warning("%s: %s at offset %d, scanning for the next record",
                                    self.path, exc.args[0], exc.args[1])
                    self._resyncing = True
                    self._resync(fh, exc.args[1])

    def _restarted(self) -> None:
        """Hook: the file was truncated and is read again from offset 0."""

    def _resync(self, fh: BinaryIO, bad: int) -> None:
        """Set ``offset`` to the next plausible record start after ``bad`` (see class doc)."""
        pos = bad + 1
        while True:
            fh.seek(pos)
            chunk = fh.read(_SCAN_BYTES)
            i = chunk.find(_ZERO_HIGH_BYTES, 4)
            while i != -1:
                try:
                    next(iter_records(fh, pos + i - 4), None)
                except CorruptRecord:
                    i = chunk.find(_ZERO_HIGH_BYTES, i + 1)
                    continue
                self.offset = pos + i - 4
                return
            if len(chunk) < _SCAN_BYTES:  # end of file: the last 7 offsets are not decidable yet
                self.offset = max(pos, pos + len(chunk) - 7)
                return
            pos += len(chunk) - 7


class MsSummaryFile(_RecordFollower):
    """Incremental converter of one ``*_MS`` file (which may still be growing).

    ``offset`` is the end of the last consumed record: persist it and pass it back to resume.
    ``skipped`` counts values and records not converted, by reason.
    """

    def __init__(self, path: str | Path, offset: int = 0) -> None:
        super().__init__(path, offset)
        self.skipped: Counter[str] = Counter()
        # SummaryCollector records an epoch's last step twice (step_end, then epoch_end) with
        # identical values; keeping the first copy lets a live follower emit it at once.
        self._last_step: dict[str, int] = {}

    def _restarted(self) -> None:
        self._last_step.clear()
        self.skipped["truncated"] += 1

    def read_new(self) -> list[ConvertedEvent]:
        """Convert the records completed since the last call (version and graph records dropped)."""
        events = []
        for payload in self.payloads():
            event = _MSG["Event"]()
            try:
                event.ParseFromString(payload)
            except DecodeError:
                self.skipped["undecodable"] += 1
                continue
            if event.HasField("graph_def"):
                self.skipped["graph"] += 1
            if not event.HasField("summary"):
                continue
            values = []
            for value in event.summary.value:
                if self._last_step.get(value.tag) == event.step:
                    self.skipped["duplicate"] += 1
                    continue
                self._last_step[value.tag] = event.step
                converted = _convert(value)
                if not converted:
                    self.skipped["unsupported"] += 1
                values += converted
            if values:
                events.append(ConvertedEvent(event.step, event.wall_time, values))
        return events


def _convert(value: Any) -> list[Summary.Value]:
    """One MindSpore ``Summary.Value`` as TensorBoard values (none if it has no TB equivalent)."""
    tag = value.tag
    if value.HasField("scalar_value"):
        return [Summary.Value(tag=tag, simple_value=value.scalar_value)]
    if value.HasField("image"):  # same message in both formats
        img = value.image
        return [Summary.Value(tag=tag, image=Summary.Image(
            height=img.height, width=img.width, colorspace=img.colorspace,
            encoded_image_string=img.encoded_image))]
    if value.HasField("histogram"):
        hist = value.histogram
        counts = [b.count for b in hist.buckets]
        # MindSpore keeps no sum of squares: estimate it from bucket centres clamped to the data
        # range (exact when min == max). TensorBoard's dashboards do not use it; others may.
        sum_squares = sum(b.count * min(max(b.left + b.width / 2, hist.min), hist.max) ** 2
                          for b in hist.buckets)
        return [_histogram(tag, [b.left + b.width for b in hist.buckets], counts,
                           hist.min, hist.max, hist.sum, sum_squares),
                *_nonfinite(tag, hist.nan_count, hist.pos_inf_count, hist.neg_inf_count)]
    if value.HasField("tensor"):
        return _tensor(tag, value.tensor)
    return []  # loss landscape: no TensorBoard equivalent


def _histogram(tag: str, limits: Any, counts: Any, lo: float, hi: float, total: float,
               sum_squares: float) -> Summary.Value:
    """A TF ``HistogramProto``: ``bucket_limit[i]`` is bucket i's right edge, ``min`` the 1st left.

    TensorBoard's legacy-histogram migration drops empty end buckets and uses ``min``/``max``
    as the outer edges, so they carry the data range, not the bucket range.
    """
    return Summary.Value(tag=tag, histo=HistogramProto(
        min=lo, max=hi, num=float(sum(counts)), sum=total, sum_squares=sum_squares,
        bucket_limit=[float(x) for x in limits], bucket=[float(c) for c in counts]))


def _nonfinite(tag: str, nan: int, pos_inf: int, neg_inf: int) -> list[Summary.Value]:
    """NaN/±inf counts have no histogram field: scalars ``<tag>/nan_count`` etc., when nonzero."""
    counts = {"nan_count": nan, "pos_inf_count": pos_inf, "neg_inf_count": neg_inf}
    return [Summary.Value(tag=f"{tag}/{name}", simple_value=n) for name, n in counts.items() if n]


def _tensor(tag: str, tensor: Any) -> list[Summary.Value]:
    """A 1-element tensor becomes a scalar, a larger one a histogram of its values (shape is lost).

    MindSpore's summary writer puts every dtype into ``float_data`` (float32); the other
    repeated fields are read for completeness. An empty tensor converts to nothing.
    """
    import numpy as np  # only for MindSpore summaries: replay and the daemon start without it

    data = (tensor.float_data or tensor.double_data or tensor.int64_data or tensor.int32_data
            or tensor.uint64_data)
    values = np.asarray(data, dtype=np.float64)
    if values.size == 1:
        return [Summary.Value(tag=tag, simple_value=float(values[0]))]
    if values.size == 0:
        return []
    finite = values[np.isfinite(values)]
    nonfinite = _nonfinite(tag, int(np.isnan(values).sum()), int(np.isposinf(values).sum()),
                           int(np.isneginf(values).sum()))
    if finite.size == 0:
        return [_histogram(tag, [], [], 0.0, 0.0, 0.0, 0.0), *nonfinite]
    counts, edges = np.histogram(finite, bins=min(_MAX_BINS, finite.size // 10 + 1))
    return [_histogram(tag, edges[1:], counts, float(finite.min()), float(finite.max()),
                       float(finite.sum()), float(finite @ finite)), *nonfinite]


def read_lineage(path: str | Path) -> dict[str, str | int | float]:
    """Training parameters from a ``*_lineage`` file, flat, for a TensorBoard text event.

    Keys: optimizer, learning_rate, loss_function, epoch, parallel_mode, device_num,
    batch_size, train_dataset_path, train_dataset_size, network (model class), final_loss,
    model_path, model_size (only those MindSpore set), plus ``custom_lineage_data`` entries,
    which never override the built-in keys. The learning rate exists only here, never as a
    scalar. Floats are float32 on disk and returned at float32's shortest round-trip decimal.
    """
    import numpy as np  # for float32's shortest decimal

    train: dict[str, str | int | float] = {}
    custom: dict[str, str | int | float] = {}
    for payload in _RecordFollower(path).payloads():
        event = _MSG["LineageEvent"]()
        try:
            event.ParseFromString(payload)
        except DecodeError:
            continue
        if event.HasField("train_lineage"):
            for _, part in event.train_lineage.ListFields():
                for field, val in part.ListFields():
                    is_f32 = field.type == field.TYPE_FLOAT
                    train[field.name] = float(str(np.float32(val))) if is_f32 else val
        for info in [event.user_defined_info, *event.user_defined_info.user_info]:
            for entry in [*info.map_int32, *info.map_str, *info.map_double]:
                custom[entry.key] = entry.value
    return {**custom, **train}
