"""The systemd unit verifies cleanly, and the daemon speaks the notify protocol to a test socket."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

UNIT = Path(__file__).parent.parent / "deploy" / "systemd" / "mstb-sidecar@.service"
VERSIONS = Path(__file__).parent / "fixtures" / "versions"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_unit_passes_systemd_analyze_verify_without_warnings(tmp_path: Path) -> None:
    exe = shutil.which("mstb-sidecar") or str(Path(sys.executable).parent / "mstb-sidecar")
    text = UNIT.read_text().replace("/usr/local/bin/mstb-sidecar", exe)
    (tmp_path / UNIT.name).write_text(text)
    proc = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "mstb-sidecar@job1.service")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == "", proc.stderr


def test_unit_has_the_promised_settings() -> None:
    settings = dict(
        line.split("=", 1) for line in UNIT.read_text().splitlines() if "=" in line and not line.startswith("#")
    )
    assert settings["Type"] == "notify" and settings["Restart"] == "on-failure"
    assert settings["Before"] == "train@%i.service" and settings["PartOf"] == "train@%i.service"
    for key, value in {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "PrivateTmp": "yes"}.items():
        assert settings[key] == value
    assert "WatchdogSec" in settings and "ReadWritePaths" in settings


def test_daemon_speaks_the_notify_protocol(tmp_path: Path) -> None:
    sock_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(0.5)
    logs = tmp_path / "logs"
    shutil.copytree(VERSIONS / "v1.9.0-graph" / "output" / "log", logs)
    env = {**os.environ, "NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "400000"}
    proc = subprocess.Popen([sys.executable, "-m", "sidecar.cli", "--watch", str(logs), "--out", str(tmp_path / "out")],
                            env=env, stderr=subprocess.PIPE, text=True)
    messages: list[str] = []
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and sum("WATCHDOG=1" in m for m in messages) < 3:
            try:
                messages.append(sock.recv(4096).decode())
            except TimeoutError:
                continue
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        while True:
            try:
                messages.append(sock.recv(4096).decode())
            except (TimeoutError, BlockingIOError):
                break
    finally:
        if proc.poll() is None:
            proc.kill()
        sock.close()
    ready = [m for m in messages if "READY=1" in m]
    assert len(ready) == 1 and "STATUS=following" in ready[0]
    assert messages.index(ready[0]) < next(i for i, m in enumerate(messages) if "WATCHDOG=1" in m)
    assert sum("WATCHDOG=1" in m for m in messages) >= 3
    assert any("last step 16" in m for m in messages if m.startswith("STATUS="))
    assert "STOPPING=1" in messages[-1] or any("STOPPING=1" in m for m in messages[-3:])
