"""Following a run that another process writes, event by event, as its files grow.

``mstb-sidecar aggregate`` reads the node sidecars' rank runs this way: the event files are the
interface. A run is its event files in name order, TensorBoard's reading order; a writer's new
file sorts after every existing one (:func:`sidecar.output.event_file.next_file_name`) and is
created only after the previous one was closed, so a file with a newer one beside it never
grows again and is not looked at once read to its end.

Each file is read from the offset where reading stopped (:func:`~sidecar.output.tfrecord.iter_records`):
a partial last record, still being written, ends the read there and is read whole next time.
A record whose CRC fails ends the file, as it does for TensorBoard (warned). A file that is
shorter than its offset was not written by a sidecar (they never truncate): warned, and read on
from its new end. Offsets, per file name, are the caller's to checkpoint. When every file read
so far is gone, the run was deleted (its writer writes it anew): :attr:`RunFollower.rewritten`
says so, for the caller to take what follows as history it has seen.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

from tensorboard.compat.proto import event_pb2

from sidecar.output.event_file import event_files
from sidecar.output.tfrecord import CorruptRecord, iter_records

log = logging.getLogger(__name__)


class RunFollower:
    def __init__(self, run_dir: Path, offsets: dict[str, int]) -> None:
        self.run_dir = run_dir
        self.offsets = dict(offsets)  # event file name -> offset read to
        self._closed: set[str] = set()  # files with a newer one beside them, read to their end
        self.rewritten = False  # every file read so far is gone: the run was deleted (and is written anew)

    def read(self, limit: int) -> Iterator[event_pb2.Event]:
        """Up to ``limit`` events from where reading stopped, in the run's order. An event counts
        as read (its offset is passed) once it is yielded."""
        files = event_files(self.run_dir)
        names = {path.name for path in files}
        if self.offsets and names.isdisjoint(self.offsets):
            self.rewritten = True  # set before the first event of the new files is yielded
        self.offsets = {name: offset for name, offset in self.offsets.items() if name in names}
        self._closed &= names
        for index, path in enumerate(files):
            if limit <= 0:
                return
            if path.name in self._closed:
                continue
            newest = index == len(files) - 1
            for event in self._read_file(path, limit):
                limit -= 1
                yield event
            if not newest and limit > 0:
                self._closed.add(path.name)

    def _read_file(self, path: Path, limit: int) -> Iterator[event_pb2.Event]:
        offset = self.offsets.get(path.name, 0)
        try:
            size = os.stat(path).st_size
            if size == offset:
                return
            if size < offset:
                log.warning("%s is shorter than what was read of it (%d < %d bytes); reading on from its end",
                            path, size, offset)
                self.offsets[path.name] = size
                return
            with open(path, "rb") as fh:
                for record in iter_records(fh, offset):
                    self.offsets[path.name] = record.end
                    yield event_pb2.Event.FromString(record.payload)
                    limit -= 1
                    if limit <= 0:
                        return
        except FileNotFoundError:
            return  # deleted meanwhile: its run is being rewritten, the new files are read next time
        except CorruptRecord:
            log.warning("%s has a corrupt record at offset %d; the rest of the file is not read (TensorBoard "
                        "stops there too)", path, self.offsets.get(path.name, 0))
            self._closed.add(path.name)
        except ValueError as exc:  # a record that is not an Event (protobuf DecodeError)
            log.warning("%s: a record at offset %d is not an event (%s); skipped", path,
                        self.offsets.get(path.name, 0), exc)
