"""Object storage as the logdir (issue 28, item 2): ``--out s3://BUCKET/PREFIX``.

The store is moto's standalone S3 server (``moto_server``, the test extra), started on 127.0.0.1 on
a free port once for the module and reset (moto's ``/moto-api/reset``: no bucket or object is
left) before each test. Results are read back in a fresh process with TensorBoard's own S3 loader
(``tests/s3_read.py``: ``EventMultiplexer`` on ``s3://`` with ``S3_ENDPOINT`` set, as
``tensorboard --logdir s3://...`` reads), and compared with what a local
``--out`` shows or with the values the logs were written with, step by step.

Faults go through :class:`Proxy`, a small HTTP forwarder in front of the server (moto has no fault
injection, and keeps its objects in memory, so stopping the server itself would lose the bucket):
its listener is closed and opened again (the endpoint unreachable, then back), it answers
``503 SlowDown`` or ``500``, or it answers slowly.
"""

from __future__ import annotations

import http.client
import json
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import boto3
import pytest

from live_helpers import BIN, RankLog, Sidecar, all_written, free_port, scrape, wait_until
from outputs import read_out
from sidecar.output.state import instance_name
from sidecar.output.upload import OBJECT_BYTES

MOTO = Path(sys.executable).with_name("moto_server")
READER = Path(__file__).with_name("s3_read.py")
FIXTURE = Path(__file__).parent / "fixtures" / "real" / "mf1.9-dp2" / "output"
RANKS = (0, 1)


class Moto:
    """``moto_server`` on 127.0.0.1 (``auth``: moto checks access keys, none of which exist)."""

    def __init__(self, root: Path, auth: bool = False) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        env = {"INITIAL_NO_AUTH_ACTION_COUNT": "0"} if auth else {}
        self._log = open(root / f"moto-{self.port}.log", "wb")
        self.proc = subprocess.Popen([str(MOTO), "-H", "127.0.0.1", "-p", str(self.port)], stdout=self._log,
                                     stderr=subprocess.STDOUT, env={**_environ(), **env})
        wait_until(self._answers, 30, "moto_server to answer")

    def _answers(self) -> bool:
        assert self.proc.poll() is None, "moto_server exited"
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True
        except OSError:
            return False

    def client(self):  # noqa: ANN201 (boto3's generated type)
        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def keys(self, bucket: str, prefix: str) -> dict[str, int]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return {o["Key"]: o["Size"] for page in pages for o in page.get("Contents", [])}

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self._log.close()


def _environ() -> dict[str, str]:
    import os

    return dict(os.environ)


FAULTS = {"503": (503, "SlowDown"), "500": (500, "InternalError"), "expired": (400, "ExpiredToken")}


class Proxy:
    """An HTTP forwarder to ``port`` that a test can stop and start again (same port), make answer
    ``mode`` (:data:`FAULTS`) instead of forwarding, or delay by ``delay`` seconds."""

    def __init__(self, port: int) -> None:
        self.target, self.port = port, free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.mode, self.delay = "pass", 0.0
        self.held = 0  # requests delayed so far
        self.answered: Counter[str] = Counter()
        self._open: set[socket.socket] = set()
        self._server: ThreadingHTTPServer | None = None
        self.start()

    def start(self) -> None:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                proxy._open.add(self.connection)

            def finish(self) -> None:
                proxy._open.discard(self.connection)
                super().finish()

            def forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if proxy.delay:
                    proxy.held += 1
                    time.sleep(proxy.delay)
                if proxy.mode != "pass":
                    proxy.answered[proxy.mode] += 1
                    status, code = FAULTS[proxy.mode]
                    data = f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("expect", "connection")}
                conn = http.client.HTTPConnection("127.0.0.1", proxy.target, timeout=30)
                conn.request(self.command, self.path, body, headers)
                answer = conn.getresponse()
                data = answer.read()
                proxy.answered["forwarded"] += 1
                self.send_response(answer.status)
                for key, value in answer.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                        self.send_header(key, value)
                length = answer.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = forward

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        """The endpoint goes away: no listener, and the open connections are cut."""
        assert self._server is not None
        self._server.shutdown()
        self._server.server_close()
        for conn in list(self._open):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Moto]:
    """One moto server for the module (a start costs about a second); each test resets it."""
    server = Moto(tmp_path_factory.mktemp("moto"))
    yield server
    server.stop()


@pytest.fixture
def s3(moto: Moto, monkeypatch: pytest.MonkeyPatch) -> Moto:
    """The moto server emptied (moto's own reset: no bucket, object or lease of an earlier test
    is left) with bucket ``runs``; the environment the sidecars and the reader inherit."""
    server = moto
    with urllib.request.urlopen(urllib.request.Request(f"{server.endpoint}/moto-api/reset", method="POST"),
                                timeout=30) as answer:
        assert answer.status == 200
    assert not server.client().list_buckets()["Buckets"]
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("S3_ENDPOINT", server.endpoint)
    server.client().create_bucket(Bucket="runs")
    return server


def read_bucket(url: str) -> dict[str, dict]:
    """Every run under ``url`` as TensorBoard's S3 loader shows it (a fresh process: see the module doc)."""
    done = subprocess.run([sys.executable, str(READER), url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def points(run: dict, tag: str) -> dict[int, float]:
    """One tag's points, asserting TensorBoard shows no step twice."""
    steps = [step for step, _ in run["scalars"].get(tag, [])]
    repeated = [step for step, n in Counter(steps).items() if n > 1]
    assert not repeated, f"{tag}: steps shown twice: {repeated[:20]}"
    return {step: value for step, value in run["scalars"].get(tag, [])}


def replay(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN), "replay", *args], capture_output=True, text=True, timeout=300)


# -- a replay ------------------------------------------------------------------------------------


def test_replay_to_a_bucket_shows_what_a_local_replay_shows(s3: Moto, tmp_path: Path) -> None:
    local = tmp_path / "local"
    assert replay(str(FIXTURE), "--out", str(local), "-q").returncode == 0
    done = replay(str(FIXTURE), "--out", "s3://runs/exp/", "--state-dir", str(tmp_path / "stage"),
                  "--max-event-file-mb", "0.02")  # several event files per run, read in order
    assert done.returncode == 0, done.stderr
    assert "tensorboard --logdir s3://runs/exp" in done.stdout

    got, want = read_bucket("s3://runs/exp"), read_out(local)
    assert sorted(got) == sorted(want)
    for run, shown in want.items():
        for tag, expected in shown.scalars.items():
            assert points(got[run], tag) == pytest.approx(expected, nan_ok=True), f"{run} {tag}"
        assert got[run]["run_json"] == shown.run_json, run
    truth = json.loads((FIXTURE.parent / "tensorboard_truth.json").read_text())  # mindformers' own TensorBoard
    for run in ("rank_0", "rank_1"):
        assert points(got[run], "loss") == pytest.approx({step: value for step, _, value in truth[run]["loss"]})

    keys = s3.keys("runs", "exp/")
    events = {k: size for k, size in keys.items() if "tfevents" in k}
    assert len({k.rsplit(".", 1)[0] for k in events if k.startswith("exp/rank_0/")}) > 1
    assert all(k.rsplit(".", 1)[1].isdigit() and len(k.rsplit(".", 1)[1]) == 16 for k in events)
    assert max(events.values()) <= OBJECT_BYTES
    assert f"exp/.mstb-sidecar/state-{instance_name(socket.gethostname())}.json" in keys
    assert not [k for k in keys if "lease-" in k or "lock-" in k]  # the lease was given back, locks stay local

    # again, from the config file: nothing new to write, nothing uploaded twice
    config = tmp_path / "sidecar.yaml"
    config.write_text(f"out: s3://runs/exp\nstate-dir: {tmp_path / 'stage'}\nwatch: {FIXTURE}\n")
    again = replay("--config", str(config), "-q")
    assert again.returncode == 0, again.stderr
    assert {k: v for k, v in s3.keys("runs", "exp/").items() if "/.mstb-sidecar/" not in k} == \
        {k: v for k, v in keys.items() if "/.mstb-sidecar/" not in k}
    # and from an empty staging directory (another machine): the bucket is pulled, nothing is written twice
    elsewhere = replay(str(FIXTURE), "--out", "s3://runs/exp", "--state-dir", str(tmp_path / "other"), "-q")
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert {k: v for k, v in s3.keys("runs", "exp/").items() if "tfevents" in k} == events


# -- refused at start ---------------------------------------------------------------------------


def _one_line_exit_2(done: subprocess.CompletedProcess[str], *words: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_bad_bucket_credentials_endpoint_or_no_boto3_is_one_line_and_exit_2(s3: Moto, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    stage = ["--state-dir", str(tmp_path / "stage")]
    _one_line_exit_2(replay(str(FIXTURE), "--out", "s3://nosuchbucket/x", *stage), "no bucket nosuchbucket")
    _one_line_exit_2(replay(str(FIXTURE), "--out", "s3://", *stage), "s3://BUCKET/PREFIX")
    _one_line_exit_2(replay(str(FIXTURE), "--out", str(tmp_path / "o"), *stage), "--state-dir")

    locked = Moto(tmp_path, auth=True)  # no access key exists there
    try:
        monkeypatch.setenv("S3_ENDPOINT", locked.endpoint)
        _one_line_exit_2(replay(str(FIXTURE), "--out", "s3://runs/x", *stage), "credentials", "AWS_ACCESS_KEY_ID")
    finally:
        locked.stop()
    monkeypatch.setenv("S3_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens
    _one_line_exit_2(replay(str(FIXTURE), "--out", "s3://runs/x", *stage), "cannot reach", "S3_ENDPOINT")

    stub = tmp_path / "no-boto3" / "boto3"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('boto3 is not installed')\n")
    monkeypatch.setenv("PYTHONPATH", f"{stub.parent}:{_environ().get('PYTHONPATH', '')}")
    done = subprocess.run([str(BIN), "--watch", str(FIXTURE), "--out", "s3://runs/x", *stage],
                          capture_output=True, text=True, timeout=60)
    _one_line_exit_2(done, "pip install 'mstb-sidecar[s3]'")
    assert not list((tmp_path / "stage").rglob("*tfevents*"))


def test_one_writer_per_prefix_and_instance(s3: Moto, tmp_path: Path) -> None:
    logs = _logs(tmp_path)
    first = _sidecar(tmp_path, "a")
    first.start()
    second = _sidecar(tmp_path, "b")
    second.start(wait_ready=False)
    assert second.wait_exit(60) == 2
    _one_line_exit_2(subprocess.CompletedProcess([], 2, "", second.stderr()), "another sidecar", "s3://runs/live",
                     "--instance")
    logs[0].step(3)
    rc, _ = first.stop()
    assert rc == 0, first.stderr()
    second.start()  # the lease was given back at the clean stop
    assert second.stop()[0] == 0


# -- live, killed, faults ------------------------------------------------------------------------


def _logs(root: Path) -> list[RankLog]:
    return [RankLog(root / "output" / "log" / f"rank_{rank}" / "info.log", rank) for rank in RANKS]


def _sidecar(root: Path, stage: str, *extra: str) -> Sidecar:
    logs_dir = root / f"stderr-{stage}"
    logs_dir.mkdir(exist_ok=True)
    return Sidecar([root / "output"], "s3://runs/live", "inotify", logs_dir,  # type: ignore[arg-type]
                   "--state-dir", str(root / stage), "--upload-interval", "0.2", "--checkpoint-interval", "0.2",
                   *extra)


def _leases_expired(s3: Moto) -> bool:
    """Every lease in the bucket has gone unrenewed past its time (another sidecar may take it)."""
    client = s3.client()
    listed = client.list_objects_v2(Bucket="runs", Prefix="live/").get("Contents", [])
    leases = [item["Key"] for item in listed if "/lease-" in item["Key"]]
    return all(json.loads(client.get_object(Bucket="runs", Key=key)["Body"].read())["expires"] < time.time()
               for key in leases)


def _assert_bucket_shows(logs: list[RankLog]) -> None:
    got = read_bucket("s3://runs/live")
    for log in logs:
        assert points(got[f"rank_{log.rank}"], "loss") == log.expected, f"rank {log.rank}"


def test_sigkill_at_random_moments_and_a_lost_staging_directory_lose_and_double_nothing(
        s3: Moto, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MSTB_SIDECAR_LEASE_TTL", "1")  # a staging directory lost with its sidecar waits this long
    rng = random.Random(28)
    logs = _logs(tmp_path)
    sidecar = _sidecar(tmp_path, "stage")
    wiped = 0
    try:
        for round_ in range(6):
            sidecar.start()
            for _ in range(rng.randint(1, 4)):
                for log in logs:
                    log.step(rng.randint(1, 15))
                time.sleep(rng.uniform(0, 0.5))
            sidecar.kill()
            if round_ in (2, 4):  # the pod is replaced: its staging directory is gone
                shutil.rmtree(tmp_path / "stage")
                wiped += 1
                wait_until(lambda: _leases_expired(s3), 10, "the dead sidecar's lease to run out")
        sidecar.start()
        for log in logs:
            log.step(5)
        wait_until(lambda: all_written(tmp_path / "stage", logs), 30, "every step in the staging directory")
        rc, _ = sidecar.stop()
        assert rc == 0, sidecar.stderr()
    finally:
        sidecar.cleanup()
    assert wiped == 2
    assert "Traceback" not in sidecar.stderr(all_runs=True)
    _assert_bucket_shows(logs)


def _metric(port: int, name: str, **labels: str) -> float:
    return scrape(port, name, **labels) or 0.0


def test_store_down_throttling_errors_and_slowness_are_retried_counted_and_lose_nothing(
        s3: Moto, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proxy = Proxy(s3.port)
    monkeypatch.setenv("S3_ENDPOINT", proxy.endpoint)
    port = free_port()
    logs = _logs(tmp_path)
    sidecar = _sidecar(tmp_path, "stage", "--metrics-port", str(port), "--status-interval", "0.5")
    stage = tmp_path / "stage"

    def uploaded() -> bool:
        return _metric(port, "mstb_sidecar_bucket_pending_bytes") == 0 and \
            _metric(port, "mstb_sidecar_bucket_last_upload_timestamp_seconds") > marked

    try:
        sidecar.start()
        for log in logs:
            log.step(10)
        marked = time.time()
        wait_until(uploaded, 20, "the first steps to be uploaded")
        _assert_bucket_shows(logs)  # while it runs: fresh within the upload interval

        proxy.stop()  # the store goes away
        for log in logs:
            log.step(10)
        wait_until(lambda: all_written(stage, logs), 5, "the runs to go on while the store is down")
        wait_until(lambda: _metric(port, "mstb_sidecar_bucket_failed_requests_total", reason="unreachable") > 0
                   and _metric(port, "mstb_sidecar_bucket_pending_bytes") > 0, 20, "the failures to be counted")
        wait_until(lambda: "failed request(s)" in sidecar.stderr() and "unreachable" in sidecar.stderr(), 10,
                   "the status line to show them")
        proxy.start()  # and comes back
        marked = time.time()
        wait_until(uploaded, 60, "the upload after the store came back")

        proxy.mode = "503"  # throttled, then server errors
        for log in logs:
            log.step(5)
        wait_until(lambda: _metric(port, "mstb_sidecar_bucket_failed_requests_total", reason="throttled") > 0, 20,
                   "SlowDown to be counted")
        proxy.mode = "500"
        wait_until(lambda: _metric(port, "mstb_sidecar_bucket_failed_requests_total", reason="server-error") > 0,
                   40, "500 to be counted")
        proxy.mode = "expired"  # the session token ran out: the credentials are read again at each try
        wait_until(lambda: _metric(port, "mstb_sidecar_bucket_failed_requests_total", reason="credentials") > 0,
                   40, "expired credentials to be counted")
        proxy.mode = "pass"
        marked = time.time()
        wait_until(uploaded, 60, "the upload after the errors")

        proxy.delay = 3.0  # a slow store: the runs are written at the usual pace meanwhile
        for log in logs:
            log.step(5)
        wait_until(lambda: proxy.held > 0, 10, "an upload held by the slow store")
        for log in logs:
            log.step(5)
        wait_until(lambda: all_written(stage, logs), 2.5, "the runs to go on while an upload is held")
        proxy.delay = 0.0
        marked = time.time()
        wait_until(uploaded, 60, "the upload after the slow spell")
        _assert_bucket_shows(logs)
        rc, _ = sidecar.stop(timeout=60)
        assert rc == 0, sidecar.stderr()
    finally:
        sidecar.cleanup()
        proxy.mode, proxy.delay = "pass", 0.0
    assert proxy.answered["503"] and proxy.answered["500"] and proxy.answered["expired"]
    assert "Traceback" not in sidecar.stderr(all_runs=True)
    _assert_bucket_shows(logs)


# -- the job aggregate from the bucket -----------------------------------------------------------


def test_aggregate_builds_the_job_view_from_the_runs_in_the_bucket(s3: Moto, tmp_path: Path) -> None:
    nodes = {"node0": (0, 1, 2), "node1": (3, 4, 5)}
    for node, ranks in nodes.items():
        for rank in ranks:
            log = RankLog(tmp_path / node / "output" / "log" / f"rank_{rank}" / "info.log", rank)
            log.step(12)
        for out in (["--out", str(tmp_path / "local")], ["--out", "s3://runs/job", "--state-dir", str(tmp_path / node)]):
            done = replay(str(tmp_path / node / "output"), *out, "--instance", node, "-q")
            assert done.returncode == 0, done.stderr
    local = subprocess.run([str(BIN), "aggregate", "--once", "--out", str(tmp_path / "local")],
                           capture_output=True, text=True, timeout=120)
    assert local.returncode == 0, local.stderr
    done = subprocess.run([str(BIN), "aggregate", "--once", "--out", "s3://runs/job", "--state-dir",
                           str(tmp_path / "job")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr

    got = read_bucket("s3://runs/job")
    want = read_out(tmp_path / "local")["aggregate/job"].scalars
    mean = points(got["aggregate/job"], "loss/mean")
    assert mean == pytest.approx(want["loss/mean"])
    assert mean[12] == pytest.approx(sum(rank * 100000 + 12 for rank in range(6)) / 6)
    assert sorted(run for run in got if run.startswith("rank_")) == [f"rank_{r}" for r in range(6)]


class _Aggregate(Sidecar):
    """``mstb-sidecar aggregate --out OUT`` as a subprocess."""

    @property
    def cmd(self) -> list[str]:
        return [str(BIN), "aggregate", "--out", str(self.out), *self.extra]


def test_a_live_aggregate_follows_what_the_nodes_upload(s3: Moto, tmp_path: Path) -> None:
    """``aggregate --out s3://`` keeps fetching the prefix: steps the nodes upload after it started
    reach its mean, and its own run reaches the bucket."""
    nodes = {"node0": (0, 1), "node1": (2, 3)}
    logs = {node: [RankLog(tmp_path / node / "output" / "log" / f"rank_{r}" / "info.log", r) for r in ranks]
            for node, ranks in nodes.items()}

    def upload(steps: int) -> None:
        for node, node_logs in logs.items():
            for log in node_logs:
                log.step(steps)
            done = replay(str(tmp_path / node / "output"), "--out", "s3://runs/job", "--state-dir",
                          str(tmp_path / node), "--instance", node, "-q")
            assert done.returncode == 0, done.stderr

    def mean() -> dict[int, float]:
        got = read_bucket("s3://runs/job")
        return points(got["aggregate/job"], "loss/mean") if "aggregate/job" in got else {}

    upload(5)
    (tmp_path / "stderr-job").mkdir()
    job = _Aggregate([], "s3://runs/job", "poll", tmp_path / "stderr-job",  # type: ignore[arg-type]
                     "--state-dir", str(tmp_path / "job"), "--upload-interval", "0.3", "--poll-interval", "0.1")
    try:
        job.start(wait_ready=False)
        upload(5)
        want = {step: sum(rank * 100000 + step for rank in range(4)) / 4 for step in range(1, 11)}
        wait_until(lambda: mean() == pytest.approx(want), 60, "the mean of all ten steps in the bucket", every=1)
        rc, _ = job.stop()
        assert rc == 0, job.stderr()
    finally:
        job.cleanup()
    assert "Traceback" not in job.stderr()
