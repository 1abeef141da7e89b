"""Speed benchmark: ``mstb-sidecar replay`` against the ad hoc regex + tensorboardX script.

Why it exists: the product does more than a ten-minute script does (resume checkpoints,
de-duplication, all log versions, durable writes), and this tells us what that costs or saves on
a realistic input. It measures; it asserts nothing (it is not a test).

What it does, in one invocation:

1. generates a deterministic mindformers v1.9 graph-trainer log tree in a temp dir
   (``output/log/rank_N/info.log``, file format; or ``--layout worker`` for msrun's
   ``output/msrun_log/worker_N.log`` in stdout format with MindSpore foreign lines);
2. runs the contenders as subprocesses on the same tree, ``--reps`` times each, rotating which
   goes first, each into a fresh output dir: the product, the baseline as people run it, and the
   baseline pinned to one core (``taskset -c 0``; its writer thread then stops fighting its main
   thread for the GIL across cores); subprocesses because that is what a user runs
   (interpreter start and imports included, measured separately as the startup floor), because
   ``os.wait4`` then gives each run's own peak RSS and CPU time, and because nothing
   (logging setup, module state, warm caches of objects) leaks from one repetition into the next;
3. replays the product again into an already-written output dir (the idempotent no-op path);
4. reads the product's and the baseline's outputs back once with TensorBoard's ``EventAccumulator``
   and warns if the number of ``loss`` points per rank differs, so the ratios compare equal work.

    .venv/bin/python bench/bench_replay.py            # ~70 MB tree, 5 reps
    .venv/bin/python bench/bench_replay.py --quick    # smoke run in a few seconds
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
BASELINE = BENCH / "baseline_regex_replay.py"

# -- the input ---------------------------------------------------------------------------------

CB = "mindformers/core/callback/callback.py"
BT = "mindformers/trainer/base_trainer.py"
BAR_CHAR = "\u2588"
# Non-metric INFO lines a v1.9 run prints between step records (grouped lr, dataset, memory).
NOISE = (
    (CB, 757, "print_output_info", "default_lr: {lr:.6e}, equal to `lr:` above."),
    (CB, 760, "print_output_info", "group_0_lr: {half:.6e}, group_0_params: ['model.embedding.word_embeddings.weight']"),
    ("mindformers/dataset/dataloader/blended_megatron_dataloader.py", 211, "__getitem__",
     "Fetched global batch {g} from 17 shards, prefetch queue depth 4"),
    (CB, 1488, "on_train_step_end", "Device memory: allocated 27.41 GB, reserved 31.00 GB, peak 29.87 GB"),
    ("mindformers/wrapper/wrapper.py", 402, "construct", "Gradient accumulation finished for micro batch 8/8"),
)
# MindSpore-native lines that msrun interleaves into worker logs (never in info.log).
FOREIGN = (
    "[WARNING] ME({pid}:281473096347664,MainProcess):{nts} [mindspore/common/_decorator.py:40] "
    "'TensorAdd' is deprecated from version 1.1 and will be removed in a future version, use 'Add' instead.",
    "[WARNING] DEVICE({pid},ffff8febf010,python):{nts} [mindspore/ccsrc/plugin/res_manager/ascend/"
    "mem_manager/ascend_memory_pool.cc:154] FreeIdleMemsByEagerFree] Eager free memory size is 1073741824.",
)


@dataclass
class Tree:
    root: Path  # what every contender is pointed at
    files: int
    bytes: int
    lines: int
    ranks: int
    steps: int  # training steps per rank


class _Clock:
    """Log timestamps (UTC, so the bytes do not depend on the machine's zone)."""

    def __init__(self, start: float) -> None:
        self.t = start
        self._sec = -1
        self._text = ""

    def mf(self) -> str:
        sec = int(self.t)
        if sec != self._sec:
            self._sec, self._text = sec, time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(sec))
        return f"{self._text},{int((self.t - sec) * 1000):03d}"

    def native(self) -> str:
        us = int((self.t - int(self.t)) * 1e6)
        return time.strftime("%Y-%m-%d-%H:%M:%S", time.gmtime(self.t)) + f".{us // 1000:03d}.{us % 1000:03d}"


def generate(base: Path, layout: str, ranks: int, steps: int, noise: int, epochs: int,
             ckpt_every: int, foreign_share: float, seed: int) -> Tree:
    """Write the log tree; same arguments, same bytes."""
    per_epoch = math.ceil(steps / epochs)
    total_files = total_bytes = total_lines = 0
    for rank in range(ranks):
        rng = random.Random(seed * 1000 + rank)
        clock = _Clock(1795946400.0 + 0.05 * rank)  # 2026-11-29 10:00:00 UTC
        if layout == "info":
            path = base / "output" / "log" / f"rank_{rank}" / "info.log"
            fmt = "[INFO] {ts} [{src}:{ln}] {fn}: {msg}\n"
        else:
            path = base / "output" / "msrun_log" / f"worker_{rank}.log"
            fmt = "{ts} - mindformers/data/jobs/bench/output/log[{src}:{ln}] - INFO - {msg}\n"
        path.parent.mkdir(parents=True, exist_ok=True)
        out: list[str] = []

        def info(src: str, ln: int, fn: str, msg: str) -> None:
            out.append(fmt.format(ts=clock.mf(), src=src, ln=ln, fn=fn, msg=msg))

        for ln, fn, msg in ((912, "training_process", ".........Build Dataset For Train.........."),
                            (449, "create_train_dataset", f"Will be Training epochs:{epochs}, sink_size:1"),
                            (930, "training_process", ".........Build Net For Train.........."),
                            (1077, "training_process", ".........Model Compiling, Please Wait a Moment..........."),
                            (1081, "training_process", ".........Starting Training Model..........")):
            clock.t += 2.0
            info(BT, ln, fn, msg)
        loss, total = 4.2, per_epoch * epochs
        for i in range(steps):
            epoch, local = divmod(i, per_epoch)
            g = i + 1
            lr = 3e-5 * min(1.0, g / 200) * (0.55 + 0.45 * math.cos(math.pi * g / total))
            loss = max(1.2, loss * 0.9997 + rng.gauss(0, 0.01))
            ms = int(rng.gauss(2890, 40))
            clock.t += ms / 1000
            info(CB, 733, "print_output_info",
                 f"{{ Epoch:[{epoch + 1:3d}/{epochs:3d}], step:[{local + 1:5d}/{per_epoch:5d}], loss: {loss:.6f}, "
                 f"per_step_time: {ms}ms, lr: {lr:.7g}, overflow cond: False, loss_scale: 1.0, "
                 f"global_norm: [{rng.uniform(0.8, 2.0):.7f}], train_throughput_per_npu: {rng.gauss(195, 2):.3f}T")
            pct = 100.0 * g / total
            eta = int((total - g) * ms / 1000)
            info(CB, 753, "print_output_info",
                 f"  {pct:4.1f}% |{BAR_CHAR * int(pct / 2):<50}| {rng.gauss(0.86, 0.01):.5f} samples/s/p  "
                 f"{eta // 3600}:{eta // 60 % 60:02d}:{eta % 60:02d} }}")
            for j in range(noise):
                if layout == "worker" and rng.random() < foreign_share:
                    out.append(FOREIGN[j % len(FOREIGN)].format(pid=41872 + rank, nts=clock.native()) + "\n")
                else:
                    src, ln, fn, msg = NOISE[j % len(NOISE)]
                    info(src, ln, fn, msg.format(lr=lr, half=lr / 2, g=g))
            if ckpt_every and g % ckpt_every == 0:
                info(CB, 880, "save_ckpt", "......Saving ckpt......")
                info(CB, 887, "save_ckpt", f"global_step: {g}")
                clock.t += 20.0
                info(CB, 936, "_save_ckpt",
                     f"Finish saving ckpt of epoch {epoch + 1} step {local + 1} using {rng.uniform(14, 34):.3f} seconds")
        info(BT, 1090, "training_process", ".........Training Over!.............")
        data = "".join(out).encode()
        path.write_bytes(data)
        total_files += 1
        total_bytes += len(data)
        total_lines += len(out)
    root = base / "output" / ("log" if layout == "info" else "msrun_log")
    return Tree(root, total_files, total_bytes, total_lines, ranks, steps)


# -- running -----------------------------------------------------------------------------------


@dataclass
class Run:
    seconds: float
    cpu: float  # user + sys of the child
    rss_mb: float


def child_env(scratch: Path) -> dict[str, str]:
    """The environment of every contender: bytecode cached (under ``scratch``, warmed by the
    startup-floor runs), as an installed package has it, even where ``PYTHONDONTWRITEBYTECODE``
    is set; otherwise each run would compile every module it imports again."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(scratch / "pycache")
    return env


def run_child(cmd: list[str], scratch: Path) -> Run:
    """Wall time, CPU and peak RSS of one subprocess; exits the benchmark if it fails."""
    err = scratch / "stderr.txt"
    with open(err, "wb") as fh:
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=fh, env=child_env(scratch))
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)  # wait4 reaped it; tell Popen
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{err.read_text(errors='replace')[-2000:]}")
    return Run(seconds, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024)


def product_cmd(root: Path, out: Path) -> list[str]:
    exe = Path(sys.executable).parent / "mstb-sidecar"
    head = [str(exe)] if exe.exists() else [sys.executable, "-m", "sidecar.cli"]
    return [*head, "replay", str(root), "--out", str(out), "--quiet"]


def one_process_cmd(root: Path, out: Path) -> list[str]:
    """The product without its replay workers: what the parallel speed-up is measured against,
    and whose output the parallel replay's must equal."""
    return [*product_cmd(root, out), "--jobs", "1"]


def baseline_cmd(root: Path, out: Path) -> list[str]:
    return [sys.executable, str(BASELINE), str(root), "--out", str(out)]


def pinned_cmd(root: Path, out: Path) -> list[str]:
    """The baseline on one core, as ``taskset -c 0`` runs it: its writer thread and main thread then
    stop fighting over the GIL across cores, which makes it about twice as fast."""
    return [sys.executable, "-c", PIN, str(min(os.sched_getaffinity(0))), *baseline_cmd(root, out)]


PIN = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])}); os.execv(sys.argv[2], sys.argv[2:])"
CONTENDERS = {"product": product_cmd, "baseline": baseline_cmd, "pinned": pinned_cmd}


@dataclass
class Series:
    runs: list[Run] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(r.seconds for r in self.runs)


def read_back(out: Path) -> tuple[dict[int, int], int]:
    """(loss points per rank, all scalar points) as TensorBoard itself would load them."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    loss: dict[int, int] = {}
    total = 0
    for run_dir in sorted(out.glob("rank_*")):
        acc = ea.EventAccumulator(str(run_dir), size_guidance={ea.SCALARS: 0})
        acc.Reload()
        tags = acc.Tags()[ea.SCALARS]
        counts = {tag: len(acc.Scalars(tag)) for tag in tags}
        loss[int(run_dir.name.split("_")[1])] = counts.get("loss", 0)
        total += sum(counts.values())
    return loss, total


def identical(parallel: Path, one: Path, clock: tuple[float, float]) -> str:
    """Whether the default (parallel) replay wrote every event (run, tag, step, value, wall time)
    the one-process replay did; wall times taken from the clock, not the log, are left out."""
    sys.path.insert(0, str(BENCH.parent / "tests"))
    from tb_read import all_events

    a, b = all_events(parallel, clock), all_events(one, clock)
    if a == b:
        return f"the default replay's {sum(map(len, a.values())):,} events equal the one-process replay's"
    differ = sorted(run for run in a.keys() | b.keys() if a.get(run) != b.get(run))
    return f"WARNING: the default replay's events differ from the one-process replay's in {', '.join(differ)}"


def event_bytes(out: Path) -> int:
    return sum(p.stat().st_size for p in out.glob("rank_*/events.out.tfevents.*"))


# -- report ------------------------------------------------------------------------------------


def machine() -> str:
    model = ""
    try:
        model = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"machine: nproc={cpus} ({model or platform.processor()}), python {platform.python_version()} "
            f"({sys.executable}), {platform.system()} {platform.release()}")


def table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)


def row(name: str, s: Series, tree: Tree | None, points: int | None) -> tuple[str, ...]:
    t = s.median
    rate = (lambda n: f"{n / t:,.0f}") if tree else (lambda n: "-")
    return (name, f"{t:.3f}", f"{min(r.seconds for r in s.runs):.3f}",
            f"{statistics.median(r.cpu for r in s.runs):.2f}",
            rate(tree.lines) if tree else "-", f"{tree.bytes / 1e6 / t:.1f}" if tree else "-",
            rate(points) if tree and points is not None else "-",
            f"{max(r.rss_mb for r in s.runs):.0f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Benchmark mstb-sidecar replay against a regex + tensorboardX script.")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--steps", type=int, default=7000, help="training steps per rank")
    p.add_argument("--noise", type=int, default=4, help="non-metric lines per step")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--ckpt-every", type=int, default=1000, help="steps between checkpoint-save lines (0: none)")
    p.add_argument("--layout", choices=("info", "worker"), default="info",
                   help="info: output/log/rank_N/info.log (file format); worker: msrun_log/worker_N.log "
                        "(stdout format, MindSpore foreign lines mixed in)")
    p.add_argument("--foreign-share", type=float, default=0.3, help="worker layout: share of noise lines that are foreign")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="smoke run: 2 ranks x 1500 steps, 3 reps")
    p.add_argument("--tmp", type=Path, help="where to put the temp dir (default: system temp)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir and print its path")
    a = p.parse_args(argv)
    if a.quick:
        a.ranks, a.steps, a.reps = 2, 1500, 3

    work = Path(tempfile.mkdtemp(prefix="mstb-bench-", dir=a.tmp))
    started = time.time()  # wall times from here on come from the clock, not from the generated logs
    try:
        t0 = time.perf_counter()
        tree = generate(work / "in", a.layout, a.ranks, a.steps, a.noise, a.epochs, a.ckpt_every,
                        a.foreign_share, a.seed)
        print(f"input: {tree.files} files under {tree.root.relative_to(work / 'in')} ({a.layout} layout), "
              f"{tree.bytes / 1e6:.1f} MB, {tree.lines:,} lines, {tree.ranks} ranks x {tree.steps:,} steps, "
              f"{a.noise} noise lines/step (generated in {time.perf_counter() - t0:.1f} s)")

        empty = work / "empty"
        empty.mkdir()
        floor = {name: statistics.median(run_child(cmd(empty, work / f"floor-{name}-{i}"), work).seconds
                                         for i in range(3)) for name, cmd in CONTENDERS.items()}

        series = {name: Series() for name in CONTENDERS}
        last: dict[str, Path] = {}
        for rep in range(a.reps):
            order = list(CONTENDERS)[rep % len(CONTENDERS):] + list(CONTENDERS)[:rep % len(CONTENDERS)]
            for name in order:
                out = work / f"out-{name}-{rep}"
                series[name].runs.append(run_child(CONTENDERS[name](tree.root, out), work))
                if name in last:
                    shutil.rmtree(last[name])  # keep the disk (and page cache) footprint flat
                last[name] = out
            print(f"  rep {rep + 1}/{a.reps}: " + ", ".join(f"{n} {series[n].runs[-1].seconds:.2f} s" for n in order),
                  flush=True)

        before = event_bytes(last["product"])
        noop = Series([run_child(product_cmd(tree.root, last["product"]), work) for _ in range(a.reps)])
        grew = event_bytes(last["product"]) - before
        one = Series([run_child(one_process_cmd(tree.root, work / f"out-one-{i}"), work) for i in range(a.reps)])
        same = identical(last["product"], work / f"out-one-{a.reps - 1}", (started, time.time()))

        t0 = time.perf_counter()
        counts = {name: read_back(out) for name, out in last.items() if name != "pinned"}  # the same script
        verify_s = time.perf_counter() - t0

        rows = [("contender", "median s", "min s", "cpu s", "lines/s", "MB/s", "points/s", "peak RSS MB")]
        rows.append(row("product  mstb-sidecar replay", series["product"], tree, counts["product"][1]))
        rows.append(row("baseline regex+tensorboardX", series["baseline"], tree, counts["baseline"][1]))
        rows.append(row("baseline pinned to one core", series["pinned"], tree, counts["baseline"][1]))
        rows.append(row("product  one process (--jobs 1)", one, tree, counts["product"][1]))
        rows.append(row("product  2nd replay (no-op)", noop, None, None))
        print()
        print(table(rows))
        print("startup floor (empty input, median of 3): " + ", ".join(f"{n} {t:.3f} s" for n, t in floor.items()))
        print(f"points written: product {counts['product'][1]:,}, baseline {counts['baseline'][1]:,} "
              f"(read back with EventAccumulator in {verify_s:.1f} s); 2nd replay added {grew} event bytes")
        loss_p, loss_b = counts["product"][0], counts["baseline"][0]
        if loss_p != loss_b or any(n != tree.steps for n in loss_p.values()):
            print(f"WARNING: loss points per rank differ (product {loss_p}, baseline {loss_b}, "
                  f"expected {tree.steps} each): the ratio does not compare equal work")
        else:
            print(f"check: loss points per rank equal ({tree.steps:,} on each of {tree.ranks} ranks)")
        print(f"check: {same}")
        for name, label in (("baseline", "free-running baseline"), ("pinned", "pinned baseline")):
            ratio = series[name].median / series["product"].median
            verdict = f"{ratio:.1f}x faster" if ratio >= 1 else f"{1 / ratio:.1f}x slower"
            print(f"ratio ({label} / product time): {verdict}")
        print(machine())
    finally:
        if a.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
