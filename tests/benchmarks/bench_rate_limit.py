"""rate_limit: a fleet-wide rate limit under load. A real supervisor with 8
worker processes (2 threads each) runs 500 one-step runs whose step takes a
token of `bench-api` (config `rate_limits: {bench-api: {rate: 50, per: 1}}`).
Figures, from the step rows' started_at (the moment each took its token):
the observed rate over the whole (target: within 10% of 50/s) and the most
steps started in any 1 s window (never above burst, 50).

python -m tests.benchmarks.bench_rate_limit [--steps N] [--rate R] [--quick]
Prints one JSON line."""

from __future__ import annotations

import argparse
import datetime
import time

import everystep
from tests.benchmarks import harness, workflows


def main() -> None:
    parser = argparse.ArgumentParser(description="rate_limit: 8 workers against one fleet-wide rate limit")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--rate", type=float, default=50.0)
    parser.add_argument("--processes", type=int, default=8)
    args = harness.arguments(parser, quick={"steps": 100, "rate": 50.0, "processes": 8})
    burst = int(args.rate)
    with harness.schema() as db, harness.scratch() as folder:
        with db.connect(autocommit=False) as conn, everystep.transaction(conn):
            everystep.schedule_many(workflows.rate_limited, [(i,) for i in range(args.steps)])
        with harness.supervisor(db, "rate-limit", folder, workers={"processes": args.processes, "threads": 2},
                                rate_limits={"bench-api": {"rate": args.rate, "per": 1}}):
            deadline = time.monotonic() + 600
            while db.value("SELECT count(*) FROM everystep_workflow WHERE status <> 'completed'"):
                assert time.monotonic() < deadline, "the rate-limited runs did not complete"
                time.sleep(0.1)
        starts = sorted(row[0] for row in db.query("SELECT started_at FROM everystep_step"))
    window = datetime.timedelta(seconds=1)
    most = max(sum(1 for t in starts[i:] if t < start + window) for i, start in enumerate(starts))
    span = (starts[-1] - starts[0]).total_seconds()
    harness.emit({
        "benchmark": "rate_limit",
        "steps": len(starts),
        "workers": args.processes,
        "rate_per_s": args.rate,
        "burst": burst,
        "observed_per_s": round((len(starts) - 1) / span, 2),
        "observed_over_rate": round((len(starts) - 1) / span / args.rate, 3),
        "max_in_any_1s": most,
        "seconds": round(span, 2),
    })


if __name__ == "__main__":
    main()
