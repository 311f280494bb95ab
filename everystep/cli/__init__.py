"""The `everystep` operations CLI.

    everystep [--context NAME] COMMAND ...
    everystep migrate [--environment NAME [--force]]
    everystep runs list [--status S] [--workflow NAME] [--parent RUN] [--where K=V ...] [--limit N] [-o text|json]
    everystep runs cancel|requeue|rerun|resolve-step [--where K=V ...] [--workflow W] [--status S] [--since T]
        [--until T] (--dry-run | [--yes]) [--from-step STEP_ID] [--step STEP_ID --result JSON|--error MSG|--discard]
    everystep runs show RUN [-o text|json]
    everystep runs export RUN... | --workflow NAME [--status S] [--limit N] [-o FILE]
    everystep replay-check HISTORY [--imports MODULE ...] [-o text|json]
    everystep resolve-step RUN STEP (--result JSON | --error MSG | --discard)
    everystep requeue RUN...
    everystep cancel RUN... [--reason TEXT]
    everystep reschedule RUN...
    everystep rerun RUN... --from-step STEP_ID
    everystep prune --older-than DAYS [--dry-run]
    everystep schedule MODULE:FUNC [JSON ...] [--idempotency-key K] [--deadline SECONDS]
    everystep schedules plan|apply|retire|list [-o text|json]
    everystep worker --name NAME [--import MODULE ...]
    everystep maintenance [--interval S] [--grace S] [--max-crashes N]
    everystep ui [--bind ADDRESS] [--port N]
    everystep roles [--apply] [--prefix P] [--schema S]
    everystep dag list [--status S] | show KEY | cancel KEY | rerun KEY MEMBER [-o text|json]

Every action (resolve-step, requeue, cancel, reschedule, rerun, prune, schedule,
schedules apply and retire) is recorded in the audit trail, everystep_audit.
The actions on runs are everystep.operations' functions, the UI's too.

The database comes from --database-url, else --context NAME's url (the
contexts file: ~/.config/everystep/contexts.yaml or $EVERYSTEP_CONTEXTS),
else $EVERYSTEP_DATABASE_URL, else the `database.url` of `-c FILE`. With a
context's environment (or -c FILE's database.expected_environment), every
command refuses a database that records another environment, before it
writes anything (everystep/cli/contexts.py).

A command either does all it was asked or nothing: bad input and refusals are
found before anything is written, and reported as one line on stderr.

Exit codes: 0 success; 1 the command ran and refused (a run in the wrong
state, a claimer that is alive; replay-check: a run diverges; a schema a
newer everystep migrated) or the database rejected it; 2 bad input
(usage, a malformed id or JSON value, an unknown run, step, workflow or
module, a database of another environment); 3 the database is unreachable; 4 `schedules apply --plan-digest`
found the plan changed since it was reviewed (nothing written); 130
interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import psycopg

from everystep.cli import actions, admin, dags, history, processes, runs, schedules
from everystep.cli.common import EXIT_DATABASE, EXIT_REFUSED, EXIT_USAGE, CliError
from everystep.errors import DatabaseRefused
from everystep.logs import first_line

__all__ = ["CliError", "build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line and the exit code for bad input."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _database_options(parser: argparse.ArgumentParser, default: Any) -> None:
    parser.add_argument("--database-url", default=default,
                        help="PostgreSQL URL (default: $EVERYSTEP_DATABASE_URL, else -c FILE)")
    parser.add_argument("-c", "--config", default=default, help="everystep.yaml to take database.url from")
    parser.add_argument("--context", default=default, metavar="NAME",
                        help="take the database URL and the environment it must be from the context NAME of "
                             "~/.config/everystep/contexts.yaml (or $EVERYSTEP_CONTEXTS)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="everystep", description="Operate everystep runs on PostgreSQL.",
                     epilog="The commands: docs/operations.md. The keys of -c FILE: docs/running.md, "
                            "section Configuration.")
    _database_options(parser, None)
    # The same options after the command; SUPPRESS keeps them from resetting
    # what was given before it.
    database = argparse.ArgumentParser(add_help=False)
    _database_options(database, argparse.SUPPRESS)

    def add(commands: Any, name: str, fn: Callable[[argparse.Namespace], int] | None, help: str
            ) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help, parents=[database])
        if fn is not None:
            sub.set_defaults(func=fn)
        return sub

    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (admin, runs, history, actions, schedules, processes, dags):
        module.add_commands(commands, add)
    return parser


def _connection_lost(exc: psycopg.OperationalError) -> bool:
    # No SQLSTATE: the client lost the connection; 08: connection exception;
    # 57P: the server shut down or is starting.
    return exc.sqlstate is None or exc.sqlstate.startswith(("08", "57P"))



def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
        sys.stdout.flush()  # here, so a closed pipe is handled below
        return code
    except CliError as exc:
        message, code = str(exc), exc.code
    except DatabaseRefused as exc:
        message, code = str(exc), EXIT_REFUSED
    except psycopg.OperationalError as exc:
        message = f"database error: {first_line(exc)}"
        code = EXIT_DATABASE if _connection_lost(exc) else EXIT_REFUSED
    except psycopg.errors.UndefinedTable as exc:
        message, code = f"database error: {first_line(exc)} (run `everystep migrate` first?)", EXIT_REFUSED
    except psycopg.DataError as exc:
        message, code = f"the database refused a value: {first_line(exc)}", EXIT_USAGE
    except psycopg.Error as exc:
        message, code = f"database error: {first_line(exc)}", EXIT_REFUSED
    except BrokenPipeError:
        # The reader went away (`| head`): not an error; silence the final flush.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        message, code = "interrupted", 130
    print(f"everystep: {message}", file=sys.stderr)
    return code

