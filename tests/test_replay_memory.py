"""A replay's memory is flat in the log's length: ten times the steps, no more memory.

A replay reads each file a megabyte at a time, and what it keeps per rank is bounded (the
sequencer's window of identities, the aggregate's LEAD steps, the detectors' windows, the event
files' buffers), so once those are full, within the first few thousand steps, its peak memory
no longer grows with the log. A leak of even 100 bytes per record would add 7 MB here.

The peak is the process's own high-water mark (``VmHWM``), read by the replaying process at its
end: ``ru_maxrss`` of a child of pytest counts pytest's own memory (the child starts as a copy of
it), so the replay runs its real entry point (``sidecar.cli.main``) in a fresh interpreter that
reports its ``VmHWM`` and, for a replay with workers, their peaks (``RUSAGE_CHILDREN``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from live_helpers import RankLog
from tb_read import scalars

SHORT, LONG = 4_000, 40_000  # steps per rank; the bounded structures are full from about 3,000
SLACK_MB = 5.0  # allocator noise; what a replay of SHORT steps needs is about 45 MB

# Replays as ``mstb-sidecar`` does, then prints its peaks (MB): its own, and its workers'.
MEASURE = """
import json, resource, sys
from sidecar.cli import main
code = main(sys.argv[1:])
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"code": code, "self": hwm / 1024,
                  "workers": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


@pytest.fixture(scope="module")
def trees(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Two ranks of mindformers v1.9 step records, SHORT and LONG steps long."""
    made = {}
    for steps in (SHORT, LONG):
        root = tmp_path_factory.mktemp(f"steps{steps}") / "output"
        for rank in range(2):
            log = RankLog(root / "log" / f"rank_{rank}" / "info.log", rank)
            log.write(b"".join(log.take() for _ in range(steps)))
        made[steps] = root
    return made


def _peaks(root: Path, out: Path, jobs: int) -> dict[str, float]:
    proc = subprocess.run([sys.executable, "-c", MEASURE, "replay", str(root), "--out", str(out), "--quiet",
                           "--jobs", str(jobs)], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    peaks = json.loads(proc.stdout.strip().splitlines()[-1])
    assert peaks.pop("code") == 0, proc.stderr
    return peaks


@pytest.mark.parametrize("jobs", [1, 2], ids=["one-process", "two-workers"])
def test_ten_times_the_steps_needs_no_more_memory(trees: dict[int, Path], tmp_path: Path, jobs: int) -> None:
    short = _peaks(trees[SHORT], tmp_path / "short", jobs)
    long = _peaks(trees[LONG], tmp_path / "long", jobs)
    assert (short["workers"] > 0) == (jobs > 1), f"--jobs {jobs}: workers {short['workers']} MB"
    for what in ("self", "workers"):
        assert long[what] <= short[what] + SLACK_MB, (
            f"--jobs {jobs}, {what}: {LONG} steps peaked at {long[what]:.1f} MB, {SHORT} at {short[what]:.1f} MB")
    loss = scalars(tmp_path / "long" / "rank_1")["loss"]  # and the long replay did read to the end
    assert sorted(loss) == list(range(1, LONG + 1)) and loss[LONG] == 100_000 + LONG, f"{len(loss)} loss points"
