"""The `everystep` operations CLI.

Exit codes: 0 success; 1 the command ran and refused (a run in the wrong
state, nothing to do where something was asked); 2 bad input (usage, a
malformed id or JSON, an unknown workflow); 3 the database is unreachable.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator

import psycopg

from everystep import scheduler, store

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


def cmd_migrate(args: argparse.Namespace) -> int:
    with connect(args) as conn:
        applied = store.migrate(conn)
    print(f"applied {', '.join(applied)}" if applied else "nothing to apply: the schema is up to date")
    return 0


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
    add_schedules_commands(commands)
    return parser


# ---------------------------------------------------------------- recurring schedules

def add_schedules_commands(commands: argparse._SubParsersAction) -> None:
    """`everystep schedules plan|apply|retire|list`."""
    group = commands.add_parser(
        "schedules", help="manage recurring schedules", description="Manage the recurring schedules: the "
        "schedules: section of everystep.yaml is the manifest; plan shows what apply would write."
    )
    actions = group.add_subparsers(dest="schedules_command", required=True, metavar="ACTION")

    def add(name: str, fn: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        sub = actions.add_parser(name, help=help, description=help)
        sub.set_defaults(func=fn)
        # SUPPRESS: absent here, it does not hide a -c given before the command.
        sub.add_argument("-c", "--config", default=argparse.SUPPRESS, help="everystep.yaml (the manifest)")
        return sub

    add("plan", cmd_schedules_plan, "show what apply would add, change and leave, and the live keys the file "
        "no longer has (read-only)")
    add("apply", cmd_schedules_apply, "write the file's schedules; keys no longer in the file keep firing "
        "until retired")
    add("retire", cmd_schedules_retire, "retire a schedule: it never fires again").add_argument("key")
    add("list", cmd_schedules_list, "list the schedules: state, timing, next and last fire, last run").add_argument(
        "--all", action="store_true", help="include retired schedules"
    )


def cmd_schedules_plan(args: argparse.Namespace) -> int:
    return _plan_or_apply(args, scheduler.plan, done=False)


def cmd_schedules_apply(args: argparse.Namespace) -> int:
    return _plan_or_apply(args, scheduler.apply, done=True)


def _plan_or_apply(args: argparse.Namespace, action: Callable[..., list[scheduler.PlanEntry]], done: bool) -> int:
    manifest = _schedules_manifest(args)  # validated before the database is touched
    with _schedules_database(args) as conn:
        entries = action(conn, manifest)
    _print_plan(entries, done)
    return 0


def cmd_schedules_retire(args: argparse.Namespace) -> int:
    with _schedules_database(args) as conn:
        try:
            retired_at = store.retire_schedule(conn, args.key)
        except store.ScheduleRefused as refused:
            raise CliError(str(refused), EXIT_REFUSED) from None
    print(f"retired {args.key} at {scheduler.iso_utc(retired_at)}: it will not fire again "
          "(remove it from the file too, or the next apply brings it back)")
    return 0


def cmd_schedules_list(args: argparse.Namespace) -> int:
    with _schedules_database(args) as conn:
        rows = [row for row in store.load_schedules(conn) if args.all or row["retired_at"] is None]
    if not rows:
        print("no schedules" if args.all else "no live schedules")
        return 0
    table = [("KEY", "STATE", "CRON", "TIMEZONE", "WORKFLOW", "NEXT FIRE", "LAST FIRE", "LAST RUN")]
    for row in rows:
        state = "retired" if row["retired_at"] else "paused" if row["paused"] else "active"
        last_run = f"{row['last_run_id']} {row['last_run_status']}" if row["last_run_id"] else "-"
        table.append((row["key"], state, row["cron"], row["timezone"], row["workflow"],
                      scheduler.iso_utc(row["next_fire_at"]) if state == "active" else "-",
                      scheduler.iso_utc(row["last_fire_at"]) if row["last_fire_at"] else "-", last_run))
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    for line in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip())
    for row in rows:
        if row["last_error"]:
            print(f"{row['key']}: {row['last_error']}")
    return 0


def _schedules_manifest(args: argparse.Namespace) -> dict:
    """The schedules of -c FILE, validated before anything is read or written."""
    if not args.config:
        raise CliError(f"schedules {args.schedules_command} needs the manifest: -c everystep.yaml")
    from supervisor.config import ConfigError, load  # noqa: PLC0415  (only with -c)

    try:
        return load(args.config).schedules
    except ConfigError as exc:
        raise CliError(str(exc)) from None


@contextlib.contextmanager
def _schedules_database(args: argparse.Namespace) -> Iterator[psycopg.Connection]:
    with connect(args) as conn:
        try:
            yield conn
        except psycopg.errors.UndefinedTable:
            raise CliError("this database has no schedule table: run `everystep migrate` first",
                           EXIT_REFUSED) from None


_PLAN_MARKS = {"add": "+", "revive": "+", "change": "~", "unchanged": "=", "not_in_file": "!"}
_PLAN_WORDS = {"add": "to add", "revive": "to revive", "change": "to change", "unchanged": "unchanged",
               "not_in_file": "not in the file"}
_APPLIED_WORDS = {**_PLAN_WORDS, "add": "added", "revive": "revived", "change": "changed"}


def _print_plan(entries: list[scheduler.PlanEntry], done: bool) -> None:
    for entry in entries:
        print(f"{_PLAN_MARKS[entry.action]} {entry.key}: {_describe_plan_entry(entry)}")
    words = _APPLIED_WORDS if done else _PLAN_WORDS
    counts = [f"{sum(e.action == action for e in entries)} {word}" for action, word in words.items()
              if any(e.action == action for e in entries)]
    print(f"{'applied' if done else 'plan'}: {', '.join(counts) or 'no schedules in the file or the database'}")


def _describe_plan_entry(entry: scheduler.PlanEntry) -> str:
    changes = "; ".join(f"{name} {_plan_value(old)} -> {_plan_value(new)}" for name, (old, new) in
                        entry.changes.items())
    next_fire = " (paused)" if entry.paused else f" (next fire {scheduler.iso_utc(entry.next_fire_at)})"
    if entry.action == "add":
        return f"add{next_fire}"
    if entry.action == "revive":
        return f"revive the retired schedule{': ' + changes if changes else ''}{next_fire}"
    if entry.action == "change":
        return f"change {changes}{next_fire}"
    if entry.action == "unchanged":
        return "unchanged"
    still = "still there, paused," if entry.paused else "still live: it keeps firing"
    return f"not in the file, {still} until retired (everystep schedules retire {entry.key})"


def _plan_value(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)


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
