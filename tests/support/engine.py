"""Helpers of the engine's tests."""

from __future__ import annotations

import everystep
from everystep import schedule


def schedule_one(db, fn, *args, **kw):
    with db.connect() as conn, everystep.transaction(conn):
        return schedule(fn, *args, **kw)


def step_ids(db, run_id):
    return [s["step_id"] for s in db.steps(run_id)]
