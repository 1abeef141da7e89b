"""The fast path: recognising, cheaply, a line that the full parser would find nothing in.

Most lines of a long training log are neither step records nor markers (dataset, memory, grouped
learning-rate lines, MindSpore warnings). The full path routes, splits and dispatches each one
only to learn that; :func:`plain` answers the same question with a prefix match and one search.

What it accepts, as a whole line (label included):

- a mindformers line (file or stdout prefix, ``[INFO] 2024-...`` / ``2024-06-18 ... - INFO - ``)
  whose message contains none of the substrings the dispatch looks for
  (:data:`parsers.line.NEEDLES`): :data:`TIMED`, as the full splitter gives it a timestamp;
- a MindSpore native, CANN or MindIO line below :data:`parsers.line.ERROR_LEVELS`, which the
  full path calls foreign and ignores: :data:`UNTIMED`, as the full splitter gives it none.

Either starts like a log line, so it carries no launcher label and keeps the rank of the lines
before it, and :func:`parsers.line.parse_message` returns ``None`` for it: all the full path
takes from it is its timestamp, if any. Anything else (:data:`NOT_PLAIN`), and every line of a
stream with a user ``--rank-pattern``, goes to the full parser: this path only ever says
"nothing here", never what a line means.

The needles are searched as the shortest suffix that starts at their rarest character (``kpoint``
for ``checkpoint``), in one regex built as a trie: a message without the suffix cannot contain
the needle, and rare first characters keep the regex from trying alternatives at most positions.
A needle with a digit in it is searched without the digits (the longest run between them): a
line with the rest of it goes to the full parser too, which decides.

Raw lines (:class:`Shapes`): the answer for a line is the answer for its *shape*, the line's bytes
with every ASCII digit made ``0``. The prefix patterns treat all digits alike (``\\d``, and classes
that hold every digit or none), so they match the lines of one shape alike and at the same
places; no needle as searched holds a digit, and no level in :data:`~parsers.line.ERROR_LEVELS`
does; UTF-8 never uses the bytes of ASCII digits inside a multi-byte character, so two lines of
one shape decode to texts of one shape. A log repeats a few shapes (the same call sites, numbers
of the same width), so the answer, and for a line that is not plain where its prefix is, is looked
up per shape: the regexes run once per shape, and a plain line is not even decoded. The shapes
kept are bounded (:data:`KEEP_SHAPES`): a log of ever new shapes costs a lookup more per line,
not memory.
"""

from __future__ import annotations

import re

from parsers.line import ERROR_LEVELS, NEEDLES, text_of
from parsers.prefix import FILE_PREFIX, FOREIGN_PREFIX, STDOUT_PREFIX, Cut, cut_of, native_level
from parsers.torn import tears

# Blanks, lower-case letters, digits and the punctuation of ordinary text, most common first;
# any other character (upper case, braces) is rarer than all of them.
_COMMON = " etaoinsrhldcu:,.mf_p/gwyb0123456789-[]()'=vkxjqz"
_MIN_SUFFIX = 4


def _rare_suffix(needle: str) -> str:
    """The suffix of ``needle`` that starts at its rarest character and is at least
    :data:`_MIN_SUFFIX` long (or the whole needle)."""
    def rarity(i: int) -> int:
        return _COMMON.index(needle[i]) if needle[i] in _COMMON else len(_COMMON)

    return needle[max(range(max(len(needle) - _MIN_SUFFIX, 0) + 1), key=rarity):]


def _any_of(words: set[str]) -> re.Pattern[str]:
    """One regex that finds any of ``words``, as a trie: at each position at most one
    alternative per character is tried (a flat alternation tries them all)."""
    tree: dict[str, dict] = {}
    for word in words:
        node = tree
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}

    def build(node: dict[str, dict]) -> str:
        if "" in node:
            return ""  # a shorter word ends here: it alone decides
        alts = [re.escape(ch) + build(child) for ch, child in sorted(node.items())]
        return alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"

    return re.compile(build(tree))


def _digit_free(needle: str) -> str:
    """The longest run of ``needle`` without an ASCII digit (see :class:`Shapes`)."""
    return max(re.split("[0-9]+", needle), key=len)


_NEEDLE = _any_of({_rare_suffix(_digit_free(needle)) for needle in NEEDLES})


NOT_PLAIN, TIMED, UNTIMED, TORN = 0, 1, 2, 3
_NOTHING, _UNTIMED, _TIMED = (NOT_PLAIN, None), (UNTIMED, None), (TIMED, None)


def plain(line: str) -> int:
    """:data:`NOT_PLAIN`, or a plain line with (:data:`TIMED`) or without (:data:`UNTIMED`) a
    timestamp of its own (see the module docstring)."""
    return classify(line)[0]


def classify(line: str) -> tuple[int, re.Match[str] | None]:
    """:func:`plain`'s answer and, for a mindformers line that is not plain, its prefix match,
    which the full path's split takes instead of matching the line again."""
    first = line[:1]
    if first == "[":
        m = FILE_PREFIX.match(line)
        if m is None:
            return _UNTIMED if FOREIGN_PREFIX.match(line) and native_level(line) not in ERROR_LEVELS else _NOTHING
    elif first.isdigit():
        m = STDOUT_PREFIX.match(line)
        if m is None:
            return _UNTIMED if FOREIGN_PREFIX.match(line) else _NOTHING  # MindIO: no level the parser reads
    else:
        return _NOTHING
    return (NOT_PLAIN, m) if _NEEDLE.search(line, m.start(3)) else _TIMED


SHAPE = bytes.maketrans(b"123456789", b"000000000")  # a line's shape: every ASCII digit made 0
KEEP_SHAPES = 4096


class Shapes:
    """:func:`classify` for raw lines, its answer remembered per shape (see the module docstring),
    and for a line that is not plain, where its prefix is (:func:`parsers.prefix.cut_of`). A line
    that holds a second log line (:func:`parsers.torn.tears`, which tears lines of one shape
    alike) is :data:`TORN`, whatever its parts are: the caller splits it and classifies the rest."""

    __slots__ = ("_known",)

    def __init__(self) -> None:
        # shape -> TIMED or UNTIMED, or for a line that is not plain its prefix's cut (() for none)
        self._known: dict[bytes, int | Cut | tuple[()]] = {}

    def classify(self, raw: bytes) -> tuple[int, str | None, Cut | None]:
        """(kind, text, cut). A plain line (:data:`TIMED`, :data:`UNTIMED`) or a torn one
        (:data:`TORN`) comes without its text; another with its text and where its prefix is
        (``None``: it has none)."""
        shape = raw.translate(SHAPE)
        known = self._known.get(shape)
        if known is not None:
            if isinstance(known, int):
                return known, None, None
            return NOT_PLAIN, text_of(raw), known or None
        if len(self._known) >= KEEP_SHAPES:
            self._known.clear()
        if tears(raw):
            self._known[shape] = TORN
            return TORN, None, None
        text = text_of(raw)
        kind, prefix = classify(text)
        cut = cut_of(prefix) if prefix is not None else None
        self._known[shape] = kind or cut or ()
        return (kind, None, None) if kind else (NOT_PLAIN, text, cut)
