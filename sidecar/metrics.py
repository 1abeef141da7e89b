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
        yield CounterMetricFamily("mstb_sidecar_lines_read", "Log lines read", value=engine.lines_read)
        written = CounterMetricFamily("mstb_sidecar_records_written", "Step records written", labels=["rank"])
        for rank_id, count in sorted(engine.accounting.written.items()):
            written.add_metric([str(rank_id)], count)
        yield written
        dropped = CounterMetricFamily(
            "mstb_sidecar_records_not_written",
            "Records or lines read but not written, by reason (duplicate, superseded, malformed, too-long, unreadable)",
            labels=["rank", "reason"],
        )
        for (rank_id, reason), count in sorted(engine.accounting.dropped.items()):
            dropped.add_metric([str(rank_id), reason.value], count)
        yield dropped
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
        if engine.aggregator is not None:
            yield GaugeMetricFamily("mstb_sidecar_aggregate_pending_steps",
                                    "Steps the cross-rank aggregate waits for a rank to report",
                                    value=engine.aggregator.pending_steps())
            yield CounterMetricFamily("mstb_sidecar_aggregate_incomplete_steps",
                                      "Aggregate steps written without every rank (a rank late past "
                                      "--aggregate-timeout, or a replay whose input ended first)",
                                      value=engine.aggregator.incomplete_steps)
        alerts = CounterMetricFamily("mstb_sidecar_alerts", "Alerts raised", labels=["rank", "kind"])
        for (rank_id, kind), count in sorted(engine.alerts.counts.items()):
            alerts.add_metric([str(rank_id), kind], count)
        yield alerts


def serve(engine: Engine, host: str, port: int) -> EngineCollector:
    """Start the endpoint; the daemon points the returned collector at a new engine if it starts over."""
    collector = EngineCollector(engine)
    registry = CollectorRegistry()
    registry.register(collector)
    start_http_server(port, addr=host, registry=registry)
    return collector
