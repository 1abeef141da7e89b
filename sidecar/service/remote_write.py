"""``--remote-write URL``: push what ``/metrics`` shows with the Prometheus remote-write 1.0 protocol.

For clusters where nothing can scrape the nodes: every ``--remote-write-interval`` seconds a
thread of its own reads the same registry that ``/metrics`` serves (:func:`sidecar.service.metrics.
registry_for`), so the push holds exactly what a scrape would see at that moment, with the same
names and labels, plus the two labels a scrape adds: ``job="mstb-sidecar"`` (the scrape job of
the shipped configuration) and ``instance`` = ``--instance`` (the host name by default). Like the
HTTP thread of ``/metrics``, it reads the engine's counters between the loop's iterations without
a lock: each figure is read whole under the GIL, and a push is a snapshot as a scrape is. The
engine loop does nothing for it, so a dead, slow or throttling receiver cannot slow reading.

Each snapshot is encoded at once (protobuf ``WriteRequest``, snappy block compression) and queued;
a second thread sends the queue oldest first, one request per snapshot, so samples of a series
arrive in time order as the receivers require. Network errors, 5xx and 429 are retried with
exponential backoff and jitter (Retry-After honoured); any other answer outside 2xx is final: the
samples are counted as rejected and the first such answer is logged with the server's message.
The queue is bounded in samples (``--remote-write-queue``): when full, the oldest snapshots are
dropped and counted (the newest is always kept). On SIGTERM a last snapshot is taken after the
drain and the queue is sent within ``drain_timeout``; what is left then is counted as dropped.
Outcomes are counted in ``mstb_sidecar_remote_write_*`` (pushed too) and in the status line.

Each request also carries every ``--remote-write-header`` and the credentials of
:mod:`sidecar.service.remote_auth`. A 401 or 403 is not final: the credential file is read again
(a rotated Secret) and the same snapshot retried with backoff, counted as ``unauthorized``; the
queue is kept. Neither the log nor the status line nor the metrics ever show the secret.
"""

from __future__ import annotations

import email.utils
import http.client
import logging
import random
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Iterable, Iterator

import cramjam
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from sidecar import __version__
from sidecar.service.remote_auth import Credentials

log = logging.getLogger(__name__)

JOB = "mstb-sidecar"  # the ``job`` label, as the shipped scrape configuration names the sidecars
HEADERS = {
    "Content-Encoding": "snappy",
    "Content-Type": "application/x-protobuf",
    "X-Prometheus-Remote-Write-Version": "0.1.0",
    "User-Agent": f"mstb-sidecar/{__version__}",
}
REQUEST_TIMEOUT = 30.0  # Prometheus' own remote_timeout
MIN_BACKOFF, MAX_BACKOFF = 0.25, 10.0  # doubled per failed attempt, then jittered
MAX_RETRY_AFTER = 300.0  # a Retry-After longer than this is taken as this
OUTCOMES = ("sent", "rejected", "dropped")
FAILURES = ("network", "server-error", "throttled", "unauthorized")  # retried; a rejection is not
UNAUTHORIZED = (401, 403)


def _write_request_class() -> type:
    """``prometheus.WriteRequest`` of remote-write 1.0 (prompb/remote.proto, types.proto: the four
    messages it uses), built in a private pool: no generated code, no ``protoc``."""
    f = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(name="mstb_sidecar/remote_write.proto", package="prometheus",
                                               syntax="proto3")

    def message(name: str, *fields: tuple[str, int, int, int, str]) -> None:
        m = proto.message_type.add(name=name)
        for field_name, number, kind, label, type_name in fields:
            named = {"type_name": type_name} if type_name else {}
            m.field.add(name=field_name, number=number, type=kind, label=label, **named)

    one, many = f.LABEL_OPTIONAL, f.LABEL_REPEATED
    message("WriteRequest", ("timeseries", 1, f.TYPE_MESSAGE, many, ".prometheus.TimeSeries"))
    message("TimeSeries", ("labels", 1, f.TYPE_MESSAGE, many, ".prometheus.Label"),
            ("samples", 2, f.TYPE_MESSAGE, many, ".prometheus.Sample"))
    message("Label", ("name", 1, f.TYPE_STRING, one, ""), ("value", 2, f.TYPE_STRING, one, ""))
    message("Sample", ("value", 1, f.TYPE_DOUBLE, one, ""), ("timestamp", 2, f.TYPE_INT64, one, ""))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("prometheus.WriteRequest"))


WriteRequest = _write_request_class()


def encode(families: Iterable, labels: dict[str, str], timestamp_ms: int) -> tuple[int, bytes]:
    """(samples, snappy-compressed ``WriteRequest``): every sample of ``families`` as its own series,
    named as the text exposition names it, with ``labels`` added (sorted by name, as the protocol
    asks; an empty value is no label, as in Prometheus)."""
    request = WriteRequest()
    count = 0
    for family in families:
        for sample in family.samples:
            series = request.timeseries.add()
            named = {**sample.labels, **labels, "__name__": sample.name}
            for name in sorted(named):
                if named[name] != "":
                    series.labels.add(name=name, value=named[name])
            series.samples.add(value=float(sample.value), timestamp=timestamp_ms)
            count += 1
    return count, bytes(cramjam.snappy.compress_raw(request.SerializeToString()))


class _Answer:
    """What one request came to: sent, retry (after ``wait`` if the server said), or rejected."""

    def __init__(self, outcome: str, reason: str = "", detail: str = "", wait: float | None = None) -> None:
        self.outcome, self.reason, self.detail, self.wait = outcome, reason, detail, wait


class RemoteWrite:
    """The collecting and the sending thread, the bounded queue between them, and their counters."""

    def __init__(self, url: str, registry: CollectorRegistry, interval: float, capacity: int,
                 instance: str, headers: dict[str, str] | None = None,
                 credentials: Credentials | None = None) -> None:
        self.url = url
        self.headers = {**(headers or {}), **HEADERS}
        self.credentials = credentials or Credentials()
        self.registry = registry
        self.interval = interval
        self.capacity = capacity
        self.labels = {"job": JOB, "instance": instance}
        self.counts = dict.fromkeys(OUTCOMES, 0)
        self.failures = dict.fromkeys(FAILURES, 0)
        self._queue: deque[tuple[int, bytes]] = deque()
        self._queued = 0  # samples in _queue
        self._in_flight = 0  # samples of the snapshot being sent (or retried)
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._deadline: float | None = None  # set by close(): send what is queued until then
        self._gave_up = False  # close() counted what was left as dropped: a late answer counts nothing
        self._failing_since: float | None = None
        self._last_error = ""
        self._rejection_logged = False
        self._refused = False  # the last failure was a 401/403 (logged when it starts)
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # as Prometheus: no env proxy
        self._threads = [threading.Thread(target=self._collect_loop, name="remote-write-collect", daemon=True),
                         threading.Thread(target=self._send_loop, name="remote-write-send", daemon=True)]

    @property
    def pending(self) -> int:
        return self._queued + self._in_flight

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def close(self, timeout: float) -> None:
        """A last snapshot (the caller has drained the logs), sent with the queue within ``timeout``;
        what could not be sent by then is counted as dropped."""
        self._stop.set()
        self._threads[0].join()
        self.snapshot()
        with self._cond:
            self._deadline = time.monotonic() + timeout
            self._cond.notify_all()
        self._threads[1].join(timeout)
        with self._cond:
            left = self.pending
            self.counts["dropped"] += left
            self._queue.clear()
            self._queued = self._in_flight = 0
            self._gave_up = True
        if left:
            log.warning("remote write to %s: %d sample(s) not sent within the drain timeout (%g s; %s); "
                        "counted as dropped", self.url, left, timeout, self._last_error or "the receiver is slow")

    def snapshot(self) -> None:
        """Read the registry now and queue the push; drop the oldest pushes past the capacity."""
        count, payload = encode(self.registry.collect(), self.labels, int(time.time() * 1000))
        with self._cond:
            self._queue.append((count, payload))
            self._queued += count
            while self._queued > self.capacity and len(self._queue) > 1:
                dropped, _ = self._queue.popleft()
                self._queued -= dropped
                self.counts["dropped"] += dropped
            self._cond.notify_all()

    def describe(self) -> str:
        """The status line's part: ``remote write: 1200 sent, 40 pending, 300 dropped; failing since 30 s: ...``."""
        counts, since = self.counts, self._failing_since  # read once: the sending thread may clear it meanwhile
        parts = [f"{counts['sent']} sent"] + [f"{n} {what}" for what, n in
                                               (("pending", self.pending), ("dropped", counts["dropped"]),
                                                ("rejected", counts["rejected"])) if n]
        failing = f"; failing since {time.monotonic() - since:.0f} s: {self._last_error}" if since is not None else ""
        return f"remote write: {', '.join(parts)}{failing}"

    def _collect_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.snapshot()
            except RuntimeError as exc:  # a dict the engine resized while read: as a failed scrape, taken again
                log.debug("remote write: could not read the metrics (%s); next push in %g s", exc, self.interval)
            self._stop.wait(self.interval)

    def _send_loop(self) -> None:
        backoff = MIN_BACKOFF
        item: tuple[int, bytes] | None = None
        while True:
            with self._cond:
                if item is None:
                    while not self._queue and self._deadline is None:
                        self._cond.wait()
                    if not self._queue:
                        return  # closing, and all is sent
                    item = self._queue.popleft()
                    self._queued -= item[0]
                    self._in_flight = item[0]
                deadline = self._deadline
            timeout = REQUEST_TIMEOUT if deadline is None else min(REQUEST_TIMEOUT, deadline - time.monotonic())
            if timeout <= 0:
                return
            answer = self._post(item[1], timeout)
            with self._cond:
                if self._gave_up:
                    return
                if answer.outcome != "retry":
                    self.counts[answer.outcome] += item[0]
                    self._in_flight, item = 0, None
                else:
                    self.failures[answer.reason] += 1
            self._account(answer)
            if answer.reason == "unauthorized":
                self._reload_credentials()
            if answer.outcome == "retry":
                wait = answer.wait if answer.wait is not None else backoff * random.uniform(0.5, 1.0)
                backoff = min(backoff * 2, MAX_BACKOFF)
                with self._cond:
                    self._cond.wait_for(lambda: self._deadline is not None and self._deadline != deadline, wait)
            else:
                backoff = MIN_BACKOFF

    def _post(self, payload: bytes, timeout: float) -> _Answer:
        request = urllib.request.Request(self.url, data=payload, method="POST",
                                         headers={**self.headers, **self.credentials.headers})
        try:
            with self._opener.open(request, timeout=timeout) as response:
                response.read()
            return _Answer("sent")
        except urllib.error.HTTPError as exc:
            message = _message(exc)
            if exc.code in UNAUTHORIZED:
                return _Answer("retry", "unauthorized", f"HTTP {exc.code}: {message}")
            if exc.code == 429 or exc.code >= 500:
                return _Answer("retry", "throttled" if exc.code == 429 else "server-error",
                               f"HTTP {exc.code}: {message}", _retry_after(exc.headers.get("Retry-After")))
            return _Answer("rejected", detail=f"HTTP {exc.code}: {message}")
        except (OSError, http.client.HTTPException) as exc:  # refused, reset, timed out, DNS; a garbled answer
            reason = getattr(exc, "reason", None) or exc
            return _Answer("retry", "network", str(getattr(reason, "strerror", None) or reason))

    def _reload_credentials(self) -> None:
        """After a 401/403: the credential file again, as a rotated Secret mount holds the new one."""
        try:
            self.credentials.reload()
        except ValueError as exc:  # the message names the file, never its content
            log.warning("remote write to %s: %s; keeping the credentials read before", self.url, exc)

    def _account(self, answer: _Answer) -> None:
        """Log a failure once when it starts and once when it is over, a rejection once."""
        now = time.monotonic()
        if answer.outcome == "retry":
            self._last_error = answer.detail
            if self._failing_since is None or (answer.reason == "unauthorized" and not self._refused):
                self._failing_since = self._failing_since or now
                file = self.credentials.file
                again = f"; reading {file} again" if answer.reason == "unauthorized" and file else ""
                log.warning("remote write to %s failed (%s)%s; retrying with backoff, keeping up to %d samples",
                            self.url, answer.detail, again, self.capacity)
            self._refused = answer.reason == "unauthorized"
            return
        if self._failing_since is not None:
            log.info("remote write to %s works again after %.0f s", self.url, now - self._failing_since)
            self._failing_since, self._last_error, self._refused = None, "", False
        if answer.outcome == "rejected" and not self._rejection_logged:
            self._rejection_logged = True
            log.warning("remote write to %s: the server rejected a push (%s); not retried, counted as rejected "
                        "(later rejections are only counted)", self.url, answer.detail)


def _message(exc: urllib.error.HTTPError) -> str:
    """The server's reason, one line, bounded."""
    try:
        body = exc.read(512).decode("utf-8", "replace")
    except OSError:
        body = ""
    return " ".join(body.split()) or str(exc.reason)


def _retry_after(value: str | None) -> float | None:
    """Seconds of a Retry-After header (a number or an HTTP date), bounded; None if absent or unreadable."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError):
            return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER)


class RemoteWriteCollector(Collector):
    """The pusher's own counters, on ``/metrics`` and in the push itself."""

    def __init__(self, pusher: RemoteWrite, job: str) -> None:
        self.pusher = pusher
        self.job = job

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        pusher, job = self.pusher, self.job
        samples = CounterMetricFamily("mstb_sidecar_remote_write_samples",
                                      "Samples pushed by --remote-write, by outcome (sent; rejected by the "
                                      "receiver; dropped: queue full, or not sent by exit)",
                                      labels=["training_job", "outcome"])
        for outcome in OUTCOMES:
            samples.add_metric([job, outcome], pusher.counts[outcome])
        yield samples
        failed = CounterMetricFamily("mstb_sidecar_remote_write_failed_requests",
                                     "Push requests that failed and were retried (network, server-error: 5xx, "
                                     "throttled: 429, unauthorized: 401/403)", labels=["training_job", "reason"])
        for reason in FAILURES:
            failed.add_metric([job, reason], pusher.failures[reason])
        yield failed
        pending = GaugeMetricFamily("mstb_sidecar_remote_write_pending_samples",
                                    "Samples queued for --remote-write, not sent yet", labels=["training_job"])
        pending.add_metric([job], pusher.pending)
        yield pending
