"""Settings from the command line and an optional YAML file, validated in one place.

The YAML file uses the command line's long option names, written with ``-`` or ``_`` alike
(``poll-interval`` or ``poll_interval``; ``watch`` for the paths, ``no-aggregate: true``). Command-line
values win over the file. Every misuse ends in :class:`ConfigError`, which lists every problem
found (not just the first), each under the name the user wrote, with a did-you-mean for typos.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
import shlex
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from parsers.custom_metrics import CustomMetric, MetricList
from sidecar.analysis.detectors import AlertSettings, Group
from sidecar.following.tailer import STDIN
from sidecar.output import run_names
from sidecar.output.bucket import SCHEME, split_url
from sidecar.service.remote_auth import parse_headers, read_secret


class ConfigError(Exception):
    """A fatal misuse: the message is shown as-is, with a non-zero exit and no traceback."""


class SidecarConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    out: Path  # the staging directory (--state-dir) when --out is a bucket
    bucket: str | None = None  # --out s3://BUCKET/PREFIX, as given
    state_dir: Path | None = None
    upload_interval: float = Field(10.0, gt=0, le=3600)
    paths: list[Path] = Field(min_length=1)
    rank: int = Field(0, ge=0, description="rank of files whose path names none")
    rank_pattern: str | None = None
    instance: str = Field(default_factory=socket.gethostname)
    max_line_bytes: int = Field(1 << 20, ge=1024)
    companion_wait: float = Field(0.5, gt=0)
    aggregate: bool = True
    aggregate_timeout: float = Field(30.0, gt=0)
    loss_ranks: list[int] | None = None
    run_name: str = run_names.DEFAULT
    label: str | None = None
    every: int = Field(1, ge=1, description="keep every N-th step per tag")
    metrics: list[CustomMetric] = []  # config file only: parsers.custom_metrics
    max_event_file_mb: float | None = Field(None, gt=0)
    quiet: bool = False
    verbose: bool = False
    log_format: Literal["text", "json"] = "text"
    # live mode
    poll: bool = False
    poll_interval: float = Field(0.25, gt=0, le=60)
    min_read_interval: float = Field(0.08, ge=0, le=60)  # inotify: at 20 steps/s, 0.8 of the CPU of every burst read, waits < 0.1 s
    rescan_interval: float = Field(1.0, gt=0, le=600)
    checkpoint_interval: float = Field(5.0, gt=0, le=600)  # the fsyncs are a tenth of the live CPU at 1 s
    rotate_quiet: float = Field(5.0, ge=0)
    from_end: bool = False
    drain_timeout: float = Field(5.0, gt=0)
    metrics_port: int | None = Field(None, ge=0, le=65535)
    metrics_host: str = "127.0.0.1"
    wait_grace: float = Field(300.0, ge=0)
    status_interval: float = Field(60.0, ge=0)
    remote_write: str | None = None
    remote_write_interval: float = Field(15.0, gt=0)
    remote_write_queue: int = Field(100_000, ge=1, description="samples kept while the receiver is unreachable")
    remote_write_headers: dict[str, str] = {}  # sidecar.service.remote_auth.parse_headers
    remote_write_basic_auth_user: str | None = None
    remote_write_password_file: Path | None = None  # files only: a secret on the command line shows in ps
    remote_write_bearer_token_file: Path | None = None
    mlflow: str | None = None  # a tracking URI: sidecar.output.mlflow_sink
    # alerts
    alerts: AlertSettings = AlertSettings()
    on_alert: list[str] | None = None
    on_alert_timeout: float = Field(10.0, gt=0)
    job: str | None = None
    # replay
    progress: bool = True
    jobs: int | None = Field(None, ge=1, description="replay: processes to read ranks in (default: the usable cores)")
    fail_on: list[Group] = []

    @model_validator(mode="before")
    @classmethod
    def _bucket(cls, data: object) -> object:
        """``--out s3://...`` writes into the staging directory, which the bucket mirrors
        (:mod:`sidecar.output.upload`); everything else keeps writing a local ``out``."""
        if not isinstance(data, dict):
            return data
        out, state_dir = data.get("out"), data.get("state_dir")
        if isinstance(out, str) and out.startswith(SCHEME):
            try:
                bucket, prefix = split_url(out)
            except ValueError as exc:  # not pydantic's ValueError: its message would be unnamed
                raise ConfigError(f"--out {out}: {exc}") from None
            staging = Path(state_dir) if state_dir is not None else default_state_dir(bucket, prefix)
            return {**data, "bucket": out.rstrip("/"), "out": staging}
        if state_dir is not None:
            raise ConfigError("--state-dir is for --out s3://BUCKET/PREFIX only (a local --out holds its own state)")
        return data

    @field_validator("loss_ranks", mode="before")
    @classmethod
    def _ranks(cls, value: object) -> object:
        if isinstance(value, str):  # "2,3" from the command line
            try:
                return [int(part) for part in value.split(",") if part.strip()]
            except ValueError:
                raise ValueError("a comma-separated list of ranks, e.g. 6,7") from None
        return value

    @field_validator("fail_on", mode="before")
    @classmethod
    def _groups(cls, value: object) -> object:
        if isinstance(value, str):  # "nan,spike" from the command line
            value = [part.strip() for part in value.split(",") if part.strip()]
        known = [g.value for g in Group]
        for name in value if isinstance(value, list) else []:
            if name not in known:
                raise ValueError(f"unknown alert '{name}'; choose from {', '.join(known)}")
        return value

    @field_validator("alerts", mode="before")
    @classmethod
    def _alert_keys(cls, value: object) -> object:
        """``loss-spike`` or ``loss_spike``, as for the top-level options."""
        def norm(node: object) -> object:
            return {str(k).replace("-", "_"): norm(v) for k, v in node.items()} if isinstance(node, dict) else node
        return norm(value)

    @field_validator("on_alert", mode="before")
    @classmethod
    def _command(cls, value: object) -> object:
        """A command line split like a shell would, but run without one; it must exist now."""
        if isinstance(value, str):
            try:
                value = shlex.split(value)
            except ValueError as exc:
                raise ValueError(f"cannot split the command ({exc})") from None
        if isinstance(value, list):
            if not value:
                raise ValueError("empty command")
            if shutil.which(str(value[0])) is None:
                raise ValueError(f"'{value[0]}' is not an executable on PATH; give its full path")
        return value
    @field_validator("remote_write")
    @classmethod
    def _remote_write(cls, value: str | None) -> str | None:
        parts = urlsplit(value or "http://h")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("not an http:// or https:// URL; e.g. http://prometheus:9090/api/v1/write")
        return value

    @field_validator("remote_write_headers", mode="before")
    @classmethod
    def _headers(cls, value: object) -> object:
        return parse_headers(value)

    @field_validator("remote_write_basic_auth_user")
    @classmethod
    def _user(cls, value: str | None) -> str | None:
        if value is not None and (not value or any(c in value for c in ":\r\n")):
            raise ValueError("a user name, not empty, without ':' or a line break")
        return value

    @field_validator("remote_write_password_file", "remote_write_bearer_token_file")
    @classmethod
    def _secret_file(cls, value: Path | None) -> Path | None:
        if value is not None:
            read_secret(value)  # readable and not empty now; read again by the pusher (not kept here)
        return value

    @model_validator(mode="after")
    def _credentials(self) -> SidecarConfig:
        user, password, token = (self.remote_write_basic_auth_user, self.remote_write_password_file,
                                 self.remote_write_bearer_token_file)
        if token is not None and (user is not None or password is not None):
            raise ConfigError("--remote-write-bearer-token-file and --remote-write-basic-auth-user "
                              "(--remote-write-password-file) exclude each other; give one")
        if self.remote_write is None and (self.remote_write_headers or user or password or token):
            raise ConfigError("--remote-write-header and the credential options are for --remote-write URL; "
                              "give it too, or drop them")
        if (user is None) != (password is None):
            raise ConfigError("--remote-write-basic-auth-user and --remote-write-password-file go together "
                              "(the password only from a file: the command line shows in ps)")
        return self

    @field_validator("mlflow")
    @classmethod
    def _mlflow(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("empty; give the tracking server's URI, e.g. http://mlflow:5000")
        if value is not None and importlib.util.find_spec("mlflow") is None:
            raise ValueError("needs MLflow's client, not installed here: pip install 'mstb-sidecar[mlflow]'")
        return value

    @field_validator("metrics")
    @classmethod
    def _metrics(cls, value: list[CustomMetric]) -> list[CustomMetric]:
        return MetricList(metrics=value).metrics  # unique names and tags

    @field_validator("run_name")
    @classmethod
    def _run_name(cls, value: str) -> str:
        return run_names.check_template(value)

    @field_validator("rank_pattern")
    @classmethod
    def _pattern(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            compiled = re.compile(value)
        except re.error as exc:
            raise ValueError(f"not a valid regular expression ({exc})") from None
        if "rank" not in compiled.groupindex:
            raise ValueError("needs a named group (?P<rank>\\d+)")
        return value


# YAML keys (with "_") that are spelled differently from the field they set; True: the value is negated.
_ALIASES = {"watch": ("paths", False), "no_aggregate": ("aggregate", True), "no_progress": ("progress", True)}
_HIDDEN = {"paths", "aggregate", "progress", "bucket"}  # set through an alias, not under this name


def load_config(cli: dict[str, object], config_file: Path | None, paths_option: str = "--watch PATH") -> SidecarConfig:
    """Merge the YAML file (if any) under the command-line values and validate. ``paths_option``
    names the paths in a message (``replay`` and ``check`` take them as arguments)."""
    merged: dict[str, object] = {}
    written: dict[str, str] = {}  # field -> the YAML key as the user wrote it
    problems: list[str] = []
    raw: dict[str, object] = {}  # the file as written, for naming keys inside sections
    if config_file is not None:
        merged, written, problems, raw = _read_yaml(config_file)
    merged.update({k: v for k, v in cli.items() if v is not None})
    for key in cli:
        if cli[key] is not None:
            written.pop(key, None)
    try:
        config = SidecarConfig.model_validate(merged)
    except ValidationError as exc:
        problems += [_describe(err, written, config_file, raw, paths_option) for err in exc.errors()]
        config = None
    if problems or config is None:
        raise ConfigError("\n".join(dict.fromkeys(problems)))
    return config


def _read_yaml(config_file: Path) -> tuple[dict[str, object], dict[str, str], list[str], dict[str, object]]:
    import yaml  # here, not at the top: 11 ms of start-up that only --config needs

    try:
        loaded = yaml.safe_load(config_file.read_text(encoding="utf-8")) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read config file {config_file}: {exc.strerror}; check the path") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config file {config_file} is not valid YAML{where}; fix it or drop --config") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {config_file} must be a mapping of option: value")
    known = sorted({*SidecarConfig.model_fields, *_ALIASES} - _HIDDEN)
    values: dict[str, object] = {}
    written: dict[str, str] = {}
    problems = []
    for key, value in loaded.items():
        name = str(key).replace("-", "_")
        field, negate = _ALIASES.get(name, (name, False))
        if name in _HIDDEN or field not in SidecarConfig.model_fields:
            style = "-" if "-" in str(key) else "_"
            alias = next((a for a, (f, _) in _ALIASES.items() if f == name), None)  # aggregate -> no_aggregate
            close = [alias] if alias else difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean '{close[0].replace('_', style)}'?" if close else ""
            problems.append(f"{config_file}: unknown option '{key}'{hint}")
            continue
        if field == "paths" and isinstance(value, str):
            value = [value]
        if negate and isinstance(value, bool):
            value = not value
        values[field] = value
        written[field] = str(key)
    return values, written, problems, loaded


def _describe(err: dict, written: dict[str, str], config_file: Path | None, raw: dict[str, object],
              paths_option: str) -> str:
    """One problem, named as the user wrote it: the YAML key (with the file), else the option.
    An unknown key inside a section (``alerts: {los-spike: ...}``) keeps its spelling and gets a
    did-you-mean among that section's keys."""
    field = str(err["loc"][0]) if err["loc"] else ""
    msg = "required" if err["type"] == "missing" else err["msg"]
    if field in written:
        path, node, model = [written[field]], raw.get(written[field]), SidecarConfig.model_fields[field].annotation
        for part in err["loc"][1:]:
            key = next((k for k in node if str(k).replace("-", "_") == part), part) if isinstance(node, dict) else part
            path.append(str(key))
            fields = getattr(model, "model_fields", {})  # the section's known keys
            if err["type"] == "extra_forbidden" and part == err["loc"][-1]:
                close = difflib.get_close_matches(str(part), list(fields), n=1)
                hint = close[0].replace("_", "-" if "-" in str(key) else "_") if close else None
                msg = "unknown option" + (f"; did you mean '{hint}'?" if hint else "")
            node = node.get(key) if isinstance(node, dict) else None
            model = fields[part].annotation if part in fields else None
        return f"{config_file}: '{'.'.join(path)}': {msg}"
    named = {"paths": paths_option, "out": "--out DIR", "remote_write_headers": "--remote-write-header"}
    option = named.get(field, "--" + field.replace("_", "-"))
    return f"{option}: {msg}"


def check_stream(config: SidecarConfig) -> None:
    """``--watch -`` (standard input) is the only path: its end ends the run, which files
    followed beside it would not."""
    if STDIN in config.paths and len(config.paths) > 1:
        raise ConfigError("--watch -: standard input is the only path when given (it ends the run at its end); "
                          "follow files with another sidecar (another --instance)")


def check_paths(config: SidecarConfig) -> None:
    """Replay and check read what is there now: a path that does not exist (or cannot be read)
    is a mistake to report at once. The live daemon waits for missing paths instead."""
    if STDIN in config.paths:
        raise ConfigError("- (standard input) is read live only: mstb-sidecar --watch - --out DIR reads it "
                          "and exits 0 at its end")
    for path in config.paths:
        try:
            is_dir = path.is_dir()
            if not is_dir and not path.exists():
                raise ConfigError(f"{path} does not exist; pass the training output directory "
                                  "(e.g. output/ or output/log) or a log file")
        except OSError as exc:  # a directory on the way that we may not search
            raise ConfigError(f"cannot read {path}: {(exc.strerror or str(exc)).lower()}; "
                              "run as a user that can read the training logs") from None
        if not os.access(path, os.R_OK | (os.X_OK if is_dir else 0)):
            raise ConfigError(f"cannot read {path}: permission denied; run as a user that can read the training logs")


def default_state_dir(bucket: str, prefix: str) -> Path:
    """Where ``--out s3://BUCKET/PREFIX`` stages its runs unless ``--state-dir`` says:
    ``$XDG_STATE_HOME/mstb-sidecar/BUCKET/PREFIX`` (``~/.local/state`` without it)."""
    home = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(home, "mstb-sidecar", bucket, *prefix.split("/"))


def prepare_out(out: Path, option: str = "--out") -> None:
    """Create ``--out`` (or the staging ``--state-dir``) if needed and prove it is writable, before any work starts."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".mstb-probe-", dir=out)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(
            f"cannot write to {option} {out}: {exc.strerror or exc}; choose a directory you can write to"
        ) from None
