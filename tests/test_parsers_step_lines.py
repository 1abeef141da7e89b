"""Table-driven tests of the step-record parsers: one row per mindformers version and shape.

Lines are rendered from the format strings in ``mindformers-log-formats.md`` §2-§4.
"""

from __future__ import annotations

import math

import pytest

from parsers.line import parse_message
from parsers.prefix import Message
from parsers.records import BarLine, EpochEndLine, Family, MalformedLine, MonitorLine, StepLine

NAN = float("nan")
INF = float("inf")

# (id, line, family, epoch, steps, step, scalars, flags)
STEP_CASES = [
    (
        "r0.2",
        "Epoch:[  0/  3], step:[   40/  800], loss:[3.872/4.015], time:488.201 ms, lr:3.75e-05",
        Family.R0X, 0, 800, 40,
        {"loss": 3.872, "iteration-time": 488.201, "learning-rate": 3.75e-05},
        {"epoch_base": 0},
    ),
    (
        "r0.2-text-lr",
        "Epoch:[  1/  3], step:[    5/  800], loss:[3.872/4.015], time:488.201 ms, lr:Not Set LR.",
        Family.R0X, 1, 800, 5, {"loss": 3.872, "iteration-time": 488.201}, {"epoch_base": 0},
    ),
    (
        "r0.3",
        "Epoch:[  1/  2], step:[   64/  400], loss:[1.936/2.104], time:2210.478 ms, lr:[1.5624999e-05], "
        "overflow cond: False, loss_scale: 65536.0",
        Family.R0X, 1, 400, 64,
        {"loss": 1.936, "iteration-time": 2210.478, "learning-rate": 1.5624999e-05, "loss-scale": 65536.0},
        {"epoch_base": 1},
    ),
    (
        "r0.3-overflow-first-step",
        "Epoch:[  1/  2], step:[    2/  300], loss:[3.118/3.118], time:389120.447 ms, lr:[0.], overflow cond: True, "
        "loss_scale: 1073741800.0",
        Family.R0X, 1, 300, 2,
        {"loss": 3.118, "iteration-time": 389120.447, "learning-rate": 0.0, "loss-scale": 1073741800.0},
        {"overflow": True},
    ),
    (
        "r0.6-no-lr-unavailable-scale",
        "Epoch:[  2/  5], step:[  150/  312], loss:[0.874/0.913], time:97.305 ms, overflow cond: False, "
        "loss_scale: unavailable",
        Family.R0X, 2, 312, 150, {"loss": 0.874, "iteration-time": 97.305}, {"epoch_base": 1},
    ),
    (
        "r0.6-nan",
        "Epoch:[  1/  2], step:[   80/  400], loss:[  nan/2.500], time:2201.100 ms, lr:[1.4e-05], "
        "overflow cond: [ True], loss_scale: 32768.0",
        Family.R0X, 1, 400, 80,
        {"loss": NAN, "iteration-time": 2201.1, "learning-rate": 1.4e-05, "loss-scale": 32768.0},
        {"overflow": True},
    ),
    (
        "r0.7-sink",
        "{ Epoch:[  1/  3], step:[  480/12000], loss: 6.417, per_step_time: 1893ms, lr: 4.7999997e-06, "
        "overflow cond: False, loss_scale: 131072.0",
        Family.GRAPH, 1, 12000, 480,
        {"loss": 6.417, "iteration-time": 1893.0, "learning-rate": 4.7999997e-06, "loss-scale": 131072.0},
        {"needs_bar": True},
    ),
    (
        "r0.7-non-sink-no-lr",
        "{ Epoch:[  2/  4], step:[   75/  250], loss:[2.561/2.790], per_step_time: 642ms, overflow cond: False, "
        "loss_scale: unavailable",
        Family.GRAPH, 2, 250, 75, {"loss": 2.561, "iteration-time": 642.0}, {"needs_bar": True},
    ),
    (
        "v1.3-global-norm",
        "{ Epoch:[  1/  1], step:[  210/ 4000], loss: 4.086, per_step_time: 2317ms, lr: 1.9949998e-05, "
        "overflow cond: False, loss_scale: 1.0, global_norm: [2.7341568]",
        Family.GRAPH, 1, 4000, 210,
        {"loss": 4.086, "iteration-time": 2317.0, "learning-rate": 1.9949998e-05, "loss-scale": 1.0,
         "grad-norm": 2.7341568},
        {},
    ),
    (
        "v1.4-mfu",
        "{ Epoch:[  1/  3], step:[   15/ 1200], loss: 7.204, per_step_time: 1186ms, lr: 3.5e-06, overflow cond: "
        "False, loss_scale: 1.0, global_norm: [6.0917406], train_throughput_per_npu: 238.114T",
        Family.GRAPH, 1, 1200, 15,
        {"loss": 7.204, "iteration-time": 1186.0, "learning-rate": 3.5e-06, "loss-scale": 1.0,
         "grad-norm": 6.0917406, "model-flops-throughput-per-npu": 238.114},
        {},
    ),
    (
        "v1.7.0-beta2-lm-loss-space",
        "{ Epoch:[  1/  1], step:[  300/ 5000], loss: 2.874120, lm loss: 2.810337, per_step_time: 5120ms, "
        "lr: 2.4e-05, overflow cond: False, loss_scale: 1.0, global_norm: [0.64172953]",
        Family.GRAPH, 1, 5000, 300,
        {"loss": 2.87412, "lm-loss": 2.810337, "iteration-time": 5120.0, "learning-rate": 2.4e-05,
         "loss-scale": 1.0, "grad-norm": 0.64172953},
        {},
    ),
    (
        "v1.7-separate-losses",
        "{ Epoch:[  1/  1], step:[  300/ 5000], loss: 2.874120, lm_loss: 2.810337, load_balancing_loss: 0.063783, "
        "mtp_loss: 3.002915, per_step_time: 5120ms, lr: 2.4e-05, overflow cond: False, loss_scale: 1.0, "
        "global_norm: [0.64172953], train_throughput_per_npu: 187.662T",
        Family.GRAPH, 1, 5000, 300,
        {"loss": 2.87412, "lm-loss": 2.810337, "load-balancing-loss": 0.063783, "mtp-loss": 3.002915,
         "iteration-time": 5120.0, "learning-rate": 2.4e-05, "loss-scale": 1.0, "grad-norm": 0.64172953,
         "model-flops-throughput-per-npu": 187.662},
        {},
    ),
    (
        "v1.9-indexer-loss",
        "{ Epoch:[  1/  1], step:[   88/ 3000], loss: 2.551900, lm_loss: 2.504110, indexer_loss: 0.047790, "
        "per_step_time: 6402ms, lr: 2.9e-05, overflow cond: False, loss_scale: 1.0, global_norm: [0.5520937]",
        Family.GRAPH, 1, 3000, 88,
        {"loss": 2.5519, "lm-loss": 2.50411, "indexer-loss": 0.04779, "iteration-time": 6402.0,
         "learning-rate": 2.9e-05, "loss-scale": 1.0, "grad-norm": 0.5520937},
        {},
    ),
    (
        "v1.8-non-sink-none-norm",
        "{ Epoch:[  3/ 10], step:[   40/  125], loss:[1.772041/1.903552], per_step_time: 512ms, overflow cond: "
        "False, loss_scale: unavailable, global_norm: None",
        Family.GRAPH, 3, 125, 40, {"loss": 1.772041, "iteration-time": 512.0}, {},
    ),
    (
        "v1.8-nan",
        "{ Epoch:[  1/  1], step:[  733/ 2000], loss:   nan, per_step_time: 2874ms, lr: 1.1e-05, overflow cond: "
        "True, loss_scale: 1.0, global_norm: [nan]",
        Family.GRAPH, 1, 2000, 733,
        {"loss": NAN, "iteration-time": 2874.0, "learning-rate": 1.1e-05, "loss-scale": 1.0, "grad-norm": NAN},
        {"overflow": True},
    ),
    (
        "graph-inf-and-multi-element-norm",
        "{ Epoch:[  1/  1], step:[  734/ 2000], loss:  -inf, per_step_time: 2874ms, lr: 1e-05, overflow cond: "
        "False, loss_scale: 1.0737418e+09, global_norm: [0.51 0.49]",
        Family.GRAPH, 1, 2000, 734,
        {"loss": -INF, "iteration-time": 2874.0, "learning-rate": 1e-05, "loss-scale": 1.0737418e09},
        {},
    ),
    (
        "graph-wide-step-no-pad",
        "{ Epoch:[ 12/100], step:[123456/200000], loss: 1.000, per_step_time: 9ms, lr: 0.0, overflow cond: False, "
        "loss_scale: 1.0",
        Family.GRAPH, 12, 200000, 123456,
        {"loss": 1.0, "iteration-time": 9.0, "learning-rate": 0.0, "loss-scale": 1.0},
        {},
    ),
    (
        "v1.9-pynative",
        "{ step:[   40/  500], loss:   3.482917, per_step_time:   1624ms, lr: 2.000000e-05, grad_norm:   0.913204, "
        "throughput: 142.87T }",
        Family.PYNATIVE, None, None, 40,
        {"loss": 3.482917, "iteration-time": 1624.0, "learning-rate": 2e-05, "grad-norm": 0.913204,
         "model-flops-throughput-per-npu": 142.87},
        {},
    ),
    (
        "v1.9-pynative-placeholder-norm",
        "{ step:[    7/  100], loss:   5.902113, per_step_time:  12045ms, lr: 1.000000e-04, grad_norm: NaN, "
        "throughput:   3.07T }",
        Family.PYNATIVE, None, None, 7,
        {"loss": 5.902113, "iteration-time": 12045.0, "learning-rate": 1e-04, "model-flops-throughput-per-npu": 3.07},
        {},
    ),
    (
        "pynative-real-nan-norm",
        "{ step:[    8/  100], loss:        nan, per_step_time:  12045ms, grad_norm:        nan, throughput:   3.07T }",
        Family.PYNATIVE, None, None, 8,
        {"loss": NAN, "iteration-time": 12045.0, "grad-norm": NAN, "model-flops-throughput-per-npu": 3.07},
        {},
    ),
    (
        "r2.0-pynative-extra-losses",
        "{ step:[  120/ 2000], loss:   2.176503, per_step_time:   3381ms, load_balancing_loss:   0.998421, "
        "mtp_1_loss:   2.402276, lr: 1.500000e-05, grad_norm:   0.482913, throughput:  88.41T }",
        Family.PYNATIVE, None, None, 120,
        {"loss": 2.176503, "iteration-time": 3381.0, "load-balancing-loss": 0.998421, "mtp-1-loss": 2.402276,
         "learning-rate": 1.5e-05, "grad-norm": 0.482913, "model-flops-throughput-per-npu": 88.41},
        {},
    ),
    (
        "r2.0-pynative-non-last-stage",
        "{ step:[  120/ 2000], loss: N/A (non-last PP stage, refer to last stage for real loss), "
        "per_step_time:   3379ms, grad_norm: NaN }",
        Family.PYNATIVE, None, None, 120, {"iteration-time": 3379.0}, {"loss_not_available": True},
    ),
    (
        "master-pynative-consumed-samples",
        "{ step:[  120/ 2000], consumed_samples: 491520, global_batch_size: 4096, loss:   2.176503, "
        "per_step_time:   3381ms, load_balancing_loss:   0.998421, lr: 1.500000e-05, grad_norm:   0.482913, "
        "throughput:  88.41T }",
        Family.PYNATIVE, None, None, 120,
        {"batch-size": 4096.0, "loss": 2.176503, "iteration-time": 3381.0, "load-balancing-loss": 0.998421,
         "learning-rate": 1.5e-05, "grad-norm": 0.482913, "model-flops-throughput-per-npu": 88.41},
        {},
    ),
    (
        "master-pynative-non-last-stage-none-batch",
        "{ step:[  120/ 2000], consumed_samples: None, global_batch_size: None, loss: N/A (non-last PP stage, "
        "refer to last stage for real loss), per_step_time:   3379ms, grad_norm: NaN }",
        Family.PYNATIVE, None, None, 120, {"iteration-time": 3379.0}, {"loss_not_available": True},
    ),
    (
        "pynative-intermediate-unpadded",
        "{ step:[    7/  100], loss: 5.902113, per_step_time: 12045ms }",
        Family.PYNATIVE, None, None, 7, {"loss": 5.902113, "iteration-time": 12045.0}, {},
    ),
    (
        "experimental-pynative",
        "Epoch: 0, Step: 12, Loss: 9.872301, Finite_grads: True, Loss_scale: 65536.0, Learning_rate: 2.500000e-06, "
        "Time: 1288.47 ms",
        Family.EXPERIMENTAL, 0, None, 12,
        {"loss": 9.872301, "loss-scale": 65536.0, "learning-rate": 2.5e-06, "iteration-time": 1288.47},
        {},
    ),
    (
        "experimental-pynative-docs-variant",
        "train: Epoch:0, Step: 3, Loss: 9.9, Finite_grads: False, Loss_scale: 32768.0, "
        "Learning_rate: (2.500000e-06,2.500000e-06,), Time: 1288.47 ms",
        Family.EXPERIMENTAL, 0, None, 3,
        {"loss": 9.9, "loss-scale": 32768.0, "learning-rate": 2.5e-06, "iteration-time": 1288.47},
        {"overflow": True},
    ),
]


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-9)


@pytest.mark.parametrize("case", STEP_CASES, ids=[c[0] for c in STEP_CASES])
def test_step_record_of_every_version(case: tuple) -> None:
    _, line, family, epoch, steps, step, scalars, flags = case
    parsed = parse_message(Message(line))
    assert isinstance(parsed, StepLine)
    assert (parsed.family, parsed.epoch, parsed.steps, parsed.step) == (family, epoch, steps, step)
    assert parsed.scalars.keys() == scalars.keys()
    for tag, value in scalars.items():
        assert _same(parsed.scalars[tag], value), tag
    for flag, value in flags.items():
        assert getattr(parsed, flag) == value


BAR_CASES = [
    ("r0.7-u25ae", "   1.3% |                                                  | 4.23 samples/s/p  18:10:27 }", 4.23),
    ("r0.7-partial", "  32.5% |▮▮▮▮▮▮▮▮▮▮▮▮▮▮▮▮                                  | 12.46 samples/s/p  0:30:23 }", 12.46),
    ("r0.8-u2588-days", "  12.0% |██████                                            | 6.81 samples/s/p  3 days, 4:05:06 }",
     6.81),
    ("v1.0.1-5-decimals", "  62.5% |███████████████████████████████                   | 1.84211 samples/s/p  3 days, 4:05:06 }",
     1.84211),
    ("one-day", "   0.4% |                                                  | 1.34907 samples/s/p  1 day, 15:00:03 }",
     1.34907),
]


@pytest.mark.parametrize("line,value", [c[1:] for c in BAR_CASES], ids=[c[0] for c in BAR_CASES])
def test_progress_bar_of_every_version(line: str, value: float) -> None:
    assert parse_message(Message(line)) == BarLine(value)


@pytest.mark.parametrize(
    "line,ms",
    [
        ("Epoch time: 391012.553 ms, per step time: 488.766 ms, avg loss: 3.950", 488.766),
        ("Per sink_size step time: 2224.902 ms, per step time: 556.226 ms, avg loss: 1.936", 556.226),
    ],
)
def test_r0x_epoch_end_line(line: str, ms: float) -> None:
    assert parse_message(Message(line)) == EpochEndLine(ms)


@pytest.mark.parametrize(
    "line,tag,step,value",
    [
        ("Epoch:[  1/  3], step:[   15/ 1200] local_norm/model.layers.3.attention.wo.weight: 0.0419",
         "local_norm/model.layers.3.attention.wo.weight", 15, 0.0419),
        ("Epoch:[  2/  3], step:[   15/ 1200] local_lm_loss: 2.8103368", "local_lm_loss", 15, 2.8103368),
        ("Epoch:[  1/  1], step:[  300/ 5000] max_attention_logit/max: 41.625", "max_attention_logit/max", 300, 41.625),
    ],
)
def test_training_state_monitor_lines(line: str, tag: str, step: int, value: float) -> None:
    parsed = parse_message(Message(line))
    assert isinstance(parsed, MonitorLine)
    assert (parsed.tag, parsed.step, parsed.value) == (tag, step, value)


@pytest.mark.parametrize(
    "line",
    [
        "{ Epoch:[  1/ x], step:[ 5/ 9], loss: 1.0",
        "Epoch:[  1/  3], step:[   15/ 1200] garbage-without-value",
        "{ step:[  abc/ 10], loss: 1.0 }",
    ],
)
def test_lines_that_open_like_records_but_do_not_parse_are_malformed(line: str) -> None:
    assert isinstance(parse_message(Message(line)), MalformedLine)


@pytest.mark.parametrize(
    "line",
    [
        "default_lr: 1.200000e-05, equal to `lr:` above.",
        "group_0_lr: 6.000000e-06, group_0_params: ['model.embedding.word_embeddings.weight']",
        "Full model flops is 123456, Shard model flops is 12345.",
        "pipeline stages: 4 > 1, the loss on the last card is valid.",
        "opt_global_step: 118, skip_data_grad_norm_threshold: 5.0, is_skip: [ True]",
        "",
        "\x00\x00garbage \ufffd\ufffd",
    ],
)
def test_other_lines_are_not_step_records(line: str) -> None:
    assert not isinstance(parse_message(Message(line)), (StepLine, BarLine, MalformedLine))


INT64_MAX = (1 << 63) - 1
BIG = "9" * 5000  # int() of this raises ValueError; float() of it is inf


@pytest.mark.parametrize(
    "line",
    [
        "{ Epoch:[  1/  1], step:[99999999999999999999999/100], loss: 1.0, per_step_time: 5ms",
        "{ Epoch:[99999999999999999999999/  1], step:[    1/100], loss: 1.0, per_step_time: 5ms",
        "{ Epoch:[  1/  1], step:[    1/99999999999999999999999], loss: 1.0, per_step_time: 5ms",
        f"{{ Epoch:[  1/  1], step:[{BIG}/100], loss: 1.0, per_step_time: 5ms",
        f"{{ Epoch:[{1 << 62}/  2], step:[  1/   4], loss: 1.0",  # each fits, the global step does not
        f"Epoch:[  1/  3], step:[{BIG}/ 800], loss:[3.872/4.015], time:488.201 ms, lr:3.75e-05",
        f"Epoch:[{1 << 62}/  3], step:[   15/ 4] local_lm_loss: 2.8",  # monitor line, global step too big
        f"Epoch:[  1/  3], step:[{BIG}/ 1200] local_lm_loss: 2.8",
        "{ step:[99999999999999999999999/  500], loss: 1.0, per_step_time: 1ms }",
        f"{{ step:[{BIG}/  500], loss: 1.0, per_step_time: 1ms }}",
        "Epoch: 1, Step: 99999999999999999999999, Loss: 9.9, Time: 1288.47 ms",
        f"Epoch: {BIG}, Step: 1, Loss: 9.9, Time: 1288.47 ms",
    ],
    ids=["graph-step", "graph-epoch", "graph-steps", "graph-5000-digits", "graph-global", "r0x-5000-digits",
         "monitor-global", "monitor-5000-digits", "pynative-step", "pynative-5000-digits", "experimental-step",
         "experimental-epoch"],
)
def test_steps_and_epochs_beyond_int64_are_malformed(line: str) -> None:
    assert isinstance(parse_message(Message(line)), MalformedLine)


def test_the_largest_int64_step_still_parses() -> None:
    parsed = parse_message(Message(f"{{ step:[{INT64_MAX}/  500], loss: 1.0, per_step_time: 1ms }}"))
    assert isinstance(parsed, StepLine) and parsed.global_step() == INT64_MAX

