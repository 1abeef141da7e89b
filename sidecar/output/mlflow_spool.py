"""The MLflow sink's write-ahead spool: what its ``sync()`` made durable, and what the server confirmed.

One directory per ``--instance``: ``<out>/.mstb-sidecar/mlflow-<instance>/``. Contract:

- ``seg-<n>.jsonl``: the operations handed over between two syncs (one JSON array a line, see
  :mod:`sidecar.output.mlflow_sink`), written to ``seg-<n>.part`` as they come and made durable
  by :meth:`Spool.seal` (fsync, rename, fsync of the directory) before the checkpoint that passed
  their lines is saved. A ``.part`` found at start was never sealed: the checkpoint's offsets did
  not pass its lines, so they come again, and it is deleted.
- ``marks.json``: what the sealed segments hold (per run: each key's highest step since the run's
  last resume, the settings and lifecycle last spooled, the position in the run last taken) and
  the last segment they include. A kill between a seal and this write is mended at start by
  reading the later segments again.
  The marks are the sink's durable state: a point at or under its mark is never spooled again.
- ``sent.json``: written by the sender thread alone: the last segment the server took whole
  (the oldest segments are sent together, up to :data:`BUNDLE` points, and confirmed together),
  the experiment's and each run's MLflow id. At start the oldest segments, as many as one such
  pass takes, may have been sent in part before a kill: the sender checks their points against
  the server (:attr:`Spool.unsure`). Confirmed segments are deleted.

The bound: at most ``limit`` points spooled and not confirmed (the sink counts what it refuses).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
from pathlib import Path

from sidecar.output.durable import sync_dir, write_atomic
from sidecar.output.state import STATE_DIR, instance_name

log = logging.getLogger(__name__)

_SEGMENT = re.compile(r"seg-(\d{10})\.(jsonl|part)")
BUNDLE = 20_000  # points the sender takes in one pass over the oldest segments, confirmed together
WRITE_BEHIND = 1 << 16  # bytes of operations buffered before they go to the open segment (no fsync)


def spool_dir(out: Path, instance: str) -> Path:
    return out / STATE_DIR / f"mlflow-{instance_name(instance)}"


def _json(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def digest(settings: object) -> str:
    """What a run's settings are, in 16 hex digits (the marks keep this, not the settings)."""
    return hashlib.sha256(_json(settings)).hexdigest()[:16]


def _load(path: Path) -> dict:
    try:
        content = json.loads(path.read_bytes())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("MLflow spool: cannot read %s (%s); taken as empty", path, exc)
        return {}
    return content if isinstance(content, dict) else {}


class Spool:
    """The files above. The engine's thread writes segments and marks; the sender reads sealed
    segments and writes ``sent.json``; ``lock`` guards what both look at (counts, sealed list)."""

    def __init__(self, directory: Path, limit: int) -> None:
        self.dir = directory
        self.limit = limit
        self.lock = threading.Lock()
        self.sealed: dict[int, int] = {}  # segment -> points in it, not confirmed yet
        self.unsure: set[int] = set()  # sealed before this start and not confirmed: maybe sent in part
        self.marks: dict[str, dict] = {}  # run -> {"keys": {key: step}, "settings", "status", "resume", "at"}
        self.sent: dict = {}
        self._next = 1
        self.upto = 0  # the last segment sealed
        self.opened = False
        self._buffer: list[bytes] = []
        self._buffered = 0
        self._fd: int | None = None
        self._points = 0  # of the open segment

    # -- the engine's side ---------------------------------------------------------------
    def open(self) -> None:
        """Read what is on disk: marks, confirmed segment, the sealed segments still to send."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self.opened = True
        self.sealed.clear()
        marks = _load(self.dir / "marks.json")
        self.marks = marks.get("runs", {}) if isinstance(marks.get("runs"), dict) else {}
        upto = int(marks.get("upto", 0))
        self.sent = _load(self.dir / "sent.json")
        confirmed = int(self.sent.get("segment", 0))
        for path in sorted(self.dir.iterdir()):
            found = _SEGMENT.fullmatch(path.name)
            if found is None:
                continue
            number = int(found.group(1))
            self._next = max(self._next, number + 1)
            if found.group(2) == "part" or number <= confirmed:
                path.unlink()  # never sealed (its lines come again), or sent whole
                continue
            ops = self.read(number)
            self.sealed[number] = sum(op[0] == "m" for op in ops)
            if number > upto:  # sealed, then killed before the marks were written
                for op in ops:
                    self.note(op)
        # the sender confirms the oldest segments together, up to BUNDLE points: those may be sent in part
        self.unsure = set(self.oldest(BUNDLE))
        self.upto = max(upto, confirmed, *self.sealed) if self.sealed else max(upto, confirmed)
        self._next = max(self._next, self.upto + 1)

    def mark(self, run: str) -> dict:
        return self.marks.setdefault(run, {"keys": {}})

    def note(self, op: list) -> None:
        """Bring the marks up to date with one operation (see :mod:`sidecar.output.mlflow_sink`)."""
        kind, run = op[0], op[1]
        if kind == "n":
            return
        marks = self.mark(run)
        if kind in ("m", "t"):
            keys = marks["keys"]
            keys[op[2]] = max(keys.get(op[2], -1), op[4])
        elif kind == "r":
            marks["keys"] = {key: min(step, op[2] - 1) for key, step in marks["keys"].items()}
            marks["resume"] = [op[2], op[3]]
        elif kind == "p":
            marks["settings"] = digest(op[2])
        elif kind == "s":
            marks["status"] = op[2]
        elif kind == "a":
            marks["at"] = [op[2], op[3]]

    def room(self) -> int:
        """Points that may still be spooled before the bound."""
        with self.lock:
            return self.limit - sum(self.sealed.values()) - self._points

    def add(self, op: list) -> None:
        """Spool one operation (durable at the next :meth:`seal`) and mark it."""
        self.note(op)
        line = _json(op) + b"\n"
        self._buffer.append(line)
        self._buffered += len(line)
        if op[0] == "m":
            with self.lock:
                self._points += 1
        if self._buffered >= WRITE_BEHIND:
            self._write_behind()

    def _write_behind(self) -> None:
        if self._fd is None:
            self._fd = os.open(self._path(self._next, "part"),
                               os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        view = memoryview(b"".join(self._buffer))
        while view:
            view = view[os.write(self._fd, view):]
        self._buffer.clear()
        self._buffered = 0

    def seal(self) -> int | None:
        """Make what was added durable as the next segment, then the marks; the number sealed
        (``None`` if there was nothing to seal)."""
        if self._fd is None and not self._buffer:
            return None
        self._write_behind()
        assert self._fd is not None
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None
        number = self._next
        os.replace(self._path(number, "part"), self._path(number, "jsonl"))
        sync_dir(self.dir)
        self._next += 1
        self.upto = number
        with self.lock:
            self.sealed[number] = self._points
            self._points = 0
        write_atomic(self.dir / "marks.json", _json({"upto": number, "runs": self.marks}))
        return number

    def close(self) -> None:
        """Unsealed operations are let go (their lines come again), as a kill would."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._buffer.clear()
        self._buffered = 0
        self.opened = False
        with self.lock:
            self._points = 0

    # -- the sender's side ---------------------------------------------------------------
    def first(self) -> int | None:
        with self.lock:
            return min(self.sealed, default=None)

    def oldest(self, points: int) -> list[int]:
        """The oldest sealed segments, up to ``points`` points (at least one segment, if any)."""
        taken: list[int] = []
        total = 0
        with self.lock:
            for number in sorted(self.sealed):
                if taken and total + self.sealed[number] > points:
                    break
                taken.append(number)
                total += self.sealed[number]
        return taken

    def read(self, number: int) -> list[list]:
        with open(self._path(number, "jsonl"), "rb") as fh:
            return [json.loads(line) for line in fh if line.strip()]

    def confirm(self, number: int, sent: dict) -> None:
        """The segments up to ``number`` are on the server whole: say so, then delete them."""
        self.sent = {**sent, "segment": number}
        write_atomic(self.dir / "sent.json", _json(self.sent))
        with self.lock:
            done = [n for n in self.sealed if n <= number]
            for n in done:
                del self.sealed[n]
        self.unsure.difference_update(done)
        for n in done:
            self._path(n, "jsonl").unlink(missing_ok=True)

    def save_ids(self, sent: dict) -> None:
        """The MLflow ids learnt (a run just created): kept before anything is logged to it."""
        self.sent = {**self.sent, **sent}
        write_atomic(self.dir / "sent.json", _json(self.sent))

    def _path(self, number: int, kind: str) -> Path:
        return self.dir / f"seg-{number:010d}.{kind}"
