"""The ``--out`` comparison (:mod:`outputs`) sees what it claims to: equal trees compare equal,
and a point, a text, HParams data or ``run.json`` that differs is named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from outputs import compare, read_out
from parsers.records import Record
from sidecar.cli import main
from sidecar.output.run_writer import RunWriter

RANK_1 = Path(__file__).parent / "fixtures" / "real" / "mf1.9-dp2" / "output" / "log" / "rank_1" / "info.log"


def test_two_replays_are_equal_and_each_kind_of_difference_is_named(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):
        assert main(["replay", str(RANK_1), "--out", str(out), "--quiet", "--instance", "test"]) == 0
    assert compare(a, b) == []
    shown = read_out(a)["rank_1"]
    assert {"loss", "batch-size", "B-samples-per-day"} <= shown.scalars.keys()
    assert {"config", "parallel-layout"} <= shown.texts.keys() and shown.hparams

    content = json.loads((b / "rank_1" / "run.json").read_text())
    content["settings"]["run.global_batch_size"] = 5
    (b / "rank_1" / "run.json").write_text(json.dumps(content))
    shutil.rmtree(b / "rank_1" / "vs_samples")
    writer = RunWriter(b / "rank_1")
    writer.write(Record(1000, 0.0, {"loss": 1.0}, {"config": "another card"}))
    writer.close()
    found = compare(a, b)
    assert any(line.startswith("rank_1/run.json differs: settings.run.global_batch_size:") for line in found), found
    assert any(line.startswith("rank_1/vs_samples loss_vs_samples: steps only in expected:") for line in found), found
    assert "rank_1 loss: steps only in got: [1000] (1)" in found
    assert "rank_1 config: steps only in got: [1000] (1)" in found


def test_texts_are_read_back_with_the_purge_of_a_resume(tmp_path: Path) -> None:
    """A resume's START at step 5 drops a text at step 10, as TensorBoard shows it: ``tb_read.texts``
    agrees with :func:`outputs.read_run` (texts kept through a purge would hide a text written twice)."""
    from tb_read import texts

    run = tmp_path / "rank_0"
    writer = RunWriter(run)
    writer.write(Record(3, 1.0, texts={"events/note": "early"}))
    writer.write(Record(10, 2.0, texts={"events/note": "late"}))
    writer.resume(5, 3.0, "resumed at 5")
    writer.close()
    assert texts(run) == read_out(tmp_path)["rank_0"].texts == {"events/note": {3: "early"},
                                                                 "events/resume": {5: "resumed at 5"}}
