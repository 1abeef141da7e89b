"""In-process TensorBoard for MindSpore training: a ``Callback`` and a ``SummaryCollector`` helper.

For users who can change their training script and want more than the log shows. The callback
writes the daemon's tags (:mod:`parsers.tags`) through the daemon's writer
(:class:`sidecar.output.run_writer.RunWriter`), so its runs overlay the sidecar's and mindformers' own.

This module imports MindSpore (install the ``mindspore`` extra). The callback has to subclass
``mindspore.train.Callback``, because ``Model.train`` and mindformers' ``Trainer`` accept only such
instances, and a plain class is simpler to read, document and ``isinstance``-check than one built
by a lazy factory. Nothing else in the package imports this module, so the daemon and the CLI
stay MindSpore-free.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

try:
    from mindspore import nn
    from mindspore.communication import get_rank
    from mindspore.train import Callback, RunContext, SummaryCollector
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError("sidecar.inprocess needs MindSpore: pip install 'mstb-sidecar[mindspore]'") from exc

from parsers import tags
from parsers.records import Record
from sidecar.mindspore.device_reads import GradNorm, Rate, outputs
from sidecar.output.event_scan import RunView
from sidecar.output.run_writer import RunWriter

log = logging.getLogger(__name__)

STOP_TIMEOUT = 30.0  # seconds the end of training waits for the writer, at most
WRITE_INTERVAL = 0.25  # seconds between the writer's batches: it wakes per batch, never per point
_COLLECT_FREQS = (10, 50, 100, 200, 500)


class TensorBoardCallback(Callback):
    """Write ``loss``, ``learning-rate``, ``grad-norm``, ``throughput``, ``iteration-time`` per step.

    Output goes to ``out_dir/rank_<rank>`` (``out_dir`` made absolute here, so a later ``chdir``
    cannot move it), every ``every`` steps (the first step at least ``every`` after the last
    written one, like mindformers' ``per_print_times``). The training thread only reads the
    values and appends them to a list of at most ``queue_size`` points; a background thread
    writes them in batches every ``WRITE_INTERVAL``. When the list is full, points are dropped
    and counted in ``dropped`` (one warning), never waited for. A writer error is logged once and
    sets ``disabled``; training goes on without the callback. Both are per ``model.train``: the
    next training with the same callback starts afresh. A training that ends the process without
    ending the training (Ctrl-C in a loop that drives the hooks, an uncaught exception) still has
    every point handed over written: the writer is stopped and drained at interpreter exit
    (``atexit``; its thread is a daemon, which exit would otherwise freeze mid-list), and before a
    SIGTERM ends it (MindSpore's runtime turns Ctrl-C in ``Model.train`` into one), unless the
    script handles SIGTERM itself. The process then ends as it would have, after the drain (at most
    ``STOP_TIMEOUT``, and after the step that is running: Python handles signals between steps).

    Step: ``cur_step_num`` plus the optimizer's ``global_step`` at the start of the training
    (minus ``cur_step_num`` there), i.e. mindformers' global step: a resumed or second-stage
    training with the same optimizer continues the curve; one with a new optimizer restarts at
    step 1 and supersedes the old points from there.

    - ``loss``: mean of the network output (its first element if a tuple), as SummaryCollector.
    - ``learning-rate``: the train network's own output when it reports one (mindformers'
      ``(loss, overflow, loss_scale, lr, global_norm, ...)``), else the rate of the optimizer's
      latest update, its schedule at ``global_step - 1`` (group 0 for grouped rates).
    - ``grad-norm``: from that same output, or with ``compute_grad_norm=True`` recomputed before
      the step on its batch (one extra forward and backward per written step; the local,
      unclipped gradient; not available in sink mode). The network's parameters that the
      optimizer does not update (batch-norm statistics) are put back afterwards, bit for bit, and
      so are the seed counters of functional random ops (``ops.dropout``); random operator
      objects (``nn.Dropout``'s) are replaced by the extra pass's own, so the training's random
      draws stay as they were (see :class:`~sidecar.mindspore.device_reads.GradNorm`).
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
        self.out_dir = Path(out_dir).absolute()
        self.every = every
        self.batch_size = batch_size
        self.compute_grad_norm = compute_grad_norm
        self.rank = rank
        self.queue_size = queue_size
        self.run_dir: Path | None = None
        self.dropped = 0
        self.disabled = False
        self._contexts = 0  # open ``with`` blocks: Model.fit's evaluation nests one in the training's
        self._pending: deque[Record] = deque()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._hung: threading.Thread | None = None  # a writer that outlived STOP_TIMEOUT
        self._view: tuple[Path, RunView] | None = None  # the run as the last writer closed it
        self._samples = 0
        self._offset = 0
        self._last_written = 0
        self._last_time = 0.0
        self._rate: Rate | None = None
        self._norm_on = False
        self._norm_fn: GradNorm | None = None
        self._norm: float | None = None

    def __enter__(self) -> TensorBoardCallback:
        self._contexts += 1
        return self

    def __exit__(self, *exc: object) -> None:
        # Only the outermost block ends the training (also when it raised): leaving the one that
        # Model.fit opens around each evaluation must not stop the writer.
        self._contexts = max(self._contexts - 1, 0)
        if not self._contexts:
            self._stop()

    def on_train_begin(self, run_context: RunContext) -> None:
        # Starts the thread here, not in __enter__: SummaryCollector forks its writer process in
        # its __enter__, and forking is only safe before other threads exist.
        self.disabled, self.dropped = False, 0
        self._guard(self._begin, run_context.original_args())

    def on_train_step_begin(self, run_context: RunContext) -> None:
        if self._norm_on and not self.disabled:
            cb = run_context.original_args()
            if self._due(cb.cur_step_num):
                self._norm = self._grad_norm(cb)

    def on_train_step_end(self, run_context: RunContext) -> None:
        self._guard(self._step_end, run_context.original_args())

    def on_train_end(self, run_context: RunContext) -> None:
        self._stop()

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
        if self._hung is not None and self._hung.is_alive():
            raise RuntimeError(f"the previous training's writer is still stuck writing {self.run_dir}")
        self.run_dir = self.out_dir / f"rank_{get_rank() if self.rank is None else self.rank}"
        self._samples = self.batch_size or cb.train_dataset.get_batch_size()
        optimizer = cb.optimizer or getattr(cb.train_network, "optimizer", None)
        self._rate = Rate(optimizer, self._rate)
        applied = self._rate.start(cb.cur_step_num, type(cb.train_network) is nn.TrainOneStepCell)
        self._offset = applied - cb.cur_step_num if applied is not None and applied > cb.cur_step_num else 0
        self._norm_on = self.compute_grad_norm
        self._last_written, self._last_time = cb.cur_step_num, time.perf_counter()
        self._pending, self._stopping = deque(), threading.Event()
        self._thread = threading.Thread(target=self._write_loop, name="mstb-tensorboard", daemon=True,
                                        args=(self.run_dir, cb.cur_step_num + self._offset + 1,
                                              self._pending, self._stopping))
        self._thread.start()
        atexit.register(self._stop)  # unregistered by _stop: one registration per training
        if threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:  # nobody else handles it
                signal.signal(signal.SIGTERM, _on_term)
            if signal.getsignal(signal.SIGTERM) is _on_term:
                _TERM_DRAINS.append(self)

    def _due(self, step: int) -> bool:
        return step - self._last_written >= self.every

    def _step_end(self, cb: Any) -> None:
        step = cb.cur_step_num
        if not self._due(step):
            return
        loss, lr, norm = outputs(cb.net_outputs)  # the host copy waits for the device
        now = time.perf_counter()
        seconds = (now - self._last_time) / (step - self._last_written)
        scalars = {tags.LOSS: loss, tags.ITERATION_TIME: seconds * 1000.0,
                   tags.THROUGHPUT: self._samples / seconds}
        if lr is None and self._rate is not None:
            lr = self._rate.applied(step)
        if norm is not None:
            self._norm_on = False  # the network reports it: no extra pass
        norm, self._norm = (self._norm if norm is None else norm), None
        for tag, value in ((tags.LEARNING_RATE, lr), (tags.GRAD_NORM, norm)):
            if value is not None:
                scalars[tag] = value
        self._last_written, self._last_time = step, now
        self._put(Record(step + self._offset, time.time(), scalars, training_step=True))

    def _grad_norm(self, cb: Any) -> float | None:
        try:
            if cb.dataset_sink_mode:
                raise RuntimeError("sink mode keeps the step's batch on the device")
            loss_net = cb.train_network.network
            weights = (cb.optimizer or cb.train_network.optimizer).parameters
            if self._norm_fn is None or not self._norm_fn.measures(loss_net, weights):
                self._norm_fn = GradNorm(loss_net, weights)  # a reused callback: a new network
            return self._norm_fn(*cb.train_dataset_element)
        except Exception as exc:
            log.warning("compute_grad_norm is off for this training: %s", exc)
            self._norm_on = False
            return None

    def _put(self, record: Record) -> None:
        # A deque append: no lock and no wake-up of the writer, which would take the GIL per point.
        if len(self._pending) < self.queue_size:
            self._pending.append(record)
            return
        self.dropped += 1
        if self.dropped == 1:
            log.warning("TensorBoard writer is behind: dropping points (%d waiting), training is not slowed",
                        self.queue_size)

    def _write_loop(self, run_dir: Path, first_step: int, pending: deque[Record],
                    stopping: threading.Event) -> None:
        """Writer thread: owns the RunWriter (its directory scan is I/O too) and its own list.

        A later training into the same directory starts its scan where this writer closed the run
        (what a reused callback wrote is not read back: at start-up, with the GIL, that would cost
        the training about 0.1 ms per point of the earlier trainings)."""
        writer: RunWriter | None = None
        view, self._view = self._view, None
        try:
            writer = RunWriter(run_dir, view[1] if view and view[0] == run_dir else None)
            if writer.max_step >= first_step:  # restarted from an earlier step: supersede the tail
                writer.resume(first_step, time.time(),
                              f"training restarted at step {first_step}; earlier points from this step on were superseded")
            while True:
                last = stopping.wait(WRITE_INTERVAL)
                if pending:
                    while pending:
                        writer.write(pending.popleft())
                    writer.flush()
                if last:
                    break
            writer.close()
            self._view = run_dir, writer.view
        except Exception:
            log.exception("TensorBoard writer for %s failed; the callback is off for the rest of this "
                          "training, training goes on", run_dir)
            self.disabled = True
            if writer is not None:
                writer.abandon()

    def _stop(self) -> None:
        """Let the writer drain and close, waiting at most STOP_TIMEOUT (a hung disk must not hang
        the end of training) and not at all for a writer that already died."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        atexit.unregister(self._stop)
        if self in _TERM_DRAINS:
            _TERM_DRAINS.remove(self)
            if (not _TERM_DRAINS and threading.current_thread() is threading.main_thread()
                    and signal.getsignal(signal.SIGTERM) is _on_term):
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
        self._stopping.set()
        thread.join(STOP_TIMEOUT)
        if thread.is_alive():
            self._hung = thread
            log.warning("TensorBoard writer for %s did not finish in %.0f s", self.run_dir, STOP_TIMEOUT)
        if self.dropped:
            log.warning("TensorBoard callback dropped %d points for %s", self.dropped, self.run_dir)


_TERM_DRAINS: list[TensorBoardCallback] = []  # trainings running while SIGTERM is ours (see _on_term)


def _on_term(signum: int, frame: object) -> None:
    """SIGTERM while trainings run, and nobody else handles it: MindSpore's runtime turns Ctrl-C in
    ``Model.train`` into one, whose default action ends the process before any Python runs. Drain
    every running callback's writer, then end the process as SIGTERM would have."""
    for callback in list(_TERM_DRAINS):
        callback._stop()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


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
