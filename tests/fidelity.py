"""Comparing sidecar output with mindformers' own TensorBoard output (the truth).

mindformers writes unrounded float32 values in-process; the log prints them rounded. Each field
is therefore compared within its print precision plus float32 rounding:

=================================  =================  ===========================================
tag                                log format         tolerance (absolute)
=================================  =================  ===========================================
loss                               ``%5.6f``          5e-7 + float32 ulp
learning-rate                      numpy ``str``      float32 relative 1e-6 (shortest repr)
grad-norm                          numpy ``str``      float32 relative 1e-6
loss-scale                         numpy ``str``      exact
iteration-time                     ``%d`` ms          exact (both are ``int(ms)``)
throughput                         ``%.5f``           5e-6 + float32 ulp
model-flops-throughput-per-npu     ``%.3f``           5e-4 + float32 ulp
=================================  =================  ===========================================

Derived from the start-up lines and the step lines (:mod:`sidecar.output.samples`), compared by
:data:`DERIVED_TAGS`: ``batch-size`` (the global batch size, exact), ``B-samples-per-day``
(throughput x world size x 86400 / 1e9, so the throughput's print precision scaled by the world
size of the genuine runs, at most 2) and the ``<tag>_vs_samples`` twins at step x GBS (the tag's
own tolerance), which the sidecar keeps in the nested run ``<rank run>/vs_samples``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tb_read import raw_points, scalars

PRINT_ABS = {
    "loss": 5e-7,
    "learning-rate": 0.0,
    "grad-norm": 0.0,
    "loss-scale": 0.0,
    "iteration-time": 0.0,
    "throughput": 5e-6,
    "model-flops-throughput-per-npu": 5e-4,
}
RELATIVE = {"learning-rate": 1e-6, "grad-norm": 1e-6}
COMPARED_TAGS = tuple(PRINT_ABS)
PRINT_ABS["batch-size"] = 0.0
PRINT_ABS["B-samples-per-day"] = PRINT_ABS["throughput"] * 2 * 86400 / 1e9
TWINNED = ("learning-rate", "batch-size", "loss", "loss-scale", "grad-norm", "iteration-time", "throughput")
TWIN_SUFFIX = "_vs_samples"
SAMPLES_RUN = "vs_samples"
DERIVED_TAGS = ("batch-size", "B-samples-per-day", *(f"{t}{TWIN_SUFFIX}" for t in TWINNED))


def tolerance(tag: str, truth: float) -> float:
    tag = tag.removesuffix(TWIN_SUFFIX)
    ulp = float(np.spacing(np.float32(abs(truth)))) if math.isfinite(truth) else 0.0
    return PRINT_ABS[tag] + 2 * ulp + RELATIVE.get(tag, 0.0) * abs(truth)


def load_truth(path: Path) -> dict[str, dict[str, dict[int, float]]]:
    """run -> tag -> {step: value} from a ``tensorboard_truth.json``."""
    data = json.loads(path.read_text())
    return {run: {tag: {int(p[0]): float(p[2]) for p in pts} for tag, pts in tags.items()} for run, tags in data.items()}


@dataclass
class Comparison:
    points: dict[str, int] = field(default_factory=dict)  # tag -> points compared
    mismatches: list[str] = field(default_factory=list)
    worst: dict[str, float] = field(default_factory=dict)  # tag -> max |diff|

    def ok(self) -> bool:
        return not self.mismatches


def compare_run(out_run: Path, truth: dict[str, dict[int, float]], tags: tuple[str, ...] = COMPARED_TAGS) -> Comparison:
    """Every truth point of every compared tag must be in ``out_run`` at the same step, within tolerance."""
    shown = scalars(out_run)
    twins = scalars(out_run / SAMPLES_RUN) if (out_run / SAMPLES_RUN).is_dir() else {}
    result = Comparison()
    raw = raw_points(out_run) + raw_points(out_run / SAMPLES_RUN)
    dups = [key for key, n in raw.items() if n > 1]
    if dups:
        result.mismatches.append(f"{out_run.name}: {len(dups)} (tag, step) written twice, e.g. {dups[:3]}")
    for tag in tags:
        expected = truth.get(tag)
        if not expected:
            continue
        got = (twins if tag.endswith(TWIN_SUFFIX) else shown).get(tag, {})
        if got.keys() != expected.keys():
            missing = sorted(set(expected) - set(got))[:5]
            extra = sorted(set(got) - set(expected))[:5]
            result.mismatches.append(f"{out_run.name} {tag}: steps differ (missing {missing}, extra {extra})")
            continue
        worst = 0.0
        for step, value in expected.items():
            mine = got[step]
            if math.isnan(value) or math.isnan(mine):
                if not (math.isnan(value) and math.isnan(mine)):
                    result.mismatches.append(f"{out_run.name} {tag}@{step}: {mine} vs truth {value}")
                continue
            diff = abs(mine - value) if math.isfinite(value) else (0.0 if mine == value else math.inf)
            worst = max(worst, diff)
            if diff > tolerance(tag, value):
                result.mismatches.append(f"{out_run.name} {tag}@{step}: {mine!r} vs truth {value!r} (diff {diff:.3g})")
        result.points[tag] = len(expected)
        result.worst[tag] = worst
    return result
