"""What a run was: the configuration mindformers prints at start-up, as a typed description.

Why: months later a curve is only useful with the settings that made it, and comparing runs in
TensorBoard's HParams tab needs them as data. mindformers prints them without being asked
(format reference, "Run configuration lines at start-up" §1-§8), differently per version:

- every version: ``initial parallel_config from dict: {...}`` (and the recompute, moe and swap
  dicts), the ``global_batch_size = <factors> = ...`` formula (``device_num`` / ``data_parallel``,
  ``micro_batch_num``, ``gradient_accumulation_steps``; v1.0+ prints the total first, up to r0.8
  last), ``Now Running Task is: T, Model is: M``, ``Network Parameters: N M.``;
- ``The current parallel mode is P, ...`` (non-pipeline branches), ``Pipeline parallel was opened:
  pipeline_stages = P, ...``, ``pipeline_stage = P > 1, vocab_emb_dp ...``;
- v1.0+: ``set output path to '...'``, ``host_name: H, host_ip: I``; v1.6+ lr lines
  (``Current warmup_ratio is ...``, ``warmup_lr_init is not set. The default value V ...``),
  r1.8+ ``Get warmup_steps(W) = int(...)``; v1.2-v1.6 ``The current MindSpore version is V,...``;
- every version, stdout only (``worker_N.log``) and only on ranks ``% 8 == 0``: ``pprint(config)``,
  the whole configuration after mindformers' defaults as a multi-line Python literal. It is
  collected with a bounded accumulator (:data:`MAX_DUMP_BYTES`), object reprs such as
  ``<...MoEConfig object at 0x7f...>`` are made strings (without the address, which differs per
  run), and it is read with :func:`ast.literal_eval` node by node (:mod:`parsers.literal`): a value
  that is not a literal (``CosineWithWarmUpLR()``, ``Parameter (name=...)``) becomes its source
  text. Nothing is executed.
- mindformers itself never logs the graph/PyNative mode: it is ``context.mode`` of the dump only.
  (A ``Running MindFormers in GRAPH_MODE`` line is a launcher's own, printed before its config
  overrides: the genuine PyNative run of ``tests/fixtures/real`` prints it too, so it is not read.)

:class:`StartupCollector` (one per stream) turns messages into field updates; :class:`RunConfig`
(one per rank) holds them. The batch formula and the parallel_config dict's world size are read by
:mod:`parsers.parallel_lines`, the one reader of them. :func:`settings` flattens a description
into the values TensorBoard's HParams tab and the config card show
(:mod:`sidecar.output.config_card`), and :func:`config_hash` hashes them without the run-specific ones (paths,
host, rank, device id), so two runs of one configuration share a hash. Without the dump (an
``info.log`` alone) the settings are the start-up lines only, which leave out most of the
configuration (the learning rate, the optimizer, the model's sizes): two runs that differ there
share a hash, so such a hash says it is partial (:data:`PARTIAL`, and the card says what it
covers) rather than claim an equality it cannot know. Pure: no I/O, no clocks.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field, fields

from parsers.literal import read_literal
from parsers.parallel_lines import batch_formula, world_of_dict, world_of_factors
from parsers.prefix import Message
from parsers.values import INT64_MAX

MAX_DUMP_BYTES = 4 << 20  # a pprint dump larger than this is dropped (counted), not parsed
DUMP_DROPPED = "dump_dropped"  # an update that says a dump was seen but not read
PARTIAL = "partial-"  # the prefix of a hash over the start-up lines only (no dump was read)

Value = str | int | float | bool | None


@dataclass
class RunConfig:
    """One rank's run description. ``None``: the log did not say."""

    task: str | None = None
    model: str | None = None
    mode: str | None = None
    parallel_mode: str | None = None
    output_path: str | None = None
    host: str | None = None
    mindspore_version: str | None = None
    global_batch_size: int | None = None
    batch_factors: dict[str, int] = field(default_factory=dict)  # the formula's names -> values
    world_size: int | None = None
    pipeline_stages: int | None = None
    micro_batch_num: int | None = None
    num_layers_per_stage: list | None = None
    network_parameters_m: float | None = None
    epochs: int | None = None
    sink_size: int | None = None
    dataset_size: int | None = None
    lr_schedule: dict[str, float] = field(default_factory=dict)  # from the lr lines
    parallel_config: dict | None = None
    recompute_config: dict | None = None
    moe_config: dict | None = None
    swap_config: dict | None = None
    dump: dict | None = None  # the pprint config dump, sanitised

    def update(self, updates: dict[str, object]) -> bool:
        """Apply field updates (other names are ignored); returns whether anything changed."""
        changed = False
        for name, value in updates.items():
            if name not in _FIELD_NAMES:
                continue
            if isinstance(value, dict) and name in _MERGED:
                value = {**getattr(self, name), **value}
            if getattr(self, name) != value:
                setattr(self, name, value)
                changed = True
        return changed

    def facts(self) -> dict[str, object]:
        """The parsed start-up facts (everything but the raw dicts), with derived values filled in."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _RAW}
        dump = self.dump or {}
        context = dump.get("context") if isinstance(dump.get("context"), dict) else {}
        if isinstance(context.get("mode"), int) and context["mode"] in _MODES:
            out["mode"] = _MODES[context["mode"]]
        parallel = self.parallel_config or {}
        if out["pipeline_stages"] is None and isinstance(parallel.get("pipeline_stage"), int):
            out["pipeline_stages"] = parallel["pipeline_stage"]
        if out["micro_batch_num"] is None:
            mbn = self.batch_factors.get("micro_batch_num", parallel.get("micro_batch_num"))
            out["micro_batch_num"] = mbn if isinstance(mbn, int) else None
        if out["world_size"] is None:
            out["world_size"] = _world_size(self.batch_factors, dump, parallel)
        if out["global_batch_size"] is None:
            runner = dump.get("runner_config") if isinstance(dump.get("runner_config"), dict) else {}
            out["global_batch_size"] = runner.get("global_batch_size")
        for name in ("global_batch_size", "world_size"):  # steps and rates are computed with them
            out[name] = _count(out[name])
        return out


_FIELD_NAMES = frozenset(f.name for f in fields(RunConfig))
_MERGED = ("batch_factors", "lr_schedule")  # several lines add to these
_RAW = ("parallel_config", "recompute_config", "moe_config", "swap_config", "dump")
_MODES = {0: "GRAPH_MODE", 1: "PYNATIVE_MODE"}


def _count(value: object) -> int | None:
    """A count the log states (a batch size, a number of devices): a positive integer that fits
    int64, since steps are computed with it (``step x GBS``); anything else (``0``, ``-4``, a
    400-digit number in a dump) is not one."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= INT64_MAX else None


def _world_size(factors: dict[str, int], dump: dict, parallel: dict) -> int | None:
    """The batch formula's device_num, else the dump's, else dp*mp*cp*pp of the parallel_config
    dict: the lines read as :mod:`parsers.parallel_lines` reads them for the aggregate."""
    if "device_num" in factors:
        return world_of_factors(factors)
    if isinstance(dump.get("device_num"), int):
        return dump["device_num"]
    return world_of_dict(parallel)


# -- start-up lines ------------------------------------------------------------------------------

_GBS = "global_batch_size = "
_DICTS = {f"initial {name} from dict: ": name for name in ("parallel_config", "recompute_config", "moe_config", "swap_config")}
PREFIXES = (  # every start-up line starts with one of these (parsers.fast_path must not skip them)
    *_DICTS,
    _GBS,
    "The current parallel mode is ",
    "Pipeline parallel was opened: ",
    "pipeline_stage = ",
    "Now Running Task is: ",
    "set output path to ",
    "host_name: ",
    "Network Parameters: ",
    "Will be Training epochs:",
    "Create train",
    "Current ",
    "Get warmup_steps(",
    "warmup_lr_init is not set.",
    "The current MindSpore version is ",
    "num_layers per stage: ",
)
_INT = r"-?\d{1,12}"
_NUM = r"-?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|inf|nan)"
_PATTERNS: list[tuple[re.Pattern[str], tuple[str, ...]]] = [
    (re.compile(r"Now Running Task is: (\S+), Model is: (\S+)"), ("task", "model")),
    (re.compile(r"set output path to '([^']*)'"), ("output_path",)),
    (re.compile(r"host_name: ([^,\s]+)"), ("host",)),
    (re.compile(rf"Network Parameters: ({_NUM}) M\."), ("network_parameters_m",)),
    (re.compile(rf"Will be Training epochs:\s*({_INT}), sink_size:\s*({_INT})"), ("epochs", "sink_size")),
    (re.compile(rf"Create train(?:ing)? dataset finish, dataset size:\s*({_INT})"), ("dataset_size",)),
    (re.compile(r"The current MindSpore version is ([\w.\-+]+)"), ("mindspore_version",)),
    (re.compile(rf"(?:Pipeline parallel was opened: pipeline_stages|pipeline_stage) = ({_INT})"), ("pipeline_stages",)),
    (re.compile(r"The current parallel mode is (\w+)"), ("parallel_mode",)),
]
_LR_PHASE = re.compile(rf"Current (\w+)_ratio is ({_NUM}), total_steps is ({_INT}), \w+_steps will be set to ({_INT})")
_LR_EPOCHS = re.compile(rf"Get warmup_steps\(({_INT})\) = int\(warmup_epochs\(({_NUM})\)")
_LR_INIT = re.compile(rf"warmup_lr_init is not set\. The default value ({_NUM}) ")


def parse_startup_line(text: str) -> dict[str, object] | None:
    """The run facts one start-up message states, or ``None`` for any other message."""
    if not text.startswith(PREFIXES):
        return None
    out: dict[str, object] = {}
    for prefix, name in _DICTS.items():
        if text.startswith(prefix):
            literal = read_literal(text[len(prefix):].strip())
            return {name: literal} if isinstance(literal, dict) else None
    if text.startswith("num_layers per stage: "):
        layers = read_literal(text[len("num_layers per stage: "):].strip())
        return {"num_layers_per_stage": layers} if isinstance(layers, list) else None
    for pattern, names in _PATTERNS:
        m = pattern.search(text)
        if m:
            out.update({n: _typed(n, v) for n, v in zip(names, m.groups())})
    at = text.find(_GBS)
    if at >= 0:
        out.update(batch_formula(text[at + len(_GBS):]))
    lr = _lr_line(text)
    if lr:
        out["lr_schedule"] = lr
    return out or None


def _typed(name: str, raw: str) -> object:
    if name in ("epochs", "sink_size", "dataset_size", "pipeline_stages"):
        return int(raw)
    if name == "network_parameters_m":
        return float(raw)
    return raw


def _lr_line(text: str) -> dict[str, float]:
    m = _LR_PHASE.match(text)
    if m:
        phase = m.group(1)
        return {f"{phase}_ratio": float(m.group(2)), "total_steps": int(m.group(3)), f"{phase}_steps": int(m.group(4))}
    m = _LR_EPOCHS.match(text)
    if m:
        return {"warmup_steps": int(m.group(1)), "warmup_epochs": float(m.group(2))}
    m = _LR_INIT.match(text)
    if m:
        return {"warmup_lr_init": float(m.group(1))}
    return {}


class StartupCollector:
    """One stream's start-up facts, as updates for the rank's :class:`RunConfig`.

    Cheap on the hot path: a prefixed message is looked at only when it starts with one of the
    start-up prefixes, and an unprefixed one only when it opens (``{'``) or continues (a leading
    space) a pprint dump. A dump ends at the first line that does not continue it, or as soon as
    its brackets balance and it parses.
    """

    __slots__ = ("updates", "dumps_dropped", "_dump", "_size", "_depth")

    def __init__(self) -> None:
        self.updates: dict[str, object] = {}
        self.dumps_dropped = 0  # too large or not a literal
        self._dump: list[str] | None = None
        self._size = 0
        self._depth = 0

    def feed(self, message: Message) -> None:
        text = message.text
        if self._dump is not None:
            if message.level is None and not message.foreign and text[:1] == " ":
                self._grow(text)
                return
            self._finish(final=True)
        if message.foreign:
            return
        if message.level is None:
            if text.startswith("{'"):
                self._dump, self._size, self._depth = [], 0, 0
                self._grow(text)
            return
        found = parse_startup_line(text)
        if found:
            for name, value in found.items():
                merged = self.updates.get(name)
                self.updates[name] = {**merged, **value} if name in _MERGED and isinstance(merged, dict) else value

    @property
    def collecting(self) -> bool:
        """Is a dump open (its lines read, not parsed yet)?"""
        return self._dump is not None

    def flush(self) -> None:
        """End of input: a dump still open is parsed as it is."""
        if self._dump is not None:
            self._finish(final=True)

    def take(self) -> dict[str, object]:
        updates, self.updates = self.updates, {}
        return updates

    def _grow(self, line: str) -> None:
        assert self._dump is not None
        self._size += len(line) + 1
        if self._size > MAX_DUMP_BYTES:
            self._dump = None
            self._dropped()
            return
        self._dump.append(line)
        self._depth += sum(line.count(c) for c in "{[(") - sum(line.count(c) for c in "}])")
        if self._depth <= 0:
            self._finish(final=False)

    def _finish(self, final: bool) -> None:
        assert self._dump is not None
        value = read_literal("\n".join(self._dump))
        if isinstance(value, dict):
            self.updates["dump"] = value
        elif not final:
            return  # the counts were fooled by a bracket inside a string: wait for the end
        else:
            self._dropped()
        self._dump = None

    def _dropped(self) -> None:
        self.dumps_dropped += 1
        self.updates[DUMP_DROPPED] = True


# -- settings, hash --------------------------------------------------------------------

# Keys (last component) whose values differ between runs of one configuration.
_RUN_SPECIFIC = re.compile(
    r"(?:^|_)(?:path|paths|dir|file|url|host|ip|prefix)(?:$|_)|^(?:rank_id|local_rank|device_id|host_name|"
    r"load_checkpoint|src_strategy_path_or_dir|strategy_ckpt_save_file|checkpoint_name_or_path|output_path)$"
)


def settings(config: RunConfig) -> dict[str, Value]:
    """Every setting as ``dotted.key -> str | int | float | bool | None``: the start-up facts under
    ``run.``, then the configuration as mindformers holds it (the pprint dump, with the
    parallel/recompute/moe/swap dicts of the start-up lines where the dump has only an object)."""
    out: dict[str, Value] = {}
    for name, value in config.facts().items():
        _flatten(f"run.{name}", value, out)
    tree = dict(config.dump or {})
    for name in ("parallel_config", "recompute_config", "moe_config", "swap_config"):
        given = getattr(config, name)
        if given is not None and not isinstance(tree.get(name), dict):
            tree[name] = given
    for key, value in tree.items():
        _flatten(key, value, out)
    return out


def _flatten(key: str, value: object, out: dict[str, Value]) -> None:
    if isinstance(value, dict):  # an empty one says nothing
        for k, v in value.items():
            _flatten(f"{key}.{k}", v, out)
    elif isinstance(value, (str, int, float, bool)) or value is None:
        out[key] = value
    else:
        out[key] = json.dumps(value, default=str, ensure_ascii=False)


def is_run_specific(key: str) -> bool:
    return bool(_RUN_SPECIFIC.search(key.rsplit(".", 1)[-1]))


def config_hash(values: dict[str, Value], partial: bool = False) -> str:
    """12 hex digits of SHA-256 over the settings that are not run-specific (:func:`is_run_specific`);
    ``partial`` (the settings come from the start-up lines only): prefixed with :data:`PARTIAL`."""
    kept = {k: v for k, v in values.items() if not is_run_specific(k)}
    canonical = json.dumps(kept, sort_keys=True, default=str, ensure_ascii=False, allow_nan=True)
    digest = hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:12]
    return PARTIAL + digest if partial else digest
