"""The operators' web UI (everystep/ui/): its pages' reads and the actions
it offers beyond the CLI's. Statements: sql/ui.sql."""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Callable

import psycopg

from everystep.db import ops, queries, runs, schedules, tracebacks
from everystep.db.rows import RunFilter, dicts

UI_STATUS_CAP = 1000  # counts per status are exact up to this; above it, the planner's estimate


def ui_runs(conn: psycopg.Connection, f: RunFilter, limit: int) -> list[dict]:
    """One page of runs matching the filter, newest first (keyset paging:
    pass the last row's (created_at, id) as `before` for the next page).
    Unprepared: see ui.sql."""
    before_at, before_id = f.before or (None, None)
    return dicts(conn.execute(queries.get("ui_runs"), {
        "status": f.status, "workflow": f.workflow, "since": f.since, "until": f.until, "run_id": f.run_id,
        "key": f.idempotency_key, "args": f.args_contain, "before_at": before_at, "before_id": before_id,
        "limit": limit, "attributes": f.attributes_contain,
    }, prepare=False))


def ui_overview(conn: psycopg.Connection, statuses: tuple[str, ...], limit: int) -> dict:
    """The live page's data in one statement. `counts` are exact up to
    UI_STATUS_CAP (a count above it means "more"); `estimate` is what the
    planner's statistics say (reltuples and the most common values of status),
    for the statuses past the cap: no statement here scans the table."""
    page, counts, estimate, runners, changes = conn.execute(
        queries.get("ui_overview"), {"cap": UI_STATUS_CAP, "statuses": list(statuses), "limit": limit}
    ).fetchone()
    return {"runs": page, "counts": counts, "estimate": estimate, "runners": runners, "changes": changes}


def ui_run(conn: psycopg.Connection, run: uuid.UUID) -> dict | None:
    """A run with every recorded step (all their columns, whatever the
    schema version has: started_at and finished_at when present), its crash
    count, its audit records, its messages, events, children and re-runs,
    and the executions recorded in everystep_execution, from one snapshot."""
    with conn.transaction():
        conn.execute(queries.get("read_only_snapshot"), {})
        found = runs.load_run(conn, run)
        if found is None:
            return None
        found["steps"] = [row[0] for row in conn.execute(queries.get("ui_run_steps"), {"run": run})]
        crashes = conn.execute(queries.get("ui_run_crashes"), {"run": run}).fetchone()
        found["crashes"] = crashes[0] if crashes else 0
        found["audit"] = ops.audit_records(conn, run=run, limit=100)
        found.update(dicts(conn.execute(queries.get("ui_run_links"), {"run": run}))[0])
        found["executions"] = dicts(conn.execute(queries.get("ui_run_executions"), {"run": run}))
        found["messages"] = runs.load_messages(conn, run)
        found["events"] = runs.load_events(conn, run)
        found["children"] = runs.children(conn, run)
        found["tracebacks"] = tracebacks.step_tracebacks(conn, run)
    return found


def ui_workflow_names(conn: psycopg.Connection, limit: int = 500) -> list[str]:
    """The distinct workflow names, by a loose scan of the (name, created_at)
    index: one index probe per name, however many runs there are."""
    return [row[0] for row in conn.execute(queries.get("ui_workflow_names"), {"limit": limit})]


def ui_failures(conn: psycopg.Connection, hours: int) -> list[dict]:
    """Failed runs created in the last `hours`, grouped by workflow and
    exception type, with the newest run of each group."""
    return dicts(conn.execute(queries.get("ui_failures"), {"hours": hours}))


def ui_workers(conn: psycopg.Connection) -> list[dict]:
    """Every runner of this schema that holds its lock now, fleet-wide: the
    session holding it (a worker's control connection, application name
    `everystep <name> control`), since when that session exists, how many
    pool connections the runner has open, and its runs in flight."""
    return dicts(conn.execute(queries.get("ui_workers"), {}))


def ui_reschedule(conn: psycopg.Connection, run: uuid.UUID, new_id: uuid.UUID) -> uuid.UUID | None:
    """Schedule a new run of the same workflow with the same args (no
    idempotency key); None if there is no such run."""
    row = conn.execute(queries.get("ui_reschedule"), {"id": new_id, "run": run}).fetchone()
    return row[0] if row else None


def ui_set_schedule_paused(conn: psycopg.Connection, key: str, paused: bool,
                           next_fire_at: Callable[[dict], datetime.datetime] | None = None) -> None:
    """Pause or resume a live schedule from the UI (until the next `schedules
    apply` writes the file's value again). Resuming sets the next fire time
    `next_fire_at(row)`, so the time spent paused is not caught up."""
    with conn.transaction():
        schedules.lock_scheduler(conn)
        rows = dicts(conn.execute(queries.get("ui_live_schedule"), {"key": key}))
        if not rows:
            raise schedules.ScheduleRefused(f"no live schedule {key!r}")
        conn.execute(queries.get("ui_set_schedule_paused"), {
            "paused": paused, "next_fire_at": next_fire_at(rows[0]) if next_fire_at and not paused else None,
            "key": key})
