"""The messages between a replay's parent and its workers (:mod:`sidecar.service.replay_protocol`),
through a real pipe, as a worker's :class:`~sidecar.service.replay_child.Relay` sends them: typed
items in the order the engine handed them over, each step marked when its loss was written."""

from __future__ import annotations

from multiprocessing.connection import Pipe

from parsers.records import ParallelConfigLine, PipelineLine, Record
from sidecar.analysis.alerts import Alert
from sidecar.analysis.detectors import Group
from sidecar.service.replay_child import Relay
from sidecar.service.replay_protocol import Batch, StepSeen


def test_a_batch_arrives_typed_in_order_with_the_written_steps_marked() -> None:
    parent, child = Pipe()
    relay = Relay(child, {0, 1})
    alert = Alert("loss-spike", Group.SPIKE, 0, 2, "loss", 9.0, 3.0, "3.0x the recent median 3")
    relay.observe(0, Record(1, 100.0, {"loss": 2.5, "not-aggregated": 1.0}, training_step=True), 0.0)
    relay.loss(0, 1, 2.5, 100.0, None)  # its loss was written
    relay.observe(1, Record(1, 101.0, {"loss": 2.4}, training_step=True), 0.0)  # a copy: not written
    relay.note_parallel(ParallelConfigLine(8))
    relay.observe(0, Record(2, 102.0, {"loss": 9.0}, training_step=True), 0.0, resumed=True)
    relay.loss(0, 2, 9.0, 102.0, None, again=True)  # judged again after a kill
    relay.alert(alert)
    relay.note_pipeline(PipelineLine(2))
    relay.send(4096)

    batch = parent.recv()
    assert isinstance(batch, Batch)
    assert batch.items == [
        StepSeen(0, 1, 100.0, {"loss": 2.5}, False, True, False),
        StepSeen(1, 1, 101.0, {"loss": 2.4}, False, False, False),
        ParallelConfigLine(8),
        StepSeen(0, 2, 102.0, {"loss": 9.0}, True, True, True),
        alert,
        PipelineLine(2),
    ]
    assert all(type(item) is StepSeen for item in batch.items if isinstance(item, tuple))
    assert (batch.expected, batch.read, batch.pumped) == ({0, 1}, 4096, False)

    relay.send(0)  # nothing new: no items, and the ranks are not said again
    assert parent.recv() == Batch([], None, 0, False)
