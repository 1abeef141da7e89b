"""``--run-name TEMPLATE``: where a rank's run goes under ``--out``.

Why: several experiments replayed or followed into one logdir must not share ``rank_0``; a
template such as ``{label}/{config_hash}/rank_{rank}`` names each run by what differs, and
TensorBoard shows them side by side. Fields: ``{rank}`` (required, so ranks never share a run),
``{job}`` (``--job``), ``{label}`` (``--label``, e.g. ``lora-r8``) and ``{config_hash}`` (:func:`parsers.run_config.config_hash`
of the rank's configuration as read before its run was created; ``partial-<hex>`` when that was
the start-up lines only, which two runs differing in, say, the learning rate share).

Safety: the template is checked at start-up (unknown fields, format specs, an absolute path or
``..`` are a one-line error); every field value is sanitised into one path component (``/`` and
anything but ``[A-Za-z0-9_.-]`` become ``_``, no leading dot), so log content or a label can never
reach outside ``--out``.
"""

from __future__ import annotations

import re
import string

DEFAULT = "rank_{rank}"
FIELDS = ("rank", "job", "label", "config_hash")
MAX_COMPONENT = 100
_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]+")
_LITERAL_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-/]")


def check_template(template: str) -> str:
    """The template if it is usable; else ``ValueError`` with one line saying what to change."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"not a valid template ({exc}); write fields as {{rank}}, {{label}}, {{config_hash}}") from None
    names = set()
    for literal, name, spec, conversion in parsed:
        if _LITERAL_UNSAFE.search(literal):
            raise ValueError(f"{literal!r}: use only letters, digits, '_', '.', '-' and '/' around the fields")
        if name is None:
            continue
        if name not in FIELDS:
            raise ValueError(f"unknown field {{{name}}}; the fields are " + ", ".join(f"{{{f}}}" for f in FIELDS))
        if spec or conversion:
            raise ValueError(f"{{{name}}}: no format spec or conversion allowed")
        names.add(name)
    if "rank" not in names:
        raise ValueError("must contain {rank}, or ranks would share one run (e.g. {label}/rank_{rank})")
    parts = template.split("/")
    if template.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError("must be a relative path without empty, '.' or '..' components")
    return template


def uses(template: str, name: str) -> bool:
    return any(field == name for _, field, _, _ in string.Formatter().parse(template))


def render(template: str, rank: int, label: str | None = None, config_hash: str | None = None,
           job: str | None = None) -> str:
    """The run's path under ``--out`` (``/``-separated); fields missing a value read ``unknown``,
    ``unlabelled`` or ``unnamed``."""
    values = {"rank": str(rank), "job": job or "unnamed", "label": label or "unlabelled",
              "config_hash": config_hash or "unknown"}
    safe = {k: (_UNSAFE.sub("_", v).lstrip(".") or "_")[:MAX_COMPONENT] for k, v in values.items()}
    return template.format(**safe)
