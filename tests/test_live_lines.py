"""Live daemon: partial lines, over-long lines and bad bytes.

A partial last line is never parsed before its newline (the cut is placed inside the loss
value, so parsing early would write a wrong value) and the checkpoint never points inside a
line, also across a restart. Lines over the cap are skipped and counted while the file keeps
being followed. Invalid UTF-8, NUL bytes and CRLF endings crash nothing.
"""

from __future__ import annotations

import json
import signal

from live_helpers import LiveEnv, all_written, free_port, raw_run, scrape, wait_until

pytest_plugins = ["live_helpers"]


def _cut_in_loss(record: bytes) -> int:
    """A cut point inside the loss number of a head line: ``loss: 1000`` | ``12.000000``."""
    return record.index(b"loss: ") + len(b"loss: ") + 4


def _checkpointed_offsets_on_line_starts(live: LiveEnv) -> list[int]:
    state = json.loads(live.state_file().read_text())
    offsets = []
    for entry in state["files"]:
        data = open(entry["path"], "rb").read()
        offset = entry["offset"]
        assert offset == 0 or data[offset - 1 : offset] == b"\n", f"checkpoint inside a line: {entry}"
        offsets.append(offset)
    return offsets


def test_partial_line_is_held_until_complete(live: LiveEnv) -> None:
    log = live.info_log(1)
    log.step(5)
    sidecar = live.sidecar().start()
    wait_until(lambda: all_written(live.out, [log]), 10, "the first steps")
    record = log.take()
    cut = _cut_in_loss(record)
    log.write(record[:cut])
    sidecar.caught_up()  # it has looked at the partial line
    assert len(raw_run(live.out / "rank_1").points) == 5, "a partial line was parsed"
    _checkpointed_offsets_on_line_starts(live)
    log.write(record[cut:])
    log.step(3)
    live.finish(sidecar, [log])


def test_partial_line_completed_after_a_restart(live: LiveEnv) -> None:
    """SIGTERM (then SIGKILL) with a half-written head pending, completed while down."""
    log = live.info_log(0)
    log.step(10)
    sidecar = live.sidecar().start()
    for stop in (sidecar.stop, sidecar.kill):
        wait_until(lambda: all_written(live.out, [log]), 10, "the steps so far")
        record = log.take()
        cut = _cut_in_loss(record)
        log.write(record[:cut])
        sidecar.caught_up()  # it has looked at the partial line
        stop()
        assert _checkpointed_offsets_on_line_starts(live)
        log.write(record[cut:])
        log.step(2)
        sidecar.start()
    live.finish(sidecar, [log])


def test_head_waiting_for_its_bar_across_a_restart(live: LiveEnv) -> None:
    """The head line is complete, its bar line not yet: the held head is not lost by a kill."""
    log = live.info_log(0)
    log.step(5)
    sidecar = live.sidecar().start()
    wait_until(lambda: all_written(live.out, [log]), 10, "the first steps")
    record = log.take()
    head_end = record.index(b"\n") + 1
    log.write(record[:head_end])
    sidecar.caught_up()  # the head is read and held
    sidecar.kill()
    log.write(record[head_end:])
    log.step(2)
    sidecar.start()
    live.finish(sidecar, [log])


def test_long_lines_are_skipped_and_counted(live: LiveEnv) -> None:
    """Lines of 3 MiB (cap 1 MiB), one arriving in pieces and one cut by a restart."""
    port = free_port()
    log = live.info_log(0)
    log.step(5)
    sidecar = live.sidecar("--metrics-port", str(port)).start()
    log.write(b"[INFO] x" + b"y" * (3 << 20) + b"\n")
    log.step(5)
    log.write(b"[INFO] z" + b"w" * (1 << 20))
    sidecar.caught_up()  # each piece read on its own
    log.write(b"w" * (1 << 20))
    sidecar.caught_up()
    log.write(b"w" * (1 << 20) + b"\n")
    log.step(5)
    wait_until(lambda: all_written(live.out, [log]), 10, "the steps around the long lines")
    too_long = {"rank": "0", "reason": "too-long"}
    assert wait_until(lambda: (scrape(port, "mstb_sidecar_records_not_written_total", **too_long) or 0) >= 2, 5,
                      "the long-line counter")
    log.write(b"[INFO] q" + b"z" * (2 << 20))  # over the cap, no newline yet
    sidecar.caught_up()
    rc, _ = sidecar.stop()
    assert rc == 0
    log.write(b"z" * 1000 + b"\n")
    log.step(5)
    sidecar.start()
    live.finish(sidecar, [log])


def test_bad_bytes_never_crash(live: LiveEnv) -> None:
    """Invalid UTF-8, NUL bytes, CRLF endings, empty lines between and inside records."""
    log = live.worker_log(2)
    log.step(3)
    sidecar = live.sidecar().start()
    log.write(b"\xff\xfe\xc3\x28 invalid utf-8 \xed\xa0\x80\n\n\n")
    log.write(b"\x00\x00\x00\x00\n")
    log.step(2)
    log.write(log.take().replace(b"\n", b"\r\n"))  # a Windows-style record
    log.write(b"[INFO] 2026-11-29 10:00:00,000 [a.py:1] f: \x00 NUL inside \x80\x81\n")
    log.write(b"\x00" * 5000)  # a copytruncate-style NUL run before the next line
    log.step(3)
    log.write(b"[INFO] \xff{ Epoch:[  1/  1], step:[\xff\xfe/100000], loss: \xc3\x28\n")
    log.step(3)
    live.finish(sidecar, [log])


def test_counts_outlive_the_file_they_came_from(live: LiveEnv) -> None:
    """A malformed line is counted once, and the count stays after its (rotated, then deleted)
    file is forgotten: the accounting is the sidecar's, not the file's."""
    port = free_port()
    config = live.root / "sidecar.yaml"
    config.write_text("rotate_quiet: 0.1\nrescan_interval: 0.1\n")
    log = live.info_log(0)
    log.step(3)
    log.write(b"[INFO] 2026-11-29 10:00:00,000 [x.py:1] f: { Epoch:[  1/  1], step:[oops/100], loss: 1\n")
    log.step(3)
    sidecar = live.sidecar("--metrics-port", str(port), "--config", str(config)).start()
    malformed = {"rank": "0", "reason": "malformed"}
    metric = "mstb_sidecar_records_not_written_total"
    assert wait_until(lambda: scrape(port, metric, **malformed) == 1, 10, "the malformed line to be counted")
    log.rotate()
    log.step(3)
    wait_until(lambda: all_written(live.out, [log]), 10, "the steps after the rollover")
    log.path.with_name("info.log.1").unlink()

    def forgotten() -> bool:  # once past rotate_quiet; SIGHUP rescans at once (with inotify, rescans are rare)
        sidecar.proc.send_signal(signal.SIGHUP)
        return scrape(port, "mstb_sidecar_files") == 1

    wait_until(forgotten, 10, "the deleted file to be forgotten")
    assert scrape(port, metric, **malformed) == 1
    live.finish(sidecar, [log])
