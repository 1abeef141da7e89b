"""Cost of ``TensorBoardCallback`` per point, before and after, side by side in one process.

Why it exists: the callback runs on the training thread, so every microsecond it takes is added
to every step it writes. This trains a toy network (MindSpore on the CPU, Dense(4, 1), MSE,
Momentum with a ``PolynomialDecayLR`` schedule, batch 4: a step of about a millisecond, so the
callback's cost is not hidden by the step) and times ``model.train`` with no callback, with the
baseline callback and with the current one, ``--reps`` times in rotating order, each callback
object reused as a training script reuses it across ``model.train`` calls. Each ``model.train``
writes to a fresh run directory, so the figures are per point: a writer first reads the run
directory it continues (about 0.1 ms a point already there, MindSpore's protobuf being pure
Python), and in one directory that scan would grow with every rep (``--same-dir`` measures that
way). The baseline is ``sidecar/inprocess.py`` as of ``--baseline`` (a git revision), written to
a temporary directory and imported from there for this run only.

Figures, all medians over reps:

- step ms: wall time of ``model.train`` / steps, the writer's drain at the end included;
- cost/point us: (time with the callback - time without it, in the same rep) / points written;
- hooks/point us: the time spent inside the callback's hooks on the training thread;
- first +s: the extra seconds of the first ``model.train`` with the callback (its graph
  compilations: the baseline's learning-rate schedule, the current one's block of it).

It measures; it asserts nothing (it is not a test). Run it with the venv's Python:

    .venv/bin/python bench/bench_callback.py                 # graph mode, 2,000 steps, 7 reps
    .venv/bin/python bench/bench_callback.py --mode pynative --steps 300
    .venv/bin/python bench/bench_callback.py --same-dir      # every model.train into one run directory
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
BASELINE = "5d897d7"  # the last revision before issue 14's changes to sidecar/inprocess.py


def load_baseline(rev: str, into: Path) -> ModuleType:
    """``sidecar/inprocess.py`` at ``rev`` as a module of its own (it imports today's helpers;
    the run writer has moved to ``sidecar.output`` since, so that import is pointed there)."""
    source = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:sidecar/inprocess.py"],
                            capture_output=True, text=True, check=True).stdout
    source = source.replace("from sidecar.run_writer import", "from sidecar.output.run_writer import")
    path = into / "inprocess_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("inprocess_baseline", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def timed(callback: Any) -> list[float]:
    """Time ``callback``'s per-step hooks: the returned list collects the seconds spent in them."""
    spent: list[float] = []
    for name in ("on_train_step_begin", "on_train_step_end"):
        hook = getattr(callback, name)

        def wrapper(run_context: Any, hook: Any = hook) -> None:
            began = time.perf_counter()
            hook(run_context)
            spent.append(time.perf_counter() - began)

        setattr(callback, name, wrapper)
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("graph", "pynative"), default="graph")
    parser.add_argument("--steps", type=int, default=2000, help="steps per model.train (default 2000)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--same-dir", dest="fresh", action="store_false",
                        help="every model.train into the same run directory (default: a fresh one each)")
    parser.add_argument("--baseline", default=BASELINE, help=f"git revision of the baseline (default {BASELINE})")
    args = parser.parse_args()

    import mindspore as ms
    import mindspore.dataset as ds
    from mindspore import nn
    from mindspore.train import Model

    from sidecar import inprocess

    ms.set_context(mode=ms.PYNATIVE_MODE if args.mode == "pynative" else ms.GRAPH_MODE)
    ms.set_seed(0)
    with tempfile.TemporaryDirectory(prefix="mstb-bench-cb-") as tmp:
        root = Path(tmp)
        os.chdir(root)  # MindSpore's graph dumps, if any, stay in the temp dir
        baseline = load_baseline(args.baseline, root)
        rng = np.random.default_rng(0)
        x = rng.normal(size=(args.steps * 4, 4)).astype(np.float32)
        y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)
        data = ds.NumpySlicesDataset({"x": x, "y": y}, shuffle=False).batch(4)
        net = nn.Dense(4, 1)
        schedule = nn.PolynomialDecayLR(0.05, 0.005, args.steps * args.reps * 3, 2.0)
        model = Model(net, loss_fn=nn.MSELoss(), optimizer=nn.Momentum(net.trainable_params(), schedule, 0.9))
        model.train(1, data, dataset_sink_mode=False)  # compile and warm up

        callbacks = {"none": [], "baseline": [baseline.TensorBoardCallback(root / "baseline", rank=0)],
                     "current": [inprocess.TensorBoardCallback(root / "current", rank=0)]}
        seconds: dict[str, list[float]] = {name: [] for name in callbacks}
        hooks: dict[str, list[float]] = {name: [] for name in callbacks if name != "none"}
        first: dict[str, float] = {}
        spent = {name: timed(cbs[0]) for name, cbs in callbacks.items() if cbs}
        names = list(callbacks)
        for rep in range(args.reps + 1):  # rep 0: the first model.train with each callback, reported apart
            for name in names[rep % 3:] + names[:rep % 3]:
                spent.get(name, []).clear()
                for callback in callbacks[name]:
                    callback.out_dir = root / name / (f"train{rep}" if args.fresh else "run")
                began = time.perf_counter()
                model.train(1, data, callbacks=callbacks[name], dataset_sink_mode=False)
                took = time.perf_counter() - began
                if rep == 0:
                    first[name] = took
                    continue
                seconds[name].append(took)
                if name in spent:
                    hooks[name].append(sum(spent[name]) / args.steps)

    print(f"mode {args.mode}, {args.steps} steps x {args.reps} reps, one point per step, "
          f"{'a fresh run directory per model.train' if args.fresh else 'one run directory'}; "
          f"python {platform.python_version()}, mindspore {ms.__version__}, {os.cpu_count()} cpus, "
          f"baseline {args.baseline}")
    print(f"{'variant':<10}{'step ms':>10}{'cost/point us':>16}{'hooks/point us':>17}{'first +s':>14}")
    cost: dict[str, float] = {}
    for name in names:
        step_ms = statistics.median(seconds[name]) / args.steps * 1e3
        line = f"{name:<10}{step_ms:>10.3f}"
        if name != "none":
            cost[name] = statistics.median(
                (t - t0) / args.steps * 1e6 for t, t0 in zip(seconds[name], seconds["none"]))
            line += f"{cost[name]:>16.1f}{statistics.median(hooks[name]) * 1e6:>17.1f}"
            line += f"{first[name] - first['none']:>14.2f}"
        print(line)
    print(f"ratio current/baseline: cost {cost['current'] / cost['baseline']:.2f}, "
          f"hooks {statistics.median(hooks['current']) / statistics.median(hooks['baseline']):.2f}")


if __name__ == "__main__":
    sys.exit(main())
