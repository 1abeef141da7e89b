"""TensorBoard tag vocabulary, matching mindformers' own TensorBoard writer.

mindformers (v1.4+) writes ``loss``, ``learning-rate``, ``grad-norm``, ``loss-scale``,
``iteration-time`` (ms), ``throughput`` (samples/s per device), ``model-flops-throughput-per-npu``
and the separate losses. Using the same names lets sidecar curves overlay in-process ones.
"""

from __future__ import annotations

import re

LOSS = "loss"
LEARNING_RATE = "learning-rate"
GRAD_NORM = "grad-norm"
LOSS_SCALE = "loss-scale"
ITERATION_TIME = "iteration-time"
THROUGHPUT = "throughput"
MODEL_FLOPS = "model-flops-throughput-per-npu"
BATCH_SIZE = "batch-size"
CHECKPOINT_SAVE_TIME = "checkpoint-save-time"
# The metrics of a graph-trainer step record, in the order they are shown (summary, aggregate).
MAIN = (LOSS, LEARNING_RATE, GRAD_NORM, LOSS_SCALE, ITERATION_TIME, THROUGHPUT, MODEL_FLOPS)
# The metrics the cross-rank aggregate takes over ranks (sidecar.analysis.aggregate), in the order
# the custom-scalars layout charts them (sidecar.output.layout).
AGGREGATED = (*MAIN, "lm-loss", "mtp-loss", "load-balancing-loss", "indexer-loss")
EVAL_PREFIX = "eval/"
EVAL_TIME = "eval/time"
TEXT_CHECKPOINT = "events/checkpoint"
# Written by the sidecar itself, not read from a log: the run's configuration card, the parallel
# layout a rank's log states (for the job-wide aggregate) and alerts (``alerts/<name>``).
CONFIG = "config"
PARALLEL_LAYOUT = "parallel-layout"
ALERTS_PREFIX = "alerts/"
LIFECYCLE_PREFIX = "events/lifecycle/"  # + finished, failed, running (again): parsers.lifecycle

# Log key (lower-cased, as printed by any trainer) -> tag.
KEY_TAGS: dict[str, str] = {
    "loss": LOSS,
    "lr": LEARNING_RATE,
    "learning_rate": LEARNING_RATE,
    "global_norm": GRAD_NORM,
    "grad_norm": GRAD_NORM,
    "loss_scale": LOSS_SCALE,
    "per_step_time": ITERATION_TIME,
    "time": ITERATION_TIME,
    "train_throughput_per_npu": MODEL_FLOPS,
    # The PyNative trainer's ``throughput: ..T`` is model TFLOPS per device, not samples/s.
    "throughput": MODEL_FLOPS,
    "lm_loss": "lm-loss",
    "lm loss": "lm-loss",
    "mtp_loss": "mtp-loss",
    "load_balancing_loss": "load-balancing-loss",
    "indexer_loss": "indexer-loss",
    "global_batch_size": BATCH_SIZE,
}

_MTP_N = re.compile(r"mtp_(\d+)_loss")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-/]+")
MAX_TAG_LENGTH = 200


def tag_for_key(key: str) -> str | None:
    """Tag for a printed key, or ``None`` for keys that are not metrics (epoch, overflow, ...)."""
    tag = KEY_TAGS.get(key)
    if tag is None:
        m = _MTP_N.fullmatch(key)
        if m:
            return f"mtp-{m.group(1)}-loss"
    return tag


def sanitize_tag(name: str) -> str:
    """Make a name taken from log content safe as a tag: no odd characters, bounded length."""
    clean = _UNSAFE.sub("_", name.strip()).strip("/")
    return clean[:MAX_TAG_LENGTH] or "_"
