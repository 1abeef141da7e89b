"""What an operator sees: waiting for a job that has not started, skipped files and directories
reported (warning, summary, status, metric), the log's format, the status line, ``-v``
decisions, and the ``check`` dry run. Read back through stderr, exit codes, the metrics
endpoint and TensorBoard's loader."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime
from pathlib import Path

import pytest

from live_helpers import BIN, MODES, Sidecar, wait_until
from tb_read import scalars

GRAPH = Path(__file__).parent / "fixtures" / "versions" / "v1.9.0-graph" / "output"
EXE = [sys.executable, "-m", "sidecar.cli"]
STAMPED = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} mstb-sidecar: (INFO|WARNING|DEBUG|ERROR): ")
# root reads everything: drop to nobody so that mode bits count
AS_USER = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []
needs_user = pytest.mark.skipif(os.geteuid() == 0 and shutil.which("setpriv") is None, reason="needs setpriv as root")


def loss_steps(run: Path) -> int:
    return len(scalars(run).get("loss", {})) if run.exists() else 0


def job_tree(tmp_path: Path) -> Path:
    """A copy of the 2-rank fixture that user nobody can read (and an --out it can write)."""
    job = tmp_path / "job"
    shutil.copytree(GRAPH, job)
    for parent in tmp_path.parents:  # pytest's base directories are owner-only: let nobody pass
        parent.chmod(parent.stat().st_mode | 0o001)
        if parent.name.startswith("pytest-of-") or parent == Path(tempfile.gettempdir()):
            break  # the top of them (a pytest-xdist worker's sits one level deeper)
    for path in [tmp_path, *job.rglob("*"), job]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    (tmp_path / "out").mkdir(mode=0o777)
    (tmp_path / "out").chmod(0o777)
    return job


@pytest.mark.parametrize("mode", MODES)
def test_watch_path_that_does_not_exist_yet_is_waited_for(tmp_path: Path, mode: str) -> None:
    job = tmp_path / "job" / "output"
    sidecar = Sidecar([job], tmp_path / "out", mode, tmp_path, "--wait-grace", "3")
    try:
        sidecar.start()
        wait_until(lambda: "still does not exist" in sidecar.stderr(), 15, "the grace warning")
        # when the grace runs out, not at the loop's next reconcile (10 s with file events)
        assert re.search(r"still does not exist after [34] s", sidecar.stderr()), sidecar.stderr()
        assert sidecar.running()
        shutil.copytree(GRAPH, job)
        for rank in (0, 1):
            wait_until(lambda: loss_steps(tmp_path / "out" / f"rank_{rank}") == 16, 30, f"rank {rank}'s steps")
        rc, _ = sidecar.stop()
    finally:
        sidecar.cleanup()
    err = sidecar.stderr()
    assert rc == 0, err
    assert err.count(f"waiting for {job} to appear") == 1 and err.count("still does not exist") == 1
    assert f"{job} appeared; following it" in err


@needs_user
def test_replay_reports_unreadable_files_and_directories(tmp_path: Path) -> None:
    job = job_tree(tmp_path)
    shutil.copytree(job / "log" / "rank_1", job / "log" / "rank_2")
    (job / "log" / "rank_1" / "info.log").chmod(0o600)
    (job / "log" / "rank_2").chmod(0o700)
    proc = subprocess.run([*AS_USER, *EXE, "replay", str(job / "log"), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(Path.cwd())})
    assert proc.returncode == 0, proc.stderr
    assert f"cannot read {job / 'log' / 'rank_1' / 'info.log'}: Permission denied; its records are missing" in proc.stderr
    assert f"cannot read {job / 'log' / 'rank_2'}: Permission denied; the logs below it are missing" in proc.stderr
    assert "not written, by reason: 2 unreadable" in proc.stdout
    assert loss_steps(tmp_path / "out" / "rank_0") == 16 and not (tmp_path / "out" / "rank_2").exists()


@needs_user
def test_replay_of_an_unreadable_file_named_directly_says_permission_denied(tmp_path: Path) -> None:
    job = job_tree(tmp_path)
    log = job / "log" / "rank_1" / "info.log"
    log.chmod(0o600)
    proc = subprocess.run([*AS_USER, *EXE, "replay", str(log), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(Path.cwd())})
    assert proc.returncode == 2
    assert proc.stderr == (f"mstb-sidecar replay: error: cannot read {log}: permission denied; "
                           "run as a user that can read the training logs\n")


def test_replay_of_a_file_with_no_step_record_says_so(tmp_path: Path) -> None:
    log = tmp_path / "log" / "rank_0" / "info.log"
    log.parent.mkdir(parents=True)
    log.write_bytes(b"".join(b"line %d of something else\n" % i for i in range(40)))
    proc = subprocess.run([*EXE, "replay", str(tmp_path / "log"), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "nothing new since the last run" not in proc.stdout
    line = proc.stderr.strip()
    assert STAMPED.match(line), line  # timestamped text by default
    assert f"no mindformers step record was recognised in the 40 line(s) read from {log}" in line


def test_replay_and_check_of_a_binary_file_name_it(tmp_path: Path) -> None:
    """Binary data under a log's name: one warning naming it (nothing of it is parsed as lines);
    ``check`` says the same."""
    log = tmp_path / "log" / "rank_0" / "info.log"
    log.parent.mkdir(parents=True)
    log.write_bytes(bytes(range(256)) * 40)
    proc = subprocess.run([*EXE, "replay", str(tmp_path / "log"), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    line = proc.stderr.strip()
    assert STAMPED.match(line) and line.endswith(f"WARNING: {log} holds binary data, not a text log; it is not read "
                                                 "('mstb-sidecar check PATH' shows what each file was taken for)"), line
    check = subprocess.run([*EXE, "check", str(tmp_path / "log")], capture_output=True, text=True, timeout=120)
    assert re.search(rf"\n  0 +- +{log} +not recognised: binary data, not a text log\n", check.stdout), check.stdout


@pytest.mark.parametrize("lines", [False, True], ids=["no-newline", "newlines"])
def test_live_binary_file_is_named_once_and_leaves_no_lag(tmp_path: Path, lines: bool) -> None:
    """A binary info.log beside a real one, live: one warning naming it, an unreadable file in
    the status and the metrics, and a lag of 0 (its bytes are not a line that may yet end), also
    after more binary data is appended."""
    logs = tmp_path / "log"
    shutil.copytree(GRAPH / "log", logs)
    junk = bytes(range(256)) if lines else bytes(b for b in range(256) if b != 10)
    binary = logs / "rank_1" / "info.log"
    binary.write_bytes(junk * 8)
    port = _free_port()
    sidecar = Sidecar([logs], tmp_path / "out", "inotify", tmp_path, "--status-interval", "0.3",
                      "--metrics-port", str(port))
    try:
        sidecar.start()
        wait_until(lambda: loss_steps(tmp_path / "out" / "rank_0") == 16, 30, "rank 0")
        with open(binary, "ab") as fh:
            fh.write(junk * 2)
        status = ("following 2 file(s), 1 rank(s), last step 16 (rank 0), training finished (rank 0), lag 0 bytes, "
                  "not written: 1 unreadable")
        wait_until(lambda: sidecar.stderr().count(status) >= 2, 10, "two status lines after the append")
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert re.search(r'^mstb_sidecar_records_not_written_total\{rank="1",reason="unreadable",training_job="[^"]+"\} 1\.0$',
                         metrics, re.M), metrics
        assert sidecar.stop()[0] == 0
    finally:
        sidecar.cleanup()
    err = sidecar.stderr()
    assert err.count(f"WARNING: {binary} holds binary data, not a text log; it is not read") == 1, err
    assert "lag 0 bytes" in err.splitlines()[-1], err


def test_journald_gets_no_timestamps_and_json_is_one_object_per_line(tmp_path: Path) -> None:
    log = tmp_path / "rank_0" / "info.log"
    log.parent.mkdir()
    log.write_text("not a mindformers line\n")
    err = tmp_path / "stderr"
    with open(err, "w") as fh:
        st = os.fstat(fh.fileno())
        env = {**os.environ, "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        subprocess.run([*EXE, "replay", str(log), "--out", str(tmp_path / "a")], stderr=fh, env=env, timeout=120)
    assert err.read_text().startswith("mstb-sidecar: WARNING: no mindformers step record was recognised")
    proc = subprocess.run([*EXE, "replay", str(log), "--out", str(tmp_path / "b"), "--log-format", "json"],
                          capture_output=True, text=True, timeout=120)
    entries = [json.loads(line) for line in proc.stderr.splitlines()]
    assert len(entries) == 1 and entries[0]["level"] == "warning" and entries[0]["logger"] == "sidecar.service.replay"
    assert entries[0]["message"].startswith("no mindformers step record was recognised in the 1 line(s)")
    stamp = entries[0]["time"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d", stamp)  # with its zone
    assert abs(datetime.fromisoformat(stamp).timestamp() - time.time()) < 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_user
def test_live_unreadable_directory_is_reported_in_log_status_and_metrics_then_read(tmp_path: Path) -> None:
    job = job_tree(tmp_path)
    (job / "log" / "rank_1").chmod(0o700)
    port = _free_port()
    cmd = [*AS_USER, str(BIN), "--watch", str(job / "log"), "--out", str(tmp_path / "out"), "--poll",
           "--status-interval", "0", "--metrics-port", str(port), "--job", "llama"]
    err = tmp_path / "stderr"
    with open(err, "w") as fh:
        proc = subprocess.Popen(cmd, stderr=fh)
    try:
        wait_until(lambda: loss_steps(tmp_path / "out" / "rank_0") == 16, 30, "rank 0")
        proc.send_signal(signal.SIGUSR1)
        wait_until(lambda: "status:" in err.read_text(), 10, "the status line")
        status = next(line for line in err.read_text().splitlines() if "status:" in line)
        assert status.endswith("status: following 1 file(s), 1 rank(s), last step 16 (rank 0), training finished "
                               "(rank 0), lag 0 bytes, not written: 1 unreadable"), status
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'mstb_sidecar_records_not_written_total{rank="1",reason="unreadable",training_job="llama"} 1.0' in metrics
        (job / "log" / "rank_1").chmod(0o755)  # fixed: it is read without a restart
        wait_until(lambda: loss_steps(tmp_path / "out" / "rank_1") == 16, 30, "rank 1 once readable")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    text = err.read_text()
    assert text.count(f"cannot read {job / 'log' / 'rank_1'}: Permission denied") == 1, text
    assert f"{job / 'log' / 'rank_1'} is readable again" in text


def test_periodic_status_and_verbose_decisions(tmp_path: Path) -> None:
    logs = tmp_path / "log"
    shutil.copytree(GRAPH / "log", logs)
    sidecar = Sidecar([logs], tmp_path / "out", "inotify", tmp_path, "-v", "--status-interval", "0.5")
    try:
        sidecar.start()
        wait_until(lambda: loss_steps(tmp_path / "out" / "rank_1") == 16, 30, "rank 1")
        os.rename(logs / "rank_0" / "info.log", logs / "rank_0" / "info.log.1")
        wait_until(lambda: "(rotated)" in sidecar.stderr(), 20, "the rotation")
        wait_until(lambda: sidecar.stderr().count("status: following") >= 2, 10, "two status lines")
        rc, _ = sidecar.stop()
        size = (logs / "rank_1" / "info.log").stat().st_size
        sidecar.start()  # the restart resumes each file where the checkpoint says
        wait_until(lambda: "resuming at byte" in sidecar.stderr(), 10, "the resume")
        assert sidecar.stop()[0] == 0
        assert f"following {logs / 'rank_1' / 'info.log'} as rank 1, resuming at byte {size} (checkpoint)" in sidecar.stderr()
    finally:
        sidecar.cleanup()
    err = sidecar.stderr(all_runs=True)
    assert rc == 0
    lines = err.splitlines()
    assert all(STAMPED.match(line) for line in lines), err
    for rank in (0, 1):
        assert f"DEBUG: following {logs / f'rank_{rank}' / 'info.log'} as rank {rank}, from the start" in err
        assert f"DEBUG: rank {rank} found: writing {tmp_path / 'out' / f'rank_{rank}'}" in err
    assert f"DEBUG: {logs / 'rank_0' / 'info.log'} is now {logs / 'rank_0' / 'info.log.1'} (rotated)" in err
    assert "status: following 2 file(s), 2 rank(s), last step 16 (rank 0-1), training finished (rank 0-1), lag 0 bytes" in err
    assert not [line for line in lines if "DEBUG" in line and "watchdog" in line.lower() or "Event" in line]


@needs_user
def test_check_lists_ranks_formats_and_problems_and_writes_nothing(tmp_path: Path) -> None:
    job = job_tree(tmp_path)
    (job / "log" / "rank_1" / "info.log").chmod(0o600)
    shutil.copytree(job / "log" / "rank_0", job / "log" / "rank_3")
    (job / "log" / "rank_3").chmod(0o700)
    (job / "log" / "rank_4").mkdir(mode=0o755)
    (job / "log" / "rank_4" / "info.log").write_text("hello\n")
    (job / "log" / "rank_4" / "info.log").chmod(0o644)
    before = sorted(tmp_path.rglob("*"))
    proc = subprocess.run([*AS_USER, *EXE, "check", str(job)], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path / "out", env={**os.environ, "PYTHONPATH": str(Path.cwd())})
    assert proc.returncode == 4, proc.stderr
    out = proc.stdout
    assert out.startswith(f"would follow 3 of 5 log file(s) under {job}\n")
    assert re.search(rf"\n  0 +1 +{job}/log/rank_0/info.log +r0\.7\+ graph trainer\n", out), out
    assert re.search(rf"\n  1 +1 +{job}/msrun_log/worker_1.log +r0\.7\+ graph trainer\n", out), out
    assert re.search(rf"\n  1 +- +{job}/log/rank_1/info.log +unreadable: permission denied\n", out), out
    assert re.search(rf"\n  4 +- +{job}/log/rank_4/info.log +not recognised: no mindformers step record in it", out), out
    assert f"unreadable directory {job}/log/rank_3: permission denied" in out
    assert out.endswith("nothing was written\n")
    assert sorted(tmp_path.rglob("*")) == before
    ok = subprocess.run([*EXE, "check", str(GRAPH)], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and ok.stdout.startswith("would follow 4 of 4 log file(s)")
