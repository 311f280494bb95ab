"""growth: what a large history costs. w1 (N one-step runs drained by a
supervisor's 2 workers x 8 threads) on empty tables, then again with H
finished runs (a step row each) in the tables (target: within 10%), then
`everystep prune` of those H runs while the supervisor drains another w1
batch: the prune's seconds and the w1 figure during it (the prune deletes
in short batches and skips locked rows, so workers are not blocked).

python -m tests.benchmarks.bench_growth [--history H] [--runs N] [--quick]
Prints one JSON line."""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time

from tests.benchmarks import harness, workflows

QUICK = {"history": 20000, "runs": 500}
CHUNK = 100_000  # history rows per transaction while filling


def w1(db, runs: int, offset: int) -> float:
    started = harness.schedule_all(db, workflows.one_step, [(offset + i,) for i in range(runs)])
    harness.wait_drained(db)
    return runs / (harness.last_completion(db) - started)


def fill(db, history: int) -> None:
    """`history` runs completed 30 days ago, each with its step row."""
    with db.connect() as conn:
        for start in range(0, history, CHUNK):
            count = min(CHUNK, history - start)
            conn.execute(
                "WITH runs AS (INSERT INTO everystep_workflow (id, name, args, status, result, created_at,"
                "  completed_at)"
                " SELECT gen_random_uuid(), 'tests.benchmarks.workflows.one_step', jsonb_build_array(n), 'completed',"
                "  to_jsonb(n), now() - interval '30 days', now() - interval '30 days'"
                " FROM generate_series(%s::int, %s::int) AS n RETURNING id, args)"
                " INSERT INTO everystep_step (workflow_id, step_id, name, args, kwargs, status, result)"
                " SELECT id, '1', 'tests.benchmarks.workflows.noop', args, '{}', 'done', args->0 FROM runs",
                (start, start + count - 1),
            )
        conn.execute("VACUUM ANALYZE everystep_workflow")
        conn.execute("VACUUM ANALYZE everystep_step")


def prune(db) -> float:
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "everystep", "--database-url", db.url, "prune", "--older-than", "7"],
                   check=True, capture_output=True)
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--history", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=5000)
    args = harness.arguments(parser, quick=QUICK)
    with harness.schema() as db, harness.scratch() as folder, harness.supervisor(db, "growth", folder):
        empty = w1(db, args.runs, 0)
        fill_started = time.monotonic()
        fill(db, args.history)
        fill_s = time.monotonic() - fill_started
        full = w1(db, args.runs, args.runs)
        pruned: dict[str, float] = {}
        pruning = threading.Thread(target=lambda: pruned.update(seconds=prune(db)))
        pruning.start()
        during = w1(db, args.runs, 2 * args.runs)
        pruning.join()
        left = db.value("SELECT count(*) FROM everystep_workflow WHERE completed_at < now() - interval '7 days'")
        failed = harness.failures(db)
    harness.emit({
        "benchmark": "growth",
        "history": args.history,
        "runs": args.runs,
        "fill_s": round(fill_s, 1),
        "runs_per_s_empty": round(empty, 1),
        "runs_per_s_with_history": round(full, 1),
        "with_history_over_empty": round(full / empty, 3),
        "target_with_history_over_empty": 0.9,
        "prune_s": round(pruned["seconds"], 1),
        "runs_per_s_during_prune": round(during, 1),
        "left_after_prune": left,
        "not_completed": failed,
    })


if __name__ == "__main__":
    main()
