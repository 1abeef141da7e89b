"""Start-up lines that state the world size ("Run configuration lines at start-up" §1-§3 of the
format reference): each version's text as mindformers prints it, and the lines that look alike
but do not state it."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parsers.assembler import StreamAssembler
from parsers.line import parse_message
from parsers.parallel_lines import parse_parallel_line
from parsers.prefix import Message, PrefixSplitter
from parsers.records import ParallelConfigLine
from parsers.run_config import RunConfig, parse_startup_line

REAL = Path(__file__).parent / "fixtures" / "real" / "mf1.9-dp2" / "output"
_BAR = "  5.2% |██                                                | 0.86313 samples/s/p  2:26:41 }"
_HEAD = ("{ Epoch:[  1/  1], step:[    1/  100], loss: 2.500000, per_step_time: 512ms, lr: 1e-05, "
         "overflow cond: False, loss_scale: 1.0, global_norm: [0.5]")


def _parse(text: str):
    return parse_message(Message(text, level="INFO"))


@pytest.mark.parametrize(
    "text,world",
    [
        # stand-alone / data-parallel, r0.6-r0.8 (base_trainer.py:201 v0.6.0): bs * device_num = gbs
        ("global_batch_size = batch_size_per_card * device_num = 2 * 8 = 16", 8),
        # the same branch from v1.0 (base_trainer.py:232 v1.0.0, :277 master): gbs first
        ("global_batch_size = batch_size_per_card * device_num * gradient_accumulation_steps = 64 = 2 * 16 * 2", 16),
        # semi/auto without full batch, second line, r0.6-v1.3.x (base_trainer.py:209 v1.0.0)
        ("global_batch_size = per_batch_size * device_num = 64 * 16 = 1024", 16),
        # cpu_affinity with CPU_AFFINITY=1, v1.0+ (build_context.py:59 v1.0.0): device_num is the group size
        ("cpu_affinity, rank_id: 3, device_num: 16", 16),
        # checkpoint transform with auto_trans_ckpt (transform_checkpoint.py:164 v1.3.0)
        ("world_size: 16", 16),
    ],
)
def test_lines_that_state_device_num(text: str, world: int) -> None:
    assert _parse(text) == ParallelConfigLine(world)


@pytest.mark.parametrize(
    "text,world",
    [
        # r0.6: no context_parallel key (parallel_config.py:40 v0.6.0)
        ("initial parallel_config from dict: {'data_parallel': 2, 'model_parallel': 4, 'pipeline_stage': 2, "
         "'micro_batch_num': 32, 'vocab_emb_dp': False, 'recompute': False}", 16),
        # v1.3+: dp * mp * cp * pp (expert_parallel is not a factor); a key the yaml leaves out is 1
        ("initial parallel_config from dict: {'data_parallel': 1, 'model_parallel': 2, 'context_parallel': 2, "
         "'expert_parallel': 4, 'pipeline_stage': 4, 'micro_batch_num': 8, 'optimizer_shard': None}", 16),
        ("initial parallel_config from dict: {'model_parallel': 8, 'micro_batch_num': 1}", 8),
    ],
)
def test_parallel_config_dict_gives_a_derived_world_size(text: str, world: int) -> None:
    assert _parse(text) == ParallelConfigLine(world, derived=True)


@pytest.mark.parametrize(
    "text",
    [
        # v1.4+ semi/auto without full batch: data_parallel, not the world size
        "global_batch_size = per_batch_size * data_parallel = 64 * 2 = 128",
        # full batch, pp > 1, v1.0+: no device_num in it
        "Pipeline parallel was opened: pipeline_stages = 2, full batch is True, gradient_accumulation_steps will "
        "not take effect in pipeline parallel, global batch size will be changed: global_batch_size = batch_size "
        "* data_parallel * micro_batch_num * micro_batch_interleave_num = 256 = 1 * 8 * 32 * 1).",
        "The current parallel mode is semi_auto_parallel, full batch is True,so global batch size will be changed: "
        "global_batch_size = batch_size * data_parallel * micro_batch_interleave_num * gradient_accumulation_steps "
        "= 16 = 1 * 16 * 1 * 1",
        # the per-checkpoint CheckpointMonitor line is not the formula
        "global_batch_size: 128",
        # values that are not a count: none is better than a wrong one
        "initial parallel_config from dict: {'data_parallel': 99999999999, 'model_parallel': 1}",
        "initial parallel_config from dict: {'data_parallel': 0, 'model_parallel': 1}",
        "initial parallel_config from dict: {'micro_batch_num': 1}",
        "world_size: many",
    ],
)
def test_lines_that_do_not_state_it(text: str) -> None:
    assert not isinstance(_parse(text), ParallelConfigLine)


@pytest.mark.parametrize(
    "path,lines",
    [
        ("log/rank_0/info.log", (28, 50)),  # file format, v1.9
        ("msrun_log/worker_0.log", (43, 65)),  # stdout format (msrun worker log), v1.9
    ],
)
def test_real_v19_data_parallel_log(path: str, lines: tuple[int, int]) -> None:
    """mindformers 1.9, 2 ranks data parallel: the dict (derived) and the batch line agree on 2."""
    text = (REAL / path).read_text().splitlines()
    splitter = PrefixSplitter()
    parsed = [parse_message(splitter.split(text[n - 1])) for n in lines]
    assert parsed == [ParallelConfigLine(2, derived=True), ParallelConfigLine(2)]


def test_a_config_line_between_head_and_bar_does_not_split_the_record() -> None:
    """A start-up line is for the aggregate only: it must not release a held head early."""
    asm = StreamAssembler()
    out = []
    for line in (_HEAD, "world_size: 16", _BAR):
        out += asm.feed(_parse(line), None, 0, 0.0)
    assert len(out) == 1 and out[0].scalars["throughput"] == 0.86313


def _card_world(text: str) -> int | None:
    """The world size the run configuration (config card, run.json) takes from the line alone."""
    config = RunConfig()
    config.update(parse_startup_line(text) or {})
    return config.facts()["world_size"]


def _aggregate_world(text: str) -> int | None:
    line = parse_parallel_line(text)
    return None if line is None else line.world_size


_SHARED = [  # every batch-formula and parallel_config line above, stating a world size or not
    "global_batch_size = batch_size_per_card * device_num = 2 * 8 = 16",
    "global_batch_size = batch_size_per_card * device_num * gradient_accumulation_steps = 64 = 2 * 16 * 2",
    "global_batch_size = per_batch_size * device_num = 64 * 16 = 1024",
    "global_batch_size = per_batch_size * data_parallel = 64 * 2 = 128",
    "initial parallel_config from dict: {'data_parallel': 2, 'model_parallel': 4, 'pipeline_stage': 2, "
    "'micro_batch_num': 32, 'vocab_emb_dp': False, 'recompute': False}",
    "initial parallel_config from dict: {'model_parallel': 8, 'micro_batch_num': 1}",
    "initial parallel_config from dict: {'data_parallel': 99999999999, 'model_parallel': 1}",
    "initial parallel_config from dict: {'data_parallel': 0, 'model_parallel': 1}",
    "initial parallel_config from dict: {'micro_batch_num': 1}",
    "initial parallel_config from dict: {'data_parallel': True, 'model_parallel': 2}",
]


@pytest.mark.parametrize("text", _SHARED)
def test_the_aggregate_and_the_config_card_read_one_world_size(text: str) -> None:
    """One reader of the batch formula and the parallel_config dict (parsers.parallel_lines): the
    world size the aggregate takes from a line is the one the run configuration shows."""
    assert _aggregate_world(text) == _card_world(text)


_FACTOR = st.one_of(st.integers(-3, 10**8), st.booleans(), st.none(), st.sampled_from(["'x'", "2.0"]))


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["data_parallel", "model_parallel", "context_parallel", "pipeline_stage",
                                        "micro_batch_num", "expert_parallel"]), _FACTOR, max_size=6))
def test_any_parallel_config_dict_gives_both_the_same_world_size(factors: dict[str, object]) -> None:
    text = "initial parallel_config from dict: {" + ", ".join(f"'{k}': {v}" for k, v in factors.items()) + "}"
    assert _aggregate_world(text) == _card_world(text)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["batch_size_per_card", "per_batch_size", "device_num", "data_parallel",
                                 "gradient_accumulation_steps", "micro_batch_num"]), min_size=2, max_size=4),
       st.lists(st.integers(-2, 10**9), min_size=1, max_size=5), st.integers(0, 10**6), st.booleans())
def test_any_batch_formula_gives_both_the_same_world_size(names: list[str], values: list[int], total: int,
                                                          total_first: bool) -> None:
    product = " * ".join(map(str, values))
    sides = [str(total), product] if total_first else [product, str(total)]
    text = "global_batch_size = " + " * ".join(names) + " = " + " = ".join(sides)
    assert _aggregate_world(text) == _card_world(text)
