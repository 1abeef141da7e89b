"""Train the tiny LLaMA with real mindformers on the CPU and leave its genuine output in WORKDIR/output.

Writes the data set (``make_data.py``), then trains (``train.py``) with the mindformers venv's
Python, in WORKDIR: one process (``single``), or two data-parallel workers under ``msrun`` on
127.0.0.1 (``dp2``). Needs only the standard library, so any Python can start it; the commands run
without a shell. Exit status: the training's.

WORKDIR/output then holds ``log/rank_N/info.log``, ``msrun_log/worker_N.log`` (dp2) and
mindformers' own TensorBoard runs ``tensorboard/rank_N/``.

usage: launch.py --python MF_PYTHON WORKDIR {single,dp2} [--records N] [--master-port P] [key=value ...]
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "tiny_llama.yaml"
# dp2 is the single config with data parallelism over two workers.
MODE_OVERRIDES = {"single": (), "dp2": ("use_parallel=True", "parallel_config.data_parallel=2")}
WORKERS = {"single": 1, "dp2": 2}
DATA = Path("data") / "train.mindrecord"  # train_dataset.data_loader.dataset_dir in the config


def steps_per_rank(records: int, mode: str) -> int:
    """Global steps each rank trains: two epochs of batch 2 over its share of the records."""
    return 2 * (records // (2 * WORKERS[mode]))


def commands(python: Path, mode: str, records: int, overrides: list[str], master_port: int) -> list[list[str]]:
    """The data command, then the training command; both run in WORKDIR."""
    data = [str(python), str(HERE / "make_data.py"), str(DATA), str(records)]
    script = [str(HERE / "train.py"), str(CONFIG), *MODE_OVERRIDES[mode], *overrides]
    if mode == "single":
        return [data, [str(python), *script]]
    msrun = [str(python.parent / "msrun"), f"--worker_num={WORKERS[mode]}", f"--local_worker_num={WORKERS[mode]}",
             "--master_addr=127.0.0.1", f"--master_port={master_port}", "--log_dir=output/msrun_log",
             "--join=True", "--cluster_time_out=120"]
    return [data, msrun + script]


def environment(python: Path) -> dict[str, str]:
    """msrun starts its workers as ``python`` from PATH: the venv's must come first."""
    return {**os.environ, "PATH": f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", type=Path, required=True, help="interpreter of a venv with mindformers 1.9")
    parser.add_argument("workdir", type=Path)
    parser.add_argument("mode", choices=sorted(MODE_OVERRIDES))
    parser.add_argument("--records", type=int, help="data set size (default 200 per worker)")
    parser.add_argument("--master-port", type=int, default=8118, help="msrun's port on 127.0.0.1 (dp2)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. context.mode=1")
    args = parser.parse_intermixed_args(argv)
    args.python = args.python.absolute()  # the commands run in WORKDIR; not resolve(): a venv's python is a link
    if not os.access(args.python, os.X_OK):
        parser.error(f"--python {args.python}: no such interpreter (give the python of a venv with mindformers 1.9)")
    if args.mode == "dp2" and not os.access(args.python.parent / "msrun", os.X_OK):
        parser.error(f"dp2 needs msrun beside --python, in {args.python.parent} (it comes with mindspore)")
    records = args.records or 200 * WORKERS[args.mode]

    args.workdir.mkdir(parents=True, exist_ok=True)
    env = environment(args.python)
    for cmd in commands(args.python, args.mode, records, args.overrides, args.master_port):
        print(f"launch.py: {shlex.join(cmd)}", file=sys.stderr, flush=True)
        rc = subprocess.run(cmd, cwd=args.workdir, env=env, stdin=subprocess.DEVNULL).returncode
        if rc != 0:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
