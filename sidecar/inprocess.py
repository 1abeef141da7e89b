"""In-process TensorBoard for MindSpore training: a ``Callback`` and a ``SummaryCollector`` helper.

For users who can change their training script and want more than the log shows. The callback
writes the daemon's tags (:mod:`parsers.tags`) through the daemon's writer
(:class:`sidecar.run_writer.RunWriter`), so its runs overlay the sidecar's and mindformers' own.

This module imports MindSpore (install the ``mindspore`` extra). The callback has to subclass
``mindspore.train.Callback``, because ``Model.train`` and mindformers' ``Trainer`` accept only such
instances, and a plain class is simpler to read, document and ``isinstance``-check than one built
by a lazy factory. Nothing else in the package imports this module, so the daemon and the CLI
stay MindSpore-free.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

try:
    import mindspore as ms
    from mindspore import nn, ops
    from mindspore.communication import get_rank
    from mindspore.nn.learning_rate_schedule import LearningRateSchedule
    from mindspore.train import Callback, RunContext, SummaryCollector
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError("sidecar.inprocess needs MindSpore: pip install 'mstb-sidecar[mindspore]'") from exc

from parsers import tags
from parsers.records import Record
from sidecar.output.run_writer import RunWriter

log = logging.getLogger(__name__)

_STOP = object()
STOP_TIMEOUT = 30.0  # seconds the end of training waits for the writer to drain
_COLLECT_FREQS = (10, 50, 100, 200, 500)


class TensorBoardCallback(Callback):
    """Write ``loss``, ``learning-rate``, ``grad-norm``, ``throughput``, ``iteration-time`` per step.

    Output goes to ``out_dir/rank_<rank>`` at the global step ``cur_step_num``, every ``every``
    steps (the first step at least ``every`` after the last written one, like mindformers'
    ``per_print_times``). The training thread only reads the values; a background thread
    writes them through a queue of ``queue_size`` points. When the queue is full, points are
    dropped and counted in ``dropped`` (one warning), never waited for. A writer error is logged
    once and sets ``disabled``; training goes on without the callback.

    - ``loss``: mean of the network output (its first element if a tuple), as SummaryCollector.
    - ``learning-rate``: the train network's own output when it reports one (mindformers'
      ``(loss, overflow, loss_scale, lr, global_norm, ...)``), else the optimizer's schedule
      at ``cur_step_num - 1``, i.e. the rate applied in this step (group 0 for grouped rates).
    - ``grad-norm``: from that same output, or with ``compute_grad_norm=True`` recomputed before
      the step on its batch (one extra forward and backward per written step; the local,
      unclipped gradient; not available in sink mode).
    - ``iteration-time`` (ms) and ``throughput`` (samples/s per device, ``batch_size`` / step
      seconds; ``batch_size`` defaults to the dataset's): wall time per step since the previous
      point, data loading and callbacks included, so in sink mode the sink time / sink size. Both
      ends are taken after the loss reached the host, so asynchronous execution cannot shift
      time between points. The first point includes graph compilation.
    """

    def __init__(self, out_dir: str | Path, every: int = 1, *, batch_size: int | None = None,
                 compute_grad_norm: bool = False, rank: int | None = None,
                 queue_size: int = 10_000) -> None:
        super().__init__()
        if every < 1 or queue_size < 1:
            raise ValueError("every and queue_size must be >= 1")
        self.out_dir = Path(out_dir)
        self.every = every
        self.batch_size = batch_size
        self.compute_grad_norm = compute_grad_norm
        self.rank = rank
        self.queue_size = queue_size
        self.run_dir: Path | None = None
        self.dropped = 0
        self.disabled = False
        self._queue: queue.Queue[Any] = queue.Queue(queue_size)
        self._thread: threading.Thread | None = None
        self._samples = 0
        self._last_written = 0
        self._last_time = 0.0
        self._norm_fn: _GradNorm | None = None
        self._norm: float | None = None

    def on_train_begin(self, run_context: RunContext) -> None:
        # Starts the thread here, not in __enter__: SummaryCollector forks its writer process in
        # its __enter__, and forking is only safe before other threads exist.
        self._guard(self._begin, run_context.original_args())

    def on_train_step_begin(self, run_context: RunContext) -> None:
        cb = run_context.original_args()
        if self.compute_grad_norm and not self.disabled and self._due(cb.cur_step_num):
            self._norm = self._grad_norm(cb)

    def on_train_step_end(self, run_context: RunContext) -> None:
        self._guard(self._step_end, run_context.original_args())

    def on_train_end(self, run_context: RunContext) -> None:
        self._stop()

    def __exit__(self, *exc: object) -> None:
        self._stop()  # also when training raised

    def _guard(self, fn: Callable[[Any], None], cb: Any) -> None:
        """Run ``fn`` unless disabled; an error disables the callback rather than the training."""
        if self.disabled:
            return
        try:
            fn(cb)
        except Exception:
            log.exception("TensorBoard callback failed; it is off for the rest of this training")
            self.disabled = True

    def _begin(self, cb: Any) -> None:
        self.run_dir = self.out_dir / f"rank_{get_rank() if self.rank is None else self.rank}"
        self._samples = self.batch_size or cb.train_dataset.get_batch_size()
        self._last_written, self._last_time = cb.cur_step_num, time.perf_counter()
        self._queue = queue.Queue(self.queue_size)
        self._thread = threading.Thread(target=self._write_loop, name="mstb-tensorboard", daemon=True,
                                        args=(self.run_dir, cb.cur_step_num + 1, self._queue))
        self._thread.start()

    def _due(self, step: int) -> bool:
        return step - self._last_written >= self.every

    def _step_end(self, cb: Any) -> None:
        step = cb.cur_step_num
        if not self._due(step):
            return
        loss, lr, norm = _outputs(cb.net_outputs)  # the host copy waits for the device
        now = time.perf_counter()
        seconds = (now - self._last_time) / (step - self._last_written)
        scalars = {tags.LOSS: loss, tags.ITERATION_TIME: seconds * 1000.0,
                   tags.THROUGHPUT: self._samples / seconds}
        if lr is None:
            lr = _scheduled_lr(cb.optimizer or getattr(cb.train_network, "optimizer", None), step)
        if norm is not None:
            self.compute_grad_norm = False  # the network reports it: no extra pass
        norm, self._norm = (self._norm if norm is None else norm), None
        for tag, value in ((tags.LEARNING_RATE, lr), (tags.GRAD_NORM, norm)):
            if value is not None:
                scalars[tag] = value
        self._last_written, self._last_time = step, now
        self._put(Record(step, time.time(), scalars, training_step=True))

    def _grad_norm(self, cb: Any) -> float | None:
        try:
            if cb.dataset_sink_mode:
                raise RuntimeError("sink mode keeps the step's batch on the device")
            if self._norm_fn is None:
                optimizer = cb.optimizer or cb.train_network.optimizer
                self._norm_fn = _GradNorm(cb.train_network.network, optimizer.parameters)
            return _scalar(self._norm_fn(*cb.train_dataset_element))
        except Exception as exc:
            log.warning("compute_grad_norm is off: %s", exc)
            self.compute_grad_norm = False
            return None

    def _put(self, record: Record) -> None:
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("TensorBoard writer is behind: dropping points (queue of %d full), "
                            "training is not slowed", self.queue_size)

    def _write_loop(self, run_dir: Path, first_step: int, points: queue.Queue[Any]) -> None:
        """Writer thread: owns the RunWriter (its directory scan is I/O too) and its own queue."""
        writer: RunWriter | None = None
        try:
            writer = RunWriter(run_dir)
            if writer.max_step >= first_step:  # restarted from an earlier step: supersede the tail
                writer.resume(first_step, time.time(),
                              f"training restarted at step {first_step}; earlier points from this step on were superseded")
            while (item := points.get()) is not _STOP:
                writer.write(item)
                if points.empty():
                    writer.flush()
            writer.close()
        except Exception:
            log.exception("TensorBoard writer for %s failed; the callback is off, training goes on", run_dir)
            self.disabled = True
            if writer is not None:
                writer.abandon()

    def _stop(self) -> None:
        """Let the writer drain and close; bounded, so a hung disk cannot hang the end of training."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        try:
            self._queue.put(_STOP, timeout=STOP_TIMEOUT)
        except queue.Full:
            pass  # the writer is dead or stuck; the join below times out too
        thread.join(STOP_TIMEOUT)
        if thread.is_alive():
            log.warning("TensorBoard writer for %s did not finish in %.0f s", self.run_dir, STOP_TIMEOUT)
        if self.dropped:
            log.warning("TensorBoard callback dropped %d points for %s", self.dropped, self.run_dir)


class _GradNorm(nn.Cell):
    """Global L2 norm of d(loss)/d(weights) on one batch, in one graph: one host copy, not one per tensor."""

    def __init__(self, loss_net: nn.Cell, weights: Any) -> None:
        super().__init__(auto_prefix=False)
        self.loss_net = loss_net
        self.weights = weights
        self.grad = ops.GradOperation(get_by_list=True)

    def construct(self, *inputs: Any) -> Any:
        grads = self.grad(self.loss_net, self.weights)(*inputs)
        return ops.sqrt(ops.addn([ops.square(g.astype(ms.float32)).sum() for g in grads]))


def _scalar(value: Any) -> float:
    return float(np.mean(value.asnumpy() if isinstance(value, ms.Tensor) else value))


def _outputs(out: Any) -> tuple[float, float | None, float | None]:
    """(loss, lr, grad norm) of a train network's output, read as mindformers' MFLossMonitor does."""
    out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    lr = out[3] if len(out) in (4, 5, 7) else None
    norm = out[4] if len(out) in (5, 7) else None  # None too when mindformers does not clip
    return _scalar(out[0]), None if lr is None else _scalar(lr), None if norm is None else _scalar(norm)


def _scheduled_lr(optimizer: Any, step: int) -> float | None:
    """The rate ``optimizer`` applied in ``step`` (1-based): its schedule at global step ``step - 1``."""
    lr = getattr(optimizer, "learning_rate", None)
    if lr is None:
        return None
    if getattr(optimizer, "is_group_lr", False):
        lr = lr[0]
    if isinstance(lr, LearningRateSchedule):
        lr = lr(ms.Tensor(step - 1, ms.int32))
    return _scalar(lr)


def _collect_freq(total_steps: int) -> int:
    """The smallest of 10, 50, 100, 200, 500 that keeps a run to about 1,000 collections."""
    return next((f for f in _COLLECT_FREQS if total_steps <= f * 1000), _COLLECT_FREQS[-1])


def summary_collector(summary_dir: str | Path, total_steps: int, *, rank: int | None = None,
                      collect_freq: int | None = None, collect_graph: bool = False,
                      collect_landscape: dict[str, Any] | None = None,
                      collect_specified_data: dict[str, Any] | None = None,
                      **kwargs: Any) -> SummaryCollector:
    """A ``SummaryCollector`` writing to ``summary_dir/rank_<rank>``, sized for a run of ``total_steps``.

    Each collection writes weight histograms, so ``collect_freq`` grows with the run (10 up to
    10k steps, 50-100 up to 100k, 100-500 beyond). Off unless asked, because TensorBoard shows
    none of them after conversion: landscape checkpoints (MindSpore's default writes one per step
    for the first 20 steps; pass a landscape config dict to opt in), the network graph, and the
    dataset graph (on which MindSpore 2.9.0 crashes; opt in with
    ``collect_specified_data={"collect_dataset_graph": True}``). Other keyword arguments go to
    ``SummaryCollector``. In dataset sink mode SummaryCollector counts ``collect_freq`` in
    epochs (sinks). Only one SummaryCollector may run per process.
    """
    data: dict[str, Any] = {"collect_graph": collect_graph, "collect_landscape": collect_landscape,
                            "collect_dataset_graph": False}
    data.update(collect_specified_data or {})
    run_dir = Path(summary_dir) / f"rank_{get_rank() if rank is None else rank}"
    return SummaryCollector(str(run_dir), collect_freq=collect_freq or _collect_freq(total_steps),
                            collect_specified_data=data, **kwargs)
