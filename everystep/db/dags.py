"""Graphs of runs and follow-ups (everystep.dags): the statements of
sql/dags.sql, one typed function each, in the caller's transaction.

What everystep.dags and schedule(depends_on=) write are plans
(queries.Plan): the caller composes them into its own (`yield from`) and
runs that with queries.run on a connection or queries.arun on an
AsyncConnection, the same statements. The reads of the operators' tools and
of a running member take a connection."""

from __future__ import annotations

import uuid
from typing import NamedTuple

import psycopg

from everystep.db import queries
from everystep.db.queries import Plan, Query
from everystep.db.rows import dicts


class DagRow(NamedTuple):
    key: str
    workflows: list[str] | None
    created_at: object
    created_by: str | None
    sealed_at: object
    sealed_by: str | None
    cancelled_at: object
    cancel_reason: str | None
    members: int


class Held(NamedTuple):
    awaiting: int  # what the run still waits for: the seal, and the dependencies not completed (0: due at once)
    cancel_reason: str | None  # set when a dependency had failed, stopped or been cancelled


def create_dag(key: str, workflows: list[str] | None, actor: str | None) -> Plan:
    """The graph `key` (a DagRow), made now unless it exists."""
    yield Query("create_dag", {"key": key, "workflows": workflows, "actor": actor}, "none")
    return (yield from dag(key))


def dag(key: str) -> Plan:
    """The graph `key` (a DagRow), None if there is none."""
    row = yield Query("dag", {"key": key})
    return None if row is None else DagRow(*row)


def take_member_position(key: str) -> Plan:
    """The next member's position, locking the graph; None if it is not open."""
    row = yield Query("take_member_position", {"key": key})
    return None if row is None else row[0]


def named_members(dag: str, keys: list[str], runs: list[uuid.UUID], new_key: str) -> Plan:
    """The members named (by key or run id) or keyed `new_key`: key -> run id."""
    rows = yield Query("named_members", {"dag": dag, "keys": keys, "runs": runs, "new_key": new_key}, "all")
    return {key: run for key, run in rows}


def add_member(dag: str, key: str, position: int, run: uuid.UUID, depends_on: list[str]) -> Plan:
    yield Query("add_member", {"dag": dag, "key": key, "position": position, "run": run, "depends_on": depends_on},
                "none")


def runs_exist(runs: list[uuid.UUID]) -> Plan:
    """Which of `runs` exist (a set)."""
    return {row[0] for row in (yield Query("runs_exist", {"runs": runs}, "all"))}


def hold_for_dependencies(run: uuid.UUID, depends_on: list[uuid.UUID], sealed: bool = True) -> Plan:
    """Make a run inserted in this transaction wait for `depends_on` (and,
    not `sealed`, for the seal of its graph); a Held."""
    row = yield Query("hold_for_dependencies", {"run": run, "depends_on": depends_on, "seal": 0 if sealed else 1})
    return Held(row[0], row[1])


def lock_dag(key: str) -> Plan:
    """(sealed_at, cancelled_at, members) of the graph, locked; None if there is none."""
    return (yield Query("lock_dag", {"key": key}))


def seal_dag(key: str, actor: str | None) -> Plan:
    """Seal the graph locked by lock_dag; returns how many members it released."""
    return (yield Query("seal_dag", {"key": key, "actor": actor}))[0]


def dag_members(key: str) -> Plan:
    return (yield Query("dag_members", {"key": key}, "dicts"))


def list_dags(conn: psycopg.Connection, status: str | None = None, limit: int | None = 100) -> list[dict]:
    return dicts(conn.execute(queries.get("list_dags"), {"status": status, "limit": limit}))


def cancel_dag(key: str, reason: str | None) -> Plan:
    """Cancel the graph's members not ended yet, and settle the dependents of
    those cancelled at once; False if there is no such graph."""
    rows = yield Query("cancel_dag", {"key": key, "reason": reason}, "all")
    ended = [(run, status) for _, run, status in rows if run is not None]
    if ended:
        yield from _settle_runs([run for run, _ in ended], [status for _, status in ended])
    return rows[0][0] is not None


def settle_runs(conn: psycopg.Connection, runs: list[uuid.UUID], statuses: list[str]) -> int:
    return queries.run(conn, _settle_runs(runs, statuses))


def _settle_runs(runs: list[uuid.UUID], statuses: list[str]) -> Plan:
    return (yield Query("settle_runs", {"runs": runs, "statuses": statuses}))[0]


def member_run(dag: str, key: str) -> Plan:
    """A member's run and its status (the member locked), None if there is no such member."""
    row = yield Query("member_run", {"dag": dag, "key": key})
    return None if row is None else (row[0], row[1])


def replace_member_run(dag: str, key: str, old: uuid.UUID, new: uuid.UUID) -> Plan:
    """Put a member's re-run in its place; returns how many cancelled dependents wait again."""
    return (yield Query("replace_member_run", {"dag": dag, "key": key, "old": old, "new": new}))[1]


def upstream_result(conn: psycopg.Connection, run: uuid.UUID, key: str) -> tuple | None:
    """(status, result, is a dependency of run) of the member `key` of run's graph."""
    return conn.execute(queries.get("upstream_result"), {"run": run, "key": key}).fetchone()


def dag_of_run(conn: psycopg.Connection, run: uuid.UUID) -> tuple[str, str] | None:
    """(graph key, member key) of a member run."""
    return conn.execute(queries.get("dag_of_run"), {"run": run}).fetchone()
