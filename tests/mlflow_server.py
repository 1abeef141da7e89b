"""A real MLflow tracking server for the tests: ``mlflow server`` with a SQLite backend on 127.0.0.1.

Started as a child process (it takes seconds: the first start makes the database), waited for on
``/health``, stopped (and started again on the same port and database, for the outage tests) and
read back with MLflow's own client. Without MLflow's job execution (``MLFLOW_SERVER_ENABLE_JOB_EXECUTION``:
a job runner and seven ``huey`` consumer processes for GenAI jobs and trace roll-ups, none of which
the tracking API the sink uses needs): on a 2-core machine their start-up alone took seconds of
CPU from every start of the server and from the tests running beside it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from live_helpers import free_port, poll

START_TIMEOUT = 180.0  # the first start migrates the SQLite schema: tens of seconds on a loaded machine


class MLflowServer:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        mlflow = shutil.which("mlflow", path=str(Path(sys.executable).parent)) or "mlflow"
        log = open(self.root / "server.log", "ab")
        self.proc = subprocess.Popen(
            [mlflow, "server", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
             "--artifacts-destination", str(self.root / "artifacts"), "--host", "127.0.0.1",
             "--port", str(self.port), "--workers", "1"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.root,
            env={**os.environ, "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
                 "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        log.close()

        def up() -> bool:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {(self.root / 'server.log').read_text()[-2000:]}")
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as answer:
                return answer.status == 200

        if poll(up, bool, START_TIMEOUT, (OSError,))[0]:
            return
        self.stop()
        raise RuntimeError(f"mlflow server not up after {START_TIMEOUT:.0f} s")

    def stop(self) -> None:
        """Stop the server and its workers (its own process group), and wait for them."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass
        self.proc = None

    def client(self):  # noqa: ANN201 - MlflowClient
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri=self.uri)
