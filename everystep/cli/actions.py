"""The operator's actions on runs: `everystep resolve-step`, `requeue` and `cancel`."""

from __future__ import annotations

import argparse
from typing import Any

from everystep import api, liveness, serde, store
from everystep.cli.common import (
    EXIT_REFUSED,
    Add,
    CliError,
    audit,
    connect,
    json_value_argument,
    load_run,
    run_id_argument,
    utc,
)
from everystep.errors import EverystepError


def add_commands(commands: Any, add: Add) -> None:
    resolve = add(commands, "resolve-step", cmd_resolve_step,
                  "say what happened to the started step of a blocked run, and schedule the run again")
    resolve.add_argument("run", type=run_id_argument, metavar="RUN")
    resolve.add_argument("step", metavar="STEP", help="the step id, e.g. 3 or charge or fan.0.1")
    outcome = resolve.add_mutually_exclusive_group(required=True)
    outcome.add_argument("--result", type=json_value_argument, default=_NOT_GIVEN, metavar="JSON",
                         help="the effect happened: record this result")
    outcome.add_argument("--error", metavar="MSG", help="the effect happened and failed with this message")
    outcome.add_argument("--discard", action="store_true", help="the effect did not happen: run the step again")

    requeue = add(commands, "requeue", cmd_requeue,
                  "put running runs whose claimer is dead back to scheduled")
    requeue.add_argument("runs", type=run_id_argument, nargs="+", metavar="RUN")

    cancel = add(commands, "cancel", cmd_cancel,
                 "cancel runs: scheduled, waiting and blocked ones at once, running ones at their next step")
    cancel.add_argument("runs", type=run_id_argument, nargs="+", metavar="RUN")
    cancel.add_argument("--reason", metavar="TEXT", help="why (recorded with the run, given to its Cancelled)")


# argparse tells options apart from their defaults by value: `--result null`
# (None) must not look like "not given", or it would not conflict with --discard.
_NOT_GIVEN: Any = object()


def cmd_resolve_step(args: argparse.Namespace) -> int:
    with connect(args) as conn:
        load_run(conn, args.run)
        if store.step_row(conn, args.run, args.step) is None:
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
        audit(conn, "resolve-step", args.run, args.step, details={k: serde.to_json(v) for k, v in how.items()})
    print(f"step {args.step!r} of run {args.run} {done}; the run is scheduled again")
    return 0


def cmd_requeue(args: argparse.Namespace) -> int:
    run_ids = list(dict.fromkeys(args.runs))
    with connect(args) as conn:
        runs = [load_run(conn, run_id) for run_id in run_ids]
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
                requeued = store.requeue_from_dead_claimers(conn, [(run["id"], run["claimed_by"]) for run in runs])
                if len(requeued) != len(runs):
                    changed = ", ".join(str(run["id"]) for run in runs if run["id"] not in requeued)
                    raise CliError(f"run {changed} changed while being requeued; nothing was requeued", EXIT_REFUSED)
                for run in runs:
                    audit(conn, "requeue", run["id"], details={"claimer": run["claimed_by"]})
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
        return f"run {run['id']} is waiting for its time ({utc(run['due_at'])}): a worker will claim it then"
    if status == "blocked":
        return f"run {run['id']} is blocked: resolve its started step with `everystep resolve-step`"
    if status in store.TERMINAL:
        return f"run {run['id']} is {status}: a finished run is never requeued; schedule it again"
    return None


def cmd_cancel(args: argparse.Namespace) -> int:
    run_ids = list(dict.fromkeys(args.runs))
    with connect(args) as conn:
        for run_id in run_ids:
            load_run(conn, run_id)
        with api.transaction(conn):  # all or nothing
            statuses = {run_id: api.cancel(run_id, args.reason) for run_id in run_ids}
            finished = [f"run {run_id} is {status} already" for run_id, status in statuses.items()
                        if status not in ("cancelled", "running")]
            if finished:
                raise CliError("; ".join(finished) + ("; nothing was cancelled" if len(run_ids) > 1 else ""),
                               EXIT_REFUSED)
            for run_id, status in statuses.items():
                audit(conn, "cancel", run_id, details={"reason": args.reason, "status": status})
    for run_id, status in statuses.items():
        if status == "running":
            print(f"asked run {run_id} to stop: it is running; it ends cancelled at its next step")
        else:
            print(f"cancelled run {run_id}")
    return 0

