"""The ``--metrics-port`` endpoint over plain HTTP: only ``/metrics`` serves metrics, ``/healthz``
and ``/readyz`` answer 200 or 503 with one line, every other path is 404, loopback by default."""

from __future__ import annotations

import platform
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar import __version__
from live_helpers import fetch, fetch_until, free_port
from sidecar.engine import Engine, Settings
from sidecar.following.clock import FakeClock
from sidecar.service import metrics
from sidecar.service.notify import Notifier

DP2 = Path(__file__).parent / "fixtures" / "real" / "mf1.9-dp2" / "output"
BIN = Path(sys.executable).with_name("mstb-sidecar")


def get(port: int, path: str) -> tuple[int, str]:
    return fetch(f"http://127.0.0.1:{port}{path}")


def ok(port: int, path: str) -> tuple[int, str]:
    """The first 200 answer of ``path``, once the endpoint serves one."""
    return fetch_until(f"http://127.0.0.1:{port}{path}", lambda answer: answer[0] == 200, 30, "a 200 answer")


def listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as the kernel lists them) of the TCP sockets listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if int(hex_port, 16) == port and state == "0A":  # LISTEN
                found.add(address)
    return found


def test_the_daemon_serves_metrics_and_probes_on_their_paths_only(tmp_path: Path) -> None:
    shutil.copytree(DP2, tmp_path / "logs")
    port = free_port()
    proc = subprocess.Popen([str(BIN), "--watch", str(tmp_path / "logs"), "--out", str(tmp_path / "out"),
                             "--metrics-port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert ok(port, "/readyz") == (200, "ready: the first scan is done\n")
        assert listening_addresses(port) == {"0100007F"}  # 127.0.0.1, nothing else
        code, text = ok(port, "/healthz")
        assert code == 200 and text.startswith("alive: the main loop ran ")
        code, text = get(port, "/metrics")
        assert code == 200
        job = (tmp_path / "out").resolve()
        assert (f'mstb_sidecar_build_info{{python="{platform.python_version()}",sidecar="{socket.gethostname()}",'
                f'training_job="{job}",version="{__version__}"}} 1.0') in text
        text = fetch_until(f"http://127.0.0.1:{port}/metrics", lambda answer: f'mstb_sidecar_records_written_total{{'
                           f'rank="1",training_job="{job}"}} 200.0' in answer[1], 30, "rank 1's 200 records")[1]
        assert f'mstb_sidecar_records_written_total{{rank="0",training_job="{job}"}} 200.0' in text
        assert f'mstb_sidecar_records_written_total{{rank="1",training_job="{job}"}} 200.0' in text
        for path in ("/", "/nonexistent", "/metrics/x", "/healthz/", "/favicon.ico"):
            code, text = get(port, path)
            assert code == 404 and "mstb_sidecar" not in text, path
            assert text == "not found: the paths are /metrics, /healthz and /readyz\n"
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0, proc.stderr.read() if proc.stderr else ""


def test_probes_follow_the_main_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not ready before the first scan; not alive when the main loop stops telling it ran."""
    monkeypatch.setattr(metrics, "STALE_AFTER", 0.5)
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    clock = FakeClock()
    notifier = Notifier(clock)
    port = free_port()
    _, registry = metrics.registry_for(Engine(Settings(out=tmp_path / "out", roots=[tmp_path])), "job",
                                       metrics.TrainingGauges())
    metrics.serve(registry, "127.0.0.1", port, notifier)
    assert get(port, "/readyz") == (503, "not ready: the first scan is running\n")
    assert get(port, "/healthz") == (200, "starting: the first scan is running\n")
    notifier.ready("following 0 file(s)")
    assert get(port, "/readyz") == (200, "ready: the first scan is done\n")
    assert get(port, "/healthz")[0] == 200
    clock.advance(0.7)  # the loop did not report for longer than the limit
    code, text = get(port, "/healthz")
    assert code == 503 and text.startswith("stalled: the main loop last ran ") and text.endswith(" ago (limit 0.5 s)\n")
    notifier.healthy()
    assert get(port, "/healthz")[0] == 200
