"""A real TensorBoard server on 127.0.0.1, for tests that check what a user's browser would get.

``load_fast="true"`` is TensorBoard's Rust data server, ``"false"`` its Python loader: they
read event files differently (purges, downsampling), so display tests may run on both.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from live_helpers import free_port, poll


class TensorBoard:
    def __init__(self, port: int) -> None:
        self.port = port

    def get(self, path: str, **params: str) -> object:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}{query}", timeout=5) as response:
            return json.loads(response.read())

    def wait_for(self, path: str, done: Callable[[object], bool], timeout: float = 90, **params: str) -> object:
        """GET ``path`` until ``done(answer)``; the last answer when ``timeout`` passes first."""
        return poll(lambda: self.get(path, **params), done, timeout, (OSError, json.JSONDecodeError))[1]


@contextmanager
def tensorboard(logdir: Path, load_fast: str = "true") -> Iterator[TensorBoard]:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1",
         "--port", str(port), f"--load_fast={load_fast}", "--reload_interval=1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        yield TensorBoard(port)
    finally:
        server.terminate()
        server.wait(timeout=30)
