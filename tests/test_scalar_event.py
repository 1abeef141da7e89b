"""Scalar events encoded without protobuf objects decode to exactly the ``Event`` protobuf builds."""

from __future__ import annotations

import math

from tensorboardX.proto import event_pb2, summary_pb2

from sidecar.output import scalar_event


def protobuf(step: int, wall_time: float, scalars: dict[str, float]) -> event_pb2.Event:
    values = [summary_pb2.Summary.Value(tag=tag, simple_value=value) for tag, value in scalars.items()]
    return event_pb2.Event(wall_time=wall_time, step=step, summary=summary_pb2.Summary(value=values))


def test_encoded_events_decode_to_the_protobuf_event() -> None:
    scalars = {"loss": 0.25, "learning-rate": 1e-45, "grad-norm": math.inf, "throughput": 3e38,
               "loss-scale": -math.inf, "model-flops-throughput-per-npu": -0.0, "local_norm/é": 7.5}
    for step, wall_time in ((0, 0.0), (1, 0.0), (127, 1.5), (128, 1.7e9), (2**63 - 1, 1764550000.123456), (-3, 2.0)):
        decoded = event_pb2.Event.FromString(scalar_event.encode(step, wall_time, scalars))
        assert decoded == protobuf(step, wall_time, scalars)


def test_values_beyond_float32_become_infinite_and_nan_stays_nan() -> None:
    decoded = event_pb2.Event.FromString(scalar_event.encode(5, 1.0, {"a": 1e39, "b": -1e300, "c": math.nan}))
    a, b, c = (v.simple_value for v in decoded.summary.value)
    assert (a, b) == (math.inf, -math.inf) and math.isnan(c)
