"""Write the token data set the tiny LLaMA trains on, as a MindRecord file.

Runs in the mindformers venv (it needs ``mindspore.mindrecord``). The tokens follow a pattern
(``x[t+1] = (7 * x[t] + 3) % 997 + 1``, replaced by a random token one time in ten), so the loss
falls and the curves have a shape; the generator is seeded, so every run trains on the same data.
Each record is ``seq_length + 1`` tokens: mindformers shifts them into inputs and labels. An
evaluation set (``eval_dataset`` in ``tiny_llama.yaml``) takes ``seq_length`` tokens (TOKENS 32):
mindformers' eval network feeds the whole record to the model and shifts inside the metric.

usage: make_data.py OUT.mindrecord RECORDS [TOKENS]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from mindspore.mindrecord import FileWriter

SEQ_LENGTH = 32  # model.model_config.seq_length in tiny_llama.yaml
VOCAB = 1000  # model.model_config.vocab_size
NOISE = 0.1
SEED = 1234


def records(n: int, tokens: int = SEQ_LENGTH + 1) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(SEED)
    out = []
    for _ in range(n):
        x = np.empty(tokens, np.int32)
        x[0] = rng.integers(1, VOCAB)
        for t in range(1, tokens):
            x[t] = (x[t - 1] * 7 + 3) % 997 + 1 if rng.random() > NOISE else rng.integers(1, VOCAB)
        out.append({"input_ids": x})
    return out


def write(path: Path, n: int, tokens: int = SEQ_LENGTH + 1) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = FileWriter(str(path), shard_num=1, overwrite=True)  # also replaces PATH.db
    writer.add_schema({"input_ids": {"type": "int32", "shape": [-1]}}, "tiny")
    writer.write_raw_data(records(n, tokens))
    writer.commit()


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__.strip().splitlines()[-1])
    write(Path(sys.argv[1]), *map(int, sys.argv[2:]))
