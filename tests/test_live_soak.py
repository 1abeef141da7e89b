"""The issue's "done when": steady writers, rename rotation, SIGKILL + restart, SIGTERM.

Three ranks write 25 steps a second each; rank 0 is rotated by rename every 1.5 s (with one
more line into the renamed file before the writer reopens); the sidecar is SIGKILLed at random
every 1-2.5 s and restarted at once; the last one runs through one more rotation. At the end
every step of every rank is in the output exactly once (TensorBoard's view and the raw records),
the append-to-disk p99 is under 1 s for steps written while a sidecar was running (and not about
to be killed), and SIGTERM exits 0 quickly. ``MSTB_SOAK_SECONDS`` sets the duration (default 8);
both wake-up modes run.
"""

from __future__ import annotations

import os
import random
import time

from live_helpers import DiskWatcher, LiveEnv, SteadyWriter, assert_exactly_once, percentile, wait_until

pytest_plugins = ["live_helpers"]

SECONDS = float(os.environ.get("MSTB_SOAK_SECONDS", "8"))


def test_soak_rotation_sigkill_restart_sigterm(live: LiveEnv) -> None:
    rng = random.Random(99)
    logs = [live.info_log(r) for r in range(3)]
    sidecar = live.sidecar()
    windows: list[tuple[float, float]] = []  # (ready, killed - 1 s): latency is measured in these
    with DiskWatcher(live.out, range(3)) as watcher:
        with SteadyWriter(logs, rate=25, rotate_every=1.5) as writer:
            end = time.monotonic() + SECONDS
            kills = 0
            while time.monotonic() < end:
                sidecar.start()
                ready = time.monotonic()
                time.sleep(rng.uniform(1.0, 2.5))
                sidecar.kill()
                kills += 1
                windows.append((ready, time.monotonic() - 1.0))
            sidecar.start()
            ready, rotated = time.monotonic(), writer.rotations
            wait_until(lambda: writer.rotations > rotated, 10, "a rotation while the last sidecar runs")
        windows.append((ready, time.monotonic()))
        watcher.wait_all(logs, 15)
        lat = sorted(x for since, until in windows for x in watcher.latencies(logs, since, until))
    rc, took = sidecar.stop()
    assert rc == 0, sidecar.stderr()
    assert "Traceback" not in sidecar.stderr(all_runs=True)
    assert_exactly_once(live.out, logs)
    p50, p99 = percentile(lat, 0.5), percentile(lat, 0.99)
    steps = sum(len(log.history) for log in logs)
    print(f"\nsoak ({live.mode}, {SECONDS:.0f} s): {steps} steps, {writer.rotations} rotations, {kills} SIGKILLs; "
          f"latency n={len(lat)} p50={p50 * 1000:.0f} ms p99={p99 * 1000:.0f} ms max={lat[-1] * 1000:.0f} ms; "
          f"SIGTERM exit {took:.2f} s")
    assert writer.rotations >= 2 and kills >= 2
    assert p99 < 1.0
    assert took < 5.0
