"""The MLflow sink's sending thread: sealed spool segments to the tracking server, oldest first.

It alone talks to the server (:class:`mlflow.MlflowClient`, imported here, in this thread: the
engine never waits for MLflow's import or its network). Per segment, its operations grouped by run
(each run's in order) are sent in ``log_batch`` requests of one run within MLflow's limits (1000
metrics, 100 tags, 100 params, 1000 in all); a run is created the first time it is named, after a search for one with its
``mstb.run`` and ``instance`` tags (a kill between the creation and the saving of its id must not
make a second run); then the segment is confirmed (:meth:`Spool.confirm`). The oldest segments are
taken together, up to :data:`BUNDLE` points: a checkpoint every few seconds makes small ones.

Faults: a network error, a timeout, a 5xx or a 429 (MLflow's own retries are turned off, so the
thread sees them at once) is retried with exponential backoff and jitter, from the batch that
failed, for as long as it takes: the segments wait on disk, the engine goes on. Any other answer
is final: the batch's points are counted as ``rejected`` and the first such answer is logged. A
segment sealed before this start may have been sent in part before a kill: each of its metric
keys' history is read from the server first (once, then kept up to date while such segments are
sent) and the points it holds, by (step, timestamp), are not sent again. Settings go as params once; a key whose value changed later keeps its first value
(MLflow forbids a change), and the tag ``mstb.settings_changed`` names it; ``settings.json``, an
artifact, always has the latest settings in full.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import socket
import threading
import time
from collections.abc import Callable

from sidecar import __version__
from sidecar.output.mlflow_spool import BUNDLE, Spool

log = logging.getLogger(__name__)

MAX_METRICS, MAX_TAGS, MAX_PARAMS, MAX_ENTITIES = 1000, 100, 100, 1000  # one log_batch request
MAX_KEY, MAX_PARAM_VALUE, MAX_TAG_VALUE = 250, 6000, 8000
MIN_BACKOFF, MAX_BACKOFF = 0.5, 30.0
STALLED = 60.0  # close(): a sender without progress this long (nor failing) is given up on
RESUME_METRIC = "mstb/resumed-at"  # a resume: the step training went back to, at that step
_BAD_KEY = re.compile(r"[^/\w.\- :]")
STATUS = {"finished": "FINISHED", "failed": "FAILED", "running": "RUNNING"}  # events/lifecycle/<state>


def short(text: str, limit: int) -> str:
    """``text`` within ``limit`` characters, visibly cut (``…``) when it was longer."""
    return text if len(text) <= limit else text[:limit - 1] + "…"


def key_for(name: str) -> str:
    """A valid MLflow key for ``name``: odd characters as ``_``, cut visibly (``...``) past 250."""
    key = _BAD_KEY.sub("_", name)
    return key if len(key) <= MAX_KEY else key[:MAX_KEY - 3] + "..."


def by_run(ops: list[list]) -> list[list]:
    """A segment's operations for the server grouped by run, each run's in their order: runs
    interleave step by step, and a batch holds one run's. (``"a"``, a position, is the spool's.)"""
    first: dict[str, int] = {}
    return sorted((op for op in ops if op[0] != "a"), key=lambda op: first.setdefault(op[1], len(first)))


class Sender:
    def __init__(self, uri: str, experiment: str, instance: str, spool: Spool, counts: dict[str, int]) -> None:
        self.uri, self.experiment, self.instance = uri, experiment, instance
        self.spool, self.counts = spool, counts
        self.ids: dict[str, str] = {}  # run -> MLflow run id
        self.experiment_id: str | None = None
        self.verify_all = False  # the spool was lost: check every point against the server
        self.failing_since: float | None = None
        self._last_error = ""
        self._rejection_logged = False
        self._artifact_logged = False
        self._history: dict[tuple[str, str], set[tuple[int, int]]] = {}  # what the server holds, while unsure
        self._wake = threading.Condition()
        self._stop = False
        self._progress = 0  # operations done: what close() watches
        self._thread = threading.Thread(target=self._loop, name="mlflow-sender", daemon=True)

    def start(self) -> None:
        sent = self.spool.sent if self.spool.sent.get("uri") in (None, self.uri) else {}  # ids of another server
        self.ids = dict(sent.get("runs", {})) if isinstance(sent.get("runs"), dict) else {}
        self.experiment_id = sent.get("experiment") if isinstance(sent.get("experiment"), str) else None
        self._thread.start()

    def wake(self) -> None:
        with self._wake:
            self._wake.notify_all()

    def stop(self, quiet: float) -> None:
        """Send what is sealed while the server takes it: stop once it has failed for ``quiet``
        seconds since this was called, or made no progress for :data:`STALLED` (a slow request)."""
        began = seen_at = time.monotonic()
        seen = -1
        while self.spool.first() is not None and self._thread.is_alive():
            now = time.monotonic()
            if self._progress != seen:
                seen, seen_at = self._progress, now
            failing = self.failing_since is not None and now - max(self.failing_since, began) >= quiet
            if failing or now - seen_at >= max(quiet, STALLED):
                break
            time.sleep(0.05)
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        self._thread.join(quiet)

    # -- the thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        client = None
        backoff = MIN_BACKOFF
        ops: list[list] = []
        number, at, unsure = None, 0, False
        while not self._stop:
            try:
                if client is None:  # at once: MLflow's import takes seconds, better before the first segment
                    client = self._client()
                    self._progress += 1
                if number is None:
                    numbers = self.spool.oldest(BUNDLE)
                    if not numbers:
                        with self._wake:
                            self._wake.wait_for(lambda: self._stop or self.spool.first() is not None, 1.0)
                        continue
                    number, at = numbers[-1], 0
                    ops = by_run([op for n in numbers for op in self.spool.read(n)])
                    unsure = self.verify_all or not self.spool.unsure.isdisjoint(numbers)
                    if not unsure:
                        self._history.clear()
                while at < len(ops) and not self._stop:
                    at = self._step(client, ops, at, unsure)
                    self._progress += 1
                    self._recovered()
                if at == len(ops):
                    self.spool.confirm(number, self._ids())
                    number = None
                backoff = MIN_BACKOFF
            except Exception as exc:  # noqa: BLE001 - anything the client raises is a failed attempt
                self._failed(exc)
                with self._wake:
                    self._wake.wait_for(lambda: self._stop, backoff * random.uniform(0.5, 1.0))
                backoff = min(backoff * 2, MAX_BACKOFF)

    def _client(self):  # noqa: ANN202 - mlflow's type, imported here
        # Our own retries, not MLflow's (which would hold this thread for minutes), and no run URLs
        # printed on standard output (a replay's summary goes there).
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri=self.uri)

    def _step(self, client, ops: list[list], at: int, unsure: bool) -> int:  # noqa: ANN001
        """Do ``ops[at]`` (with the operations after it that go in the same batch); the next index."""
        op = ops[at]
        kind, run = op[0], op[1]
        run_id = self._run(client, run, op[2] if kind == "n" else None)
        if kind == "n":
            return at + 1
        if kind == "p":
            self._params(client, run_id, op[2])
            return at + 1
        if kind == "s":
            if op[2] == "RUNNING":
                self._call(lambda: client.update_run(run_id, status="RUNNING"), 1)
            else:
                self._call(lambda: client.set_terminated(run_id, op[2], op[3]), 1)
            return at + 1
        return self._batch(client, run_id, ops, at, unsure)

    def _batch(self, client, run_id: str, ops: list[list], at: int, unsure: bool) -> int:  # noqa: ANN001
        from mlflow.entities import Metric, RunTag

        metrics: list = []
        tags: dict[str, RunTag] = {}
        run, end = ops[at][1], at
        while end < len(ops) and ops[end][0] in ("m", "t", "r") and ops[end][1] == run:
            op = ops[end]
            if len(metrics) >= MAX_METRICS or len(tags) >= MAX_TAGS or len(metrics) + len(tags) >= MAX_ENTITIES:
                break
            if op[0] == "t":
                tags[op[2]] = RunTag(key_for(op[2]), short(op[3], MAX_TAG_VALUE))
            else:
                key, value, step, ts = (op[2], op[3], op[4], op[5]) if op[0] == "m" else (RESUME_METRIC, op[2], op[2], op[3])
                if unsure:
                    present = self._present(client, run_id, key)
                    if (step, ts) in present:
                        end += 1
                        continue
                    present.add((step, ts))  # a later segment's copy is not sent twice either
                metrics.append(Metric(key_for(key), float(value), ts, step))
            end += 1
        self._call(lambda: client.log_batch(run_id, metrics=metrics, tags=list(tags.values())), len(metrics))
        self.counts["sent"] += len(metrics)
        return end

    def _present(self, client, run_id: str, key: str) -> set[tuple[int, int]]:  # noqa: ANN001
        """(step, timestamp) of the points ``key`` has on the server (read once, then kept up to date)."""
        found = self._history.get((run_id, key))
        if found is None:
            found = self._history[(run_id, key)] = {(m.step, m.timestamp) for m in
                                                      client.get_metric_history(run_id, key_for(key))}
        return found

    def _params(self, client, run_id: str, content: dict) -> None:  # noqa: ANN001
        """The settings as params (new keys; a changed one is named in a tag), its hash as a tag,
        and in full as ``settings.json``."""
        from mlflow.entities import Param, RunTag

        values = content.get("settings") if isinstance(content.get("settings"), dict) else content
        have = client.get_run(run_id).data.params
        params, changed = {}, []
        for name, value in values.items():
            key, text = key_for(str(name)), short(value if isinstance(value, str) else json.dumps(value), MAX_PARAM_VALUE)
            if key not in have:
                params.setdefault(key, Param(key, text))
            elif have[key] != text:
                changed.append(key)
        tags = [RunTag("config_hash", str(content["config_hash"]))] if content.get("config_hash") else []
        if changed:
            tags.append(RunTag("mstb.settings_changed", short(
                f"{len(changed)} setting(s) changed since the params were logged (settings.json has the "
                f"latest): {', '.join(changed)}", MAX_TAG_VALUE)))
        batch = list(params.values())
        for start in range(0, max(len(batch), 1), MAX_PARAMS):
            part = batch[start:start + MAX_PARAMS]
            self._call(lambda: client.log_batch(run_id, params=part, tags=tags if start == 0 else []), 0)
        try:
            client.log_dict(run_id, content, "settings.json")
        except Exception as exc:  # noqa: BLE001 - an artifact store the client cannot reach
            self.counts["artifacts-failed"] += 1
            if not self._artifact_logged:
                self._artifact_logged = True
                log.warning("MLflow: cannot store settings.json for run %s (%s); the params and tags are "
                            "logged (later failures are only counted)", run_id, str(exc).splitlines()[0][:300])

    def _run(self, client, run: str, rank: int | None) -> str:  # noqa: ANN001
        """The MLflow run id of ``run``: known, found by its tags, or created (and saved at once)."""
        known = self.ids.get(run)
        if known is not None:
            return known
        if self.experiment_id is None:
            self.experiment_id = self._experiment(client)
        quoted = run.replace("'", "\\'")
        found = client.search_runs([self.experiment_id], max_results=1, filter_string=(
            f"tags.`mstb.run` = '{quoted}' and tags.instance = '{self.instance.replace(chr(39), chr(92) + chr(39))}'"))
        if found:
            run_id = found[0].info.run_id
        else:
            tags = {"mstb.run": run, "instance": self.instance, "host": socket.gethostname(),
                    "mstb.source": f"mstb-sidecar {__version__}", **({"rank": str(rank)} if rank is not None else {})}
            run_id = client.create_run(self.experiment_id, run_name=run, tags=tags).info.run_id
        self.ids = {**self.ids, run: run_id}  # a new dict: sync() reads it from the engine's thread
        self.spool.save_ids(self._ids())
        return run_id

    def _ids(self) -> dict:
        return {"uri": self.uri, "experiment": self.experiment_id, "runs": self.ids}

    def _experiment(self, client) -> str:  # noqa: ANN001
        found = client.get_experiment_by_name(self.experiment)
        if found is not None:
            return found.experiment_id
        try:
            return client.create_experiment(self.experiment)
        except Exception:  # noqa: BLE001 - another sidecar made it meanwhile
            found = client.get_experiment_by_name(self.experiment)
            if found is None:
                raise
            return found.experiment_id

    def _call(self, request: Callable[[], object], points: int) -> None:
        """One request; a final refusal is counted (``points`` rejected) and logged once, not raised."""
        try:
            request()
        except Exception as exc:
            status = getattr(exc, "get_http_status_code", lambda: 500)()
            if type(exc).__name__ != "RestException" or not 400 <= status < 500 or status == 429:
                raise
            self.counts["rejected"] += points
            if not self._rejection_logged:
                self._rejection_logged = True
                log.warning("MLflow at %s refused a request (%s); its %d point(s) are counted as rejected, not "
                            "retried (later refusals are only counted)", self.uri, str(exc)[:300], points)

    def _failed(self, exc: Exception) -> None:
        self.counts["retries"] += 1
        self._last_error = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        if self.failing_since is None:
            self.failing_since = time.monotonic()
            log.warning("MLflow at %s: %s; retrying with backoff, the points wait in the spool on disk",
                        self.uri, self._last_error)

    def _recovered(self) -> None:
        if self.failing_since is not None:
            log.info("MLflow at %s works again after %.0f s", self.uri, time.monotonic() - self.failing_since)
            self.failing_since = None

    def describe(self) -> str:
        since = self.failing_since
        return f"failing since {time.monotonic() - since:.0f} s: {self._last_error}" if since is not None else ""
