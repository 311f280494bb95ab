"""held_back: w1 while another session holds a snapshot open (a REPEATABLE
READ transaction that read once and then sits idle, as an analytics query
or a forgotten session does), which keeps vacuum from removing any dead
tuple younger than it. w1 batches are drained for D seconds without it,
then for D seconds with it held: runs/s with against without (target
>= 0.8), the hot tables' dead tuples at the end, and what the alert's
metric (everystep_oldest_xmin_age_seconds) read while it was held.

python -m tests.benchmarks.bench_held_back [--seconds D] [--batch N] [--vacuum] [--quick]
Prints one JSON line."""

from __future__ import annotations

import argparse
import time

import psycopg

import everystep
import everystep.db
from tests.benchmarks import harness, workflows
from tests.conftest import Database

QUICK = {"seconds": 3.0, "batch": 300}


def schedule_batch(db: Database, args_list: list[tuple]) -> list:
    """w1's runs in one transaction; their ids."""
    with db.connect(autocommit=False) as conn, everystep.transaction(conn):
        return [everystep.schedule(workflows.one_step, *args).id for args in args_list]


def wait_for_batch(db: Database, ids: list) -> None:
    """Until every run of the batch has finished, looked up by id. Not by a
    count over the status index (harness.wait_drained): a held snapshot
    keeps that index's dead entries too, and walking them every 50 ms took
    a fifth of the 2 cores, which the benchmark would then charge to the
    engine. By the primary key, on a session with sequential scans off: the
    tables are never analyzed here (autovacuum off), and the planner read
    the whole run table instead, 13 ms a look at 23,000 rows."""
    with db.connect() as conn:
        conn.execute("SET enable_seqscan = off")
        while conn.execute("SELECT count(*) FROM everystep_workflow WHERE id = ANY(%s)"
                           " AND status IN ('scheduled', 'running')", (ids,)).fetchone()[0]:
            time.sleep(0.05)


def drain_for(db: Database, seconds: float, batch: int, offset: int, vacuum: bool) -> tuple[float, int]:
    """w1 batches one after the other for `seconds`: runs/s, and the runs
    done. `vacuum`: a VACUUM of the hot tables after each batch, standing in
    for autovacuum (the test server runs with it off)."""
    began = time.time()
    done = 0
    while time.time() - began < seconds:
        wait_for_batch(db, schedule_batch(db, [(offset + done + i,) for i in range(batch)]))
        done += batch
        if vacuum:
            with db.connect() as conn:
                conn.execute("VACUUM everystep_workflow, everystep_step")
    return done / (harness.last_completion(db) - began), done


def dead_tuples(db: Database) -> int:
    with db.connect() as conn:
        return sum(row.dead_tuples for row in everystep.db.table_health(conn))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=60.0, help="how long the snapshot is held")
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--vacuum", action="store_true",
                        help="VACUUM the hot tables after each batch, in both phases, as autovacuum would")
    args = harness.arguments(parser, quick=QUICK)
    with harness.schema() as db, harness.scratch() as folder, harness.supervisor(db, "held-back", folder):
        without, done = drain_for(db, args.seconds, args.batch, 0, args.vacuum)
        dead_without = dead_tuples(db)
        holder = psycopg.connect(db.url, autocommit=False)
        try:
            holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            holder.execute("SELECT count(*) FROM everystep_workflow")  # the snapshot, then idle in transaction
            held, _ = drain_for(db, args.seconds, args.batch, done, args.vacuum)
            with db.connect() as conn:
                horizon = everystep.db.vacuum_horizon(conn)
            dead_held = dead_tuples(db)
        finally:
            holder.close()
        failed = harness.failures(db)
    harness.emit({
        "benchmark": "held_back",
        "seconds": args.seconds,
        "vacuum": args.vacuum,
        "runs_per_s_without": round(without, 1),
        "runs_per_s_held": round(held, 1),
        "held_over_without": round(held / without, 3),
        "target": 0.8,
        "oldest_xmin_age_seconds": round(horizon.oldest_xmin_age_seconds, 1),
        "idle_in_transaction_seconds": round(horizon.idle_in_transaction_seconds, 1),
        "dead_tuples_without": dead_without,
        "dead_tuples_held": dead_held,
        "not_completed": failed,
    })


if __name__ == "__main__":
    main()
