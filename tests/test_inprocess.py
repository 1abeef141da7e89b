"""In-process callback and SummaryCollector helper, checked against real MindSpore on CPU.

Training runs in subprocesses (SummaryRecord allows one instance per process and forks a writer
pool), two scenarios at a time. A plain ``Capture`` callback in
the same callback list records what ``step_end`` saw, and the callback's output is read back
with TensorBoard's own ``EventAccumulator``. The queue/error/restart rules are driven directly
through the callback hooks with MindSpore's own ``RunContext``.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from mindspore_required import require_mindspore

from live_helpers import wait_until
from tb_read import scalars, texts

pytestmark = pytest.mark.mindspore

require_mindspore()

from mindspore.train.callback import RunContext, _InternalCallbackParam  # noqa: E402

from parsers.records import Record  # noqa: E402
from sidecar import inprocess  # noqa: E402
from sidecar.inprocess import TensorBoardCallback, summary_collector  # noqa: E402
from sidecar.mindspore.ms_summary import MsSummaryFile, find_summary_files  # noqa: E402
from sidecar.output.event_scan import RunView  # noqa: E402

BATCH, SINK = 4, 4

# argv: OUT SCENARIO. Dense(4,1) + MSELoss + Momentum, 10 steps per epoch.
#   graph / pynative: 3 epochs, PolynomialDecayLR (graph) or a per-step lr list (pynative), with
#     summary_collector(), TensorBoardCallback (pynative: compute_grad_norm) and every=7, in ONE list.
#   reporting: 1 epoch of a train cell returning mindformers' (loss, overflow, scale, lr, norm).
#   sink: graph, dataset_sink_mode=True, sink_size=4, 5 epochs, through MindSpore's own sink loop.
#     CPU MindSpore has no device queue (Model.train silently falls back to non-sink), so here
#     each sink's batches come from the host and run through the real train network.
GENERATOR = r"""
import itertools, json, sys, time
import numpy as np
import mindspore as ms
import mindspore.dataset as ds
import mindspore.train.model as model_module
from mindspore import nn, ops
from mindspore.train import Callback, Model
from sidecar.inprocess import TensorBoardCallback, summary_collector

out, scenario = sys.argv[1], sys.argv[2]
ms.set_context(mode=ms.PYNATIVE_MODE if scenario == "pynative" else ms.GRAPH_MODE)
ms.set_seed(0)
rng = np.random.default_rng(0)
x = rng.normal(size=(40, 4)).astype(np.float32)
y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)
data = ds.NumpySlicesDataset({"x": x, "y": y}, shuffle=False).batch(4)
net = nn.Dense(4, 1)
lr = [0.01 + 0.001 * i for i in range(40)] if scenario == "pynative" else nn.PolynomialDecayLR(0.05, 0.005, 25, 2.0)
opt = nn.Momentum(net.trainable_params(), lr, momentum=0.9)
seen, extra = {}, {}


class Capture(Callback):
    def on_train_begin(self, run_context):
        extra["began"] = time.perf_counter()

    def on_train_step_begin(self, run_context):
        cb = run_context.original_args()
        if scenario == "pynative":  # float64 reference for compute_grad_norm, before the update
            grads = ms.grad(cb.train_network.network, None, cb.optimizer.parameters)(*cb.train_dataset_element)
            self.norm = float(np.sqrt(sum((g.asnumpy().astype(np.float64) ** 2).sum() for g in grads)))

    def on_train_step_end(self, run_context):
        cb = run_context.original_args()
        outs = cb.net_outputs if isinstance(cb.net_outputs, tuple) else (cb.net_outputs,)
        row = {"loss": float(outs[0].asnumpy()), "t": time.perf_counter(), "sink": cb.dataset_sink_mode}
        if len(outs) == 5:
            row.update(lr=float(outs[3].asnumpy()), norm=float(outs[4].asnumpy()))
        if scenario == "pynative":
            row["norm"] = self.norm
        seen[cb.cur_step_num] = row


class Reporting(nn.TrainOneStepCell):
    def __init__(self, network, optimizer):
        super().__init__(network, optimizer)
        self.grads = ops.GradOperation(get_by_list=True)

    def construct(self, *inputs):
        loss = self.network(*inputs)
        grads = self.grads(self.network, self.weights)(*inputs)
        norm = ops.sqrt(ops.addn([ops.square(g).sum() for g in grads]))
        rate = self.optimizer.learning_rate(self.optimizer.global_step).reshape(())
        loss = ops.depend(loss, self.optimizer(grads))
        return loss, ops.isinf(loss), ops.ones((), ms.float32), rate, norm


class HostSink:
    def __init__(self, dataset, size):
        self.batches, self.size = itertools.cycle(list(dataset.create_tuple_iterator(num_epochs=1))), size

    def sink_size(self):
        return self.size

    def __iter__(self):
        yield (tuple(next(self.batches) for _ in range(self.size)),)

    def continue_send(self):
        pass

    stop_send = release = continue_send


class HostSinkNet:
    def __init__(self, net):
        self.net, self.losses = net, []

    def set_train(self, mode=True):
        self.net.set_train(mode)

    def __call__(self, batches):
        for batch in batches:
            result = self.net(*batch)
            self.losses.append(float(result.asnumpy()))
            time.sleep(0.02)
        return result


class CpuSinkModel(Model):
    def _exec_preprocess(self, is_train, dataset, dataset_sink_mode, sink_size=-1, epoch_num=1,
                         dataset_helper=None):
        self._backbone_is_train = True
        return dataset_helper or HostSink(dataset, sink_size), host_net


class ClaimsDevice:  # model.py's view of mindspore.context: not "CPU", so sink mode stays on
    def __getattr__(self, name):
        return getattr(ms.context, name)

    def get_context(self, key):
        return "Ascend" if key == "device_target" else ms.context.get_context(key)


if scenario in ("graph", "pynative"):
    model = Model(net, loss_fn=nn.MSELoss(), optimizer=opt)
    callbacks = [summary_collector(out + "/summary", total_steps=30),
                 TensorBoardCallback(out + "/tb", compute_grad_norm=scenario == "pynative"),
                 TensorBoardCallback(out + "/tb7", every=7), Capture()]
    model.train(3, data, callbacks=callbacks, dataset_sink_mode=False)
elif scenario == "reporting":
    model = Model(Reporting(nn.WithLossCell(net, nn.MSELoss()), opt))
    model.train(1, data, callbacks=[TensorBoardCallback(out + "/tb"), Capture()], dataset_sink_mode=False)
else:
    model = CpuSinkModel(net, loss_fn=nn.MSELoss(), optimizer=opt)
    host_net = HostSinkNet(model._train_network)
    model_module.context = ClaimsDevice()
    callbacks = [Capture(), TensorBoardCallback(out + "/tb", compute_grad_norm=True)]
    model.train(5, data, callbacks=callbacks, dataset_sink_mode=True, sink_size=4)
    extra["host_losses"] = host_net.losses
with open(out + "/seen.json", "w") as fh:
    json.dump({"seen": seen, **extra}, fh)
"""
SCENARIOS = ("graph", "pynative", "reporting", "sink")


@dataclass(frozen=True)
class Run:
    out: Path
    seen: dict[int, dict]
    began: float
    host_losses: list[float]
    stderr: str


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    root = tmp_path_factory.mktemp("inprocess")
    script = root / "train.py"  # a file: graph mode compiles a Cell from its source
    script.write_text(GENERATOR)

    def run(name: str) -> Run:
        out = root / name
        out.mkdir()
        proc = subprocess.run([sys.executable, str(script), str(out), name], cwd=out,  # for MindSpore's dumps
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=240)
        assert proc.returncode == 0, f"{name}: {proc.stderr[-4000:]}"
        saved = json.loads((out / "seen.json").read_text())
        return Run(out, {int(k): v for k, v in saved["seen"].items()}, saved["began"],
                   saved.get("host_losses", []), proc.stderr)

    # Two at a time: MindSpore's thread pools make more processes than cores slower than serial.
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(SCENARIOS, pool.map(run, SCENARIOS)))


def f32(value: float) -> float:
    return float(np.float32(value))


def poly_lr(step: int) -> float:
    """PolynomialDecayLR(0.05, 0.005, 25, 2.0) at global step ``step``, in float32 like MindSpore."""
    p = np.float32(min(step, 25)) / np.float32(25)
    return float(np.float32(0.045) * (np.float32(1) - p) ** np.float32(2) + np.float32(0.005))


def assert_timing(series: dict[str, dict[int, float]]) -> None:
    for step, ms in series["iteration-time"].items():
        assert ms > 0
        assert series["throughput"][step] * ms == pytest.approx(BATCH * 1000.0, rel=1e-6)


@pytest.mark.parametrize("mode", ["graph", "pynative"])
def test_callback_values_are_what_step_end_saw(runs: dict[str, Run], mode: str) -> None:
    run = runs[mode]
    series = scalars(run.out / "tb" / "rank_0")
    steps = list(range(1, 31))
    assert sorted(run.seen) == steps and not any(row["sink"] for row in run.seen.values())
    assert set(series) == {"loss", "learning-rate", "iteration-time", "throughput"} | (
        {"grad-norm"} if mode == "pynative" else set())
    assert series["loss"] == {s: f32(run.seen[s]["loss"]) for s in steps}
    if mode == "graph":  # the rate applied in step s is the schedule at global step s - 1
        assert series["learning-rate"] == {s: poly_lr(s - 1) for s in steps}
    else:
        assert series["learning-rate"] == {s: f32(0.01 + 0.001 * (s - 1)) for s in steps}
        # float32 sums in one graph vs a float64 reference on the host
        assert series["grad-norm"] == pytest.approx({s: run.seen[s]["norm"] for s in steps}, rel=1e-5)
    assert_timing(series)
    every7 = scalars(run.out / "tb7" / "rank_0")
    assert every7["loss"] == {s: series["loss"][s] for s in (7, 14, 21, 28)}


@pytest.mark.parametrize("mode", ["graph", "pynative"])
def test_summary_collector_in_the_same_list(runs: dict[str, Run], mode: str) -> None:
    run_dir = runs[mode].out / "summary" / "rank_0"
    (path,) = [p for p in find_summary_files(run_dir) if p.name.endswith("_MS")]
    loss = {e.step: v.simple_value for e in MsSummaryFile(path).read_new()
            for v in e.values if v.tag == "loss/auto"}
    assert sorted(loss) == [1, 10, 20, 30]  # collect_freq 10 for a 30-step run
    callback = scalars(runs[mode].out / "tb" / "rank_0")["loss"]
    assert loss == {s: callback[s] for s in loss}
    assert not (run_dir / "ckpt_dir").exists()  # no landscape checkpoints


def test_network_reported_lr_and_grad_norm(runs: dict[str, Run]) -> None:
    run = runs["reporting"]
    series = scalars(run.out / "tb" / "rank_0")
    steps = list(range(1, 11))
    assert series["learning-rate"] == {s: f32(run.seen[s]["lr"]) for s in steps}
    assert series["grad-norm"] == {s: f32(run.seen[s]["norm"]) for s in steps}
    assert series["loss"] == {s: f32(run.seen[s]["loss"]) for s in steps}
    # mindformers' wrapper reads the schedule at the pre-update global step, as the callback does
    assert series["learning-rate"] == {s: poly_lr(s - 1) for s in steps}


def test_sink_mode_steps_jump_by_sink_size(runs: dict[str, Run]) -> None:
    run = runs["sink"]
    series = scalars(run.out / "tb" / "rank_0")
    steps = [4, 8, 12, 16, 20]
    assert sorted(run.seen) == steps and all(row["sink"] for row in run.seen.values())
    assert series["loss"] == {s: f32(run.seen[s]["loss"]) for s in steps}
    assert series["loss"] == {s: f32(run.host_losses[s - 1]) for s in steps}  # each sink's last step
    assert series["learning-rate"] == {s: poly_lr(s - 1) for s in steps}
    ends = [run.began] + [run.seen[s]["t"] for s in steps]
    for step, begin, end in zip(steps, ends, ends[1:]):  # the sink's time / sink size (>= 20 ms sleep)
        ms = series["iteration-time"][step]
        assert ms >= 20 and ms == pytest.approx((end - begin) * 1000 / SINK, rel=0.1)
    assert_timing(series)
    assert "grad-norm" not in series and "compute_grad_norm is off" in run.stderr


# ---- the queue, error and restart rules, through the hooks (no training needed) ----

def drive(callback: TensorBoardCallback, steps: range, loss: object = 1.0, begin: bool = True) -> None:
    """Call the hooks as ``Model.train`` does for ``steps`` (begun at ``steps.start - 1``)."""
    cb = _InternalCallbackParam(cur_step_num=steps.start - 1, optimizer=None, train_network=None,
                                dataset_sink_mode=False)
    context = RunContext(cb)
    if begin:
        callback.on_train_begin(context)
    for step in steps:
        cb.cur_step_num, cb.net_outputs = step, np.float32(loss * step) if isinstance(loss, float) else loss
        callback.on_train_step_begin(context)
        callback.on_train_step_end(context)


def end(callback: TensorBoardCallback) -> None:
    callback.on_train_end(RunContext(_InternalCallbackParam()))


def test_full_queue_drops_points_and_never_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    entered, release, written = threading.Event(), threading.Event(), []

    class StuckWriter:  # a hung filesystem, until release is set
        def __init__(self, run_dir: Path, since: RunView | None) -> None:
            self.max_step, self.view = -1, RunView()

        def write(self, record: Record) -> None:
            entered.set()
            release.wait(10)
            written.append(record.step)

        def flush(self) -> None:
            pass

        close = flush

    monkeypatch.setattr(inprocess, "RunWriter", StuckWriter)
    callback = TensorBoardCallback(tmp_path, batch_size=BATCH, rank=0, queue_size=2)
    drive(callback, range(1, 2))
    assert entered.wait(5)
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="sidecar.inprocess"):
        drive(callback, range(2, 12), begin=False)
        assert time.monotonic() - began < 2  # the writer is stuck for 10 s
        assert callback.dropped == 8 and len(caplog.records) == 1  # 2 queued, 8 dropped, one warning
        release.set()
        end(callback)
    assert written == [1, 2, 3] and not callback.disabled


class FullDisk:
    def __init__(self, run_dir: Path, since: RunView | None) -> None:
        self.max_step = -1

    def write(self, record: Record) -> None:
        raise OSError(28, "No space left on device")

    def abandon(self) -> None:
        pass


def test_writer_error_disables_callback_training_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(inprocess, "RunWriter", FullDisk)
    callback = TensorBoardCallback(tmp_path, batch_size=BATCH, rank=0)
    with caplog.at_level(logging.WARNING, logger="sidecar.inprocess"):
        drive(callback, range(1, 2))
        wait_until(lambda: callback.disabled, 5, "the callback to give up after the write error")
        drive(callback, range(2, 20), begin=False)
        end(callback)
    assert callback.disabled
    assert [r.levelname for r in caplog.records] == ["ERROR"]
    assert "No space left on device" in caplog.text


def test_an_unreadable_output_disables_callback_not_training(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    callback = TensorBoardCallback(tmp_path, batch_size=BATCH, rank=0)
    with caplog.at_level(logging.WARNING, logger="sidecar.inprocess"):
        drive(callback, range(1, 5), loss="not a tensor")  # no exception reaches the training loop
        end(callback)
    assert callback.disabled and [r.levelname for r in caplog.records] == ["ERROR"]


def test_restart_from_an_earlier_step_supersedes_the_tail(tmp_path: Path) -> None:
    callback = TensorBoardCallback(tmp_path, batch_size=BATCH, rank=3)
    drive(callback, range(1, 6))
    end(callback)
    drive(callback, range(3, 5), loss=10.0)  # the same callback, resumed from step 2
    end(callback)
    series = scalars(tmp_path / "rank_3")
    assert series["loss"] == {1: 1.0, 2: 2.0, 3: 30.0, 4: 40.0}
    assert series["throughput"].keys() == {1, 2, 3, 4}
    assert list(texts(tmp_path / "rank_3")["events/resume"]) == [3]


# argv: OUT HOW. 20 steps, then an interrupt. HOW "raise" and "sigint": the hooks driven as a
# training loop of one's own does (no ``with`` block, no on_train_end), then KeyboardInterrupt
# raised in the loop, or the test's SIGINT awaited. "model": graph-mode Model.train (loss = the
# step), with a second callback (every=7, to OUT7), the test's SIGINT awaited in the last step's
# callbacks; MindSpore's runtime turns it into a SIGTERM to the process. The writer's interval is made longer than the test, so every point is
# still waiting in its list when the interrupt ends the process.
INTERRUPTED = r"""
import signal, sys
import numpy as np
import mindspore as ms
import mindspore.dataset as ds
from mindspore import nn
from mindspore.train import Callback, Model
from mindspore.train.callback import RunContext, _InternalCallbackParam
from sidecar import inprocess

inprocess.WRITE_INTERVAL = 600.0
out, how = sys.argv[1], sys.argv[2]
callback = inprocess.TensorBoardCallback(out, batch_size=4, rank=0)


def handed_over(step):
    if step == 20:
        if how == "raise":
            raise KeyboardInterrupt
        print("handed over", flush=True)
        while True:
            signal.pause()  # until the test's signal ends the process


class Last(Callback):
    def on_train_step_end(self, run_context):
        handed_over(run_context.original_args().cur_step_num)


class Step(nn.Cell):  # the network's output, the loss, is the step: x holds it
    def construct(self, x, y):
        return x.sum() + 0 * y.sum()


if how == "model":
    ms.set_context(mode=ms.GRAPH_MODE)
    x = np.arange(1, 21, dtype=np.float32).reshape(20, 1)
    data = ds.NumpySlicesDataset({"x": x, "y": x}, shuffle=False).batch(1)
    every7 = inprocess.TensorBoardCallback(out + "7", batch_size=4, rank=0, every=7)
    Model(Step()).train(1, data, callbacks=[callback, every7, Last()], dataset_sink_mode=False)
cb = _InternalCallbackParam(cur_step_num=0, optimizer=None, train_network=None, dataset_sink_mode=False)
context = RunContext(cb)
callback.on_train_begin(context)
for step in range(1, 21):
    cb.cur_step_num, cb.net_outputs = step, np.float32(step)
    callback.on_train_step_begin(context)
    callback.on_train_step_end(context)
    handed_over(step)
"""


@pytest.mark.parametrize("how", ["raise", "sigint", "model"])
def test_an_interrupt_drains_every_point_handed_over(tmp_path: Path, how: str) -> None:
    """Ctrl-C at step 20: the 20 points handed to the writer are all in the run (before the fix,
    those the writer had not taken yet died with its thread, or with the SIGTERM MindSpore sends)."""
    script = tmp_path / "loop.py"
    script.write_text(INTERRUPTED)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "tb"), how], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        if how != "raise":
            assert proc.stdout.readline() == "handed over\n"
            proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    if how == "model":
        assert proc.returncode == -signal.SIGTERM, err[-2000:]  # as MindSpore ends it
        assert scalars(tmp_path / "tb7" / "rank_0")["loss"] == {7: 7.0, 14: 14.0}
    else:
        assert proc.returncode == -signal.SIGINT and err.rstrip().endswith("KeyboardInterrupt"), err[-2000:]
    assert scalars(tmp_path / "tb" / "rank_0")["loss"] == {step: float(step) for step in range(1, 21)}


def test_summary_collector_settings(tmp_path: Path) -> None:
    assert [inprocess._collect_freq(n) for n in (30, 10_000, 20_000, 100_000, 150_000, 400_000, 10**7)] \
        == [10, 10, 50, 100, 200, 500, 500]
    collector = summary_collector(tmp_path, total_steps=60_000, rank=5)
    assert collector._summary_dir == str(tmp_path / "rank_5") and collector._collect_freq == 100
    data = collector._collect_specified_data
    assert (data["collect_landscape"], data["collect_graph"], data["collect_dataset_graph"]) == (None, False, False)
    assert data["collect_metric"] is True  # MindSpore's defaults otherwise kept
    opted = summary_collector(tmp_path, total_steps=60_000, rank=5, collect_freq=7, collect_graph=True)
    assert opted._collect_freq == 7 and opted._collect_specified_data["collect_graph"] is True


def test_the_daemon_does_not_import_mindspore() -> None:
    code = "import sys, sidecar.cli, sidecar.service.daemon, sidecar.mindspore.ms_summary; sys.exit('mindspore' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
