"""The tracebacks of failed step attempts (everystep_step_traceback): written
by the execution holding the run, read by the console."""

from __future__ import annotations

import uuid

from everystep.db import queries
from everystep.db.rows import dicts
from everystep.db.session import Executor


def record_traceback(conn: Executor, run: uuid.UUID, runner: str, token: int, step_id: str, attempt: int,
                     traceback: str) -> bool:
    """Keep the traceback of attempt `attempt` of step `step_id`; False if
    the run is no longer held by this execution (nothing written)."""
    return conn.execute(queries.get("record_traceback"), {
        "run": run, "runner": runner, "token": token, "step_id": step_id, "attempt": attempt,
        "traceback": traceback}).fetchone() is not None


def step_tracebacks(conn: Executor, run: uuid.UUID) -> list[dict]:
    """A run's step tracebacks: step_id, attempt, claim_token, traceback, recorded_at."""
    return dicts(conn.execute(queries.get("step_tracebacks"), {"run": run}))
