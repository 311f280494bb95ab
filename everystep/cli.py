"""The `everystep` operations CLI.

Exit codes: 0 success; 1 the command ran and refused (a run in the wrong
state, nothing to do where something was asked); 2 bad input (usage, a
malformed id or JSON, an unknown workflow); 3 the database is unreachable.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import psycopg

from everystep import store

EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_DATABASE = 3


class CliError(Exception):
    """One clear line for stderr, and the exit code that goes with it."""

    def __init__(self, message: str, code: int = EXIT_USAGE):
        super().__init__(message)
        self.code = code


def database_url(args: argparse.Namespace) -> str:
    """--database-url, else EVERYSTEP_DATABASE_URL, else -c FILE's database.url."""
    if args.database_url:
        return args.database_url
    if os.environ.get("EVERYSTEP_DATABASE_URL"):
        return os.environ["EVERYSTEP_DATABASE_URL"]
    if getattr(args, "config", None):
        from supervisor.config import ConfigError, load  # noqa: PLC0415  (only with -c)

        try:
            url = load(args.config).database.url
        except ConfigError as exc:
            raise CliError(str(exc)) from None
        if url:
            return url
        raise CliError(
            f"{args.config}: database.url is empty (the embedded database is only started by the supervisor)"
        )
    raise CliError("no database: pass --database-url, set EVERYSTEP_DATABASE_URL, or pass -c everystep.yaml")


def connect(args: argparse.Namespace) -> psycopg.Connection:
    url = database_url(args)
    try:
        return psycopg.connect(url, autocommit=True, connect_timeout=10)
    except psycopg.OperationalError as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else "connection failed"
        raise CliError(f"cannot reach the database: {first_line}", EXIT_DATABASE) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
    return value


def cmd_migrate(args: argparse.Namespace) -> int:
    with connect(args) as conn:
        applied = store.migrate(conn)
    print(f"applied {', '.join(applied)}" if applied else "nothing to apply: the schema is up to date")
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    """Run one worker in this process until TERM/INT (drain) or QUIT (fast stop)."""
    import importlib  # noqa: PLC0415
    import signal  # noqa: PLC0415

    from everystep import logs  # noqa: PLC0415
    from everystep.worker import Worker  # noqa: PLC0415

    logs.configure(args.log_level)
    url = database_url(args)
    for module in args.imports:
        try:
            importlib.import_module(module)
        except Exception as exc:
            raise CliError(f"cannot import {module}: {type(exc).__name__}: {exc}") from None
    worker = Worker(url, args.name, threads=args.threads, poll=args.poll, drain=args.drain, grace=args.grace,
                    max_crashes=args.max_crashes)
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    signal.signal(signal.SIGINT, lambda *_: worker.stop())
    signal.signal(signal.SIGQUIT, lambda *_: worker.stop(fast=True))
    worker.run()
    sys.stdout.flush()
    # Steps still running past the drain deadline were requeued; do not wait for their threads.
    os._exit(0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="everystep", description="Operate everystep runs on PostgreSQL.")
    parser.add_argument("--database-url", help="PostgreSQL URL (default: $EVERYSTEP_DATABASE_URL, else -c FILE)")
    parser.add_argument("-c", "--config", help="everystep.yaml to take database.url from")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, fn: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help)
        sub.set_defaults(func=fn)
        return sub

    add("migrate", cmd_migrate, "apply the schema migrations (safe to run concurrently and repeatedly)")

    worker = add("worker", cmd_worker, "run one worker in this process (the supervisor runs a pool of them)")
    worker.add_argument("--name", required=True, help="runner name: the claimed_by of its runs; unique while alive")
    worker.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                        help="module defining workflows (repeatable)")
    worker.add_argument("--threads", type=_positive_int, default=8, help="runs in flight (default 8)")
    worker.add_argument("--poll", type=_positive_float, default=1.0, help="seconds between polls (default 1)")
    worker.add_argument("--drain", type=float, default=30.0, help="seconds to drain on TERM; 0 waits for ever")
    worker.add_argument("--grace", type=float, default=10.0,
                        help="seconds without its lock before the worker abandons its runs (default 10)")
    worker.add_argument("--max-crashes", type=_positive_int, default=3,
                        help="claims that die without progress before a run fails (default 3)")
    worker.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except CliError as exc:
        print(f"everystep: {exc}", file=sys.stderr)
        return exc.code
    except psycopg.OperationalError as exc:
        print(f"everystep: database error: {str(exc).strip().splitlines()[0]}", file=sys.stderr)
        return EXIT_DATABASE
    except psycopg.Error as exc:
        print(f"everystep: database error: {str(exc).strip().splitlines()[0]}", file=sys.stderr)
        return EXIT_REFUSED


if __name__ == "__main__":
    sys.exit(main())
