"""Helpers of the engine's tests."""

from __future__ import annotations

import threading

import psycopg

import everystep
import everystep.db
from everystep import schedule

# How a worker of a version before 0032 claims a run: with its own
# statement, which makes it running under a new token and leaves its queue
# row behind (the sweep's strays, 0040 and 0042).
OLD_CLAIM = ("UPDATE everystep_workflow SET status = 'running', claimed_by = 'old-0',"
             " claim_token = nextval('everystep_claim_token') WHERE id = %s")


def in_ready_order(db) -> list:
    """The ready runs' ids in the order the claims take them."""
    return [row[0] for row in db.query(
        "SELECT run_id FROM everystep_ready ORDER BY priority DESC, ready_at, run_id")]


def schedule_one(db, fn, *args, **kw):
    with db.connect() as conn, everystep.transaction(conn):
        return schedule(fn, *args, **kw)


def schedule_in(conn, fn, *args, **kw):
    """Schedule a run in a transaction of `conn` (an everystep_db connection)."""
    with everystep.transaction(conn):
        return schedule(fn, *args, **kw)


def claim_hard(db, observed: str, claimers: int = 8) -> list[int]:
    """`claimers` threads claiming and ending runs (with successor claims) as
    fast as they can until the queue stays empty, while an observer runs the
    query `observed` (one number) again and again; returns what it saw."""
    seen: list[int] = []
    done = threading.Event()
    errors: list[BaseException] = []

    def observe() -> None:
        with db.connect() as conn:
            while not done.is_set():
                seen.append(conn.execute(observed).fetchone()[0])

    def claimer(i: int) -> None:
        name = f"w{i}"
        try:
            with db.connect() as conn:
                everystep.db.prepare_session(conn)
                idle = 0
                while idle < 20:
                    runs = everystep.db.claim(conn, name, 2)
                    idle = 0 if runs else idle + 1
                    while runs:
                        run = runs.pop()
                        runs += everystep.db.finish_run(conn, run.id, name, run.token, "completed", "null", None,
                                                        claim=not runs).claimed
        except BaseException as exc:  # noqa: BLE001  (reported below)
            errors.append(exc)

    observer = threading.Thread(target=observe)
    observer.start()
    threads = [threading.Thread(target=claimer, args=(i,)) for i in range(claimers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    done.set()
    observer.join()
    assert not errors, errors
    return seen


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


def take_lock_from(thief, name: str, backends: tuple[str, ...], attempts: int = 20) -> None:
    """Cut the connections of a worker named `name` (by application_name) and
    take its runner lock on `thief` before the worker comes back: the lock is
    asked for while the cut backend still holds it, so the thief is first in
    line. Should the worker win all the same (it reconnects within
    milliseconds), cut it again: the wait is bounded by lock_timeout, never a
    hang."""
    thief.execute("SET lock_timeout = '2s'")
    try:
        for _ in range(attempts):
            thief.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                          " WHERE application_name = ANY(%s)", ([b[:63] for b in backends],))
            try:
                thief.execute("SELECT pg_advisory_lock(hashtextextended('everystep:' || current_schema() || ':'"
                              " || %s, 0))", (name,))
                return
            except psycopg.errors.LockNotAvailable:
                continue
        raise AssertionError(f"the worker {name} took its lock back {attempts} times")
    finally:
        thief.execute("RESET lock_timeout")
