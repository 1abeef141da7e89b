"""``--run-name TEMPLATE``: experiments replayed into one logdir, told apart in TensorBoard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sidecar.cli import main
from sidecar.output.run_names import check_template, render
from tb_server import tensorboard

REAL = Path(__file__).parent / "fixtures" / "real"
SESSION_GROUPS = {"experimentName": "", "startIndex": 0, "sliceSize": 20,
                  "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"],
                  "colParams": [{"hparam": "run.world_size"}, {"hparam": "run.dataset_size"}, {"metric": {"tag": "loss"}}]}


def test_three_experiments_in_one_logdir_are_told_apart_in_hparams_and_scalars(tmp_path: Path) -> None:
    out = tmp_path / "summary"
    hashes = {}
    for run in ("mf1.9-single", "mf1.9-pynative", "mf1.9-dp2"):
        assert main(["replay", str(REAL / run / "output"), "--out", str(out), "--quiet", "--no-aggregate",
                     "--run-name", "{label}/{config_hash}/rank_{rank}", "--label", run]) == 0
        (config_dir,) = (out / run).iterdir()
        hashes[run] = config_dir.name
        assert json.loads((config_dir / "rank_0" / "run.json").read_text())["config_hash"] == config_dir.name
    assert len(set(hashes.values())) == 3
    runs = {run: f"{run}/{digest}/rank_0" for run, digest in hashes.items()}
    with tensorboard(out) as tb:
        experiment = tb.wait_for("/data/plugin/hparams/experiment", lambda a: bool(a and a.get("hparamInfos")),
                                 request=json.dumps({"experimentName": ""}))
        differs = {h["name"]: h["differs"] for h in experiment["hparamInfos"]}  # type: ignore[index]
        assert differs["run.world_size"] and differs["run.dataset_size"] and not differs["run.model"]
        groups = tb.get("/data/plugin/hparams/session_groups", request=json.dumps(SESSION_GROUPS))
        sessions = {g["name"]: g for g in groups["sessionGroups"]}  # type: ignore[index]
        assert set(sessions) == {*runs.values(), f"mf1.9-dp2/{hashes['mf1.9-dp2']}/rank_1"}
        shown = {run: (sessions[name]["hparams"]["run.world_size"], sessions[name]["hparams"]["run.dataset_size"])
                 for run, name in runs.items()}
        assert shown == {"mf1.9-single": (1, 100), "mf1.9-pynative": (1, 20), "mf1.9-dp2": (2, 100)}
        for run, name in runs.items():
            loss = tb.get("/data/plugin/scalars/scalars", run=name, tag="loss")
            assert len(loss) == (40 if run == "mf1.9-pynative" else 200)  # type: ignore[arg-type]
            final = [m["value"] for m in sessions[name]["metricValues"] if m["name"]["tag"] == "loss"]
            assert final == [pytest.approx(loss[-1][2])]  # type: ignore[index]


@pytest.mark.parametrize(("template", "why"), [
    ("{label}", "must contain {rank}"),
    ("{user}/rank_{rank}", "unknown field {user}"),
    ("../rank_{rank}", "'..'"),
    ("/abs/rank_{rank}", "relative path"),
    ("rank_{rank:03d}", "no format spec"),
    ("rank {rank}", "use only letters"),
])
def test_a_bad_template_is_one_line_and_exit_2(template: str, why: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["replay", str(REAL / "mf1.9-single" / "output"), "--out", str(tmp_path / "o"), "--run-name", template])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and why in err[0] and "--run-name" in err[0]


def test_field_values_cannot_leave_out() -> None:
    template = check_template("{label}/{config_hash}/rank_{rank}")
    assert render(template, 3, "../../etc", "ab/cd") == "_.._etc/ab_cd/rank_3"
    assert render(template, 0, "..", None) == "_/unknown/rank_0"
    assert render("rank_{rank}", 7) == "rank_7"
