"""The restart check of :class:`sidecar.following.tailer.FileTail`: a restored offset is kept for a file that
was only appended to, and dropped for one that was rewritten."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.following.tailer import HEAD_BYTES, MARKER_BYTES, FileTail
from sidecar.output.state import FileState


def _checkpoint(path: Path) -> tuple[int, str, str]:
    """Read what the file holds now and return (offset, head, marker) as a checkpoint saves them."""
    tail = FileTail.open(path)
    try:
        tail.read(1 << 16)
        return (tail.offset, *tail.fingerprint())
    finally:
        tail.close()


def _restart(path: Path, offset: int, head: str, marker: str) -> tuple[bool, FileTail]:
    tail = FileTail.open(path)
    tail.offset = offset
    return tail.verify(head, marker), tail


@pytest.mark.parametrize(
    "before",
    [b"", b"partial line, no newline yet", b"line 1\n", b"line 1\nline 2\npartial", b"x" * (HEAD_BYTES - 10) + b"\n"],
    ids=["empty", "partial-only", "one-line", "lines-and-partial", "just-under-head"],
)
def test_a_short_file_appended_to_after_the_checkpoint_keeps_its_offset(tmp_path: Path, before: bytes) -> None:
    path = tmp_path / "info.log"
    path.write_bytes(before)
    offset, head, marker = _checkpoint(path)
    assert offset == before.rfind(b"\n") + 1
    with open(path, "ab") as fh:
        fh.write(b" finished\nline 3\n")
    ok, tail = _restart(path, offset, head, marker)
    try:
        assert ok and tail.offset == offset
        assert [line for _, line in tail.read(1 << 16)] == (before[offset:] + b" finished\nline 3").split(b"\n")
    finally:
        tail.close()


def test_a_rewritten_file_is_read_again_from_the_start(tmp_path: Path) -> None:
    path = tmp_path / "info.log"
    path.write_bytes(b"line 1\nline 2\n")
    offset, head, marker = _checkpoint(path)
    path.write_bytes(b"LINE 1\nline 2\nline 3\n")  # same length before the offset, other bytes
    ok, tail = _restart(path, offset, head, marker)
    try:
        assert not ok and tail.offset == 0
    finally:
        tail.close()


BAR = b"[INFO] 2026-11-29 10:00:%02d,000 [callback.py:318] print_output_info: | 0.86313 samples/s/p  2:26:41 }\n"
BANNER = b"".join(b"  option_%02d | %s | the same in every launch\n" % (i, b"-" * 40) for i in range(20))


def test_equal_ends_of_lines_before_the_offset_are_no_evidence(tmp_path: Path) -> None:
    """Two jobs with the same banner (the head) and the same last 64 bytes before the offset (the
    end of a bar line), whose lines there carry other times: the restored offset is not trusted."""
    assert len(BANNER) > HEAD_BYTES
    path = tmp_path / "train.log"
    path.write_bytes(BANNER + b"".join(BAR % s for s in range(20)))
    offset, head, marker = _checkpoint(path)
    path.write_bytes(BANNER + b"".join(BAR % (s + 30) for s in range(25)))  # same width, later times, longer
    ok, tail = _restart(path, offset, head, marker)
    try:
        assert not ok and tail.offset == 0
    finally:
        tail.close()


def test_a_checkpoint_from_before_line_markers_still_loads_and_verifies(tmp_path: Path) -> None:
    """A state file without ``marker_kind`` holds the 64-byte marker: it loads as kind 1 and an
    unchanged file keeps its offset (the next checkpoint writes the line marker)."""
    path = tmp_path / "info.log"
    path.write_bytes(b"".join(BAR % s for s in range(20)))
    tail = FileTail.open(path)
    tail.read(1 << 16)
    head, marker = tail.fingerprint(kind=1)
    tail.close()
    saved = FileState.model_validate({"path": str(path), "dev": 0, "ino": 0, "offset": len(path.read_bytes()),
                                      "head": head, "marker": marker})
    assert saved.marker_kind == 1 and MARKER_BYTES == 64
    tail = FileTail.open(path)
    tail.offset = saved.offset
    try:
        assert tail.verify(saved.head, saved.marker, saved.marker_kind) and tail.offset == saved.offset
    finally:
        tail.close()
