"""`everystep runs list --where K=V` and the bulk actions by filter:
`everystep runs cancel|requeue|rerun|resolve-step` with --where, --workflow,
--status, --since, --until; --dry-run shows the count and the first 20
runs, --yes applies (needed for more than one run). Each is
everystep.operations.bulk: in chunks, resumable, audited."""

from __future__ import annotations

import argparse
import datetime as dt
from typing import Any

from everystep import operations
from everystep.attributes import STATUSES, parse_where
from everystep.cli.common import (
    EXIT_REFUSED,
    Add,
    CliError,
    acted_on,
    actor,
    connect,
    json_value_argument,
    plural,
)
from everystep.errors import EverystepError

_NOT_GIVEN: Any = object()  # `--result null` must not look like "not given"


def where_argument(text: str) -> tuple[str, str]:
    try:
        return parse_where(text)
    except EverystepError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--where ")) from None


def moment_argument(text: str) -> dt.datetime:
    """An ISO 8601 time; without an offset, UTC."""
    try:
        moment = dt.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 time (e.g. 2026-05-01T12:00Z): {text!r}") from None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=dt.UTC)


def where_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--where", type=where_argument, action="append", metavar="KEY=VALUE",
                        help="only runs with this attribute (repeatable: all of them); the value is read as "
                             "JSON when a number, true or false (order=42), else a string")


def add_bulk_commands(runs_commands: Any, add: Add) -> None:
    helps = {
        "cancel": "cancel the runs a filter finds (scheduled, waiting, blocked at once; running at their next step)",
        "requeue": "put the running runs a filter finds whose claimer is dead back to scheduled",
        "rerun": "re-run the ended runs a filter finds from a step",
        "resolve-step": "resolve the same started step of the blocked runs a filter finds",
    }
    for action, text in helps.items():
        sub = add(runs_commands, action, cmd_bulk, text)
        sub.set_defaults(action=action)
        where_option(sub)
        sub.add_argument("--workflow", metavar="NAME", help="only runs of this workflow (module.qualname)")
        sub.add_argument("--status", choices=STATUSES, help="only runs in this status")
        sub.add_argument("--since", type=moment_argument, metavar="TIME", help="only runs created at or after TIME")
        sub.add_argument("--until", type=moment_argument, metavar="TIME", help="only runs created before TIME")
        sub.add_argument("--dry-run", action="store_true", help="only show how many runs, and the first 20")
        sub.add_argument("--yes", action="store_true", help="act (needed when the filter finds more than one run)")
        if action == "cancel":
            sub.add_argument("--reason", metavar="TEXT", help="why (recorded with each run)")
        if action == "rerun":
            sub.add_argument("--from-step", required=True, metavar="STEP_ID", help="the step id to run again")
        if action == "resolve-step":
            sub.add_argument("--step", required=True, metavar="STEP_ID", help="the started step's id")
            outcome = sub.add_mutually_exclusive_group(required=True)
            outcome.add_argument("--result", type=json_value_argument, default=_NOT_GIVEN, metavar="JSON",
                                 help="the effect happened: record this result")
            outcome.add_argument("--error", metavar="MSG", help="the effect happened and failed with this message")
            outcome.add_argument("--discard", action="store_true",
                                 help="the effect did not happen: run the step again")


def run_filter(args: argparse.Namespace) -> dict:
    """The filter of the command line, as operations.bulk takes it (only what was given)."""
    given = {
        "workflow": args.workflow.replace(":", ".") if args.workflow else None,
        "status": args.status,
        "attributes": dict(args.where) if args.where else None,
        "since": getattr(args, "since", None),
        "until": getattr(args, "until", None),
    }
    return {key: value for key, value in given.items() if value is not None}


def cmd_bulk(args: argparse.Namespace) -> int:
    action = args.action
    f = run_filter(args)
    if not f:
        raise CliError(f"runs {action} needs a filter (--where, --workflow, --status, --since, --until): it never "
                       "acts on every run")
    how: dict[str, Any] = {}
    if action == "cancel":
        how["reason"] = args.reason
    elif action == "rerun":
        how["from_step"] = args.from_step
    elif action == "resolve-step":
        how["step"] = args.step
        if args.discard:
            how["discard"] = True
        elif args.error is not None:
            how["error"] = args.error
        else:
            how["result"] = args.result
    with connect(args) as conn:
        try:
            preview = operations.bulk(action, f, dry_run=True, actor=actor(), conn=conn, **how)
            if args.dry_run:
                _print_preview(action, preview)
                return 0
            if preview.count > 1 and not args.yes:
                raise CliError(f"runs {action} would act on {plural(preview.count, 'run')}: check them with "
                               "--dry-run, then add --yes", EXIT_REFUSED)
            outcome = operations.bulk(action, f, dry_run=False, actor=actor(), conn=conn, **how)
        except EverystepError as exc:
            raise CliError(str(exc)) from None
    resumed = " (carried on where an interrupted run of this command stopped)" if outcome.resumed else ""
    print(f"{action}: {plural(outcome.count, 'run')} found, {outcome.done} done, {outcome.refused} refused"
          f"{resumed}")
    acted_on(args)
    return 0


def _print_preview(action: str, preview: operations.BulkOutcome) -> None:
    print(f"{action} would act on {plural(preview.count, 'run')} (dry run: nothing done)")
    for run in preview.sample:
        print(run)
    if preview.count > len(preview.sample):
        print(f"... and {preview.count - len(preview.sample)} more")



