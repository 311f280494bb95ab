"""Helpers of the engine's tests."""

from __future__ import annotations

import everystep
from everystep import schedule


def schedule_one(db, fn, *args, **kw):
    with db.connect() as conn, everystep.transaction(conn):
        return schedule(fn, *args, **kw)


def schedule_in(conn, fn, *args, **kw):
    """Schedule a run in a transaction of `conn` (an everystep_db connection)."""
    with everystep.transaction(conn):
        return schedule(fn, *args, **kw)


def step_ids(db, run_id):
    return [s["step_id"] for s in db.steps(run_id)]


def most_at_once(db, runs) -> int:
    """The most steps of `runs` that ran at one moment, from the step rows'
    started and finished times (an end and a start at one instant do not overlap)."""
    moments = sorted((moment, delta) for run in runs for step in db.steps(run.id)
                     for moment, delta in ((step["started_at"], 1), (step["finished_at"], -1)))
    now = highest = 0
    for _moment, delta in moments:
        now += delta
        highest = max(highest, now)
    return highest
