"""The operators' actions and records: resolving a blocked run's step,
the audit trail. Statements: sql/ops.sql."""

from __future__ import annotations

import json
import uuid

import psycopg

from everystep.db import fenced, queries
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


def audit(conn: Executor, actor: str, source: str, action: str, run: uuid.UUID | None = None,
          step_id: str | None = None, target: str | None = None, details: dict | None = None) -> None:
    """Record an operator's action (who, what, on which run or step, the values given)."""
    conn.execute(queries.get("audit"), {
        "actor": actor[:255], "source": source, "action": action, "run": run, "step_id": step_id, "target": target,
        "details": json.dumps(details or {}, default=str)})


def audit_records(conn: psycopg.Connection, run: uuid.UUID | None = None, limit: int = 200,
                  before: int | None = None) -> list[dict]:
    """The newest audit records (of one run), newest first."""
    return dicts(conn.execute(queries.get("audit_records"), {"run": run, "before": before, "limit": limit}))
