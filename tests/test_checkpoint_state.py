"""The checkpoint's state file (:mod:`sidecar.output.state`): saved whole or not at all, loaded or
replaced by a fresh start with a warning (missing, torn, corrupt, another version), older
checkpoints still load, one file per instance and experiment, and a state whose runs are gone
is recognised (:func:`runs_match`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from sidecar.output.state import STATE_DIR, VERSION, FileState, RunState, State, StateStore, instance_name, runs_match


def _state() -> State:
    return State(files=[FileState(path="/logs/rank_0/info.log", dev=1, ino=2, offset=4096, head="aGVhZA==",
                                  marker="bWFyaw==", marker_kind=2)],
                 runs={"0": RunState(file="events.out.tfevents.1", size=300, watermarks={"loss": 12})})


def test_a_saved_state_loads_as_it_was(tmp_path: Path) -> None:
    store = StateStore(tmp_path, "node-1")
    store.save(_state())
    assert store.path == tmp_path / STATE_DIR / "state-node-1.json"
    assert store.load() == _state()
    assert [p.name for p in store.path.parent.iterdir()] == ["state-node-1.json"]  # no temp file left


def test_a_save_replaces_the_whole_file(tmp_path: Path) -> None:
    store = StateStore(tmp_path, "a")
    store.save(_state())
    smaller = State(runs={"1": RunState(file="e", size=1)})
    store.save(smaller)
    assert store.load() == smaller  # not a mix of the two


def test_no_checkpoint_is_a_fresh_start_without_a_word(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert StateStore(tmp_path, "a").load() == State()
    assert caplog.records == []


@pytest.mark.parametrize("content, said", [
    (b'{"version": 2, "files": [{"path": "/x", "dev": 1', "is corrupt"),  # torn by a crash mid-write elsewhere
    (b"\xff\xfe not json", "is corrupt"),  # bad UTF-8
    (b'{"version": 2, "files": [{"path": "/x"}]}', "is corrupt"),  # fields missing
    (b'{"version": 2, "files": [{"path": "/x", "dev": 1, "ino": 2, "offset": -5, "head": "", "marker": ""}]}',
     "is corrupt"),  # an offset no file has
    (b'{"version": 1}', "has version 1"),
])
def test_an_unusable_checkpoint_is_a_fresh_start_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                  content: bytes, said: str) -> None:
    store = StateStore(tmp_path, "a")
    store.path.parent.mkdir(parents=True)
    store.path.write_bytes(content)
    with caplog.at_level(logging.WARNING):
        assert store.load() == State()
    assert said in caplog.text and str(store.path) in caplog.text


def test_a_checkpoint_from_before_a_part_was_kept_loads(tmp_path: Path) -> None:
    """Parts added later (facts, firing alerts, the aggregate's run, a run's alerts, the marker
    kind) are absent in older checkpoints: those load with the defaults, as before."""
    store = StateStore(tmp_path, "a")
    store.path.parent.mkdir(parents=True)
    old = {"version": VERSION, "files": [{"path": "/x", "dev": 1, "ino": 2, "offset": 10, "head": "", "marker": ""}],
           "runs": {"0": {"file": "e", "size": 5}}}
    store.path.write_text(json.dumps(old))
    state = store.load()
    assert state.files[0].marker_kind == 1  # the 64 bytes before the offset, as written then
    assert state.runs["0"].alerts is None and state.facts == {} and state.firing == [] and state.aggregate is None


def test_one_file_per_instance_and_experiment(tmp_path: Path) -> None:
    assert instance_name("node 1/gpu:0") == "node_1_gpu_0"
    assert instance_name("") == "default" and len(instance_name("x" * 200)) == 64
    a, b = StateStore(tmp_path, "n"), StateStore(tmp_path, "m")
    long = "exp-" + "x" * 60
    e1, e2 = StateStore(tmp_path, "n", long + "1"), StateStore(tmp_path, "n", long + "2")
    assert len({a.path, b.path, e1.path, e2.path}) == 4  # cut to the same 48 characters, still distinct
    a.save(_state())
    assert b.load() == State() and e1.load() == State()
    a.forget()
    assert not a.path.exists()
    a.forget()  # nothing to drop: no error


def test_runs_match_names_what_is_gone(tmp_path: Path) -> None:
    run = tmp_path / "rank_0"
    run.mkdir()
    (run / "events.out.tfevents.1").write_bytes(b"x" * 300)
    state = _state()
    assert runs_match(tmp_path, state) == {}
    (run / "events.out.tfevents.1").write_bytes(b"x" * 200)  # shorter than the checkpoint claims
    assert runs_match(tmp_path, state) == {"0": f"{run / 'events.out.tfevents.1'} holds 200 of the 300 bytes written"}
    (run / "events.out.tfevents.1").unlink()
    assert runs_match(tmp_path, state) == {"0": f"{run / 'events.out.tfevents.1'} was deleted"}
    run.rmdir()
    assert runs_match(tmp_path, state) == {"0": f"{run} was deleted"}
    named = State(runs={"3": RunState(name="exp/rank_3", file="e", size=1), "4": RunState()})  # 4: nothing written
    assert runs_match(tmp_path, named) == {"3": f"{tmp_path / 'exp' / 'rank_3'} was deleted"}
