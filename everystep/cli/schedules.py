"""`everystep schedules plan|apply|retire|list`: the recurring schedules, with
the schedules: section of everystep.yaml as the manifest."""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

import psycopg

from everystep import db, scheduler
from everystep.cli.common import (
    EXIT_PLAN_CHANGED,
    EXIT_REFUSED,
    Add,
    CliError,
    acted_on,
    audit,
    connect,
    load_config,
    output_option,
    print_json,
    table,
)


def add_commands(commands: Any, add: Add) -> None:
    """`everystep schedules plan|apply|retire|list`."""
    group = add(commands, "schedules", None, "manage recurring schedules: the schedules: section of everystep.yaml "
                "is the manifest; plan shows what apply would write")
    actions = group.add_subparsers(dest="schedules_command", required=True, metavar="ACTION")
    plan = add(actions, "plan", cmd_schedules_plan, "show what apply would add, change and leave, the live keys "
               "of the file's source it no longer has, and the plan's digest (read-only)")
    output_option(plan)
    apply = add(actions, "apply", cmd_schedules_apply, "write the file's schedules; keys no longer in the file keep "
                "firing until retired")
    apply.add_argument("--plan-digest", metavar="DIGEST", type=_plan_digest,
                       help=f"apply only if the plan is still the one `plan` printed this digest for; else write "
                            f"nothing, show the plan now and exit {EXIT_PLAN_CHANGED}")
    output_option(apply)
    retire = add(actions, "retire", cmd_schedules_retire, "retire a schedule of your source: it never fires again")
    retire.add_argument("key")
    retire.add_argument("--source", help="the source that owns the key (default: the source of -c FILE's "
                                         f"schedules, else {scheduler.DEFAULT_SOURCE})")
    retire.add_argument("--force", action="store_true", help="retire it whichever source owns it")
    output_option(retire)
    listing = add(actions, "list", cmd_schedules_list, "list the schedules: state, source, timing, next and last "
                  "fire, last run")
    listing.add_argument("--all", action="store_true", help="include retired schedules")
    listing.add_argument("--source", help="only the schedules of this source")
    output_option(listing)


def _plan_digest(text: str) -> str:
    if not re.fullmatch(r"sha256:[0-9a-f]{64}", text):
        raise argparse.ArgumentTypeError(f"{text[:80]!r} is not a plan digest (sha256: and 64 hex digits, as "
                                         "`everystep schedules plan` prints it)")
    return text


def cmd_schedules_plan(args: argparse.Namespace) -> int:
    manifest = _schedules_manifest(args)  # validated before the database is touched
    with _schedules_database(args) as conn:
        plan = _refused_as_cli_error(lambda: scheduler.plan(conn, manifest))
    _print_plan(args, plan, done=False)
    return 0


def cmd_schedules_apply(args: argparse.Namespace) -> int:
    manifest = _schedules_manifest(args)
    with _schedules_database(args) as conn:
        try:
            plan = _refused_as_cli_error(lambda: scheduler.apply(conn, manifest, args.plan_digest))
        except scheduler.PlanChanged as changed:
            _print_plan(args, changed.plan, done=False, expected_digest=args.plan_digest)
            raise CliError(str(changed), EXIT_PLAN_CHANGED) from None
        audit(conn, "schedules-apply", target=str(args.config),
               details={e.key: e.action for e in plan.entries if e.action != "unchanged"})
    _print_plan(args, plan, done=True, expected_digest=args.plan_digest)
    return 0


def cmd_schedules_retire(args: argparse.Namespace) -> int:
    if args.source is not None:
        source = _source_option(args.source)
    elif args.config:
        source = load_config(args.config).schedules.source  # its workflow may be gone: that is why it retires
    else:
        source = scheduler.DEFAULT_SOURCE
    with _schedules_database(args) as conn:
        owner_required = None if args.force else source
        retired_at = _refused_as_cli_error(lambda: db.retire_schedule(conn, args.key, owner_required))
        owner = db.load_schedule(conn, args.key)["source"]
        audit(conn, "schedules-retire", target=args.key, details={"source": owner, "forced": args.force})
    if args.output == "json":
        print_json({"key": args.key, "source": owner, "retired_at": retired_at, "forced": args.force,
                    **_environment(args)})
        return 0
    print(f"retired {args.key}{'' if owner == source else f' (of source {owner})'} at "
          f"{scheduler.iso_utc(retired_at)}: it will not fire again "
          "(remove it from the file too, or the next apply brings it back)")
    acted_on(args)
    return 0


def cmd_schedules_list(args: argparse.Namespace) -> int:
    with _schedules_database(args) as conn:
        rows = [row for row in db.load_schedules(conn) if (args.all or row["retired_at"] is None)
                and (args.source is None or row["source"] == args.source)]
    if args.output == "json":
        print_json({"schedules": [_schedule_document(row) for row in rows]})
        return 0
    if not rows:
        print("no schedules" if args.all else "no live schedules")
        return 0
    lines = []
    for row in rows:
        state = scheduler.state_of(row)
        last_run = f"{row['last_run_id']} {row['last_run_status']}" if row["last_run_id"] else "-"
        lines.append((row["key"], state, row["source"], row["cron"], row["timezone"], row["workflow"],
                      scheduler.iso_utc(row["next_fire_at"]) if state == "active" else "-",
                      scheduler.iso_utc(row["last_fire_at"]) if row["last_fire_at"] else "-", last_run))
    print(table(("KEY", "STATE", "SOURCE", "CRON", "TIMEZONE", "WORKFLOW", "NEXT FIRE", "LAST FIRE", "LAST RUN"),
                lines))
    for row in rows:
        if row["paused_reason"] and row["paused"]:
            print(f"{row['key']}: {row['paused_reason']}")
        if row["last_error"]:
            print(f"{row['key']}: {row['last_error']}")
    return 0


# The fields of `schedules list -o json`, in order.
_SCHEDULE_FIELDS = ("key", "state", "source", "version", "workflow", "args", "cron", "timezone", "catchup",
                    "max_catchup", "overlap", "max_lateness_seconds", "paused", "auto_pause_after", "paused_reason",
                    "next_fire_at", "last_fire_at", "last_run_id", "last_run_status", "last_error", "created_at",
                    "updated_at", "retired_at")


def _schedule_document(row: dict) -> dict:
    return {name: scheduler.state_of(row) if name == "state" else row[name] for name in _SCHEDULE_FIELDS}


def _source_option(text: str) -> str:
    from everystep.config import ConfigError, read_source  # noqa: PLC0415

    try:
        return read_source("--source", text)
    except ConfigError as exc:
        raise CliError(str(exc)) from None


def _refused_as_cli_error(action: Callable[[], Any]) -> Any:
    try:
        return action()
    except db.ScheduleRefused as refused:
        raise CliError(str(refused), EXIT_REFUSED) from None


def _schedules_manifest(args: argparse.Namespace) -> scheduler.Manifest:
    """The schedules of -c FILE, validated before anything is read or written."""
    from everystep.config import ConfigError, check_workflows  # noqa: PLC0415

    if not args.config:
        raise CliError(f"schedules {args.schedules_command} needs the manifest: -c everystep.yaml")
    config = load_config(args.config)
    try:
        warnings = check_workflows(config)  # a schedule that could only fire failing runs is bad input
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    for warning in warnings:
        print(f"everystep: warning: {warning}", file=sys.stderr)
    return config.schedules


@contextlib.contextmanager
def _schedules_database(args: argparse.Namespace) -> Iterator[psycopg.Connection]:
    with connect(args) as conn:
        try:
            yield conn
        except psycopg.errors.UndefinedTable:
            raise CliError("this database has no schedule table: run `everystep migrate` first",
                           EXIT_REFUSED) from None
        except psycopg.errors.UndefinedColumn:
            raise CliError("this database's schedule table is older than this everystep: run `everystep migrate` "
                           "first", EXIT_REFUSED) from None


_PLAN_MARKS = {"add": "+", "revive": "+", "change": "~", "unchanged": "=", "not_in_file": "!"}
_PLAN_WORDS = {"add": "to add", "revive": "to revive", "change": "to change", "unchanged": "unchanged",
               "not_in_file": "not in the file"}
_APPLIED_WORDS = {**_PLAN_WORDS, "add": "added", "revive": "revived", "change": "changed"}


def _print_plan(args: argparse.Namespace, plan: scheduler.Plan, done: bool, expected_digest: str | None = None
                ) -> None:
    counts = {action: sum(e.action == action for e in plan.entries) for action in _PLAN_WORDS}
    if args.output == "json":
        document = {"source": plan.source, "digest": plan.digest, "entries": [_plan_entry_document(e)
                                                                              for e in plan.entries],
                    "counts": counts}
        if args.schedules_command == "apply":
            document = {"applied": done, "expected_digest": expected_digest, **document, **_environment(args)}
        print_json(document)
        return
    for entry in plan.entries:
        print(f"{_PLAN_MARKS[entry.action]} {entry.key}: {_describe_plan_entry(entry)}")
    words = _APPLIED_WORDS if done else _PLAN_WORDS
    summary = [f"{counts[action]} {word}" for action, word in words.items() if counts[action]]
    print(f"{'applied' if done else 'plan'}: {', '.join(summary) or 'no schedules in the file or the database'}"
          f" (source {plan.source})")
    print(f"digest: {plan.digest}")
    if done:
        acted_on(args)


def _environment(args: argparse.Namespace) -> dict:
    """The environment a change acted on, for its JSON document: when the database records one."""
    found = getattr(args, "environment_found", None)
    return {"environment": found} if found else {}


def _plan_entry_document(entry: scheduler.PlanEntry) -> dict:
    return {
        "key": entry.key,
        "action": entry.action,
        "changes": {name: {"from": old, "to": new} for name, (old, new) in entry.changes.items()},
        "next_fire_at": entry.next_fire_at,
        "paused": entry.paused,
        "version": entry.version,
        "paused_reason": entry.paused_reason,
    }


def _describe_plan_entry(entry: scheduler.PlanEntry) -> str:
    changes = "; ".join(f"{name} {_plan_value(old)} -> {_plan_value(new)}" for name, (old, new) in
                        entry.changes.items())
    next_fire = " (paused)" if entry.paused else f" (next fire {scheduler.iso_utc(entry.next_fire_at)})"
    if entry.paused_reason and entry.action in ("change", "unchanged"):
        changes += f" [it {entry.paused_reason}]"
    if entry.action == "add":
        return f"add{next_fire}"
    if entry.action == "revive":
        return f"revive the retired schedule{': ' + changes if changes else ''}{next_fire}"
    if entry.action == "change":
        return f"change {changes}{next_fire}"
    if entry.action == "unchanged":
        return f"unchanged{' ' + changes.strip() if changes else ''}"
    still = "still there, paused," if entry.paused else "still live: it keeps firing"
    return f"not in the file, {still} until retired (everystep schedules retire {entry.key})"


def _plan_value(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)

