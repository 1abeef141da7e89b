"""Train with real mindformers on the CPU, as mindformers' own ``run_mindformer.py`` does.

Runs in the mindformers venv, in the job's directory (the config's ``./output`` and ``./data`` are
relative to it), once per worker under ``msrun``. The order matters on the CPU:
``set_output_path`` -> ``build_context`` -> ``Trainer(config).train()``; without ``build_context``
first, the Trainer sets up a device context the CPU does not have.

One patch, in this launcher, not in mindformers: the train wrapper's overflow check
(``MFTrainOneStepCell.get_overflow_status``, from MindSpore's ``TrainOneStepWithLossScaleCell``)
picks its ops by device and on the CPU ends in the Ascend-only ``NPUGetFloatStatusV2``, which fails
at graph compile. It is replaced by the same inf/nan reduction built on ``IsFinite``, which has a
CPU kernel. Loss, learning rate and grad norm do not depend on it; only ``overflow cond`` does.

usage: train.py CONFIG.yaml [dotted.key=value ...]   (values are YAML: 1000.0, True, float16)
"""

from __future__ import annotations

import sys
from typing import Any

import yaml


def patch_cpu_overflow_check() -> None:
    from mindspore import ops
    from mindspore.common import dtype as mstype
    from mindformers.wrapper.wrapper import MFTrainOneStepCell

    grad_overflow = ops.MultitypeFuncGraph("cpu_grad_overflow")

    @grad_overflow.register("Tensor")
    def _(grad: Any) -> Any:
        return ops.cast(ops.logical_not(ops.IsFinite()(grad).all()), mstype.float32)

    def get_overflow_status(self: Any, status: Any, compute_output: Any) -> Any:
        return self._get_distributed_overflow_status_on_infnan_mode(grad_overflow, compute_output)

    MFTrainOneStepCell.get_overflow_status = get_overflow_status


def load_config(path: str, overrides: list[str]) -> Any:
    """The YAML config with ``a.b.c=value`` overrides applied; a key that does not exist is an error."""
    from mindformers.tools.register import MindFormerConfig

    config = MindFormerConfig(path)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            sys.exit(f"train.py: override {item!r} is not key=value (e.g. context.mode=1)")
        *parents, leaf = key.split(".")
        node = config
        for name in parents:
            node = node.get(name)
            if node is None:
                sys.exit(f"train.py: override {key!r}: no {name!r} in {path}")
        if leaf not in node:
            sys.exit(f"train.py: override {key!r}: no {leaf!r} in {path}")
        node[leaf] = yaml.safe_load(value)
    return config


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit(__doc__.strip().splitlines()[-1])
    config = load_config(argv[0], argv[1:])
    patch_cpu_overflow_check()

    from mindformers.core.context import build_context
    from mindformers.trainer import Trainer
    from mindformers.utils.file_utils import set_output_path

    set_output_path(config.output_dir)
    build_context(config)
    Trainer(config).train()


if __name__ == "__main__":
    main(sys.argv[1:])
