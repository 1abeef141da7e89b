"""A sink for tests (:mod:`sidecar.output.sink`) that keeps what it is handed only through the
checkpoint (``sync`` / ``restore``), as a tracker or a bucket keeps only what it acknowledged:
a SIGKILL loses what came after the last checkpoint, and the engine must hand that again.

Its state: every point it shows, by (run, tag, step), and what would be a fault: a point handed
twice without ``again`` and without a resume in between (``twice``); plus the resumes and the
settings it was given. Run as a program, it is ``mstb-sidecar`` with this sink added.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

from parsers.records import Record
from sidecar.output.sink import Position, SinkState


class RecordingSink:
    name = "recording"

    def __init__(self) -> None:
        self.points: dict[str, dict[str, dict[int, object]]] = {}  # run -> tag -> step -> value
        self.twice: list[str] = []
        self.resumes: list[list[object]] = []  # [run, step]
        self.metas: dict[str, dict[str, object]] = {}  # run -> settings
        self.again = 0  # points taken from an again=True hand-over
        self.restored: list[bool] = []  # per start: whether a state came back

    def restore(self, state: SinkState | None) -> None:
        self.restored.append(state is not None)
        if state is not None:
            self.points = {run: {tag: {int(s): v for s, v in steps.items()} for tag, steps in tags.items()}
                           for run, tags in state["points"].items()}  # type: ignore[union-attr]
            self.twice, self.resumes = list(state["twice"]), list(state["resumes"])  # type: ignore[call-overload]
            self.metas, self.again = dict(state["metas"]), int(state["again"])  # type: ignore[call-overload]
            self.restored = list(state["restored"]) + self.restored  # type: ignore[call-overload]

    def write(self, run: str, rank: int | None, record: Record, again: bool = False,
              at: Position | None = None) -> None:
        tags = self.points.setdefault(run, {})
        for tag, value in [*record.scalars.items(), *record.texts.items()]:
            steps = tags.setdefault(tag, {})
            if record.step in steps:
                if not again:
                    self.twice.append(f"{run} {tag} {record.step}")
                continue
            steps[record.step] = value
            self.again += again

    def resume(self, run: str, rank: int | None, step: int, wall_time: float | None, again: bool = False,
               at: Position | None = None) -> None:
        self.resumes.append([run, step])
        for steps in self.points.get(run, {}).values():
            for old in [s for s in steps if s >= step]:
                del steps[old]

    def meta(self, run: str, rank: int | None, settings: Mapping[str, object]) -> None:
        self.metas[run] = dict(settings)

    def flush(self) -> None:
        pass

    def sync(self) -> SinkState:
        return {"points": self.points, "twice": self.twice, "resumes": self.resumes, "metas": self.metas,
                "again": self.again, "restored": self.restored}

    def health(self) -> Mapping[str, int]:
        return {"points": sum(len(steps) for tags in self.points.values() for steps in tags.values())}

    def close(self) -> None:
        pass


if __name__ == "__main__":
    from sidecar.cli import main

    sys.exit(main(sys.argv[1:], sinks=[RecordingSink()]))
