"""``--run-name TEMPLATE``: where a rank's run goes under ``--out``.

Why: several experiments replayed or followed into one logdir must not share ``rank_0``; a
template such as ``{label}/{config_hash}/rank_{rank}`` names each run by what differs, and
TensorBoard shows them side by side. Fields: ``{rank}`` (required, so ranks never share a run),
``{job}`` (``--job``), ``{label}`` (``--label``, e.g. ``lora-r8``) and ``{config_hash}`` (:func:`parsers.run_config.config_hash`
of the rank's configuration as read before its run was created; ``partial-<hex>`` when that was
the start-up lines only, which two runs differing in, say, the learning rate share).

Experiments. Each invocation (one job, or one replay) is an experiment: what the template puts
around ``{rank}``'s path component. Its aggregate and layout runs go where a rank's run would,
that component replaced by ``aggregate/<instance>`` (:func:`beside`): ``{label}/rank_{rank}``
gives ``lora-r8/aggregate/<instance>``, the default ``rank_{rank}`` ``aggregate/<instance>`` as
ever, so experiments sharing ``--out`` never share an aggregate. So ``{rank}`` must be the only
field of its component (``{label}_{rank}`` would leave the label out of the aggregate's path).
Its checkpoint is its own too (:func:`experiment` names it): another experiment's offsets would
skip the logs this one has not written yet.

Safety: the template is checked at start-up (unknown fields, format specs, an absolute path or
``..`` are a one-line error); every field value is sanitised into one path component (``/`` and
anything but ``[A-Za-z0-9_.-]`` become ``_``, no leading dot), so log content or a label can never
reach outside ``--out``.
"""

from __future__ import annotations

import os
import re
import string
from pathlib import Path

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
    if len(_fields(parts[_rank_part(template)])) > 1:
        raise ValueError("{rank} must be the only field of its path component (e.g. {label}/rank_{rank}), so that "
                         "each experiment's aggregate and layout runs can go beside its ranks")
    return template


def _fields(text: str) -> list[str]:
    return [field for _, field, _, _ in string.Formatter().parse(text) if field is not None]


def _rank_part(template: str) -> int:
    return next(i for i, part in enumerate(template.split("/")) if "rank" in _fields(part))


def beside(template: str, rank_run: str, kind: str, instance: str) -> str:
    """The experiment's ``kind`` run (``aggregate``, ``layout``) of a checked ``template``: the path of
    ``rank_run`` (one of its rank runs, as :func:`render` made it) with ``{rank}``'s component
    replaced by ``kind/instance``."""
    parts = rank_run.split("/")
    parts[_rank_part(template)] = f"{kind}/{instance}"
    return "/".join(parts)


class RankRuns:
    """Where one experiment's rank runs are, for what reads them back from ``--out`` (the job
    aggregate). The experiment's part of the template must not hold ``{config_hash}`` (:func:`needs_hash`)."""

    def __init__(self, template: str, label: str | None, job: str | None) -> None:
        index = _rank_part(template)
        parts = render(template, 0, label, None, job).split("/")
        self.parent, self.suffix = "/".join(parts[:index]), "/".join(parts[index + 1:])
        self.pattern = re.compile("".join(re.escape(literal) + (r"(\d{1,7})" if name else "")
                                          for literal, name, _, _ in string.Formatter().parse(template.split("/")[index])))

    def find(self, out: Path) -> dict[int, Path]:
        """rank -> run directory, of the runs there are now."""
        try:
            names = os.listdir(out / self.parent)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        found = {}
        for name in names:
            match = self.pattern.fullmatch(name)
            run = out / self.parent / name / self.suffix
            if match is not None and run.is_dir():
                found[int(match.group(1))] = run
        return found


def needs_hash(template: str) -> bool:
    """Does the experiment's part of the template (outside ``{rank}``'s component) hold ``{config_hash}``?
    Then its aggregate can be placed only once a rank's configuration was read."""
    parts = template.split("/")
    del parts[_rank_part(template)]
    return "config_hash" in _fields("/".join(parts))


def experiment(template: str, label: str | None, job: str | None) -> str:
    """What tells this experiment's checkpoint from others in one ``--out``: the template with ``{rank}``'s
    component as ``*`` and ``{label}``, ``{job}`` filled in (``{config_hash}`` stays a field: it is read
    from the logs, which the checkpoint's offsets are of). Empty for a template of one component (the
    default): its checkpoint stays where it always was."""
    parts = template.split("/")
    if len(parts) == 1:
        return ""
    parts[_rank_part(template)] = "*"
    return render("/".join(parts).replace("{config_hash}", "{{config_hash}}"), 0, label, None, job)


def uses(template: str, name: str) -> bool:
    return name in _fields(template)


def render(template: str, rank: int, label: str | None = None, config_hash: str | None = None,
           job: str | None = None) -> str:
    """The run's path under ``--out`` (``/``-separated); fields missing a value read ``unknown``,
    ``unlabelled`` or ``unnamed``."""
    values = {"rank": str(rank), "job": job or "unnamed", "label": label or "unlabelled",
              "config_hash": config_hash or "unknown"}
    safe = {k: (_UNSAFE.sub("_", v).lstrip(".") or "_")[:MAX_COMPONENT] for k, v in values.items()}
    return template.format(**safe)
