"""fleet: 4 supervisors x 2 workers x 4 threads against one PostgreSQL.
(4 threads, not 8: 4 x 2 x 8 pooled connections would take most of a
default server's max_connections = 100, which the test server shares.)

- Drain: N one-step runs scheduled in one transaction (schedule_many),
  drained by one supervisor (2 x 4), then by the fleet of 4 (fresh schema each):
  runs/s of each (from the commit to the last completion) and their ratio
  (no collapse from contention: >= 1), and the fleet's claim statements that
  found nothing per completed run (target <= 0.1).
- Fan-out: the fleet idle; K runs scheduled one per transaction, 20 ms apart:
  notifications the workers received per scheduling transaction (every
  listening worker receives every notification), and empty claims per run.

Counts come from the supervisors' /metrics (everystep_worker_*_total).

python -m tests.benchmarks.bench_fleet [--runs N] [--supervisors S] [--trickle K] [--quick]
Prints one JSON line."""

from __future__ import annotations

import argparse
import contextlib
import time

import everystep
from tests.benchmarks import harness, workflows
from tests.support.scraping import get, samples

QUICK = {"runs": 400, "trickle": 10}
THREADS = 4


def counters(supervisors: list) -> dict[str, float]:
    """Sums over the fleet of the workers' claim and notification counters."""
    totals = {"claims": 0.0, "empty_claims": 0.0, "notifications": 0.0}
    for sup in supervisors:
        _, text = get(f"http://127.0.0.1:{sup.port}/metrics")
        for (name, _), value in samples(text).items():
            for key in totals:
                if name == f"everystep_worker_{key}_total":
                    totals[key] += value
    return totals


def drain(runs: int, supervisors: int, trickled: int = 0) -> tuple[float, dict[str, float], int]:
    """runs/s of `supervisors` supervisors draining `runs` runs; counter deltas; failures."""
    with harness.schema() as db, harness.scratch() as folder, contextlib.ExitStack() as stack:
        fleet = [stack.enter_context(harness.supervisor(db, f"fleet{i}", folder / str(i), ready=False,
                                                        workers={"threads": THREADS}))
                 for i in range(supervisors)]
        for sup in fleet:  # started together, then waited for
            harness.wait_ready(sup)
        time.sleep(1.0)  # at rest: pools filled, every worker waiting
        before = counters(fleet)
        started = schedule_many(db, runs)
        harness.wait_drained(db)
        rate = runs / (harness.last_completion(db) - started)
        time.sleep(1.5)  # the last claims and notifications reach the metrics
        after = counters(fleet)
        deltas = {key: after[key] - before[key] for key in after}
        if trickled:
            deltas.update(trickle(db, fleet, trickled))
        return rate, deltas, harness.failures(db)


def schedule_many(db, runs: int) -> float:
    with db.connect(autocommit=False) as conn, everystep.transaction(conn):
        everystep.schedule_many(workflows.one_step, [(i,) for i in range(runs)])
    return time.time()


def trickle(db, fleet: list, count: int) -> dict[str, float]:
    """Notifications received and empty claims per run scheduled one by one to the idle fleet."""
    before = counters(fleet)
    with db.connect(autocommit=False) as conn:
        for i in range(count):
            harness.schedule_in(conn, workflows.one_step, i)
            time.sleep(0.02)
    harness.wait_drained(db)
    time.sleep(1.5)
    after = counters(fleet)
    return {
        "trickle_notifications_per_schedule": (after["notifications"] - before["notifications"]) / count,
        "trickle_empty_claims_per_run": (after["empty_claims"] - before["empty_claims"]) / count,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20000)
    parser.add_argument("--supervisors", type=int, default=4)
    parser.add_argument("--trickle", type=int, default=50, help="runs scheduled one by one to the idle fleet")
    args = harness.arguments(parser, quick=QUICK)
    limit = harness.commit_ceiling(5.0 if args.runs >= 5000 else 1.0)
    one_rate, _, one_failed = drain(args.runs, 1)
    fleet_rate, fleet, fleet_failed = drain(args.runs, args.supervisors, args.trickle)
    harness.emit({
        "benchmark": "fleet",
        "runs": args.runs,
        "supervisors": args.supervisors,
        "workers": args.supervisors * harness.PROCESSES,
        "threads": THREADS,
        "limit_commits_per_s": round(limit, 1),
        "runs_per_s_one_supervisor": round(one_rate, 1),
        "runs_per_s": round(fleet_rate, 1),
        "fleet_over_one": round(fleet_rate / one_rate, 3),
        "empty_claims_per_run": round(fleet["empty_claims"] / args.runs, 4),
        "target_empty_claims_per_run": 0.1,
        "notifications_during_drain": fleet["notifications"],
        "trickle_runs": args.trickle,
        "notifications_per_schedule": round(fleet["trickle_notifications_per_schedule"], 2),
        "trickle_empty_claims_per_run": round(fleet["trickle_empty_claims_per_run"], 2),
        "not_completed": one_failed + fleet_failed,
    })


if __name__ == "__main__":
    main()
