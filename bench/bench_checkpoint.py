"""What the alert detectors add to each checkpoint, for many ranks: bytes and seconds per save.

The product keeps each detector's window as float32, little-endian, base64 (``LevelState.values``);
the baseline is the same state with each window as a JSON list of floats, what a plain
``list[float]`` field would give. Both build the ranks' part of the checkpoint from the same
detectors, ``--reps`` times, interleaved; it prints the medians and their ratio. It measures;
it asserts nothing (``tests/test_detectors.py`` checks the size stays small, not the time).

    .venv/bin/python bench/bench_checkpoint.py              # 1,024 ranks, full windows, 7 reps
    .venv/bin/python bench/bench_checkpoint.py --ranks 4096
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from parsers import tags  # noqa: E402
from parsers.records import Record  # noqa: E402
from sidecar.analysis.alerts import Alerts  # noqa: E402
from sidecar.analysis.watch import _unpack  # noqa: E402


def filled(ranks: int, steps: int) -> Alerts:
    """Every detector of ``ranks`` ranks after ``steps`` steps of a slowly rising loss and grad norm."""
    alerts = Alerts(None, False)
    for rank in range(ranks):
        for n in range(1, steps + 1):
            alerts.observe(rank, Record(n, None, {tags.LOSS: 2.0 + 0.001 * n, tags.GRAD_NORM: 1.0 + 0.001 * n,
                                                  tags.THROUGHPUT: 100.0 + n % 2}, training_step=True), 0.0)
    return alerts


def product(alerts: Alerts, ranks: int) -> str:
    return "[" + ",".join(alerts.snapshot(rank).model_dump_json() for rank in range(ranks)) + "]"


def windows_as_lists(alerts: Alerts, ranks: int) -> list[dict]:
    """The same state with each window as a list of floats (made once: the detectors' windows)."""
    states = []
    for rank in range(ranks):
        state = alerts.snapshot(rank).model_dump(mode="json")
        for level in state["baselines"]["levels"].values():
            level["values"] = _unpack(level["values"], "f")
        states.append(state)
    return states


def baseline(states: list[dict]) -> str:
    """Each window copied into a list (as a snapshot must, the detectors go on) and dumped as JSON."""
    return json.dumps([{**state, "baselines": {**state["baselines"], "levels": {
        name: {**level, "values": list(level["values"])} for name, level in state["baselines"]["levels"].items()}}}
        for state in states])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--steps", type=int, default=120, help="steps observed per rank (120 fills the windows)")
    p.add_argument("--reps", type=int, default=7)
    a = p.parse_args(argv)
    alerts = filled(a.ranks, a.steps)
    times: dict[str, list[float]] = {"product": [], "baseline": []}
    sizes: dict[str, int] = {}
    states = windows_as_lists(alerts, a.ranks)
    builds = {"product": lambda: product(alerts, a.ranks), "baseline": lambda: baseline(states)}
    for _ in range(a.reps):
        for name, build in builds.items():
            started = time.perf_counter()
            text = build()
            times[name].append(time.perf_counter() - started)
            sizes[name] = len(text)
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"{a.ranks} ranks x {a.steps} steps, median of {a.reps}")
    for name in ("product", "baseline"):
        print(f"  {name:9} {med[name] * 1000:8.1f} ms  {sizes[name] / 1024:8.0f} KiB")
    print(f"  baseline / product: {med['baseline'] / med['product']:.2f}x the time, "
          f"{sizes['baseline'] / sizes['product']:.2f}x the bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
