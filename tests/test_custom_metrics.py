"""The ``metrics:`` section of the config file: custom curves from lines users really add."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.cli import main
from tb_read import scalars, texts

INFO = Path(__file__).parent / "fixtures" / "real" / "mf1.9-dp2" / "output" / "log" / "rank_0" / "info.log"
CONFIG = r"""
metrics:
  - name: tokens
    regex: 'step (?P<step>\d+), tokens/s: (?P<value>[\d.]+)'
    tag: tokens-per-s
  - name: eval-print
    regex: '^\[eval\] step=(?P<step>\d+) ppl=(?P<value>\S+)'
    tag: eval-ppl
  - name: best
    regex: 'new best checkpoint at step (?P<step>\d+): (?P<value>\S+)'
    tag: best-checkpoint
    kind: text
  - name: claimed
    regex: 'step:\[\s*(?P<step>\d+)/\s*\d+\], loss:\[(?P<value>[\d.]+)'
    tag: my-loss
"""


def _with_user_lines(tmp_path: Path) -> Path:
    """The genuine log with what a custom callback (through mindformers' logger) and a print() add."""
    out: list[str] = []
    for line in INFO.read_text().splitlines():
        out.append(line)
        if "samples/s/p" in line and "step:[" not in line:  # after each step's bar line
            step = sum(1 for o in out if "samples/s/p" in o)
            stamp = line[:38]  # "[INFO] 2026-11-29 15:53:14,179 [mindfo" -> keep the level and time
            out.append(f"{stamp[:31]}[/work/job/my_callback.py:41] on_train_step_end: step {step}, tokens/s: {1000 + step}.5")
            if step % 50 == 0:
                out.append(f"[eval] step={step} ppl={100 / step:.4f}")
            if step == 120:
                out.append(f"{stamp[:31]}[/work/job/my_callback.py:60] on_train_step_end: "
                           f"new best checkpoint at step {step}: /ckpt/best_{step}.ckpt")
    out.append("[INFO] 2026-11-29 15:59:00,000 [x.py:1] f: " + "x" * 5000 + " step 999, tokens/s: 1.0")  # past the cap
    log = tmp_path / "output" / "log" / "rank_0" / "info.log"
    log.parent.mkdir(parents=True)
    log.write_text("\n".join(out) + "\n")
    return tmp_path / "output"


def test_two_custom_metrics_give_their_curves_and_a_text(tmp_path: Path) -> None:
    config = tmp_path / "sidecar.yaml"
    config.write_text(CONFIG)
    out = tmp_path / "summary"
    assert main(["replay", str(_with_user_lines(tmp_path)), "--out", str(out), "--config", str(config),
                 "--quiet", "--no-aggregate"]) == 0
    shown = scalars(out / "rank_0")
    assert shown["tokens-per-s"] == {s: 1000 + s + 0.5 for s in range(1, 201)}
    assert shown["eval-ppl"] == pytest.approx({s: 100 / s for s in (50, 100, 150, 200)}, rel=1e-4)
    assert texts(out / "rank_0")["best-checkpoint"] == {120: "/ckpt/best_120.ckpt"}
    assert "my-loss" not in shown  # step lines belong to the built-in parsers
    assert len(shown["loss"]) == 200


@pytest.mark.parametrize(("metric", "why"), [
    ("{name: a, regex: '(?P<step>\\d+) (?P<value>[', tag: a}", "'metrics.0.regex': Value error, not a valid regular expression"),
    ("{name: a, regex: 'step (?P<step>\\d+)', tag: a}", "needs the named groups (?P<value>...)"),
    ("{name: a, regex: '(?P<step>\\d+) (?P<value>\\S+)', tag: loss}", "'loss' is a built-in tag"),
    ("{name: a, regex: '(?P<step>\\d+) (?P<value>\\S+)', tag: events/mine}", "built-in prefix"),
    ("{name: a, regex: '(?P<step>\\d+) (?P<value>(\\w+\\s?)+)$', tag: a}", "a repeat inside a repeat"),
    ("{name: a, regex: '(?P<step>\\d+) (?P<value>\\S+) (?P=value)', tag: a}", "a back-reference"),
    ("{name: a, regex: '(?P<step>\\d+) (?P<value>\\S+)', tag: a, kind: histogram}", "'metrics.0.kind'"),
])
def test_a_bad_metric_is_one_clear_line_and_exit_2(metric: str, why: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "sidecar.yaml"
    config.write_text(f"metrics:\n  - {metric}\n")
    with pytest.raises(SystemExit) as exit_:
        main(["replay", str(INFO), "--out", str(tmp_path / "o"), "--config", str(config)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and why in err[0], err


def test_two_metrics_with_one_tag_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "sidecar.yaml"
    config.write_text("metrics:\n  - {name: a, regex: 'a (?P<step>\\d+) (?P<value>\\S+)', tag: t}\n"
                      "  - {name: b, regex: 'b (?P<step>\\d+) (?P<value>\\S+)', tag: t}\n")
    with pytest.raises(SystemExit):
        main(["replay", str(INFO), "--out", str(tmp_path / "o"), "--config", str(config)])
    assert "two metrics with the tag 't'" in capsys.readouterr().err
