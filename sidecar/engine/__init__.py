"""The pipeline, shared by ``replay`` and the live daemon: :mod:`sidecar.engine.hub` says how it
works; the names the rest of the code uses are these."""

from sidecar.engine.delivery import Rank, RankStats
from sidecar.engine.hub import Engine
from sidecar.engine.progress import AggregateProgress, Progress, RankProgress
from sidecar.engine.settings import LEAD, CrossRank, ForeignRank, Settings
from sidecar.engine.sources import Source

__all__ = ["LEAD", "AggregateProgress", "CrossRank", "Engine", "ForeignRank", "Progress", "Rank", "RankProgress",
           "RankStats", "Settings", "Source"]
