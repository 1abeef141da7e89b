"""Symlinked job trees: a linked ``output/log``, a linked rank directory (the rank is the link's
name), a linked log file, link loops and a link to ``--out``, in replay and live. Every real file
is read once, and TensorBoard shows every step of every rank exactly once."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from live_helpers import BIN, LiveEnv, RankLog, all_written, assert_exactly_once, wait_until

pytest_plugins = ["live_helpers"]


def linked_tree(live: LiveEnv) -> list[RankLog]:
    """``output/log -> ../store/logs`` holding rank_0 and rank_1; ``rank_3 -> ../node7`` (a
    directory named after nothing); ``rank_2/info.log -> ../../files/r2.log``; plus loops (a link
    to an ancestor, a second link to a rank directory, a link to itself) and a link to ``--out``,
    which holds a log that must not be read."""
    store = live.root / "store"
    (live.output / "log").rmdir()
    (store / "logs").mkdir(parents=True)
    (live.output / "log").symlink_to("../store/logs")
    logs = [RankLog(store / "logs" / f"rank_{r}" / "info.log", r) for r in (0, 1)]
    logs.append(RankLog(store / "files" / "r2.log", 2))
    (store / "logs" / "rank_2").mkdir()
    (store / "logs" / "rank_2" / "info.log").symlink_to("../../files/r2.log")
    logs.append(RankLog(store / "node7" / "info.log", 3))
    (store / "logs" / "rank_3").symlink_to("../node7")
    (store / "logs" / "loop").symlink_to("..")
    (store / "logs" / "again").symlink_to("rank_0")
    (store / "logs" / "rank_1" / "self").symlink_to(".")
    stray = RankLog(live.out / "rank_9" / "info.log", 9)  # inside --out: never read
    stray.step(3)
    (store / "logs" / "tb").symlink_to(os.path.relpath(live.out, store / "logs"))
    return logs


def replay(live: LiveEnv, root: Path) -> None:
    done = subprocess.run([str(BIN), "replay", str(root), "--out", str(live.out), "--instance", "test"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("wake_mode", ["poll"])
@pytest.mark.parametrize("root", ["output", "output/log"])
def test_replay_follows_links_and_reads_every_real_file_once(live: LiveEnv, root: str) -> None:
    logs = linked_tree(live)
    for log in logs:
        log.step(20)
    replay(live, live.root / root)
    assert_exactly_once(live.out, logs)
    assert sorted(p.name for p in live.out.glob("rank_*")) == ["rank_0", "rank_1", "rank_2", "rank_3", "rank_9"]
    assert not list((live.out / "rank_9").glob("*tfevents*"))  # only the stray log, no run


def test_live_follows_links_with_wakeups_inside_them(live: LiveEnv) -> None:
    logs = linked_tree(live)
    for log in logs:
        log.step(5)
    sidecar = live.sidecar().start()
    wait_until(lambda: all_written(live.out, logs), 15, "the steps written before the start")
    for log in logs:
        log.step(10)
    # inotify must watch the link targets (a recursive watch does not follow links): steps
    # arrive within the companion wait, long before the 10 s reconcile would find them
    wait_until(lambda: all_written(live.out, logs), 3, "steps appended behind links")
    live.finish(sidecar, logs)

