"""Graphs of runs and follow-ups (everystep.dags): the statements of
sql/dags.sql, one typed function each, in the caller's transaction."""

from __future__ import annotations

import uuid
from typing import NamedTuple

import psycopg

from everystep.db import queries
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
    awaiting: int  # what the run still waits for (0: due at once)
    cancel_reason: str | None  # set when a dependency had failed, stopped or been cancelled


def create_dag(conn: psycopg.Connection, key: str, workflows: list[str] | None, actor: str | None) -> DagRow:
    """The graph `key`, made now unless it exists."""
    conn.execute(queries.get("create_dag"), {"key": key, "workflows": workflows, "actor": actor})
    return dag(conn, key)


def dag(conn: psycopg.Connection, key: str) -> DagRow | None:
    row = conn.execute(queries.get("dag"), {"key": key}).fetchone()
    return None if row is None else DagRow(*row)


def take_member_position(conn: psycopg.Connection, key: str) -> int | None:
    """The next member's position, locking the graph; None if it is not open."""
    row = conn.execute(queries.get("take_member_position"), {"key": key}).fetchone()
    return None if row is None else row[0]


def named_members(conn: psycopg.Connection, dag: str, keys: list[str], runs: list[uuid.UUID],
                  new_key: str) -> dict[str, uuid.UUID]:
    """The members named (by key or run id) or keyed `new_key`: key -> run id."""
    rows = conn.execute(queries.get("named_members"),
                        {"dag": dag, "keys": keys, "runs": runs, "new_key": new_key}).fetchall()
    return {key: run for key, run in rows}


def add_member(conn: psycopg.Connection, dag: str, key: str, position: int, run: uuid.UUID,
               depends_on: list[str]) -> None:
    conn.execute(queries.get("add_member"),
                 {"dag": dag, "key": key, "position": position, "run": run, "depends_on": depends_on})


def runs_exist(conn: psycopg.Connection, runs: list[uuid.UUID]) -> set[uuid.UUID]:
    return {row[0] for row in conn.execute(queries.get("runs_exist"), {"runs": runs})}


def hold_for_dependencies(conn: psycopg.Connection, run: uuid.UUID, depends_on: list[uuid.UUID],
                          extra: int = 0) -> Held:
    """Make a run inserted in this transaction wait for `depends_on` (and
    `extra` more: the seal of its graph)."""
    row = conn.execute(queries.get("hold_for_dependencies"),
                       {"run": run, "depends_on": depends_on, "extra": extra}).fetchone()
    return Held(row[0], row[1])


def lock_dag(conn: psycopg.Connection, key: str) -> tuple | None:
    """(sealed_at, cancelled_at, members) of the graph, locked; None if there is none."""
    return conn.execute(queries.get("lock_dag"), {"key": key}).fetchone()


def seal_dag(conn: psycopg.Connection, key: str, actor: str | None) -> int:
    """Seal the graph locked by lock_dag; returns how many members it released."""
    return conn.execute(queries.get("seal_dag"), {"key": key, "actor": actor}).fetchone()[0]


def dag_members(conn: psycopg.Connection, key: str) -> list[dict]:
    return dicts(conn.execute(queries.get("dag_members"), {"key": key}))


def list_dags(conn: psycopg.Connection, status: str | None = None, limit: int | None = 100) -> list[dict]:
    return dicts(conn.execute(queries.get("list_dags"), {"status": status, "limit": limit}))


def cancel_dag(conn: psycopg.Connection, key: str, reason: str | None) -> bool:
    """Cancel the graph's members not ended yet, and settle the dependents of
    those cancelled at once; False if there is no such graph."""
    rows = conn.execute(queries.get("cancel_dag"), {"key": key, "reason": reason}).fetchall()
    ended = [(run, status) for _, run, status in rows if run is not None]
    if ended:
        settle_runs(conn, [run for run, _ in ended], [status for _, status in ended])
    return rows[0][0] is not None


def settle_runs(conn: psycopg.Connection, runs: list[uuid.UUID], statuses: list[str]) -> int:
    return conn.execute(queries.get("settle_runs"), {"runs": runs, "statuses": statuses}).fetchone()[0]


def member_run(conn: psycopg.Connection, dag: str, key: str) -> tuple[uuid.UUID, str | None] | None:
    """A member's run and its status (the member locked), None if there is no such member."""
    row = conn.execute(queries.get("member_run"), {"dag": dag, "key": key}).fetchone()
    return None if row is None else (row[0], row[1])


def replace_member_run(conn: psycopg.Connection, dag: str, key: str, old: uuid.UUID, new: uuid.UUID) -> int:
    """Put a member's re-run in its place; returns how many cancelled dependents wait again."""
    return conn.execute(queries.get("replace_member_run"),
                        {"dag": dag, "key": key, "old": old, "new": new}).fetchone()[1]


def upstream_result(conn: psycopg.Connection, run: uuid.UUID, key: str) -> tuple | None:
    """(status, result, is a dependency of run) of the member `key` of run's graph."""
    return conn.execute(queries.get("upstream_result"), {"run": run, "key": key}).fetchone()


def dag_of_run(conn: psycopg.Connection, run: uuid.UUID) -> tuple[str, str] | None:
    """(graph key, member key) of a member run."""
    return conn.execute(queries.get("dag_of_run"), {"run": run}).fetchone()
