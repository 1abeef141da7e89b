"""The run's configuration as TensorBoard shows it: the ``config`` text card and the values of
the HParams tab, from the flat settings of :func:`parsers.run_config.settings`.

Guards: what TensorBoard cannot show is made showable, never dropped silently: no ``None`` in
HParams (left out: "not stated"), an integer beyond a double as its digits, strings and card
cells cut at :data:`MAX_TEXT` characters (with an ellipsis), ``|`` and newlines escaped in the card.
"""

from __future__ import annotations

import sys

from parsers.run_config import PARTIAL, Value

MAX_TEXT = 200  # longest string value shown as a hyperparameter

_DOUBLE_MAX = int(sys.float_info.max)


def hparams(values: dict[str, Value]) -> dict[str, str | float | bool]:
    """The settings TensorBoard's HParams tab can show: no ``None``, strings cut at :data:`MAX_TEXT`,
    an integer beyond a double (its numbers) as its digits."""
    out: dict[str, str | float | bool] = {}
    for key, value in values.items():
        if value is None:
            continue
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > _DOUBLE_MAX:
            value = str(value)
        if isinstance(value, str) and len(value) > MAX_TEXT:
            value = value[: MAX_TEXT - 1] + "…"
        out[key] = value
    return out


def markdown(values: dict[str, Value], digest: str) -> str:
    """The ``config`` text card: a table of the start-up facts, then the configuration; for a
    :data:`PARTIAL` hash, first what it covers."""
    lines = [f"**config hash** `{digest}`", ""]
    if digest.startswith(PARTIAL):
        lines += ["*Partial:* no full configuration dump was read (it is in the stdout log, `worker_N.log`, "
                  "of every eighth rank), only mindformers' start-up lines. The hash covers the settings "
                  "below and nothing else: the `run.` facts (task, model, parallel mode, global batch size "
                  "and its factors, world size, pipeline stages, parameter count, epochs, data set size, "
                  "warm-up lines) and the parallel, recompute, MoE and swap configurations. Runs that "
                  "differ elsewhere (learning rate and its schedule, optimizer, model sizes, seed) share "
                  "it. Name the stdout log on the command line too for a hash of the whole configuration.", ""]
    lines += ["| setting | value |", "|---|---|"]
    for key, value in values.items():
        if value is None:
            continue
        shown = str(value).replace("|", "\\|").replace("\n", " ")
        if len(shown) > MAX_TEXT:
            shown = shown[: MAX_TEXT - 1] + "…"
        lines.append(f"| `{key}` | {shown} |")
    return "\n".join(lines)
