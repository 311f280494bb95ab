"""The `everystep` operations CLI.

    everystep migrate
    everystep runs list [--status S] [--workflow NAME] [--parent RUN] [--limit N] [-o text|json]
    everystep runs show RUN [-o text|json]
    everystep resolve-step RUN STEP (--result JSON | --error MSG | --discard)
    everystep requeue RUN...
    everystep cancel RUN... [--reason TEXT]
    everystep prune --older-than DAYS [--dry-run]
    everystep schedule MODULE:FUNC [JSON ...] [--idempotency-key K]
    everystep schedules plan|apply|retire|list [-o text|json]
    everystep worker --name NAME [--import MODULE ...]
    everystep ui [--bind ADDRESS] [--port N]
    everystep roles [--apply] [--prefix P] [--schema S]

Every action (resolve-step, requeue, prune, schedule, schedules apply and
retire) is recorded in the audit trail, everystep_audit.

The database comes from --database-url, else $EVERYSTEP_DATABASE_URL, else
the `database.url` of `-c FILE`.

A command either does all it was asked or nothing: bad input and refusals are
found before anything is written, and reported as one line on stderr.

Exit codes: 0 success; 1 the command ran and refused (a run in the wrong
state, a claimer that is alive) or the database rejected it; 2 bad input
(usage, a malformed id or JSON value, an unknown run, step, workflow or
module); 3 the database is unreachable; 4 `schedules apply --plan-digest`
found the plan changed since it was reviewed (nothing written); 130
interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import inspect
import json
import logging
import math
import os
import sys
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

import psycopg

from everystep import api, db, liveness, registry, scheduler, serde
from everystep.errors import EverystepError
from everystep.logs import first_line
from everystep.schema import MAX_KEY

log = logging.getLogger("everystep")

EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_DATABASE = 3
EXIT_PLAN_CHANGED = 4

STATUSES = ("scheduled", "waiting", "running", "completed", "failed", "stopped", "blocked", "cancelled")
MAX_DAYS = 36500  # 100 years: the bound of --older-than
MAX_RUNNER_NAME = MAX_KEY  # the width of claimed_by
PRUNE_BATCH = 1000  # runs deleted per transaction, so prune never holds locks for long


class CliError(Exception):
    """One clear line for stderr, and the exit code that goes with it."""

    def __init__(self, message: str, code: int = EXIT_USAGE):
        super().__init__(message)
        self.code = code


# ---------------------------------------------------------------- the database

def database_url(args: argparse.Namespace) -> str:
    """--database-url, else EVERYSTEP_DATABASE_URL, else -c FILE's database.url."""
    if args.database_url:
        return args.database_url
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


def connect(args: argparse.Namespace) -> psycopg.Connection:
    url = database_url(args)
    try:
        return psycopg.connect(url, autocommit=True, connect_timeout=10)
    except psycopg.OperationalError as exc:
        raise CliError(f"cannot reach the database: {first_line(exc)}", EXIT_DATABASE) from None
    except psycopg.ProgrammingError as exc:  # a malformed URL
        raise CliError(f"bad database URL: {first_line(exc)}") from None


def _load_run(conn: psycopg.Connection, run_id: uuid.UUID) -> dict:
    run = db.load_run(conn, run_id)
    if run is None:
        raise CliError(f"no run {run_id}")
    return run


def _audit(conn: psycopg.Connection, action: str, run: uuid.UUID | None = None, step_id: str | None = None,
           target: str | None = None, details: dict | None = None) -> None:
    """Record an action in the audit trail (everystep_audit), as the Unix
    user on this host. A database not migrated to it yet records nothing."""
    import getpass  # noqa: PLC0415
    import socket  # noqa: PLC0415

    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid {os.getuid()}"
    try:
        db.audit(conn, f"{user}@{socket.gethostname()}", "cli", action, run, step_id, target, details)
    except psycopg.errors.UndefinedTable:
        pass


# ---------------------------------------------------------------- argument types

def _run_id(text: str) -> uuid.UUID:
    try:
        return uuid.UUID(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a run id (a run id is a UUID)") from None


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")


def _json_value(text: str) -> Any:
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


def _seconds(zero: bool) -> Callable[[str], float]:
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


def _runner_name(text: str) -> str:
    if not 0 < len(text) <= MAX_RUNNER_NAME or not text.isprintable() or any(ch.isspace() for ch in text):
        raise argparse.ArgumentTypeError(
            f"expected 1 to {MAX_RUNNER_NAME} printable characters without whitespace, not {text!r}")
    return text


def _whole_number(low: int, high: int | None = None) -> Callable[[str], int]:
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

def _utc(moment: dt.datetime | None) -> str:
    return "-" if moment is None else moment.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


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


def _plain(value: Any) -> Any:
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, dt.datetime):
        return value.astimezone(dt.UTC).isoformat()
    raise TypeError(f"cannot print a {type(value).__name__} as JSON")


def _print_json(data: Any) -> None:
    print(json.dumps(data, default=_plain, ensure_ascii=False, indent=2))


def _table(headers: Sequence[str], rows: list[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in (headers, *rows)) for i in range(len(headers))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in (headers, *rows)
    )


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


# ---------------------------------------------------------------- commands

def cmd_migrate(args: argparse.Namespace) -> int:
    with connect(args) as conn:
        applied = db.migrate(conn)
    print(f"applied {', '.join(applied)}" if applied else "nothing to apply: the schema is up to date")
    return 0


def _import_modules(names: Sequence[str]) -> None:
    for module in names:
        try:
            registry.import_module(module)
        except Exception as exc:
            raise CliError(f"cannot import {module}: {type(exc).__name__}: {exc}") from None


def _workflow_pattern(text: str) -> str:
    from everystep.config import WORKFLOW_PATTERN  # noqa: PLC0415

    if len(text) > 300 or not WORKFLOW_PATTERN.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a workflow name pattern like myapp.gpu.* (letters, digits, '_', '.', '*', '?')")
    return text


def cmd_worker(args: argparse.Namespace) -> int:
    """Run one worker in this process until TERM/INT (drain) or QUIT (fast stop)."""
    from everystep import logs  # noqa: PLC0415
    from everystep.signals import stop_on_signals  # noqa: PLC0415
    from everystep.worker import Worker  # noqa: PLC0415

    logs.configure(args.log_level)
    url = database_url(args)
    direct_url = args.direct_url
    if direct_url is None and getattr(args, "config", None):
        direct_url = load_config(args.config).database.direct_url or None
    _import_modules(args.imports)
    worker = Worker(url, args.name, threads=args.threads, poll=args.poll, drain=args.drain, grace=args.grace,
                    max_crashes=args.max_crashes, workflows=args.workflows, direct_url=direct_url)
    stop_on_signals(worker)
    worker.run()
    sys.stdout.flush()
    # Steps still running past the drain deadline were requeued; do not wait for their threads.
    os._exit(0)



def cmd_maintenance(args: argparse.Namespace) -> int:
    """Run the dead-claimer sweep and the recurring schedules in this process
    until TERM, INT or QUIT. Options given win over -c FILE's recovery.*."""
    from everystep import logs  # noqa: PLC0415
    from everystep.config import RecoveryConfig  # noqa: PLC0415
    from everystep.maintenance import Maintenance  # noqa: PLC0415
    from everystep.signals import stop_on_signals  # noqa: PLC0415

    recovery, imports = RecoveryConfig(), list(args.imports)
    if getattr(args, "config", None):
        config = load_config(args.config)
        recovery, imports = config.recovery, [*config.imports, *args.imports]
    logs.configure(args.log_level)
    url = database_url(args)
    _import_modules(imports)
    maintenance = Maintenance(
        url,
        interval=recovery.interval if args.interval is None else args.interval,
        grace=recovery.grace if args.grace is None else args.grace,
        max_crashes=recovery.max_crashes if args.max_crashes is None else args.max_crashes,
    )
    stop_on_signals(maintenance)
    log.info(
        "maintenance: the dead-claimer sweep every %g s (grace %g s), the recurring schedules every second",
        maintenance.interval, maintenance.sweep.grace)
    maintenance.run()
    return 0

def cmd_runs_list(args: argparse.Namespace) -> int:
    # MODULE:FUNC (as `schedule` takes it) names the same workflow as module.FUNC.
    name = args.workflow.replace(":", ".") if args.workflow else None
    with connect(args) as conn:
        runs = db.list_runs(conn, args.status, name, args.limit + 1, args.parent)
    more, runs = len(runs) > args.limit, runs[: args.limit]
    if args.output == "json":
        _print_json(runs)
        return 0
    if not runs:
        print("no runs")
        return 0
    print(_table(
        ("ID", "STATUS", "WORKFLOW", "CREATED", "ENDED", "CLAIMED BY"),
        [(str(run["id"]), run["status"], run["name"], _utc(run["created_at"]), _utc(run["completed_at"]),
          run["claimed_by"] or "-") for run in runs],
    ))
    if more:
        print(f"(the newest {args.limit}; more runs match: raise --limit)")
    return 0


def cmd_runs_show(args: argparse.Namespace) -> int:
    with connect(args) as conn:
        # One snapshot, so the steps shown are the steps of the run shown.
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        conn.read_only = True
        with conn.transaction():
            run = _load_run(conn, args.run)
            steps = db.load_steps(conn, args.run)
            children = db.children(conn, args.run)
            messages = db.load_messages(conn, args.run)
            events = db.load_events(conn, args.run)
    if args.output == "json":
        _print_json({**run, "steps": steps, "children": children, "messages": messages, "events": events})
        return 0
    fields = [
        ("run", str(run["id"])),
        ("workflow", run["name"]),
        ("status", run["status"]),
        ("claimed by", run["claimed_by"] or "-"),
        ("idempotency key", run["idempotency_key"] or "-"),
        ("created", _utc(run["created_at"])),
        ("ended", _utc(run["completed_at"])),
        ("args", _json_text(run["args"])),
    ]
    if run["status"] == "waiting":
        fields.append(("due", _utc(run["due_at"])))
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
    if run["cancel_requested_at"] is not None:
        fields.append(("cancel", f"requested {_utc(run['cancel_requested_at'])}"
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
        print(_table(("STEP", "STATUS", "FUNCTION", "ARGS", "RESULT OR ERROR"), [_step_row(s) for s in steps]))
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


def _step_row(step: dict) -> tuple[str, ...]:
    args = _json_text(step["args"]) + (f" {_json_text(step['kwargs'])}" if step["kwargs"] else "")
    if step["name"] == "everystep.sleep" and step["status"] == "done":
        outcome = f"wakes at {_epoch_utc(step['result'])}"
    elif step["status"] == "done":
        outcome = _json_text(step["result"])
    elif step["status"] == "retrying":
        outcome = f"(retrying after {_plural(len(step['attempts'] or []), 'failed attempt')})"
    elif step["status"] == "failed":
        outcome = _describe_error(step["error"])
    else:
        outcome = "(started; outcome unknown)"
    return step["step_id"], step["status"], step["name"], args, outcome


# argparse tells options apart from their defaults by value: `--result null`
# (None) must not look like "not given", or it would not conflict with --discard.
_NOT_GIVEN: Any = object()


def cmd_resolve_step(args: argparse.Namespace) -> int:
    with connect(args) as conn:
        _load_run(conn, args.run)
        if db.step_row(conn, args.run, args.step) is None:
            raise CliError(f"run {args.run} has no step {args.step!r}")
        if args.discard:
            how, done = {"discard": True}, "discarded: the step will run again"
        elif args.error is not None:
            how, done = {"error": args.error}, f"recorded as failed with the error {args.error!r}"
        else:
            how, done = {"result": args.result}, f"recorded as done with the result {serde.dumps(args.result)}"
        try:
            api.resolve_step(conn, args.run, args.step, **how)
        except EverystepError as refused:
            raise CliError(str(refused), EXIT_REFUSED) from None
        _audit(conn, "resolve-step", args.run, args.step, details={k: serde.to_json(v) for k, v in how.items()})
    print(f"step {args.step!r} of run {args.run} {done}; the run is scheduled again")
    return 0


def cmd_requeue(args: argparse.Namespace) -> int:
    run_ids = list(dict.fromkeys(args.runs))
    with connect(args) as conn:
        runs = [_load_run(conn, run_id) for run_id in run_ids]
        refusals = [why for run in runs if (why := _why_not_requeued(run))]
        claimers = {run["claimed_by"] for run in runs if run["status"] == "running"}
        with liveness.dead_claimers_locked(conn, claimers) as dead:
            refusals += [
                f"run {run['id']} is running on {run['claimed_by']}, which holds its lock: the claimer is alive"
                for run in runs if run["status"] == "running" and run["claimed_by"] not in dead
            ]
            if refusals:
                raise CliError("; ".join(refusals) + ("; nothing was requeued" if len(runs) > 1 else ""),
                               EXIT_REFUSED)
            with conn.transaction():
                requeued = db.requeue_from_dead_claimers(conn, [(run["id"], run["claimed_by"]) for run in runs])
                if len(requeued) != len(runs):
                    changed = ", ".join(str(run["id"]) for run in runs if run["id"] not in requeued)
                    raise CliError(f"run {changed} changed while being requeued; nothing was requeued", EXIT_REFUSED)
                for run in runs:
                    _audit(conn, "requeue", run["id"], details={"claimer": run["claimed_by"]})
    for run in runs:
        why = f"its claimer {run['claimed_by']} is dead" if run["claimed_by"] is not None else "it had no claimer"
        print(f"requeued run {run['id']} ({why})")
    return 0


def _why_not_requeued(run: dict) -> str | None:
    """Why a run that is not `running` is not requeued (None for a running run)."""
    status = run["status"]
    if status == "scheduled":
        return f"run {run['id']} is scheduled: it needs nothing, a worker will claim it"
    if status == "waiting":
        return f"run {run['id']} is waiting for its time ({_utc(run['due_at'])}): a worker will claim it then"
    if status == "blocked":
        return f"run {run['id']} is blocked: resolve its started step with `everystep resolve-step`"
    if status in db.TERMINAL:
        return f"run {run['id']} is {status}: a finished run is never requeued; schedule it again"
    return None


def cmd_cancel(args: argparse.Namespace) -> int:
    run_ids = list(dict.fromkeys(args.runs))
    with connect(args) as conn:
        for run_id in run_ids:
            _load_run(conn, run_id)
        with api.transaction(conn):  # all or nothing
            statuses = {run_id: api.cancel(run_id, args.reason) for run_id in run_ids}
            finished = [f"run {run_id} is {status} already" for run_id, status in statuses.items()
                        if status not in ("cancelled", "running")]
            if finished:
                raise CliError("; ".join(finished) + ("; nothing was cancelled" if len(run_ids) > 1 else ""),
                               EXIT_REFUSED)
            for run_id, status in statuses.items():
                _audit(conn, "cancel", run_id, details={"reason": args.reason, "status": status})
    for run_id, status in statuses.items():
        if status == "running":
            print(f"asked run {run_id} to stop: it is running; it ends cancelled at its next step")
        else:
            print(f"cancelled run {run_id}")
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    what = f"completed, failed, stopped or cancelled more than {_plural(args.older_than, 'day')} ago"
    with connect(args) as conn:
        if args.dry_run:
            count = db.count_prunable(conn, args.older_than)
            print(f"would delete {_plural(count, 'run')} {what}, with their steps (dry run: nothing deleted)")
            return 0
        deleted = 0
        while batch := db.prune_batch(conn, args.older_than, PRUNE_BATCH):
            deleted += batch
        _audit(conn, "prune", details={"older_than_days": args.older_than, "deleted": deleted})
    print(f"deleted {_plural(deleted, 'run')} {what}, with their steps")
    return 0


def cmd_ui(args: argparse.Namespace) -> int:
    """Serve the operators' web UI in this process until TERM/INT."""
    from everystep import logs  # noqa: PLC0415
    from everystep.ui.core import Credentials, bind_problem  # noqa: PLC0415

    url = database_url(args)
    bind, port = args.bind, args.port
    viewer = os.environ.get("EVERYSTEP_UI_VIEWER_TOKEN", "")
    operator = os.environ.get("EVERYSTEP_UI_OPERATOR_TOKEN", "")
    if getattr(args, "config", None):
        from everystep.config import ConfigError, load  # noqa: PLC0415

        try:
            ui = load(args.config).ui
        except ConfigError as exc:
            raise CliError(str(exc)) from None
        if ui is not None:  # the file's ui: section, the command line's options first
            bind, port = bind or ui.bind, ui.port if port is None else port
            viewer, operator = ui.viewer_token or viewer, ui.operator_token or operator
    bind = bind or "127.0.0.1"
    problem = bind_problem(bind, viewer, operator, "set EVERYSTEP_UI_VIEWER_TOKEN and/or EVERYSTEP_UI_OPERATOR_TOKEN")
    if problem:
        raise CliError(problem)
    try:
        from everystep.ui import server  # noqa: PLC0415
    except ImportError as exc:
        raise CliError(f"the UI needs its libraries: pip install 'everystep[ui]' ({exc})") from None
    logs.configure(args.log_level)
    try:
        sock = server.bind(bind, 9118 if port is None else port)
    except OSError as exc:
        raise CliError(f"cannot listen on {bind}:{port}: {exc.strerror or exc}", EXIT_REFUSED) from None
    server.serve(sock, url, Credentials(viewer, operator))
    return 0


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
    return 0


def cmd_schedule(args: argparse.Namespace) -> int:
    workflow_fn = _import_workflow(args.target)
    signature = inspect.signature(workflow_fn)
    try:
        signature.bind(*args.values)  # before anything is written: a run that could never start is bad input
    except TypeError as exc:
        raise CliError(f"{args.target}{signature}: {exc} (given {_plural(len(args.values), 'value')})") from None
    with connect(args) as conn:
        try:
            with api.transaction(conn):
                run = api.schedule(workflow_fn, *args.values, idempotency_key=args.idempotency_key)
                if run.created:
                    _audit(conn, "schedule", run.id, target=run.name, details={"args": serde.to_json(list(args.values)),
                                                                               "idempotency_key": args.idempotency_key})
        except EverystepError as exc:
            raise CliError(str(exc)) from None
    if run.created:
        print(f"created run {run.id} of {run.name}")
    else:
        print(f"existing run {run.id} of {run.name} has the idempotency key {args.idempotency_key!r};"
              " nothing scheduled")
    return 0


def _import_workflow(target: str) -> Callable:
    try:
        return registry.import_target(target)
    except registry.TargetError as exc:
        raise CliError(str(exc)) from None


# ---------------------------------------------------------------- the parser

class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line and the exit code for bad input."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _output_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", choices=("text", "json"), default="text",
                        help="text for people (default), or one JSON document for scripts")
    parser.add_argument("--json", dest="output", action="store_const", const="json", help="the same as -o json")


def _database_options(parser: argparse.ArgumentParser, default: Any) -> None:
    parser.add_argument("--database-url", default=default,
                        help="PostgreSQL URL (default: $EVERYSTEP_DATABASE_URL, else -c FILE)")
    parser.add_argument("-c", "--config", default=default, help="everystep.yaml to take database.url from")


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
    add(commands, "migrate", cmd_migrate, "apply the schema migrations (safe to run concurrently and repeatedly)")

    runs = add(commands, "runs", None, "list runs, or show one with its steps")
    runs_commands = runs.add_subparsers(dest="runs_command", required=True, metavar="COMMAND")
    listing = add(runs_commands, "list", cmd_runs_list, "list runs, newest first")
    listing.add_argument("--status", choices=STATUSES, help="only runs in this status")
    listing.add_argument("--workflow", metavar="NAME", help="only runs of this workflow (module.qualname)")
    listing.add_argument("--parent", type=_run_id, metavar="RUN", help="only the child runs of this run")
    listing.add_argument("--limit", type=_whole_number(1), default=50, metavar="N",
                         help="at most N runs (default 50)")
    _output_option(listing)
    show = add(runs_commands, "show", cmd_runs_show, "show a run and its recorded steps")
    show.add_argument("run", type=_run_id, metavar="RUN")
    _output_option(show)

    resolve = add(commands, "resolve-step", cmd_resolve_step,
                  "say what happened to the started step of a blocked run, and schedule the run again")
    resolve.add_argument("run", type=_run_id, metavar="RUN")
    resolve.add_argument("step", metavar="STEP", help="the step id, e.g. 3 or charge or fan.0.1")
    outcome = resolve.add_mutually_exclusive_group(required=True)
    outcome.add_argument("--result", type=_json_value, default=_NOT_GIVEN, metavar="JSON",
                         help="the effect happened: record this result")
    outcome.add_argument("--error", metavar="MSG", help="the effect happened and failed with this message")
    outcome.add_argument("--discard", action="store_true", help="the effect did not happen: run the step again")

    requeue = add(commands, "requeue", cmd_requeue,
                  "put running runs whose claimer is dead back to scheduled")
    requeue.add_argument("runs", type=_run_id, nargs="+", metavar="RUN")

    cancel = add(commands, "cancel", cmd_cancel,
                 "cancel runs: scheduled, waiting and blocked ones at once, running ones at their next step")
    cancel.add_argument("runs", type=_run_id, nargs="+", metavar="RUN")
    cancel.add_argument("--reason", metavar="TEXT", help="why (recorded with the run, given to its Cancelled)")

    prune = add(commands, "prune", cmd_prune,
                "delete completed, failed, stopped and cancelled runs (with their steps) older than a bound")
    prune.add_argument("--older-than", type=_whole_number(1, MAX_DAYS), required=True,
                       metavar="DAYS", help="days since the run ended")
    prune.add_argument("--dry-run", action="store_true", help="only count what would be deleted")

    schedule = add(commands, "schedule", cmd_schedule, "schedule a run of a workflow")
    schedule.add_argument("target", metavar="MODULE:FUNC", help="the @workflow, e.g. myapp.workflows:provision_vm")
    schedule.add_argument("values", type=_json_value, nargs="*", metavar="JSON",
                          help="each one positional argument, in everystep's JSON")
    schedule.add_argument("--idempotency-key", metavar="K", help="return the existing run of this workflow and key")

    worker = add(commands, "worker", cmd_worker, "run one worker in this process (the supervisor runs a pool of them)")
    worker.add_argument("--name", required=True, type=_runner_name,
                        help="runner name: the claimed_by of its runs; unique while alive")
    worker.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                        help="module defining workflows (repeatable)")
    worker.add_argument("--workflows", action="append", type=_workflow_pattern, metavar="PATTERN",
                        help="run only the workflows whose name matches PATTERN ('*' any characters, '?' one); "
                             "repeat for several (default: every workflow)")
    worker.add_argument("--threads", type=_whole_number(1), default=8, help="runs in flight (default 8)")
    worker.add_argument("--poll", type=_seconds(zero=False), default=1.0,
                        help="seconds between polls (default 1)")
    worker.add_argument("--drain", type=_seconds(zero=True), default=30.0,
                        help="seconds to drain on TERM; 0 waits for ever")
    worker.add_argument("--grace", type=_seconds(zero=True), default=10.0,
                        help="seconds without its lock before the worker abandons its runs (default 10)")
    worker.add_argument("--max-crashes", type=_whole_number(1), default=3,
                        help="claims that die without progress before a run fails (default 3)")
    worker.add_argument("--direct-url", metavar="URL",
                        help="when the database URL goes through PgBouncer (transaction pooling): a URL straight to "
                        "PostgreSQL for the control session (default: -c FILE's database.direct_url)")
    worker.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])

    maintenance = add(commands, "maintenance", cmd_maintenance,
                      "recover the runs of dead workers and fire the recurring schedules, in this process")
    maintenance.add_argument("--interval", type=_seconds(zero=False), metavar="SECONDS",
                             help="seconds between dead-claimer sweeps (default: recovery.interval of -c FILE, else 5)")
    maintenance.add_argument("--grace", type=_seconds(zero=True), metavar="SECONDS",
                             help="seconds a claimer's lock must stay free before it is dead "
                                  "(default: recovery.grace of -c FILE, else 10)")
    maintenance.add_argument("--max-crashes", type=_whole_number(1), metavar="N",
                             help="claims that die without progress before a run fails "
                                  "(default: recovery.max_crashes of -c FILE, else 3)")
    maintenance.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                             help="module defining workflows (repeatable; -c FILE's imports too)")
    maintenance.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])

    ui = add(commands, "ui", cmd_ui, "serve the operators' web UI (without a supervisor)")
    ui.add_argument("--bind", default=None, help="address to listen on (default 127.0.0.1, or the ui: section of -c)")
    ui.add_argument("--port", type=_whole_number(0, 65535), default=None, help="port (default 9118; 0: any free port)")
    ui.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])

    roles = add(commands, "roles", cmd_roles, "print the SQL of three least-privilege roles (producer, worker, "
                "operator), or apply it")
    roles.add_argument("--apply", action="store_true", help="run the SQL on the database instead of printing it")
    roles.add_argument("--prefix", type=_role_prefix, default="everystep_",
                       help="role name prefix (default everystep_)")
    roles.add_argument("--schema", type=_role_prefix, default=None,
                       help="schema of the everystep tables (default public)")

    add_schedules_commands(commands, add)
    return parser


def _role_prefix(text: str) -> str:
    if not text or len(text) > 40 or not (text[0].isalpha() or text[0] == "_") or \
            not all(ch.isalnum() or ch == "_" for ch in text) or not text.isascii():
        raise argparse.ArgumentTypeError(f"expected letters, digits and '_' (at most 40), not {text!r}")
    return text.lower()


def _connection_lost(exc: psycopg.OperationalError) -> bool:
    # No SQLSTATE: the client lost the connection; 08: connection exception;
    # 57P: the server shut down or is starting.
    return exc.sqlstate is None or exc.sqlstate.startswith(("08", "57P"))


# ---------------------------------------------------------------- recurring schedules

def add_schedules_commands(commands: argparse._SubParsersAction, add: Callable[..., argparse.ArgumentParser]) -> None:
    """`everystep schedules plan|apply|retire|list`; `add` is build_parser's,
    which gives each command the database options."""
    group = add(commands, "schedules", None, "manage recurring schedules: the schedules: section of everystep.yaml "
                "is the manifest; plan shows what apply would write")
    actions = group.add_subparsers(dest="schedules_command", required=True, metavar="ACTION")
    plan = add(actions, "plan", cmd_schedules_plan, "show what apply would add, change and leave, the live keys "
               "of the file's source it no longer has, and the plan's digest (read-only)")
    _output_option(plan)
    apply = add(actions, "apply", cmd_schedules_apply, "write the file's schedules; keys no longer in the file keep "
                "firing until retired")
    apply.add_argument("--plan-digest", metavar="DIGEST",
                       help=f"apply only if the plan is still the one `plan` printed this digest for; else write "
                            f"nothing, show the plan now and exit {EXIT_PLAN_CHANGED}")
    _output_option(apply)
    retire = add(actions, "retire", cmd_schedules_retire, "retire a schedule of your source: it never fires again")
    retire.add_argument("key")
    retire.add_argument("--source", help="the source that owns the key (default: the source of -c FILE's "
                                         f"schedules, else {scheduler.DEFAULT_SOURCE})")
    retire.add_argument("--force", action="store_true", help="retire it whichever source owns it")
    _output_option(retire)
    listing = add(actions, "list", cmd_schedules_list, "list the schedules: state, source, timing, next and last "
                  "fire, last run")
    listing.add_argument("--all", action="store_true", help="include retired schedules")
    listing.add_argument("--source", help="only the schedules of this source")
    _output_option(listing)


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
        _audit(conn, "schedules-apply", target=str(args.config),
               details={e.key: e.action for e in plan.entries if e.action != "unchanged"})
    _print_plan(args, plan, done=True, expected_digest=args.plan_digest)
    return 0


def cmd_schedules_retire(args: argparse.Namespace) -> int:
    if args.source is not None:
        source = _source_option(args.source)
    elif args.config:
        source = _schedules_manifest(args).source
    else:
        source = scheduler.DEFAULT_SOURCE
    with _schedules_database(args) as conn:
        owner_required = None if args.force else source
        retired_at = _refused_as_cli_error(lambda: db.retire_schedule(conn, args.key, owner_required))
        owner = db.load_schedule(conn, args.key)["source"]
        _audit(conn, "schedules-retire", target=args.key, details={"source": owner, "forced": args.force})
    if args.output == "json":
        _print_json({"key": args.key, "source": owner, "retired_at": retired_at, "forced": args.force})
        return 0
    print(f"retired {args.key}{'' if owner == source else f' (of source {owner})'} at "
          f"{scheduler.iso_utc(retired_at)}: it will not fire again "
          "(remove it from the file too, or the next apply brings it back)")
    return 0


def cmd_schedules_list(args: argparse.Namespace) -> int:
    with _schedules_database(args) as conn:
        rows = [row for row in db.load_schedules(conn) if (args.all or row["retired_at"] is None)
                and (args.source is None or row["source"] == args.source)]
    if args.output == "json":
        _print_json({"schedules": [_schedule_document(row) for row in rows]})
        return 0
    if not rows:
        print("no schedules" if args.all else "no live schedules")
        return 0
    table = []
    for row in rows:
        state = scheduler.state_of(row)
        last_run = f"{row['last_run_id']} {row['last_run_status']}" if row["last_run_id"] else "-"
        table.append((row["key"], state, row["source"], row["cron"], row["timezone"], row["workflow"],
                      scheduler.iso_utc(row["next_fire_at"]) if state == "active" else "-",
                      scheduler.iso_utc(row["last_fire_at"]) if row["last_fire_at"] else "-", last_run))
    print(_table(("KEY", "STATE", "SOURCE", "CRON", "TIMEZONE", "WORKFLOW", "NEXT FIRE", "LAST FIRE", "LAST RUN"),
                 table))
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
    if not args.config:
        raise CliError(f"schedules {args.schedules_command} needs the manifest: -c everystep.yaml")
    return load_config(args.config).schedules


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
            document = {"applied": done, "expected_digest": expected_digest, **document}
        _print_json(document)
        return
    for entry in plan.entries:
        print(f"{_PLAN_MARKS[entry.action]} {entry.key}: {_describe_plan_entry(entry)}")
    words = _APPLIED_WORDS if done else _PLAN_WORDS
    summary = [f"{counts[action]} {word}" for action, word in words.items() if counts[action]]
    print(f"{'applied' if done else 'plan'}: {', '.join(summary) or 'no schedules in the file or the database'}"
          f" (source {plan.source})")
    print(f"digest: {plan.digest}")


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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
        sys.stdout.flush()  # here, so a closed pipe is handled below
        return code
    except CliError as exc:
        message, code = str(exc), exc.code
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


if __name__ == "__main__":
    sys.exit(main())
