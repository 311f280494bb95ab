"""What the commands share: the database they talk to, the errors and exit
codes, the argument types, and the output helpers."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import uuid
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import psycopg

from everystep import db, operations, registry, serde
from everystep.cli.errors import (  # noqa: F401  (re-exported: the commands take them from here)
    EXIT_DATABASE,
    EXIT_PLAN_CHANGED,
    EXIT_REFUSED,
    EXIT_USAGE,
    CliError,
)
from everystep.logs import first_line

# How a module adds its commands: add(commands, name, fn, help) is a
# subcommand with the database options (build_parser's).
Add = Callable[[Any, str, "Callable[[argparse.Namespace], int] | None", str], argparse.ArgumentParser]


# ---------------------------------------------------------------- the database

def database_url(args: argparse.Namespace) -> str:
    """--database-url, else --context's url, else EVERYSTEP_DATABASE_URL,
    else -c FILE's database.url."""
    context = _context(args)
    if args.database_url:
        if context is not None:
            raise CliError(f"--database-url and --context {context.name} both name a database: give one")
        return args.database_url
    if context is not None:
        return context.url
    if os.environ.get("EVERYSTEP_DATABASE_URL"):
        return os.environ["EVERYSTEP_DATABASE_URL"]
    if getattr(args, "config", None):
        url = load_config(args.config).database.url
        if url:
            return url
        from everystep import embedded  # noqa: PLC0415

        url = embedded.running_url()
        if url:
            return url  # the embedded server of a supervisor running here
        raise CliError(
            f"{args.config}: database.url is empty and no embedded database is running here "
            "(everystep-supervisor starts one under ./.everystep/)"
        )
    raise CliError("no database: pass --database-url, set EVERYSTEP_DATABASE_URL, or pass -c everystep.yaml")


def load_config(path: str) -> Any:
    """The config file given with -c, validated (a mistake is one line, exit 2)."""
    from everystep.config import ConfigError, load  # noqa: PLC0415  (only with -c)

    try:
        return load(path)
    except ConfigError as exc:
        raise CliError(str(exc)) from None


def _context(args: argparse.Namespace) -> Any:
    """The --context of the command line, read from the contexts file (once)."""
    name = getattr(args, "context", None)
    if not name:
        return None
    if getattr(args, "_context", None) is None:
        from everystep.cli import contexts  # noqa: PLC0415

        args._context = contexts.load_context(name)
    return args._context


def expected_environment(args: argparse.Namespace) -> tuple[str | None, str]:
    """The environment the database must record, and who expects it: the
    --context's, else -c FILE's database.expected_environment; (None, "")
    when nothing expects one."""
    context = _context(args)
    if context is not None and context.environment is not None:
        return context.environment, f"--context {context.name}"
    if getattr(args, "config", None):
        expected = load_config(args.config).database.expected_environment
        if expected:
            return expected, f"{args.config}: database.expected_environment"
    return None, ""


def allow_newer_schema(args: argparse.Namespace) -> bool:
    """Whether --allow-newer-schema, or -c FILE's database.allow_newer_schema,
    declares a schema migrated by a newer everystep compatible."""
    if getattr(args, "allow_newer_schema", False):
        return True
    return bool(getattr(args, "config", None)) and load_config(args.config).database.allow_newer_schema


def open_connection(args: argparse.Namespace) -> psycopg.Connection:
    """A connection to the command's database, with no environment check."""
    from everystep.config import port_problem  # noqa: PLC0415

    url = database_url(args)
    try:
        problem = port_problem(url)
    except psycopg.ProgrammingError as exc:  # a malformed URL
        raise CliError(f"bad database URL: {first_line(exc)}") from None
    if problem:
        raise CliError(f"bad database URL: {problem}")
    try:
        return psycopg.connect(url, autocommit=True, connect_timeout=10)
    except psycopg.OperationalError as exc:
        raise CliError(f"cannot reach the database: {first_line(exc)}", EXIT_DATABASE) from None
    except psycopg.ProgrammingError as exc:  # a malformed URL
        raise CliError(f"bad database URL: {first_line(exc)}") from None


def connect(args: argparse.Namespace) -> psycopg.Connection:
    """A connection to the command's database, once its recorded environment
    is the expected one (else one line, exit 2, before anything is written).
    The environment found is kept in `args.environment_found`."""
    from everystep.cli import contexts  # noqa: PLC0415

    expected, why = expected_environment(args)
    conn = open_connection(args)
    try:
        args.environment_found = contexts.check(conn, expected, why)
    except BaseException:
        conn.close()
        raise
    return conn


def check_environment(args: argparse.Namespace) -> str | None:
    """For a command that connects by itself (a worker, the UI): refuse a
    database that is not the expected environment before it starts."""
    expected, _ = expected_environment(args)
    if expected is None:
        return None
    with connect(args):
        return args.environment_found


def acted_on(args: argparse.Namespace) -> None:
    """The line a command that changed something ends with: the environment
    it acted on, when the database records one."""
    found = getattr(args, "environment_found", None)
    if found:
        print(f"environment: {found}")


def load_run(conn: psycopg.Connection, run_id: uuid.UUID) -> dict:
    run = db.load_run(conn, run_id)
    if run is None:
        raise CliError(f"no run {run_id}")
    return run


def actor() -> operations.Actor:
    """Who acts, as the audit trail records it: $EVERYSTEP_OPERATOR, else
    the Unix user on this host (user@host)."""
    import getpass  # noqa: PLC0415
    import socket  # noqa: PLC0415

    named = os.environ.get("EVERYSTEP_OPERATOR", "").strip()
    if named:
        return operations.Actor(named, "cli")  # the person, where the OS user is shared (a bastion's "deploy")
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid {os.getuid()}"
    return operations.Actor(f"{user}@{socket.gethostname()}", "cli")


def audit(conn: psycopg.Connection, action: str, run: uuid.UUID | None = None, step_id: str | None = None,
          target: str | None = None, details: dict | None = None) -> None:
    """Record an action that is not one of everystep.operations' in the audit
    trail (everystep_audit). A database not migrated to it yet records nothing."""
    who = actor()
    try:
        db.audit(conn, who.name, who.source, action, run, step_id, target, details)
    except psycopg.errors.UndefinedTable:
        pass


# ---------------------------------------------------------------- argument types

def run_id_argument(text: str) -> uuid.UUID:
    try:
        return uuid.UUID(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a run id (a run id is a UUID)") from None


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")


def json_value_argument(text: str) -> Any:
    """A value in everystep's extended JSON: plain JSON, or the tagged
    encodings of the stored columns ({"$es": "date", "v": "2026-01-02"})."""
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid JSON ({exc})") from None
    try:
        return serde.from_json(data)
    except Exception as exc:  # a malformed tagged value, whatever it trips on
        raise argparse.ArgumentTypeError(f"{text!r} is not a valid everystep value ({first_line(exc)})") from None


def seconds_argument(zero: bool) -> Callable[[str], float]:
    """A finite number of seconds, > 0 (or >= 0 when `zero` is allowed)."""
    def parse(text: str) -> float:
        try:
            number = float(text)
        except ValueError:
            number = math.nan
        if not math.isfinite(number) or number < 0 or (number == 0 and not zero):
            raise argparse.ArgumentTypeError(f"expected a number of seconds {'>= 0' if zero else '> 0'}, not {text!r}")
        return number

    return parse


def whole_number_argument(low: int, high: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            number = int(text)
        except ValueError:
            number = None
        if number is None or number < low or (high is not None and number > high):
            bounds = f"from {low} to {high}" if high is not None else f"of at least {low}"
            raise argparse.ArgumentTypeError(f"expected a whole number {bounds}, not {text!r}")
        return number

    return parse


# ---------------------------------------------------------------- output

def utc(moment: dt.datetime | None) -> str:
    return "-" if moment is None else moment.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _plain(value: Any) -> Any:
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, dt.datetime):
        return value.astimezone(dt.UTC).isoformat()
    raise TypeError(f"cannot print a {type(value).__name__} as JSON")


def print_json(data: Any) -> None:
    print(json.dumps(data, default=_plain, ensure_ascii=False, indent=2))


def table(headers: Sequence[str], rows: list[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in (headers, *rows)) for i in range(len(headers))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in (headers, *rows)
    )


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"



def import_modules(names: Sequence[str]) -> None:
    for module in names:
        try:
            registry.import_module(module)
        except Exception as exc:
            raise CliError(f"cannot import {module}: {type(exc).__name__}: {exc}") from None


def output_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", choices=("text", "json"), default="text",
                        help="text for people (default), or one JSON document for scripts")
    parser.add_argument("--json", dest="output", action="store_const", const="json", help="the same as -o json")
