"""Discovery (:mod:`sidecar.following.discovery`): which files are logs, whose rank, in what order,
through links and past directories that cannot be listed, on a real tree.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from sidecar.following import discovery
from sidecar.following.discovery import MAX_DEPTH, Candidate, discover, linked_dirs, rank_of


def _touch(*paths: Path) -> None:
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x\n")


def _found(roots: list[Path], **kw: object) -> list[tuple[str, int]]:
    base = roots[0] if roots[0].is_dir() else roots[0].parent
    return [(str(c.path.relative_to(base)), c.rank) for c in discover(roots, **kw)]


def test_the_log_names_it_knows_and_their_ranks(tmp_path: Path) -> None:
    log = tmp_path / "output" / "log"
    _touch(log / "rank_0" / "info.log", log / "rank_0" / "error.log", log / "rank_1" / "mindformers.log",
           log / "rank_2" / "mindformer.log", tmp_path / "output" / "msrun_log" / "worker_3.log",
           tmp_path / "output" / "mf_parallel4" / "rank_table" / "mindformer.log",
           log / "rank_5" / "notes.txt", log / "rank_5" / "info.log.bak")
    summary = tmp_path / "output" / "summary" / "rank_6" / "a.out.events.summary.1700000000.0.host_MS"
    _touch(summary)
    found = _found([tmp_path / "output"], default_rank=9)
    assert found == [("log/rank_0/info.log", 0), ("log/rank_1/mindformers.log", 1), ("log/rank_2/mindformer.log", 2),
                     ("msrun_log/worker_3.log", 3), ("mf_parallel4/rank_table/mindformer.log", 4),
                     ("summary/rank_6/a.out.events.summary.1700000000.0.host_MS", 6)]
    assert [c.summary for c in discover([tmp_path / "output"])] == [False] * 5 + [True]


def test_the_innermost_rank_wins_else_the_default(tmp_path: Path) -> None:
    assert rank_of(Path("/jobs/rank_3/sub/rank_7/info.log")) == 7
    assert rank_of(Path("/jobs/rank_3/msrun_log/worker_12.log.2")) == 12
    assert rank_of(Path("/jobs/train/info.log")) is None
    _touch(tmp_path / "train" / "info.log")
    candidate, = discover([tmp_path / "train"], default_rank=4)
    assert (candidate.rank, candidate.ranked) == (4, False)


def test_a_chain_is_read_oldest_backup_first(tmp_path: Path) -> None:
    rank = tmp_path / "log" / "rank_0"
    _touch(*(rank / name for name in ("info.log", "info.log.1", "info.log.2", "info.log.10")))
    found = discover([tmp_path / "log"])
    assert [c.path.name for c in found] == ["info.log.10", "info.log.2", "info.log.1", "info.log"]
    assert {c.chain for c in found} == {str(rank / "info.log")}
    assert [c.backup for c in found] == [10, 2, 1, 0]


def test_a_named_live_log_brings_its_backups(tmp_path: Path) -> None:
    rank = tmp_path / "rank_2"
    _touch(rank / "info.log", rank / "info.log.1", rank / "info.log.x", rank / "other.log")
    assert _found([rank / "info.log"]) == [("info.log.1", 2), ("info.log", 2)]
    named = tmp_path / "train.out"  # any file named on the command line is followed
    _touch(named)
    candidate, = discover([named], default_rank=1)
    assert candidate.path == named and candidate.rank == 1


def test_a_missing_root_yields_nothing(tmp_path: Path) -> None:
    assert discover([tmp_path / "not-yet"]) == []


def test_links_are_followed_and_name_the_rank(tmp_path: Path) -> None:
    store = tmp_path / "store"
    _touch(store / "r3" / "info.log", tmp_path / "job" / "log" / "rank_0" / "info.log")
    log = tmp_path / "job" / "log"
    (log / "rank_3").symlink_to(store / "r3")  # the link's own name gives the rank
    (log / "loop").symlink_to(tmp_path / "job")  # a link to an ancestor: the walk ends there
    (log / "latest").symlink_to(log / "rank_0")  # a second way to a real directory: read once, as itself
    found = discover([tmp_path / "job"])
    assert [(c.path, c.rank) for c in found] == [(log / "rank_0" / "info.log", 0), (log / "rank_3" / "info.log", 3)]
    assert linked_dirs([tmp_path / "job"]) == [store / "r3"]  # watched too; the loop is not


def test_out_is_never_entered_however_it_is_reached(tmp_path: Path) -> None:
    out = tmp_path / "job" / "tb"
    _touch(tmp_path / "job" / "log" / "rank_0" / "info.log", out / "rank_1" / "info.log")
    (tmp_path / "job" / "log" / "view").symlink_to(out)
    assert _found([tmp_path / "job"], exclude=out) == [("log/rank_0/info.log", 0)]


def test_the_walk_stops_below_max_depth(tmp_path: Path) -> None:
    shallow = tmp_path.joinpath(*["d"] * (MAX_DEPTH - 1), "rank_0", "info.log")
    deep = tmp_path.joinpath(*["d"] * MAX_DEPTH, "rank_1", "info.log")
    _touch(shallow, deep)
    assert [c.rank for c in discover([tmp_path])] == [0]


def test_an_unlisted_directory_is_reported_not_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory that cannot be listed goes to ``unreadable`` with its error, and the rest of
    the tree is still found. (Permission bits do not stop root, so the listing fails by hand.)"""
    log = tmp_path / "log"
    _touch(log / "rank_0" / "info.log", log / "rank_1" / "info.log")
    scandir = os.scandir

    def failing(path: object) -> object:
        if Path(os.fsdecode(path)) == log / "rank_1":
            raise PermissionError(errno.EACCES, "Permission denied")
        return scandir(path)

    monkeypatch.setattr(discovery.os, "scandir", failing)
    unreadable: dict[Path, OSError] = {}
    assert [c.rank for c in discover([log], unreadable=unreadable)] == [0]
    assert list(unreadable) == [log / "rank_1"] and unreadable[log / "rank_1"].errno == errno.EACCES


def test_candidates_sort_by_rank_then_chain_then_age() -> None:
    a = Candidate(Path("b/rank_1/info.log"), 1, "b/rank_1/info.log", 0)
    b = Candidate(Path("a/rank_1/info.log.1"), 1, "a/rank_1/info.log", 1)
    c = Candidate(Path("a/rank_1/info.log"), 1, "a/rank_1/info.log", 0)
    d = Candidate(Path("z/rank_0/info.log"), 0, "z/rank_0/info.log", 0)
    assert sorted([a, b, c, d], key=Candidate.order) == [d, b, c, a]
