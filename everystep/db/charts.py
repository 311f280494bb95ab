"""The console's charts: the per-minute figures the maintenance child keeps
(everystep_minute) and the bounded reads the pages draw. Statements:
sql/charts.sql."""

from __future__ import annotations

import datetime

import psycopg

from everystep.db import queries
from everystep.db.rows import dicts

CHART_LOOKBACK_S = 3600  # a run is counted in the minute it ended if it ended within this long of its creation
CHART_FIRST_WINDOW = datetime.timedelta(hours=1)  # how far back the first rollup of a schema goes
CHART_DUE_CAP = 10_000  # due runs counted per workflow, at most
CHART_KEEP_DAYS = 2  # the figures kept


def roll_up_minutes(conn: psycopg.Connection, sample_backlog: bool = True) -> datetime.datetime:
    """Bring the per-minute figures up to now, in one transaction: the runs
    that ended since the last minute rolled up (that minute again, as it may
    have been incomplete; the first time, the last hour), and, with
    `sample_backlog`, the backlog now into the current minute. Returns the
    minute the rollup started at. No JIT: the statements read a bounded
    part of the table, but their estimates on a big one pass jit_above_cost,
    and compiling them took longer than running them."""
    with conn.transaction():
        conn.execute(queries.get("no_jit_in_transaction"), {})
        last, now = conn.execute(queries.get("last_minute_rolled_up"), {}).fetchone()
        since = max(last or now - CHART_FIRST_WINDOW, now - datetime.timedelta(days=1))
        # Planned with its values (prepare=False): a generic plan cannot see
        # how narrow the creation-time range is.
        conn.execute(queries.get("roll_up_minutes"), {"since": since, "lookback_s": CHART_LOOKBACK_S}, prepare=False)
        if sample_backlog or last is None or last < now.replace(second=0, microsecond=0):
            conn.execute(queries.get("sample_queue"), {"cap": CHART_DUE_CAP})
    return since


def prune_minutes(conn: psycopg.Connection, days: int = CHART_KEEP_DAYS) -> int:
    """Delete the figures older than `days` days; returns how many rows."""
    with conn.transaction():
        return conn.execute(queries.get("prune_minutes"), {"days": days}).rowcount


def chart_minutes(conn: psycopg.Connection, workflow: str | None, minutes: int) -> list[dict]:
    """One workflow's figures (None: every workflow's) over the last
    `minutes` minutes, oldest first; minutes without a row had nothing."""
    return dicts(conn.execute(queries.get("chart_minutes"), {"workflow": workflow or "*", "minutes": minutes}))


def chart_step_durations(conn: psycopg.Connection, workflow: str | None, runs: int) -> list[dict]:
    """Step duration percentiles (p50, p90, p99, max; seconds) per step
    name, over the steps of the newest `runs` runs (of one workflow)."""
    return dicts(conn.execute(queries.get("chart_step_durations"), {"workflow": workflow, "runs": runs}))


def chart_schedule_fires(conn: psycopg.Connection, key: str, limit: int) -> list[dict]:
    """A schedule's newest fires, newest first, with how each run ended."""
    return dicts(conn.execute(queries.get("chart_schedule_fires"), {"key": key, "limit": limit}))
