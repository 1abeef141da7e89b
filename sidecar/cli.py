"""Command line: ``mstb-sidecar --watch PATH --out DIR`` (live), ``mstb-sidecar replay PATH... --out DIR``,
``mstb-sidecar check PATH...`` (a dry run that writes nothing) and ``mstb-sidecar aggregate --out DIR``
(one aggregate over the rank runs of every node sharing ``--out``).

Exit codes (also in ``--help``, as an admin reads them from ``systemctl status``): see
:data:`EXIT_CODES`. Errors are one line each on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import atexit
import errno
import logging
import os
import resource
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from sidecar import __version__

if TYPE_CHECKING:
    from sidecar.output.upload import Uploader
    from sidecar.output.sink import Sink
    from sidecar.service.config import SidecarConfig

EXIT_OK, EXIT_WRITE, EXIT_USAGE, EXIT_METRICS, EXIT_CHECK, EXIT_ALERT, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 5, 130
EXIT_CODES = f"""exit codes:
  {EXIT_OK}  done (also when nothing matched, with a warning)
  {EXIT_WRITE}  the output could not be written (disk full, read-only, deleted); run again after the fix
  {EXIT_USAGE}  misuse: bad option or config, missing path (replay), unwritable --out,
     another sidecar already writing --out as this instance
  {EXIT_METRICS}  the --metrics-port endpoint could not be served (port in use, bad --metrics-host),
     or a --remote-write credential file could not be read at start
  {EXIT_CHECK}  check: a file found cannot be followed (unreadable, not recognised) or none was found
  {EXIT_ALERT}  replay: an alert that --fail-on names was raised (everything was still written)
  {EXIT_INTERRUPTED}  replay: stopped by Ctrl-C; the same command goes on from its last checkpoint"""
COMMANDS = """commands:
  mstb-sidecar --watch PATH... --out DIR     follow live until SIGTERM/SIGINT (this page)
  mstb-sidecar replay PATH... --out DIR      read finished logs once, print a summary, exit
  mstb-sidecar check PATH...                 dry run: what would be followed, writes nothing
  mstb-sidecar aggregate --out DIR           one aggregate over the rank runs of every node (aggregate/job)"""


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", help="output directory: one TensorBoard run per rank (rank_<N>/); or s3://BUCKET/PREFIX "
                        "(staged in --state-dir, uploaded every --upload-interval)")
    _bucket(parser)
    parser.add_argument("--config", type=Path, help="YAML file with any of these options (command line wins)")
    parser.add_argument("--rank", type=int, help="rank of files whose path names none (default 0)")
    parser.add_argument(
        "--rank-pattern",
        help="regex with a named group 'rank' that labels lines of a combined stream, e.g. '^\\[r(?P<rank>\\d+)\\] '",
    )
    parser.add_argument("--instance", help="name of this sidecar's checkpoint, unique per node sharing --out (default: hostname)")
    parser.add_argument("--max-line-bytes", type=int, help="skip (and count) lines longer than this (default 1 MiB)")
    parser.add_argument("--no-aggregate", dest="aggregate", action="store_false", default=None,
                        help="no cross-rank aggregate run (aggregate/<instance>; under --run-name, beside the rank runs)")
    parser.add_argument("--loss-ranks", help="ranks whose loss the aggregate uses, e.g. 6,7 "
                        "(default: all, or the last pipeline stage when mindformers reports pipeline stages)")
    parser.add_argument("--on-alert", metavar="CMD",
                        help="run CMD (split like a shell would, run without one) for each alert and "
                        "'resolved', with the alert as JSON on stdin; it never blocks reading")
    parser.add_argument("--on-alert-timeout", type=float, metavar="SECONDS",
                        help="kill an --on-alert command after this long (default 10)")
    parser.add_argument("--job", help="the job's name: label 'training_job' of the metrics (default: the absolute "
                        "--out) and {job} of --run-name")
    parser.add_argument("--run-name", metavar="TEMPLATE",
                        help="run directory of each rank under --out, from {rank}, {job}, {label}, {config_hash} "
                        "(default rank_{rank}; e.g. {label}/{config_hash}/rank_{rank})")
    parser.add_argument("--label", help="the {label} of --run-name, e.g. lora-r8")
    parser.add_argument("--every", type=int, metavar="N", help="keep every N-th step per tag, and each tag's first "
                        "and last point, non-finite values and alert steps (default 1: all)")
    parser.add_argument("--max-event-file-mb", type=float, metavar="MB",
                        help="start a new event file once one holds this many MiB (default: no limit)")
    parser.add_argument("--mlflow", metavar="TRACKING_URI",
                        help="also log every run to this MLflow tracking server, one MLflow run per run, in the "
                        "experiment --job, e.g. http://mlflow:5000 (needs: pip install 'mstb-sidecar[mlflow]')")
    _logging(parser)


def _bucket(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state-dir", type=Path, metavar="DIR",
                        help="with --out s3://: the local directory the runs and the checkpoint are staged in "
                        "(default $XDG_STATE_HOME/mstb-sidecar/BUCKET/PREFIX, else ~/.local/state/...)")
    parser.add_argument("--upload-interval", type=float, metavar="SECONDS",
                        help="with --out s3://: seconds between uploads, so how fresh the bucket is (default 10)")


def _logging(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-q", "--quiet", action="store_true", default=None, help="only warnings and errors")
    parser.add_argument("-v", "--verbose", action="store_true", default=None,
                        help="also the sidecar's decisions: files opened, rotated, resumed, ranks found")
    parser.add_argument("--log-format", choices=["text", "json"],
                        help="text (timestamped, none under journald) or one JSON object per line (default text)")
    parser.add_argument("-V", "--version", action="version", version=f"mstb-sidecar {__version__}")


def _watch_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mstb-sidecar",
        description="Follow mindformers logs and write per-rank TensorBoard runs until SIGTERM/SIGINT. "
        "A --watch path that does not exist yet is waited for. "
        "Use 'mstb-sidecar replay PATH... --out DIR' to convert finished logs once.",
        epilog=f"{COMMANDS}\n\n{EXIT_CODES}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--watch", dest="paths", type=Path, nargs="+", metavar="PATH",
                        help="directories (e.g. output/log, output/) or log files to follow; '-': standard input "
                        "(e.g. kubectl logs -f POD | mstb-sidecar --watch - ...), read until it ends")
    _common(parser)
    parser.add_argument("--poll", action="store_true", default=None,
                        help="poll only, no inotify (automatic on NFS and other network filesystems)")
    parser.add_argument("--poll-interval", type=float, help="seconds between file checks (default 0.25)")
    parser.add_argument("--min-read-interval", type=float, metavar="SECONDS",
                        help="with inotify, the least time between two reads: lines written faster are read in "
                        "batches, for less CPU and up to this much delay (default 0.08; 0: every burst at once)")
    parser.add_argument("--rescan-interval", type=float, help="seconds between looks for new files (default 1)")
    parser.add_argument("--checkpoint-interval", type=float, help="seconds between offset checkpoints (default 5)")
    parser.add_argument("--from-end", action="store_true", default=None,
                        help="skip what files already hold when first seen (default: read from the beginning)")
    parser.add_argument("--aggregate-timeout", type=float,
                        help="seconds the aggregate waits for a slow rank before writing a step (default 30)")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (127.0.0.1)")
    parser.add_argument("--metrics-host", help="address for --metrics-port (default 127.0.0.1)")
    parser.add_argument("--wait-grace", type=float, metavar="SECONDS",
                        help="warn when a --watch path still does not exist after this long (default 300; it keeps waiting)")
    parser.add_argument("--status-interval", type=float, metavar="SECONDS",
                        help="log a status line this often, and on SIGUSR1 (default 60; 0: only on SIGUSR1)")
    parser.add_argument("--remote-write", metavar="URL",
                        help="also push the metrics with Prometheus remote write, e.g. http://prometheus:9090/api/v1/write")
    parser.add_argument("--remote-write-interval", type=float, metavar="SECONDS",
                        help="seconds between pushes (default 15)")
    parser.add_argument("--remote-write-queue", type=int, metavar="SAMPLES",
                        help="samples kept while the receiver is unreachable, the oldest dropped first "
                        "(default 100000)")
    parser.add_argument("--remote-write-header", dest="remote_write_headers", action="append", metavar="'NAME: VALUE'",
                        help="send this header with every push, e.g. 'X-Scope-OrgID: team-a' (repeatable)")
    parser.add_argument("--remote-write-basic-auth-user", metavar="USER",
                        help="push with basic auth as USER, the password read from --remote-write-password-file")
    parser.add_argument("--remote-write-password-file", type=Path, metavar="PATH",
                        help="the basic-auth password (never on the command line); read again on a 401/403")
    parser.add_argument("--remote-write-bearer-token-file", type=Path, metavar="PATH",
                        help="push with 'Authorization: Bearer <the file's content>'; read again on a 401/403")
    return parser


def _paths_parser(command: str, description: str) -> argparse.ArgumentParser:
    """A subcommand that takes the paths to read as positional arguments."""
    parser = argparse.ArgumentParser(
        prog=f"mstb-sidecar {command}",
        description=description,
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("paths", type=Path, nargs="*", metavar="PATH",
                        help="training output directories or log files (default: watch: of --config)")
    return parser


def _replay_parser() -> argparse.ArgumentParser:
    parser = _paths_parser(
        "replay",
        "Read mindformers logs once into per-rank TensorBoard runs, print a summary, exit. "
        "Running it again adds only what is new.",
    )
    _common(parser)
    parser.add_argument("--no-progress", dest="progress", action="store_false", default=None,
                        help="no progress bar (it only shows on a terminal anyway)")
    parser.add_argument("--jobs", type=int, metavar="N",
                        help="read the ranks in N processes (default: one per usable core, for 8 MB of logs or more; "
                        "1: one process)")
    parser.add_argument("--checkpoint-interval", type=float, metavar="SECONDS",
                        help="seconds between checkpoints while reading: a replay that is killed goes on from "
                        "the last one (default 5)")
    parser.add_argument("--fail-on", metavar="ALERTS",
                        help="exit 5 if any of these alerts was raised, e.g. nan,spike (nan, spike, "
                        "behind, throughput, divergence, overflow, error); for CI jobs that gate on a log")
    return parser


def _check_parser() -> argparse.ArgumentParser:
    parser = _paths_parser(
        "check",
        "Dry run: list the files the sidecar would follow under PATH..., each with its rank and "
        "detected mindformers format, and what is unreadable or not recognised. Writes nothing.",
    )
    parser.add_argument("--config", type=Path, help="YAML file with --rank / --rank-pattern (command line wins)")
    parser.add_argument("--rank", type=int, help="rank of files whose path names none (default 0)")
    parser.add_argument("--rank-pattern", help="regex with a named group 'rank' for combined streams")
    _logging(parser)
    return parser


def _aggregate_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mstb-sidecar aggregate",
        description="Follow every rank_<N> run under --out (one sidecar per node writes its ranks' runs there) "
        "and write one cross-rank aggregate for the whole job, aggregate/job, until SIGTERM/SIGINT.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", help="the output directory the node sidecars share, or their s3://BUCKET/PREFIX")
    _bucket(parser)
    parser.add_argument("--once", action="store_true",
                        help="read what the runs hold, write every step with the ranks that reported it, exit")
    parser.add_argument("--aggregate-timeout", type=float,
                        help="seconds a step waits for a late or dead node before it is written without it (default 30)")
    parser.add_argument("--loss-ranks", help="ranks whose loss the aggregate uses, e.g. 6,7 "
                        "(default: all, or the last pipeline stage when the logs report pipeline stages)")
    parser.add_argument("--run-name", metavar="TEMPLATE", help="where the node sidecars put the rank runs, as they "
                        "were given it (default rank_{rank}); the aggregate goes beside them, e.g. <label>/aggregate/job")
    parser.add_argument("--label", help="the {label} of --run-name")
    parser.add_argument("--job", help="the {job} of --run-name")
    parser.add_argument("--poll-interval", type=float, default=1.0, help="seconds between looks at the runs (default 1)")
    parser.add_argument("--checkpoint-interval", type=float, help="seconds between checkpoints (default 5)")
    parser.add_argument("--status-interval", type=float, metavar="SECONDS",
                        help="log a status line this often (default 60; 0: never)")
    _logging(parser)
    parser.set_defaults(config=None)
    return parser


def main(argv: list[str] | None = None, sinks: Sequence[Sink] = ()) -> int:
    """The command line; ``sinks``: outputs besides TensorBoard, for a program that embeds it."""
    args = list(sys.argv[1:] if argv is None else argv)
    command = args[0] if args and args[0] in ("replay", "check", "aggregate") else "watch"
    parser = {"replay": _replay_parser, "check": _check_parser, "watch": _watch_parser,
              "aggregate": _aggregate_parser}[command]()
    if not args:
        parser.print_usage(sys.stderr)
        parser.exit(EXIT_USAGE, f"{COMMANDS}\n\nmore: mstb-sidecar --help\n")
    if command == "watch" or (command == "aggregate" and "--once" not in args):
        # Until the daemon installs its own handlers, SIGTERM means "stop now": nothing is
        # written or checkpointed yet, so a plain exit 0 loses nothing.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    ns = vars(parser.parse_args(args if command == "watch" else args[1:]))
    # Imported once the arguments parse: ``--help`` and a usage error need none of it (pydantic,
    # and through the lock's state file the aggregate and TensorBoard's protos).
    from sidecar.output.lock import LockError, hold
    from sidecar.service.config import ConfigError, check_paths, check_stream, load_config, prepare_out
    from sidecar.service.logsetup import setup_logging

    config_file = ns.pop("config")
    once = bool(ns.pop("once", False))
    if command in ("replay", "check") and not ns["paths"]:
        if config_file is None:
            parser.error("the following arguments are required: PATH")
        ns["paths"] = None  # the config file's watch:
    try:
        if command == "check":
            ns["out"] = Path(".")  # required by the settings; check never writes
        if command == "aggregate":
            from sidecar.analysis.job_aggregate import JOB

            ns["paths"], ns["instance"] = [Path(".")], JOB  # it reads --out only, and writes as instance "job"
        config = load_config(ns, config_file, "--watch PATH" if command == "watch" else "PATH (or watch: in --config)")
        setup_logging(config.quiet, config.verbose, config.log_format)
        if command in ("replay", "check"):  # live mode waits for paths that do not exist yet
            check_paths(config)
        elif command == "watch":
            check_stream(config)
        if command == "check":
            from sidecar.service.check import run_check

            return EXIT_OK if run_check(config, sys.stdout) else EXIT_CHECK
        prepare_out(config.out, "--state-dir" if config.bucket else "--out")
        hold(config.out, config.instance)  # for the life of the process: one writer per --out and instance
        uploader = _open_bucket(config, mirror=command == "aggregate")
    except (ConfigError, LockError) as exc:
        parser.exit(EXIT_USAGE, "".join(f"{parser.prog}: error: {line}\n" for line in str(exc).splitlines()))
    _raise_fd_limit()
    if uploader is not None:
        uploader.start()
    code = EXIT_WRITE
    try:
        code = _run(command, config, once, uploader, parser, sinks)
    finally:
        if uploader is not None:
            from sidecar.service.bucket_out import close_bucket

            finished = (command == "replay" or once) and code != EXIT_INTERRUPTED  # done when the bucket holds it
            if not close_bucket(uploader, config, replay=finished) and finished and code == EXIT_OK:
                code = EXIT_WRITE
    return code


def _open_bucket(config: SidecarConfig, mirror: bool) -> Uploader | None:
    """``--out s3://``: the uploader, its lease held and the staging directory pulled (or ConfigError)."""
    if config.bucket is None:
        return None
    from sidecar.service.bucket_out import BucketStartError, open_bucket
    from sidecar.service.config import ConfigError

    try:
        return open_bucket(config, mirror)
    except BucketStartError as exc:
        raise ConfigError(str(exc)) from None


def _run(command: str, config: SidecarConfig, once: bool, uploader: Uploader | None,
         parser: argparse.ArgumentParser, sinks: Sequence[Sink]) -> int:
    from sidecar.output.lock import LockError

    try:
        if command == "aggregate":
            from sidecar.service.job_daemon import run_job_aggregate

            return run_job_aggregate(config, once)
        if command == "replay":
            from sidecar.service.replay import run_replay

            return run_replay(config, EXIT_ALERT, sinks)
        from sidecar.service.daemon import MetricsUnavailable, run_daemon

        try:
            return run_daemon(config, [*sinks, *([uploader] if uploader is not None else [])], uploader=uploader)
        except MetricsUnavailable as exc:
            parser.exit(EXIT_METRICS, f"{parser.prog}: error: {exc}\n")
    except OSError as exc:
        return _write_failure(config, exc)
    except LockError as exc:  # --out was deleted and another sidecar took it meanwhile
        parser.exit(EXIT_USAGE, f"{parser.prog}: error: {exc}\n")
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


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


def run() -> NoReturn:
    """The console script: :func:`main`, then an exit that skips the interpreter's teardown.

    When :func:`main` returns, everything it wrote is closed and synced (runs, checkpoint); the
    atexit handlers (logging's flush among them) run and stdout and stderr are flushed here.
    What is left, freeing every module and object one by one, is work the kernel does at once:
    about 40 ms of a 0.3 s ``check`` or empty replay (10 ms after a replay, whose objects are
    mostly frozen). While another thread runs (the metrics endpoint, an ``--on-alert`` command),
    the normal exit is kept: it waits for threads that are not daemons.
    """
    code = main()
    if threading.active_count() > 1:
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (``| head``): nothing more can be said
            pass
    os._exit(code)


if __name__ == "__main__":
    run()
