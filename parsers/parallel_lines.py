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

The batch formula and the parallel_config dict are read here for the run configuration too
(:mod:`parsers.run_config`: the global batch size, its factors and the world size of the config
card): one reader, so the world size the aggregate takes and the one the card shows cannot differ
(``tests/test_parsers_parallel_lines.py``).

Cheap: every such line starts with one of :data:`PREFIXES`, checked with one ``startswith``
before anything else. World sizes are bounded to 7 digits: a value that does not fit is no value.
"""

from __future__ import annotations

import re

from parsers.literal import read_literal
from parsers.records import ParallelConfigLine

_DICT = "initial parallel_config from dict: "
_BATCH = "global_batch_size = "
_AFFINITY = "cpu_affinity, rank_id: "
_WORLD = "world_size: "
PREFIXES = (_DICT, _BATCH, _AFFINITY, _WORLD)

_COUNT = re.compile(r"\d{1,7}")
_DICT_FACTORS = ("data_parallel", "model_parallel", "context_parallel", "pipeline_stage")
_INT = r"-?\d{1,12}"
_FACTOR_NAMES = re.compile(r"[a-z_]+(?: \* [a-z_]+)+")
_FACTOR_VALUES = re.compile(rf"{_INT}(?: \* {_INT})+")


def parse_parallel_line(text: str) -> ParallelConfigLine | None:
    """The world size a start-up line states, or ``None`` when it states none."""
    if text.startswith(_BATCH):
        factors = batch_formula(text[len(_BATCH):]).get("batch_factors")
        world = world_of_factors(factors) if isinstance(factors, dict) else None
    elif text.startswith(_DICT):
        literal = read_literal(text[len(_DICT):].strip())
        world = world_of_dict(literal) if isinstance(literal, dict) else None
        return None if world is None else ParallelConfigLine(world, derived=True)
    elif text.startswith(_AFFINITY):
        world = _count(text.partition(", device_num: ")[2])
    elif text.startswith(_WORLD):
        world = _count(text[len(_WORLD):])
    else:
        return None
    return None if world is None else ParallelConfigLine(world)


def batch_formula(formula: str) -> dict[str, object]:
    """``a * b * c = G = 2 * 8 * 1`` (v1.0+) or ``a * b = 2 * 8 = G`` (up to r0.8), after
    ``global_batch_size = ``: the total (``global_batch_size``) and each factor by name
    (``batch_factors``: the value list of the same length as the names, at the same place)."""
    names_m = _FACTOR_NAMES.match(formula)
    if not names_m:
        return {}
    names = names_m.group(0).split(" * ")
    out: dict[str, object] = {}
    for side in formula[names_m.end():].split(" = ")[1:]:
        side = side.strip().rstrip(").").strip()
        if re.fullmatch(_INT, side):
            out["global_batch_size"] = int(side)
        elif _FACTOR_VALUES.fullmatch(side):
            values = side.split(" * ")
            if len(values) == len(names):
                out["batch_factors"] = {n: int(v) for n, v in zip(names, values)}
    return out


def world_of_factors(factors: dict[str, int]) -> int | None:
    """``device_num`` of the batch formula's factors (v1.4+ prints ``data_parallel`` instead: not
    the world size, ``None``)."""
    return _bounded(factors.get("device_num"))


def world_of_dict(parallel: dict) -> int | None:
    """``dp * mp * cp * pp`` of a parallel_config dict (a key the yaml leaves out is 1); ``None``
    if it has none of them, or a present one is not a count."""
    if not any(key in parallel for key in _DICT_FACTORS):
        return None
    world = 1
    for key in _DICT_FACTORS:
        count = _bounded(parallel.get(key, 1))
        if count is None:
            return None
        world *= count
    return world


def _bounded(value: object) -> int | None:
    return value if type(value) is int and 0 < value < 10_000_000 else None


def _count(raw: str) -> int | None:
    raw = raw.strip()
    if not _COUNT.fullmatch(raw):
        return None
    value = int(raw)
    return value if value > 0 else None
