"""The database's upkeep: `everystep migrate`, `prune` and `roles`."""

from __future__ import annotations

import argparse
from typing import Any

from everystep import db
from everystep.cli import contexts
from everystep.cli.common import (
    Add,
    CliError,
    acted_on,
    actor,
    allow_newer_schema,
    audit,
    connect,
    expected_environment,
    load_config,
    open_connection,
    plural,
    whole_number_argument,
)

MAX_DAYS = 36500  # 100 years: the bound of --older-than


def add_commands(commands: Any, add: Add) -> None:
    migrate = add(commands, "migrate", cmd_migrate,
                  "apply the schema migrations (safe to run concurrently and repeatedly)")
    migrate.add_argument("--environment", metavar="NAME",
                         help="record which environment this database is (staging, production, ...): "
                              "commands whose --context expects another refuse to act on it")
    migrate.add_argument("--allow-newer-schema", action="store_true",
                         help="go on when a newer everystep migrated the schema (migrations this version does not "
                              "know), declaring it compatible (config: database.allow_newer_schema)")
    migrate.add_argument("--force", action="store_true",
                         help="with --environment: record it even though the database records another "
                              "(a copy of production restored as staging, say)")

    prune = add(commands, "prune", cmd_prune,
                "delete completed, failed, stopped and cancelled runs (with their steps) past their retention: "
                "the config's `retention:`, or --older-than")
    prune.add_argument("--older-than", type=whole_number_argument(1, MAX_DAYS), default=None,
                       metavar="DAYS", help="days since the run ended, for every end status (default: the config "
                       "file's retention: by end status)")
    prune.add_argument("--dry-run", action="store_true", help="only count what would be deleted")

    roles = add(commands, "roles", cmd_roles, "print the SQL of three least-privilege roles (producer, worker, "
                "operator), or apply it")
    roles.add_argument("--apply", action="store_true", help="run the SQL on the database instead of printing it")
    roles.add_argument("--prefix", type=_role_prefix, default="everystep_",
                       help="role name prefix (default everystep_)")
    roles.add_argument("--schema", type=_role_prefix, default=None,
                       help="schema of the everystep tables (default public)")


def cmd_migrate(args: argparse.Namespace) -> int:
    if args.environment is None:
        if args.force:
            raise CliError("--force only goes with --environment NAME")
        with connect(args) as conn:
            applied = db.migrate(conn, allow_newer_schema(args))
        print(f"applied {', '.join(applied)}" if applied else "nothing to apply: the schema is up to date")
        acted_on(args)
        return 0
    name = contexts.environment_name(args.environment, "--environment")
    expected, why = expected_environment(args)
    if expected is not None and expected != name:
        raise CliError(f"--environment {name}, but {why} expects {expected!r}: nothing done")
    with open_connection(args) as conn:
        recorded = db.recorded_environment(conn)
        if recorded is not None and recorded != name and not args.force:
            raise CliError(f"this database is recorded as {recorded!r}, not {name!r}: nothing done (if it is "
                           f"{name} now, a copy say, pass --force)")
        with conn.transaction():
            applied = db.migrate(conn, allow_newer_schema(args))
            if recorded != name:
                who = actor()
                db.record_environment(conn, name, who.name)
                db.audit(conn, who.name, who.source, "environment", target=name, details={"was": recorded})
    print(f"applied {', '.join(applied)}" if applied else "nothing to apply: the schema is up to date")
    print(f"environment: {name}" + ("" if recorded == name else
                                    f" (recorded now{f'; it was {recorded}' if recorded else ''})"))
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    """The retention by end status, now: `--older-than DAYS` for every end
    status, else the config file's `retention:`. Whole partitions of the
    history where every run is expired, batches of the rest."""
    from everystep import retention  # noqa: PLC0415

    if args.older_than is not None:
        policy = {status: args.older_than * 86400.0 for status in retention.RETAINED}
        what = f"completed, failed, stopped or cancelled more than {plural(args.older_than, 'day')} ago"
    else:
        policy = load_config(args.config).retention if getattr(args, "config", None) else {}
        if not policy:
            raise CliError("nothing to prune: give --older-than DAYS, or -c FILE with a `retention:` section")
        what = "past their retention (" + ", ".join(
            f"{status} {_duration(seconds)}" for status, seconds in policy.items()) + ")"
    with connect(args) as conn:
        if args.dry_run:
            count = sum(retention.count(conn, policy).values())
            print(f"would delete {plural(count, 'run')} {what}, with their steps (dry run: nothing deleted)")
            return 0
        applied = retention.apply(conn, policy)
        if args.older_than is not None:
            details = {"older_than_days": args.older_than, "deleted": applied.removed}
        else:
            details = {"retention": policy, "deleted": applied.removed, "dropped_partitions": applied.dropped_weeks}
        audit(conn, "prune", details=details)
    dropped = (f" ({plural(applied.dropped, 'run')} in {plural(applied.dropped_weeks, 'dropped weekly partition')})"
               if applied.dropped_weeks else "")
    print(f"deleted {plural(applied.removed, 'run')} {what}, with their steps{dropped}")
    acted_on(args)
    return 0


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def cmd_roles(args: argparse.Namespace) -> int:
    """Print (or apply) the SQL of the producer, worker and operator roles."""
    from everystep import roles  # noqa: PLC0415

    text = roles.sql_text(args.prefix, args.schema)
    if not args.apply:
        print(text)
        return 0
    with connect(args) as conn:
        conn.execute(text)  # one transaction: the SQL has its BEGIN and COMMIT
    print(f"applied the roles {', '.join(roles.role_names(args.prefix))}")
    acted_on(args)
    return 0


def _role_prefix(text: str) -> str:
    if not text or len(text) > 40 or not (text[0].isalpha() or text[0] == "_") or \
            not all(ch.isalnum() or ch == "_" for ch in text) or not text.isascii():
        raise argparse.ArgumentTypeError(f"expected letters, digits and '_' (at most 40), not {text!r}")
    return text.lower()

