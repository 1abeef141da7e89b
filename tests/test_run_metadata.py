"""Run metadata from the genuine mindformers 1.9 logs: the ``config`` card, HParams data and
``run.json`` match the yaml the run was launched with, read back through TensorBoard."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from live_helpers import LiveEnv, tb_points, tb_text_steps, wait_until
from sidecar.cli import main
from parsers.records import Record
from sidecar.output.event_scan import RunView
from sidecar.output.run_meta import RunMetadata
from sidecar.output.run_writer import RunWriter
from outputs import assert_same_outputs, read_run
from tb_read import scalars, texts
from tb_server import tensorboard

REAL = Path(__file__).parent / "fixtures" / "real"
LAUNCHED = REAL / "mf1.9-dp2" / "tiny_llama.yaml"  # the recipe's yaml as it was when the run was recorded
# What mindformers itself rewrites between the yaml and its pprint dump (base_trainer, check_runner_config).
REWRITTEN = {"lr_schedule.total_steps": 200, "runner_config.sink_size": -1,
             "tensorboard.tensorboard_dir": "./output/tensorboard/rank_0"}
pytest_plugins = ["live_helpers"]

NOT_IN_DUMP = {"model.model_config.checkpoint_name_or_path"}  # popped when the model is built


def _yaml_leaves() -> dict[str, object]:
    """tiny_llama.yaml as launched in dp2 mode (launch.py's overrides), flattened like the sidecar does."""
    config = yaml.safe_load(LAUNCHED.read_text())
    config["use_parallel"] = True
    config["parallel_config"]["data_parallel"] = 2
    out: dict[str, object] = {}

    def walk(key: str, value: object) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{key}.{k}" if key else k, v)
        else:
            out[key] = value
    walk("", config)
    return out


def _hparams(run_dir: Path) -> dict[str, object]:
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    start = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    return {k: getattr(v, v.WhichOneof("kind")) for k, v in start.hparams.items()}


@pytest.fixture(scope="module")
def dp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dp2") / "summary"
    assert main(["replay", str(REAL / "mf1.9-dp2" / "output"), "--out", str(out), "--quiet"]) == 0
    return out


def test_config_card_and_hparams_match_the_yaml_of_the_run(dp2: Path) -> None:
    leaves = _yaml_leaves()
    rank0 = _hparams(dp2 / "rank_0")
    card = texts(dp2 / "rank_0")["config"]
    assert list(card) == [1]  # once, at the first step
    for key, value in leaves.items():
        if key in NOT_IN_DUMP:
            assert key not in rank0
            continue
        expected = REWRITTEN.get(key, value)
        if isinstance(expected, list):  # a list is shown as JSON text
            assert json.loads(rank0[key]) == expected, key
        else:
            assert rank0[key] == expected, key
            assert f"| `{key}` | {expected} |" in card[1]
    run = json.loads((dp2 / "rank_0" / "run.json").read_text())
    assert run["run"]["global_batch_size"] == 4 and run["run"]["world_size"] == 2
    assert run["run"]["mode"] == "GRAPH_MODE" and run["run"]["model"] == "llama_tiny"
    assert run["settings"]["model.model_config.hidden_size"] == 64
    assert f"**config hash** `{run['config_hash']}`" in card[1]
    # rank 1 prints no pprint dump: it shows the job's, without rank 0's own values
    rank1 = _hparams(dp2 / "rank_1")
    assert rank1["model.model_config.num_layers"] == 2 and rank1["run.global_batch_size"] == 4
    assert "context.device_id" not in rank1 and "tensorboard.tensorboard_dir" not in rank1
    assert json.loads((dp2 / "rank_1" / "run.json").read_text())["config_hash"] == run["config_hash"]


def test_hparams_through_the_tensorboard_server(dp2: Path) -> None:
    with tensorboard(dp2) as tb:
        request = json.dumps({"experimentName": ""})
        experiment = tb.wait_for("/data/plugin/hparams/experiment", lambda a: bool(a and a.get("hparamInfos")),
                                 request=request)
        names = {info["name"] for info in experiment["hparamInfos"]}
        assert {"model.model_config.hidden_size", "lr_schedule.learning_rate", "run.global_batch_size"} <= names
        assert {m["name"]["tag"] for m in experiment["metricInfos"]} >= {"loss", "learning-rate"}
        groups = tb.get("/data/plugin/hparams/session_groups", request=json.dumps({
            "experimentName": "", "startIndex": 0, "sliceSize": 10,
            "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"],
            "colParams": [{"hparam": "lr_schedule.learning_rate"}, {"metric": {"tag": "loss"}}]}))
        by_run = {g["name"]: g for g in groups["sessionGroups"]}
        assert set(by_run) >= {"rank_0", "rank_1"}
        assert by_run["rank_0"]["hparams"]["lr_schedule.learning_rate"] == 0.001
        loss = [m["value"] for m in by_run["rank_0"]["metricValues"] if m["name"]["tag"] == "loss"]
        shown = scalars(dp2 / "rank_0")["loss"]
        assert loss == [pytest.approx(shown[max(shown)])]  # the last loss of the run


def _hash(src: Path, out: Path) -> str:
    assert main(["replay", str(src), "--out", str(out), "--quiet"]) == 0
    return json.loads((out / "rank_0" / "run.json").read_text())["config_hash"]


def test_hash_is_the_same_for_a_run_of_one_config_and_differs_when_one_value_changes(tmp_path: Path) -> None:
    original = _hash(REAL / "mf1.9-dp2" / "output", tmp_path / "a")
    # the same configuration run elsewhere: other directory, host and time
    moved = tmp_path / "moved"
    shutil.copytree(REAL / "mf1.9-dp2" / "output", moved)
    for path in moved.rglob("*.log"):
        text = path.read_text().replace("/work/mfruns/dp2", "/scratch/other").replace("host_name: vm", "host_name: n7")
        path.write_text(text.replace("2026-11-29 15:5", "2026-12-24 09:1"))
    assert _hash(moved, tmp_path / "b") == original
    # one value changed (the seed, printed only in the pprint dump)
    worker = moved / "msrun_log" / "worker_0.log"
    worker.write_text(worker.read_text().replace(" 'seed': 0,\n", " 'seed': 1,\n", 1))
    assert _hash(moved, tmp_path / "c") != original


def test_replaying_again_writes_no_second_card(dp2: Path) -> None:
    before = (dp2 / "rank_0" / "run.json").stat().st_mtime_ns
    assert main(["replay", str(REAL / "mf1.9-dp2" / "output"), "--out", str(dp2), "--quiet"]) == 0
    assert list(texts(dp2 / "rank_0")["config"]) == [1]
    assert (dp2 / "rank_0" / "run.json").stat().st_mtime_ns == before


def test_a_new_job_in_the_same_directory_writes_its_own_card_after_the_resume_marker(tmp_path: Path) -> None:
    log = tmp_path / "output" / "log" / "rank_0" / "info.log"
    log.parent.mkdir(parents=True)
    first = (REAL / "mf1.9-dp2" / "output" / "log" / "rank_0" / "info.log").read_text()
    second = (REAL / "mf1.9-single" / "output" / "log" / "rank_0" / "info.log").read_text()
    log.write_text(first + second.replace("2026-11-29", "2026-11-30"))  # the single-process job, a day later
    out = tmp_path / "summary"
    assert main(["replay", str(tmp_path / "output"), "--out", str(out), "--quiet", "--no-aggregate"]) == 0
    card = texts(out / "rank_0")["config"]
    assert list(card) == [1]  # the first job's card at step 1 was purged by the resume marker at 1
    assert "| `run.global_batch_size` | 2 |" in card[1] and "| `run.world_size` | 1 |" in card[1]
    assert _hparams(out / "rank_0")["run.global_batch_size"] == 2
    assert json.loads((out / "rank_0" / "run.json").read_text())["run"]["global_batch_size"] == 2
    assert sorted(scalars(out / "rank_0" / "vs_samples")["loss_vs_samples"]) == [2 * s for s in range(1, 201)]


def test_a_hash_of_the_start_up_lines_alone_says_it_is_partial_and_what_it_covers(tmp_path: Path) -> None:
    """Two single-process runs with ``info.log`` alone, one with the genuine lr schedule, one at a
    fixed 1e-3: the start-up lines are the same, so the hashes are too; they must
    say they are partial, and the card which settings they cover; the full dump's hash is not."""
    genuine = (REAL / "mf1.9-single" / "output" / "log" / "rank_0" / "info.log").read_text()
    fixed = re.sub(r"lr: [0-9.e+-]+,", "lr: 0.001,", genuine)
    assert fixed != genuine
    digests, rates = [], []
    for name, text in (("schedule", genuine), ("fixed", fixed)):
        log = tmp_path / name / "output" / "log" / "rank_0" / "info.log"
        log.parent.mkdir(parents=True)
        log.write_text(text)
        out = tmp_path / f"{name}-summary"
        assert main(["replay", str(log.parent), "--out", str(out), "--quiet", "--no-aggregate"]) == 0
        rates.append(scalars(out / "rank_0")["learning-rate"])
        digest = json.loads((out / "rank_0" / "run.json").read_text())["config_hash"]
        assert re.fullmatch(r"partial-[0-9a-f]{12}", digest)
        card = texts(out / "rank_0")["config"][1]
        assert card.startswith(f"**config hash** `{digest}`\n\n*Partial:* no full configuration dump was read")
        assert "The hash covers the settings below and nothing else" in card and "learning rate" in card
        assert "| `run.global_batch_size` | 2 |" in card  # one of the settings it covers, listed
        digests.append(digest)
    assert digests[0] == digests[1]
    assert all(v == pytest.approx(1e-3) for v in rates[1].values()) and len(set(rates[0].values())) > 50  # they differ
    named = tmp_path / "named"  # {config_hash} in --run-name: the run is named by the marked hash
    assert main(["replay", str(tmp_path / "fixed" / "output"), "--out", str(named), "--quiet", "--no-aggregate",
                 "--run-name", "{config_hash}/rank_{rank}"]) == 0
    assert (named / digests[0] / "rank_0" / "run.json").is_file()
    full = _hash(REAL / "mf1.9-dp2" / "output", tmp_path / "full")  # with worker_N.log's dump
    assert re.fullmatch(r"[0-9a-f]{12}", full)
    assert not texts(tmp_path / "full" / "rank_0")["config"][1].count("*Partial:*")


def _resumed_log(tmp_path: Path, steps: int, again: int) -> tuple[Path, bytes, bytes]:
    """Rank 0 of the dp2 job (its start-up lines, then ``steps`` steps) and the lines of a resume
    to step 1 without start-up lines (a checkpoint reload): its first ``again`` steps a day later."""
    lines = (REAL / "mf1.9-dp2" / "output" / "log" / "rank_0" / "info.log").read_bytes().splitlines(keepends=True)
    first = next(i for i, line in enumerate(lines) if b"print_output_info: { Epoch" in line)
    log = tmp_path / "output" / "log" / "rank_0" / "info.log"
    log.parent.mkdir(parents=True)
    resumed = b"".join(lines[first:first + 2 * again]).replace(b"2026-11-29", b"2026-11-30")
    return log, b"".join(lines[:first + 2 * steps]), resumed


def _replay(logs: Path, out: Path) -> None:
    assert main(["replay", str(logs), "--out", str(out), "--quiet", "--no-aggregate"]) == 0


def test_a_resume_to_the_first_step_writes_the_layout_again_at_it(tmp_path: Path) -> None:
    """The layout is written before step 1; a resume to step 1 purges it with the card: both are
    written again at the resume step (before, the layout was gone for good)."""
    log, before, resumed = _resumed_log(tmp_path, steps=10, again=5)
    log.write_bytes(before + resumed)
    out = tmp_path / "summary"
    _replay(tmp_path / "output", out)
    shown = read_run(out / "rank_0").texts  # as TensorBoard's plugins show texts (tb_read.texts ignores the purge)
    assert list(shown["config"]) == [1]
    assert list(shown["parallel-layout"]) == [1]
    assert {p["world_size"] for p in json.loads(shown["parallel-layout"][1])["parallel"]} == {2}


def test_a_restart_then_a_resume_gives_the_card_and_layout_of_an_uninterrupted_run(tmp_path: Path) -> None:
    """A replay, then (a restart from its checkpoint) the log goes back to step 1: the card, whose
    step the checkpoint holds, and the layout are written again at step 1, as one replay of the
    whole log writes them (before: the card at the last step read, the layout not at all)."""
    log, before, resumed = _resumed_log(tmp_path, steps=10, again=5)
    log.write_bytes(before)
    out = tmp_path / "summary"
    _replay(tmp_path / "output", out)
    with open(log, "ab") as fh:
        fh.write(resumed)
    _replay(tmp_path / "output", out)
    whole = tmp_path / "whole"
    _replay(tmp_path / "output", whole)
    shown = read_run(out / "rank_0").texts
    assert list(shown["config"]) == [1] and list(shown["parallel-layout"]) == [1]
    assert_same_outputs(whole, out)


def test_a_resume_after_the_card_keeps_it_where_one_replay_puts_it(tmp_path: Path) -> None:
    """A replay writes the card at step 1; the log then goes back to step 6 (which does not purge
    it) and a second replay reads on: the card stays at step 1, and one replay of the whole log puts
    it there too (before, it wrote the card at its end, at the last segment's first step: 6)."""
    log, before, _ = _resumed_log(tmp_path, steps=10, again=0)
    lines = before.splitlines(keepends=True)
    first = next(i for i, line in enumerate(lines) if b"print_output_info: { Epoch" in line)
    log.write_bytes(before)
    out = tmp_path / "summary"
    _replay(tmp_path / "output", out)
    with open(log, "ab") as fh:
        fh.write(b"".join(lines[first + 10:first + 16]).replace(b"2026-11-29", b"2026-11-30"))  # steps 6-8 again
    _replay(tmp_path / "output", out)
    whole = tmp_path / "whole"
    _replay(tmp_path / "output", whole)
    assert list(read_run(whole / "rank_0").texts["config"]) == [1]
    assert_same_outputs(whole, out)


@pytest.mark.parametrize("wake_mode", ["inotify"])
@pytest.mark.parametrize("unheld", [0, 2])
def test_a_kill_after_a_resume_marker_before_its_checkpoint_writes_the_card_again(live: LiveEnv, tmp_path: Path,
                                                                                  unheld: int) -> None:
    """A live sidecar writes the card at step 1 and stops; a restart (no checkpoint for ten minutes)
    reads ``unheld`` more steps and a resume to step 1, whose START purges the card, and is killed
    before checkpointing them. The next restart reads them again (the resume as a copy), so only
    its run shows the purge: the card is written again at step 1, as one replay puts it (before,
    the checkpoint said it was written, and the run never showed it again)."""
    log, before, resumed = _resumed_log(tmp_path, steps=10, again=5)
    lines = before.splitlines(keepends=True)
    read, held = (len(b"".join(lines[:len(lines) - 2 * n])) for n in (unheld + 1, unheld))  # a step: head and bar
    log.write_bytes(before[:read])
    run = live.out / "rank_0"
    first = live.sidecar().start()
    wait_until(lambda: tb_text_steps(run, "config") == [1], 20, "the card at step 1")
    assert first.stop()[0] == 0
    second = live.sidecar("--checkpoint-interval", "600").start()
    with open(log, "ab") as fh:
        fh.write(before[read:held])
    wait_until(lambda: _held(live) == held, 20, "the first read checkpointed (the next is 600 s away)")
    with open(log, "ab") as fh:
        fh.write(before[held:] + resumed)
    wait_until(lambda: [s for s, _ in tb_points(run)] == [1, 2, 3, 4, 5], 20, "the resumed steps on disk")
    second.kill()
    assert tb_text_steps(run, "config") == []  # the resume's START purged it, and no checkpoint saw that
    assert _held(live) == held
    third = live.sidecar().start()
    wait_until(lambda: tb_text_steps(run, "config") == [1], 20, "the card written again at step 1")
    assert third.stop()[0] == 0
    assert "Traceback" not in third.stderr()
    whole = tmp_path / "whole"
    assert main(["replay", str(live.output), "--out", str(whole), "--quiet", "--instance", "test"]) == 0
    shown = read_run(run).texts
    assert list(shown["config"]) == [1] and list(shown["parallel-layout"]) == [1]
    assert_same_outputs(whole, live.out)


def _held(live: LiveEnv) -> int:
    """How far the checkpoint says the one log was read (-1 before there is one)."""
    try:
        return int(json.loads(live.state_file().read_text())["files"][0]["offset"])
    except (OSError, ValueError, KeyError, IndexError):
        return -1


def test_a_checkpoint_holds_the_configuration_read_since_the_last_one(tmp_path: Path) -> None:
    """A rank's configuration is serialised for a checkpoint again only when it changed (1,024
    unchanged ones made most of an idle sidecar's checkpoint); what a rank stated after one
    checkpoint is in the next, and a restart takes it back."""
    meta = RunMetadata()
    meta.note(0, {"model": "llama", "lr_schedule": {"warmup_steps": 10.0}})
    first = meta.snapshot()["0"].config
    assert meta.snapshot()["0"].config is first  # unchanged: the same text
    meta.note(0, {"lr_schedule": {"total_steps": 200.0}, "world_size": 8})
    again = RunMetadata()
    again.load(0, meta.snapshot()["0"], tmp_path)
    assert again.config(0).lr_schedule == {"warmup_steps": 10.0, "total_steps": 200.0}
    assert again.config(0) == meta.config(0) and again.batch(0) == (None, 8)


@pytest.mark.parametrize("checkpointed", ["from-its-checkpoint", "with-no-checkpoint"])
@pytest.mark.parametrize("later", ["nothing", "a resume"])
def test_a_kill_after_the_card_before_its_checkpoint_leaves_the_card_shown(tmp_path: Path, later: str,
                                                                            checkpointed: str) -> None:
    """The window between a checkpoint's writing of the card (``run.json`` at once, the event still
    buffered, or on disk) and the saving of that checkpoint: a SIGKILL there leaves a checkpoint
    that knows no card and a ``run.json`` that says the settings were written. The restart shows
    the card at step 3, also after a resume to step 2 purges it (before, neither was written
    again). The kill: the writer is abandoned, its buffer lost, or closed when the card reached disk.
    The restart goes on from the checkpoint of the rank, or (killed before the rank's first
    checkpoint) from none, reading the start-up lines and steps again (before, it trusted
    ``run.json`` and wrote no card when the buffered one was lost)."""
    run = tmp_path / "rank_0"
    for buffered in (True, False):
        shutil.rmtree(run, ignore_errors=True)
        meta, writer = RunMetadata(), RunWriter(run)
        meta.note(0, {"model": "llama", "world_size": 2, "global_batch_size": 4})
        for step in (3, 4):
            record = Record(step, 1000.0 + step, scalars={"loss": float(step)}, training_step=True)
            writer.write(record)
            meta.stepped(0, record, resumed=False)
        checkpoint, view = meta.snapshot()["0"], writer.sync()
        since = RunView(dict(view.watermarks), view.file, view.size)
        meta.write_due({0: writer})
        writer.abandon() if buffered else writer.close()  # SIGKILL before the next checkpoint is saved
        again = RunMetadata()
        if checkpointed == "from-its-checkpoint":
            restarted = RunWriter(run, since)
            again.load(0, checkpoint, run)
            again.shown(0, restarted.view.watermarks)
        else:
            restarted = RunWriter(run)
            again.note(0, {"model": "llama", "world_size": 2, "global_batch_size": 4})
            for step in (3, 4):  # read again: written anew if the kill lost them, else duplicates
                record = Record(step, 1000.0 + step, scalars={"loss": float(step)}, training_step=True)
                if restarted.view.watermarks.get("loss", -1) < step:
                    restarted.write(record)
                again.stepped(0, record, resumed=False)
        if later == "a resume":
            again.write_due({0: restarted})
            restarted.resume(2, 1010.0, "resumed")
            record = Record(2, 1010.0, scalars={"loss": 0.5}, training_step=True)
            restarted.write(record)
            again.stepped(0, record, resumed=True)
        again.write_due({0: restarted})
        restarted.close()
        expected = [2] if later == "a resume" else [3]
        assert list(read_run(run).texts.get("config", {})) == expected, f"buffered={buffered}"
