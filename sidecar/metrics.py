"""Optional Prometheus endpoint (``--metrics-port``): the sidecar's own health, read on scrape.

Values are collected from the engine when Prometheus asks, so the hot path pays nothing. The
endpoint binds to 127.0.0.1 unless ``--metrics-host`` says otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from sidecar.engine import Engine


class EngineCollector(Collector):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        engine = self.engine
        sources = list(engine.sources.values())
        yield CounterMetricFamily("mstb_sidecar_bytes_read", "Log bytes read", value=engine.bytes_read)
        yield CounterMetricFamily("mstb_sidecar_lines_read", "Log lines read", value=sum(s.lines for s in sources))
        yield CounterMetricFamily(
            "mstb_sidecar_bad_lines", "Lines skipped as malformed or too long",
            value=sum(s.malformed + s.tail.long_lines for s in sources),
        )
        yield GaugeMetricFamily("mstb_sidecar_files", "Files followed", value=len(sources))
        yield GaugeMetricFamily(
            "mstb_sidecar_lag_bytes", "Bytes written to logs but not read yet",
            value=sum(max(s.tail.size - s.tail.offset, 0) for s in sources),
        )
        points = CounterMetricFamily("mstb_sidecar_points_written", "Values written to event files", labels=["rank"])
        last = GaugeMetricFamily("mstb_sidecar_last_step", "Latest global step written", labels=["rank"])
        for rank_id, rank in sorted(engine.ranks.items()):
            points.add_metric([str(rank_id)], rank.writer.points_written)
            if rank.stats.last_step is not None:
                last.add_metric([str(rank_id)], rank.stats.last_step)
        yield points
        yield last
        alerts = CounterMetricFamily("mstb_sidecar_alerts", "Alerts raised", labels=["rank", "kind"])
        for (rank_id, kind), count in sorted(engine.alerts.counts.items()):
            alerts.add_metric([str(rank_id), kind], count)
        yield alerts


def serve(engine: Engine, host: str, port: int) -> None:
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    start_http_server(port, addr=host, registry=registry)
