"""``--remote-write``: the push reaches a real Prometheus as ``/metrics`` shows it, and survives faults.

Debian's ``prometheus`` runs with ``--web.enable-remote-write-receiver`` on 127.0.0.1 (found and
required as in :mod:`test_prometheus`); the values are read back through its query API. The faults
a real receiver cannot be made to show on cue (503, 429 with Retry-After, 400, a server that hangs)
come from a small local HTTP server that decodes what it is sent (snappy, then the protobuf wire
format by hand, independently of the sidecar's encoder).
"""

from __future__ import annotations

import math
import re
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import cramjam
import pytest
from prometheus_client.parser import text_string_to_metric_families

from live_helpers import RankLog, Sidecar, all_written, free_port, loss_value, wait_until
from test_cli import one_line_error, run
from test_prometheus import binary, query

FIXTURE = Path(__file__).parent / "fixtures" / "real" / "mf1.9-dp2" / "output"
VOLATILE = ("mstb_sidecar_training_seconds_since_step", "mstb_sidecar_remote_write_")  # change with every push


class Prometheus:
    """Debian's prometheus as a remote-write receiver on a fixed port and storage, stoppable and startable."""

    def __init__(self, root: Path, web: Sequence[str] = (), headers: dict[str, str] | None = None) -> None:
        self.binary = binary("prometheus")
        self.root = root
        self.port = free_port()
        self.web = list(web)  # e.g. --web.config.file=...
        self.headers = headers or {}  # what the API needs then (basic auth)
        (root / "prometheus.yml").write_text("global: {scrape_interval: 1h}\n")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api/v1/write"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, f"--config.file={self.root / 'prometheus.yml'}", f"--storage.tsdb.path={self.root / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--web.enable-remote-write-receiver", *self.web],
            stdout=subprocess.DEVNULL, stderr=open(self.root / "prometheus.log", "ab"))
        wait_until(self._ready, 30, "prometheus to be ready")

    def _ready(self) -> bool:
        try:
            request = urllib.request.Request(f"http://127.0.0.1:{self.port}/-/ready", headers=self.headers)
            with urllib.request.urlopen(request, timeout=1) as resp:
                return resp.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(20)

    def raw(self, expr: str) -> list[dict]:
        """A range selector's raw samples: [{metric, values: [[time, "value"], ...]}]."""
        return query(self.port, expr, self.headers)


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Prometheus]:
    server = Prometheus(tmp_path)
    server.start()
    yield server
    server.stop()


def sidecar(tmp_path: Path, watch: Path, *extra: str) -> Sidecar:
    return Sidecar([watch], tmp_path / "tb", "inotify", tmp_path, *extra).start()


def exposition(port: int) -> dict[tuple[str, frozenset], float]:
    """Every sample ``/metrics`` shows: (name, labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
        text = resp.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def stored(prom: Prometheus, job: str) -> dict[tuple[str, frozenset], float]:
    """Every series Prometheus holds of the job's push, as :func:`exposition` names them; checks
    the two labels the push adds for a scrape's ``job`` and ``instance``."""
    found = {}
    for result in query(prom.port, f'{{training_job="{job}"}}', prom.headers):
        labels = dict(result["metric"])
        assert (labels.pop("job"), labels.pop("instance")) == ("mstb-sidecar", "test")
        found[(labels.pop("__name__"), frozenset(labels.items()))] = float(result["value"][1])
    return found


def key(name: str, job: str, **labels: str) -> tuple[str, frozenset]:
    """A series as :func:`exposition` and :func:`stored` name it."""
    return name, frozenset({"training_job": job, **labels}.items())


def same(a: float, b: float) -> bool:
    return a == b or math.isnan(a) and math.isnan(b)


def stopped_counts(side: Sidecar) -> dict[str, int]:
    """The counts of the last status line (``stopped: ..., remote write: 12 sent, 3 dropped``)."""
    line = [entry for entry in side.stderr().splitlines() if "stopped:" in entry][-1]
    part = line.split("remote write: ")[1].split(";")[0]
    return {what: int(n) for n, what in re.findall(r"(\d+) (\w+)", part)}


def test_prometheus_holds_what_metrics_shows_and_what_was_queued_while_it_was_down(tmp_path: Path,
                                                                                   prometheus: Prometheus) -> None:
    port = free_port()
    side = sidecar(tmp_path, FIXTURE, "--metrics-port", str(port), "--job", "rw-fixture", "--remote-write",
                   prometheus.url, "--remote-write-interval", "0.3", "--status-interval", "0")
    step, loss = key("mstb_sidecar_training_step", "rw-fixture", rank="0"), key("mstb_sidecar_training_loss",
                                                                                  "rw-fixture", rank="0")
    try:
        def agree() -> bool:
            shown, held = exposition(port), stored(prometheus, "rw-fixture")
            return shown.get(step) == 200.0 and shown.keys() == held.keys() and all(
                same(value, held[series]) for series, value in shown.items() if not series[0].startswith(VOLATILE))

        wait_until(agree, 20, "Prometheus to hold every series /metrics shows, with its value")
        held = stored(prometheus, "rw-fixture")
        assert held[step] == 200.0 and held[loss] == exposition(port)[loss]
        assert held[key("mstb_sidecar_records_written_total", "rw-fixture", rank="0")] > 0

        prometheus.stop()
        down = time.time()
        pending = key("mstb_sidecar_remote_write_pending_samples", "rw-fixture")
        wait_until(lambda: exposition(port)[pending] >= 5 * len(held), 10, "five snapshots to be queued")
        failed = key("mstb_sidecar_remote_write_failed_requests_total", "rw-fixture", reason="network")
        assert exposition(port)[failed] >= 2
        side.proc.send_signal(signal.SIGUSR1)
        wait_until(lambda: re.search(r"remote write: \d+ sent, \d+ pending; failing since \d+ s: ", side.stderr()),
                   5, "the status line to say so")
        assert side.running() and "remote write to http://127.0.0.1" in side.stderr()  # a warning, not an exit
        up = time.time()
        prometheus.start()
        sent = key("mstb_sidecar_remote_write_samples_total", "rw-fixture", outcome="sent")
        wait_until(lambda: exposition(port)[pending] < 2 * len(held), 15, "the queue to drain")
        window = f"{time.time() - down + 30:.0f}s"
        steps = prometheus.raw(f'mstb_sidecar_training_step{{training_job="rw-fixture",rank="0"}}[{window}]')
        during = [float(t) for t, v in steps[0]["values"] if down + 0.2 < float(t) < up and v == "200"]
        assert len(during) >= 4, (down, up, steps)  # the snapshots taken while it was down
        dropped = key("mstb_sidecar_remote_write_samples_total", "rw-fixture", outcome="dropped")
        assert exposition(port)[dropped] == 0 and exposition(port)[sent] > 0
    finally:
        rc, _ = side.stop()
    assert rc == 0 and "Traceback" not in side.stderr(), side.stderr()


def test_sigterm_pushes_the_last_values(tmp_path: Path, prometheus: Prometheus) -> None:
    log = RankLog(tmp_path / "output" / "log" / "rank_0" / "info.log", 0)
    log.step(5)
    port = free_port()
    side = sidecar(tmp_path, tmp_path / "output", "--metrics-port", str(port), "--job", "rw-final",
                   "--remote-write", prometheus.url, "--remote-write-interval", "600")
    step = key("mstb_sidecar_training_step", "rw-final", rank="0")
    wait_until(lambda: exposition(port).get(step) == 5.0, 10, "step 5 to be read")
    log.step(3)
    wait_until(lambda: exposition(port).get(step) == 8.0, 10, "step 8 to be read")
    rc, _ = side.stop()
    assert rc == 0, side.stderr()
    held = stored(prometheus, "rw-final")  # the first push (at start) held no step yet; the last one does
    assert held[step] == 8.0
    assert held[("mstb_sidecar_training_loss", step[1])] == loss_value(0, 8)


# -- a receiver that answers as told ---------------------------------------------------------------
def fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of a protobuf message: varints and length-delimited fields, 64-bit as int."""
    i = 0
    while i < len(data):
        key, i = varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = varint(data, i)
        elif wire == 1:
            value, i = int.from_bytes(data[i:i + 8], "little"), i + 8
        else:
            assert wire == 2, wire
            size, i = varint(data, i)
            value, i = data[i:i + size], i + size
        yield number, value


def varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        value |= (byte & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if byte < 0x80:
            return value, i


class Push:
    """One request as the receiver saw it."""

    def __init__(self, at: float, headers: dict[str, str], body: bytes, code: int) -> None:
        self.at, self.headers, self.body, self.code = at, headers, body, code
        series = [value for number, value in fields(bytes(cramjam.snappy.decompress_raw(body))) if number == 1]
        self.samples = len(series)
        stamps = {stamp for s in series for number, sample in fields(s) if number == 2
                  for n, stamp in fields(sample) if n == 2}
        assert len(stamps) == 1, stamps  # one snapshot per request
        self.timestamp = stamps.pop()


class Receiver:
    """A local HTTP server: ``answer(n)`` gives the status, headers and body of the n-th request (0-based)."""

    def __init__(self, answer: Callable[[int], tuple[int, dict[str, str], bytes]], hang: bool = False) -> None:
        self.pushes: list[Push] = []
        self.release = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if hang:
                    receiver.release.wait(60)
                code, headers, text = answer(len(receiver.pushes))
                receiver.pushes.append(Push(time.monotonic(), dict(self.headers), body, code))
                self.send_response(code)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/api/v1/write"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()

    def samples(self, code: int) -> int:
        return sum(push.samples for push in self.pushes if push.code == code)


@pytest.fixture
def receiver(request: pytest.FixtureRequest) -> Iterator[Receiver]:
    server = Receiver(*request.param)
    yield server
    server.close()


def busy_then_ok(n: int) -> tuple[int, dict[str, str], bytes]:
    """429 with Retry-After (1.5 s: the backoff is 0.25 s at most then), two 503s, then 200."""
    return [(429, {"Retry-After": "1.5"}, b"slow down"), (503, {}, b"busy"), (503, {}, b"busy")][n] if n < 3 \
        else (200, {}, b"")


@pytest.mark.parametrize("receiver", [(busy_then_ok,)], indirect=True)
def test_5xx_and_429_are_retried_with_the_same_samples_and_retry_after_is_honoured(tmp_path: Path,
                                                                                   receiver: Receiver) -> None:
    log = RankLog(tmp_path / "output" / "log" / "rank_0" / "info.log", 0)
    log.step(3)
    port = free_port()
    side = sidecar(tmp_path, tmp_path / "output", "--metrics-port", str(port), "--job", "rw-retry",
                   "--remote-write", receiver.url, "--remote-write-interval", "0.2")
    wait_until(lambda: len(receiver.pushes) >= 6, 15, "the receiver to accept pushes")
    shown = exposition(port)
    failed = {reason: shown[key("mstb_sidecar_remote_write_failed_requests_total", "rw-retry", reason=reason)]
              for reason in ("network", "server-error", "throttled")}
    rc, _ = side.stop()
    assert rc == 0, side.stderr()
    first = receiver.pushes
    assert [p.code for p in first[:4]] == [429, 503, 503, 200]
    assert first[0].body == first[1].body == first[2].body == first[3].body  # the one snapshot, retried until taken
    assert first[1].at - first[0].at >= 1.45  # Retry-After: 1.5
    assert failed == {"network": 0, "server-error": 2, "throttled": 1}
    assert {k.lower(): v for k, v in first[0].headers.items()}.items() >= {
        "content-encoding": "snappy", "content-type": "application/x-protobuf",
        "x-prometheus-remote-write-version": "0.1.0"}.items()
    stamps = [p.timestamp for p in first if p.code == 200]
    assert stamps == sorted(set(stamps))  # oldest first, none twice
    assert stopped_counts(side) == {"sent": receiver.samples(200)}  # none pending, dropped or rejected


@pytest.mark.parametrize("receiver", [(lambda n: (400, {}, b"out of bounds: sample too old for this test\n"),)],
                         indirect=True)
def test_a_4xx_is_rejected_not_retried_counted_and_logged_once(tmp_path: Path, receiver: Receiver) -> None:
    port = free_port()
    side = sidecar(tmp_path, FIXTURE, "--metrics-port", str(port), "--job", "rw-reject",
                   "--remote-write", receiver.url, "--remote-write-interval", "0.2")
    wait_until(lambda: len(receiver.pushes) >= 4, 15, "several pushes")
    shown = exposition(port)
    rc, _ = side.stop()
    assert rc == 0, side.stderr()
    assert len({p.body for p in receiver.pushes}) == len(receiver.pushes)  # each snapshot once: no retry
    assert side.stderr().count("sample too old for this test") == 1
    assert "HTTP 400: out of bounds: sample too old for this test" in side.stderr()
    assert all(shown[key("mstb_sidecar_remote_write_failed_requests_total", "rw-reject", reason=reason)] == 0
               for reason in ("network", "server-error", "throttled"))
    assert stopped_counts(side) == {"sent": 0, "rejected": receiver.samples(400)}


class DownFor:
    """503 for ``seconds`` from the first request, then 200."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.until = math.inf

    def __call__(self, n: int) -> tuple[int, dict[str, str], bytes]:
        if n == 0:
            self.until = time.monotonic() + self.seconds
        return (503, {}, b"down") if time.monotonic() < self.until else (200, {}, b"")


@pytest.mark.parametrize("receiver", [(DownFor(2.0),)], indirect=True)
def test_a_full_queue_drops_the_oldest_snapshots_and_counts_them(tmp_path: Path, receiver: Receiver) -> None:
    side = sidecar(tmp_path, FIXTURE, "--job", "rw-drop", "--remote-write", receiver.url,
                   "--remote-write-interval", "0.1", "--remote-write-queue", "1")  # only the newest snapshot is kept
    wait_until(lambda: len([p for p in receiver.pushes if p.code == 200]) >= 3, 20,
               "the receiver to accept pushes again")
    rc, _ = side.stop()
    assert rc == 0, side.stderr()
    failed = {p.timestamp for p in receiver.pushes if p.code == 503}
    taken = [p.timestamp for p in receiver.pushes if p.code == 200]
    counts = stopped_counts(side)
    assert counts["sent"] == receiver.samples(200) and counts["dropped"] > 0
    # The first snapshot was retried for two seconds (503) and then taken; the ones collected
    # meanwhile (every 0.1 s) replaced each other in the queue, so the next one sent is from
    # the end of those two seconds, not from their start.
    assert failed == {taken[0]} and taken == sorted(set(taken))
    assert taken[1] - taken[0] >= 1500


@pytest.mark.parametrize("receiver", [(lambda n: (200, {}, b""), True)], indirect=True)
def test_a_hung_receiver_never_delays_the_event_files_nor_the_exit(tmp_path: Path, receiver: Receiver) -> None:
    log = RankLog(tmp_path / "output" / "log" / "rank_0" / "info.log", 0)
    config = tmp_path / "sidecar.yaml"
    config.write_text("drain_timeout: 1\n")
    side = sidecar(tmp_path, tmp_path / "output", "--remote-write", receiver.url, "--remote-write-interval", "0.1",
                   "--config", str(config))
    for _ in range(3):
        log.step(10)
        wait_until(lambda: all_written(tmp_path / "tb", [log]), 5, "the event files to keep up")
    rc, took = side.stop()
    assert rc == 0 and took < 4, (took, side.stderr())
    assert re.search(r"remote write to \S+: \d+ sample\(s\) not sent within the drain timeout \(1 s; ", side.stderr())
    assert stopped_counts(side)["dropped"] > 0


def test_a_url_that_is_not_http_is_a_one_line_error(tmp_path: Path) -> None:
    proc = run("--watch", str(FIXTURE), "--out", str(tmp_path / "o"), "--remote-write", "ftp://prometheus/api/v1/write")
    assert proc.returncode == 2
    assert "--remote-write: Value error, not an http:// or https:// URL" in one_line_error(proc)
    config = tmp_path / "c.yaml"
    config.write_text("remote_write: prometheus:9090\n")
    proc = run("--watch", str(FIXTURE), "--out", str(tmp_path / "o"), "--config", str(config))
    assert proc.returncode == 2 and "'remote_write': Value error, not an http" in one_line_error(proc)
