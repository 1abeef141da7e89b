"""Every benchmark in one command, and one table of the figures at the end.

Runs :mod:`bench_replay` (replay against the ad hoc regex + tensorboardX script) and then
:mod:`bench_live` (live CPU per 1,000 lines and latency, idle cost with inotify and ``--poll``,
startup; the current tree against ``--baseline``), each printing its own details as it goes,
then both tables again together. It measures; it asserts nothing.

    .venv/bin/python bench/run_all.py             # ~8 min
    .venv/bin/python bench/run_all.py --smoke     # checks that it all still runs (CI); figures meaningless
"""

from __future__ import annotations

import argparse
import io
import sys
from contextlib import redirect_stdout
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_live  # noqa: E402
import bench_replay  # noqa: E402

SMOKE_REPLAY = ["--ranks", "1", "--steps", "50", "--reps", "1"]


class _Tee(io.TextIOBase):
    """Print as it goes and keep a copy (bench_replay prints its table, it does not return it)."""

    def __init__(self) -> None:
        self.kept = io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        return sys.__stdout__.write(text)

    def flush(self) -> None:
        sys.__stdout__.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Run bench_replay and bench_live and print their figures together.")
    p.add_argument("--smoke", action="store_true", help="tiny runs that only check the benchmarks work")
    p.add_argument("--baseline", default=bench_live.BASELINE,
                   help="bench_live's baseline: git revision or source directory, or 'none'")
    p.add_argument("--replay-args", default="", help="extra arguments for bench_replay, e.g. '--steps 4000'")
    a = p.parse_args(argv)

    print("== replay ==", flush=True)
    tee = _Tee()
    with redirect_stdout(tee):
        bench_replay.main((SMOKE_REPLAY if a.smoke else []) + a.replay_args.split())
    replay_table = _table_of(tee.kept.getvalue())

    print("\n== live ==", flush=True)
    live_args = ["--baseline", a.baseline] + (["--smoke"] if a.smoke else [])
    live_rows = bench_live.run(bench_live.parse_args(live_args))

    print("\n== all figures ==")
    print(replay_table)
    print()
    print(bench_replay.table(live_rows))
    print(bench_replay.machine())
    return 0


def _table_of(output: str) -> str:
    """bench_replay's table and the verdict lines after it (from its header row to the last ratio)."""
    lines = output.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("contender")), 0)
    end = max((i for i, line in enumerate(lines) if line.startswith("ratio")), default=len(lines) - 1)
    return "\n".join(lines[start:end + 1])


if __name__ == "__main__":
    sys.exit(main())
