"""Optional HTTP endpoint (``--metrics-port``): Prometheus metrics and health probes.

- ``/metrics``: the sidecar's own figures, collected from the engine when Prometheus asks, so
  the hot path pays nothing. Every series carries ``training_job`` (``--job``), so a dashboard's
  job selector applies to all of them; per-rank ones add ``rank``, and an alert's name is the
  label ``alert`` wherever it appears. ``mstb_sidecar_build_info{version,python}`` is 1;
  ``mstb_sidecar_training_state{state}`` says whether each rank runs, finished or failed;
  ``mstb_sidecar_sink_health{sink,reason}`` what each output beside the event files counts
  (:meth:`Sink.health <sidecar.output.sink.Sink.health>`). Everything comes from one snapshot per scrape
  (:meth:`Engine.progress <sidecar.engine.progress.ProgressPart.progress>`) and the training
  gauges' sink (:class:`TrainingGauges`).
- ``/healthz``: 200 while the main loop ran within its watchdog interval (systemd's
  ``WatchdogSec`` when set, else :data:`STALE_AFTER`), 503 once it did not: a stuck sidecar.
- ``/readyz``: 200 once the first scan is done, 503 before.
- anything else: 404, so a typo in a scrape or probe config is seen, not answered with metrics.

The registry that ``/metrics`` serves is also what ``--remote-write`` pushes
(:mod:`sidecar.service.remote_write`), so a push and a scrape show the same series.

Health is what the main loop tells systemd (:class:`sidecar.service.notify.Notifier`), so the probes
and the watchdog never disagree. The endpoint binds to 127.0.0.1 unless ``--metrics-host``
says otherwise.
"""

from __future__ import annotations

import math
import platform
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from socketserver import TCPServer, ThreadingMixIn
from typing import TypeVar
from urllib.parse import urlsplit

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from parsers import tags
from parsers.lifecycle import Lifecycle
from parsers.records import Record
from sidecar import __version__
from sidecar.analysis.accounting import Reason
from sidecar.engine import Engine, Progress
from sidecar.output.sink import PassiveSink, Position
from sidecar.service.notify import Notifier
from sidecar.service.status import TENSORBOARD

# tag -> (metric name after mstb_sidecar_training_, help); iteration-time is exported in seconds
TRAINING_GAUGES = {
    tags.LOSS: ("loss", "Latest loss (NaN when the log said so)"),
    tags.LEARNING_RATE: ("learning_rate", "Latest learning rate"),
    tags.GRAD_NORM: ("grad_norm", "Latest global gradient norm"),
    tags.LOSS_SCALE: ("loss_scale", "Latest loss scale"),
    tags.THROUGHPUT: ("throughput_samples_per_second", "Latest throughput, samples/s per device"),
    tags.MODEL_FLOPS: ("model_tflops_per_device", "Latest model TFLOPS per device"),
    tags.ITERATION_TIME: ("step_seconds", "Latest step time as the log reports it"),
}
PER_RANK = ["training_job", "rank"]  # the labels of every per-rank series; the others carry training_job
F = TypeVar("F", CounterMetricFamily, GaugeMetricFamily)
ALERT_HOLD = 60.0  # a NaN that lasted one step must still reach a Prometheus scraping every 15-30 s
STALE_AFTER = 30.0  # without a systemd watchdog: three of the main loop's longest waits (10 s)


class TrainingGauges(PassiveSink):
    """The per-rank training gauges (:data:`TRAINING_GAUGES`), a sink (:mod:`sidecar.output.sink`):
    the values of each rank's latest training step written to its run (with ``--every``, the
    latest kept). Points read again after a restart are older than what comes next: ignored, and
    nothing is kept across restarts (a gauge shows what this process read)."""

    name = "training-gauges"

    def __init__(self) -> None:
        self.latest: dict[int, dict[str, float]] = {}  # rank -> tag -> value

    def write(self, run: str, rank: int | None, record: Record, again: bool = False,
              at: Position | None = None) -> None:
        if rank is not None and record.training_step and not again:
            self.latest[rank] = {tag: value for tag, value in record.scalars.items() if tag in TRAINING_GAUGES}


class EngineCollector(Collector):
    def __init__(self, engine: Engine, job: str, gauges: TrainingGauges) -> None:
        self.engine = engine
        self.job = job
        self.gauges = gauges

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        progress = self.engine.progress()
        build = GaugeMetricFamily("mstb_sidecar_build_info", "Always 1; the labels say what runs",
                                  labels=["version", "python", "training_job", "sidecar"])
        build.add_metric([__version__, platform.python_version(), self.job, progress.instance], 1)
        yield build
        yield from self._training(progress, time.monotonic())
        job = [self.job]
        yield self._one(CounterMetricFamily, "mstb_sidecar_bytes_read", "Log bytes read", progress.bytes_read)
        yield self._one(CounterMetricFamily, "mstb_sidecar_lines_read", "Log lines read", progress.lines_read)
        written = CounterMetricFamily("mstb_sidecar_records_written", "Step records written", labels=PER_RANK)
        for rank_id, count in sorted(progress.accounting.written.items()):
            written.add_metric([*job, str(rank_id)], count)
        yield written
        dropped = CounterMetricFamily(
            "mstb_sidecar_records_not_written",
            f"Records or lines read but not written, by reason ({', '.join(r.value for r in Reason)})",
            labels=[*PER_RANK, "reason"],
        )
        for (rank_id, reason), count in sorted(progress.accounting.dropped.items()):
            dropped.add_metric([*job, str(rank_id), reason.value], count)
        yield dropped
        yield self._one(GaugeMetricFamily, "mstb_sidecar_files", "Files followed", progress.following)
        yield self._one(GaugeMetricFamily, "mstb_sidecar_lag_bytes", "Bytes written to logs but not read yet",
                        progress.lag_bytes)
        points = CounterMetricFamily("mstb_sidecar_points_written", "Values written to event files", labels=PER_RANK)
        for rank_id in sorted(progress.written_here):
            points.add_metric([*job, str(rank_id)], progress.ranks[rank_id].points)
        yield points
        if progress.aggregate is not None:
            yield self._one(GaugeMetricFamily, "mstb_sidecar_aggregate_pending_steps",
                            "Steps the cross-rank aggregate waits for a rank to report", progress.aggregate.pending)
            yield self._one(CounterMetricFamily, "mstb_sidecar_aggregate_incomplete_steps",
                            "Aggregate steps written without every rank (a rank late past "
                            "--aggregate-timeout, or a replay whose input ended first)",
                            progress.aggregate.incomplete)
        alerts = CounterMetricFamily("mstb_sidecar_alerts", "Alert episodes begun (rank 'all': across ranks)",
                                     labels=[*PER_RANK, "alert"])
        for (rank_id, name), count in sorted(progress.alerts.items()):
            alerts.add_metric([*job, "all" if rank_id < 0 else str(rank_id), name], count)
        yield alerts
        sinks = GaugeMetricFamily("mstb_sidecar_sink_health", "Outputs beside the event files (--mlflow): "
                                  "what each counts, by reason (sent, queued, rejected, dropped-..., retries, "
                                  "seconds-failing)", labels=["training_job", "sink", "reason"])
        for name, counts in progress.sinks.items():
            if name != TENSORBOARD:  # the event files' own figures are above
                for reason, count in counts.items():
                    sinks.add_metric([*job, name, reason], count)
        yield sinks

    def _one(self, family_type: type[F], name: str, help_text: str, value: float) -> F:
        """The one series of a figure of the whole sidecar, labelled with its job."""
        family = family_type(name, help_text, labels=["training_job"])
        family.add_metric([self.job], value)
        return family

    def _training(self, progress: Progress, now: float) -> Iterator[GaugeMetricFamily]:
        """Per-rank training gauges and alert state, labelled by job and rank (bounded: one series
        per rank and metric, one per rank and alert raised)."""
        labels = PER_RANK
        families = {tag: GaugeMetricFamily(f"mstb_sidecar_training_{name}", help_text, labels=labels)
                    for tag, (name, help_text) in TRAINING_GAUGES.items()}
        step = GaugeMetricFamily("mstb_sidecar_training_step", "Latest training step read", labels=labels)
        since = GaugeMetricFamily("mstb_sidecar_training_seconds_since_step",
                                  "Seconds since this sidecar read the rank's latest step", labels=labels)
        for rank, figures in progress.ranks.items():
            key = [self.job, str(rank)]
            if figures.watched_step is not None:
                step.add_metric(key, figures.watched_step)
            if figures.arrived is not None:
                since.add_metric(key, max(now - figures.arrived, 0.0))
        for rank, latest in sorted(self.gauges.latest.items()):
            for tag, value in latest.items():
                families[tag].add_metric([self.job, str(rank)], value / 1000.0 if tag == tags.ITERATION_TIME else value)
        yield step
        yield since
        yield self._lifecycle(progress)
        yield from families.values()
        active = GaugeMetricFamily("mstb_sidecar_alert_active",
                                   f"1 while an alert episode is on, and at least {ALERT_HOLD:g} s from its start "
                                   "so a short one is scraped; else 0 (rank 'all': across ranks)",
                                   labels=[*labels, "alert"])
        for key, on in sorted(progress.alerts_active.items()):
            rank, name = key
            held = now - progress.alerts_started.get(key, -math.inf) < ALERT_HOLD
            active.add_metric([self.job, "all" if rank < 0 else str(rank), name], 1.0 if on or held else 0.0)
        yield active

    def _lifecycle(self, progress: Progress) -> GaugeMetricFamily:
        """One series per rank and state, 1 for the rank's current one (a Prometheus state set):
        the shipped TrainingStalled rule does not page for a finished or failed rank."""
        family = GaugeMetricFamily("mstb_sidecar_training_state",
                                   "1 for the rank's lifecycle state (running, finished, failed), else 0",
                                   labels=[*PER_RANK, "state"])
        for rank, figures in progress.ranks.items():
            if figures.lifecycle is not None:
                for state in Lifecycle:
                    family.add_metric([self.job, str(rank), state.value], 1.0 if state is figures.lifecycle else 0.0)
        return family


class Probes:
    """``/healthz`` and ``/readyz`` answers: (status, one line of text)."""

    def __init__(self, notifier: Notifier) -> None:
        self.notifier = notifier

    def alive(self) -> tuple[int, str]:
        notifier = self.notifier
        age = notifier.since_healthy()
        if age is None:
            return 200, "starting: the first scan is running"
        limit = 2 * notifier.watchdog_interval if notifier.watchdog_interval else STALE_AFTER
        if age <= limit:
            return 200, f"alive: the main loop ran {age:.1f} s ago"
        return 503, f"stalled: the main loop last ran {age:.0f} s ago (limit {limit:g} s)"

    def ready(self) -> tuple[int, str]:
        if self.notifier.ready_at is None:
            return 503, "not ready: the first scan is running"
        return 200, "ready: the first scan is done"


class _Server(ThreadingMixIn, TCPServer):
    """http.server's ``HTTPServer`` without its reverse-DNS lookup of the bound address at start."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, host: str, port: int, registry: CollectorRegistry, probes: Probes) -> None:
        self.address_family, address = _family(host, port)
        self.registry = registry
        self.probes = probes
        super().__init__((address, port), _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        path = urlsplit(self.path).path
        if path == "/metrics":
            self._send(200, generate_latest(self.server.registry), CONTENT_TYPE_LATEST)
        elif path in ("/healthz", "/readyz"):
            code, text = self.server.probes.alive() if path == "/healthz" else self.server.probes.ready()
            self._send(code, f"{text}\n".encode(), "text/plain; charset=utf-8")
        else:
            self._send(404, b"not found: the paths are /metrics, /healthz and /readyz\n", "text/plain; charset=utf-8")

    def _send(self, code: int, body: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass  # a scrape every few seconds is not news


def _family(host: str, port: int) -> tuple[socket.AddressFamily, str]:
    """IPv4 or IPv6, as the host names it (``::1`` must not be bound as IPv4)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    return family, sockaddr[0]


def registry_for(engine: Engine, job: str, gauges: TrainingGauges) -> tuple[EngineCollector, CollectorRegistry]:
    """The one registry that ``/metrics`` serves and ``--remote-write`` pushes (``gauges``: a sink
    of the engine's); the daemon points the returned collector at a new engine if it starts over."""
    collector = EngineCollector(engine, job, gauges)
    registry = CollectorRegistry()
    registry.register(collector)
    return collector, registry


def serve(registry: CollectorRegistry, host: str, port: int, notifier: Notifier) -> None:
    """Start the endpoint in its own thread."""
    server = _Server(host, port, registry, Probes(notifier))
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
