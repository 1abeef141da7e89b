"""The baseline: the log-to-TensorBoard script an ML engineer writes in ten minutes.

It exists so ``bench_replay.py`` can say how the product compares to the obvious alternative,
so it is kept honest rather than naive: compiled regexes, a cheap substring test before each
regex, text-mode line iteration (C-level buffering and UTF-8 decoding), and tensorboardX's
``SummaryWriter.add_scalar`` used the way its docs show. It is deliberately *not* robust: no
resume/de-duplication, no other log versions, no wall times from the log (``add_scalar``
stamps ``time.time()``), which only makes it faster than a careful script would be.

It writes the same seven tags per step as the product (loss, learning-rate, grad-norm,
loss-scale, iteration-time, model-flops-throughput-per-npu from the head line, throughput from
the progress bar) so both contenders do the same amount of useful work.

    python bench/baseline_regex_replay.py TREE --out DIR
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from tensorboardX import SummaryWriter

# The v1.9 graph-trainer head: "{ Epoch:[  1/  2], step:[  512/ 2000], loss: 3.019482, ..."
HEAD = re.compile(
    r"Epoch:\[\s*(\d+)/\s*\d+\], step:\[\s*(\d+)/\s*(\d+)\], loss: ([^,]+), per_step_time: (\d+)ms, "
    r"lr: ([^,]+), overflow cond: \w+, loss_scale: ([^,]+), global_norm: \[?([^\],]+)\]?, "
    r"train_throughput_per_npu: ([^T,]+)T"
)
# The progress bar that closes the record: "  5.2% |██   | 0.86313 samples/s/p  2:26:41 }"
BAR = re.compile(r"\| ([\d.]+) samples/s/p")
LOGS = re.compile(r"(?:rank_(\d+)/info\.log|worker_(\d+)\.log)$")
HEAD_TAGS = ("loss", "iteration-time", "learning-rate", "loss-scale", "grad-norm", "model-flops-throughput-per-npu")


def replay_file(path: Path, writer: SummaryWriter) -> int:
    """Write every step record of one rank's log; returns the number of scalars written."""
    step = -1
    points = 0
    add = writer.add_scalar
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if "samples/s/p" in line:
                m = BAR.search(line)
                if m and step >= 0:
                    add("throughput", float(m.group(1)), step)
                    points += 1
            elif "step:[" in line:
                m = HEAD.search(line)
                if m is None:
                    continue
                epoch, local, per_epoch = int(m.group(1)), int(m.group(2)), int(m.group(3))
                step = (epoch - 1) * per_epoch + local
                for tag, raw in zip(HEAD_TAGS, m.groups()[3:]):
                    add(tag, float(raw), step)
                points += len(HEAD_TAGS)
    return points


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    for path in sorted(args.root.rglob("*.log")):
        m = LOGS.search(path.as_posix())
        if m is None:
            continue
        rank = int(m.group(1) or m.group(2))
        writer = SummaryWriter(logdir=str(args.out / f"rank_{rank}"))
        try:
            replay_file(path, writer)
        finally:
            writer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
