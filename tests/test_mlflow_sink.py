"""``--mlflow``: the runs in a real MLflow tracking server, read back with MLflow's own client.

One ``mlflow server`` (SQLite backend, 127.0.0.1), the session's (``conftest.mlflow_server``, shared
with ``test_model_sinks`` in one pytest-xdist group); each test has its experiment.
The sink is driven directly (tags, params and lifecycle; points that wait in the spool while the
server is down and are sent once by the next start; a segment sent in part before a kill) and
through the real command: a replay of genuine mindformers logs gives one MLflow run per
TensorBoard run whose metric histories equal the TensorBoard curves point for point (float32, as
the event files hold them), and a live sidecar SIGKILLed and restarted, with the server stopped
and started again meanwhile, sends every point exactly once.
"""

from __future__ import annotations

import json
import math
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from live_helpers import RankLog, Sidecar, paced, wait_until
from mlflow_server import MLflowServer
from outputs import read_out, same_value
from parsers.records import Record
from sidecar.output.event_scan import RunView
from sidecar.output.mlflow_sink import MLflowSink
from sidecar.output.tensorboard import TensorBoardSink

pytest.importorskip("mlflow")

pytestmark = pytest.mark.xdist_group("model-sinks")  # the worker that has the session's MLflow server

REAL = Path(__file__).parent / "fixtures" / "real"
BIN = Path(sys.executable).with_name("mstb-sidecar")


@pytest.fixture
def server(mlflow_server: MLflowServer) -> MLflowServer:
    return mlflow_server


def runs_of(server: MLflowServer, experiment: str) -> dict:
    """Run name -> run, of ``experiment`` (none when it does not exist yet)."""
    client = server.client()
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return {}
    return {run.info.run_name: run for run in client.search_runs([found.experiment_id], max_results=1000)}


def f32(value: float) -> float:
    """As an event file holds it (MLflow keeps +-inf as +-1.8e308)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def history(server: MLflowServer, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in server.client().get_metric_history(run_id, key))


# -- the sink on its own ----------------------------------------------------------------------
def test_params_tags_and_lifecycle(server: MLflowServer, tmp_path: Path) -> None:
    """One MLflow run per run, tagged; settings as params (a long value cut visibly, the full
    ones in settings.json); texts as tags; FINISHED and FAILED from the lifecycle texts, and
    the aggregate ends FAILED when a rank did."""
    (tmp_path / "rank_0").mkdir()
    (tmp_path / "rank_0" / "run.json").write_text(json.dumps({"config_hash": "abc123", "settings": {}}))
    sink = MLflowSink(server.uri, tmp_path, "node-a", "limits", 30)
    sink.restore(None)
    long = "x" * 7000
    settings = {"run.world_size": 2, "model.num_layers": 4, "note": long, "bad key[0]": True, "none": None}
    sink.meta("rank_0", 0, settings)
    for step in range(1, 4):
        for rank in (0, 1):
            sink.write(f"rank_{rank}", rank, Record(step, 1_800_000_000.0 + step, {"loss": rank + step / 4}))
        sink.write("aggregate/node-a", None, Record(step, 1_800_000_000.0 + step, {"loss/mean": 0.5 + step / 4}))
    sink.write("rank_0", 0, Record(3, 1_800_000_010.0, texts={"alerts/loss-spike": "rank 0: loss spike at step 3"}))
    sink.write("rank_0", 0, Record(3, 1_800_000_011.0, texts={"events/lifecycle/finished": "rank 0: training finished"}))
    sink.write("rank_1", 1, Record(3, 1_800_000_012.0, texts={"events/lifecycle/failed": "rank 1: training died"}))
    assert sink.sync()["segment"] == 1
    sink.close()
    assert sink.health()["sent"] == 9 and sink.health()["queued"] == 0

    runs = runs_of(server, "limits")
    assert set(runs) == {"rank_0", "rank_1", "aggregate/node-a"}
    rank0 = runs["rank_0"]
    assert {k: rank0.data.tags[k] for k in ("rank", "instance", "config_hash", "mstb.run")} == \
        {"rank": "0", "instance": "node-a", "config_hash": "abc123", "mstb.run": "rank_0"}
    assert rank0.data.tags["host"]
    assert rank0.data.params["note"] == "x" * 5999 + "…"
    assert rank0.data.params["bad key_0_"] == "true" and rank0.data.params["none"] == "null"
    assert rank0.data.params["model.num_layers"] == "4"
    full = server.client().download_artifacts(rank0.info.run_id, "settings.json", str(tmp_path))
    assert json.loads(Path(full).read_text())["settings"]["note"] == long
    assert rank0.data.tags["alerts/loss-spike"] == "rank 0: loss spike at step 3"
    assert (rank0.info.status, runs["rank_1"].info.status, runs["aggregate/node-a"].info.status) == \
        ("FINISHED", "FAILED", "FAILED")
    assert rank0.info.end_time == 1_800_000_011_000
    assert history(server, rank0.info.run_id, "loss") == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert "rank" not in runs["aggregate/node-a"].data.tags


def test_server_down_then_up_and_restart(server: MLflowServer, tmp_path: Path) -> None:
    """Points handed over while the server is down wait in the spool (retried, counted); a new
    sink (a restart) sends them once the server is back, with the ones it is handed again
    (``again``) not repeated, and a resume's later points beside the superseded ones."""
    down = MLflowServer(tmp_path / "down")  # nothing listens on its port
    sink = MLflowSink(down.uri, tmp_path, "n", "outage", 1)
    sink.restore(None)
    for step in range(1, 2501):  # more than one log_batch request
        sink.write("rank_0", 0, Record(step, 1_800_000_000.0 + step, {"loss": step * 0.5, "lr": 1e-3}))
    state = sink.sync()
    wait_until(lambda: sink.health()["retries"] >= 2, 60, "the sender to retry")
    assert sink.health()["queued"] == 5000
    sink.close()  # gives up after the drain timeout: the points stay in the spool

    sink = MLflowSink(server.uri, tmp_path, "n", "outage", 30)
    sink.restore(state)
    for step in range(2400, 2601):
        sink.write("rank_0", 0, Record(step, 1_800_000_000.0 + step, {"loss": step * 0.5}), again=step <= 2500)
    sink.resume("rank_0", 0, 2590, 1_800_010_000.0)
    for step in range(2590, 2596):
        sink.write("rank_0", 0, Record(step, 1_800_010_000.0 + step, {"loss": -step}))
    sink.sync()
    sink.close()

    run = runs_of(server, "outage")["rank_0"]
    points = server.client().get_metric_history(run.info.run_id, "loss")
    before = {(m.step, m.value) for m in points if m.timestamp < 1_800_010_000_000}
    after = sorted((m.step, m.value) for m in points if m.timestamp >= 1_800_010_000_000)
    assert len(points) == 2600 + 6 and before == {(s, s * 0.5) for s in range(1, 2601)}
    assert after == [(s, -s) for s in range(2590, 2596)]
    assert history(server, run.info.run_id, "mstb/resumed-at") == [(2590, 2590)]
    assert len(server.client().get_metric_history(run.info.run_id, "lr")) == 2500


@pytest.mark.parametrize("viewed", [True, False], ids=["from-the-checkpoint", "a-run-without-a-view"])
def test_a_resume_spooled_after_the_checkpoint_is_handed_again_once(server: MLflowServer, tmp_path: Path,
                                                                   viewed: bool) -> None:
    """A run written past the checkpoint through a resume, spooled, then killed before the checkpoint
    was saved: the restart hands the run's events past the checkpoint (or all of them, for a run the
    checkpoint has no view of, as a rank's ``vs samples`` twins) again, the superseded segment's
    first, whose steps lie past the new segment's. Nothing of it is spooled twice, and the points
    written after the restart, at steps the old segment had, are all sent."""
    experiment = f"rehand-{viewed}"

    def at(step: int, segment: int) -> Record:
        return Record(step, 1_800_000_000.0 + segment * 1000 + step, {"loss": segment * 100.0 + step})

    sink = MLflowSink(server.uri, tmp_path, "n", experiment, 30)
    sink.restore(None)
    tensorboard = TensorBoardSink(tmp_path, None, [sink])
    writer = tensorboard.writer("rank_0", 0)
    for step in range(1, 21):
        writer.write(at(step, 1))
    tensorboard.sync()
    view = writer.sync()
    checkpoint = RunView(dict(view.watermarks), view.file, view.size), sink.sync()
    for step in range(21, 31):
        writer.write(at(step, 1))
    writer.resume(10, 1_800_002_010.0, "training resumed at step 10")
    for step in range(10, 16):
        writer.write(at(step, 2))
    tensorboard.sync()
    sink.sync()  # spooled; then killed before the checkpoint was saved
    sink.close()

    sink = MLflowSink(server.uri, tmp_path, "n", experiment, 30)
    sink.restore(checkpoint[1])
    tensorboard = TensorBoardSink(tmp_path, None, [sink])
    writer = tensorboard.writer("rank_0", 0, checkpoint[0] if viewed else None)
    for step in range(16, 26):
        writer.write(at(step, 2))
    tensorboard.sync()
    sink.sync()
    sink.close()

    run = runs_of(server, experiment)["rank_0"]
    assert history(server, run.info.run_id, "loss") == sorted(
        [(s, 100.0 + s) for s in range(1, 31)] + [(s, 200.0 + s) for s in range(10, 26)])
    assert history(server, run.info.run_id, "mstb/resumed-at") == [(10, 10)]


def test_spooled_but_unconfirmed_is_reconciled(server: MLflowServer, tmp_path: Path) -> None:
    """A segment sent in part before a kill (its sent mark never written) is checked against the
    server after the restart: what the server holds is not sent again."""
    sink = MLflowSink(server.uri, tmp_path, "n", "reconcile", 30)
    sink.restore(None)
    for step in range(1, 1501):
        sink.write("rank_0", 0, Record(step, 1_800_000_000.0 + step, {"loss": float(step)}))
    sink.sync()
    sink.close()
    spool = sink.spool.dir
    ops = [json.loads(line) for line in (spool / "seg-0000000001.jsonl").read_text().splitlines()] \
        if (spool / "seg-0000000001.jsonl").exists() else None
    assert ops is None  # sent and confirmed: deleted
    # the state after a kill between the server's answer and the sent mark: segment 1 unconfirmed
    sent = json.loads((spool / "sent.json").read_text())
    (spool / "sent.json").write_text(json.dumps({**sent, "segment": 0}))
    lines = [json.dumps(["n", "rank_0", 0])] + [json.dumps(["m", "rank_0", "loss", float(s), s, (1_800_000_000 + s) * 1000])
                                                 for s in range(1, 1501)]
    (spool / "seg-0000000001.jsonl").write_text("\n".join(lines) + "\n")
    sink = MLflowSink(server.uri, tmp_path, "n", "reconcile", 30)
    sink.restore(None)
    sink.close()
    run = runs_of(server, "reconcile")["rank_0"]
    assert history(server, run.info.run_id, "loss") == [(s, float(s)) for s in range(1, 1501)]
    assert len(runs_of(server, "reconcile")) == 1


def test_bad_uri_warns_and_keeps_the_points(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A URI MLflow cannot use: a warning and retries, never an exception; the points stay spooled."""
    sink = MLflowSink("nonsense://nowhere", tmp_path, "n", "bad", 1)
    sink.restore(None)
    sink.write("rank_0", 0, Record(1, None, {"loss": 1.0}))
    sink.sync()
    wait_until(lambda: sink.health()["retries"] >= 1, 60, "a failed attempt")
    sink.close()
    assert sink.health()["queued"] == 1
    assert any("nonsense://nowhere" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)


def test_without_the_extra_one_line_error(tmp_path: Path) -> None:
    """``--mlflow`` where MLflow's client is not installed: exit 2 with one line naming the extra."""
    code = ("import sys; sys.modules['mlflow'] = None; from sidecar.cli import main; "
            f"sys.exit(main(['replay', {str(REAL / 'mf1.9-single' / 'output')!r}, '--out', {str(tmp_path)!r}, "
            "'--mlflow', 'http://127.0.0.1:1']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parent.parent)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'mstb-sidecar[mlflow]'" in lines[0] and "--mlflow" in lines[0]


# -- through the command ----------------------------------------------------------------------
def assert_as_tensorboard(server: MLflowServer, out: Path, experiment: str) -> dict:
    """Every run under ``out`` with curves or texts is an MLflow run whose metric histories are its
    TensorBoard curves, point for point, none repeated; returns the MLflow runs by name."""
    tree, runs = read_out(out), runs_of(server, experiment)
    shown = {name for name, run in tree.items() if run.scalars}
    assert shown and shown <= set(runs), (sorted(shown), sorted(runs))
    for name in shown:
        run_id = runs[name].info.run_id
        for tag, points in tree[name].scalars.items():
            got = server.client().get_metric_history(run_id, tag)
            steps = [m.step for m in got]
            assert len(steps) == len(set(steps)), f"{name} {tag}: a step repeated in MLflow"
            values = {m.step: f32(m.value) for m in got}
            assert values.keys() == points.keys(), f"{name} {tag}: steps differ"
            assert all(same_value(values[s], v) for s, v in points.items()), f"{name} {tag}: values differ"
    return runs


@pytest.mark.parametrize("name,status", [("mf1.9-dp2/output", "FINISHED"),  # ends in Training Over!
                                         ("mf1.9-crash-noclip/stdout_stderr.log", "FAILED")])  # in a traceback
def test_replay_real_logs(server: MLflowServer, tmp_path: Path, name: str, status: str) -> None:
    """A replay: one MLflow run per rank (and the aggregate, the twins) equal to TensorBoard, the
    settings as params, tagged, ended as the log ended; a second replay adds nothing."""
    job = f"replay-{name.split('/')[0]}"
    cmd = [str(BIN), "replay", str(REAL / name), "--out", str(tmp_path / "tb"), "--mlflow", server.uri,
           "--job", job, "--instance", "ci", "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert not any(line.startswith("Traceback") for line in done.stderr.splitlines())  # the log's own is quoted
    assert "not sent yet" not in done.stderr
    runs = assert_as_tensorboard(server, tmp_path / "tb", job)
    tree = read_out(tmp_path / "tb")
    ranks = sorted(n for n in tree if n.startswith("rank_") and "/" not in n)
    for rank in ranks:
        run, meta = runs[rank], tree[rank].run_json
        assert run.info.status == status
        assert {k: run.data.tags.get(k) for k in ("rank", "instance", "config_hash")} == \
            {"rank": rank[len("rank_"):], "instance": "ci", "config_hash": meta["config_hash"]}
        params = run.data.params
        assert len(params) == len(meta["settings"])
        for key, value in meta["settings"].items():
            assert params[key] == (value if isinstance(value, str) else json.dumps(value)), key
        assert "events/lifecycle/" + status.lower() in run.data.tags
    assert runs["aggregate/ci"].info.status == status
    counts = {n: len(server.client().get_metric_history(r.info.run_id, "loss")) for n, r in runs.items()}
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    assert counts == {n: len(server.client().get_metric_history(r.info.run_id, "loss"))
                      for n, r in runs_of(server, job).items()}


def test_live_sigkill_and_server_outage(server: MLflowServer, tmp_path: Path) -> None:
    """Live, two ranks: the sidecar is SIGKILLed and restarted while they write, the server is
    stopped and started again meanwhile; every point reaches MLflow once, and the runs end
    FINISHED at ``Training Over!``."""
    logs = [RankLog(tmp_path / "output" / "log" / f"rank_{r}" / "info.log", r) for r in (0, 1)]
    job, out = "live", tmp_path / "tb"
    sidecar = Sidecar([tmp_path / "output"], out, "inotify", tmp_path, "--mlflow", server.uri, "--job", job,
                      "--checkpoint-interval", "0.3")

    def write(steps: int, seconds: float) -> None:
        for _ in paced(range(steps), seconds / steps):
            for log in logs:
                log.step()

    try:
        write(40, 0.5)
        sidecar.start()
        write(40, 2.0)
        sidecar.kill()  # between two checkpoints, as likely as not with points sent and not marked
        sidecar.start()
        write(40, 1.5)
        server.stop()
        write(40, 2.0)
        sidecar.kill()  # while the server is down: the spool holds what it could not send
        sidecar.start()
        write(40, 1.0)
        server.start()
        write(40, 1.0)
        for log in logs:
            log.say(".........Training Over!.............")
        wanted = {f"rank_{log.rank}": len(log.expected) for log in logs}

        def all_there() -> bool:
            runs = runs_of(server, job)
            return all(name in runs and runs[name].info.status == "FINISHED" and
                       len(history(server, runs[name].info.run_id, "loss")) >= count
                       for name, count in wanted.items())

        wait_until(all_there, 180, "every point and the finish in MLflow", every=1.0)
        rc, _ = sidecar.stop(signal.SIGTERM)
        assert rc == 0, sidecar.stderr()
    finally:
        sidecar.cleanup()
        if server.proc is None:
            server.start()
    assert "Traceback" not in sidecar.stderr(all_runs=True)
    runs = assert_as_tensorboard(server, out, job)
    for log in logs:
        run_id = runs[f"rank_{log.rank}"].info.run_id
        assert history(server, run_id, "loss") == sorted(log.expected.items())


def test_live_genuine_logs_across_kills(server: MLflowServer, tmp_path: Path) -> None:
    """Live on the genuine mindformers 1.9 logs of two ranks, arriving in three parts with a
    SIGKILL after each of the first two (one once caught up, one while a part is being written):
    the MLflow runs equal the TensorBoard runs point for point, none repeated, and end FINISHED."""
    sources = sorted((REAL / "mf1.9-dp2" / "output" / "log").glob("rank_*/info.log"))
    targets = [tmp_path / "output" / "log" / src.parent.name / "info.log" for src in sources]
    parts = []
    for src, target in zip(sources, targets):
        target.parent.mkdir(parents=True)
        lines = src.read_bytes().splitlines(keepends=True)
        third = len(lines) // 3
        parts.append((target, [b"".join(lines[:third]), b"".join(lines[third:2 * third]), b"".join(lines[2 * third:])]))
    job, out = "live-genuine", tmp_path / "tb"
    sidecar = Sidecar([tmp_path / "output"], out, "inotify", tmp_path, "--mlflow", server.uri, "--job", job,
                      "--checkpoint-interval", "0.3")

    def write(part: int) -> None:
        for target, pieces in parts:
            with target.open("ab") as f:
                f.write(pieces[part])

    try:
        write(0)
        sidecar.start()
        sidecar.caught_up()
        sidecar.kill()
        sidecar.start()
        write(1)
        sidecar.kill()  # as likely as not before the second part is all read
        sidecar.start()
        write(2)

        sidecar.caught_up()
        shown = {name: len(run.scalars["loss"]) for name, run in read_out(out).items() if "loss" in run.scalars}
        assert set(shown) >= {"rank_0", "rank_1"}, sorted(shown)

        def finished() -> bool:
            runs = runs_of(server, job)
            return all(name in runs and runs[name].info.status == "FINISHED" and
                       len(history(server, runs[name].info.run_id, "loss")) >= count for name, count in shown.items())

        wait_until(finished, 180, "every loss point and the finish in MLflow", every=1.0)
        rc, _ = sidecar.stop(signal.SIGTERM)
        assert rc == 0, sidecar.stderr()
    finally:
        sidecar.cleanup()
    assert "Traceback" not in sidecar.stderr(all_runs=True)
    runs = assert_as_tensorboard(server, out, job)
    assert {"rank_0", "rank_1"} <= set(runs)
