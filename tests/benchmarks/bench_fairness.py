"""fairness: a fair queue under one big tenant. A workflow with
concurrency_per_key=4 has a key with a big backlog (100,000 due runs) and
nine keys with 10 runs each, scheduled after it; a real supervisor (2 worker
processes x 8 threads) drains them. Figures: how many of the big key's runs
had completed when the nine keys' last run completed (target: < 1,000), how
long the nine took, and the most runs of one key ever running at once (from
the step rows' started/finished times; the limit is 4).

python -m tests.benchmarks.bench_fairness [--big N] [--keys N] [--each N] [--quick]
Prints one JSON line."""

from __future__ import annotations

import argparse
import time

import everystep
from tests.benchmarks import harness, workflows

PER_KEY = 4


def most_at_once(db: harness.Database, key: str) -> int:
    moments = sorted(db.query(
        "SELECT m, d FROM (SELECT s.started_at AS m, 1 AS d FROM everystep_step s"
        " JOIN everystep_workflow w ON w.id = s.workflow_id WHERE w.concurrency_key = %(k)s"
        " UNION ALL SELECT s.finished_at, -1 FROM everystep_step s"
        " JOIN everystep_workflow w ON w.id = s.workflow_id WHERE w.concurrency_key = %(k)s) AS e", {"k": key}))
    now = highest = 0
    for _moment, delta in moments:
        now += delta
        highest = max(highest, now)
    return highest


def main() -> None:
    parser = argparse.ArgumentParser(description="fairness: small keys beside one big key")
    parser.add_argument("--big", type=int, default=100_000)
    parser.add_argument("--keys", type=int, default=9)
    parser.add_argument("--each", type=int, default=10)
    args = harness.arguments(parser, quick={"big": 3000, "keys": 9, "each": 10})
    keyed = workflows.one_step_keyed
    small = [f"tenant:{i}" for i in range(args.keys)]
    with harness.schema() as db, harness.scratch() as folder:
        with harness.supervisor(db, "fairness", folder):  # its workers write the per-key limit
            with db.connect(autocommit=False) as conn, everystep.transaction(conn):
                for start in range(0, args.big, 10_000):
                    everystep.schedule_many(keyed, [(i,) for i in range(start, min(args.big, start + 10_000))],
                                            concurrency_key="tenant:big")
            with db.connect(autocommit=False) as conn, everystep.transaction(conn):
                for key in small:
                    everystep.schedule_many(keyed, [(i,) for i in range(args.each)], concurrency_key=key)
            started = time.time()
            deadline = time.monotonic() + 600
            while db.value("SELECT count(*) FROM everystep_workflow WHERE concurrency_key = ANY(%s)"
                           " AND status <> 'completed'", (small,)):
                assert time.monotonic() < deadline, "the small keys did not finish"
                time.sleep(0.02)
            small_s = time.time() - started
            last_small = db.value("SELECT max(completed_at) FROM everystep_workflow WHERE concurrency_key = ANY(%s)",
                                  (small,))
            big_before = db.value("SELECT count(*) FROM everystep_workflow WHERE concurrency_key = 'tenant:big'"
                                  " AND status = 'completed' AND completed_at <= %s", (last_small,))
            time.sleep(1)
            most = max([most_at_once(db, "tenant:big"), *(most_at_once(db, key) for key in small)])
    harness.emit({
        "benchmark": "fairness",
        "big_key_runs": args.big,
        "small_keys": args.keys,
        "runs_per_small_key": args.each,
        "per_key_limit": PER_KEY,
        "big_completed_before_small_done": big_before,
        "target_big_completed_before": 1000,
        "small_keys_done_s": round(small_s, 2),
        "most_running_per_key": most,
    })


if __name__ == "__main__":
    main()
