"""What the in-process callback (:mod:`sidecar.inprocess`) reads from the device, besides the loss:
the learning rate an optimizer applied (:class:`Rate`), the global gradient norm (:class:`GradNorm`)
and a train network's outputs (:func:`outputs`).

Contract: reading must not change the training. The gradient norm's extra pass puts back every
state it moves (batch-norm statistics, parameters the optimizer does not update, the seed counters
of functional random ops) and runs random operator objects as copies; the learning rate is read,
never stepped. It must cost the step little: the learning rate is read from the host where it can
be, or for a block of steps in one graph call.

This module imports MindSpore; nothing the daemon imports imports it.
"""

from __future__ import annotations

import copy
import importlib
import logging
from typing import Any

import numpy as np

try:
    import mindspore as ms
    from mindspore import nn, ops
    from mindspore.nn.learning_rate_schedule import LearningRateSchedule
    from mindspore.nn.optim.optimizer import _ConvertToCell, _IteratorLearningRate
    from mindspore.ops.primitive import Primitive
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError("sidecar.inprocess needs MindSpore: pip install 'mstb-sidecar[mindspore]'") from exc

log = logging.getLogger("sidecar.inprocess")  # the callback's log: its warnings are about it

# The op-seed counters of MindSpore's functional random ops (``mindspore.common.seed`` is also
# the name of a function there, so ``from ... import`` gives the function, not the module).
_KERNEL_SEED: dict[Any, int] = importlib.import_module("mindspore.common.seed")._KERNEL_SEED

_BLOCK = 8  # learning rates evaluated per graph call (see Rate)


class Rate:
    """The learning rate of an optimizer's latest update: its schedule at ``global_step - 1``.

    ``global_step`` is read from the device once per training when the train network is a plain
    ``nn.TrainOneStepCell`` (it calls the optimizer once per step, unconditionally, so the
    optimizer's step moves with ``cur_step_num``), else at every point: a loss-scale cell skips
    the update of an overflowed step, an accumulating one updates every few steps.

    Reading it must cost the step little: one graph call per point takes longer than a toy
    training step. A fixed rate is read from its Parameter (another callback may change it); a
    list of rates is copied to the host once; a schedule without Parameters depends on the step
    alone, so in graph mode it is evaluated for the next ``_BLOCK`` points in one graph call and
    cached. Each step is still evaluated at shape (1,), as the optimizer calls it: a schedule
    evaluated on a vector can differ in the last bit. Other schedules, and any in PyNative mode
    (where a block is only more operators), are evaluated per point.
    """

    def __init__(self, optimizer: Any, previous: Rate | None) -> None:
        lr = getattr(optimizer, "learning_rate", None)
        if getattr(optimizer, "is_group_lr", False):
            lr = lr[0]
        if isinstance(lr, _ConvertToCell):  # a fixed rate in a group
            lr = lr.learning_rate
        self.lr = lr
        self.step = getattr(optimizer, "global_step", None)
        self.table = lr.learning_rate.asnumpy() if isinstance(lr, _IteratorLearningRate) else None
        self.block: _Block | None = None
        if (isinstance(lr, LearningRateSchedule) and self.table is None and not list(lr.get_parameters())
                and ms.get_context("mode") == ms.GRAPH_MODE):  # in PyNative a block is only more ops
            self.block = previous.block if previous and previous.lr is lr else _Block(lr)
        self.cache: dict[int, float] = {}
        self.last: int | None = None
        self.base: int | None = None  # global_step - cur_step_num, while they move together

    def start(self, cur_step_num: int, in_step: bool) -> int | None:
        """The optimizer's update count at the start of a training (``None`` without an
        optimizer); ``in_step``: the optimizer runs exactly once in every step from here on."""
        step = self.global_step(cur_step_num)
        self.base = step - cur_step_num if in_step and step is not None else None
        return step

    def global_step(self, cur_step_num: int) -> int | None:
        if self.base is not None:
            return self.base + cur_step_num
        return None if self.step is None else int(self.step.asnumpy().reshape(-1)[0])

    def applied(self, cur_step_num: int) -> float | None:
        if not isinstance(self.lr, LearningRateSchedule):
            return None if self.lr is None else scalar(self.lr)
        step = self.global_step(cur_step_num)
        if step is None:
            return None
        step -= 1  # the step of the update just applied
        if self.table is not None and 0 <= step < len(self.table):
            return float(self.table[step])
        if self.block is None:
            return scalar(self.lr(ms.Tensor([step], ms.int32)))
        if step not in self.cache:  # the next points are usually as far apart as the last two
            stride = step - self.last if self.last is not None and step > self.last else 1
            steps = np.arange(step, step + stride * _BLOCK, stride, dtype=np.int32)
            try:
                self.cache = dict(zip(steps.tolist(), self.block(ms.Tensor(steps)).asnumpy().tolist()))
            except Exception as exc:  # e.g. a schedule that does not compile unrolled
                log.warning("learning rate read per point (slower): %s", exc)
                self.block = None
                return self.applied(cur_step_num)
        self.last = step
        return self.cache[step]


class _Block(nn.Cell):
    """A schedule at ``_BLOCK`` steps in one graph, each at shape (1,) as the optimizer calls it."""

    def __init__(self, schedule: LearningRateSchedule) -> None:
        super().__init__(auto_prefix=False)
        self.schedule = schedule

    def construct(self, steps: Any) -> Any:
        return ops.stack([self.schedule(steps[i:i + 1]).reshape(()) for i in range(_BLOCK)])


class GradNorm:
    """Global L2 norm of d(loss)/d(weights) on one batch, leaving the network as it was.

    The extra forward pass runs in training mode, because the step's gradient depends on it
    (batch statistics, not moving ones), and so moves the network's state: batch-norm statistics,
    any parameter the optimizer does not update. Those are copied (on the device) before and put
    back after, bit for bit. Functional random ops take a seed from MindSpore's per-op counters
    when traced (graph) or called (PyNative); the counters are put back too, so the training's
    own random ops get the seeds they would have had. A random operator object (``nn.Dropout``
    holds one) keeps its state in the object: graph mode compiles the extra pass with operators
    of its own, and in PyNative the pass runs with copies of those a cell holds, kept from pass to
    pass (MindSpore cannot save and restore the state itself).
    """

    def __init__(self, loss_net: nn.Cell, weights: Any) -> None:
        self.loss_net, self.weights = loss_net, weights
        self.graph = _NormGraph(loss_net, weights)
        trained = {id(w) for w in weights}
        self.state = [p for p in loss_net.get_parameters() if id(p) not in trained]
        self.twins = _random_twins(loss_net) if ms.get_context("mode") == ms.PYNATIVE_MODE else []

    def measures(self, loss_net: nn.Cell, weights: Any) -> bool:
        return loss_net is self.loss_net and weights is self.weights

    def __call__(self, *inputs: Any) -> float:
        saved = [p.value().copy() for p in self.state]
        seeds = dict(_KERNEL_SEED)
        for cell, name, _, twin in self.twins:
            setattr(cell, name, twin)
        try:
            return scalar(self.graph(*inputs))
        finally:
            for param, value in zip(self.state, saved):
                param.set_data(value)
            _KERNEL_SEED.clear()
            _KERNEL_SEED.update(seeds)
            for cell, name, op, _ in self.twins:
                setattr(cell, name, op)


def _random_twins(net: nn.Cell) -> list[tuple[nn.Cell, str, Any, Any]]:
    """(cell, attribute, operator, copy) for the random operators the cells of ``net`` hold
    (MindSpore marks them ``side_effect_hidden``); a copy starts from the same seeds."""
    return [(cell, name, value, copy.deepcopy(value)) for _, cell in net.cells_and_names()
            for name, value in vars(cell).items()
            if isinstance(value, Primitive) and value.attrs.get("side_effect_hidden")]


class _NormGraph(nn.Cell):
    """The norm in one graph: one host copy, not one per tensor."""

    def __init__(self, loss_net: nn.Cell, weights: Any) -> None:
        super().__init__(auto_prefix=False)
        self.loss_net = loss_net
        self.weights = weights
        self.grad = ops.GradOperation(get_by_list=True)

    def construct(self, *inputs: Any) -> Any:
        grads = self.grad(self.loss_net, self.weights)(*inputs)
        return ops.sqrt(ops.addn([ops.square(g.astype(ms.float32)).sum() for g in grads]))


def scalar(value: Any) -> float:
    array = value.asnumpy() if isinstance(value, ms.Tensor) else np.asarray(value)
    return float(array.item() if array.size == 1 else array.mean())  # a loss is one value: no reduction


def outputs(out: Any) -> tuple[float, float | None, float | None]:
    """(loss, lr, grad norm) of a train network's output, read as mindformers' MFLossMonitor does."""
    out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    lr = out[3] if len(out) in (4, 5, 7) else None
    norm = out[4] if len(out) in (5, 7) else None  # None too when mindformers does not clip
    return scalar(out[0]), None if lr is None else scalar(lr), None if norm is None else scalar(norm)
