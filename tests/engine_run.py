"""Runs the engine in this process, as a replay does, for unit tests of the parts it holds
together (no CLI, no worker processes)."""

from __future__ import annotations

from sidecar.analysis.accounting import Accounting
from sidecar.engine import Engine
from sidecar.service.config import SidecarConfig
from sidecar.service.engine_settings import settings_from


def replay_in_process(config: SidecarConfig) -> Accounting:
    """Read everything ``config`` names once, checkpoint and close: what was written or counted."""
    engine = Engine(settings_from(config, live=False))
    try:
        engine.scan()
        while engine.pump(1 << 20, 0.0):
            pass
        engine.end_of_input()
        engine.checkpoint()
        return engine.accounting
    finally:
        engine.close()
