"""`everystep runs list|show|export` and `everystep schedule`: reading runs
(and writing them out as a history for `everystep replay-check`), and
scheduling one."""

from __future__ import annotations

import argparse
import datetime as dt
import inspect
import json
import sys
from collections.abc import Callable
from typing import Any

import psycopg

from everystep import api, db, history, registry, serde
from everystep.attributes import find_runs
from everystep.cli import bulk
from everystep.cli.common import (
    Add,
    CliError,
    acted_on,
    audit,
    connect,
    json_value_argument,
    load_run,
    output_option,
    plural,
    print_json,
    run_id_argument,
    seconds_argument,
    table,
    utc,
    whole_number_argument,
)
from everystep.errors import EverystepError

STATUSES = ("scheduled", "waiting", "running", "completed", "failed", "stopped", "blocked", "cancelled")


def add_commands(commands: Any, add: Add) -> None:
    runs = add(commands, "runs", None, "list runs, or show one with its steps")
    runs_commands = runs.add_subparsers(dest="runs_command", required=True, metavar="COMMAND")
    listing = add(runs_commands, "list", cmd_runs_list, "list runs, newest first")
    listing.add_argument("--status", choices=STATUSES, help="only runs in this status")
    listing.add_argument("--workflow", metavar="NAME", help="only runs of this workflow (module.qualname)")
    listing.add_argument("--parent", type=run_id_argument, metavar="RUN", help="only the child runs of this run")
    bulk.where_option(listing)
    listing.add_argument("--limit", type=whole_number_argument(1), default=50, metavar="N",
                         help="at most N runs (default 50)")
    output_option(listing)
    show = add(runs_commands, "show", cmd_runs_show, "show a run and its recorded steps")
    show.add_argument("run", type=run_id_argument, metavar="RUN")
    output_option(show)
    export = add(runs_commands, "export", cmd_runs_export,
                 "write runs with their recorded steps as a history, for `everystep replay-check`")
    export.add_argument("runs", type=run_id_argument, nargs="*", metavar="RUN", help="the runs (or a filter)")
    export.add_argument("--workflow", metavar="NAME", help="the newest runs of this workflow (module.qualname)")
    export.add_argument("--status", choices=STATUSES, help="the newest runs in this status")
    export.add_argument("--limit", type=whole_number_argument(1), default=100, metavar="N",
                        help="with a filter, at most N runs (default 100)")
    export.add_argument("-o", "--output", default="-", metavar="FILE", help="the file to write (default: stdout)")

    bulk.add_bulk_commands(runs_commands, add)

    schedule = add(commands, "schedule", cmd_schedule, "schedule a run of a workflow")
    schedule.add_argument("target", metavar="MODULE:FUNC", help="the @workflow, e.g. myapp.workflows:provision_vm")
    schedule.add_argument("values", type=json_value_argument, nargs="*", metavar="JSON",
                          help="each one positional argument, in everystep's JSON")
    schedule.add_argument("--idempotency-key", metavar="K", help="return the existing run of this workflow and key")
    schedule.add_argument("--deadline", type=seconds_argument(zero=False), metavar="SECONDS",
                          help="cancel the run (reason: deadline) if not finished this many seconds from now")
    schedule.add_argument("--priority", type=int, metavar="N",
                          help="-100..100, higher runs first (default: the workflow's, else 0)")
    schedule.add_argument("--concurrency-key", metavar="K", help="its fair queue's key (concurrency_per_key)")


def cmd_runs_list(args: argparse.Namespace) -> int:
    # MODULE:FUNC (as `schedule` takes it) names the same workflow as module.FUNC.
    name = args.workflow.replace(":", ".") if args.workflow else None
    if args.where:
        return _runs_where(args, name)
    with connect(args) as conn:
        runs = db.list_runs(conn, args.status, name, args.limit + 1, args.parent)
        if not runs and name is not None:
            _known_workflow(conn, name)
    more, runs = len(runs) > args.limit, runs[: args.limit]
    if args.output == "json":
        print_json(runs)
        return 0
    if not runs:
        print("no runs")
        return 0
    print(table(
        ("ID", "STATUS", "WORKFLOW", "CREATED", "ENDED", "CLAIMED BY"),
        [(str(run["id"]), run["status"], run["name"], utc(run["created_at"]), utc(run["completed_at"]),
          run["claimed_by"] or "-") for run in runs],
    ))
    if more:
        print(f"(the newest {args.limit}; more runs match: raise --limit)")
    return 0


def _runs_where(args: argparse.Namespace, name: str | None) -> int:
    """`runs list --where K=V ...`: the runs with those attributes (and the
    other filters), newest first, with their attributes."""
    if args.parent is not None:
        raise CliError("runs list: --where and --parent do not go together")
    with connect(args) as conn:
        try:
            runs = find_runs(workflow=name, status=args.status, attributes=dict(args.where), limit=args.limit + 1,
                             conn=conn)
        except EverystepError as exc:
            raise CliError(str(exc)) from None
    more, runs = len(runs) > args.limit, runs[: args.limit]
    if args.output == "json":
        print_json([run._asdict() for run in runs])
        return 0
    if not runs:
        print("no runs")
        return 0
    print(table(
        ("ID", "STATUS", "WORKFLOW", "CREATED", "ENDED", "ATTRIBUTES"),
        [(str(run.id), run.status, run.workflow, utc(run.created_at), utc(run.completed_at),
          _json_text(run.attributes)) for run in runs],
    ))
    if more:
        print(f"(the newest {args.limit}; more runs match: raise --limit)")
    return 0


def _known_workflow(conn: psycopg.Connection, name: str) -> None:
    """A workflow filter that matches nothing: bad input (exit 2) when no
    run ever had the name and no module defines a workflow of it (a typo),
    rather than an empty list."""
    if db.list_runs(conn, None, name, 1):
        return
    try:
        registry.resolve(name)
    except Exception:  # ImportError, TypeError, whatever importing the module raises
        raise CliError(f"--workflow {name}: no run has that name and no module defines a workflow of it "
                       "(a module.qualname, e.g. myapp.workflows.provision_vm)") from None


def cmd_runs_show(args: argparse.Namespace) -> int:
    with connect(args) as conn:
        # One snapshot, so the steps shown are the steps of the run shown.
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        conn.read_only = True
        with conn.transaction():
            run = load_run(conn, args.run)
            steps = db.load_steps(conn, args.run)
            children = db.children(conn, args.run)
            messages = db.load_messages(conn, args.run)
            events = db.load_events(conn, args.run)
            now = db.database_now(conn)
    if args.output == "json":
        if run.get("attributes") is None:
            run.pop("attributes", None)  # shown only for a run that has attributes
        print_json({**run, "steps": steps, "children": children, "messages": messages, "events": events})
        return 0
    fields = [
        ("run", str(run["id"])),
        ("workflow", run["name"]),
        ("status", run["status"]),
        ("claimed by", run["claimed_by"] or "-"),
        ("idempotency key", run["idempotency_key"] or "-"),
        *([("priority", str(run["priority"]))] if run.get("priority") else []),  # shown when not the default, 0
        *([("concurrency key", run["concurrency_key"])] if run.get("concurrency_key") else []),
        ("created", utc(run["created_at"])),
        ("ended", utc(run["completed_at"])),
        ("args", _json_text(run["args"])),
        *([("attributes", _json_text(run["attributes"]))] if run.get("attributes") else []),
    ]
    if run["status"] == "waiting":
        fields.append(("due", utc(run["due_at"])))
    if run["parent_id"] is not None:
        fields.append(("parent", str(run["parent_id"])))
    if children:
        ended = sum(1 for child in children if child["status"] in db.TERMINAL)
        fields.append(("children", f"{len(children)} ({ended} ended): `everystep runs list --parent {run['id']}`"
                       if len(children) > 5 else ", ".join(f"{c['id']} {c['status']}" for c in children)))
    if messages:
        waiting = sum(1 for m in messages if m["consumed_by"] is None)
        fields.append(("messages", f"{len(messages)} received, {waiting} not consumed yet"))
    for event in events:
        fields.append((f"event {event['key']}"[:15], _json_text(event["value"])))
    if run["deadline_at"] is not None:
        fields.append(("deadline", f"{utc(run['deadline_at'])} ({_until(run['deadline_at'], run, now)})"))
    timed_out = _timed_out(steps)
    if timed_out:
        count = sum(timed_out.values())
        fields.append(("timeouts", f"{count} step attempt{'s' if count > 1 else ''} timed out"
                                   f" ({', '.join(f'step {k}' for k in timed_out)})"))
    if run["cancel_requested_at"] is not None or run["cancel_reason"]:
        # (A run its deadline cancelled at its end has the reason, no request.)
        fields.append(("cancel", (f"requested {utc(run['cancel_requested_at'])}" if run["cancel_requested_at"]
                                  else "at its end")
                                 + (f": {run['cancel_reason']}" if run["cancel_reason"] else "")))
    if run["status"] in ("completed", "cancelled") and run["result"] is not None:
        fields.append(("result", _json_text(run["result"])))
    if run["error"] is not None:
        fields.append(("error", _describe_error(run["error"])))
    for label, value in fields:
        print(f"{label:<16}{value}")
    print()
    if not steps:
        print("no steps recorded")
    else:
        print(table(("STEP", "STATUS", "FUNCTION", "ARGS", "RESULT OR ERROR"), [_step_row(s) for s in steps]))
        for step in steps:
            for attempt in step["attempts"] or []:
                print(f"  step {step['step_id']} attempt {attempt['attempt']} failed at {_epoch_utc(attempt['at'])}:"
                      f" {_describe_error(attempt['error'])}; retry at {_epoch_utc(attempt['retry_at'])}")
    started = [s["step_id"] for s in steps if s["status"] == "started"]
    if run["status"] == "blocked" and started:
        print()
        print(f"blocked on step {started[0]}: resolve it with `everystep resolve-step {run['id']} {started[0]}` and"
              " --result JSON (it happened), --error MSG (it happened and failed) or --discard (it did not)")
    return 0


def cmd_runs_export(args: argparse.Namespace) -> int:
    if not args.runs and args.workflow is None and args.status is None:
        raise CliError("runs export takes run ids, or a filter: --workflow NAME, --status S")
    with connect(args) as conn:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ  # one snapshot of all the runs
        conn.read_only = True
        run_ids = list(args.runs)
        if args.workflow is not None or args.status is not None:
            name = args.workflow.replace(":", ".") if args.workflow else None
            listed = db.list_runs(conn, args.status, name, args.limit)
            if not listed and name is not None:
                _known_workflow(conn, name)
            run_ids += [run["id"] for run in listed if run["id"] not in run_ids]
        try:
            document = history.export(conn, run_ids)
        except LookupError as exc:
            raise CliError(str(exc)) from None
    text = json.dumps(document, ensure_ascii=False, indent=1)
    if args.output == "-":
        print(text)
    else:
        with open(args.output, "w", encoding="utf-8") as out:
            out.write(text + "\n")
        print(f"exported {plural(len(document['runs']), 'run')} to {args.output}", file=sys.stderr)
    return 0


def _step_row(step: dict) -> tuple[str, ...]:
    args = _json_text(step["args"]) + (f" {_json_text(step['kwargs'])}" if step["kwargs"] else "")
    if step["name"] == "everystep.sleep" and step["status"] == "done":
        outcome = f"wakes at {_epoch_utc(step['result'])}"
    elif step["status"] == "done":
        outcome = _json_text(step["result"])
    elif step["status"] == "retrying":
        outcome = f"(retrying after {plural(len(step['attempts'] or []), 'failed attempt')})"
    elif step["status"] == "failed":
        outcome = _describe_error(step["error"])
    else:
        outcome = "(started; outcome unknown)"
    return step["step_id"], step["status"], step["name"], args, outcome


def _until(deadline: dt.datetime, run: dict, now: dt.datetime) -> str:
    """How a run stands against its deadline (database time)."""
    if run["status"] in db.TERMINAL:
        return "met" if run["completed_at"] is not None and run["completed_at"] < deadline \
            and run["cancel_reason"] != "deadline" else "passed"
    left = (deadline - now).total_seconds()
    if left <= 0:
        return "passed"
    if left < 120:
        return f"in {left:.0f} s"
    if left < 7200:
        return f"in {left / 60:.0f} min"
    return f"in {left / 3600:.1f} h"


def _timed_out(steps: list[dict]) -> dict[str, int]:
    """The steps with attempts that timed out (StepTimeout), and how many each."""
    counts: dict[str, int] = {}
    for step in steps:
        errors = [a["error"] for a in step["attempts"] or []]
        if step["status"] == "failed":
            errors.append(step["error"])
        n = sum(1 for error in errors if isinstance(error, dict) and error.get("type") == STEP_TIMEOUT)
        if n:
            counts[step["step_id"]] = n
    return counts


STEP_TIMEOUT = "everystep.errors.StepTimeout"


def _epoch_utc(seconds: float) -> str:
    """Epoch seconds (database time) as UTC, to the millisecond."""
    return dt.datetime.fromtimestamp(seconds, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ").replace("000Z", "Z")


def _json_text(data: Any) -> str:
    """Stored JSON as one line."""
    return json.dumps(data, ensure_ascii=False)


def _describe_error(error: Any) -> str:
    """An encoded exception as `module.Class: message`, with its args when
    they say more than the message (a Terminal's payload)."""
    if not isinstance(error, dict) or "type" not in error:
        return _json_text(error)
    message = str(error.get("message", "")).replace("\r", "\\r").replace("\n", "\\n")
    args = error.get("args", [])
    extra = f" (args: {_json_text(args)})" if args not in ([], [error.get("message")]) else ""
    return f"{error['type']}: {message}{extra}"



def cmd_schedule(args: argparse.Namespace) -> int:
    workflow_fn = _import_workflow(args.target)
    signature = inspect.signature(workflow_fn)
    try:
        signature.bind(*args.values)  # before anything is written: a run that could never start is bad input
    except TypeError as exc:
        raise CliError(f"{args.target}{signature}: {exc} (given {plural(len(args.values), 'value')})") from None
    with connect(args) as conn:
        try:
            with api.transaction(conn):
                run = api.schedule(workflow_fn, *args.values, idempotency_key=args.idempotency_key,
                                   deadline=args.deadline, priority=args.priority,
                                   concurrency_key=args.concurrency_key)
                if not run.created:
                    _same_arguments(conn, run, args)
                if run.created:
                    details = {"args": serde.to_json(list(args.values)), "idempotency_key": args.idempotency_key}
                    if args.deadline is not None:
                        details["deadline"] = args.deadline
                    audit(conn, "schedule", run.id, target=run.name, details=details)
        except EverystepError as exc:
            raise CliError(str(exc)) from None
    if run.created:
        print(f"created run {run.id} of {run.name}")
    else:
        print(f"existing run {run.id} of {run.name} has the idempotency key {args.idempotency_key!r};"
              " nothing scheduled")
    acted_on(args)
    return 0


def _same_arguments(conn: psycopg.Connection, run: api.ScheduledRun, args: argparse.Namespace) -> None:
    """A reused idempotency key with other arguments: bad input, not a silent
    "existing run" (the run the key names will not do what was asked)."""
    existing = load_run(conn, run.id)["args"]
    given = json.loads(serde.dumps(list(args.values)))
    if existing != given:
        raise CliError(f"existing run {run.id} of {run.name} has the idempotency key {args.idempotency_key!r} "
                       f"with other arguments ({_json_text(existing)[:200]}, not {_json_text(given)[:200]}); "
                       "nothing scheduled")


def _import_workflow(target: str) -> Callable:
    try:
        return registry.import_target(target)
    except registry.TargetError as exc:
        raise CliError(str(exc)) from None

