"""The accounting invariant (:mod:`sidecar.analysis.accounting`): every record read is written, or
counted under a named reason; nothing is dropped for a reason not on the list.

The counters themselves (once per unreadable path, a thinned record moves from written to
thinned, merging a worker's counts), and the invariant end to end: an in-process replay of a
log with a copy, an unparsable step and an over-long line, whose written count is what
TensorBoard shows and whose counts add up to every record in the input.
"""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import pytest

from engine_run import replay_in_process
from live_helpers import RankLog, loss_value
from sidecar.analysis import accounting
from sidecar.analysis.accounting import Accounting, Reason
from sidecar.service.config import SidecarConfig
from tb_read import scalars

_DOCUMENTED = ["duplicate", "superseded", "malformed", "too-long", "thinned", "deleted-unread", "unreadable"]


def test_the_reasons_are_the_documented_ones() -> None:
    assert [r.value for r in Reason] == _DOCUMENTED
    assert all(f"``{name}``" in (accounting.__doc__ or "") for name in _DOCUMENTED)


def test_written_and_dropped_per_rank() -> None:
    acc = Accounting()
    for rank in (0, 0, 0, 1):
        acc.wrote(rank)
    acc.thinned(0)  # counted as written, then thinned away whole
    acc.drop(1, Reason.DUPLICATE, 2)
    acc.drop(1, Reason.MALFORMED, 0)  # nothing: no zero entry either
    assert acc.written == {0: 2, 1: 1}
    assert acc.of_rank(0) == {Reason.THINNED: 1}
    assert acc.of_rank(1) == {Reason.DUPLICATE: 2}
    assert (1, Reason.MALFORMED) not in acc.dropped
    assert acc.totals() == {Reason.THINNED: 1, Reason.DUPLICATE: 2}
    assert acc.describe() == "2 duplicate, 1 thinned"  # in the order of the reasons
    assert Accounting().describe() == ""


def test_merge_adds_a_workers_counts() -> None:
    parent, worker = Accounting(), Accounting()
    parent.wrote(0)
    parent.drop(0, Reason.DUPLICATE)
    worker.wrote(0)
    worker.wrote(3)
    worker.drop(0, Reason.DUPLICATE)
    worker.unreadable(Path("/logs/rank_3/info.log"), 3, OSError(errno.EACCES, "Permission denied"))
    parent.merge(worker)
    assert parent.written == {0: 2, 3: 1}
    assert parent.of_rank(0) == {Reason.DUPLICATE: 2}
    assert parent.of_rank(3) == {Reason.UNREADABLE: 1}
    assert parent.unreadable_paths() == {Path("/logs/rank_3/info.log"): "Permission denied"}


def test_an_unreadable_path_is_counted_once_until_it_is_readable(caplog: pytest.LogCaptureFixture) -> None:
    acc, path = Accounting(), Path("/logs/rank_2/info.log")
    denied = OSError(errno.EACCES, "Permission denied")
    with caplog.at_level(logging.INFO):
        acc.unreadable(path, 2, denied)
        acc.unreadable(path, 2, denied)  # every rescan tries again: not a new loss
        assert acc.of_rank(2) == {Reason.UNREADABLE: 1}
        acc.unreadable(path, 2, OSError(errno.EIO, "Input/output error"))  # another failure: said and counted
        assert acc.of_rank(2) == {Reason.UNREADABLE: 2}
        acc.readable(path)
        assert acc.unreadable_paths() == {}
        acc.unreadable(path, 2, denied)  # unreadable again: a new loss
    assert acc.of_rank(2) == {Reason.UNREADABLE: 3}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3 and all(str(path) in w and "its records are missing" in w for w in warnings)
    assert f"{path} is readable again" in caplog.text


def test_unlisted_directories_count_for_the_rank_in_their_path() -> None:
    acc = Accounting()
    denied = OSError(errno.EACCES, "Permission denied")
    rank_dir, top = Path("/logs/rank_5"), Path("/logs/other")
    acc.directories({rank_dir: denied, top: denied}, default_rank=7)
    assert acc.of_rank(5) == {Reason.UNREADABLE: 1}
    assert acc.of_rank(7) == {Reason.UNREADABLE: 1}  # no rank in its path: the default
    acc.directories({top: denied}, default_rank=7)  # rank_5 could be listed again
    assert acc.unreadable_paths() == {top: "Permission denied"}
    assert acc.totals() == {Reason.UNREADABLE: 2}  # counts never drop


def test_every_record_read_is_written_or_counted(tmp_path: Path) -> None:
    """An in-process replay (no CLI): 20 steps in ``info.log``, the same records in
    ``worker_0.log`` (a copy), a step line whose step does not fit in int64 and a line over
    --max-line-bytes. TensorBoard shows each step once; the rest is counted by its reason."""
    log = RankLog(tmp_path / "output" / "log" / "rank_0" / "info.log", 0)
    log.step(10)
    head = log.record(10**20).split(b"\n")[0]  # a step beyond int64: malformed
    log.write(head + b"\n")
    del log.expected[10**20]
    log.history.pop()
    log.write(b"[INFO] " + b"x" * 4096 + b"\n")  # too long
    log.step(10)
    copy = tmp_path / "output" / "msrun_log" / "worker_0.log"
    copy.parent.mkdir(parents=True)
    copy.write_bytes(log.path.read_bytes())
    config = SidecarConfig(out=tmp_path / "tb", paths=[tmp_path / "output"], instance="test", max_line_bytes=1024,
                           progress=False, quiet=True)
    acc = replay_in_process(config)
    shown = scalars(tmp_path / "tb" / "rank_0")["loss"]
    assert shown == {s: loss_value(0, s) for s in range(1, 21)}
    assert acc.written[0] == 20
    assert acc.of_rank(0) == {Reason.DUPLICATE: 20, Reason.MALFORMED: 2, Reason.TOO_LONG: 2}
    # 2 x (20 steps + 1 unparsable + 1 too long) read: every one written or counted
    assert acc.written[0] + sum(acc.of_rank(0).values()) == 2 * 22
