"""Python literals as ``repr``/``pprint`` print them, read without executing anything.

mindformers prints its configuration that way (the start-up ``initial parallel_config from dict:``
lines and the ``pprint(config)`` dump, :mod:`parsers.run_config`). Object reprs such as
``<...MoEConfig object at 0x7f...>`` become strings without the address (which differs per run), a
sub-expression that is not a literal becomes its source text. Guards: never raises, never executes;
the caller bounds the text's size.
"""

from __future__ import annotations

import ast
import re

_OBJECT_REPR = re.compile(r"<([A-Za-z_][\w.]*(?: [\w.]+)*?) at 0x[0-9a-fA-F]+>")
_CLASS_REPR = re.compile(r"<class '([\w.]+)'>")
# ``Parameter (name=model.layers.0.wq, shape=(64, 64), ...)``: a repr that is not even Python syntax.
_CALL_REPR = re.compile(r"\b[A-Z]\w* ?\((?:[^()'\"\n]|\([^()'\"\n]*\))*\)")


def read_literal(text: str) -> object:
    """A Python literal as printed by ``repr``/``pprint``, or ``None`` if it is not one.

    Object reprs are made strings first (their addresses dropped); a sub-expression that is not a
    literal (a call, a name) is kept as its source text; if that is still not Python syntax,
    call-like reprs (``Name (...)``) are made strings too. Never raises, never executes anything.
    """
    text = _OBJECT_REPR.sub(lambda m: repr(f"<{m.group(1)}>"), text)
    text = _CLASS_REPR.sub(lambda m: repr(f"<class {m.group(1)}>"), text)
    for attempt in (text, _CALL_REPR.sub(lambda m: repr(m.group(0)), text)):
        try:
            tree = ast.parse(attempt, mode="eval")
            return _node_value(tree.body, attempt)
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            continue
    return None


def _node_value(node: ast.expr, source: str) -> object:
    if isinstance(node, ast.Dict):
        return {
            str(_node_value(k, source)) if k is not None else "**": _node_value(v, source)
            for k, v in zip(node.keys, node.values)
        }
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [_node_value(e, source) for e in node.elts]
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError):
        return ast.get_source_segment(source, node) or ast.unparse(node)
