"""What ``--remote-write`` sends besides the samples: extra headers and credentials, as Prometheus'
own ``remote_write`` config offers them (``headers``, ``basic_auth`` with ``password_file``,
``authorization`` with ``credentials_file``).

- :func:`parse_headers` turns ``--remote-write-header 'Name: value'`` (repeatable) or the config
  file's ``remote_write_headers: {Name: value}`` into a dict, refusing (``ValueError``, one line) a
  header without a colon, one with CR/LF or an invalid name, and those the protocol sets itself
  (:data:`RESERVED`; ``Authorization`` too: credentials come from a file only).
- :func:`read_secret` reads a password or token file: its content without the trailing newline;
  a missing, unreadable or empty file is a ``ValueError`` naming the file, never its content.
- :class:`Credentials` holds the ``Authorization`` header built from the files, read at start and
  again by :meth:`Credentials.reload` when the receiver answers 401/403 (a Secret mount rotated).

A secret lives only in the header dict handed to the request: it is never logged, nor put in the
status line, the metrics or the checkpoint (:meth:`Credentials.__repr__` hides it too).
"""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping
from pathlib import Path

# Set by the sidecar per request (remote-write 1.0), or by the credential options.
RESERVED = ("Content-Type", "Content-Encoding", "X-Prometheus-Remote-Write-Version", "User-Agent", "Authorization")
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 field-name


def parse_headers(value: object) -> dict[str, str]:
    """``['X-Scope-OrgID: team-a']`` (command line) or ``{'X-Scope-OrgID': 'team-a'}`` (config file)."""
    if isinstance(value, Mapping):
        pairs = [(str(name), str(text)) for name, text in value.items()]
    elif isinstance(value, list):
        pairs = []
        for item in value:
            name, colon, text = str(item).partition(":")
            if not colon:
                raise ValueError(f"'{item}' has no colon; write 'Name: value', e.g. 'X-Scope-OrgID: team-a'")
            pairs.append((name.strip(), text.strip()))
    else:
        raise ValueError("a mapping of header name to value, e.g. {X-Scope-OrgID: team-a}")
    headers: dict[str, str] = {}
    for name, text in pairs:
        if any(c in name + text for c in "\r\n"):
            raise ValueError(f"header '{name.strip()}' holds a line break (CR or LF)")
        if not _TOKEN.fullmatch(name):
            raise ValueError(f"'{name}' is not a valid header name")
        reserved = next((r for r in RESERVED if r.lower() == name.lower()), None)
        if reserved == "Authorization":
            raise ValueError("Authorization is not set here; use --remote-write-bearer-token-file or "
                             "--remote-write-basic-auth-user with --remote-write-password-file")
        if reserved is not None:
            raise ValueError(f"{reserved} is set by the remote-write protocol itself; drop it")
        headers[name] = text
    return headers


def read_secret(path: Path) -> str:
    """The file's content without the trailing newline (as Prometheus reads ``password_file``)."""
    try:
        text = path.read_text(encoding="utf-8").rstrip("\r\n")
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text") from None
    if not text:
        raise ValueError(f"{path} is empty")
    if any(c in text for c in "\r\n"):
        raise ValueError(f"{path} holds more than one line")
    return text


class Credentials:
    """The ``Authorization`` header of basic auth (user, password file) or a bearer token file."""

    def __init__(self, user: str | None = None, password_file: Path | None = None,
                 token_file: Path | None = None) -> None:
        self.user, self.password_file, self.token_file = user, password_file, token_file
        self.headers: dict[str, str] = {}
        self.reload()

    @property
    def file(self) -> Path | None:
        """The file the secret is read from (None: no credentials)."""
        return self.token_file or self.password_file

    def reload(self) -> None:
        """Read the file again (ValueError if it cannot be read: the headers stay as they were)."""
        if self.token_file is not None:
            self.headers = {"Authorization": f"Bearer {read_secret(self.token_file)}"}
        elif self.password_file is not None:
            pair = f"{self.user}:{read_secret(self.password_file)}".encode()
            self.headers = {"Authorization": f"Basic {base64.b64encode(pair).decode('ascii')}"}

    def __repr__(self) -> str:
        return f"Credentials(user={self.user!r}, file={str(self.file)!r})"
