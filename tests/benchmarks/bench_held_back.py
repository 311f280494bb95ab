"""held_back: w1 while another session holds a snapshot open (a REPEATABLE
READ transaction that read once and then sits idle, as an analytics query
or a forgotten session does), which keeps vacuum from removing any dead
tuple younger than it. w1 batches are drained for D seconds without it,
then for D seconds with it held: runs/s with against without (target
>= 0.8), the hot tables' dead tuples at the end, and what the alert's
metric (everystep_oldest_xmin_age_seconds) read while it was held.

python -m tests.benchmarks.bench_held_back [--seconds D] [--batch N] [--quick]
Prints one JSON line."""

from __future__ import annotations

import argparse
import time

import psycopg

import everystep.db
from tests.benchmarks import harness, workflows
from tests.conftest import Database

QUICK = {"seconds": 8.0, "batch": 300}


def drain_for(db: Database, seconds: float, batch: int, offset: int) -> tuple[float, int]:
    """w1 batches one after the other for `seconds`: runs/s, and the runs done."""
    began = time.time()
    done = 0
    while time.time() - began < seconds:
        harness.schedule_all(db, workflows.one_step, [(offset + done + i,) for i in range(batch)])
        harness.wait_drained(db)
        done += batch
    return done / (harness.last_completion(db) - began), done


def dead_tuples(db: Database) -> int:
    with db.connect() as conn:
        return sum(row.dead_tuples for row in everystep.db.table_health(conn))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=60.0, help="how long the snapshot is held")
    parser.add_argument("--batch", type=int, default=1000)
    args = harness.arguments(parser, quick=QUICK)
    with harness.schema() as db, harness.scratch() as folder, harness.supervisor(db, "held-back", folder):
        without, done = drain_for(db, args.seconds, args.batch, 0)
        dead_without = dead_tuples(db)
        holder = psycopg.connect(db.url, autocommit=False)
        try:
            holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            holder.execute("SELECT count(*) FROM everystep_workflow")  # the snapshot, then idle in transaction
            held, _ = drain_for(db, args.seconds, args.batch, done)
            with db.connect() as conn:
                horizon = everystep.db.vacuum_horizon(conn)
            dead_held = dead_tuples(db)
        finally:
            holder.close()
        failed = harness.failures(db)
    harness.emit({
        "benchmark": "held_back",
        "seconds": args.seconds,
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
