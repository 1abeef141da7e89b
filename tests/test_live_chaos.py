"""Live daemon, model-based: random sequences of everything that can happen, checked at the end.

Three ranks (two ``info.log`` chains, one msrun ``worker_N.log``) get random operations: steps,
RotatingFileHandler rollovers, renames under a writer that keeps its fd, a rollover between a
head and its bar, lines written in two pieces, training resumes, truncation, delete + recreate,
SIGKILL, SIGTERM, SIGHUP and restarts. The model (each :class:`RankLog`'s expected points and
raw history) must equal what TensorBoard shows and what the event files hold.

Operations that destroy unread data are only done once the sidecar has caught up (truncate,
delete), and no more than four rollovers happen past what it has read (a fifth would delete
an unread backup, as ``backupCount=5`` does): those losses are the trainer's, not ours.
``MSTB_CHAOS_SEEDS`` (default 1) seeds run per wake-up mode, ``MSTB_CHAOS_OPS`` (default 60)
operations each.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from live_helpers import LiveEnv, RankLog, all_written, wait_until

pytest_plugins = ["live_helpers"]

SEEDS = int(os.environ.get("MSTB_CHAOS_SEEDS", "1"))
OPS = int(os.environ.get("MSTB_CHAOS_OPS", "60"))
_OPS = ["steps"] * 6 + ["rotate", "shift", "split", "partial", "kill", "term", "hup", "truncate", "delete",
                        "resume", "sleep"]


class _Chaos:
    def __init__(self, live: LiveEnv, seed: int) -> None:
        self.live = live
        self.rng = random.Random(seed)
        self.logs = [live.info_log(0), live.info_log(1), live.worker_log(2)]
        self.sidecar = live.sidecar().start()
        self.unread_rollovers = {log.rank: 0 for log in self.logs}
        self.trace: list[str] = []

    def caught_up(self) -> None:
        wait_until(lambda: all_written(self.live.out, self.logs), 15, f"catching up after {self.trace[-12:]}")
        self.unread_rollovers = dict.fromkeys(self.unread_rollovers, 0)

    def may_roll_over(self, log: RankLog) -> bool:
        if log.rank == 2:
            return False  # msrun does not rotate worker logs
        if self.unread_rollovers[log.rank] >= 4:
            if not self.sidecar.running():
                return False
            self.caught_up()
        self.unread_rollovers[log.rank] += 1
        return True

    def step(self) -> None:
        op, log, rng, up = self.rng.choice(_OPS), self.rng.choice(self.logs), self.rng, self.sidecar.running()
        self.trace.append(f"{op}:{log.rank}:{'up' if up else 'down'}")
        if op == "steps":
            log.step(rng.randint(1, 30))
        elif op == "rotate" and self.may_roll_over(log):
            log.rotate()
        elif op == "shift" and up and self.may_roll_over(log):
            log.shift()
            log.step(rng.randint(1, 5))
            log.reopen()
        elif op == "split":
            record = log.take()
            head = record.index(b"\n") + 1
            log.write(record[:head])
            if self.may_roll_over(log):
                log.rotate()
            log.write(record[head:])
        elif op == "partial":
            record = log.take()
            cut = rng.randint(1, len(record) - 1)
            log.write(record[:cut])
            time.sleep(rng.uniform(0, 0.4))
            log.write(record[cut:])
        elif op == "kill" and up:
            self.sidecar.kill()
        elif op == "term" and up:
            assert self.sidecar.stop()[0] == 0
        elif op == "hup" and up:
            self.sidecar.proc.send_signal(signal.SIGHUP)
        elif op in ("truncate", "delete") and up:
            self.caught_up()
            if op == "truncate":
                log.truncate()
            else:
                log.delete_and_recreate()
        elif op == "resume" and log.next_step > 5:
            log.go_back(rng.randint(max(1, log.next_step - 30), log.next_step - 1))
            log.step(rng.randint(1, 10))
        elif op == "sleep":
            time.sleep(rng.uniform(0, 1.0))
        if not self.sidecar.running() and rng.random() < 0.5:
            self.sidecar.start()
        time.sleep(rng.uniform(0, 0.05))


@pytest.mark.parametrize("seed", range(SEEDS))
def test_random_operations_keep_every_point_exactly_once(live: LiveEnv, seed: int) -> None:
    chaos = _Chaos(live, seed * 2 + (live.mode == "poll"))
    for _ in range(OPS):
        chaos.step()
    if not chaos.sidecar.running():
        chaos.sidecar.start()
    live.finish(chaos.sidecar, chaos.logs, timeout=20)
