"""The systemd unit verifies cleanly, its command works as systemd would run it, and the daemon
speaks the notify protocol to a test socket.

systemd is not running here, so the unit's ``ExecStart=`` is expanded by this module the way
systemd documents it (systemd.service, "Command lines"; systemd.exec, ``EnvironmentFile=``):
specifiers, ``${VAR}`` as exactly one word, ``$VAR`` as a word of its own split at whitespace.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from live_helpers import BIN, wait_until
from tb_read import scalars

UNIT = Path(__file__).parent.parent / "deploy" / "systemd" / "mstb-sidecar@.service"
AGGREGATE_UNIT = UNIT.with_name("mstb-sidecar-aggregate@.service")
ENV_EXAMPLE = UNIT.with_name("mstb-sidecar.env.example")
VERSIONS = Path(__file__).parent / "fixtures" / "versions"


def environment_file(text: str) -> dict[str, str]:
    """``EnvironmentFile=``: ``KEY=VALUE`` lines, ``#``/``;`` comments, outer whitespace and one
    pair of quotes removed from the value."""
    env = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        key, _, value = line.partition("=")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key.strip()] = value
    return env


def exec_command(line: str, env: dict[str, str], instance: str) -> list[str]:
    """An ``ExecStart=`` value as systemd runs it: ``%i``/``%H``/``%%``, then per word: ``$VAR``
    alone becomes the value split at whitespace (zero or more words), ``${VAR}`` the value as is."""
    specifiers = {"i": instance, "H": socket.gethostname(), "%": "%"}
    line = re.sub(r"%(.)", lambda m: specifiers[m.group(1)], line)
    argv: list[str] = []
    for word in shlex.split(line):
        alone = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
        if alone:
            argv += env.get(alone.group(1), "").split()
            continue
        assert re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*\}", "", word).count("$") == 0, f"unexpanded: {word}"
        argv.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: env.get(m.group(1), ""), word))
    return argv


def unit_settings(unit: Path = UNIT) -> dict[str, str]:
    return dict(line.split("=", 1) for line in unit.read_text().splitlines() if "=" in line and not line.startswith("#"))


def notifications(sock: socket.socket, until: float, pings: int = 0) -> list[tuple[float, str]]:
    """(arrival, message) until the deadline, or until ``pings`` watchdog pings came."""
    out = []
    while time.monotonic() < until and (not pings or sum("WATCHDOG=1" in m for _, m in out) < pings):
        try:
            out.append((time.monotonic(), sock.recv(4096).decode()))
        except TimeoutError:
            continue
    return out


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
@pytest.mark.parametrize("unit", [UNIT, AGGREGATE_UNIT], ids=["node", "aggregate"])
def test_unit_passes_systemd_analyze_verify_without_warnings(tmp_path: Path, unit: Path) -> None:
    exe = shutil.which("mstb-sidecar") or str(Path(sys.executable).parent / "mstb-sidecar")
    text = unit.read_text().replace("/usr/local/bin/mstb-sidecar", exe)
    (tmp_path / unit.name).write_text(text)
    proc = subprocess.run(["systemd-analyze", "verify", str(tmp_path / unit.name.replace("@", "@job1"))],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == "", proc.stderr


def test_unit_has_the_promised_settings() -> None:
    settings = unit_settings()
    assert settings["Type"] == "notify" and settings["Restart"] == "on-failure"
    assert settings["Before"] == "train@%i.service" and settings["PartOf"] == "train@%i.service"
    for key, value in {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "PrivateTmp": "yes"}.items():
        assert settings[key] == value
    assert "WatchdogSec" in settings and "ReadWritePaths" in settings


def test_aggregate_unit_matches_the_node_unit() -> None:
    """Same ordering, restart and hardening as the node unit; it needs no network at all."""
    node, settings = unit_settings(), unit_settings(AGGREGATE_UNIT)
    shared = ["Type", "NotifyAccess", "EnvironmentFile", "WatchdogSec", "Restart", "KillSignal", "PartOf", "User",
              "NoNewPrivileges", "ProtectSystem", "ReadWritePaths", "PrivateTmp", "CapabilityBoundingSet",
              "SystemCallFilter"]
    assert {key: settings[key] for key in shared} == {key: node[key] for key in shared}
    assert settings["Before"].split() == ["train@%i.service", "mstb-sidecar@%i.service"]  # so it stops after them
    assert settings["PrivateNetwork"] == "yes" and settings["RestrictAddressFamilies"] == "AF_UNIX"


def test_aggregate_unit_command_with_the_example_env_speaks_the_notify_protocol(tmp_path: Path) -> None:
    """The aggregate unit's ExecStart with the example environment file: READY=1 at once (no rank run
    yet), watchdog pings, the job aggregate of a replayed two-rank run, and exit 0 on SIGTERM."""
    root = tmp_path / "tb root"
    env = environment_file(ENV_EXAMPLE.read_text().replace("/srv/tensorboard", str(root)))
    env["MSTB_AGGREGATE_ARGS"] = "--poll-interval 0.1 --status-interval 0"
    argv = exec_command(unit_settings(AGGREGATE_UNIT)["ExecStart"], env, "JOB")
    assert argv[:4] == ["/usr/local/bin/mstb-sidecar", "aggregate", "--out", str(root / "JOB")]
    sock_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(0.2)
    environ = {**os.environ, "NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "1000000"}
    proc = subprocess.Popen([str(BIN), *argv[1:]], env=environ, stderr=subprocess.PIPE, text=True)
    try:
        received = [m for _, m in notifications(sock, time.monotonic() + 20, pings=2)]
        assert any("READY=1" in m and "STATUS=following 0 rank run(s)" in m for m in received), received
        subprocess.run([str(BIN), "replay", str(VERSIONS / "v1.9.0-graph" / "output" / "log"), "--out",
                        str(root / "JOB"), "-q"], check=True, timeout=60)
        run = root / "JOB" / "aggregate" / "job"
        wait_until(lambda: run.exists() and len(scalars(run).get("loss/mean", {})) == 16, 20, "the job aggregate")
        ranks = [scalars(root / "JOB" / f"rank_{rank}")["loss"] for rank in (0, 1)]
        want = {step: (ranks[0][step] + ranks[1][step]) / 2 for step in ranks[0]}  # what the rank runs show
        assert scalars(run)["loss/mean"] == pytest.approx(want, rel=1e-7, nan_ok=True)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        received = [m for _, m in notifications(sock, time.monotonic() + 0.5)]
        assert any("STOPPING=1" in m for m in received)
    finally:
        if proc.poll() is None:
            proc.kill()
        sock.close()


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


def test_expansion_follows_systemd_rules() -> None:
    env = environment_file("A=/x /y\n# c\n; c\nB=\"/t b\"\nC=\n")
    assert env == {"A": "/x /y", "B": "/t b", "C": ""}
    assert exec_command("/bin/p --w $A --o ${B} --i %i-%H $C", env, "job") == \
        ["/bin/p", "--w", "/x", "/y", "--o", "/t b", "--i", f"job-{socket.gethostname()}"]


def test_unit_command_with_the_example_env_starts_before_the_job_and_follows_it(tmp_path: Path) -> None:
    """The unit's ExecStart with the example environment file (its paths moved under tmp_path, the
    output root given a space) starts while the job's directories do not exist yet: READY=1 at
    once with a waiting status, watchdog pings at half of WatchdogSec; then the job writes its
    output and msrun directories, and every step of both ranks reaches the runs."""
    jobs, root = tmp_path / "jobs" / "JOB", tmp_path / "tb root"
    text = ENV_EXAMPLE.read_text().replace("/srv/jobs/JOB", str(jobs)).replace("/srv/tensorboard", str(root))
    env = environment_file(text)
    env["MSTB_ARGS"] = "--rescan-interval 0.2 --status-interval 0"  # several options in one variable
    argv = exec_command(unit_settings()["ExecStart"], env, "JOB")
    assert argv[0] == "/usr/local/bin/mstb-sidecar"  # where the README installs the command
    watch = argv[argv.index("--watch") + 1:argv.index("--out")]
    assert watch == [str(jobs / "output"), str(jobs / "msrun_log")]  # $MSTB_WATCH split into two paths
    assert argv[argv.index("--out") + 1] == str(root / "JOB")  # ${MSTB_OUT} stays one word
    assert argv[-4:] == ["--rescan-interval", "0.2", "--status-interval", "0"]
    root.mkdir()  # the unit's ReadWritePaths=; the job's directories do not exist yet
    sock_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(0.2)
    environ = {**os.environ, "NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "2000000"}  # WatchdogSec=2s
    proc = subprocess.Popen([str(BIN), *argv[1:]], env=environ, stderr=subprocess.PIPE, text=True)
    try:
        received = notifications(sock, time.monotonic() + 20, pings=4)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        ready = [m for _, m in received if "READY=1" in m]
        assert len(ready) == 1 and f"STATUS=waiting for {jobs / 'output'}, {jobs / 'msrun_log'} to appear" in ready[0]
        pings = [at for at, m in received if "WATCHDOG=1" in m]
        assert len(pings) == 4 and max(b - a for a, b in zip(pings, pings[1:])) < 1.8  # every 1 s, not every 10 s
        shutil.copytree(VERSIONS / "v1.9.0-graph" / "output" / "log", jobs / "output" / "log")
        shutil.copytree(VERSIONS / "v1.9.0-graph" / "output" / "msrun_log", jobs / "msrun_log")
        expected = json.loads((VERSIONS / "v1.9.0-graph" / "expected.json").read_text())["ranks"]
        for rank in ("0", "1"):
            want = {step: math.nan if v == "nan" else v for step, v in expected[rank]["loss"]}
            run = root / "JOB" / f"rank_{rank}"
            wait_until(lambda: run.exists() and len(scalars(run).get("loss", {})) == len(want), 30, f"rank {rank}")
            assert scalars(run)["loss"] == pytest.approx(want, rel=1e-6, nan_ok=True)
        messages = [m for _, m in notifications(sock, time.monotonic() + 1.5)]
        assert any(m.startswith("STATUS=following 4 file(s), 2 rank(s), last step 16 (rank 0-1)") for m in messages)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        stderr = proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
        sock.close()
    assert stderr.count("waiting for") == 1 and f"{jobs / 'output'} appeared" in stderr, stderr
