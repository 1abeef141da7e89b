"""Command line: ``mstb-sidecar --watch PATH --out DIR`` (live) and ``mstb-sidecar replay PATH... --out DIR``.

Exit codes: 0 done (also when nothing matched, with a warning), 1 the output could not be
written (disk full, read-only), 2 a misuse (bad option, missing path, unwritable ``--out``,
unreadable config, another sidecar already writing ``--out`` as this instance). Errors are one
line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import errno
import logging
import resource
import signal
import sys
from pathlib import Path

from sidecar import __version__
from sidecar.config import ConfigError, SidecarConfig, check_paths, load_config, prepare_out
from sidecar.lock import LockError, hold
from sidecar.logsetup import setup_logging

EXIT_OK, EXIT_WRITE, EXIT_USAGE = 0, 1, 2


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, help="output directory: one TensorBoard run per rank (rank_<N>/)")
    parser.add_argument("--config", type=Path, help="YAML file with any of these options (command line wins)")
    parser.add_argument("--rank", type=int, help="rank of files whose path names none (default 0)")
    parser.add_argument(
        "--rank-pattern",
        help="regex with a named group 'rank' that labels lines of a combined stream, e.g. '^\\[r(?P<rank>\\d+)\\] '",
    )
    parser.add_argument("--instance", help="name of this sidecar's checkpoint, unique per node sharing --out (default: hostname)")
    parser.add_argument("--max-line-bytes", type=int, help="skip (and count) lines longer than this (default 1 MiB)")
    parser.add_argument("--no-aggregate", dest="aggregate", action="store_false", default=None,
                        help="no cross-rank aggregate run (aggregate/<instance>)")
    parser.add_argument("--loss-ranks", help="ranks whose loss the aggregate uses, e.g. 6,7 "
                        "(default: all, or the last pipeline stage when mindformers reports pipeline stages)")
    parser.add_argument("-q", "--quiet", action="store_true", default=None, help="only warnings and errors")
    parser.add_argument("-v", "--verbose", action="store_true", default=None, help="debug logging")
    parser.add_argument("--version", action="version", version=f"mstb-sidecar {__version__}")


def _watch_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mstb-sidecar",
        description="Follow mindformers logs and write per-rank TensorBoard runs until SIGTERM/SIGINT. "
        "Use 'mstb-sidecar replay PATH... --out DIR' to convert finished logs once.",
    )
    parser.add_argument("--watch", dest="paths", type=Path, nargs="+", metavar="PATH",
                        help="directories (e.g. output/log, output/) or log files to follow")
    _common(parser)
    parser.add_argument("--poll", action="store_true", default=None,
                        help="poll only, no inotify (automatic on NFS and other network filesystems)")
    parser.add_argument("--poll-interval", type=float, help="seconds between file checks (default 0.25)")
    parser.add_argument("--rescan-interval", type=float, help="seconds between looks for new files (default 1)")
    parser.add_argument("--checkpoint-interval", type=float, help="seconds between offset checkpoints (default 1)")
    parser.add_argument("--from-end", action="store_true", default=None,
                        help="skip what files already hold when first seen (default: read from the beginning)")
    parser.add_argument("--aggregate-timeout", type=float,
                        help="seconds the aggregate waits for a slow rank before writing a step (default 30)")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (127.0.0.1)")
    parser.add_argument("--metrics-host", help="address for --metrics-port (default 127.0.0.1)")
    return parser


def _replay_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mstb-sidecar replay",
        description="Read mindformers logs once into per-rank TensorBoard runs, print a summary, exit. "
        "Running it again adds only what is new.",
    )
    parser.add_argument("paths", type=Path, nargs="+", metavar="PATH", help="training output directories or log files")
    _common(parser)
    parser.add_argument("--no-progress", dest="progress", action="store_false", default=None,
                        help="no progress bar (it only shows on a terminal anyway)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    replay = bool(args) and args[0] == "replay"
    if not replay:
        # Until the daemon installs its own handlers, SIGTERM means "stop now": nothing is
        # written or checkpointed yet, so a plain exit 0 loses nothing.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    parser = _replay_parser() if replay else _watch_parser()
    ns = vars(parser.parse_args(args[1:] if replay else args))
    config_file = ns.pop("config")
    try:
        config = load_config(ns, config_file)
        setup_logging(config.quiet, config.verbose)
        check_paths(config)
        prepare_out(config.out)
        hold(config.out, config.instance)  # for the life of the process: one writer per --out and instance
    except (ConfigError, LockError) as exc:
        parser.exit(EXIT_USAGE, f"{parser.prog}: error: {exc}\n")
    _raise_fd_limit()
    try:
        if replay:
            from sidecar.replay import run_replay

            return run_replay(config)
        from sidecar.daemon import run_daemon

        return run_daemon(config)
    except OSError as exc:
        return _write_failure(config, exc)
    except LockError as exc:  # --out was deleted and another sidecar took it meanwhile
        parser.exit(EXIT_USAGE, f"{parser.prog}: error: {exc}\n")
    except KeyboardInterrupt:
        return 130


def _raise_fd_limit() -> None:
    """Each rank costs two descriptors (its log, its event file): lift the soft limit to the hard one,
    as a 1024-rank job would exceed the usual soft limit of 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass  # keep the soft limit; the log says EMFILE if it is ever hit


def _write_failure(config: SidecarConfig, exc: OSError) -> int:
    what = {errno.ENOSPC: "the disk is full", errno.EROFS: "the filesystem is read-only",
            errno.EDQUOT: "the disk quota is exceeded", errno.EACCES: "permission denied"}.get(
        exc.errno or 0, exc.strerror or str(exc))
    logging.getLogger("mstb_sidecar").error(
        "cannot write to %s: %s (%s). Nothing is lost: fix it and run the same command again; "
        "it resumes from the last checkpoint.", config.out, what, exc.filename or config.out)
    return EXIT_WRITE


if __name__ == "__main__":
    sys.exit(main())
