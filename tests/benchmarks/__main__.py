"""Run every benchmark, one after the other, each printing its JSON line.

python -m tests.benchmarks [--quick] [NAME ...]      e.g. NAME = w1 latency

--quick proves in seconds that they still work (CI); without it, the full
figures take a few minutes. Exit status 1 if any benchmark failed."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = (
    "limit", "w1", "w3", "w3_write_behind", "w1_async", "w3_async", "latency", "enqueue", "fleet", "growth",
    "recovery", "memory", "scrape", "supervisor_scrape", "ui", "sleep", "flow", "claim_cost", "priority", "fairness",
    "rate_limit", "charts", "history", "held_back", "write_cost", "sustained", "stream", "attributes", "bulk", "dag",
)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", choices=[[], *BENCHMARKS], metavar="NAME",
                        help=f"benchmarks to run (default: all of {', '.join(BENCHMARKS)})")
    parser.add_argument("--quick", action="store_true", help="small sizes: prove they work in seconds")
    args = parser.parse_args()
    failed = []
    for name in args.names or BENCHMARKS:
        command = [sys.executable, "-m", f"tests.benchmarks.bench_{name}"] + (["--quick"] if args.quick else [])
        done = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        sys.stdout.write(done.stdout)
        sys.stdout.flush()
        if done.returncode != 0:
            failed.append(name)
    if failed:
        print(f"benchmarks failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
