"""The staging directory, mirrored to a bucket prefix as objects TensorBoard reads in order.

With ``--out s3://BUCKET/PREFIX`` the sidecar writes its usual ``--out`` tree into a local staging
directory (``--state-dir``) and this module copies it to the bucket, from a thread of its own:

- An event file ``RUN/NAME`` becomes a sequence of objects ``RUN/NAME.<offset, 16 digits>``, each
  holding the whole TFRecord records from that byte offset on (at most :data:`OBJECT_BYTES`, more
  only for one record that is larger). TensorBoard's directory loader reads a run's files in name
  order and goes on to the next name when one is exhausted, so these names continue the file
  where the last object ended; an object is written once, whole (S3 has no partial objects), with
  ``If-None-Match: *``: a late upload of a killed process cannot replace it. The bucket's listing
  is the upload state: each file continues at the end of its last object.
- Other files (``run.json``) are uploaded whole when they change; the newer side wins at start.
- The checkpoint (``.mstb-sidecar/state-<instance>*.json``) is read *before* a round's event data
  and uploaded after it, so the copy in the bucket never claims records the bucket lacks (the
  engine syncs the event files before it writes the checkpoint).
- :meth:`Uploader.pull` makes the staging directory hold at least what the bucket holds: at a
  start on an empty (or older) staging directory it appends the objects the local files lack and
  fetches the checkpoint, so a restart elsewhere continues exactly where the bucket is, and the
  engine's own read-back drops the points the runs already show. ``aggregate`` pulls every round
  (``mirror``) to follow the runs every node uploads.

Faults (store down, slow, 5xx, throttled, credentials expired): the round stops at the failed
request, which is counted by reason, and is retried after a jittered backoff; the staging
directory is the buffer, so nothing waits in memory and the engine never waits for the network.
What is not uploaded yet is :attr:`Uploader.pending` bytes.

The live engine has it among its sinks (:mod:`sidecar.output.sink`): it takes no records (they reach
the bucket whole, in the event files the TensorBoard sink writes) and keeps no part of the
checkpoint (the listing is its state); :meth:`health` gives its counts. Its lifetime is the
process's, not an engine's: :meth:`finish` ends it after the last checkpoint. Replay does not
register it, as any sink would make a replay run in one process.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path


from sidecar.output.bucket import REASONS, Backoff, BucketError, Entry, Store
from sidecar.output.lease import Lease
from sidecar.output.sink import PassiveSink
from sidecar.output.state import STATE_DIR, instance_name
from sidecar.output.tfrecord import CorruptRecord, whole_records

log = logging.getLogger(__name__)

OBJECT_BYTES = 16 << 20
_CHUNK = re.compile(r"(?P<file>.*tfevents[^/]*)\.(?P<offset>\d{16})")
_WARN_EVERY = 20  # a failure streak is logged at its first, then every this many failures


def chunk_name(file: str, offset: int) -> str:
    return f"{file}.{offset:016d}"


def is_event_file(name: str) -> bool:
    return "tfevents" in name.rsplit("/", 1)[-1]


class Uploader(PassiveSink):
    """Copies ``staging`` to ``store`` every ``interval`` seconds (see the module docstring).

    As a sink it only reports :meth:`health`: records, resumes and settings go up inside the event
    files and ``run.json`` it uploads; the bucket's listing is its state (:meth:`pull`), so it has
    no checkpoint part; the staging directory is its spool, durable once the TensorBoard sink has
    synced it; uploads run on their own thread, and an engine's close does not end them
    (:meth:`finish` does, with the process)."""

    name = "bucket"

    def __init__(self, store: Store, staging: Path, instance: str, interval: float, lease: Lease | None,
                 mirror: bool = False) -> None:
        self.store, self.staging, self.interval, self.lease, self.mirror = store, staging, interval, lease, mirror
        self._mine = (f"{STATE_DIR}/state-{instance_name(instance)}.json", f"{STATE_DIR}/state-{instance_name(instance)}@")
        self.sent: dict[str, int] = {}  # event file -> bytes the bucket holds
        self.synced: dict[str, tuple[int, int]] = {}  # other file -> (size, mtime_ns) the bucket has
        self.counts: Counter[str] = Counter()  # objects, bytes, checkpoints, pulled
        self.failures: Counter[str] = Counter({reason: 0 for reason in REASONS})
        self.pending = 0  # bytes in the staging directory that the bucket lacks (at the last round)
        self.last_success: float | None = None  # time.time() of the last complete round
        self.backoff = Backoff()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._no_conditions = False

    # -- the bucket into the staging directory --------------------------------------------------

    def pull(self) -> None:
        """Append to each local event file the objects it lacks; fetch missing or newer other files,
        and this instance's checkpoint if there is none locally."""
        chunks: dict[str, list[Entry]] = {}
        for entry in self.store.list():
            match = _CHUNK.fullmatch(entry.name)
            if match is not None:
                chunks.setdefault(match["file"], []).append(entry)
            elif self._wanted(entry.name):
                self._fetch(entry)
        for file, entries in chunks.items():
            self.sent[file] = self._append(file, entries)

    def _wanted(self, name: str) -> bool:
        return not name.startswith(f"{STATE_DIR}/") or name.startswith(self._mine)

    def _append(self, file: str, entries: list[Entry]) -> int:
        """Bring the local file up to the objects' end; how many bytes the bucket holds of it."""
        path = self.staging / file
        have = _size(path) or 0
        held = 0
        for entry in entries:  # in key order: by offset
            offset = int(entry.name[-16:])
            if offset != held:
                log.warning("%s/%s lacks bytes %d-%d; its later objects are not fetched", self.store.url, file,
                            held, offset)
                break
            if offset + entry.size > have:  # the local file lacks (part of) this object
                found = self.store.get(entry.name)
                if found is None:
                    break
                path.parent.mkdir(parents=True, exist_ok=True)
                with open(path, "ab") as fh:
                    fh.write(found[0][have - offset:])
                    fh.flush()
                    os.fsync(fh.fileno())
                have = offset + len(found[0])
                self.counts["pulled"] += 1
            held = offset + entry.size
        return held

    def _fetch(self, entry: Entry) -> None:
        path = self.staging / entry.name
        try:
            st = path.stat()
        except FileNotFoundError:
            st = None
        checkpoint = entry.name.startswith(self._mine)
        if st is not None and (checkpoint or st.st_mtime >= entry.modified):
            return  # the local copy is as new (a checkpoint here is never older than the bucket's)
        found = self.store.get(entry.name)
        if found is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.pull.tmp")
        tmp.write_bytes(found[0])
        os.replace(tmp, path)
        self.synced[entry.name] = _signature(path.stat())
        self.counts["pulled"] += 1

    # -- the staging directory into the bucket --------------------------------------------------

    def cycle(self) -> None:
        """One round: pull (``mirror``), event data, other files, then the checkpoint. Raises
        :class:`BucketError` at the first failed request; the next round starts over from there."""
        if self.lease is not None:
            self.lease.renew()
            if self.lease.lost:
                return
        if self.mirror:
            self.pull()
        checkpoints: dict[str, tuple[tuple[int, int], bytes]] = {}  # read before the data they cover is sent
        for name, path in self._files():
            if name.startswith(self._mine) and self.synced.get(name) != (signature := _signature(path.stat())):
                checkpoints[name] = signature, path.read_bytes()
        files = [(name, path, path.stat()) for name, path in self._files()]
        self.pending = sum(len(body) for _, body in checkpoints.values()) + sum(
            max(st.st_size - self.sent.get(name, 0), 0) if is_event_file(name) else
            0 if name.startswith(self._mine) or self.synced.get(name) == _signature(st) else st.st_size
            for name, _, st in files)
        pending = 0
        for name, path, _ in files:
            if is_event_file(name):
                pending += self._events(name, path)
            elif not name.startswith(self._mine):
                self._other(name, path)
        for name, (signature, body) in checkpoints.items():
            self.store.put(name, body)
            self.synced[name] = signature
            self.counts["checkpoints"] += 1
        self.pending = pending
        self.last_success = time.time()

    def _files(self) -> Iterator[tuple[str, Path]]:
        for directory, dirs, files in os.walk(self.staging):
            rel = os.path.relpath(directory, self.staging)
            dirs.sort()
            for file in sorted(files):
                name = file if rel == "." else f"{rel}/{file}"
                if file.endswith(".tmp") or file.startswith(".mstb-probe-"):
                    continue
                if name.startswith(f"{STATE_DIR}/") and not name.startswith(self._mine):
                    continue  # locks, lease tokens, other instances' checkpoints
                yield name, Path(directory) / file

    def _events(self, name: str, path: Path) -> int:
        """Upload what ``path`` holds past what the bucket has, in whole records; bytes left over."""
        sent = self.sent.get(name, 0)
        size = _size(path) or 0
        with open(path, "rb") as fh:
            while size > sent:
                fh.seek(sent)
                data = fh.read(min(size - sent, OBJECT_BYTES))
                try:
                    end, cut = whole_records(data)
                except CorruptRecord as exc:
                    self._corrupt(name, sent + exc.args[1])
                    return size - sent
                if end == 0 and cut > len(data) == OBJECT_BYTES:  # one record larger than an object
                    fh.seek(sent)
                    data = fh.read(cut)
                    end = len(data) if len(data) == cut else 0
                if end == 0:
                    break  # a record still being written
                self._put_chunk(name, sent, bytes(data[:end]))
                sent = self.sent[name]
        return max(size - sent, 0)

    def _put_chunk(self, name: str, offset: int, body: bytes) -> None:
        key = chunk_name(name, offset)
        try:
            self.store.put(key, body, if_none_match=not self._no_conditions)
            self.sent[name] = offset + len(body)
        except BucketError as exc:
            if exc.reason == "conflict":  # written already: by this round's earlier try, or a killed process
                size = self.store.size(key)
                if size is None:
                    raise
                self.sent[name] = offset + size
                return
            if exc.reason == "rejected" and "NotImplemented" in str(exc) and not self._no_conditions:
                self._no_conditions = True
                log.warning("%s does not support If-None-Match: objects are written unconditionally",
                            self.store.url)
                return self._put_chunk(name, offset, body)
            raise
        self.counts["objects"] += 1
        self.counts["bytes"] += len(body)

    def _corrupt(self, name: str, offset: int) -> None:
        if self.counts[f"corrupt:{name}"] == 0:
            log.error("%s has a corrupt record at byte %d; it is uploaded up to there only", self.staging / name,
                      offset)
        self.counts[f"corrupt:{name}"] += 1

    def _other(self, name: str, path: Path) -> None:
        signature = _signature(path.stat())
        if self.synced.get(name) == signature:
            return
        body = path.read_bytes()
        self.store.put(name, body)
        self.synced[name] = signature
        self.counts["objects"] += 1
        self.counts["bytes"] += len(body)

    # -- the thread ------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="bucket-upload", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        wait = self.interval
        while not self._stop.wait(wait):
            wait = self.attempt()

    def attempt(self) -> float:
        """One round, with its failure counted and logged; the seconds until the next."""
        try:
            self.cycle()
        except BucketError as exc:
            self.failures[exc.reason] += 1
            if exc.reason == "credentials":
                self.store.renew()
            if self.backoff.failures % _WARN_EVERY == 0:
                log.warning("cannot upload to %s (%s: %s); %d byte(s) wait in %s and are retried",
                            self.store.url, exc.reason, exc, self.pending, self.staging)
            return self.backoff.failed(exc.reason)
        except OSError as exc:  # the staging directory: the engine reports its own write failures
            log.warning("cannot read %s for the upload: %s", exc.filename or self.staging, exc.strerror or exc)
            return self.backoff.failed("rejected")
        if self.backoff.failures:
            log.info("uploading to %s again after %d failed attempt(s)", self.store.url, self.backoff.failures)
        self.backoff.succeeded()
        return self.interval

    def finish(self, timeout: float) -> bool:
        """Stop the thread, then upload what is left within ``timeout``; True if nothing is left."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        if self._thread is not None:
            self._thread.join(timeout)  # a request under way ends by its own timeouts
            if self._thread.is_alive():
                log.warning("the store did not answer within %.0f s; %d byte(s) wait in %s for the next start",
                            timeout, self.pending, self.staging)
                return False
        while True:
            wait = self.attempt()
            if self.backoff.failures == 0 or time.monotonic() + wait > deadline:
                break
            time.sleep(wait)
        done = self.backoff.failures == 0 and self.pending == 0
        if not done:
            log.warning("%d byte(s) are not uploaded to %s yet; they wait in %s and go at the next start",
                        self.pending, self.store.url, self.staging)
        elif self.lease is not None:
            try:
                self.lease.release()
            except BucketError:
                pass  # it expires by itself
        return done

    # -- as a sink (see the module docstring) ------------------------------------------------------

    def health(self) -> Mapping[str, int]:
        return {**self.counts, **{f"failed-{reason}": n for reason, n in self.failures.items()},
                "pending-bytes": self.pending}

    def describe(self) -> str:
        failed = sum(self.failures.values())
        reasons = ", ".join(f"{n} {r}" for r, n in self.failures.items() if n)
        line = (f"bucket {self.store.url}: {self.counts['objects']} object(s), {self.counts['bytes']} byte(s) "
                f"uploaded, {self.pending} pending")
        if failed:
            line += f", {failed} failed request(s) ({reasons})"
        if self.lease is not None and self.lease.lost:
            line += ", lease lost: not uploading"
        return line


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


def _signature(st: os.stat_result) -> tuple[int, int]:
    return st.st_size, st.st_mtime_ns
