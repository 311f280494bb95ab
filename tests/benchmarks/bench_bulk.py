"""bulk: w1 (N one-step runs drained by a supervisor's 2 workers x 8
threads) while a bulk cancel by attribute works through B waiting runs
(100,000 by default; everystep.operations.bulk, chunks of 100), against w1
alone before and after it (target >= 0.8): the bulk action's short
transactions must not slow the hot path down. Also the bulk action's runs
per second, and its longest chunk.

python -m tests.benchmarks.bench_bulk [--bulk B] [--runs N] [--quick]
Prints one JSON line."""

from __future__ import annotations

import argparse
import threading
import time

from everystep import operations
from tests.benchmarks import harness, workflows

QUICK = {"bulk": 2_000, "runs": 300}
NAME = "tests.benchmarks.workflows.one_step"

# B runs of a tenant that left, waiting for a day: no worker claims them.
FILL = """
INSERT INTO everystep_workflow (id, name, args, status, due_at, attributes)
SELECT gen_random_uuid(), %(name)s, jsonb_build_array(n), 'waiting', everystep_now() + interval '1 day',
       '{"tenant": "gone"}'::jsonb
FROM generate_series(1, %(runs)s) AS n
"""


def w1(db, runs: int, offset: int) -> float:
    started = harness.schedule_all(db, workflows.one_step, [(offset + i,) for i in range(runs)])
    harness.wait_drained(db)
    # The last run completed (the cancelled ones end too, with their own times).
    last = db.value("SELECT max(completed_at) FROM everystep_workflow_all WHERE status = 'completed'")
    return runs / (last.timestamp() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bulk", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=5_000)
    args = harness.arguments(parser, QUICK)
    with harness.schema() as db, harness.scratch() as folder, harness.supervisor(db, "bulk", folder):
        with db.connect() as conn:
            conn.execute(FILL, {"name": NAME, "runs": args.bulk})
            conn.execute("VACUUM ANALYZE everystep_workflow")
        before = w1(db, args.runs, 0)
        outcome: list = []
        bulk_began = time.monotonic()

        def cancel() -> None:
            with db.connect() as conn:
                outcome.append(operations.bulk("cancel", {"attributes": {"tenant": "gone"}}, dry_run=False,
                                               actor="bench", conn=conn))
            outcome.append(time.monotonic() - bulk_began)

        worker = threading.Thread(target=cancel)
        worker.start()
        while not db.value("SELECT done FROM everystep_bulk") and worker.is_alive():
            time.sleep(0.01)
        during = w1(db, args.runs, args.runs)
        during_bulk = worker.is_alive()  # the drain ended before the bulk action did
        worker.join()
        after = w1(db, args.runs, 2 * args.runs)
        alone = (before + after) / 2
        done = outcome[0]
        cancelled = db.value("SELECT count(*) FROM everystep_workflow_all WHERE status = 'cancelled'")
        failed = harness.failures(db) - cancelled  # the w1 runs that did not complete
    harness.emit({
        "benchmark": "bulk",
        "bulk": args.bulk,
        "runs": args.runs,
        "chunk": operations.BULK_CHUNK,
        "w1_runs_per_s_alone": round(alone, 1),
        "w1_runs_per_s_before": round(before, 1),
        "w1_runs_per_s_after": round(after, 1),
        "w1_runs_per_s_during_bulk": round(during, 1),
        "during_over_alone": round(during / alone, 3),
        "target": 0.8,
        "drain_within_bulk": during_bulk,
        "bulk_s": round(outcome[1], 1),
        "bulk_runs_per_s": round(done.done / outcome[1], 1),
        "bulk_done": done.done,
        "cancelled": cancelled,
        "not_completed": failed,
    })


if __name__ == "__main__":
    main()
