"""Regenerate docs/tensorboard.png, the README's picture of TensorBoard, from real output.

    .venv/bin/python scripts/screenshot.py [--out docs/tensorboard.png] [--tab custom_scalars]

Replays the bundled 2-rank mindformers 1.9 run (tests/fixtures/real/mf1.9-dp2/output) into a
temporary directory, serves it with TensorBoard on 127.0.0.1, waits until TensorBoard has loaded
every point, and has a headless Chromium take the screenshot. It installs nothing: Chromium must
be there already (Debian: ``apt-get install chromium``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "tests" / "fixtures" / "real" / "mf1.9-dp2" / "output"
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
STEPS = 200  # steps per rank in the example: TensorBoard has loaded it all when it serves these


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "tensorboard.png")
    parser.add_argument("--tab", default="custom_scalars", help="TensorBoard tab (custom_scalars, timeseries, text, ...)")
    parser.add_argument("--size", default="1400,1000", help="browser window WIDTH,HEIGHT")
    args = parser.parse_args()
    browser = next((b for b in map(shutil.which, BROWSERS) if b), None)
    if browser is None:
        sys.exit("screenshot: no Chromium found (looked for " + ", ".join(BROWSERS) + "); install one, "
                 "e.g. apt-get install chromium")
    with tempfile.TemporaryDirectory(prefix="mstb-screenshot-") as tmp:
        summary = Path(tmp) / "summary"
        subprocess.run([sys.executable, "-m", "sidecar.cli", "replay", str(EXAMPLE), "--out", str(summary),
                        "--instance", "example", "--quiet"], check=True)
        port = _free_port()
        server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", "summary",  # shown as is
                                   "--host", "127.0.0.1", "--port", str(port)],
                                  cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_loaded(port)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            command = [browser, "--headless=new", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
                       f"--user-data-dir={Path(tmp) / 'browser'}", f"--window-size={args.size}",
                       "--force-device-scale-factor=1", "--virtual-time-budget=20000",
                       f"--screenshot={args.out.resolve()}", f"http://127.0.0.1:{port}/#{args.tab}"]
            if os.geteuid() == 0:
                command.insert(1, "--no-sandbox")  # Chromium refuses to run its sandbox as root
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=180)
        finally:
            server.terminate()
            server.wait(timeout=30)
    print(f"wrote {args.out}")
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_loaded(port: int, timeout: float = 120) -> None:
    """Until TensorBoard serves the layout and every step of every rank's loss."""
    base = f"http://127.0.0.1:{port}/data/plugin"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            layout = _get(f"{base}/custom_scalars/layout")
            losses = [_get(f"{base}/scalars/scalars?run=rank_{r}&tag=loss") for r in (0, 1)]
            if layout.get("category") and all(len(points) == STEPS for points in losses):
                return
        except (urllib.error.URLError, ConnectionError, json.JSONDecodeError):
            pass
        time.sleep(0.5)
    sys.exit(f"screenshot: TensorBoard did not load the example within {timeout:g} s")


def _get(url: str):  # noqa: ANN202 (JSON)
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


if __name__ == "__main__":
    sys.exit(main())
