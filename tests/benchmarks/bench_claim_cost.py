"""claim_cost: what features present in the tables but unused by a run cost
it. w1 (one-step runs drained by a real supervisor's 2 worker processes x 8
threads) with, scheduled before the w1 runs, 1,000 due runs of a limited
workflow whose only slot is taken (900 runs and the children of the next),
100 parents waiting on those children, 1,000 runs sleeping for an hour, and
1,000 runs of priorities 5 to 7 sleeping for an hour —
divided by w1 on empty tables. Each repeat measures both, on schemas of
their own, one right after the other; the figures are medians.

python -m tests.benchmarks.bench_claim_cost [--runs N] [--repeat N] [--quick]
Prints one JSON line (target: ratio >= 0.95)."""

from __future__ import annotations

import argparse
import time

import everystep
import everystep.db
from tests.benchmarks import harness, workflows

LIMITED = workflows.one_step_limited_1.__everystep_workflow__
HOLDER = "claim-cost-holder"  # a live claimer (its lock held here) running the limited workflow's one run


def features(db: harness.Database, due_limited: int, parents: int, sleeping: int, prioritized: int):
    """Fill the tables; returns the connection that holds the slot's claimer alive."""
    holder = db.connect()
    assert everystep.db.try_lock(holder, HOLDER)
    everystep.db.apply_limits(holder, {LIMITED: 1})
    with db.connect(autocommit=False) as conn, everystep.transaction(conn):
        everystep.schedule(workflows.one_step_limited_1, -1)
    assert len(everystep.db.claim(holder, HOLDER, 1, everystep.db.routes_of([LIMITED]))) == 1  # the slot is taken
    with db.connect(autocommit=False) as conn, everystep.transaction(conn):
        everystep.schedule_many(workflows.one_step_limited_1, [(i,) for i in range(due_limited - parents)])
        everystep.schedule_many(workflows.parent_of_limited, [(i,) for i in range(parents)])
        for i in range(sleeping):
            everystep.schedule(workflows.one_step, i, after=3600)
        for i in range(prioritized):
            everystep.schedule(workflows.one_step, i, after=3600, priority=5 + i % 3)
    return holder


def parked_parents(db: harness.Database) -> int:
    return db.value("SELECT count(*) FROM everystep_workflow WHERE status = 'waiting' AND waiting_on LIKE 'child:%%'")


def drain_rate(runs: int, repeat: int, with_features: bool, sizes: dict) -> float:
    with harness.schema() as db, harness.scratch() as folder:
        holder = features(db, **sizes) if with_features else None
        try:
            with harness.supervisor(db, "claim_cost", folder):
                if holder is not None:
                    deadline = time.monotonic() + 60
                    while parked_parents(db) < sizes["parents"]:
                        assert time.monotonic() < deadline, "the parents did not park"
                        time.sleep(0.05)
                started = harness.schedule_all(db, workflows.one_step, [(repeat * runs + i,) for i in range(runs)])
                deadline = time.monotonic() + 600
                while db.value("SELECT count(*) FROM everystep_workflow WHERE name = %s AND status <> 'completed'"
                               " AND due_at <= now()", (workflows.one_step.__everystep_workflow__,)):
                    assert time.monotonic() < deadline, "w1 did not drain"
                    time.sleep(0.05)
                last = db.value("SELECT max(completed_at) FROM everystep_workflow WHERE name = %s",
                                (workflows.one_step.__everystep_workflow__,)).timestamp()
                return runs / (last - started)
        finally:
            if holder is not None:
                holder.close()


def main() -> None:
    parser = argparse.ArgumentParser(description="claim_cost: w1 with unused features present / without")
    parser.add_argument("--runs", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=3, help="repeats; the figures are medians")
    parser.add_argument("--due-limited", type=int, default=1000)
    parser.add_argument("--parents", type=int, default=100)
    parser.add_argument("--sleeping", type=int, default=1000)
    parser.add_argument("--prioritized", type=int, default=1000, help="runs of priorities 5-7 sleeping for an hour")
    args = harness.arguments(parser, quick={"runs": 200, "repeat": 1, "due_limited": 50, "parents": 5,
                                            "sleeping": 50, "prioritized": 50})
    sizes = {"due_limited": args.due_limited, "parents": args.parents, "sleeping": args.sleeping,
             "prioritized": args.prioritized}
    empty, present, ratios = [], [], []
    for repeat in range(args.repeat):
        empty.append(drain_rate(args.runs, repeat, False, sizes))
        present.append(drain_rate(args.runs, repeat, True, sizes))
        ratios.append(present[-1] / empty[-1])
    harness.emit({
        "benchmark": "claim_cost",
        "runs": args.runs,
        "repeat": args.repeat,
        **sizes,
        "runs_per_s_empty": round(harness.median(empty), 1),
        "runs_per_s_with_features": round(harness.median(present), 1),
        "ratio": round(harness.median(ratios), 3),
        "target": 0.95,
        "runs_per_s_empty_each": [round(r, 1) for r in empty],
        "runs_per_s_with_features_each": [round(r, 1) for r in present],
    })


if __name__ == "__main__":
    main()
