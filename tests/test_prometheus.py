"""The shipped Prometheus rules and the endpoint, with the real ``promtool`` and ``prometheus``.

Debian's ``prometheus`` package provides both; ``scripts/test`` installs it where it can (root
with apt-get, as in CI) and then requires it (``MSTB_REQUIRE_PROMETHEUS=1``); elsewhere these
tests skip and say why. The live test runs a sidecar with ``--metrics-port`` on 127.0.0.1, a
Prometheus scraping it every second with the shipped rules loaded, and reads the per-rank
gauges, a firing alert and every query of the shipped Grafana dashboard back through
Prometheus' HTTP query API.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from live_helpers import LiveEnv, RankLog, free_port, wait_until

pytest_plugins = ["live_helpers"]

RULES = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if os.environ.get("MSTB_REQUIRE_PROMETHEUS") == "1":
            pytest.fail(f"{name} is required here (MSTB_REQUIRE_PROMETHEUS=1) but not on PATH; "
                        "scripts/test installs Debian's prometheus package")
        pytest.skip(f"{name} not installed (Debian package 'prometheus'; scripts/test installs it when run as root)")
    return path


def test_promtool_checks_and_unit_tests_every_shipped_rule() -> None:
    promtool = binary("promtool")
    check = subprocess.run([promtool, "check", "rules", "mstb-sidecar-rules.yml"], cwd=RULES,
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and "SUCCESS: 8 rules found" in check.stdout, check.stdout + check.stderr
    unit = subprocess.run([promtool, "test", "rules", "mstb-sidecar-rules.test.yml"], cwd=RULES,
                          capture_output=True, text=True, timeout=60)
    assert unit.returncode == 0 and "SUCCESS" in unit.stdout, unit.stdout + unit.stderr
    rules = (RULES / "mstb-sidecar-rules.yml").read_text()
    tested = (RULES / "mstb-sidecar-rules.test.yml").read_text()
    names = [line.split(":", 1)[1].strip() for line in rules.splitlines() if line.strip().startswith("- alert:")]
    assert len(names) == 8 and all(f"alertname: {name}" in tested for name in names)


def query(port: int, expr: str, headers: dict[str, str] | None = None) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=2) as resp:
            return json.load(resp)["data"]["result"]
    except OSError:
        return []


@pytest.mark.parametrize("wake_mode", ["inotify"])
def test_a_real_prometheus_scrapes_the_per_rank_gauges_and_fires_on_nan(live: LiveEnv, tmp_path: Path) -> None:
    prometheus = binary("prometheus")
    metrics, web = free_port(), free_port()
    logs = [RankLog(live.output / "log" / f"rank_{r}" / "info.log", r,
                    loss_of=lambda step, r=r: math.nan if (r, step) == (1, 30) else 2.0 + r / 100 + step / 1000)
            for r in (0, 1)]
    for log in logs:
        log.step(20)
    sidecar = live.sidecar("--metrics-port", str(metrics), "--job", "llama-test").start()
    config = tmp_path / "prometheus.yml"
    config.write_text(f"""global: {{scrape_interval: 1s, evaluation_interval: 1s}}
rule_files: ["{RULES / 'mstb-sidecar-rules.yml'}"]
scrape_configs:
  - job_name: mstb-sidecar
    static_configs: [{{targets: ["127.0.0.1:{metrics}"]}}]
""")
    server = subprocess.Popen([prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                               f"--web.listen-address=127.0.0.1:{web}"],
                              stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"))
    try:
        def gauges() -> dict[str, float] | None:
            found = {r["metric"]["rank"]: float(r["value"][1])
                     for r in query(web, 'mstb_sidecar_training_loss{training_job="llama-test"}')}
            return found if found.keys() == {"0", "1"} else None

        got = wait_until(gauges, 30, "Prometheus to scrape both ranks' loss")
        assert got == pytest.approx({"0": 2.020, "1": 2.030}, rel=1e-6)
        steps = {r["metric"]["rank"]: float(r["value"][1]) for r in query(web, "mstb_sidecar_training_step")}
        assert steps == {"0": 20.0, "1": 20.0}
        for name in ("learning_rate", "grad_norm", "loss_scale", "step_seconds", "seconds_since_step"):
            assert len(query(web, f"mstb_sidecar_training_{name}")) == 2, name
        assert query(web, "mstb_sidecar_training_step_seconds")[0]["value"][1] == "0.512"

        for log in logs:
            log.step(15)  # rank 1's loss is NaN at step 30

        def firing() -> list[dict]:
            url = f"http://127.0.0.1:{web}/api/v1/alerts"
            with urllib.request.urlopen(url, timeout=2) as resp:
                alerts = json.load(resp)["data"]["alerts"]
            return [a for a in alerts if a["labels"]["alertname"] == "TrainingNonFinite" and a["state"] == "firing"]

        alert = wait_until(firing, 30, "TrainingNonFinite to fire in Prometheus")[0]
        assert alert["labels"]["rank"] == "1" and alert["labels"]["alert"] == "nan-loss"
        assert alert["annotations"]["summary"] == "nan-loss on rank 1 of llama-test"
        raised = wait_until(lambda: query(web, "mstb_sidecar_alerts_total"), 10, "the alert counter")
        labels = ("rank", "alert", "training_job")
        assert [(*(r["metric"][k] for k in labels), r["value"][1]) for r in raised] == [("1", "nan-loss", "llama-test", "1")]

        dashboard = json.loads((RULES.parent / "grafana" / "mstb-sidecar-job.json").read_text())
        for panel in dashboard["panels"]:  # every chart of the shipped dashboard has data for this job
            expr = panel["targets"][0]["expr"].replace("$training_job", "llama-test")
            assert query(web, expr), f"dashboard panel {panel['title']!r}: no data for {expr}"
    finally:
        server.terminate()
        server.wait(20)
    rc, _ = sidecar.stop()
    assert rc == 0, sidecar.stderr()
