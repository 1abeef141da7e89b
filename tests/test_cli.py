"""The command-line contract: exit codes, one-line errors without tracebacks, summary, config file,
and the defaults that --help and the docs state."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar import __version__, cli
from sidecar.service.config import SidecarConfig
from tb_read import scalars

VERSIONS = Path(__file__).parent / "fixtures" / "versions"
EXE = [sys.executable, "-m", "sidecar.cli"]


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*EXE, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_replay_prints_a_per_rank_summary_and_how_to_open_it(tmp_path: Path) -> None:
    proc = run("replay", str(VERSIONS / "v1.9.0-graph"), "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "rank" in out and "steps" in out and "r0.7+ graph trainer" in out
    assert f"tensorboard --logdir {tmp_path / 'out'}" in out
    rows = [r for r in map(str.split, out.splitlines()) if len(r) > 1 and r[0].isdigit() and r[1].isdigit()]
    assert [r[:4] for r in rows] == [["0", "16", "1", "16"], ["1", "16", "1", "16"]]
    assert "alert(s)" in out  # the tree has nan losses


def test_quiet_prints_nothing_on_success(tmp_path: Path) -> None:
    proc = run("replay", str(VERSIONS / "r0.7"), "--out", str(tmp_path / "out"), "--quiet")
    assert proc.returncode == 0 and proc.stdout == ""


def test_missing_path_is_a_one_line_error(tmp_path: Path) -> None:
    proc = run("replay", str(tmp_path / "nope"), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert "does not exist" in one_line_error(proc)


@pytest.mark.skipif(os.geteuid() == 0 and shutil.which("setpriv") is None, reason="needs a non-root user")
def test_unwritable_out_is_a_one_line_error(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    cmd = [*EXE, "replay", str(VERSIONS / "r0.7"), "--out", str(locked / "out")]
    if os.geteuid() == 0:  # root ignores mode bits: run as nobody, which can read the fixtures
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]
        os.chmod(tmp_path, 0o755)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(Path.cwd())})
    assert proc.returncode == 2
    line = one_line_error(proc)
    assert "cannot write to --out" in line and "choose a directory" in line


def test_out_that_is_a_file_is_a_one_line_error(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    proc = run("replay", str(VERSIONS / "r0.7"), "--out", str(target))
    assert proc.returncode == 2
    assert "cannot write to --out" in one_line_error(proc)


def test_nothing_matched_is_a_warning_and_exit_zero(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    proc = run("replay", str(tmp_path / "empty"), "--out", str(tmp_path / "out"))
    assert proc.returncode == 0
    assert "no mindformers logs found" in proc.stderr


def test_unreadable_config_is_a_one_line_error(tmp_path: Path) -> None:
    proc = run("replay", str(VERSIONS / "r0.7"), "--out", str(tmp_path / "o"), "--config", str(tmp_path / "none.yaml"))
    assert proc.returncode == 2
    assert "cannot read config file" in one_line_error(proc)


def test_invalid_yaml_and_bad_values_are_one_line_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("rank: [unclosed\n")
    proc = run("replay", str(VERSIONS / "r0.7"), "--out", str(tmp_path / "o"), "--config", str(bad))
    assert proc.returncode == 2 and "not valid YAML" in one_line_error(proc)
    bad.write_text("rank: -3\n")
    proc = run("replay", str(VERSIONS / "r0.7"), "--out", str(tmp_path / "o"), "--config", str(bad))
    assert proc.returncode == 2 and "'rank': Input should be greater than or equal to 0" in one_line_error(proc)
    bad.write_text("no_such_option: 1\n")
    proc = run("replay", str(VERSIONS / "r0.7"), "--out", str(tmp_path / "o"), "--config", str(bad))
    assert proc.returncode == 2 and "unknown option 'no_such_option'" in one_line_error(proc)


def test_config_reports_every_error_under_the_key_as_written_with_a_did_you_mean(tmp_path: Path) -> None:
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text("pol_interval: 0.5\nrescan-intervl: 2\naggregate: false\nrank: -3\ncheckpoint_interval: soon\n")
    proc = run("--watch", str(tmp_path), "--out", str(tmp_path / "o"), "--config", str(cfg))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [
        f"mstb-sidecar: error: {cfg}: unknown option 'pol_interval'; did you mean 'poll_interval'?",
        f"mstb-sidecar: error: {cfg}: unknown option 'rescan-intervl'; did you mean 'rescan-interval'?",
        f"mstb-sidecar: error: {cfg}: unknown option 'aggregate'; did you mean 'no_aggregate'?",
        f"mstb-sidecar: error: {cfg}: 'rank': Input should be greater than or equal to 0",
        f"mstb-sidecar: error: {cfg}: 'checkpoint_interval': Input should be a valid number, "
        "unable to parse string as a number",
    ]


def test_a_typo_inside_the_alerts_section_keeps_its_spelling_and_gets_a_did_you_mean(tmp_path: Path) -> None:
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text("alerts:\n  los-spike:\n    window: 5\n  stall:\n    secnds: 3\n  grad_norm_spik: {}\n")
    proc = run("--watch", str(tmp_path), "--out", str(tmp_path / "o"), "--config", str(cfg))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert sorted(proc.stderr.splitlines()) == sorted([
        f"mstb-sidecar: error: {cfg}: 'alerts.los-spike': unknown option; did you mean 'loss-spike'?",
        f"mstb-sidecar: error: {cfg}: 'alerts.stall.secnds': unknown option; did you mean 'min_seconds'?",
        f"mstb-sidecar: error: {cfg}: 'alerts.grad_norm_spik': unknown option; did you mean 'grad_norm_spike'?",
    ])


def test_replay_and_check_read_the_paths_from_the_config_files_watch(tmp_path: Path) -> None:
    log = tmp_path / "rank_3" / "info.log"
    log.parent.mkdir()
    shutil.copy(VERSIONS / "r0.7" / "output" / "log" / "rank_0" / "info.log", log)
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(f"watch: {tmp_path / 'rank_3'}\nout: {tmp_path / 'o'}\n")
    proc = run("replay", "--config", str(cfg))
    assert proc.returncode == 0, proc.stderr
    assert scalars(tmp_path / "o" / "rank_3")["loss"]
    assert run("check", "--config", str(cfg)).returncode == 0
    cfg.write_text(f"out: {tmp_path / 'o'}\n")
    proc = run("replay", "--config", str(cfg))
    assert proc.returncode == 2
    assert one_line_error(proc) == "mstb-sidecar replay: error: PATH (or watch: in --config): required"
    proc = run("replay", "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and "the following arguments are required: PATH" in proc.stderr


def test_config_keys_are_the_long_option_names_with_dash_or_underscore(tmp_path: Path) -> None:
    log = tmp_path / "rank_2" / "info.log"
    log.parent.mkdir()
    shutil.copy(VERSIONS / "r0.7" / "output" / "log" / "rank_0" / "info.log", log)
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(f"out: {tmp_path / 'o'}\nno-aggregate: true\nmax_line_bytes: 4096\nno_progress: true\n")
    proc = run("replay", str(log), "--config", str(cfg))
    assert proc.returncode == 0, proc.stderr
    names = {p.name for p in (tmp_path / "o").iterdir()}
    assert "rank_2" in names and "aggregate" not in names  # no-aggregate: true took effect


def test_no_arguments_prints_usage() -> None:
    proc = run()
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("usage: mstb-sidecar")
    assert "mstb-sidecar replay PATH... --out DIR" in proc.stderr and "Field required" not in proc.stderr


def test_missing_out_names_the_option() -> None:
    proc = run("--watch", "x")
    assert proc.returncode == 2 and one_line_error(proc) == "mstb-sidecar: error: --out DIR: required"


def test_metrics_port_in_use_is_its_own_error_and_exit_code(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = run("--watch", str(tmp_path), "--out", str(tmp_path / "o"), "--metrics-port", str(port))
    assert proc.returncode == 3
    line = one_line_error(proc)
    assert line == (f"mstb-sidecar: error: cannot serve metrics on 127.0.0.1:{port}: Address already in use; "
                    "choose another --metrics-port (or --metrics-host), or stop what uses it")


def test_bad_rank_pattern_is_a_one_line_error(tmp_path: Path) -> None:
    proc = run("replay", str(VERSIONS / "r0.7"), "--out", str(tmp_path / "o"), "--rank-pattern", "(unclosed")
    assert proc.returncode == 2 and "--rank-pattern" in one_line_error(proc)
    proc = run("replay", str(VERSIONS / "r0.7"), "--out", str(tmp_path / "o"), "--rank-pattern", r"^\d+ ")
    assert proc.returncode == 2 and "named group" in one_line_error(proc)


def test_config_file_supplies_options_and_the_command_line_wins(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    log.write_text((VERSIONS / "v1.9.0-pynative" / "output" / "log" / "rank_1" / "info.log").read_text())
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(f"out: {tmp_path / 'from_config'}\nrank: 5\nquiet: true\n")
    assert run("replay", str(log), "--config", str(cfg)).returncode == 0
    assert scalars(tmp_path / "from_config" / "rank_5")["loss"]
    other = tmp_path / "other"
    assert run("replay", str(log), "--config", str(cfg), "--rank", "7", "--out", str(other)).returncode == 0
    assert [p.name for p in other.iterdir() if p.name.startswith("rank_")] == ["rank_7"]


def test_single_file_without_rank_in_path_uses_rank_option(tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    shutil.copy(VERSIONS / "r0.7" / "output" / "log" / "rank_0" / "info.log", log)
    assert run("replay", str(log), "--out", str(tmp_path / "out"), "--rank", "3", "-q").returncode == 0
    assert [p.name for p in (tmp_path / "out").iterdir() if p.name.startswith("rank_")] == ["rank_3"]


def test_help_and_version() -> None:
    proc = run("--help")
    assert proc.returncode == 0
    assert "mstb-sidecar replay PATH... --out DIR" in proc.stdout and "mstb-sidecar check PATH..." in proc.stdout
    codes = proc.stdout[proc.stdout.index("exit codes:"):]
    assert all(f"\n  {code}  " in codes for code in range(5)), codes
    assert "Address" not in codes and "port in use" in codes
    replay_help = run("replay", "--help")
    assert replay_help.returncode == 0 and "exit codes:" in replay_help.stdout
    for flag in ("--version", "-V"):
        proc = run(flag)
        assert proc.returncode == 0 and proc.stdout == f"mstb-sidecar {__version__}\n"


@pytest.mark.parametrize("command", ["watch", "replay", "check"])
def test_the_defaults_help_states_are_the_configurations(command: str) -> None:
    """``--help`` says a default in words ("(default 0.25)"); the configuration model holds the one
    that applies. Every option whose help states a number must state the model's (``--min-read-
    interval`` said 0.2 after its default became 0.08)."""
    parser = {"watch": cli._watch_parser, "replay": cli._replay_parser, "check": cli._check_parser}[command]()
    stated = {}
    for action in parser._actions:
        m = re.search(r"\(default ([0-9]+(?:\.[0-9]+)?)( MiB)?[;:)]", action.help or "")
        if m and action.dest in SidecarConfig.model_fields:
            stated[action.dest] = float(m.group(1)) * (1 << 20 if m.group(2) else 1)
    assert len(stated) >= {"watch": 10, "replay": 4, "check": 1}[command], stated  # the check is not vacuous
    assert stated == {name: float(SidecarConfig.model_fields[name].default) for name in stated}


def test_the_docs_options_table_states_the_configurations_defaults() -> None:
    """The docs' table of live options (docs/deploying.md today) gives each default in seconds;
    they are the model's."""
    root = Path(__file__).resolve().parents[1]
    blocks = [b for doc in [root / "README.md", *root.glob("docs/*.md")] for b in doc.read_text().split("\n\n")]
    table = next(block for block in blocks if "| `--min-read-interval` |" in block)
    stated = {}
    for row in table.splitlines():
        m = re.match(r"\| `--([a-z-]+)` \| ([0-9]+(?:\.[0-9]+)?) s \|", row)
        if m:
            stated[m.group(1).replace("-", "_")] = float(m.group(2))
    assert len(stated) >= 7, stated
    assert stated == {name: float(SidecarConfig.model_fields[name].default) for name in stated}
