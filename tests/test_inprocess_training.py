"""The in-process callback in the training patterns scripts really use (issue 14), real MindSpore on CPU.

Each scenario trains in its own subprocess (graph mode compiles each Cell from its source file),
two at a time. A ``Capture`` callback in the same list records what the training did (the loss
``step_end`` saw, the rate the optimizer applied, the parameters), and the callback's output is
read back with TensorBoard's ``EventAccumulator``.

- fit: ``Model.fit`` with a validation set every epoch; the callback was made before a ``chdir``.
- stages: two ``model.train`` calls on one model (SGD, so the applied rate is -dw / grad), then a
  resume from the checkpoint saved after the first, with ``initial_epoch``; then (PyNative) a
  train cell that updates in every other step only.
- failures: a writer that dies (disk full) and one that hangs; then a later ``model.train``.
- bn-plain, bn-norm: a BatchNorm network trained without and with ``compute_grad_norm``, from the same weights.
- dropout: networks with dropout trained without and with ``compute_grad_norm``, in graph and PyNative mode.
- reuse: one callback with ``compute_grad_norm`` given to two different networks in turn.
- schedules: the cached learning-rate schedules against one-step evaluation, every third step.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from mindspore_required import require_mindspore

from tb_read import scalars, texts

pytestmark = pytest.mark.mindspore

require_mindspore()

STOP_TIMEOUT = 1.5  # the scenario's bound for the end-of-training wait

TRAIN = r"""
import errno, json, os, sys, threading, time
import numpy as np
import mindspore as ms
import mindspore.dataset as ds
from mindspore import nn, ops
from mindspore.train import Callback, Model
from sidecar import inprocess
from sidecar.inprocess import TensorBoardCallback

out, scenario = sys.argv[1], sys.argv[2]
ms.set_context(mode=ms.GRAPH_MODE)
ms.set_seed(0)
rng = np.random.default_rng(0)
X = rng.normal(size=(40, 4)).astype(np.float32)
Y = X @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)
result = {}


def dataset(rows=40):
    return ds.NumpySlicesDataset({"x": X[:rows], "y": Y[:rows]}, shuffle=False).batch(4)


def dense(scale=0.1, n_in=4, n_out=1):
    return nn.Dense(n_in, n_out, weight_init=ms.Tensor(np.full((n_out, n_in), scale, np.float32)), bias_init="zeros")


def schedule():
    return nn.PolynomialDecayLR(0.05, 0.005, 25, 2.0)


class Capture(Callback):
    # Records per training ("run") the loss; with ``norm`` the gradient norm (float64, before the
    # step); with ``applied`` (plain SGD only) the rate the update applied, -dw / grad.
    def __init__(self, run, applied=False, norm=False):
        self.run, self.applied, self.norm = run, applied, norm
        result.setdefault(run, {"steps": [], "loss": [], "applied": [], "norm": [], "evals": 0})

    def on_train_step_begin(self, run_context):
        cb = run_context.original_args()
        if self.applied or self.norm:
            params = cb.optimizer.parameters
            grads = ms.grad(cb.train_network.network, None, params)(*cb.train_dataset_element)
            self.grads = [g.asnumpy().astype(np.float64) for g in grads]
            self.before = [p.asnumpy().astype(np.float64) for p in params]

    def on_train_step_end(self, run_context):
        cb = run_context.original_args()
        row = result[self.run]
        row["steps"].append(cb.cur_step_num)
        row["loss"].append(float(cb.net_outputs.asnumpy()))
        if self.norm:
            row["norm"].append(float(np.sqrt(sum((g ** 2).sum() for g in self.grads))))
        if self.applied:
            after = [p.asnumpy().astype(np.float64) for p in cb.optimizer.parameters]
            g = np.concatenate([x.ravel() for x in self.grads])
            dw = np.concatenate([(a - b).ravel() for a, b in zip(after, self.before)])
            i = int(np.argmax(np.abs(g)))
            row["applied"].append(-dw[i] / g[i])

    def on_eval_begin(self, run_context):
        result[self.run]["evals"] += 1


class Clock(Callback):
    # Placed before and after the callback under test: on_train_end's duration is theirs.
    def __init__(self, run, key):
        self.run, self.key = run, key

    def on_train_end(self, run_context):
        result.setdefault(self.run, {})[self.key] = time.perf_counter()


if scenario == "fit":
    work = os.path.join(out, "work")
    os.makedirs(work)
    os.chdir(work)
    callback = TensorBoardCallback("tb")  # relative: resolved now, in ``work``
    os.chdir(out)
    net = dense()
    model = Model(net, loss_fn=nn.MSELoss(), optimizer=nn.Momentum(net.trainable_params(), schedule(), 0.9),
                  metrics={"mae"})
    model.fit(3, dataset(16), valid_dataset=dataset(8), callbacks=[callback, Capture("fit")])
elif scenario == "stages":
    net = dense()
    model = Model(net, loss_fn=nn.MSELoss(), optimizer=nn.SGD(net.trainable_params(), schedule()))
    callback = TensorBoardCallback(out + "/tb")
    model.train(1, dataset(), callbacks=[callback, Capture("stage1", applied=True)])
    ms.save_checkpoint(model._train_network, out + "/stage1.ckpt")
    model.train(1, dataset(), callbacks=[callback, Capture("stage2", applied=True)])
    net = dense(scale=0.7)  # overwritten by the checkpoint
    optimizer = nn.SGD(net.trainable_params(), schedule())
    model = Model(net, loss_fn=nn.MSELoss(), optimizer=optimizer)
    ms.load_param_into_net(model._train_network, ms.load_checkpoint(out + "/stage1.ckpt"))
    result["resumed_global_step"] = int(optimizer.global_step.asnumpy()[0])
    model.train(2, dataset(), initial_epoch=1,
                callbacks=[TensorBoardCallback(out + "/tb_resume"), Capture("resume", applied=True)])

    class EveryOther(nn.TrainOneStepCell):  # updates in odd steps only, as a skipping or accumulating cell
        def __init__(self, network, optimizer):
            super().__init__(network, optimizer)
            self.calls = 0

        def construct(self, *inputs):
            self.calls += 1
            return super().construct(*inputs) if self.calls % 2 else self.network(*inputs)

    class Updates(Callback):
        def on_train_step_end(self, run_context):
            result.setdefault("updates", []).append(int(train_net.optimizer.global_step.asnumpy()[0]))

    ms.set_context(mode=ms.PYNATIVE_MODE)  # Python control flow in the train cell
    net = dense()
    train_net = EveryOther(nn.WithLossCell(net, nn.MSELoss()), nn.SGD(net.trainable_params(), schedule()))
    Model(train_net).train(1, dataset(), callbacks=[TensorBoardCallback(out + "/tb_skips"), Updates()])
elif scenario == "failures":
    inprocess.STOP_TIMEOUT = float(sys.argv[3])
    net = dense()
    model = Model(net, loss_fn=nn.MSELoss(), optimizer=nn.Momentum(net.trainable_params(), 0.01, 0.9))

    # 1. the run directory is a file: the writer fails; the next model.train writes again
    os.makedirs(out + "/tb")
    open(out + "/tb/rank_0", "w").close()
    callback = TensorBoardCallback(out + "/tb")
    model.train(1, dataset(), callbacks=[callback, Capture("blocked")])
    result["blocked_disabled"] = callback.disabled
    os.remove(out + "/tb/rank_0")
    model.train(1, dataset(), callbacks=[callback, Capture("recovered")])
    result["recovered_disabled"] = callback.disabled

    # 2. a disk that fails after step 1, then one that hangs after step 1
    hang, hanging = threading.Event(), threading.Event()

    class FullAfterOne(inprocess.RunWriter):
        def write(self, record):
            if record.step > 1:
                self.flush()
                time.sleep(0.6)  # while the training fills the queue
                raise OSError(errno.ENOSPC, "No space left on device")
            return super().write(record)

    class HangsAfterOne(inprocess.RunWriter):
        def write(self, record):
            if record.step > 1:
                self.flush()
                hanging.set()
                hang.wait()  # never set: a hung filesystem
            return super().write(record)

    class SlowUntil(Callback):  # steps of 0.2 s until the writer has failed: it fails while the training runs
        def __init__(self, failed):
            self.failed = failed

        def on_train_step_end(self, run_context):
            if not self.failed():
                time.sleep(0.2)

    for name, writer in (("dead", FullAfterOne), ("hung", HangsAfterOne)):
        inprocess.RunWriter = writer
        net = dense()
        model = Model(net, loss_fn=nn.MSELoss(), optimizer=nn.Momentum(net.trainable_params(), 0.01, 0.9))
        callback = TensorBoardCallback(out + "/" + name, queue_size=2)
        failed = (lambda: callback.disabled) if name == "dead" else hanging.is_set
        model.train(1, dataset(), callbacks=[Clock(name, "before"), callback, Clock(name, "after"), Capture(name),
                                            SlowUntil(failed)])
        result[name]["disabled"] = callback.disabled
elif scenario in ("bn-plain", "bn-norm"):  # two separate trainings from the same weights
    norm = scenario == "bn-norm"
    w1 = np.linspace(-1, 1, 32, dtype=np.float32).reshape(8, 4)

    def bn_net():  # a copy of w1 each time: a Parameter made from a Tensor shares its memory
        return nn.SequentialCell([nn.Dense(4, 8, weight_init=ms.Tensor(w1.copy()), bias_init="zeros"),
                                  nn.BatchNorm1d(8), nn.ReLU(),
                                  nn.Dense(8, 1, weight_init=ms.Tensor(np.full((1, 8), 0.2, np.float32)))])

    snapshots = []

    class Snapshot(Callback):  # every parameter before the step (and before the callback's extra pass)
        def on_train_step_begin(self, run_context):
            snapshots.append({p.name: p.asnumpy().copy() for p in net.get_parameters()})  # asnumpy shares memory

    net = bn_net()
    model = Model(net, loss_fn=nn.MSELoss(), optimizer=nn.Momentum(net.trainable_params(), 0.01, 0.9))
    callbacks = [Snapshot(), TensorBoardCallback(out + "/tb", compute_grad_norm=norm), Capture(scenario)]
    model.train(1, dataset(32), callbacks=callbacks)
    np.savez(out + "/final.npz", **{p.name: p.asnumpy() for p in model._train_network.get_parameters()})
    # the reference norm: each step's gradient on a separate copy holding that step's parameters
    ref = bn_net()
    loss_net = nn.WithLossCell(ref, nn.MSELoss())
    loss_net.set_train(True)
    weights = ref.trainable_params()
    result["norm_reference"] = []
    for snapshot, (x, y) in zip(snapshots, dataset(32).create_tuple_iterator(num_epochs=1)):
        ms.load_param_into_net(ref, {k: ms.Parameter(ms.Tensor(v), name=k) for k, v in snapshot.items()})
        grads = ms.grad(loss_net, None, weights)(x, y)
        result["norm_reference"].append(float(np.sqrt(sum((g.asnumpy().astype(np.float64) ** 2).sum() for g in grads))))
elif scenario == "dropout":  # per mode, the same training without and with compute_grad_norm
    class Dropouts(nn.Cell):  # a dropout layer (an operator with a state), and functional dropout (a seed per call or trace)
        def __init__(self):
            super().__init__()
            self.first = dense(0.3, 4, 8)
            self.layer = nn.Dropout(p=0.5)
            self.last = dense(0.2, 8, 1)

        def construct(self, x):
            return self.last(ops.dropout(self.layer(ops.relu(self.first(x))), p=0.25))

    # one CPU thread: in graph mode MindSpore's dropout kernels draw on several threads, and the masks
    # then vary from run to run (with the callback or without)
    ms.device_context.cpu.op_tuning.threads_num(1)
    for mode in ("graph", "pynative"):
        ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
        for norm in (False, True):
            ms.set_seed(0)
            net = Dropouts()
            model = Model(net, loss_fn=nn.MSELoss(), optimizer=nn.Momentum(net.trainable_params(), 0.01, 0.9))
            name = f"{mode}-{'norm' if norm else 'plain'}"
            model.train(1, dataset(32), callbacks=[TensorBoardCallback(out + "/" + name, compute_grad_norm=norm),
                                                   Capture(name)])
            np.savez(out + f"/{name}.npz", **{p.name: p.asnumpy() for p in model._train_network.get_parameters()})
elif scenario == "reuse":
    callback = TensorBoardCallback(out + "/tb", compute_grad_norm=True)
    for name, net in (("first", dense(0.1)), ("second", nn.SequentialCell([dense(0.9, 4, 3), dense(-1.5, 3, 1)]))):
        model = Model(net, loss_fn=nn.MSELoss(), optimizer=nn.Momentum(net.trainable_params(), 0.01, 0.9))
        model.train(1, dataset(20), callbacks=[callback, Capture(name, norm=True)])
elif scenario == "schedules":
    class Warmup(nn.learning_rate_schedule.LearningRateSchedule):  # control flow, like mindformers' schedules
        def construct(self, global_step):
            if global_step < 5:
                return global_step.astype(ms.float32) * 0.01
            return ops.ones((), ms.float32) * 0.02

    schedules = {
        "poly-sqrt": nn.PolynomialDecayLR(0.1, 0.001, 7, 0.5, update_decay_steps=True),
        "cosine": nn.CosineDecayLR(0.001, 0.1, 13),
        "warmup": Warmup(),
        "list": [0.001 * (i + 1) for i in range(25)],
    }
    for name, lr in schedules.items():
        net = dense()
        optimizer = nn.Momentum(net.trainable_params(), lr, 0.9)
        model = Model(net, loss_fn=nn.MSELoss(), optimizer=optimizer)
        model.train(3, dataset(32), callbacks=[TensorBoardCallback(out + "/" + name, every=3), Capture(name)])
        rate = optimizer.learning_rate
        result[name]["one_step"] = {s: float(rate(ms.Tensor([s - 1], ms.int32)).asnumpy().reshape(-1)[0])
                                    for s in range(1, 25)}
with open(out + "/result.json", "w") as fh:
    json.dump(result, fh)
"""
SCENARIOS = ("fit", "stages", "failures", "bn-plain", "bn-norm", "dropout", "reuse", "schedules")


def poly(step: int) -> float:
    """PolynomialDecayLR(0.05, 0.005, 25, 2.0) at global step ``step``, in float32 like MindSpore."""
    p = np.float32(min(step, 25)) / np.float32(25)
    return float(np.float32(0.045) * (np.float32(1) - p) ** np.float32(2) + np.float32(0.005))


def f32(value: float) -> float:
    return float(np.float32(value))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict, str]]:
    root = tmp_path_factory.mktemp("inprocess-training")
    script = root / "train.py"
    script.write_text(TRAIN)

    def run(name: str) -> tuple[Path, dict, str]:
        out = root / name
        out.mkdir()
        proc = subprocess.run([sys.executable, str(script), str(out), name, str(STOP_TIMEOUT)], cwd=out,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300)
        assert proc.returncode == 0, f"{name}: {proc.stderr[-4000:]}"
        return out, json.loads((out / "result.json").read_text()), proc.stderr

    with ThreadPoolExecutor(max_workers=2) as pool:  # more MindSpore processes than cores is slower
        return dict(zip(SCENARIOS, pool.map(run, SCENARIOS)))


def test_fit_with_validation_writes_every_training_step(runs: dict) -> None:
    out, result, _ = runs["fit"]
    fit = result["fit"]
    assert fit["evals"] == 3 and fit["steps"] == list(range(1, 13))  # 3 epochs of 4 steps, evaluated after each
    series = scalars(out / "work" / "tb" / "rank_0")
    assert series["loss"] == {s: f32(v) for s, v in zip(fit["steps"], fit["loss"])}
    assert series["learning-rate"] == {s: poly(s - 1) for s in range(1, 13)}


def test_relative_out_dir_is_fixed_when_the_callback_is_made(runs: dict) -> None:
    out, _, _ = runs["fit"]
    assert scalars(out / "work" / "tb" / "rank_0")["loss"].keys() == set(range(1, 13))
    assert not (out / "tb").exists()  # where the training's working directory was


def test_learning_rate_is_the_rate_the_optimizer_applied(runs: dict) -> None:
    out, result, _ = runs["stages"]
    assert result["resumed_global_step"] == 10
    stages = [("stage1", out / "tb", 0), ("stage2", out / "tb", 10), ("resume", out / "tb_resume", 10)]
    for name, run_dir, first in stages:
        steps = [first + s for s in result[name]["steps"]]
        assert steps == list(range(first + 1, first + 11)), name  # MindSpore's step restarts at 1 each time
        written = scalars(run_dir / "rank_0")["learning-rate"]
        assert {s: written[s] for s in steps} == {s: poly(s - 1) for s in steps}, name
        # and that is what the update did: SGD moved the weights by -rate * gradient
        assert [written[s] for s in steps] == pytest.approx(result[name]["applied"], rel=1e-3), name


def test_learning_rate_follows_the_updates_of_a_cell_that_skips_some(runs: dict) -> None:
    out, result, _ = runs["stages"]
    assert result["updates"] == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5]  # the optimizer's step, after each of 10 steps
    written = scalars(out / "tb_skips" / "rank_0")["learning-rate"]
    assert written == {s: poly(u - 1) for s, u in enumerate(result["updates"], 1)}


def test_staged_training_continues_the_curve(runs: dict) -> None:
    out, result, _ = runs["stages"]
    series = scalars(out / "tb" / "rank_0")
    losses = result["stage1"]["loss"] + result["stage2"]["loss"]
    assert series["loss"] == {s: f32(v) for s, v in zip(range(1, 21), losses)}
    assert "events/resume" not in texts(out / "tb" / "rank_0")  # nothing superseded
    # the resumed run continues from the checkpoint's global step, with the second stage's values
    resumed = scalars(out / "tb_resume" / "rank_0")["loss"]
    assert resumed == {s: f32(v) for s, v in zip(range(11, 21), result["resume"]["loss"])}
    assert resumed == {s: series["loss"][s] for s in range(11, 21)}


def test_a_later_train_recovers_after_a_write_error(runs: dict) -> None:
    out, result, stderr = runs["failures"]
    assert result["blocked_disabled"] is True and result["recovered_disabled"] is False
    assert "Not a directory" in stderr
    series = scalars(out / "tb" / "rank_0")
    recovered = result["recovered"]
    assert series["loss"] == {10 + s: f32(v) for s, v in zip(recovered["steps"], recovered["loss"])}


@pytest.mark.parametrize("writer", ["dead", "hung"])
def test_the_end_of_training_wait_is_bounded(runs: dict, writer: str) -> None:
    out, result, stderr = runs["failures"]
    run = result[writer]
    waited = run["after"] - run["before"]
    if writer == "dead":  # no wait at all for a writer known dead
        assert run["disabled"] is True and waited < 0.5  # was STOP_TIMEOUT
        assert "No space left on device" in stderr
    else:
        assert STOP_TIMEOUT - 0.05 <= waited <= STOP_TIMEOUT + 0.75  # was twice STOP_TIMEOUT
        assert "did not finish in" in stderr
    assert scalars(out / writer / "rank_0")["loss"] == {1: f32(run["loss"][0])}  # written before the failure


def test_compute_grad_norm_leaves_the_model_bit_identical(runs: dict) -> None:
    (plain_out, _, _), (norm_out, result, _) = runs["bn-plain"], runs["bn-norm"]
    plain, norm = np.load(plain_out / "final.npz"), np.load(norm_out / "final.npz")
    assert {"1.moving_mean", "1.moving_variance", "0.weight", "moments.0.weight", "global_step"} <= set(plain.files)
    assert plain.files == norm.files
    assert [k for k in plain.files if not np.array_equal(plain[k], norm[k])] == []
    assert np.abs(norm["1.moving_mean"]).max() > 0.01  # the statistics did move in training
    plain_tb, norm_tb = scalars(plain_out / "tb" / "rank_0"), scalars(norm_out / "tb" / "rank_0")
    assert plain_tb["loss"] == norm_tb["loss"] and len(norm_tb["loss"]) == 8
    assert "grad-norm" not in plain_tb
    assert [norm_tb["grad-norm"][s] for s in range(1, 9)] == pytest.approx(result["norm_reference"], rel=1e-5)


@pytest.mark.parametrize("mode", ["graph", "pynative"])
def test_compute_grad_norm_leaves_dropout_masks_as_they_were(runs: dict, mode: str) -> None:
    out, result, _ = runs["dropout"]
    plain, norm = np.load(out / f"{mode}-plain.npz"), np.load(out / f"{mode}-norm.npz")
    assert plain.files == norm.files and "first.weight" in plain.files
    assert [k for k in plain.files if not np.array_equal(plain[k], norm[k])] == []
    assert result[f"{mode}-plain"]["loss"] == result[f"{mode}-norm"]["loss"]
    written = scalars(out / f"{mode}-norm" / "rank_0")
    assert sorted(written["grad-norm"]) == list(range(1, 9)) and "grad-norm" not in scalars(out / f"{mode}-plain" / "rank_0")


def test_a_reused_callback_measures_the_new_network(runs: dict) -> None:
    out, result, stderr = runs["reuse"]
    series = scalars(out / "tb" / "rank_0")
    second = result["second"]
    # the second model has a new optimizer: it restarts at step 1 and supersedes the first's points
    assert series["loss"] == {s: f32(v) for s, v in zip(second["steps"], second["loss"])}
    assert [series["grad-norm"][s] for s in second["steps"]] == pytest.approx(second["norm"], rel=1e-5)
    assert abs(second["norm"][0] - result["first"]["norm"][-1]) > 1.0  # the two networks differ
    assert "compute_grad_norm is off" not in stderr


@pytest.mark.parametrize("name", ["poly-sqrt", "cosine", "warmup", "list"])
def test_cached_learning_rates_equal_one_step_evaluation(runs: dict, name: str) -> None:
    out, result, _ = runs["schedules"]
    written = scalars(out / name / "rank_0")["learning-rate"]
    one_step = {int(s): v for s, v in result[name]["one_step"].items()}
    assert written == {s: f32(one_step[s]) for s in range(3, 25, 3)}
