"""The in-process callback given to a real mindformers 1.9 ``Trainer`` (the ``mindformers`` tier).

The tiny LLaMA of ``tests/mindformers_run`` trains 40 steps (two epochs of 20) with
``TensorBoardCallback`` in the ``Trainer``'s callbacks, a checkpoint at step 20 and evaluation
during training (``do_eval``: perplexity every 10 steps, mindformers' ``EvalCallBack`` calling
``model.eval`` from inside the training); then a second training resumes from that checkpoint
(``resume_training``) with a new callback. At every step of both, the callback's ``loss``,
``learning-rate`` and ``grad-norm`` must equal mindformers' own TensorBoard values at the same
global step: the resumed training continues at step 21, as mindformers' own curve does, with the
rate the optimizer applied there.

Reuses the venv and recipe of :mod:`test_mindformers_live` (``.cache/mfvenv``).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from test_mindformers_live import REPO, TRAIN_TIMEOUT, MfPython, _tail, clean_env, mf_python  # noqa: F401
from tb_read import scalars

pytestmark = pytest.mark.mindformers

RECIPE = REPO / "tests" / "mindformers_run"
RECORDS = 40  # two epochs of 20 steps, batch 2
EVAL_RECORDS = 4  # two batches per evaluation, at steps 10, 20, 30 and 40 (eval_step_interval)
CHECKPOINT = ("callbacks=[{type: MFLossMonitor, per_print_times: 1}, {type: CheckpointMonitor, prefix: llama, "
              "save_checkpoint_steps: 20, keep_checkpoint_max: 2, checkpoint_format: ckpt}]")

TRAIN = r"""
import sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests/mindformers_run"]
from train import load_config, patch_cpu_overflow_check
from sidecar.inprocess import TensorBoardCallback

config = load_config(sys.argv[1] + "/tests/mindformers_run/tiny_llama.yaml", sys.argv[3:])
patch_cpu_overflow_check()
from mindformers.core.context import build_context
from mindformers.trainer import Trainer
from mindformers.utils.file_utils import set_output_path

set_output_path(config.output_dir)
build_context(config)
Trainer(config, callbacks=[TensorBoardCallback(sys.argv[2])]).train()
"""


def train(mf: MfPython, workdir: Path, script: Path, out: str, *overrides: str) -> None:
    log = workdir / f"{Path(out).name}.log"
    with open(log, "w") as fh:
        proc = subprocess.run([str(mf.python), str(script), str(REPO), out, *overrides], cwd=workdir,
                              stdout=fh, stderr=subprocess.STDOUT, env=clean_env(), timeout=TRAIN_TIMEOUT)
    assert proc.returncode == 0, f"{out}: exit {proc.returncode}\n{_tail(log, 60)}"


@pytest.fixture(scope="module")
def stages(mf_python: MfPython, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    workdir = tmp_path_factory.mktemp("mf-inprocess")
    script = workdir / "train_with_callback.py"
    script.write_text(TRAIN)
    for data in (["data/train.mindrecord", str(RECORDS)], ["eval_data/eval.mindrecord", str(EVAL_RECORDS), "32"]):
        subprocess.run([str(mf_python.python), str(RECIPE / "make_data.py"), *data],
                       cwd=workdir, check=True, env=clean_env(), timeout=TRAIN_TIMEOUT, capture_output=True)
    train(mf_python, workdir, script, "output/tb_first", CHECKPOINT, "do_eval=True")
    # resume_training names the checkpoint of global step 20 (epoch 1); True would take the last one
    train(mf_python, workdir, script, "output/tb_resumed", CHECKPOINT, "resume_training=llama_rank_0-1_20.ckpt",
          "load_checkpoint=./output/checkpoint", "tensorboard.tensorboard_dir=./output/tensorboard_resumed")
    return workdir / "output"


def compare(ours: dict[str, dict[int, float]], truth: dict[str, dict[int, float]], steps: range) -> None:
    for tag in ("loss", "learning-rate", "grad-norm"):
        assert sorted(ours[tag]) == list(steps), tag
        assert {s: truth[tag][s] for s in steps} == pytest.approx(ours[tag], rel=1e-6), tag


def test_training_with_evaluation_matches_mindformers_at_every_step(stages: Path) -> None:
    evaluations = (stages.parent / "tb_first.log").read_text().count("Eval result: {'PerplexityMetric'")
    assert evaluations == 4  # after steps 10, 20, 30 and 40
    compare(scalars(stages / "tb_first" / "rank_0"), scalars(stages / "tensorboard" / "rank_0"), range(1, 41))


def test_resumed_training_continues_at_mindformers_global_step(stages: Path) -> None:
    truth = scalars(stages / "tensorboard_resumed" / "rank_0")
    assert min(truth["loss"]) == 21  # mindformers' own curve continues after the checkpoint
    compare(scalars(stages / "tb_resumed" / "rank_0"), truth, range(21, 41))
