"""The operators' actions and records: resolving a blocked run's step,
the audit trail. Statements: sql/ops.sql."""

from __future__ import annotations

import json
import uuid

import psycopg

from everystep.db import fenced, queries
from everystep.db.queries import Plan, Query
from everystep.db.rows import dicts
from everystep.db.session import Executor
from everystep.schema import RunStatus, StepStatus


class ResolveRefused(Exception):
    """resolve_step was asked to resolve something that is not a blocked run's started step."""


def resolve_step(
    conn: psycopg.Connection, run: uuid.UUID, step_id: str, status: str | None, result: str | None, error: str | None
) -> None:
    """Resolve the `started` step of a blocked run: record its outcome
    (status done/failed), or delete the row (status None: the effect did not
    happen). The run goes back to `scheduled`. One transaction."""
    with conn.transaction():
        row = conn.execute(queries.get("lock_run_status"), {"run": run}).fetchone()
        if row is None:  # not in the hot table: in the history (so finished), or no such run
            row = conn.execute(queries.get("history_run_status"), {"run": run}).fetchone()
        if row is None:
            raise ResolveRefused(f"no run {run}")
        if row[0] != RunStatus.BLOCKED:
            raise ResolveRefused(f"run {run} is {row[0]}, not blocked; only a blocked run can be resolved")
        step = fenced.step_row(conn, run, step_id)
        if step is None:
            raise ResolveRefused(f"run {run} has no step {step_id!r}")
        if step.status != StepStatus.STARTED:
            raise ResolveRefused(
                f"step {step_id!r} of run {run} is {step.status}; only its started step can be resolved")
        if status is None:
            conn.execute(queries.get("delete_step"), {"run": run, "step_id": step_id})
        else:
            conn.execute(queries.get("resolve_step"),
                         {"status": status, "result": result, "error": error, "run": run, "step_id": step_id})
        conn.execute(queries.get("reschedule_resolved"), {"run": run})
        conn.execute(queries.get("notify"), {})


def rerun_source(run: uuid.UUID) -> Plan:
    """Plan: the status of the run a re-run copies from (hot or in the
    history) and its recorded steps (id, step_id, name, status, started_at,
    finished_at; times as ISO text), in recorded order; None when there is
    no such run."""
    row = yield Query("rerun_source", {"run": run})
    return None if row is None else (row[0], row[1])


def insert_rerun(run: uuid.UUID, new_id: uuid.UUID, step_ids: list[str]) -> Plan:
    """Plan, in the caller's transaction: the re-run `new_id` of `run` (same
    workflow and args, rerun_of = run), with the recorded outcomes of
    `step_ids` copied from `run` in one statement. Returns the new run's id."""
    new = (yield Query("insert_rerun", {"id": new_id, "run": run}))[0]
    if step_ids:
        yield Query("copy_rerun_steps", {"id": new, "run": run, "step_ids": step_ids}, "none")
    return new


def audit(conn: Executor, actor: str, source: str, action: str, run: uuid.UUID | None = None,
          step_id: str | None = None, target: str | None = None, details: dict | None = None) -> None:
    """Record an operator's action (who, what, on which run or step, the values given)."""
    queries.run(conn, audit_entry(actor, source, action, run, step_id, target, details))


def audit_entry(actor: str, source: str, action: str, run: uuid.UUID | None = None, step_id: str | None = None,
                target: str | None = None, details: dict | None = None) -> Plan:
    """audit as a plan, for a plan that records its action with its writes."""
    yield Query("audit", {
        "actor": actor[:255], "source": source, "action": action, "run": run, "step_id": step_id, "target": target,
        "details": json.dumps(details or {}, default=str)}, "none")


def audit_records(conn: psycopg.Connection, run: uuid.UUID | None = None, limit: int = 200,
                  before: int | None = None) -> list[dict]:
    """The newest audit records (of one run), newest first."""
    return dicts(conn.execute(queries.get("audit_records"), {"run": run, "before": before, "limit": limit}))


def audit_records_filtered(conn: psycopg.Connection, *, actor: str | None = None, action: str | None = None,
                           run: uuid.UUID | None = None, before: int | None = None, limit: int = 200) -> list[dict]:
    """The newest audit records of one person, action and/or run (each filter
    only when given), newest first; `before` pages on by record id."""
    return dicts(conn.execute(queries.get("audit_records_filtered"), {
        "actor": actor, "action": action, "run": run, "before": before, "limit": limit}, prepare=False))


def recorded_environment(conn: psycopg.Connection) -> str | None:
    """The environment recorded for this database (`everystep migrate
    --environment NAME`); None when none is, or the schema predates it."""
    if not conn.execute(queries.get("environment_table_exists"), {}).fetchone()[0]:
        return None
    row = conn.execute(queries.get("recorded_environment"), {}).fetchone()
    return row[0] if row else None


def record_environment(conn: psycopg.Connection, name: str, by: str) -> None:
    """Record which environment this database is (staging, production, ...)."""
    conn.execute(queries.get("record_environment"), {"name": name, "by": by[:255]})
