"""The operator's actions on runs: `everystep resolve-step`, `requeue`,
`cancel`, `reschedule` and `rerun`, each one function of everystep.operations (the
UI's actions are the same functions): all or nothing, audited in the
transaction of the change."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import psycopg

from everystep import operations, serde
from everystep.cli.common import (
    EXIT_REFUSED,
    Add,
    CliError,
    acted_on,
    actor,
    connect,
    json_value_argument,
    run_id_argument,
)

T = TypeVar("T")


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

    reschedule = add(commands, "reschedule", cmd_reschedule,
                     "schedule runs again: a new run of each one's workflow with the same args")
    reschedule.add_argument("runs", type=run_id_argument, nargs="+", metavar="RUN")

    rerun = add(commands, "rerun", cmd_rerun,
                "re-run ended runs from a step: a new run each, the steps before it copied, it and what follows run")
    rerun.add_argument("runs", type=run_id_argument, nargs="+", metavar="RUN")
    rerun.add_argument("--from-step", required=True, metavar="STEP_ID",
                       help="the step id to run again, e.g. 3 or charge or fan.0.1 (see `everystep runs show RUN`)")


# argparse tells options apart from their defaults by value: `--result null`
# (None) must not look like "not given", or it would not conflict with --discard.
_NOT_GIVEN: Any = object()


def cmd_resolve_step(args: argparse.Namespace) -> int:
    if args.discard:
        how = {"discard": True}
    elif args.error is not None:
        how = {"error": args.error}
    else:
        how = {"result": args.result}
    with connect(args) as conn:
        resolved = _refused_as_cli_error(lambda: operations.resolve_step(conn, actor(), args.run, args.step, **how))
    if resolved.outcome == "discard":
        done = "discarded: the step will run again"
    elif resolved.outcome == "error":
        done = f"recorded as failed with the error {resolved.value!r}"
    else:
        done = f"recorded as done with the result {serde.dumps(resolved.value)}"
    print(f"step {resolved.step!r} of run {resolved.run} {done}; the run is scheduled again")
    acted_on(args)
    return 0


def cmd_requeue(args: argparse.Namespace) -> int:
    def line(each: operations.RequeuedRun) -> str:
        why = f"its claimer {each.claimer} is dead" if each.claimer is not None else "it had no claimer"
        return f"requeued run {each.run} ({why})"

    return _on_runs(args, lambda conn: operations.requeue(conn, actor(), args.runs), "requeued", line)


def cmd_cancel(args: argparse.Namespace) -> int:
    def line(each: operations.CancelledRun) -> str:
        if each.status == "running":
            return f"asked run {each.run} to stop: it is running; it ends cancelled at its next step"
        return f"cancelled run {each.run}"

    return _on_runs(args, lambda conn: operations.cancel(conn, actor(), args.runs, args.reason), "cancelled", line)


def cmd_reschedule(args: argparse.Namespace) -> int:
    return _on_runs(args, lambda conn: operations.reschedule(conn, actor(), args.runs), "scheduled",
                    lambda each: f"scheduled run {each.run} again: new run {each.new}")


def cmd_rerun(args: argparse.Namespace) -> int:
    """All or nothing; any refusal is one line and exit 2 (bad input: the
    runs or the step given cannot be re-run so)."""
    with connect(args) as conn:
        done, refused = operations.rerun_many(conn, actor(), args.runs, args.from_step)
    if refused:
        several = len(set(args.runs)) > 1
        raise CliError("; ".join(refusal.why for refusal in refused) + ("; nothing was re-run" if several else ""))
    for each in done:
        print(f"re-ran run {each.run} from step {each.from_step!r}: new run {each.new} "
              f"({len(each.copied)} step(s) copied)")
    return 0


def _on_runs(args: argparse.Namespace, action: Callable[[psycopg.Connection], Any], verb: str,
             line: Callable[[Any], str]) -> int:
    """Run an all-or-nothing action on the runs named, and print a line per run done."""
    with connect(args) as conn:
        done, refused = action(conn)
    _refuse(refused, args.runs, verb)
    for each in done:
        print(line(each))
    acted_on(args)
    return 0


def _refused_as_cli_error(action: Callable[[], T]) -> T:
    """A refusal of a single-target action: exit 2 for what does not exist, else 1."""
    try:
        return action()
    except operations.NotFound as unknown:
        raise CliError(str(unknown)) from None
    except operations.Refused as refused:
        raise CliError(str(refused), EXIT_REFUSED) from None


def _refuse(refused: list[operations.Refusal], runs: Sequence[object], verb: str) -> None:
    """An all-or-nothing action that refused runs (it wrote nothing): an
    unknown run is bad input (exit 2), any other refusal exit 1."""
    unknown = [refusal for refusal in refused if refusal.status is None]
    if unknown:
        raise CliError(unknown[0].why)
    if refused:
        several = len(set(runs)) > 1
        raise CliError("; ".join(refusal.why for refusal in refused) + (f"; nothing was {verb}" if several else ""),
                       EXIT_REFUSED)
