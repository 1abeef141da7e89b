"""The restart check of :class:`sidecar.following.tailer.FileTail`: a restored offset is kept for a file that
was only appended to, and dropped for one that was rewritten."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.following.tailer import HEAD_BYTES, FileTail


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
