"""The value grammar of mindformers step records, and the field splitter.

Values arrive as ``str()`` of Python/numpy objects: ``2.5``, ``  nan``, ``[1.5624999e-05]``,
``[0.51 0.49]``, ``None``, ``unavailable``, ``1893ms``, ``488.201 ms``, ``238.114T``,
``(2.5e-06,2.5e-06,)``. Anything that is not exactly one number is "no value", never a guess.
"""

from __future__ import annotations


_NON_NUMBERS = frozenset({"", "none", "unavailable", "n/a"})
_UNIT_SUFFIXES = ("ms", "T", "s")


def parse_number(text: str) -> float | None:
    """One number from a printed value, or ``None`` when it is not exactly one number."""
    s = text.strip()
    if s[:1] in "[(":
        s = s[1:-1].strip() if s[-1:] in "])" else s[1:].strip()
        if s.endswith(","):  # a one-element tuple, or the experimental trainer's lr tuple
            s = s[:-1]
        if "," in s:
            s = s.split(",", 1)[0]
        elif " " in s:
            return None  # a multi-element numpy array
    for suffix in _UNIT_SUFFIXES:
        if s.endswith(suffix) and len(s) > len(suffix):
            s = s[: -len(suffix)].rstrip()
            break
    if s.lower() in _NON_NUMBERS:
        return None
    try:
        value = float(s)
    except ValueError:
        return None
    return value


def parse_bool(text: str) -> bool | None:
    """``True``/``False`` or numpy's ``[ True]``; ``None`` for anything else."""
    s = text.strip(" []")
    if s == "True":
        return True
    if s == "False":
        return False
    return None


def split_fields(text: str) -> list[tuple[str, str]]:
    """Split ``key: value, key:value, ...`` into pairs, ignoring commas inside ``[]``/``()``.

    Keys are returned lower-cased (``Loss_scale`` -> ``loss_scale``); a part without a colon
    gets the empty key. Unknown keys are kept: new ones appear release by release.
    """
    pairs: list[tuple[str, str]] = []
    pending = ""
    for part in text.split(", "):
        if pending:
            part = f"{pending}, {part}"
        if part.count("[") > part.count("]") or part.count("(") > part.count(")"):
            pending = part  # a ", " inside brackets or parentheses: keep joining
            continue
        pending = ""
        pairs.append(_pair(part))
    if pending:
        pairs.append(_pair(pending))
    return pairs


def _pair(part: str) -> tuple[str, str]:
    key, sep, value = part.partition(":")
    if not sep:
        return "", part.strip()
    return key.strip().lower(), value.strip()
