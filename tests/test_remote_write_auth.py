"""``--remote-write`` with credentials and extra headers, against receivers that require them.

Debian's ``prometheus`` (as :mod:`test_remote_write` runs it) with ``--web.config.file`` whose
``basic_auth_users`` holds the test user: the right password file gets the values in (read back
through the query API, which needs the same basic auth); a wrong one is refused with 401, counted,
retried, and once the file is fixed on disk the queued snapshots arrive. Prometheus checks no bearer
tokens: a local server that records each request's headers (:class:`test_remote_write.Receiver`)
shows the token, a rotated token read again after a 401, and the custom headers. Misuse is a one-line
error with exit 2. No secret may show in the log, ``/metrics`` or the output (checkpoint).
"""

from __future__ import annotations

import base64
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from live_helpers import Sidecar, free_port, wait_until
from test_cli import one_line_error, run
from test_remote_write import FIXTURE, Prometheus, Receiver, exposition, key, sidecar, stored

USER, PASSWORD = "sidecar", "mstb-test-password"
# bcrypt of PASSWORD (cost 4, the least: Prometheus checks it on every request). The bcrypt package is
# not in the venv; made once with glibc's libxcrypt: python3 -c "import crypt;
# print(crypt.crypt('mstb-test-password', crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=16)))"
HASH = "$2b$04$CWlrX12kC2xkvbZFL5rLAuZQRmZV.d7nqx4mXk1jDKs54xgcEidne"
WRONG = "not-the-test-password"


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[Prometheus]:
    root = tmp_path / "prometheus"
    root.mkdir()
    (root / "web.yml").write_text(f"basic_auth_users:\n  {USER}: '{HASH}'\n")
    server = Prometheus(root, [f"--web.config.file={root / 'web.yml'}"], basic(USER, PASSWORD))
    server.start()
    yield server
    server.stop()


def pushing(tmp_path: Path, prom: Prometheus, job: str, password: str) -> tuple[Sidecar, int, Path]:
    """(the sidecar, its --metrics-port, its password file) pushing every 0.2 s as USER with ``password``."""
    password_file = tmp_path / "password"
    password_file.write_text(password + "\n")
    port = free_port()
    side = sidecar(tmp_path, FIXTURE, "--metrics-port", str(port), "--job", job, "--remote-write", prom.url,
                   "--remote-write-interval", "0.2", "--remote-write-basic-auth-user", USER,
                   "--remote-write-password-file", str(password_file))
    return side, port, password_file


def assert_no_secret(tmp_path: Path, text: str, *secrets: str) -> None:
    """Neither the secret nor its basic-auth encoding in ``text`` (log, /metrics) or the output tree."""
    forms = [s for secret in secrets for s in (secret, basic(USER, secret)["Authorization"].split()[1])]
    files = b"".join(p.read_bytes() for p in (tmp_path / "tb").rglob("*") if p.is_file())
    assert not [form for form in forms if form in text or form.encode() in files]


def test_basic_auth_from_a_file_gets_the_values_into_a_prometheus_that_requires_it(tmp_path: Path,
                                                                                  secured: Prometheus) -> None:
    with pytest.raises(urllib.error.HTTPError) as refused:  # the receiver does require it
        urllib.request.urlopen(f"http://127.0.0.1:{secured.port}/api/v1/query?query=up", timeout=2)
    assert refused.value.code == 401
    side, port, _ = pushing(tmp_path, secured, "rw-basic", PASSWORD)
    step = key("mstb_sidecar_training_step", "rw-basic", rank="0")
    try:
        wait_until(lambda: stored(secured, "rw-basic").get(step) == 200.0, 20, "the pushed step to be queryable")
        shown = exposition(port)
        assert shown[key("mstb_sidecar_remote_write_failed_requests_total", "rw-basic", reason="unauthorized")] == 0
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    finally:
        rc, _ = side.stop()
    assert rc == 0, side.stderr()
    assert_no_secret(tmp_path, side.stderr() + metrics, PASSWORD)


def test_a_wrong_password_is_retried_and_the_queue_arrives_once_the_file_is_fixed(tmp_path: Path,
                                                                                  secured: Prometheus) -> None:
    side, port, password = pushing(tmp_path, secured, "rw-rotate", WRONG)
    unauthorized = key("mstb_sidecar_remote_write_failed_requests_total", "rw-rotate", reason="unauthorized")
    pending = key("mstb_sidecar_remote_write_pending_samples", "rw-rotate")
    try:
        wait_until(lambda: exposition(port)[unauthorized] >= 3, 20, "three pushes refused with 401")
        assert side.running() and stored(secured, "rw-rotate") == {}
        assert "HTTP 401" in side.stderr() and f"reading {password} again" in side.stderr()
        per_snapshot = len(exposition(port))
        wait_until(lambda: exposition(port)[pending] >= 4 * per_snapshot, 10, "four snapshots to be queued")
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
        fixed = exposition(port)
        password.write_text(PASSWORD + "\n")  # as a rotated Secret: the same path, the new content
        at = time.time()
        wait_until(lambda: exposition(port)[pending] < 2 * per_snapshot, 20, "the queue to drain")
        steps = secured.raw('mstb_sidecar_training_step{training_job="rw-rotate",rank="0"}[5m]')
        before = [float(t) for t, _ in steps[0]["values"] if float(t) < at]
        assert len(before) >= 4, steps  # the snapshots queued while refused arrived
        shown = exposition(port)
        assert shown[key("mstb_sidecar_remote_write_samples_total", "rw-rotate", outcome="dropped")] == 0
        assert shown[key("mstb_sidecar_remote_write_samples_total", "rw-rotate", outcome="rejected")] == 0
        assert shown[unauthorized] >= fixed[unauthorized]
    finally:
        rc, _ = side.stop()
    assert rc == 0, side.stderr()
    assert "works again" in side.stderr()
    assert_no_secret(tmp_path, side.stderr() + metrics, PASSWORD, WRONG)


def test_a_bearer_token_and_custom_headers_are_sent_and_a_rotated_token_is_read_after_a_401(
        tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("old-token\n")

    def answer(n: int) -> tuple[int, dict[str, str], bytes]:
        if n == 0:  # the Secret rotated: the old token is refused, the file holds the new one
            token.write_text("new-token\n")
            return 401, {}, b"invalid token"
        return 200, {}, b""

    receiver = Receiver(answer)
    config = tmp_path / "sidecar.yaml"
    config.write_text("remote_write_headers: {X-Scope-OrgID: team-a}\n")
    try:
        side = sidecar(tmp_path, FIXTURE, "--job", "rw-bearer", "--remote-write", receiver.url,
                       "--remote-write-interval", "0.2", "--remote-write-bearer-token-file", str(token),
                       "--config", str(config), "--remote-write-header", "X-Team:  ml platform ")
        wait_until(lambda: len(receiver.pushes) >= 3, 15, "three pushes")
        rc, _ = side.stop()
    finally:
        receiver.close()
    assert rc == 0, side.stderr()
    sent = [{k.lower(): v for k, v in push.headers.items()} for push in receiver.pushes]
    assert [h["authorization"] for h in sent[:3]] == ["Bearer old-token", "Bearer new-token", "Bearer new-token"]
    assert receiver.pushes[1].body == receiver.pushes[0].body  # the refused snapshot, retried
    # The command line's headers replace the config file's, as for every option.
    assert all(h["x-team"] == "ml platform" and "x-scope-orgid" not in h for h in sent)
    assert all(h["content-type"] == "application/x-protobuf" for h in sent)
    assert "HTTP 401: invalid token" in side.stderr() and "token\n" not in side.stderr()
    assert "old-token" not in side.stderr() and "new-token" not in side.stderr()


def test_the_config_files_headers_are_sent(tmp_path: Path) -> None:
    receiver = Receiver(lambda n: (200, {}, b""))
    config = tmp_path / "sidecar.yaml"
    config.write_text("remote_write: URL\nremote_write_headers:\n  X-Scope-OrgID: team-a\n  X-Other: '1'\n"
                      .replace("URL", receiver.url))
    try:
        side = sidecar(tmp_path, FIXTURE, "--job", "rw-header", "--config", str(config))
        wait_until(lambda: receiver.pushes, 15, "a push")
        rc, _ = side.stop()
    finally:
        receiver.close()
    assert rc == 0, side.stderr()
    headers = {k.lower(): v for k, v in receiver.pushes[0].headers.items()}
    assert headers["x-scope-orgid"] == "team-a" and headers["x-other"] == "1" and "authorization" not in headers


@pytest.mark.parametrize(("options", "config", "error"), [
    (["--remote-write-header", "Content-Type: text/plain"], "",
     "--remote-write-header: Value error, Content-Type is set by the remote-write protocol itself"),
    (["--remote-write-header", "x-prometheus-remote-write-version: 2.0"], "",
     "X-Prometheus-Remote-Write-Version is set by the remote-write protocol itself"),
    (["--remote-write-header", "User-Agent: me"], "", "User-Agent is set by the remote-write protocol itself"),
    (["--remote-write-header", "content-encoding: gzip"], "", "Content-Encoding is set by the remote-write"),
    (["--remote-write-header", "Authorization: Bearer abc"], "",
     "Authorization is not set here; use --remote-write-bearer-token-file"),
    (["--remote-write-header", "X-Scope-OrgID team-a"], "", "'X-Scope-OrgID team-a' has no colon"),
    (["--remote-write-header", "X-A: b\rX-B: c"], "", "header 'X-A' holds a line break (CR or LF)"),
    ([], "remote_write_headers: {X-A: \"b\\nc\"}\n",
     "'remote_write_headers': Value error, header 'X-A' holds a line break"),
    ([], "remote_write_headers: [X-A]\n", "'remote_write_headers': Value error, 'X-A' has no colon"),
    (["--remote-write-basic-auth-user", "u"], "",
     "--remote-write-basic-auth-user and --remote-write-password-file go together"),
    (["--remote-write-password-file", "PASSWORD"], "",
     "--remote-write-basic-auth-user and --remote-write-password-file go together"),
    (["--remote-write-basic-auth-user", "u", "--remote-write-password-file", "PASSWORD",
      "--remote-write-bearer-token-file", "PASSWORD"], "", "exclude each other"),
    (["--remote-write-basic-auth-user", "u", "--remote-write-password-file", "MISSING"], "",
     "--remote-write-password-file: Value error, cannot read MISSING: No such file or directory"),
    (["--remote-write-bearer-token-file", "EMPTY"], "", "--remote-write-bearer-token-file: Value error, EMPTY is empty"),
    (["--remote-write-bearer-token-file", "UNREADABLE"], "", "cannot read UNREADABLE: "),
])
def test_misuse_is_a_one_line_error(tmp_path: Path, options: list[str], config: str, error: str) -> None:
    names = {"PASSWORD": tmp_path / "password", "MISSING": tmp_path / "missing", "EMPTY": tmp_path / "empty",
             "UNREADABLE": tmp_path}  # a directory: exists, cannot be read as a file
    names["PASSWORD"].write_text(PASSWORD)
    names["EMPTY"].write_text("\n")
    args = [str(names.get(o, o)) for o in options]
    (tmp_path / "c.yaml").write_text(config)
    proc = run("--watch", str(FIXTURE), "--out", str(tmp_path / "o"), "--remote-write", "http://127.0.0.1:1/w",
               "--config", str(tmp_path / "c.yaml"), *args)
    for name, path in names.items():
        error = error.replace(name, str(path))
    assert proc.returncode == 2 and error in one_line_error(proc)
    assert PASSWORD not in proc.stderr


def test_the_header_and_credential_options_need_remote_write(tmp_path: Path) -> None:
    proc = run("--watch", str(FIXTURE), "--out", str(tmp_path / "o"), "--remote-write-header", "X-A: b")
    assert proc.returncode == 2 and "are for --remote-write URL" in one_line_error(proc)


def test_a_credential_file_gone_after_the_options_were_checked_is_a_misuse_not_a_traceback(tmp_path: Path) -> None:
    """The file is read when the options are checked and again when the pusher starts: removed in
    between (a Secret being remounted), the start ends with the metrics misuse (exit 3, one line
    naming the file), before anything is read or served."""
    from sidecar.service.config import SidecarConfig
    from sidecar.service.daemon import MetricsUnavailable, run_daemon

    token = tmp_path / "token"
    token.write_text("s3cret\n")
    out = tmp_path / "o"
    out.mkdir()
    config = SidecarConfig(out=out, paths=[FIXTURE], instance="test", remote_write="http://127.0.0.1:1/w",
                           remote_write_bearer_token_file=token)
    token.unlink()
    with pytest.raises(MetricsUnavailable, match=f"--remote-write: cannot read {token}: No such file"):
        run_daemon(config)
    assert not any(out.glob("rank_*"))
