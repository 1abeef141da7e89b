"""Start-up configuration lines of each mindformers version (format reference, "Run configuration
lines at start-up" §1-§7) into a run description; the pprint dump; the configuration hash."""

from __future__ import annotations

import pytest

from parsers.literal import read_literal
from parsers.prefix import PrefixSplitter
from parsers.run_config import (
    MAX_DUMP_BYTES,
    RunConfig,
    StartupCollector,
    config_hash,
    parse_startup_line,
    settings,
)
from sidecar.output.config_card import hparams


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        # r0.6-r0.8 stand-alone / data parallel: total last, device_num from RANK_SIZE
        ("global_batch_size = batch_size_per_card * device_num = 2 * 8 = 16",
         {"global_batch_size": 16, "batch_factors": {"batch_size_per_card": 2, "device_num": 8}}),
        # v1.0+ stand-alone / data parallel: total first
        ("global_batch_size = batch_size_per_card * device_num * gradient_accumulation_steps = 4 = 2 * 2 * 1",
         {"global_batch_size": 4,
          "batch_factors": {"batch_size_per_card": 2, "device_num": 2, "gradient_accumulation_steps": 1}}),
        # r0.6-r0.8 semi-auto, full batch, pipeline
        ("Pipeline parallel was opened: pipeline_stages = 4, full batch is True, global batch size will be changed: "
         "global_batch_size = batch_size * data_parallel * micro_batch_num * micro_batch_interleave_num = 1 * 2 * 32 * 1 = 64).",
         {"pipeline_stages": 4, "global_batch_size": 64,
          "batch_factors": {"batch_size": 1, "data_parallel": 2, "micro_batch_num": 32, "micro_batch_interleave_num": 1}}),
        # v1.0+ the same branch: total first
        ("Pipeline parallel was opened: pipeline_stages = 2, full batch is True, gradient_accumulation_steps will not take "
         "effect in pipeline parallel, global batch size will be changed: global_batch_size = batch_size * data_parallel "
         "* micro_batch_num * micro_batch_interleave_num = 128 = 2 * 4 * 16 * 1).",
         {"pipeline_stages": 2, "global_batch_size": 128,
          "batch_factors": {"batch_size": 2, "data_parallel": 4, "micro_batch_num": 16, "micro_batch_interleave_num": 1}}),
        # v1.0+ semi-auto, full batch, no pipeline
        ("The current parallel mode is semi_auto_parallel, full batch is True,so global batch size will be changed: "
         "global_batch_size = batch_size * data_parallel * micro_batch_interleave_num * gradient_accumulation_steps = 16 = 2 * 8 * 1 * 1",
         {"parallel_mode": "semi_auto_parallel", "global_batch_size": 16,
          "batch_factors": {"batch_size": 2, "data_parallel": 8, "micro_batch_interleave_num": 1, "gradient_accumulation_steps": 1}}),
        # v1.4+ second line of the not-full-batch branches
        ("global_batch_size = per_batch_size * data_parallel = 4 * 2 = 8",
         {"global_batch_size": 8, "batch_factors": {"per_batch_size": 4, "data_parallel": 2}}),
        ("The current parallel mode is data_parallel, batch size per card will not be changed: batch_size_per_card = 2",
         {"parallel_mode": "data_parallel"}),
        ("pipeline_stage = 4 > 1, vocab_emd_dp will be reset to False.", {"pipeline_stages": 4}),  # r0.6-v1.7
        ("pipeline_stage = 2 > 1, vocab_emb_dp will be reset to False.", {"pipeline_stages": 2}),  # r1.8+
        ("Now Running Task is: text_generation, Model is: llama2_7b", {"task": "text_generation", "model": "llama2_7b"}),
        ("set output path to '/job/output'", {"output_path": "/job/output"}),
        ("host_name: node7, host_ip: 10.0.0.7", {"host": "node7"}),
        ("Network Parameters: 6738 M.", {"network_parameters_m": 6738.0}),
        ("Will be Training epochs:2, sink_size:-1", {"epochs": 2, "sink_size": -1}),
        ("Create train dataset finish, dataset size:100", {"dataset_size": 100}),
        ("The current MindSpore version is 2.2.14,and set the default runtime_num_threads to 1.",  # v1.2-v1.6
         {"mindspore_version": "2.2.14"}),
        # lr: v1.6+ _get_lr_steps, r1.8+ warmup epochs, v1.6+ warmup_lr_init
        ("Current warmup_ratio is 0.1, total_steps is 200, warmup_steps will be set to 20",
         {"lr_schedule": {"warmup_ratio": 0.1, "total_steps": 200, "warmup_steps": 20}}),
        ("Get warmup_steps(300) = int(warmup_epochs(3) * train_data_size(100))",
         {"lr_schedule": {"warmup_steps": 300, "warmup_epochs": 3.0}}),
        ("warmup_lr_init is not set. The default value 0.0 will be applied.", {"lr_schedule": {"warmup_lr_init": 0.0}}),
        ("num_layers per stage: [[2, 2], [2, 2]]", {"num_layers_per_stage": [[2, 2], [2, 2]]}),
        ("initial parallel_config from dict: {'data_parallel': 8, 'model_parallel': 4, 'pipeline_stage': 4, "
         "'micro_batch_num': 32, 'vocab_emb_dp': True, 'optimizer_shard': None}",
         {"parallel_config": {"data_parallel": 8, "model_parallel": 4, "pipeline_stage": 4, "micro_batch_num": 32,
                              "vocab_emb_dp": True, "optimizer_shard": None}}),
        ("Training epoch 3", None),
        ("global_batch_size = batch_size_per_card * device_num = 2 * x = 16", {"global_batch_size": 16}),
    ],
)
def test_startup_lines_of_each_version(line: str, expected: dict | None) -> None:
    assert parse_startup_line(line) == expected


def test_description_fills_world_size_pipeline_and_micro_batches_from_the_parallel_dict() -> None:
    config = RunConfig()
    config.update(parse_startup_line(
        "initial parallel_config from dict: {'data_parallel': 2, 'model_parallel': 4, 'pipeline_stage': 2, 'micro_batch_num': 8}"))
    facts = config.facts()
    assert (facts["world_size"], facts["pipeline_stages"], facts["micro_batch_num"]) == (16, 2, 8)
    config.update(parse_startup_line("global_batch_size = batch_size_per_card * device_num = 2 * 32 = 64"))
    assert config.facts()["world_size"] == 32  # a stated device_num wins over dp*mp*cp*pp


PPRINT = """\
{'context': {'device_id': 3, 'mode': 1},
 'lr_schedule': {'learning_rate': 0.001,
                 'type': 'CosineWithWarmUpLR'},
 'moe_config': <mindformers.modules.transformer.moe.MoEConfig object at 0x7fbbecccb6d0>,
 'optimizer': {'learning_rate': CosineWithWarmUpLR(),
               'params': [Parameter (name=model.layers.0.wq.weight, shape=(64, 64), dtype=Float32, requires_grad=True)],
               'pattern': '.*\\\\.norm[(]'},
 'rank_id': 3,
 'seed': 0}"""


def _collect(lines: list[str]) -> tuple[StartupCollector, RunConfig]:
    splitter, collector, config = PrefixSplitter(), StartupCollector(), RunConfig()
    for line in lines:
        collector.feed(splitter.split(line))
    collector.flush()
    config.update(collector.take())
    return collector, config


def test_pprint_dump_between_stdout_lines() -> None:
    stamp = "2026-11-29 15:53:07,881 - mindformers[mindformers/trainer/base_trainer.py:1515] - INFO - "
    _, config = _collect([stamp + "Now Running Task is: text_generation, Model is: tiny", *PPRINT.splitlines(),
                          stamp + ".........Model Compiling, Please Wait a Moment..........."])
    dump = config.dump
    assert dump is not None
    assert dump["moe_config"] == "<mindformers.modules.transformer.moe.MoEConfig object>"  # no address
    assert dump["optimizer"]["learning_rate"] == "CosineWithWarmUpLR()"
    assert dump["optimizer"]["params"][0].startswith("Parameter (name=model.layers.0.wq.weight")
    assert dump["optimizer"]["pattern"] == ".*\\.norm[(]"  # an unbalanced "(" in a string
    assert dump["lr_schedule"] == {"learning_rate": 0.001, "type": "CosineWithWarmUpLR"}
    assert config.facts()["mode"] == "PYNATIVE_MODE"
    assert config.model == "tiny"


def test_dump_that_is_too_large_or_not_a_literal_is_dropped_and_counted() -> None:
    chunk = " " + "1, " * 1000
    big = ["{'a': ["] + [chunk] * (MAX_DUMP_BYTES // len(chunk) + 1) + [" 2]}"]
    collector, config = _collect(big)
    assert config.dump is None and collector.dumps_dropped == 1
    collector, config = _collect(["{'a': 1,", " 'b': (((", "next line"])
    assert config.dump is None and collector.dumps_dropped == 1


@pytest.mark.parametrize("text", ["{'a': " * 500 + "1" + "}" * 500, "{'a': __import__('os').system('x')}", "{'a': 1e99999}"])
def test_read_literal_never_raises_or_executes(text: str) -> None:
    value = read_literal(text)
    assert value is None or isinstance(value, dict)


def test_hash_ignores_run_specific_values_and_changes_with_any_setting() -> None:
    def values(**changes: object) -> dict:
        config = RunConfig(model="tiny", global_batch_size=4, output_path="/a/output", host="vm",
                           dump={"seed": 0, "rank_id": 0, "context": {"device_id": 0},
                                 "train_dataset": {"data_loader": {"dataset_dir": "/a/data"}},
                                 "model": {"model_config": {"lora_rank": 8}}})
        for key, value in changes.items():
            setattr(config, key, value)
        return settings(config)

    base = config_hash(values())
    moved = values(output_path="/b/output", host="other",
                   dump={"seed": 0, "rank_id": 7, "context": {"device_id": 7},
                         "train_dataset": {"data_loader": {"dataset_dir": "/b/data"}},
                         "model": {"model_config": {"lora_rank": 8}}})
    assert config_hash(moved) == base
    changed = values(dump={"seed": 0, "rank_id": 0, "context": {"device_id": 0},
                           "train_dataset": {"data_loader": {"dataset_dir": "/a/data"}},
                           "model": {"model_config": {"lora_rank": 16}}})
    assert config_hash(changed) != base
    assert config_hash(values(global_batch_size=8)) != base
    assert len(base) == 12


def test_hparams_are_what_tensorboard_can_show() -> None:
    shown = hparams({"a": None, "b": "x" * 500, "c": 3, "d": True, "e": 0.5})
    assert set(shown) == {"b", "c", "d", "e"} and len(shown["b"]) == 200
