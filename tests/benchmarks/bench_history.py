"""history: a hundred million runs' worth of history, scaled to what this
machine holds. H finished runs with one step each are bulk-generated
(INSERT ... SELECT generate_series, in transactions of 1,000,000) straight
into the history's weekly partitions, ten weeks of them; then

- w1 (N one-step runs drained by a supervisor's 2 workers x 8 threads) with
  that history, against w1 on empty tables (target >= 0.95), medians of 3
  drains each, once the drains before have moved to the history (so that a
  drain does not share the machine with the move of another);
- (the generated pages are checkpointed before anything is measured)
- the retention removing the oldest week (H/10 runs: a partition dropped)
  while another w1 batch drains (target < 5 s, the drain >= 0.9 of w1);
- the UI's first page (the live overview) and filtered pages (by status,
  by workflow), p95 of 30 each (target < 50 ms);
- migrating in place: a schema of the version before 0017 with M finished
  runs (a step each) in its hot tables and a w1 batch draining; the
  migration's seconds, the longest the drain stood still around it, and how
  long the maintenance child then takes to move the M runs to the history.

python -m tests.benchmarks.bench_history [--history H] [--runs N] [--migrate M] [--quick]
Prints one JSON line."""

from __future__ import annotations

import argparse
import datetime as dt
import threading
import time
import uuid

import psycopg

import everystep.db
from everystep import retention
from everystep.db.rows import RunFilter
from tests.benchmarks import harness, workflows
from tests.conftest import Database, find_server
from tests.support.migrations import migrated_before, previous_release

QUICK = {"history": 20_000, "runs": 200, "migrate": 5_000, "repeat": 1}
CHUNK = 1_000_000  # rows per transaction while generating
WEEKS = 10
NAME = "tests.benchmarks.workflows.one_step"

# A UUIDv7 made of a moment and a counter (unique per n): 48 bits of Unix
# milliseconds, the version, 12 bits and 62 bits of the counter.
V7 = ("(lpad(to_hex(floor(extract(epoch FROM {at}) * 1000)::bigint), 12, '0') || '7'"
      " || lpad(to_hex(n & 4095), 3, '0') || '8' || lpad(to_hex(n), 15, '0'))::uuid")
AT = "(%(start)s::timestamptz + (n::float8 / %(total)s) * %(span)s::interval)"

FILL_HISTORY = f"""
WITH runs AS (
    INSERT INTO everystep_workflow_history (id, name, args, status, result, error, created_at, completed_at,
                                            due_at, wakes, limited, priority, keyed, dependents)
    SELECT {V7.format(at=AT)}, '{NAME}', jsonb_build_array(n),
           CASE WHEN n %% 10 = 0 THEN 'failed' ELSE 'completed' END,
           CASE WHEN n %% 10 = 0 THEN NULL ELSE to_jsonb(n) END,
           CASE WHEN n %% 10 = 0 THEN '{{"type": "ValueError", "message": "no"}}'::jsonb END,
           {AT}, {AT} + interval '1 second', {AT}, 0, false, 0, false, false
    FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS n
    RETURNING id, args, created_at
)
INSERT INTO everystep_step_history (id, workflow_id, step_id, name, args, kwargs, status, result, started_at,
                                    finished_at)
SELECT (args->>0)::bigint, id, '1', 'tests.benchmarks.workflows.noop', args, '{{}}', 'done', args->0, created_at,
       created_at + interval '1 second'
FROM runs
"""

FILL_HOT = f"""
WITH runs AS (
    INSERT INTO everystep_workflow (id, name, args, status, result, created_at, completed_at)
    SELECT {V7.format(at=AT)}, '{NAME}', jsonb_build_array(n), 'completed', to_jsonb(n), {AT},
           {AT} + interval '1 second'
    FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS n
    RETURNING id, args
)
INSERT INTO everystep_step (workflow_id, step_id, name, args, kwargs, status, result)
SELECT id, '1', 'tests.benchmarks.workflows.noop', args, '{{}}', 'done', args->0
FROM runs
"""


def w1(db: Database, runs: int, offset: int) -> float:
    started = harness.schedule_all(db, workflows.one_step, [(offset + i,) for i in range(runs)])
    harness.wait_drained(db)
    return runs / (harness.last_completion(db) - started)


def w1_median(db: Database, runs: int, offset: int, repeat: int) -> float:
    """The median of `repeat` w1 drains one after the other: all within the
    minute a finished run stays hot, so none shares the machine with the
    move of another."""
    return harness.median([w1(db, runs, offset + i * runs) for i in range(repeat)])


def moved(db: Database, timeout: float = 300.0) -> float:
    """Wait until no finished run is left in the hot table; the seconds waited."""
    began = time.monotonic()
    while db.value("SELECT EXISTS (SELECT FROM everystep_workflow WHERE status <> 'scheduled'"
                   " AND status <> 'running')"):
        if time.monotonic() - began > timeout:
            raise TimeoutError("finished runs still in the hot table")
        time.sleep(0.2)
    return time.monotonic() - began


def monday(day: dt.date) -> dt.date:
    return day - dt.timedelta(days=day.weekday())


def fill(db: Database, sql: str, total: int, start: dt.datetime, span: dt.timedelta) -> None:
    with db.connect() as conn:
        for first in range(0, total, CHUNK):
            last = min(first + CHUNK, total) - 1
            conn.execute(sql, {"start": start, "span": span, "total": total, "first": first, "last": last})


def history_weeks(db: Database, history: int) -> tuple[float, dt.datetime]:
    """Generate the history: ten weeks of runs, the last ending two weeks
    ago; its seconds, and the start of the oldest week."""
    start = dt.datetime.combine(monday(dt.datetime.now(dt.UTC).date()) - dt.timedelta(weeks=WEEKS + 2),
                                dt.time(), dt.UTC)
    began = time.monotonic()
    with db.connect() as conn:
        conn.execute("SELECT everystep_history_partition((%s::date + 7 * w)) FROM generate_series(0, %s) AS w",
                     (start.date(), WEEKS))
    fill(db, FILL_HISTORY, history, start, dt.timedelta(weeks=WEEKS))
    with db.connect() as conn:
        for table in ("everystep_workflow_history", "everystep_step_history"):
            conn.execute(f"VACUUM ANALYZE {table}")
    took = time.monotonic() - began
    settle(db)
    return took, start


def settle(db: Database) -> None:
    """Write the generated rows out before measuring: a w1 drain is bound
    by its commits' flushes, which the checkpoint of gigabytes of freshly
    written pages would otherwise share the disk with. Not in quick mode: a
    checkpoint writes out the whole server's dirty pages, the other clients'
    too (the test suite's), and quick figures are not measurements."""
    if harness.quick_mode():
        return
    with db.connect() as conn:
        conn.execute("CHECKPOINT")


def timed(call, times: int = 30) -> dict[str, float]:
    taken = []
    for _ in range(times):
        began = time.perf_counter()
        call()
        taken.append((time.perf_counter() - began) * 1000)
    return harness.percentiles(taken)


def ui_pages(db: Database) -> dict[str, float]:
    from everystep.schema import RunStatus  # noqa: PLC0415

    statuses = tuple(vars(RunStatus)[k] for k in vars(RunStatus) if k.isupper())
    with db.connect() as conn:
        first = timed(lambda: everystep.db.ui_overview(conn, statuses, 50))
        page = timed(lambda: everystep.db.ui_runs(conn, RunFilter(), 50))
        failed = timed(lambda: everystep.db.ui_runs(conn, RunFilter(status="failed"), 50))
        named = timed(lambda: everystep.db.ui_runs(conn, RunFilter(workflow=NAME), 50))
        names = timed(lambda: everystep.db.ui_workflow_names(conn))
    return {"first_page_p95_ms": round(max(first["p95"], page["p95"]), 1),
            "filtered_page_p95_ms": round(max(failed["p95"], named["p95"]), 1),
            "workflow_names_p95_ms": round(names["p95"], 1)}


# ---------------------------------------------------------------- migrating in place


def before_history(server_url: str) -> Database:
    """A schema of its own as the migrations before 0017_history leave it."""
    name = f"bench_{uuid.uuid4().hex[:12]}"
    migrated_before(server_url, name, "0017")
    return Database(server_url, name)


def migrate_in_place(finished: int, runs: int) -> dict:
    server_url = find_server()
    db = before_history(server_url)
    try:
        began = time.monotonic()
        fill(db, FILL_HOT, finished, dt.datetime.now(dt.UTC) - dt.timedelta(days=30), dt.timedelta(days=1))
        with db.connect() as conn:
            conn.execute("VACUUM ANALYZE everystep_workflow")
            conn.execute("VACUUM ANALYZE everystep_step")
        fill_s = time.monotonic() - began
        settle(db)
        # A supervisor of a version before 0032 (its code from git: later ones need the queue tables of
        # 0032), its drain running across the migration.
        with harness.scratch() as folder, harness.supervisor(db, "history-migrate", folder, migrate=False,
                                                             code=previous_release(folder / "previous",
                                                                                   before="0032")):
            # Scheduled as the version before does (its insert).
            with db.connect() as conn:
                conn.execute("INSERT INTO everystep_workflow (id, name, args, status)"
                             " SELECT gen_random_uuid(), %s, jsonb_build_array(n), 'scheduled'"
                             " FROM generate_series(1, %s) AS n", (NAME, runs))
                conn.execute("SELECT pg_notify('everystep:' || current_schema(), '')")
            time.sleep(0.3)
            with db.connect() as conn:
                started = time.monotonic()
                everystep.db.migrate(conn)
                migration_s = time.monotonic() - started
            harness.wait_drained(db)
            gap = db.value("SELECT extract(epoch FROM max(d)) FROM (SELECT completed_at - lag(completed_at)"
                           " OVER (ORDER BY completed_at) AS d FROM everystep_workflow_all"
                           " WHERE completed_at > now() - interval '1 day') g")
            moving = time.monotonic()
            deadline = moving + 1800
            while db.value("SELECT EXISTS (SELECT FROM everystep_workflow WHERE status = 'completed'"
                           " AND created_at < now() - interval '1 day')"):
                if time.monotonic() > deadline:
                    raise TimeoutError("the finished runs did not move in 30 minutes")
                time.sleep(0.5)
            move_s = time.monotonic() - moving
            failed = harness.failures(db)
        return {"migrate_finished_runs": finished, "migrate_fill_s": round(fill_s, 1),
                "migration_s": round(migration_s, 3), "drain_longest_pause_s": round(float(gap or 0), 3),
                "move_s": round(move_s, 1), "moved_runs_per_s": round(finished / max(move_s, 1e-9)),
                "migrate_not_completed": failed}
    finally:
        db.close()
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {db.schema} CASCADE")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--history", type=int, default=10_000_000)
    parser.add_argument("--runs", type=int, default=5000)
    parser.add_argument("--migrate", type=int, default=1_000_000, help="finished runs before the migration")
    parser.add_argument("--repeat", type=int, default=3, help="w1 drains on empty tables and with the history: "
                        "the figures are medians")
    args = harness.arguments(parser, quick=QUICK)
    with harness.schema() as db, harness.scratch() as folder, harness.supervisor(db, "history", folder):
        empty = w1_median(db, args.runs, 0, args.repeat)
        fill_s, start = history_weeks(db, args.history)
        if not args.quick:  # (a minute's wait: quick mode only proves the benchmark works)
            moved(db)  # the empty drains' runs, a minute after they ended
        full = w1_median(db, args.runs, args.repeat * args.runs, args.repeat)
        pages = ui_pages(db)
        # The oldest week and the first half hour of the next expire.
        bound = start + dt.timedelta(days=7, minutes=30)
        age = (dt.datetime.now(dt.UTC) - bound).total_seconds()
        policy = {"completed": age, "failed": age}
        applied: dict = {}

        def remove() -> None:
            began = time.monotonic()
            with db.connect() as conn:
                applied["result"] = retention.apply(conn, policy)
            applied["seconds"] = time.monotonic() - began

        remover = threading.Thread(target=remove)
        remover.start()
        during = w1(db, args.runs, 2 * args.repeat * args.runs)
        remover.join()
        result = applied["result"]
        failed = db.value("SELECT count(*) FROM everystep_workflow_all WHERE status <> 'completed'"
                          " AND created_at > now() - interval '1 day'")
    figures = {
        "benchmark": "history",
        "history": args.history,
        "runs": args.runs,
        "fill_s": round(fill_s, 1),
        "runs_per_s_empty": round(empty, 1),
        "runs_per_s_with_history": round(full, 1),
        "with_history_over_empty": round(full / empty, 3),
        "target_with_history_over_empty": 0.95,
        "retention_removed": result.removed,
        "retention_dropped_partitions": result.dropped_weeks,
        "retention_s": round(applied["seconds"], 2),
        "target_retention_s": 5,
        "runs_per_s_during_retention": round(during, 1),
        "during_retention_over_with_history": round(during / full, 3),
        "target_during_retention": 0.9,
        **pages,
        "target_page_ms": 50,
        "not_completed": failed,
    }
    figures.update(migrate_in_place(args.migrate, args.runs))
    harness.emit(figures)


if __name__ == "__main__":
    main()
