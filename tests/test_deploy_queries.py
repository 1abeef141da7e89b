"""Every series and label the shipped Grafana dashboard and Prometheus rules name exists on a real
sidecar's ``/metrics``, and the job selector applies to every dashboard panel.

A sidecar follows a copy of the genuine diverging v1.9 run (it finishes, raises ``nan-grad-norm``
and ``overflow``), with ``--metrics-port``; one scrape of it is the truth. From
``deploy/grafana/*.json`` (each panel's ``expr``, the template variables' ``label_values``) and
``deploy/prometheus/*.yml`` (each rule's ``expr`` and the ``$labels`` its annotations use, each
``promtool`` input series) every metric selector, label matcher and grouping label is taken out
of the PromQL and checked against that scrape: the metric is exposed, each label is on it (or is
Prometheus' own ``job``/``instance``), and a positive matcher's value matches a value it has
(not for the made-up series of the rule tests, whose ranks and alerts are examples).
Without Prometheus: ``tests/test_prometheus.py`` runs the real one where it is installed.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from live_helpers import free_port, wait_until

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DIVERGE = Path(__file__).parent / "fixtures" / "real" / "mf1.9-diverge" / "output"
BIN = Path(sys.executable).with_name("mstb-sidecar")
JOB = "llama"
ADDED_BY_PROMETHEUS = {"job", "instance"}
PROMETHEUS_OWN = {"up": ADDED_BY_PROMETHEUS}  # series Prometheus makes itself, not the sidecar
KEYWORDS = {"by", "on", "without", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or", "unless"}
GROUPING = re.compile(r"\b(by|on|without|ignoring|group_left|group_right)\s*\(([^)]*)\)")
SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)?\s*\{([^}]*)\}")
MATCHER = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*,?')


Series = dict[str, dict[str, set[str]]]  # metric -> label -> values seen


class Query:
    """What one PromQL expression names: (metric, [(label, op, value)]) selectors, grouping labels."""

    def __init__(self, expr: str, where: str) -> None:
        self.where = where
        self.selectors: list[tuple[str, list[tuple[str, str, str]]]] = []
        rest = expr
        for match in SELECTOR.finditer(expr):
            matchers, text = [], match.group(2)
            while text.strip():
                found = MATCHER.match(text)
                assert found, f"{where}: cannot read the matchers {{{match.group(2)}}}"
                matchers.append(found.groups())
                text = text[found.end():]
            self.selectors.append((match.group(1), matchers))
        rest = SELECTOR.sub(" ", rest)
        self.grouping = {label.strip() for _, labels in GROUPING.findall(rest)
                         for label in labels.split(",") if label.strip()}
        rest = GROUPING.sub(" ", rest)
        rest = re.sub(r"\[[^]]*\]|\boffset\s+\w+|\"[^\"]*\"", " ", rest)
        for name in re.findall(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*\b(?!\s*\()", rest):
            if name not in KEYWORDS:
                self.selectors.append((name, []))

    def metrics(self) -> set[str]:
        return {name for name, _ in self.selectors}


def scrape(port: int) -> Series:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    series: Series = defaultdict(lambda: defaultdict(set))
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = series[sample.name]
            for label, value in sample.labels.items():
                labels[label].add(value)
    return series


def labels_of(series: Series, metric: str) -> set[str]:
    if metric in PROMETHEUS_OWN:
        return PROMETHEUS_OWN[metric]
    return set(series[metric]) | ADDED_BY_PROMETHEUS


def check(query: Query, series: Series, values: bool = True) -> list[str]:
    """What ``query`` names that the scrape does not have (``values``: and the values it matches)."""
    wrong = []
    for metric, matchers in query.selectors:
        if metric not in series and metric not in PROMETHEUS_OWN:
            wrong.append(f"{query.where}: no series {metric}")
            continue
        for label, op, value in matchers:
            if label not in labels_of(series, metric):
                wrong.append(f"{query.where}: {metric} has no label {label}")
            elif values and op in ("=", "=~") and label not in ADDED_BY_PROMETHEUS:
                seen = series[metric][label]
                if not any(re.fullmatch(value if op == "=~" else re.escape(value), v) for v in seen):
                    wrong.append(f"{query.where}: {metric}{{{label}{op}{value!r}}} matches none of {sorted(seen)}")
    for label in query.grouping:
        for metric in query.metrics():
            if label not in labels_of(series, metric):
                wrong.append(f"{query.where}: {metric} has no label {label} to group or match on")
    return wrong


def dashboard_queries() -> list[Query]:
    found = []
    for path in sorted((DEPLOY / "grafana").glob("*.json")):
        board = json.loads(path.read_text())
        for variable in board["templating"]["list"]:
            if variable.get("type") == "query":
                metric, label = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", variable["definition"]).groups()
                found.append(Query(f"{metric}{{{label}=~\".+\"}}", f"{path.name} variable {variable['name']}"))
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                expr = target["expr"].replace("$training_job", JOB)
                found.append(Query(expr, f"{path.name} panel {panel['title']!r}"))
    return found


def rule_queries() -> list[tuple[Query, set[str]]]:
    """Each rule's query, with the labels its annotations and labels templates use."""
    found = []
    for path in sorted((DEPLOY / "prometheus").glob("*-rules.yml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                templated = set(re.findall(r"\$labels\.(\w+)", json.dumps(rule)))
                found.append((Query(rule["expr"], f"{path.name} {rule['alert']}"), templated))
    return found


def input_series(path: Path) -> list[Query]:
    tests = yaml.safe_load(path.read_text())["tests"]
    return [Query(series["series"], f"{path.name} input {series['series']}") for test in tests
            for series in test.get("input_series", [])]


@pytest.fixture(scope="module")
def series(tmp_path_factory: pytest.TempPathFactory) -> Series:
    tmp = tmp_path_factory.mktemp("deploy")
    shutil.copytree(DIVERGE, tmp / "output")
    port = free_port()
    # --remote-write to a closed port: its own series (MstbSidecarPushSilent) are on /metrics too; the
    # pushes that cannot be sent are given up on exit after a second.
    (tmp / "sidecar.yaml").write_text("drain_timeout: 1\n")
    proc = subprocess.Popen([str(BIN), "--watch", str(tmp / "output"), "--out", str(tmp / "out"), "--job", JOB,
                             "--metrics-port", str(port), "-q", "--remote-write", f"http://127.0.0.1:{free_port()}/w",
                             "--config", str(tmp / "sidecar.yaml")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        def complete() -> Series | None:
            try:
                got = scrape(port)
            except OSError:
                return None
            done = "finished" in got["mstb_sidecar_training_state"].get("state", set()) and \
                "mstb_sidecar_alerts_total" in got and "mstb_sidecar_alert_active" in got
            return got if done else None

        found = wait_until(complete, 60, "the sidecar to read the run to its end and raise its alerts", 0.2)
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0, proc.stderr.read() if proc.stderr else ""
    return found


def test_the_scrape_labels_every_series_with_the_job_and_alerts_with_alert(series: Series) -> None:
    """The label set the dashboard and rules rely on: ``training_job`` everywhere, ``alert`` for an
    alert's name in both alert metrics, no duplicate of ``training_step``."""
    ours = {name: labels for name, labels in series.items() if name.startswith("mstb_sidecar_")}
    assert len(ours) > 20
    assert not [name for name, labels in ours.items() if labels.get("training_job") != {JOB}]
    assert set(ours["mstb_sidecar_alerts_total"]) == set(ours["mstb_sidecar_alert_active"]) == {
        "training_job", "rank", "alert"}
    assert ours["mstb_sidecar_alerts_total"]["alert"] == {"nan-grad-norm", "overflow"}
    for per_rank in ("mstb_sidecar_records_written_total", "mstb_sidecar_points_written_total",
                     "mstb_sidecar_training_step"):
        assert set(ours[per_rank]) == {"training_job", "rank"}, per_rank
    assert "mstb_sidecar_last_step" not in ours


def test_every_dashboard_query_names_series_and_labels_the_sidecar_has(series: Series) -> None:
    queries = dashboard_queries()
    assert len(queries) >= 12
    assert [w for q in queries for w in check(q, series)] == []
    unfiltered = [q.where for q in queries if "variable" not in q.where and any(
        name not in PROMETHEUS_OWN and ("training_job", "=", JOB) not in matchers for name, matchers in q.selectors)]
    assert unfiltered == [], "panels the Job selector does not apply to"


def test_every_rule_and_rule_test_names_series_and_labels_the_sidecar_has(series: Series) -> None:
    rules = rule_queries()
    assert len(rules) == 8
    wrong = [w for q, _ in rules for w in check(q, series)]
    for query, templated in rules:
        have = set.union(*(labels_of(series, m) for m in query.metrics()))
        wrong += [f"{query.where}: its template uses $labels.{label}, which it has not" for label in templated - have]
    inputs = [q for path in sorted((DEPLOY / "prometheus").glob("*.test.yml")) for q in input_series(path)]
    assert len(inputs) >= 10
    assert wrong + [w for q in inputs for w in check(q, series, values=False)] == []


def test_the_query_reader_sees_what_a_query_names() -> None:
    """The PromQL reading itself: selectors, matchers, grouping labels, functions left out."""
    query = Query('max by (training_job) (a_b{x="1", y=~"n-.*"}) - on (training_job) group_right c '
                  "< 0.7 * avg_over_time(d[30m] offset 10m) > 50e6", "example")
    assert query.selectors == [("a_b", [("x", "=", "1"), ("y", "=~", "n-.*")]), ("c", []), ("d", [])]
    assert query.grouping == {"training_job"}
    series: Series = {"a_b": {"x": {"1"}, "y": {"n-1"}, "training_job": {"j"}}, "c": {"training_job": {"j"}},
                      "d": {"training_job": {"j"}}}
    assert check(query, series) == []
    assert check(Query('a_b{x="2"} + e', "typo"), series) == [
        "typo: a_b{x='2'} matches none of ['1']", "typo: no series e"]
