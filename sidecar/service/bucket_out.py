"""``--out s3://BUCKET/PREFIX`` around the commands: the checks at start, metrics, the last upload.

At start (before any log is read) :func:`open_bucket` proves what a user can fix with one line and
exit 2: boto3 is installed, the endpoint answers, the bucket exists and the credentials may write
it, and no other sidecar holds the prefix as this instance (:mod:`sidecar.output.lease`). Then it
pulls what the staging directory lacks (:meth:`Uploader.pull`), so the engine starts from what the
bucket shows. Later faults never end the process: they are retried and counted
(``mstb_sidecar_bucket_*``, the status line).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from sidecar.output.bucket import INSTALL, BucketError, Store, endpoint
from sidecar.output.lease import Lease, LeaseError
from sidecar.output.upload import Uploader
from sidecar.service.config import SidecarConfig

LAST_UPLOAD_TIMEOUT = 30.0  # a live sidecar's last upload at its stop, at least (its --drain-timeout if longer)
REPLAY_UPLOAD_TIMEOUT = 300.0  # a replay is done when the bucket has it: it waits this long for the store


class BucketStartError(Exception):
    """The bucket cannot be used as given (one line, exit 2)."""


def open_bucket(config: SidecarConfig, mirror: bool = False) -> Uploader:
    """The uploader of ``config.bucket``, its lease held and the staging directory pulled up to date."""
    url = str(config.bucket)
    try:
        import boto3  # noqa: F401  (only to say how to get it)
    except ImportError:
        raise BucketStartError(f"--out {url} needs boto3, the extra 's3': {INSTALL}") from None
    store = Store(url)
    try:
        store.check()
        lease = Lease(store, config.out, config.instance)
        lease.take()
        uploader = Uploader(store, config.out, config.instance, config.upload_interval, lease, mirror)
        uploader.pull()
    except BucketError as exc:
        raise BucketStartError(_why(url, store, exc)) from None
    except LeaseError as exc:
        raise BucketStartError(str(exc)) from None
    return uploader


def _why(url: str, store: Store, exc: BucketError) -> str:
    where = endpoint() or "the default endpoint (AWS_ENDPOINT_URL, else AWS S3)"
    if exc.reason == "credentials":
        return (f"--out {url}: the store refused the credentials ({exc}); check AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (or the profile) for this endpoint")
    if exc.reason == "no-bucket":
        return f"--out {url}: there is no bucket {store.bucket} at {where}; create it or correct --out"
    if exc.reason in ("unreachable", "slow"):
        return f"--out {url}: cannot reach {where} ({exc}); check S3_ENDPOINT / AWS_ENDPOINT_URL and the network"
    return f"--out {url}: the store refused ({exc})"


def close_bucket(uploader: Uploader, config: SidecarConfig, replay: bool) -> bool:
    """The last upload; True if the bucket has everything."""
    return uploader.finish(REPLAY_UPLOAD_TIMEOUT if replay else max(LAST_UPLOAD_TIMEOUT, config.drain_timeout))


class BucketCollector(Collector):
    """The uploader's counters on ``/metrics`` (and in ``--remote-write``)."""

    def __init__(self, uploader: Uploader, job: str) -> None:
        self.uploader, self.job = uploader, job

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        up, job = self.uploader, [self.job]
        for name, key, text in (("objects", "objects", "Objects uploaded to the --out bucket"),
                                ("uploaded_bytes", "bytes", "Bytes uploaded to the --out bucket"),
                                ("checkpoints", "checkpoints", "Checkpoints uploaded after the objects they cover")):
            family = CounterMetricFamily(f"mstb_sidecar_bucket_{name}", text, labels=["training_job"])
            family.add_metric(job, up.counts[key])
            yield family
        failed = CounterMetricFamily("mstb_sidecar_bucket_failed_requests",
                                     "Requests to the --out bucket that failed and are retried, by reason "
                                     "(unreachable, slow, throttled: 503 SlowDown, server-error: 5xx, credentials, ...)",
                                     labels=["training_job", "reason"])
        for reason, count in up.failures.items():
            failed.add_metric([self.job, reason], count)
        yield failed
        pending = GaugeMetricFamily("mstb_sidecar_bucket_pending_bytes",
                                    "Bytes of the staging directory the bucket does not hold yet", labels=["training_job"])
        pending.add_metric(job, up.pending)
        yield pending
        last = GaugeMetricFamily("mstb_sidecar_bucket_last_upload_timestamp_seconds",
                                 "When the bucket last held everything staged (0: not yet)", labels=["training_job"])
        last.add_metric(job, up.last_success or 0.0)
        yield last
