"""What the supervisor's metrics and health checks read, and what a worker
says about itself for them. Statements: sql/observe.sql."""

from __future__ import annotations

import psycopg

from everystep.db import queries
from everystep.db.rows import QueueStats, Server, TableHealth, VacuumHorizon


def set_statement_timeout(conn: psycopg.Connection, milliseconds: int) -> None:
    """Bound every statement of this session (the observer's connection)."""
    conn.execute(queries.get("statement_timeout"), {"milliseconds": str(milliseconds)})


def queue_stats(conn: psycopg.Connection) -> QueueStats:
    """The queue as it stands: counts of the unfinished statuses and the age of
    the oldest scheduled run, measured with the server's clock."""
    row = conn.execute(queries.get("queue_stats"), {}).fetchone()
    return QueueStats(row[0], row[1], row[2], max(float(row[3]), 0.0), row[4])


def table_health(conn: psycopg.Connection) -> list[TableHealth]:
    """The hot tables' live and dead tuples and last vacuums."""
    return [TableHealth(*row) for row in conn.execute(queries.get("table_health"), {})]


def vacuum_horizon(conn: psycopg.Connection) -> VacuumHorizon:
    """What holds back vacuum in this database (ages of the oldest snapshot
    and of the longest idle-in-transaction session)."""
    return VacuumHorizon(*conn.execute(queries.get("vacuum_horizon"), {}).fetchone())


def runners_without_lock(conn: psycopg.Connection, runners: list[str]) -> list[str]:
    """The runner names, among `runners`, whose advisory lock nobody holds in
    this database."""
    return [row[0] for row in conn.execute(queries.get("runners_without_lock"), {"runners": runners}).fetchall()]


def publish_route(conn: psycopg.Connection, runner: str, routes: list[str] | None,
                  unknown: list[str] | None = None) -> None:
    """Say which workflows this runner claims (LIKE patterns; None: all), and
    which it cannot import (`unknown`: it claims none of their runs)."""
    params = {"runner": runner, "patterns": routes, "unknown": list(unknown or [])}
    try:
        with conn.transaction():  # a savepoint when the caller's transaction is open
            conn.execute(queries.get("publish_route"), params)
    except psycopg.errors.UndefinedColumn:
        # A schema not migrated to 0019 yet (a new worker beside the previous
        # version's, before `everystep migrate`) has no `unknown` column: its
        # readiness then names no workflow, and the runs are still given back.
        conn.execute(queries.get("publish_route_before_0019"), params)


def unknown_workflows(conn: psycopg.Connection, runners: list[str]) -> dict[str, list[str]]:
    """The workflows each of `runners` said it cannot import (only those
    that said some)."""
    return dict(conn.execute(queries.get("unknown_workflows"), {"runners": runners}).fetchall())


def unserved_runs(conn: psycopg.Connection) -> dict[str, int]:
    """Scheduled runs, by workflow name, that no live worker (one whose lock
    is held in this database) claims: none of their routes matches."""
    return dict(conn.execute(queries.get("unserved_runs"), {}).fetchall())


def server(conn: psycopg.Connection) -> Server:
    """The server this session talks to (see Server)."""
    return Server(*conn.execute(queries.get("server"), {}).fetchone())


def fleet_load(conn: psycopg.Connection, patterns: list[str] | None, bound: int) -> int:
    """The runs of a fleet running or due now, at most `bound` (observe.sql:
    fleet_load, which the autoscaling manifests carry with the fleet's
    patterns and bound written in). `patterns`: LIKE patterns (`routes_of`),
    None for every workflow."""
    return conn.execute(queries.get("fleet_load"), {"patterns": patterns or ["%"], "bound": bound}).fetchone()[0]
