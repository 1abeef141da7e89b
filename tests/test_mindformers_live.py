"""The ``mindformers`` tier: real mindformers 1.9 trains a tiny LLaMA on the CPU while the sidecar
follows its logs live; what the sidecar wrote must equal mindformers' own TensorBoard output.

Recipe: ``tests/mindformers_run/`` (tiny model config, data generator, CPU launcher; see its
README). Each run is started with a smaller data set than the recipe's default, so it is short
but still spans two epochs (the global step crosses an epoch boundary). Runs, one at a time:

===============  ==============================================================  ============
run              what                                                            steps/rank
===============  ==============================================================  ============
graph-single     one process, graph mode                                         80
graph-dp2        two workers under ``msrun``, data parallel                      80
pynative         ``context.mode=1`` (PyNative, about 1 s a step)                 12
diverge-fp16     ``learning_rate=1000`` in float16: loss and grad norm go nan    40
===============  ==============================================================  ============

For each run ``mstb-sidecar --watch WORKDIR/output/log`` is started before the training (the
daemon refuses a path that does not exist, so the empty ``output/log`` is made first), follows
the job, and is stopped with SIGTERM once the job has ended and every step has arrived. Then,
for every rank and global step, ``loss``, ``learning-rate``, ``grad-norm``, ``loss-scale``,
``iteration-time``, ``throughput`` and ``model-flops-throughput-per-npu`` must equal
mindformers' own values within print precision (:func:`fidelity.compare_run`), nothing is
written twice, nan counts equal the truth's, and a replay of ``output/log`` and of the whole
``output/`` (with ``msrun_log/worker_N.log``) gives exactly the points the live run gave.

mindformers runs in its own venv (MindSpore 2.9, which conflicts with the project's 2.10):
``$MSTB_MF_PYTHON`` if set, else ``.cache/mfvenv`` (built once with pip, about 2 minutes and
3.4 GB, reused while it imports). An unreachable registry skips the tier, or fails it when
``CI=true``. Skip the tier with ``-m "not mindformers"`` or ``MSTB_SKIP_MINDFORMERS=1``.

Per run the points compared and the worst difference per tag are printed at the end of the
session and written to ``.cache/mindformers-fidelity.json``.

Other mindformers tests may import from here: the fixtures ``mf_python`` (the interpreter, as
:class:`MfPython`) and ``report`` (one :class:`Report` per session; add entries with
``report.run(name)`` and ``report.write()``), and :func:`start_training`, :func:`stop_job`,
:func:`read_truth`, :func:`clean_env`.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from fidelity import COMPARED_TAGS, DERIVED_TAGS, SAMPLES_RUN, compare_run
from live_helpers import poll, wait_until
from mindformers_run import launch
from sidecar.output.run_meta import CONFIG_TAG
from tb_read import raw_points, scalars, texts

pytestmark = pytest.mark.mindformers

if os.environ.get("MSTB_SKIP_MINDFORMERS") == "1":
    pytest.skip("MSTB_SKIP_MINDFORMERS=1", allow_module_level=True)

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = Path(launch.__file__)
CACHE = REPO / ".cache"
MF_VENV = CACHE / "mfvenv"
REPORT = CACHE / "mindformers-fidelity.json"
# mindformers 1.9.0 pins mindspore~=2.9.0; the recipe and the marker are about 1.9.
MF_REQUIREMENT = "mindformers==1.9.*"
# What the in-process callback imports besides what mindformers brings (pyproject's pin): a
# training environment gets it with ``pip install mstb-sidecar``.
SIDECAR_REQUIREMENTS = ["tensorboard>=2.16,<3", "crc32c>=2.4,<3"]
IN_CI = os.environ.get("CI", "").lower() in ("true", "1")

TRAIN_TIMEOUT = 900.0  # one training run (seconds); normal is 15-70 s
CATCH_UP_TIMEOUT = 30.0  # after the job ended, until every step is in the sidecar's output
PIP_TIMEOUT = 3600.0

# pip's words when it could not reach the package index (or the index had nothing to offer).
UNREACHABLE = re.compile(
    r"NewConnectionError|Failed to establish a new connection|Temporary failure in name resolution"
    r"|Name or service not known|Network is unreachable|Connection refused|ConnectTimeoutError"
    r"|ReadTimeoutError|ProxyError|SSLError|Max retries exceeded|No route to host"
    r"|\(from versions: none\)"
)


def _skip_or_fail(reason: str) -> None:
    if IN_CI:
        pytest.fail(f"{reason} (CI=true, so this fails instead of skipping)", pytrace=False)
    pytest.skip(reason)


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without the project venv's variables, which would leak into the mindformers venv."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env.update(extra)
    return env


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no output)"


# -- the mindformers interpreter ---------------------------------------------------------------
@dataclass
class MfPython:
    python: Path
    source: str  # "MSTB_MF_PYTHON", "cached venv" or "built venv"
    versions: dict[str, str]
    build_seconds: float | None = None


class RegistryUnreachable(Exception):
    pass


def _import_check(python: Path, cwd: Path) -> dict[str, str] | str:
    """Versions of mindformers and mindspore as ``python`` imports them, or why it cannot.

    Runs in ``cwd``: importing mindformers creates ``output/log`` in the working directory.
    """
    code = "import json, mindformers, mindspore, tensorboard, crc32c; print(json.dumps({'mindformers': mindformers.__version__, 'mindspore': mindspore.__version__}))"
    try:
        proc = subprocess.run([str(python), "-c", code], cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    if proc.returncode != 0:
        last = (proc.stderr or proc.stdout).strip().splitlines()
        return f"exit {proc.returncode}: {last[-1] if last else ''}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def build_mf_venv(venv: Path, log: Path) -> float:
    """``python -m venv VENV && VENV/bin/pip install mindformers==1.9.* tensorboard crc32c``; returns seconds taken.

    Raises :class:`RegistryUnreachable` when pip could not reach the index, AssertionError on any
    other failure. ``log`` gets pip's output.
    """
    started = time.monotonic()
    if venv.exists():
        shutil.rmtree(venv)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    with open(log, "w") as out:
        proc = subprocess.run(
            [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-input", MF_REQUIREMENT, *SIDECAR_REQUIREMENTS],
            stdout=out, stderr=subprocess.STDOUT, env=clean_env(PIP_DISABLE_PIP_VERSION_CHECK="1"),
            timeout=PIP_TIMEOUT,
        )
    if proc.returncode != 0:
        text = log.read_text(errors="replace")
        shutil.rmtree(venv, ignore_errors=True)
        if UNREACHABLE.search(text):
            raise RegistryUnreachable(f"pip could not reach the package index for {MF_REQUIREMENT}:\n{_tail(log, 15)}")
        raise AssertionError(f"pip install {MF_REQUIREMENT} failed (exit {proc.returncode}):\n{_tail(log)}")
    return time.monotonic() - started


@pytest.fixture(scope="session")
def mf_python(tmp_path_factory: pytest.TempPathFactory) -> MfPython:
    scratch = tmp_path_factory.mktemp("mf-import-check")
    override = os.environ.get("MSTB_MF_PYTHON")
    if override:
        versions = _import_check(Path(override), scratch)
        if isinstance(versions, str):
            pytest.fail(f"MSTB_MF_PYTHON={override} cannot import mindformers and mindspore: {versions}", pytrace=False)
        return MfPython(Path(override), "MSTB_MF_PYTHON", versions)

    CACHE.mkdir(exist_ok=True)
    python = MF_VENV / "bin" / "python"
    with open(CACHE / "mfvenv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time, also across pytest processes
        if python.exists():
            versions = _import_check(python, scratch)
            if not isinstance(versions, str):
                return MfPython(python, "cached venv", versions)
            print(f"{MF_VENV} is not usable ({versions}); rebuilding it")
        unreachable = None
        try:
            seconds = build_mf_venv(MF_VENV, CACHE / "mfvenv-build.log")
        except RegistryUnreachable as exc:
            unreachable = str(exc)
        if unreachable is not None:
            _skip_or_fail(f"cannot build the mindformers venv: {unreachable}")
        versions = _import_check(python, scratch)
        assert not isinstance(versions, str), f"freshly built {MF_VENV} cannot import mindformers: {versions}"
        return MfPython(python, "built venv", versions, round(seconds, 1))


# -- the fidelity report -----------------------------------------------------------------------
class Report:
    """Collects per-run numbers; written to ``.cache/mindformers-fidelity.json`` after every update."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict = {}

    def run(self, name: str) -> dict:
        return self.data.setdefault("runs", {}).setdefault(name, {})

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, sort_keys=False) + "\n")
        os.replace(tmp, self.path)

    def lines(self) -> list[str]:
        d = self.data
        out = [f"mindformers {d.get('mindformers', '?')}, MindSpore {d.get('mindspore', '?')} "
               f"({d.get('venv', '?')}{', built in %ss' % d['venv_build_seconds'] if d.get('venv_build_seconds') else ''})"]
        for name, run in d.get("runs", {}).items():
            out.append(
                f"{name}: ranks {run.get('ranks')}, {run.get('steps_per_rank')} steps/rank, train {run.get('train_seconds')}s, "
                f"sidecar had {run.get('loss_points_at_job_end')}/{run.get('loss_points_expected')} loss points at job end, "
                f"all after +{run.get('catch_up_seconds')}s, exit {run.get('sidecar_exit')}, "
                f"{run.get('sidecar_warnings')} warnings; "
                f"duplicates {run.get('duplicates')}; replay log/ == live: {run.get('replay_log_equal')}, "
                f"output/ == live: {run.get('replay_output_equal')}"
            )
            for tag, t in run.get("tags", {}).items():
                out.append(f"    {tag:<32} points {t['points']:>4}  nan {t['nan']:>3}  worst |diff| {t['worst_abs_diff']:.3g}")
            for m in run.get("mismatches", [])[:5]:
                out.append(f"    MISMATCH {m}")
        return out

    def pytest_terminal_summary(self, terminalreporter) -> None:  # registered as a pytest plugin
        if self.data.get("runs"):
            terminalreporter.section("mindformers fidelity")
            for line in self.lines():
                terminalreporter.write_line(line)
            terminalreporter.write_line(f"(also in {self.path})")


@pytest.fixture(scope="session")
def report(request: pytest.FixtureRequest, mf_python: MfPython) -> Report:
    rep = Report(REPORT)
    rep.data.update(generated=time.strftime("%Y-%m-%dT%H:%M:%S%z"), mindformers=mf_python.versions["mindformers"], mindspore=mf_python.versions["mindspore"],
                    venv=mf_python.source, venv_build_seconds=mf_python.build_seconds, python=str(mf_python.python))
    rep.write()
    if not request.config.pluginmanager.has_plugin("mstb-mindformers-report"):
        request.config.pluginmanager.register(rep, "mstb-mindformers-report")
    return rep


# -- the runs ----------------------------------------------------------------------------------
FP16 = ("model.model_config.compute_dtype=float16", "model.model_config.softmax_compute_type=float16",
        "model.model_config.param_init_type=float16")


@dataclass(frozen=True)
class Run:
    name: str
    mode: str  # launch.py mode: single | dp2
    records: int  # data set size; batch 2 per rank, 2 epochs
    overrides: tuple[str, ...] = ()
    nan_loss: bool = False

    @property
    def ranks(self) -> int:
        return launch.WORKERS[self.mode]

    @property
    def steps(self) -> int:
        return launch.steps_per_rank(self.records, self.mode)

    @property
    def truth_tags(self) -> tuple[str, ...]:
        """Tags mindformers' own TensorBoard output must hold (PyNative has no model flops)."""
        if "context.mode=1" in self.overrides:
            return tuple(t for t in COMPARED_TAGS if t != "model-flops-throughput-per-npu")
        return COMPARED_TAGS


RUNS = [
    Run("graph-single", "single", 80),
    Run("graph-dp2", "dp2", 160),
    Run("pynative", "single", 12, ("context.mode=1",)),
    Run("diverge-fp16", "single", 40, ("lr_schedule.learning_rate=1000.0", *FP16), nan_loss=True),
]


@dataclass
class Live:
    run: Run
    workdir: Path  # the job's directory; mindformers writes WORKDIR/output
    summary: Path  # the live sidecar's --out
    truth: dict[str, dict[str, dict[int, float]]]  # rank_N -> tag -> {step: value}
    sidecar_exit: int
    sidecar_stderr: str
    loss_points_at_job_end: int
    caught_up: bool

    @property
    def output(self) -> Path:
        return self.workdir / "output"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_training(mf: MfPython, workdir: Path, mode: str, records: int, overrides: Sequence[str],
                   log: Path) -> subprocess.Popen[bytes]:
    """Start ``mindformers_run/launch.py`` (data, then training) in WORKDIR, output into ``log``.

    The job gets its own session, so :func:`stop_job` also ends the workers msrun started.
    """
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, str(LAUNCHER), "--python", str(mf.python), "--records", str(records),
             "--master-port", str(_free_port()), str(workdir), mode, *overrides],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, env=clean_env(),
        )


def stop_job(job: subprocess.Popen[bytes]) -> None:
    """Kill a job from :func:`start_training` with everything it started, if it still runs."""
    if job.poll() is None:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()


def _loss_points(summary: Path) -> int:
    """(loss, step) keys in the output so far, read raw (files may be mid-write)."""
    return sum(1 for r in summary.glob("rank_*") for (tag, _) in raw_points(r) if tag == "loss")


def _all_arrived(summary: Path, truth: dict[str, dict[str, dict[int, float]]]) -> bool:
    for rank, tags in truth.items():
        keys = set(raw_points(summary / rank)) | set(raw_points(summary / rank / SAMPLES_RUN))
        if any((tag, step) not in keys for tag, points in tags.items() if tag in COMPARED_TAGS + DERIVED_TAGS
               for step in points):
            return False
    return True


def read_truth(output: Path) -> dict[str, dict[str, dict[int, float]]]:
    """mindformers' own TensorBoard values, shaped like :func:`fidelity.load_truth`."""
    return {d.name: scalars(d) for d in sorted((output / "tensorboard").glob("rank_*"))}


@pytest.fixture(scope="module", params=RUNS, ids=[r.name for r in RUNS])
def live(request: pytest.FixtureRequest, mf_python: MfPython, report: Report,
         tmp_path_factory: pytest.TempPathFactory) -> Live:
    run: Run = request.param
    base = tmp_path_factory.mktemp(run.name)
    workdir, summary = base / "job", base / "summary"
    log_dir = workdir / "output" / "log"
    log_dir.mkdir(parents=True)  # the daemon needs its --watch path to exist

    sidecar_err = base / "sidecar.stderr"
    with open(sidecar_err, "wb") as err:
        sidecar = subprocess.Popen(
            [sys.executable, "-m", "sidecar.cli", "--watch", str(log_dir), "--out", str(summary), "--instance", "live"],
            stdin=subprocess.DEVNULL, stdout=err, stderr=err,
        )
    job: subprocess.Popen[bytes] | None = None
    try:
        wait_until(lambda: "watching" in sidecar_err.read_text(errors="replace") or sidecar.poll() is not None, 30,
                   "the sidecar to start")
        assert sidecar.poll() is None, f"sidecar exited at start: {sidecar_err.read_text(errors='replace')}"

        job_log = base / "job.out"
        started = time.monotonic()
        job = start_training(mf_python, workdir, run.mode, run.records, run.overrides, job_log)
        try:
            job_rc = job.wait(TRAIN_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{run.name}: training did not end within {TRAIN_TIMEOUT:.0f} s:\n{_tail(job_log)}") from None
        train_seconds = time.monotonic() - started
        assert job_rc == 0, f"{run.name}: training failed (exit {job_rc}):\n{_tail(job_log)}"

        truth = read_truth(workdir / "output")
        loss_at_end = _loss_points(summary)
        ended = time.monotonic()
        caught_up = poll(lambda: _all_arrived(summary, truth), bool, CATCH_UP_TIMEOUT)[0]
        catch_up = time.monotonic() - ended

        sidecar.send_signal(signal.SIGTERM)
        try:
            sidecar_rc = sidecar.wait(30)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{run.name}: sidecar did not exit within 30 s of SIGTERM") from None
    finally:
        if job is not None:
            stop_job(job)
        if sidecar.poll() is None:
            sidecar.kill()
            sidecar.wait()

    entry = report.run(run.name)
    entry.update(
        mode=run.mode, overrides=list(run.overrides), records=run.records, ranks=sorted(truth),
        steps_per_rank=run.steps, train_seconds=round(train_seconds, 1), catch_up_seconds=round(catch_up, 2),
        loss_points_at_job_end=loss_at_end, loss_points_expected=sum(len(t.get("loss", {})) for t in truth.values()),
        sidecar_exit=sidecar_rc,
        sidecar_warnings=sidecar_err.read_text(errors="replace").count("mstb-sidecar: WARNING"),
    )
    report.write()
    return Live(run, workdir, summary, truth, sidecar_rc, sidecar_err.read_text(errors="replace"), loss_at_end, caught_up)


# -- helpers for the assertions ----------------------------------------------------------------
def _nan_count(points: dict[int, float]) -> int:
    return sum(1 for v in points.values() if math.isnan(v))


def _scalar_diff(a: dict[str, dict[int, float]], b: dict[str, dict[int, float]]) -> list[str]:
    """Differences between two ``tb_read.scalars`` dicts; nan equals nan, otherwise exact."""
    diffs = []
    for tag in sorted(set(a) | set(b)):
        pa, pb = a.get(tag, {}), b.get(tag, {})
        if pa.keys() != pb.keys():
            diffs.append(f"{tag}: steps only in first {sorted(set(pa) - set(pb))[:5]}, only in second {sorted(set(pb) - set(pa))[:5]}")
            continue
        for step in sorted(pa):
            x, y = pa[step], pb[step]
            if not (x == y or (math.isnan(x) and math.isnan(y))):
                diffs.append(f"{tag}@{step}: {x!r} vs {y!r}")
    return diffs


def _ranks(summary: Path) -> list[str]:
    return sorted(p.name for p in summary.glob("rank_*") if p.is_dir())


def _replay(paths: list[Path], out: Path) -> str:
    proc = subprocess.run([sys.executable, "-m", "sidecar.cli", "replay", *map(str, paths), "--out", str(out), "--no-progress"],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"replay {paths} exited {proc.returncode}:\n{proc.stderr}"
    return proc.stderr


def _assert_same_as_live(live: Live, out: Path, what: str, more_input: bool = False) -> None:
    assert _ranks(out) == _ranks(live.summary) == sorted(live.truth), f"{what}: ranks differ"
    problems = []
    for rank in _ranks(out):
        dups = {k: n for k, n in raw_points(out / rank).items() if n > 1}
        if dups:
            problems.append(f"{rank}: written twice by the replay: {list(dups)[:5]}")
        problems += [f"{rank} {d}" for d in _scalar_diff(scalars(live.summary / rank), scalars(out / rank))]
        # The config card says what was read: live followed output/log, and only msrun's worker logs
        # hold mindformers' full config dump, so a replay of output/ (more_input) knows more of the run.
        shown = {"live": texts(live.summary / rank), "replay": texts(out / rank)}
        for seen in shown.values() if more_input else ():
            seen.pop(CONFIG_TAG, None)
        if shown["live"] != shown["replay"]:
            problems.append(f"{rank}: text events differ: live {shown['live']} vs replay {shown['replay']}")
    assert not problems, f"{what} differs from live:\n" + "\n".join(problems[:30])


# -- the tests ---------------------------------------------------------------------------------
def test_sidecar_followed_the_job_live_and_exited_cleanly(live: Live) -> None:
    assert live.sidecar_exit == 0, f"sidecar exit {live.sidecar_exit} after SIGTERM:\n{live.sidecar_stderr}"
    bad = [ln for ln in live.sidecar_stderr.splitlines()
           if any(s in ln for s in ("mstb-sidecar: ERROR", "mstb-sidecar: CRITICAL", "Traceback (most recent call last)"))]
    assert not bad, "sidecar logged errors:\n" + "\n".join(bad[:20])
    assert live.loss_points_at_job_end > 0, "nothing was in the sidecar's output when the job ended: it did not follow live"
    assert live.caught_up, f"not every step reached the sidecar's output within {CATCH_UP_TIMEOUT:.0f} s of the job's end"


def test_live_output_matches_mindformers_own_tensorboard(live: Live, report: Report) -> None:
    run = live.run
    assert sorted(live.truth) == [f"rank_{i}" for i in range(run.ranks)], f"mindformers wrote runs {sorted(live.truth)}"
    assert _ranks(live.summary) == sorted(live.truth), f"sidecar wrote runs {_ranks(live.summary)}, truth has {sorted(live.truth)}"
    for rank, tags in live.truth.items():  # the recipe must still give what this test relies on
        for tag in run.truth_tags:
            assert set(tags.get(tag, {})) == set(range(1, run.steps + 1)), f"truth {rank} {tag}: steps {sorted(tags.get(tag, {}))[:5]}..."

    entry = report.run(run.name)
    per_tag: dict[str, dict] = {}
    mismatches: list[str] = []
    duplicates = 0
    for rank, tags in live.truth.items():
        result = compare_run(live.summary / rank, tags, COMPARED_TAGS + DERIVED_TAGS)
        mismatches += result.mismatches
        duplicates += sum(n - 1 for n in raw_points(live.summary / rank).values() if n > 1)
        for tag, n in result.points.items():
            t = per_tag.setdefault(tag, {"points": 0, "nan": 0, "worst_abs_diff": 0.0})
            t["points"] += n
            t["nan"] += _nan_count(tags[tag])
            t["worst_abs_diff"] = max(t["worst_abs_diff"], result.worst[tag])
    entry.update(tags=per_tag, mismatches=mismatches, duplicates=duplicates)
    report.write()

    assert not mismatches, f"{run.name}: sidecar differs from mindformers' own TensorBoard:\n" + "\n".join(mismatches[:30])
    assert duplicates == 0
    for tag in run.truth_tags:
        assert per_tag[tag]["points"] == run.ranks * run.steps, f"{tag}: compared {per_tag[tag]['points']} points"


def test_nan_counts_match_the_truth_exactly(live: Live) -> None:
    for rank, tags in live.truth.items():
        shown = scalars(live.summary / rank)
        for tag in COMPARED_TAGS:
            if tag in tags:
                assert _nan_count(shown.get(tag, {})) == _nan_count(tags[tag]), (
                    f"{rank} {tag}: sidecar has {_nan_count(shown.get(tag, {}))} nan, mindformers {_nan_count(tags[tag])}")
        if live.run.nan_loss:
            assert _nan_count(tags["loss"]) > 0, "the diverging run gave no nan loss: the recipe no longer diverges"
            assert _nan_count(shown["loss"]) == _nan_count(tags["loss"])
        else:
            assert _nan_count(tags["loss"]) == 0


def test_replay_of_the_log_dir_gives_the_same_points_as_live(live: Live, report: Report, tmp_path: Path) -> None:
    out = tmp_path / "replay-log"
    _replay([live.output / "log"], out)
    try:
        _assert_same_as_live(live, out, "replay of output/log")
    except AssertionError:
        report.run(live.run.name)["replay_log_equal"] = False
        report.write()
        raise
    report.run(live.run.name)["replay_log_equal"] = True
    report.write()


def test_replay_of_the_whole_output_gives_the_same_points_as_live(live: Live, report: Report, tmp_path: Path) -> None:
    workers = sorted(p.name for p in (live.output / "msrun_log").glob("worker_*.log"))
    assert workers == ([f"worker_{i}.log" for i in range(live.run.ranks)] if live.run.mode == "dp2" else [])
    out = tmp_path / "replay-output"
    _replay([live.output], out)
    try:
        _assert_same_as_live(live, out, "replay of output/", more_input=True)
    except AssertionError:
        report.run(live.run.name)["replay_output_equal"] = False
        report.write()
        raise
    report.run(live.run.name)["replay_output_equal"] = True
    report.write()
