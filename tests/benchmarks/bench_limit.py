"""limit: the raw commit ceiling of the server. 16 connections (the workers'
2 x 8 run slots) each commit one INSERT of a step-shaped row into the real
everystep_step table (unique constraint, FK to its run) as fast as they can.
Driven by pgbench (C, prepared statements) when installed, else by Python;
for comparison, also by Python clients shaped like the workers (2 processes x
8 threads, one connection each), which spend CPU of their own.

python -m tests.benchmarks.bench_limit [--seconds S] [--repeat N] [--quick]
Prints one JSON line."""

import argparse

from tests.benchmarks import harness

QUICK = {"seconds": 1.0, "repeat": 1}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--repeat", type=int, default=3, help="repeats; the figure is their median")
    args = harness.arguments(parser, quick=QUICK)
    limits, python_limits = [], []
    for _ in range(args.repeat):
        limits.append(harness.commit_ceiling(args.seconds))
        python_limits.append(harness.commit_ceiling(args.seconds, driver="python"))
    harness.emit({
        "benchmark": "limit",
        "clients": harness.CLIENTS,
        "seconds": args.seconds,
        "repeat": args.repeat,
        "driver": harness.ceiling_driver(),
        "commits_per_s": round(harness.median(limits), 1),
        "commits_per_s_each": [round(x, 1) for x in limits],
        "python_clients_commits_per_s": round(harness.median(python_limits), 1),
    })


if __name__ == "__main__":
    main()
