"""One writer per ``--out`` and instance: a second sidecar is refused at start with one line naming
the first, the first goes on undisturbed, a killed holder leaves no stale lock, and other
instances share the ``--out`` freely."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

from live_helpers import BIN, LiveEnv, RankLog, Sidecar, wait_until

pytest_plugins = ["live_helpers"]

pytestmark = pytest.mark.parametrize("wake_mode", ["inotify"])


def _second(live: LiveEnv, name: str, *extra: str) -> Sidecar:
    """Another sidecar on the same logs and ``--out``, with its own stderr files."""
    logs_dir = live.root / name
    logs_dir.mkdir()
    sidecar = Sidecar([live.output], live.out, live.mode, logs_dir, *extra)
    live.sidecars.append(sidecar)
    return sidecar


def _record(live: LiveEnv) -> str:
    return (live.out / ".mstb-sidecar" / "lock-test").read_text()


def _refusal(pid: int) -> str:
    return f"error: another sidecar (pid {pid} on {socket.gethostname()}, started "


def _one_line_naming(stderr: str, pid: int, out: Path) -> None:
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith(f"mstb-sidecar: {_refusal(pid)}"), stderr
    assert lines[0].endswith(f") already writes {out} as instance test; stop it, or give this one its own --instance")


def test_a_second_watcher_on_the_same_out_and_instance_is_refused(live: LiveEnv) -> None:
    log = live.info_log(0)
    log.step(20)
    first = live.sidecar().start()
    second = _second(live, "second")
    second.start(wait_ready=False)
    assert second.wait_exit(20) == 2
    _one_line_naming(second.stderr(), first.proc.pid, live.out)
    assert first.running()
    log.step(30)  # the first goes on alone: every step once, nothing from the refused one
    live.finish(first, [log])


def test_replay_is_refused_while_a_watcher_holds_the_out(live: LiveEnv) -> None:
    log = live.info_log(0)
    log.step(10)
    first = live.sidecar().start()
    done = subprocess.run([str(BIN), "replay", str(live.output), "--out", str(live.out), "--instance", "test"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(f"mstb-sidecar replay: {_refusal(first.proc.pid)}")
    live.finish(first, [log])


def test_a_killed_holder_leaves_no_stale_lock(live: LiveEnv) -> None:
    log = live.info_log(0)
    log.step(10)
    first = live.sidecar().start()
    wait_until(lambda: live.state_file().exists(), 10, "a first checkpoint")
    first.kill()
    log.step(10)
    second = _second(live, "second").start()  # the kernel dropped the dead holder's lock
    assert f'"pid": {second.proc.pid}' in _record(live)
    live.finish(second, [log])


def test_two_instances_share_one_out(live: LiveEnv) -> None:
    node1 = live.root / "node1" / "output"
    logs = [live.info_log(0), RankLog(node1 / "log" / "rank_1" / "info.log", 1)]
    for log in logs:
        log.step(10)
    first = live.sidecar().start()
    other = _second(live, "other", "--instance", "node1")
    other.watch = [node1]
    other.start()
    for log in logs:
        log.step(10)
    live.finish(first, logs[:1])
    live.finish(other, logs)
    assert sorted(p.name for p in (live.out / ".mstb-sidecar").glob("lock-*")) == ["lock-node1", "lock-test"]


def test_the_lock_file_names_its_holder(live: LiveEnv) -> None:
    first = live.sidecar().start()
    record = _record(live)
    assert f'"pid": {first.proc.pid}' in record and str(BIN) in record and socket.gethostname() in record
    assert first.stop()[0] == 0

