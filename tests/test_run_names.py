"""``--run-name TEMPLATE``: experiments replayed into one logdir, told apart in TensorBoard."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from sidecar.cli import main
from sidecar.output.run_names import check_template, render
from tb_read import raw_points, scalars
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
    ("{label}_{rank}", "the only field of its path component"),
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


def _shifted_copy(src: Path, dst: Path, by: float) -> Path:
    """``src`` with every logged loss ``by`` higher: another experiment of the same shape."""
    shutil.copytree(src, dst)
    for path in dst.rglob("*.log"):
        text = path.read_text()
        path.write_text(re.sub(r"loss:\[\s*([0-9.]+)/\s*([0-9.]+)\]",
                               lambda m: f"loss:[{float(m[1]) + by:.6f}/{float(m[2]) + by:.6f}]", text))
    return dst


@pytest.mark.parametrize(("template", "jobs"), [("{label}/rank_{rank}", "1"), ("{label}/{config_hash}/rank_{rank}", "1"),
                                                ("{label}/{config_hash}/rank_{rank}", "2")])
def test_each_experiment_has_its_own_aggregate_and_layout(tmp_path: Path, template: str, jobs: str) -> None:
    """Two replays of different logs into one --out, as the README compares experiments: each
    experiment's aggregate holds the mean of its own ranks (the other's losses are 10 higher) and
    sits beside them, with its layout; the second replay is not lost in the first's aggregate."""
    logs = {"base": REAL / "mf1.9-dp2" / "output",
            "shifted": _shifted_copy(REAL / "mf1.9-dp2" / "output", tmp_path / "shifted", 10.0)}
    out = tmp_path / "summary"
    for label, src in logs.items():
        assert main(["replay", str(src), "--out", str(out), "--quiet", "--instance", "n0", "--jobs", jobs,
                     "--run-name", template, "--label", label]) == 0
    means = {}
    for label in logs:
        (rank_0,) = out.glob(f"{label}/**/rank_0")
        experiment = rank_0.parent
        ranks = [scalars(experiment / f"rank_{r}")["loss"] for r in (0, 1)]
        aggregate = scalars(experiment / "aggregate" / "n0")["loss/mean"]
        assert sorted(aggregate) == sorted(ranks[0]) == list(range(1, 201))
        for step, mean in aggregate.items():  # float32, as the ranks' values were written
            assert mean == pytest.approx(float(np.float32((ranks[0][step] + ranks[1][step]) / 2)), rel=1e-6)
        assert (experiment / "layout" / "n0").is_dir()
        means[label] = aggregate
    assert all(means["shifted"][s] == pytest.approx(means["base"][s] + 10, rel=1e-5) for s in means["base"])
    assert not (out / "aggregate").exists() and not (out / "layout").exists()


@pytest.mark.parametrize("template", ["{label}/rank_{rank}", "{label}/{config_hash}/rank_{rank}"])
def test_an_experiment_goes_on_from_its_own_checkpoint(tmp_path: Path, template: str) -> None:
    """Each experiment replayed while its logs had half their steps, then again once they are whole,
    with the other experiment's replays in between: every step of each aggregate once, its own mean."""
    full = {"base": REAL / "mf1.9-dp2" / "output",
            "shifted": _shifted_copy(REAL / "mf1.9-dp2" / "output", tmp_path / "shifted", 10.0)}
    out = tmp_path / "summary"
    growing = {label: tmp_path / "growing" / label for label in full}
    for label, src in full.items():  # every log cut after its 100th step record
        for path in src.rglob("*.log"):
            lines = path.read_text().splitlines(keepends=True)
            steps = [i for i, line in enumerate(lines) if "loss:[" in line]
            cut = growing[label] / path.relative_to(src)
            cut.parent.mkdir(parents=True, exist_ok=True)
            cut.write_text("".join(lines[: steps[99] + 1] if len(steps) > 100 else lines))
    for whole in (False, True):
        for label, src in full.items():
            if whole:
                for path in src.rglob("*.log"):
                    shutil.copyfile(path, growing[label] / path.relative_to(src))  # appended to, in effect
            assert main(["replay", str(growing[label]), "--out", str(out), "--quiet", "--instance", "n0",
                         "--run-name", template, "--label", label]) == 0
    for label in full:
        (rank_0,) = out.glob(f"{label}/**/rank_0")
        aggregate = rank_0.parent / "aggregate" / "n0"
        assert max(raw_points(aggregate).values()) == 1
        ranks = [scalars(rank_0.parent / f"rank_{r}")["loss"] for r in (0, 1)]
        means = scalars(aggregate)["loss/mean"]
        assert sorted(means) == list(range(1, 201))
        for step, mean in means.items():
            assert mean == pytest.approx(float(np.float32((ranks[0][step] + ranks[1][step]) / 2)), rel=1e-6)


def test_the_job_aggregate_follows_the_run_naming(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``mstb-sidecar aggregate`` given the node sidecars' --run-name and --label: each experiment's
    job aggregate is beside its ranks and holds their mean; a template it cannot follow is one line."""
    logs = {"base": REAL / "mf1.9-dp2" / "output",
            "shifted": _shifted_copy(REAL / "mf1.9-dp2" / "output", tmp_path / "shifted", 10.0)}
    out = tmp_path / "summary"
    naming = ["--run-name", "{label}/rank_{rank}"]
    for label, src in logs.items():
        assert main(["replay", str(src), "--out", str(out), "--quiet", "--no-aggregate", *naming, "--label", label]) == 0
    for label in logs:
        assert main(["aggregate", "--out", str(out), "--once", "--quiet", *naming, "--label", label]) == 0
        ranks = [scalars(out / label / f"rank_{r}")["loss"] for r in (0, 1)]
        aggregate = scalars(out / label / "aggregate" / "job")["loss/mean"]
        assert sorted(aggregate) == list(range(1, 201))
        for step, mean in aggregate.items():
            assert mean == pytest.approx(float(np.float32((ranks[0][step] + ranks[1][step]) / 2)), rel=1e-6)
        assert (out / label / "layout" / "job").is_dir()
    assert not (out / "aggregate").exists()
    capsys.readouterr()
    assert main(["aggregate", "--out", str(out), "--once", "--run-name", "{label}/{config_hash}/rank_{rank}"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "cannot follow {config_hash}" in line


def test_the_default_naming_keeps_the_aggregate_and_layout_where_they_were(tmp_path: Path) -> None:
    out = tmp_path / "summary"
    assert main(["replay", str(REAL / "mf1.9-dp2" / "output"), "--out", str(out), "--quiet", "--instance", "n0"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [".mstb-sidecar", "aggregate", "layout", "rank_0", "rank_1"]
    assert len(scalars(out / "aggregate" / "n0")["loss/mean"]) == 200 and (out / "layout" / "n0").is_dir()
    assert (out / ".mstb-sidecar" / "state-n0.json").is_file()


def test_each_experiment_has_its_own_checkpoint(tmp_path: Path) -> None:
    """The same logs replayed under two labels: the second experiment is written whole (one shared
    checkpoint said the logs were read to their end); replaying the first again writes nothing twice."""
    out = tmp_path / "summary"
    replay = ["replay", str(REAL / "mf1.9-dp2" / "output"), "--out", str(out), "--quiet", "--instance", "n0",
              "--run-name", "{label}/rank_{rank}"]
    for label in ("a", "b", "a"):
        assert main([*replay, "--label", label]) == 0
    for label in ("a", "b"):
        for run in ("rank_0", "rank_1", "aggregate/n0"):
            points = raw_points(out / label / run)
            assert points and max(points.values()) == 1, f"{label}/{run}: empty, or a point written twice"
            assert sum(1 for tag, _ in points if tag in ("loss", "loss/mean")) == 200, f"{label}/{run}"
    names = sorted(p.name for p in (out / ".mstb-sidecar").glob("state-*.json"))
    assert [re.sub(r"-[0-9a-f]{8}\.json$", "", name) for name in names] == ["state-n0@a_", "state-n0@b_"]
