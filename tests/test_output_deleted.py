"""Output deleted under a running sidecar: never checkpointed as written, always written again.

A cleanup job or a user removes a run directory (``rm -rf --out/rank_0``), the event file being
written, or the whole ``--out`` while the sidecar follows a log that keeps growing. The daemon
must notice at its next checkpoint (before the checkpoint could claim the lost steps), warn,
read the logs again and rewrite what is gone, so that TensorBoard ends with every step exactly
once (its own loaders, raw records too). Replay stops with one error line and exit status 1,
and running the same replay again restores everything.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from live_helpers import (
    BIN,
    LiveEnv,
    RankLog,
    SteadyWriter,
    all_written,
    assert_exactly_once,
    event_files,
    free_port,
    raw_run,
    scrape,
    wait_until,
)

pytest_plugins = ["live_helpers"]

DETECTED = "writing it again from the logs"


def _delete(live: LiveEnv, what: str) -> None:
    run = live.out / "rank_0"
    if what == "run directory":
        shutil.rmtree(run)
    elif what == "whole --out":
        shutil.rmtree(live.out)
    else:
        event_files(run)[-1].unlink()  # the file being written; the older one stays


@pytest.mark.parametrize("wake_mode", ["inotify"])
@pytest.mark.parametrize("what", ["run directory", "event file being written", "whole --out"])
def test_live_output_deleted_mid_run_is_written_again(live: LiveEnv, what: str) -> None:
    logs = [live.info_log(0), live.info_log(1)]
    for log in logs:
        log.step(20)
    port = free_port()
    # It notices at its next checkpoint: one a second, not the default 5 s (4.7 s of waiting per test).
    sidecar = live.sidecar("--metrics-port", str(port), "--checkpoint-interval", "1").start()
    wait_until(lambda: all_written(live.out, logs), 10, "the first steps")
    rc, _ = sidecar.stop()  # a restart: rank_0 now has an older event file that must be kept
    assert rc == 0, sidecar.stderr()
    sidecar.start()
    run = live.out / "rank_0"
    with SteadyWriter(logs, rate=100):
        # the second start's file exists and holds steps beyond the first start's
        wait_until(lambda: len(event_files(run)) == 2 and max(raw_run(run).points)[0] > 40, 10,
                   "the second event file")
        older = event_files(run)[0]
        _delete(live, what)
        deleted = time.monotonic()
        wait_until(lambda: DETECTED in sidecar.stderr(), 10, "the sidecar to notice")
        print(f"{what}: noticed after {time.monotonic() - deleted:.2f} s")
        written = logs[0].next_step
        wait_until(lambda: logs[0].next_step >= written + 50, 10, "the writer to go on after the start-over")
    wait_until(lambda: all_written(live.out, logs), 10, "every step to be written again")
    lines = sum(2 * len(log.history) for log in logs)  # a head and a bar line per step
    # the endpoint follows the engine that started over: it read every line once, from the start
    wait_until(lambda: scrape(port, "mstb_sidecar_lines_read_total") == lines, 5, "the metrics of the new engine")
    live.finish(sidecar, logs)
    if what == "event file being written":
        assert older.exists()  # the points it holds were not written a second time (raw check)
    assert sidecar.stderr().count(DETECTED) == 1, sidecar.stderr()
    assert "ERROR" not in sidecar.stderr()


def _replay(output: Path, out: Path, stderr: Path) -> subprocess.Popen[bytes]:
    with open(stderr, "wb") as err:
        return subprocess.Popen([str(BIN), "replay", str(output), "--out", str(out), "--instance", "test",
                                 "--no-progress"], stdin=subprocess.DEVNULL, stdout=err, stderr=err)


def test_replay_output_deleted_midway_exits_1_and_a_second_replay_restores_everything(tmp_path: Path) -> None:
    output, out = tmp_path / "output", tmp_path / "tb"
    logs = [RankLog(output / "log" / f"rank_{r}" / "info.log", r) for r in range(2)]
    for log in logs:
        log.write(b"".join(log.take() for _ in range(3000)))
    first = _replay(output, out, tmp_path / "first.stderr")
    try:
        wait_until(lambda: event_files(out / "rank_0") or first.poll() is not None, 30, "rank_0's event file",
                   every=0.002)
        first.send_signal(signal.SIGSTOP)  # the replay cannot finish while its output is deleted
        assert first.poll() is None, "the replay finished before its output could be deleted"
        shutil.rmtree(out / "rank_0")
        first.send_signal(signal.SIGCONT)
        rc = first.wait(60)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    text = (tmp_path / "first.stderr").read_text()
    errors = [line for line in text.splitlines() if "ERROR" in line]
    assert rc == 1, text
    assert "Traceback" not in text, text
    assert len(errors) == 1 and "rank_0" in errors[0], text
    second = _replay(output, out, tmp_path / "second.stderr")
    assert second.wait(60) == 0, (tmp_path / "second.stderr").read_text()
    assert_exactly_once(out, logs)
