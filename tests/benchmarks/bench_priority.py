"""priority: how long a high-priority run waits behind a backlog. A real
supervisor (2 worker processes x 8 threads) drains a backlog of one-step
runs; meanwhile, one at a time, runs of priority 100 are scheduled, and each
one's pickup latency is the time from its commit to its claim (the database's
clock: created_at to its step's started_at, the step being its first act).

python -m tests.benchmarks.bench_priority [--backlog N] [--probes N] [--quick]
Prints one JSON line (target: p50 and max pickup <= 50 ms)."""

from __future__ import annotations

import argparse
import time

import everystep
from tests.benchmarks import harness, workflows


def main() -> None:
    parser = argparse.ArgumentParser(description="priority: pickup latency of urgent runs behind a backlog")
    parser.add_argument("--backlog", type=int, default=50_000)
    parser.add_argument("--probes", type=int, default=20)
    args = harness.arguments(parser, quick={"backlog": 3000, "probes": 5})
    with harness.schema() as db, harness.scratch() as folder:
        with db.connect(autocommit=False) as conn, everystep.transaction(conn):
            for start in range(0, args.backlog, 10_000):
                everystep.schedule_many(workflows.one_step, [(i,) for i in range(start, min(args.backlog,
                                                                                           start + 10_000))])
        probes, left = [], []
        with harness.supervisor(db, "priority", folder):
            for i in range(args.probes):
                time.sleep(0.2)
                left.append(db.value("SELECT count(*) FROM everystep_workflow WHERE status = 'scheduled'"))
                probes.append(harness.schedule_in_with(db, workflows.one_step, -1 - i, priority=100))
            deadline = time.monotonic() + 120
            while db.value("SELECT count(*) FROM everystep_workflow WHERE id = ANY(%s) AND status = 'completed'",
                           (probes,)) < len(probes):
                assert time.monotonic() < deadline, "the urgent runs did not complete"
                time.sleep(0.05)
            latencies = [row[0] * 1000 for row in db.query(
                "SELECT extract(epoch FROM s.started_at - w.created_at)::float8 FROM everystep_workflow w"
                " JOIN everystep_step s ON s.workflow_id = w.id WHERE w.id = ANY(%s)", (probes,))]
    harness.emit({
        "benchmark": "priority",
        "backlog": args.backlog,
        "probes": args.probes,
        "backlog_left_min": min(left),
        "pickup_ms_p50": round(harness.median(latencies), 1),
        "pickup_ms_max": round(max(latencies), 1),
        "target_ms": 50,
    })


if __name__ == "__main__":
    main()
