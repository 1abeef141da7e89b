"""MindSpore-mode conversion, checked against files written by real MindSpore on CPU.

MindSpore runs in a subprocess: SummaryRecord forks a writer pool and allows one instance per
process, which should not leak into the rest of the suite. Only the corruption and
partial-record cases edit bytes, and only of those real files.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from live_helpers import paced, wait_until
from mindspore_required import require_mindspore
from tensorboard import data_compat
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.util import tensor_util

from sidecar.mindspore.ms_summary import ConvertedEvent, MsSummaryFile, find_summary_files, read_lineage
from sidecar.output.tfrecord import frame, iter_records

pytestmark = pytest.mark.mindspore

require_mindspore()

EPOCHS, STEPS_PER_EPOCH = 3, 10

# Trains Dense(4,1) with SummaryCollector(collect_freq=1), capturing each step's loss in a
# callback of the same run, then writes scalars/tensors/histogram/image with a SummaryRecord
# (add_value, steps 1-3) and with summary operators in a Cell (step 10).
GENERATOR = r"""
import json, os, sys
import numpy as np
import mindspore as ms
import mindspore.dataset as ds
from mindspore import Tensor, nn, ops
from mindspore.train import Callback, Model, SummaryCollector, SummaryRecord

out, epochs, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ms.set_seed(0)
rng = np.random.default_rng(0)
x = rng.normal(size=(4 * steps, 4)).astype(np.float32)
y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32) + np.float32(0.1)
data = ds.NumpySlicesDataset({"x": x, "y": y}, shuffle=False).batch(4)
net = nn.Dense(4, 1)
model = Model(net, loss_fn=nn.MSELoss(),
              optimizer=nn.Momentum(net.trainable_params(), learning_rate=0.01, momentum=0.9))
losses = {}

class CaptureLoss(Callback):
    def on_train_step_end(self, run_context):
        cb = run_context.original_args()
        losses[cb.cur_step_num] = float(np.mean(cb.net_outputs.asnumpy()))

collector = SummaryCollector(
    os.path.join(out, "train"), collect_freq=1,
    collect_specified_data={"collect_landscape": None, "collect_graph": False},
    custom_lineage_data={"model_name": "tiny-dense", "seed": 7})
model.train(epochs, data, callbacks=[collector, CaptureLoss()], dataset_sink_mode=False)

class Summaries(nn.Cell):
    def __init__(self):
        super().__init__()
        self.scalar, self.image = ops.ScalarSummary(), ops.ImageSummary()
        self.hist, self.tensor = ops.HistogramSummary(), ops.TensorSummary()

    def construct(self, a, img, t):
        self.scalar("op_scalar", a.sum())
        self.image("op_image", img)
        self.hist("op_hist", t)
        self.tensor("op_tensor", t)
        return a

with SummaryRecord(os.path.join(out, "custom")) as record:
    for step in (1, 2, 3):
        record.add_value("scalar", "my_scalar", Tensor(np.float32(step * 1.5)))
        record.add_value("tensor", "one", Tensor(np.array([7.25], np.float32)))
        record.add_value("tensor", "mat", Tensor(np.arange(6, dtype=np.float32).reshape(2, 3)))
        record.add_value("histogram", "hist", Tensor(np.array(
            [1, 2, 2, 3, np.nan, np.inf, -np.inf], np.float32)))
        record.add_value("image", "img", Tensor(rng.random((2, 3, 8, 6)).astype(np.float32)))
        record.record(step)
    cell = Summaries()
    cell(Tensor(np.ones(3, np.float32)), Tensor(rng.random((1, 3, 5, 5)).astype(np.float32)),
         Tensor(np.arange(5, dtype=np.float32)))
    record.record(10, train_network=cell)

with open(os.path.join(out, "losses.json"), "w") as fh:
    json.dump(losses, fh)
"""


@dataclass(frozen=True)
class MsRun:
    train_dir: Path
    custom_dir: Path
    losses: dict[int, float]


def only(directory: Path, suffix: str) -> Path:
    (path,) = [p for p in find_summary_files(directory) if p.name.endswith(suffix)]
    return path


@pytest.fixture(scope="session")
def ms_run(tmp_path_factory: pytest.TempPathFactory) -> MsRun:
    out = tmp_path_factory.mktemp("mindspore")
    proc = subprocess.run(
        [sys.executable, "-c", GENERATOR, str(out), str(EPOCHS), str(STEPS_PER_EPOCH)],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    losses = {int(k): v for k, v in json.loads((out / "losses.json").read_text()).items()}
    return MsRun(out / "train", out / "custom", losses)


def by_tag(events: list[ConvertedEvent]) -> dict[str, list[tuple[int, Summary.Value]]]:
    series: dict[str, list[tuple[int, Summary.Value]]] = {}
    for event in events:
        for value in event.values:
            series.setdefault(value.tag, []).append((event.step, value))
    return series


def write_tfevents(path: Path, events: list[ConvertedEvent]) -> None:
    """What the sidecar's writer does, minimally: version record first, then one Event each."""
    with open(path, "wb") as fh:
        fh.write(frame(Event(wall_time=0.0, file_version="brain.Event:2").SerializeToString()))
        for ev in events:
            fh.write(frame(Event(wall_time=ev.wall_time, step=ev.step,
                                 summary=Summary(value=ev.values)).SerializeToString()))


def record_spans(path: Path) -> list[tuple[int, int]]:
    with open(path, "rb") as fh:
        return [(r.start, r.end) for r in iter_records(fh)]


def test_find_summary_files(ms_run: MsRun, tmp_path: Path) -> None:
    found = find_summary_files(ms_run.train_dir)
    assert [p.name.endswith("_MS") for p in found] == [True, False]
    assert found[1].name.endswith("_lineage")
    names = ["events.out.events.summary.1800000000.0.node.a_MS",
             "events.out.events.summary.999999999.1.node.b_MS",
             "events.out.events.summary.999999999.1.node.b_lineage",
             "events.out.events.summary.1800000000.0.node.a_explain",
             "events.out.tfevents.1800000000.node", "notes.txt"]
    for name in names:
        (tmp_path / name).touch()
    (tmp_path / "sub_MS").mkdir()
    assert [p.name for p in find_summary_files(tmp_path)] == [names[1], names[2], names[0]]


def test_training_scalars_match_losses_one_point_per_step(ms_run: MsRun) -> None:
    path = only(ms_run.train_dir, "_MS")
    records = record_spans(path)
    reader = MsSummaryFile(path)
    events = reader.read_new()
    steps = list(range(1, EPOCHS * STEPS_PER_EPOCH + 1))
    assert sorted(ms_run.losses) == steps
    # Real file: version record + one per step + the last step of each epoch again.
    assert len(records) == 1 + len(steps) + EPOCHS
    series = by_tag(events)
    assert set(series) == {"loss/auto", "weight/auto", "bias/auto"}
    assert reader.skipped == {"duplicate": EPOCHS * len(series)}
    assert reader.corrupt_records == 0 and reader.offset == path.stat().st_size
    loss = series["loss/auto"]
    assert [s for s, _ in loss] == steps
    assert [v.simple_value for _, v in loss] == [float(np.float32(ms_run.losses[s])) for s in steps]
    for tag, size in (("weight/auto", 4), ("bias/auto", 1)):
        assert [s for s, _ in series[tag]] == steps
        for _, value in series[tag]:
            histo = value.histo
            assert histo.num == size == sum(histo.bucket)
            assert histo.min <= histo.max and len(histo.bucket) == len(histo.bucket_limit)
    assert reader.read_new() == []


def test_custom_record_values(ms_run: MsRun) -> None:
    reader = MsSummaryFile(only(ms_run.custom_dir, "_MS"))
    events = reader.read_new()
    assert [e.step for e in events] == [1, 2, 3, 10]  # version record skipped
    series = by_tag(events)
    assert [v.simple_value for _, v in series["my_scalar"]] == [1.5, 3.0, 4.5]
    assert [v.simple_value for _, v in series["one"]] == [7.25] * 3  # 1-element tensor
    mat = series["mat"][0][1].histo  # 2x3 tensor -> histogram of its values
    assert (mat.num, mat.min, mat.max, mat.sum, mat.sum_squares) == (6, 0, 5, 15, 55)
    hist = series["hist"][0][1].histo  # [1, 2, 2, 3, nan, inf, -inf]
    assert (hist.num, hist.min, hist.max, hist.sum) == (4, 1, 3, 8)
    for suffix in ("nan_count", "pos_inf_count", "neg_inf_count"):
        assert [v.simple_value for _, v in series[f"hist/{suffix}"]] == [1.0] * 3
    image = series["img"][0][1].image  # 2 NCHW images of 8x6, tiled side by side
    assert (image.height, image.width, image.colorspace) == (8, 12, 3)
    assert image.encoded_image_string[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", image.encoded_image_string[16:24]) == (12, 8)
    op = {tag: vals[0][1] for tag, vals in series.items() if tag.startswith("op_")}
    assert op["op_scalar"].simple_value == 3.0
    assert (op["op_image"].image.height, op["op_image"].image.width) == (5, 5)
    assert (op["op_hist"].histo.num, op["op_tensor"].histo.num) == (5, 5)
    assert reader.skipped == {} and reader.corrupt_records == 0


def test_tensorboard_reads_converted_file(ms_run: MsRun, tmp_path: Path) -> None:
    events = MsSummaryFile(only(ms_run.train_dir, "_MS")).read_new()
    events += MsSummaryFile(only(ms_run.custom_dir, "_MS")).read_new()
    write_tfevents(tmp_path / "events.out.tfevents.1800000000.host.mstb", events)
    acc = event_accumulator.EventAccumulator(str(tmp_path), size_guidance={
        event_accumulator.SCALARS: 0, event_accumulator.HISTOGRAMS: 0,
        event_accumulator.IMAGES: 0})
    acc.Reload()
    tags = acc.Tags()
    assert {"loss/auto", "my_scalar", "one", "op_scalar", "hist/nan_count"} <= set(tags["scalars"])
    assert set(tags["histograms"]) == {"weight/auto", "bias/auto", "mat", "hist", "op_hist",
                                       "op_tensor"}
    assert set(tags["images"]) == {"img", "op_image"}
    loss = acc.Scalars("loss/auto")
    assert [(e.step, e.value) for e in loss] == [
        (s, float(np.float32(v))) for s, v in sorted(ms_run.losses.items())]
    weights = acc.Histograms("weight/auto")
    assert len(weights) == len(ms_run.losses) and all(e.histogram_value.num == 4 for e in weights)
    assert acc.Images("img")[0].width == 12
    # What the histogram dashboard gets after TensorBoard's legacy-histogram migration.
    value = [v for v in events[0].values if v.tag == "weight/auto"][0]
    buckets = tensor_util.make_ndarray(data_compat.migrate_value(value).tensor)
    assert buckets.shape == (2, 3) and buckets[:, 2].sum() == 4  # rows: left, right, count
    assert buckets[0, 0] == np.float32(value.histo.min)
    assert buckets[-1, 1] == np.float32(value.histo.max)


def test_partial_record_waits_then_resumes_from_offset(ms_run: MsRun, tmp_path: Path) -> None:
    src = only(ms_run.custom_dir, "_MS")
    data = src.read_bytes()
    (_, v_end), (r1, r1_end), _, _, _ = record_spans(src)
    live = tmp_path / src.name
    live.write_bytes(data[:r1 + 5])  # version record + a torn header
    reader = MsSummaryFile(live)
    assert reader.read_new() == [] and reader.offset == v_end
    with open(live, "ab") as fh:
        fh.write(data[r1 + 5:r1_end - 1])  # everything but the last CRC byte
    assert reader.read_new() == [] and reader.offset == v_end
    with open(live, "ab") as fh:
        fh.write(data[r1_end - 1:])
    assert [e.step for e in reader.read_new()] == [1, 2, 3, 10]
    assert reader.corrupt_records == 0
    resumed = MsSummaryFile(live, offset=r1_end)  # restored offset: steps 2.. only
    assert [e.step for e in resumed.read_new()] == [2, 3, 10]


@pytest.mark.parametrize("where", ["payload", "length"])
def test_corrupt_record_is_skipped_and_counted(ms_run: MsRun, tmp_path: Path,
                                               where: str) -> None:
    src = only(ms_run.train_dir, "_MS")
    data = bytearray(src.read_bytes())
    start, end = record_spans(src)[5]  # step 5
    data[start + 2 if where == "length" else (start + end) // 2] ^= 0xFF
    bad = tmp_path / src.name
    bad.write_bytes(bytes(data))
    reader = MsSummaryFile(bad)
    events = reader.read_new()
    assert reader.corrupt_records == 1
    assert [e.step for e in events] == [s for s in sorted(ms_run.losses) if s != 5]
    assert reader.offset == len(data) and reader.read_new() == []


def test_truncated_and_rewritten_file_is_reread(ms_run: MsRun, tmp_path: Path) -> None:
    train, custom = only(ms_run.train_dir, "_MS"), only(ms_run.custom_dir, "_MS")
    path = tmp_path / "events.out.events.summary.1800000000.0.host_MS"
    path.write_bytes(train.read_bytes())
    reader = MsSummaryFile(path)
    assert len(reader.read_new()) == len(ms_run.losses)
    path.write_bytes(custom.read_bytes())  # what a same-second SummaryRecord does to the name
    assert [e.step for e in reader.read_new()] == [1, 2, 3, 10]
    assert reader.skipped["truncated"] == 1


def test_read_only_file(ms_run: MsRun) -> None:
    src = only(ms_run.train_dir, "_MS")
    assert stat.S_IMODE(src.stat().st_mode) == 0o400  # MindSpore's chmod on close
    before = src.read_bytes()
    expected = len(MsSummaryFile(src).read_new())
    assert expected == len(ms_run.losses) and src.read_bytes() == before
    if os.geteuid() != 0:
        return  # the read above already ran against the mode bits
    # Root ignores mode bits, so read once more as an unprivileged owner of a 0400 copy
    # (in a scratch dir outside pytest's 0700 tmp tree, so that user can reach it).
    scratch = Path(tempfile.mkdtemp())
    try:
        if not all(os.stat(p).st_mode & 0o001 for p in scratch.parents):
            pytest.skip(f"{tempfile.gettempdir()} is not reachable by an unprivileged user")
        scratch.chmod(0o755)
        copy = scratch / src.name
        shutil.copyfile(src, copy)
        os.chown(copy, 65534, 65534)
        copy.chmod(0o400)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            code = 3
            try:
                os.setgid(65534)
                os.setuid(65534)
                code = 0 if len(MsSummaryFile(copy).read_new()) == expected else 1
            finally:
                os._exit(code)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    finally:
        shutil.rmtree(scratch)


LIVE_WRITER = r"""
import sys, time
import numpy as np
from mindspore import Tensor
from mindspore.train import SummaryRecord

with SummaryRecord(sys.argv[1]) as record:
    for step in range(1, int(sys.argv[2]) + 1):
        record.add_value("scalar", "x", Tensor(np.float32(step)))
        record.add_value("tensor", "big", Tensor(np.full(50_000, step, np.float32)))
        record.record(step)
        time.sleep(0.002)
"""


def test_follows_file_while_mindspore_writes(tmp_path: Path) -> None:
    """Poll the file while MindSpore's writer process appends ~200 KB records to it."""
    steps, log = 100, tmp_path / "writer.log"
    with open(log, "wb") as log_fh:  # a file, not a pipe: a full pipe would stall the writer
        writer = subprocess.Popen([sys.executable, "-c", LIVE_WRITER, str(tmp_path), str(steps)],
                                  stdout=log_fh, stderr=log_fh)
    reader, seen = None, []

    def read() -> bool:
        """One look, as a follower makes it; whether the writer had ended before it."""
        nonlocal reader
        finished = writer.poll() is not None
        if reader is None and (found := find_summary_files(tmp_path)):
            reader = MsSummaryFile(found[0])
        if reader is not None:
            seen.extend(reader.read_new())
        return finished

    wait_until(read, 120, "the MindSpore writer to finish", every=0.002)  # often: reads land mid-record
    assert writer.wait(timeout=5) == 0, log.read_text(errors="replace")[-4000:]
    assert reader is not None
    seen += reader.read_new()
    assert [e.step for e in seen] == list(range(1, steps + 1))
    assert [e.values[0].simple_value for e in seen] == list(range(1, steps + 1))
    assert all(e.values[1].histo.num == 50_000 for e in seen)
    assert reader.corrupt_records == 0 and not reader.skipped


def test_read_lineage(ms_run: MsRun) -> None:
    lineage = read_lineage(only(ms_run.train_dir, "_lineage"))
    last_loss = ms_run.losses[max(ms_run.losses)]
    assert lineage == {
        "optimizer": "Momentum", "learning_rate": 0.01, "loss_function": "MSELoss",
        "epoch": EPOCHS, "parallel_mode": "stand_alone", "device_num": 1, "batch_size": 4,
        "train_dataset_size": 4 * STEPS_PER_EPOCH, "network": "Dense",
        "final_loss": float(str(np.float32(last_loss))),
        "model_path": '{"ckpt": null}', "model_size": 0,
        "model_name": "tiny-dense", "seed": 7}


def test_cli_replay_converts_summary_dirs_into_runs(ms_run: MsRun, tmp_path: Path) -> None:
    """`_MS` files found under replay's paths become runs named after their directory, with the
    lineage as a text event, exactly once over two replays."""
    from sidecar.cli import main
    from tb_read import raw_points, scalars, texts

    out = tmp_path / "out"
    for _ in range(2):
        assert main(["replay", str(ms_run.train_dir.parent), "--out", str(out), "--quiet"]) == 0
    shown = scalars(out / "train")
    steps = list(range(1, EPOCHS * STEPS_PER_EPOCH + 1))
    assert shown["loss/auto"] == {s: float(np.float32(ms_run.losses[s])) for s in steps}
    assert "lineage" in texts(out / "train")
    assert "| optimizer | Momentum |" in texts(out / "train")["lineage"][max(steps)]
    assert max(raw_points(out / "train").values()) == 1
    assert scalars(out / "custom")  # the SummaryRecord directory is a run of its own


def test_live_sidecar_follows_a_summary_file_being_written(ms_run: MsRun, tmp_path: Path) -> None:
    """A growing `_MS` file under --watch is converted as it grows, records arriving in pieces;
    mindformers' output/summary/rank_N becomes run rank_N."""
    import signal

    from tb_read import scalars

    source = only(ms_run.train_dir, "_MS")
    data = source.read_bytes()
    rank_dir = tmp_path / "output" / "summary" / "rank_3"
    rank_dir.mkdir(parents=True)
    target = rank_dir / source.name
    target.write_bytes(b"")
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "sidecar.cli", "--watch", str(tmp_path / "output"),
                             "--out", str(out), "-q"])
    steps = list(range(1, EPOCHS * STEPS_PER_EPOCH + 1))
    try:
        with target.open("ab") as fh:
            for i in paced(range(0, len(data), 333), 0.01):  # cuts records mid-header and mid-payload
                fh.write(data[i:i + 333])
                fh.flush()
        wait_until(lambda: (out / "rank_3").exists() and len(scalars(out / "rank_3").get("loss/auto", {})) == len(steps),
                   20, "every step in rank_3")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    assert scalars(out / "rank_3")["loss/auto"] == {s: float(np.float32(ms_run.losses[s])) for s in steps}
