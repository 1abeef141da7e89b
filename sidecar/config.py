"""Settings from the command line and an optional YAML file, validated in one place.

The YAML file uses the long option names with ``_`` for ``-`` (``out``, ``watch``, ``rank_pattern``,
``poll_interval`` ...). Command-line values win over the file. Every misuse ends in
:class:`ConfigError` with one line that says what to change.
"""

from __future__ import annotations

import os
import re
import socket
import tempfile
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class ConfigError(Exception):
    """A fatal misuse: the message is shown as-is, with a non-zero exit and no traceback."""


class SidecarConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    out: Path
    paths: list[Path] = Field(min_length=1)
    rank: int = Field(0, ge=0, description="rank of files whose path names none")
    rank_pattern: str | None = None
    instance: str = Field(default_factory=socket.gethostname)
    max_line_bytes: int = Field(1 << 20, ge=1024)
    companion_wait: float = Field(0.5, gt=0)
    aggregate: bool = True
    aggregate_timeout: float = Field(30.0, gt=0)
    loss_ranks: list[int] | None = None
    quiet: bool = False
    verbose: bool = False
    # live mode
    poll: bool = False
    poll_interval: float = Field(0.25, gt=0, le=60)
    rescan_interval: float = Field(1.0, gt=0, le=600)
    checkpoint_interval: float = Field(1.0, gt=0, le=600)
    rotate_quiet: float = Field(5.0, ge=0)
    from_end: bool = False
    drain_timeout: float = Field(5.0, gt=0)
    metrics_port: int | None = Field(None, ge=0, le=65535)
    metrics_host: str = "127.0.0.1"
    # replay
    progress: bool = True

    @field_validator("loss_ranks", mode="before")
    @classmethod
    def _ranks(cls, value: object) -> object:
        if isinstance(value, str):  # "2,3" from the command line
            try:
                return [int(part) for part in value.split(",") if part.strip()]
            except ValueError:
                raise ValueError("a comma-separated list of ranks, e.g. 6,7") from None
        return value

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


def load_config(cli: dict[str, object], config_file: Path | None) -> SidecarConfig:
    """Merge the YAML file (if any) under the command-line values and validate."""
    merged: dict[str, object] = {}
    if config_file is not None:
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
        if "watch" in loaded:
            loaded["paths"] = loaded.pop("watch")
        if isinstance(loaded.get("paths"), str):
            loaded["paths"] = [loaded["paths"]]
        merged.update(loaded)
    merged.update({k: v for k, v in cli.items() if v is not None})
    try:
        return SidecarConfig.model_validate(merged)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "config"
        option = "--" + where.replace("_", "-") if where != "paths" else "the paths to read"
        source = f" (in {config_file})" if config_file is not None else ""
        raise ConfigError(f"{option}: {err['msg']}{source}") from None


def check_paths(config: SidecarConfig) -> None:
    for path in config.paths:
        if not path.exists():
            raise ConfigError(
                f"{path} does not exist; pass the training output directory (e.g. output/ or output/log) or a log file"
            )


def prepare_out(out: Path) -> None:
    """Create ``--out`` if needed and prove it is writable, before any work starts."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".mstb-probe-", dir=out)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(
            f"cannot write to --out {out}: {exc.strerror or exc}; choose a directory you can write to"
        ) from None
