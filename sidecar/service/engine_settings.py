"""The engine's settings from the validated configuration, one mapping for ``replay`` and the
live daemon, so the two read the same options the same way.

They differ only where ``live`` says: a replay waits for every rank at the aggregate (its
timeout is infinite: the whole input is there), the live daemon writes a step without a rank
that has not reported it ``aggregate_timeout`` seconds after its first report.
"""

from __future__ import annotations

from collections.abc import Sequence

from sidecar.engine import Settings
from sidecar.output.sink import Sink
from sidecar.service.alert_command import AlertCommand
from sidecar.service.config import SidecarConfig


def settings_from(config: SidecarConfig, live: bool, on_alert: AlertCommand | None = None,
                  sinks: Sequence[Sink] = ()) -> Settings:
    """The engine's settings; ``sinks``: outputs besides TensorBoard (:mod:`sidecar.output.sink`)."""
    return Settings(
        out=config.out,
        roots=config.paths,
        default_rank=config.rank,
        instance=config.instance,
        from_end=config.from_end,
        max_line=config.max_line_bytes,
        companion_wait=config.companion_wait,
        rank_pattern=config.rank_pattern,
        aggregate=config.aggregate,
        aggregate_timeout=config.aggregate_timeout if live else float("inf"),
        loss_ranks=set(config.loss_ranks) if config.loss_ranks is not None else None,
        alerts=config.alerts,
        alert_sinks=[on_alert] if on_alert is not None else [],
        live=live,
        run_name=config.run_name,
        label=config.label,
        job=config.job,
        every=config.every,
        metrics=config.metrics,
        max_file_bytes=int(config.max_event_file_mb * (1 << 20)) if config.max_event_file_mb else None,
        sinks=[*sinks, *_configured(config)],
    )


def _configured(config: SidecarConfig) -> list[Sink]:
    """The outputs the options ask for (``--mlflow``), beside those a program embedding the CLI gives."""
    if config.mlflow is None:
        return []
    from sidecar.output.mlflow_sink import MLflowSink

    experiment = config.job or config.bucket or str(config.out.resolve())  # as the metrics' training_job
    return [MLflowSink(config.mlflow, config.out, config.instance, experiment, config.drain_timeout)]


def alert_command(config: SidecarConfig) -> AlertCommand | None:
    """The ``--on-alert`` command, if one is configured."""
    return AlertCommand(config.on_alert, config.on_alert_timeout) if config.on_alert else None
