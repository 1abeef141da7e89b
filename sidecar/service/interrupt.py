"""Ctrl-C during a replay, taken where the engine is whole.

A KeyboardInterrupt raised wherever the signal lands could leave a step counted as written but
not written, or the aggregate half-updated, and no checkpoint could be trusted after it. So while
a replay reads, SIGINT only sets a flag; the replay looks at it between two reads (one process)
or two messages (workers), saves what was written there, and only then raises
KeyboardInterrupt (exit 130). :meth:`CtrlC.release` gives SIGINT back early, so that a second
Ctrl-C during that hand-over ends it at once.
"""

from __future__ import annotations

import signal
from types import FrameType, TracebackType
from typing import Any

SAVED = "interrupted: what was written is checkpointed; the same replay goes on from there"


class CtrlC:
    """``with CtrlC() as ctrl_c:`` SIGINT sets ``ctrl_c.pressed`` instead of interrupting."""

    def __init__(self) -> None:
        self.pressed = False
        self._default: Any = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.pressed = True

    def __enter__(self) -> "CtrlC":
        self._default = signal.signal(signal.SIGINT, self)
        return self

    def release(self) -> None:
        """SIGINT as it was before: the next Ctrl-C interrupts again."""
        signal.signal(signal.SIGINT, self._default)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()
