"""One writer per bucket prefix and instance: a lease object taken with conditional writes.

Nodes that share no filesystem cannot share a ``flock``, so the bucket holds the lease:
``PREFIX/.mstb-sidecar/lease-<instance>.json`` says who writes (a token, host, pid) and until when.
It is created with ``If-None-Match: *`` (only if there is none) and renewed or taken over with
``If-Match: <its ETag>`` (only if nobody changed it since it was read), so two sidecars racing for
it cannot both win. The token is kept in the staging directory (``lease-<instance>.token``), which
the local ``flock`` already guards: the same staging directory restarted after a SIGKILL takes its
own lease back at once; another one is refused until the lease has gone unrenewed for :data:`TTL`
(``MSTB_SIDECAR_LEASE_TTL`` seconds, 120 by default).

A lease taken over by someone else (this sidecar could not renew it for longer than the TTL, and
another took it) is :attr:`Lease.lost`: the uploader then stops writing and says so.
Stores that do not implement conditional writes (501) get a warning and no lease.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from pathlib import Path

from sidecar.output.bucket import BucketError, Store
from sidecar.output.state import STATE_DIR, instance_name

log = logging.getLogger(__name__)

# Seconds a lease outlives its last renewal; a staging directory that was lost with its sidecar
# (a pod replaced) waits this long before it may take the prefix over.
TTL = float(os.environ.get("MSTB_SIDECAR_LEASE_TTL") or 120.0)
RENEW_EVERY = TTL / 4


class LeaseError(Exception):
    """Another sidecar holds the lease (the message says who, and what to do)."""


class Lease:
    def __init__(self, store: Store, staging: Path, instance: str) -> None:
        name = instance_name(instance)
        self.store, self.instance = store, name
        self.key = f"{STATE_DIR}/lease-{name}.json"
        self.token = _token(staging / STATE_DIR / f"lease-{name}.token")
        self.etag: str | None = None
        self.renewed = 0.0
        self.lost = False
        self.unsupported = False

    def _body(self) -> bytes:
        return json.dumps({"token": self.token, "host": socket.gethostname(), "pid": os.getpid(),
                           "expires": time.time() + TTL}).encode()

    def take(self) -> None:
        """Hold the lease, or raise :class:`LeaseError` (or :class:`BucketError` from the store)."""
        try:
            self.etag = self.store.put(self.key, self._body(), if_none_match=True)
        except BucketError as exc:
            if self._unsupported(exc):
                return
            if exc.reason != "conflict":
                raise
            self._take_over()
        self.renewed = time.monotonic()

    def _take_over(self) -> None:
        found = self.store.get(self.key)
        if found is None:  # released meanwhile
            self.etag = self.store.put(self.key, self._body(), if_none_match=True)
            return
        body, etag = found
        try:
            held = json.loads(body)
            mine, expires = held.get("token") == self.token, float(held.get("expires", 0))
            holder = f"pid {held.get('pid')} on {held.get('host')}"
        except (ValueError, TypeError, AttributeError):
            mine, expires, holder = False, 0.0, "an unreadable lease"
        if not mine and expires > time.time():
            raise LeaseError(
                f"another sidecar ({holder}) writes {self.store.url} as instance {self.instance} (its lease runs "
                f"until {time.strftime('%H:%M:%S', time.localtime(expires))} unless renewed); stop it, "
                "or give this one its own --instance")
        try:
            self.etag = self.store.put(self.key, self._body(), if_match=etag)
        except BucketError as exc:
            if exc.reason == "conflict":
                raise LeaseError(f"another sidecar took the lease of {self.store.url} as instance "
                                 f"{self.instance} at the same moment; give this one its own --instance") from None
            raise

    def renew(self) -> None:
        """Extend the lease when due; sets :attr:`lost` if someone else holds it now."""
        if self.unsupported or self.lost or time.monotonic() - self.renewed < RENEW_EVERY:
            return
        try:
            self.etag = self.store.put(self.key, self._body(), if_match=self.etag)
        except BucketError as exc:
            if exc.reason == "conflict":
                self.lost = True
                log.error("the lease of %s as instance %s was taken over by another sidecar; this one stops "
                          "uploading (its staging directory keeps everything)", self.store.url, self.instance)
                return
            raise
        self.renewed = time.monotonic()

    def release(self) -> None:
        """Give the lease up (a clean stop), so another sidecar may start at once."""
        if self.unsupported or self.lost or self.etag is None:
            return
        found = self.store.get(self.key)
        if found is not None and found[1] == self.etag:
            self.store.delete(self.key)

    def _unsupported(self, exc: BucketError) -> bool:
        if "NotImplemented" not in str(exc) and not str(exc).startswith("501"):
            return False
        self.unsupported = True
        log.warning("%s does not support conditional writes: one writer per prefix and instance is not "
                    "enforced; make sure no other sidecar writes it as instance %s", self.store.url, self.instance)
        return True


def _token(path: Path) -> str:
    """This staging directory's lease token, made once."""
    try:
        return path.read_text(encoding="ascii").strip() or _new_token(path)
    except FileNotFoundError:
        return _new_token(path)


def _new_token(path: Path) -> str:
    token = uuid.uuid4().hex
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(token, encoding="ascii")
    os.replace(tmp, path)
    return token
