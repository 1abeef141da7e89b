"""What TensorBoard shows, through its HTTP API: text tags under their documented names, and a
custom-scalars layout with a chart for every metric the runs have and none for the others.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tensorboard.compat.proto import summary_pb2
from tensorboardX.proto import event_pb2
from tensorboardX.summary import custom_scalars, text

from sidecar.cli import main
from sidecar.output import run_writer
from sidecar.output.event_file import EventFileWriter
from sidecar.output.event_scan import RunView, scan_run
from sidecar.output.state import StateStore
from live_helpers import Sidecar, tb_points, wait_until
from outputs import newest_layout
from tb_read import raw_points
from tb_server import tensorboard

DP2 = Path(__file__).parent / "fixtures" / "real" / "mf1.9-dp2" / "output"
MAIN = ["loss", "learning-rate", "grad-norm", "loss-scale", "iteration-time", "throughput",
        "model-flops-throughput-per-npu"]  # the metrics the bundled 2-rank run has, loss first
TEXTS = {"events/compile", "events/training-start", "events/training-over", "events/lifecycle/finished"}
HEAD = ("[INFO] 2026-11-29 10:00:{s:02d},000 [mindformers/core/callback/callback.py:747] print_output_info: "
        "{{ Epoch:[  1/  1], step:[{step:5d}/  100], loss: {loss:.6f}, per_step_time: 500ms, lr: 1e-05, "
        "overflow cond: False, loss_scale: 1.0{norm}")
BAR = ("[INFO] 2026-11-29 10:00:{s:02d},001 [mindformers/core/callback/callback.py:764] print_output_info: "
       "  10.0% |█████      | 4.00000 samples/s/p  0:01:00 }}")


def replay(src: Path, out: Path, *extra: str) -> None:
    assert main(["replay", str(src), "--out", str(out), "--instance", "test", "--quiet", *extra]) == 0


def layout_of(answer: object) -> list[tuple[str, list[str]]]:
    """[(category, [chart titles])] of a ``/data/plugin/custom_scalars/layout`` answer."""
    return [(c["title"], [chart["title"] for chart in c["chart"]]) for c in answer.get("category", [])]  # type: ignore[union-attr]


def charts(metrics: list[str], band: bool = True) -> list[tuple[str, list[str]]]:
    return [(m, [f"{m} (all ranks)"] + ([f"{m} (mean, min-max band)"] if band else [])) for m in metrics]


def test_text_tags_and_layout_as_a_user_sees_them(tmp_path: Path) -> None:
    out = tmp_path / "summary"
    replay(DP2, out)
    with tensorboard(out) as tb:
        tags = tb.wait_for("/data/plugin/text/tags", lambda a: len(a) == 2)  # type: ignore[arg-type]
        assert {run: set(t) for run, t in tags.items()} == {"rank_0": TEXTS | {"config"}, "rank_1": TEXTS | {"config"}}  # type: ignore[union-attr]
        shown = tb.get("/data/plugin/text/text", run="rank_0", tag="events/compile")
        assert [p["step"] for p in shown] == [0] and "compil" in shown[0]["text"].lower()  # type: ignore[index]

        want = charts(MAIN)  # the separate losses this run never had get no chart
        layout = tb.wait_for("/data/plugin/custom_scalars/layout", lambda a: layout_of(a) == want)
        assert layout_of(layout) == want
        # Every chart has data: each overlay one curve per rank, each band its aggregate.
        for category in layout["category"]:  # type: ignore[index]
            overlay, band = category["chart"]
            for rank in ("rank_0", "rank_1"):
                got = tb.get("/data/plugin/custom_scalars/scalars", run=rank, tag=overlay["multiline"]["tag"][0])
                assert got["regex_valid"] and list(got["tag_to_events"]) == [category["title"]]
                assert len(got["tag_to_events"][category["title"]]) == 200  # type: ignore[index]
            series = band["margin"]["series"][0]
            assert (series["value"], series["lower"], series["upper"]) == tuple(
                f"{category['title']}/{s}" for s in ("mean", "min", "max"))
            mean = tb.get("/data/plugin/scalars/scalars", run="aggregate/test", tag=series["value"])
            assert len(mean) == 200  # type: ignore[arg-type]


def test_per_rank_overlays_without_the_aggregate(tmp_path: Path) -> None:
    out = tmp_path / "summary"
    replay(DP2, out, "--no-aggregate")
    assert not (out / "aggregate").exists()
    with tensorboard(out) as tb:
        want = charts(MAIN, band=False)
        assert layout_of(tb.wait_for("/data/plugin/custom_scalars/layout", lambda a: layout_of(a) == want)) == want


def write_log(path: Path, steps: range, with_norm: bool) -> None:
    norm = ", global_norm: [0.5]" if with_norm else ""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        for step in steps:
            fh.write(HEAD.format(s=step, step=step, loss=step / 10, norm=norm) + "\n" + BAR.format(s=step) + "\n")


@pytest.mark.parametrize("load_fast", ["true", "false"])
def test_the_layout_is_rewritten_when_a_metric_appears(tmp_path: Path, load_fast: str) -> None:
    """The log prints no grad norm at first; a later replay finds it. TensorBoard shows the
    newest layout of the run (both loaders), which now has the grad-norm charts too."""
    logs, out = tmp_path / "logs", tmp_path / "summary"
    for rank in (0, 1):
        write_log(logs / f"rank_{rank}" / "info.log", range(1, 6), with_norm=False)
    replay(logs, out)
    for rank in (0, 1):
        write_log(logs / f"rank_{rank}" / "info.log", range(6, 11), with_norm=True)
    replay(logs, out)
    layouts = raw_points(out / "layout" / "test")
    assert layouts == {("custom_scalars__config__", 0): 1, ("custom_scalars__config__", 1): 1}
    replay(logs, out)  # nothing new: no third layout
    assert raw_points(out / "layout" / "test") == layouts
    want = charts(["loss", "learning-rate", "grad-norm", "loss-scale", "iteration-time", "throughput"])
    with tensorboard(out, load_fast) as tb:
        assert layout_of(tb.wait_for("/data/plugin/custom_scalars/layout", lambda a: layout_of(a) == want)) == want


def test_an_earlier_versions_layout_is_replaced(tmp_path: Path) -> None:
    """Earlier versions wrote every metric's charts (8 of them empty here) into the aggregate run at
    step 0; TensorBoard would merge them in, first. The aggregate now replaces it with an empty one."""
    out = tmp_path / "summary"
    old = {f"{m} (all ranks)": ["Multiline", [f"^{m}$"]] for m in MAIN + ["lm-loss", "mtp-loss"]}
    writer = EventFileWriter(out / "aggregate" / "test", 0.0)
    writer.write(event_pb2.Event(wall_time=0.0, step=0, summary=custom_scalars({"mstb-sidecar: ranks": old})))
    writer.close()
    replay(DP2, out)
    with tensorboard(out) as tb:
        want = charts(MAIN)
        assert layout_of(tb.wait_for("/data/plugin/custom_scalars/layout", lambda a: layout_of(a) == want)) == want


def test_a_run_written_with_the_old_text_names_gets_no_text_twice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Earlier versions wrote ``events/compile`` as ``events/compile/text_summary``. Reading such
    a run again from scratch (no checkpoint) must recognise those texts under the new name."""
    out = tmp_path / "summary"
    with monkeypatch.context() as m:  # the earlier version's text values
        m.setattr(run_writer, "text_value",  # tensorboardX's proto classes, TensorBoard's bytes
                  lambda tag, value: summary_pb2.Summary.Value.FromString(text(tag, value).value[0].SerializeToString()))
        replay(DP2, out)
    before = raw_points(out / "rank_0")
    assert {t for t, _ in before if t.startswith("events/")} == {f"{t}/text_summary" for t in TEXTS}
    # A restart from that version's checkpoint: its watermarks name the texts the old way.
    run = StateStore(out, "test").load().runs["0"]
    assert "events/compile/text_summary" in run.watermarks
    view = scan_run(out / "rank_0", RunView(run.watermarks, run.file, run.size))
    assert {t: view.watermarks[t] for t in TEXTS} == {t: run.watermarks[f"{t}/text_summary"] for t in TEXTS}
    # A restart without it reads the run: the same.
    StateStore(out, "test").forget()
    replay(DP2, out)
    assert raw_points(out / "rank_0") == before


def test_a_step_written_at_the_aggregate_timeout_gets_its_band_while_nothing_is_read(tmp_path: Path) -> None:
    """Rank 1's log has no step (a rank that died at start-up): rank 0's steps wait for it and a
    live sidecar writes them --aggregate-timeout later, when nothing is read any more. The layout
    gets the band charts then, not only at the next line read or at the stop."""
    logs, out = tmp_path / "logs", tmp_path / "summary"
    write_log(logs / "rank_0" / "info.log", range(1, 4), with_norm=False)
    (logs / "rank_1").mkdir()
    (logs / "rank_1" / "info.log").write_text("")
    sidecar = Sidecar([logs], out, "inotify", tmp_path, "--aggregate-timeout", "0.5", "--checkpoint-interval", "0.2")
    sidecar.start()
    try:
        wait_until(lambda: tb_points(out / "aggregate" / "test", "loss/mean"), 5, "the aggregate's timed-out steps")
        wait_until(lambda: "loss (mean, min-max band)" in layout_titles(out / "layout" / "test"), 5,
                   f"the layout's loss band (it has {layout_titles(out / 'layout' / 'test')})")
        assert sidecar.running(), sidecar.stderr()
    finally:
        sidecar.stop()


def layout_titles(run_dir: Path) -> list[str]:
    """The chart titles of the run's newest layout, as TensorBoard's loader reads it."""
    return [chart.title for category in newest_layout(run_dir).category for chart in category.chart]
