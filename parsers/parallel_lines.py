"""Start-up run-configuration lines that state the job's world size (format reference, "Run
configuration lines at start-up" §1-§3).

Why: under pipeline parallelism only the last stage's loss is valid, and the last stage is
ranks ``>= world - world/P``. A sidecar on one node of a multi-node job sees only its node's
ranks, so the world size must come from the log. mindformers never prints it as such; it is

- ``device_num`` in the batch-size lines (``global_batch_size = batch_size_per_card * device_num
  ...``, stand-alone/data-parallel, every version; ``per_batch_size * device_num``, semi/auto
  without full batch up to v1.3), in ``cpu_affinity, rank_id: R, device_num: N`` (v1.0+, with
  ``CPU_AFFINITY``) and ``world_size: N`` (checkpoint transform);
- or ``dp * mp * cp * pp`` from ``initial parallel_config from dict: {...}`` (every version): exact
  under semi_auto_parallel, where v1.0+ refuses to start otherwise, but the dict is the yaml's,
  which data-parallel mode resets. So that value is marked ``derived`` and a stated device_num
  wins over it (the caller's rule, :class:`parsers.records.ParallelConfigLine`).

The pipeline stage count is not taken from here: the per-step ``pipeline stages: P > 1`` warning
(:class:`~parsers.records.PipelineLine`) states what the run really uses.

Cheap: every such line starts with one of :data:`PREFIXES`, checked with one ``startswith``
before anything else. Numbers are bounded to 7 digits: a value that does not fit is no value.
"""

from __future__ import annotations

import re

from parsers.records import ParallelConfigLine

_DICT = "initial parallel_config from dict: "
_BATCH = "global_batch_size = "
_AFFINITY = "cpu_affinity, rank_id: "
_WORLD = "world_size: "
PREFIXES = (_DICT, _BATCH, _AFFINITY, _WORLD)

_COUNT = re.compile(r"\d{1,7}")
_DICT_FACTOR = re.compile(r"'(data_parallel|model_parallel|context_parallel|pipeline_stage)': ([^,}]*)")


def parse_parallel_line(text: str) -> ParallelConfigLine | None:
    """The world size a start-up line states, or ``None`` when it states none."""
    if text.startswith(_BATCH):
        world = _device_num(text[len(_BATCH):])
    elif text.startswith(_DICT):
        return _from_dict(text[len(_DICT):])
    elif text.startswith(_AFFINITY):
        world = _count(text.partition(", device_num: ")[2])
    elif text.startswith(_WORLD):
        world = _count(text[len(_WORLD):])
    else:
        return None
    return None if world is None else ParallelConfigLine(world)


def _device_num(formula: str) -> int | None:
    """``device_num`` in ``a * device_num * c = g = 2 * 8 * 1`` (v1.0+) or ``a * device_num = 2 * 8 = g``
    (up to r0.8): the factor list of the same length as the names, at the same place."""
    names, *sides = formula.split(" = ")
    factors = names.split(" * ")
    if "device_num" not in factors:
        return None  # v1.4+ prints ``per_batch_size * data_parallel``: not the world size
    at = factors.index("device_num")
    for side in sides:
        values = side.strip().rstrip(").").split(" * ")
        if len(values) == len(factors):
            return _count(values[at])
    return None


def _from_dict(literal: str) -> ParallelConfigLine | None:
    """``dp * mp * cp * pp`` (a key the yaml leaves out is 1); ``None`` if a present one is not a count."""
    found = _DICT_FACTOR.findall(literal)
    if not found:
        return None
    world = 1
    for _, raw in found:
        count = _count(raw)
        if count is None:
            return None
        world *= count
    return ParallelConfigLine(world, derived=True)


def _count(raw: str) -> int | None:
    raw = raw.strip()
    if not _COUNT.fullmatch(raw):
        return None
    value = int(raw)
    return value if value > 0 else None
