"""The one-command benchmark (``bench/run_all.py``) still runs end to end and prints its table.

It checks that the benchmark works (a tiny ``--smoke`` configuration: one short replay, two
ranks written live for a second, eight idle files), never how fast anything is: speed is
measured in bench/, not asserted in tests. No baseline revision (``--baseline none``): a shallow
clone may not hold it, and the comparison code is the same for one contender or two.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_run_all_smoke_prints_every_figure(tmp_path: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, str(REPO / "bench" / "run_all.py"), "--smoke", "--baseline", "none"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = done.stdout.split("== all figures ==", 1)[1]
    assert "check: loss points per rank equal (50 on each of 1 ranks)" in figures
    table = [re.split(r"\s{2,}", line.strip()) for line in figures.splitlines() if "  " in line]
    head = next(row for row in table if row[0] == "live (median over reps)")
    current, burst = head.index("current"), head.index("every burst")
    rows = {row[0]: row[current] for row in table if len(row) > current}
    for label in ("live CPU ms / 1,000 lines", "live latency p99 ms", "idle % core, inotify", "idle % core, --poll",
                  "startup s, replay --help", "startup s, replay of empty dir"):
        float(rows[label])  # a number was measured for each figure
    assert float(rows["live CPU ms / 1,000 lines"]) > 0
    every_burst = next(row for row in table if row[0] == "live CPU ms / 1,000 lines")[burst]
    assert float(every_burst) > 0  # the current tree reading every burst as it comes (--min-read-interval 0)
    assert not list(tmp_path.iterdir()), "the benchmark left its temp files behind"


def test_checkpoint_bench_measures_both_contenders() -> None:
    """bench_checkpoint.py builds the detectors' checkpoint part both ways and prints a figure for each."""
    done = subprocess.run([sys.executable, str(REPO / "bench" / "bench_checkpoint.py"), "--ranks", "8", "--reps", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = dict(re.findall(r"^\s+(product|baseline)\s+([\d.]+) ms", done.stdout, re.M))
    assert set(figures) == {"product", "baseline"}, done.stdout
    assert re.search(r"baseline / product: [\d.]+x the time, [\d.]+x the bytes", done.stdout), done.stdout
