"""The documentation against the code: README.md and docs/*.md say only what the program does.

- every relative link leads to a file that exists, and every ``#anchor`` to a heading there;
- every ``mstb-sidecar ...`` command line in a code block (and in inline code) parses with the real
  command's argument parser and passes the configuration model, so a renamed option fails here;
- every YAML block that is a sidecar configuration loads;
- the README's first command, the replay summary, ``check``'s table and the job aggregate are run;
- the README stays a five-minute read (under 300 lines).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fidelity import COMPARED_TAGS, compare_run, load_truth
from tb_read import scalars
from tb_server import TensorBoard, tensorboard
from sidecar import cli
from sidecar.service.config import SidecarConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLE = ROOT / "tests" / "fixtures" / "real" / "mf1.9-dp2"
EXE = [sys.executable, "-m", "sidecar.cli"]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # any cwd
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
PARSERS = {"replay": cli._replay_parser, "check": cli._check_parser, "aggregate": cli._aggregate_parser}
# What the docs write for a value in a synopsis (`--every N`), and a value that parses in its place.
PLACEHOLDERS = {"N": "2", "MB": "64", "PORT": "9400", "SECONDS": "5", "CMD": "true", "TEMPLATE": "rank_{rank}"}


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def code_blocks(path: Path) -> list[tuple[str, str]]:
    """(language, text) of each fenced code block."""
    return FENCE.findall(path.read_text(encoding="utf-8"))


def _prose(path: Path) -> str:
    """The text outside fenced code blocks and inline code."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", path.read_text(encoding="utf-8")))


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a markdown file: lowercased, punctuation other than
    ``-`` and ``_`` removed, spaces as ``-``, a repeated one suffixed ``-1``, ``-2``, ..."""
    slugs: set[str] = set()
    counts: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+)$", FENCE.sub("", path.read_text(encoding="utf-8")), re.M):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
        slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        n = counts[slug] = counts.get(slug, -1) + 1
        slugs.add(slug if n == 0 else f"{slug}-{n}")
    return slugs


def relative_links(path: Path) -> list[str]:
    targets = re.findall(r"\]\(([^)\s]+)\)", _prose(path))
    return [t for t in targets if not re.match(r"[a-z]+:", t)]


def test_the_readme_is_a_five_minute_read() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) < 300


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_every_relative_link_resolves(doc: Path) -> None:
    links = relative_links(doc)
    assert links, "no links found: the pattern is broken"
    broken = []
    for link in links:
        target, _, anchor = link.partition("#")
        file = (doc.parent / target).resolve() if target else doc
        if not file.exists():
            broken.append(f"{link}: no file {file}")
        elif anchor and anchor not in anchors(file):
            broken.append(f"{link}: no heading with anchor #{anchor} in {_rel(file)}")
    assert not broken, "\n".join(broken)


def _commands(text: str) -> list[list[str]]:
    """The argument lists of the ``mstb-sidecar`` commands in shell text (line continuations joined,
    a ``$`` prompt, ``sudo -u USER`` and comments dropped; ``a && b`` and ``a; b`` are two)."""
    found = []
    for line in text.replace("\\\n", " ").splitlines():
        if not re.search(r"(^|[\s/])mstb-sidecar\s", line):  # output lines: "mstb-sidecar: error: ..."
            continue
        lexer = shlex.shlex(line.removeprefix("$ "), posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        tokens = list(lexer)
        starts = [0] + [i + 1 for i, t in enumerate(tokens) if t in (";", "&&", "||", "|")]
        for start in starts:
            rest = tokens[start:]
            if rest[:1] == ["sudo"]:
                rest = rest[3:] if rest[1:2] == ["-u"] else rest[1:]
            if rest and os.path.basename(rest[0]) == "mstb-sidecar":
                end = next((i for i, t in enumerate(rest) if t in (";", "&&", "||", "|")), len(rest))
                found.append(rest[1:end])
    return found


def doc_commands() -> list[tuple[str, list[str], bool]]:
    """Every ``mstb-sidecar`` command in the docs, with whether it is complete: in shell code blocks
    (complete: it runs as written), and inline code that starts with the command (a synopsis, which
    may leave out ``--out`` or the paths: its ``[options]`` dropped, its placeholders given values)."""
    out = []
    for doc in DOCS:
        for lang, text in code_blocks(doc):
            if lang in ("", "bash", "sh", "console", "shell"):
                out += [(_rel(doc), args, True) for args in _commands(text)]
        for span in re.findall(r"`(mstb-sidecar [^`]*)`", doc.read_text(encoding="utf-8")):
            words = [PLACEHOLDERS.get(w, w) for w in span.split()[1:] if not w.startswith("[")]
            out.append((_rel(doc), words, False))
    return out


COMMANDS = doc_commands()


def test_the_docs_have_commands_to_check() -> None:
    complete = [args for _, args, whole in COMMANDS if whole]
    assert len(complete) >= 12 and len(COMMANDS) >= 20, COMMANDS  # the extraction is not vacuous
    assert {args[0] for args in complete} >= {"--watch", "replay", "check", "aggregate"}


SECRET_FILES = ("remote_write_password_file", "remote_write_bearer_token_file")  # read when configured
STAND_IN_SECRET = Path(__file__).parent / "fixtures" / "docs-secret"


def configure(args: list[str], complete: bool = True) -> SidecarConfig:
    """``mstb-sidecar ARGS`` as :func:`sidecar.cli.main` reads it, up to the validated configuration
    (no file is read); ``complete=False`` for a synopsis, which may leave out ``--out`` or the paths.
    The parser's ``SystemExit`` (an unknown option, a bad value, ``-V``, ``--help``) passes through."""
    command = args[0] if args and args[0] in PARSERS else "watch"
    parser = PARSERS.get(command, cli._watch_parser)()
    ns = vars(parser.parse_args(args if command == "watch" else args[1:]))
    named_config = ns.pop("config") is not None  # it names a file of the docs' example, not here
    ns.pop("once", None)
    if ns.get("on_alert"):  # the docs' pager is not installed here: any executable stands in for it
        ns["on_alert"] = shlex.join([sys.executable, *shlex.split(ns["on_alert"])[1:]])
    for secret in SECRET_FILES:  # the docs' Secret mount is not here: a file of the tests stands in
        if ns.get(secret) is not None:
            ns[secret] = STAND_IN_SECRET
    if command == "check":
        ns["out"] = Path(".")
    if command == "aggregate":
        ns.update(paths=[Path(".")], instance="job")
    if not complete or named_config:  # what the synopsis or the file leaves out
        ns["paths"] = ns.get("paths") or [Path(".")]
        ns["out"] = ns.get("out") or Path("out")
    return load_config(ns, None)


@pytest.mark.parametrize("doc, args, complete", COMMANDS, ids=[f"{d}: {' '.join(a)}"[:90] for d, a, _ in COMMANDS])
def test_every_command_in_the_docs_parses_and_configures(
    doc: str, args: list[str], complete: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        configure(args, complete)
    except SystemExit as exc:  # an unknown option or a bad value; or -V and --help, which print and exit 0
        assert exc.code == 0 and {"-V", "--version", "-h", "--help"} & set(args), capsys.readouterr().err


def _sidecar_yaml_blocks() -> list[tuple[str, str]]:
    keys = {*SidecarConfig.model_fields, "watch", "no_aggregate", "no_progress"}
    out = []
    for doc in DOCS:
        for lang, text in code_blocks(doc):
            data = yaml.safe_load(text) if lang == "yaml" else None
            if isinstance(data, dict) and {k.replace("-", "_") for k in data} <= keys:
                out.append((_rel(doc), text))
    return out


def test_every_configuration_file_in_the_docs_loads(tmp_path: Path) -> None:
    blocks = _sidecar_yaml_blocks()
    assert len(blocks) >= 3, blocks  # the file example, custom metrics, alert thresholds
    for doc, text in blocks:
        file = tmp_path / "sidecar.yaml"
        data = yaml.safe_load(text)
        secrets = {key: str(STAND_IN_SECRET) for key in data if key.replace("-", "_") in SECRET_FILES}
        file.write_text(yaml.safe_dump({**data, **secrets}) if secrets else text)
        cli_values = {"paths": None if "watch" in data else [Path(".")], "out": None if "out" in data else Path("o")}
        load_config(cli_values, file)  # raises ConfigError, naming the key, on anything it refuses


def _readme_block() -> str:
    return code_blocks(ROOT / "README.md")[0][1]


def test_the_readmes_first_command_replays_the_bundled_example_as_documented(tmp_path: Path) -> None:
    """The README's install-and-replay line, from its ``mstb-sidecar``, in a directory that has the
    repository's ``tests/`` (the line's path is relative): mindformers' own values at every step,
    and the summary that docs/replay.md shows, but for the time and the host name."""
    [args] = [a for a in _commands(_readme_block()) if a[:1] == ["replay"]]
    (tmp_path / "tests").symlink_to(ROOT / "tests")
    proc = subprocess.run([*EXE, *args], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=ENV)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / args[args.index("--out") + 1]
    for rank, tags in load_truth(EXAMPLE / "tensorboard_truth.json").items():
        result = compare_run(out / rank, tags, COMPARED_TAGS)
        assert result.ok() and result.points["loss"] == len(tags["loss"]) == 200, result.mismatches[:20]
    documented = next(t for _, t in code_blocks(ROOT / "docs" / "replay.md") if t.startswith("read "))
    host = SidecarConfig.model_fields["instance"].default_factory()  # the default --instance
    shown = proc.stdout.replace(f"aggregate/{host}", "aggregate/myhost")
    assert re.sub(r" in [0-9.]+ s ", " in T s ", shown) == re.sub(r" in [0-9.]+ s ", " in T s ", documented)


def test_the_readmes_test_command_is_the_one_ci_runs() -> None:
    assert "\nscripts/test\n" in _readme_block()
    assert "exec scripts/test " in (ROOT / ".ci" / "run").read_text()
    assert os.access(ROOT / "scripts" / "test", os.X_OK)


def test_the_check_example_is_checks_output(tmp_path: Path) -> None:
    """docs/deploying.md shows ``check`` on a copy of the bundled example with rank 1's info.log
    unreadable. Its other rows, header and footer are what ``check`` prints; where permissions
    bind (not as root), the whole of it."""
    block = next(t for _, t in code_blocks(ROOT / "docs" / "deploying.md") if t.startswith("$ mstb-sidecar check"))
    [args] = _commands(block.splitlines()[0])
    documented = block.splitlines()[1:]
    shutil.copytree(EXAMPLE / "output", tmp_path / "output")
    unreadable = tmp_path / "output" / "log" / "rank_1" / "info.log"
    unreadable.chmod(0)
    proc = subprocess.run([*EXE, *args], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=ENV)
    if os.access(unreadable, os.R_OK):  # root reads it anyway
        shown = proc.stdout.replace("4 of 4", "3 of 4").splitlines()
        documented = [line for line in documented if "unreadable" not in line]
        shown = [line for line in shown if "rank_1/info.log" not in line]
        assert proc.returncode == 0
    else:
        shown = proc.stdout.splitlines()
        assert proc.returncode == 4
    assert shown == documented


def test_the_job_aggregate_example_runs(tmp_path: Path) -> None:
    """docs/many-ranks.md's ``mstb-sidecar aggregate --out ... --once``, on the bundled example's
    runs: ``aggregate/job`` has the mean of both ranks' loss at every step."""
    [args] = [a for _, a, whole in COMMANDS if whole and a[:1] == ["aggregate"] and "--once" in a]
    out = tmp_path / "tb"
    assert cli.main(["replay", str(EXAMPLE / "output"), "--out", str(out), "--quiet", "--no-aggregate"]) == 0
    args = [str(out) if prev == "--out" else arg for prev, arg in zip(["", *args], args)]
    proc = subprocess.run([*EXE, *args], capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 0, proc.stderr
    ranks = [scalars(out / f"rank_{r}")["loss"] for r in (0, 1)]
    mean = scalars(out / "aggregate" / "job")["loss/mean"]
    assert sorted(mean) == list(range(1, 201))
    assert all(mean[s] == pytest.approx((ranks[0][s] + ranks[1][s]) / 2, rel=1e-6) for s in mean)


def band_runs(tb: TensorBoard, tag: str) -> list[str] | None:
    """The runs whose ``<tag>/mean`` the Custom Scalars band chart of ``tag`` draws, asked as the
    browser asks (the chart's tags as one regex, each run of the selector in turn); ``None`` before
    the merged layout has that chart."""
    layout = tb.get("/data/plugin/custom_scalars/layout")
    series = [s for c in layout.get("category", []) if c["title"] == tag for chart in c["chart"]
              if "margin" in chart for s in chart["margin"]["series"]] if isinstance(layout, dict) else []
    if not series:
        return None
    tags = [name for s in series for name in (s["value"], s["lower"], s["upper"])]
    regex = "|".join("(" + re.sub(r"([.*+?^${}()|\[\]\\])", r"\\\1", t) + ")" for t in tags)
    runs = tb.get("/data/runs")
    answers = {run: tb.get("/data/plugin/custom_scalars/scalars", run=run, tag=regex) for run in runs}
    return sorted(run for run, answer in answers.items() if answer["tag_to_events"].get(f"{tag}/mean"))


def test_the_multi_node_configuration_draws_one_mean(tmp_path: Path) -> None:
    """docs/many-ranks.md's node command (with its options, one sidecar per node, each with its
    ``--instance``) and the job aggregate: the band chart of the merged layout draws one mean,
    the job's."""
    [node] = [a for doc, a, whole in COMMANDS if whole and doc == "docs/many-ranks.md" and a[:1] == ["--watch"]]
    paths = ("--watch", "--out")
    options = [arg for prev, arg in zip(["", *node], node) if arg not in paths and prev not in paths]
    out = tmp_path / "tb"
    for rank in (0, 1):
        logs = tmp_path / f"node{rank}" / "log"
        shutil.copytree(EXAMPLE / "output" / "log" / f"rank_{rank}", logs / f"rank_{rank}")
        assert cli.main(["replay", str(logs), "--out", str(out), "--instance", f"node{rank}", "-q", *options]) == 0
    assert cli.main(["aggregate", "--out", str(out), "--once", "-q"]) == 0
    on_disk = {str(p.parent.relative_to(out)) for p in out.rglob("events.out.tfevents.*")}
    with tensorboard(out) as tb:
        tb.wait_for("/data/runs", lambda runs: set(runs) >= on_disk)
        tb.wait_for("/data/plugin/scalars/tags", lambda tags: all(tags.get(run) for run in on_disk
                                                                   if run.startswith(("aggregate/", "rank_"))))
        tb.wait_for("/data/plugin/custom_scalars/layout", lambda _: band_runs(tb, "loss") is not None)
        drawn = band_runs(tb, "loss")
    assert drawn == ["aggregate/job"]
