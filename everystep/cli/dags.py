"""`everystep dag list|show|cancel|rerun`: graphs of runs (everystep.dags)."""

from __future__ import annotations

import argparse
from typing import Any

from everystep import dags
from everystep.cli.common import (
    Add,
    CliError,
    acted_on,
    actor,
    connect,
    output_option,
    print_json,
    table,
    utc,
    whole_number_argument,
)
from everystep.cli.errors import EXIT_REFUSED


def add_commands(commands: Any, add: Add) -> None:
    dag = add(commands, "dag", None, "list graphs of runs (everystep.dags), show, cancel, or re-run a member")
    dag_commands = dag.add_subparsers(dest="dag_command", required=True, metavar="COMMAND")
    listing = add(dag_commands, "list", cmd_dag_list, "list graphs, newest first")
    listing.add_argument("--status", choices=dags.STATUSES, help="only graphs in this status")
    listing.add_argument("--limit", type=whole_number_argument(1), default=50, metavar="N",
                         help="at most N graphs (default 50)")
    output_option(listing)
    show = add(dag_commands, "show", cmd_dag_show, "show a graph: its members with status, dependencies, run ids")
    show.add_argument("key", metavar="KEY")
    output_option(show)
    cancel = add(dag_commands, "cancel", cmd_dag_cancel, "cancel a graph: every member not ended yet")
    cancel.add_argument("key", metavar="KEY")
    cancel.add_argument("--reason", help="the cancel reason recorded on the members")
    output_option(cancel)
    rerun = add(dag_commands, "rerun", cmd_dag_rerun,
                "re-run a failed member from its failed step; its dependents start again when it completes")
    rerun.add_argument("key", metavar="KEY")
    rerun.add_argument("member", metavar="MEMBER")
    output_option(rerun)


def _refused(error: dags.DagError) -> CliError:
    return CliError(str(error)) if isinstance(error, dags.DagNotFound) else CliError(str(error), EXIT_REFUSED)


def cmd_dag_list(args: argparse.Namespace) -> int:
    with connect(args) as conn:
        found = dags.list_dags(conn, args.status, args.limit)
    if args.output == "json":
        print_json(found)
    elif not found:
        print("no graphs")
    else:
        print(table(("KEY", "STATUS", "MEMBERS", "COMPLETED", "CREATED", "SEALED"),
                    [(g["key"], g["status"], str(g["members"]), str(g["completed"]), utc(g["created_at"]),
                      utc(g["sealed_at"])) for g in found]))
    return 0


def cmd_dag_show(args: argparse.Namespace) -> int:
    with connect(args) as conn:
        try:
            state = dags.get(args.key, conn=conn)
        except dags.DagError as exc:
            raise _refused(exc) from None
    members = [{"key": key, "run_id": m.run_id, "status": m.status, "depends_on": list(m.depends_on),
                "cancel_reason": m.cancel_reason} for key, m in state.members.items()]
    if args.output == "json":
        print_json({"key": state.key, "status": state.status, "workflows": state.workflows,
                    "created_at": state.created_at, "sealed_at": state.sealed_at, "sealed_by": state.sealed_by,
                    "cancelled_at": state.cancelled_at, "members": members})
        return 0
    print(f"graph {state.key}: {state.status}, {len(members)} members, sealed {utc(state.sealed_at)}")
    if members:
        print(table(("MEMBER", "STATUS", "DEPENDS ON", "RUN"),
                    [(m["key"], m["status"] or "-", ", ".join(m["depends_on"]) or "-", str(m["run_id"]))
                     for m in members]))
    return 0


def cmd_dag_cancel(args: argparse.Namespace) -> int:
    who = actor()
    with connect(args) as conn:
        try:
            with conn.transaction():
                dags.cancel(args.key, args.reason, conn=conn, actor=who.name, source=who.source)
        except dags.DagError as exc:
            raise _refused(exc) from None
        status = dags.get(args.key, conn=conn).status
    if args.output == "json":
        print_json({"key": args.key, "status": status})
    else:
        print(f"graph {args.key}: {status}")
        acted_on(args)
    return 0


def cmd_dag_rerun(args: argparse.Namespace) -> int:
    who = actor()
    with connect(args) as conn:
        try:
            with conn.transaction():
                new = dags.rerun(args.key, args.member, conn=conn, actor=who.name, source=who.source)
        except dags.DagError as exc:
            raise _refused(exc) from None
    if args.output == "json":
        print_json({"key": args.key, "member": args.member, "run_id": new})
    else:
        print(f"graph {args.key}: member {args.member} re-run as {new}")
        acted_on(args)
    return 0
