"""Throughput (w1, w3, and w1_async, w3_async with async workflows and steps):
runs scheduled up front in one transaction, drained by a real supervisor's 2
worker processes x 8 run slots (threads, or async slots), each repeat right
after a measurement of the raw commit ceiling, so every ratio compares
figures taken minutes apart at most on this noisy machine."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from tests.benchmarks import harness


def main(benchmark: str, workflow: Callable, steps_per_run: int, runs: int, target: float,
         **supervisor: dict | list) -> None:
    """`supervisor`: sections of the supervisor's config (and `imports`)."""
    parser = argparse.ArgumentParser(description=f"{benchmark}: drain {runs} runs of {steps_per_run} step(s)")
    parser.add_argument("--runs", type=int, default=runs)
    parser.add_argument("--repeat", type=int, default=3, help="repeats; the figures are medians")
    parser.add_argument("--ceiling-seconds", type=float, default=5.0)
    args = harness.arguments(parser, quick={"runs": 200, "repeat": 1, "ceiling_seconds": 1.0})

    limits, runs_per_s, ratios, db_cpu, worker_cpu, failed = [], [], [], [], [], 0
    with (harness.schema() as db, harness.scratch() as folder,
          harness.supervisor(db, benchmark, folder, **supervisor) as fleet):
        meter = harness.CpuMeter(db, fleet.pid)
        for repeat in range(args.repeat):
            limits.append(harness.commit_ceiling(args.ceiling_seconds))
            started = harness.schedule_all(db, workflow, [(repeat * args.runs + i,) for i in range(args.runs)])
            meter.start()
            harness.wait_drained(db)
            database_seconds, worker_seconds = meter.stop()
            runs_per_s.append(args.runs / (harness.last_completion(db) - started))
            ratios.append(runs_per_s[-1] * steps_per_run / limits[-1])
            db_cpu.append(database_seconds * 1e6 / args.runs)
            worker_cpu.append(worker_seconds * 1e6 / args.runs)
        failed = harness.failures(db)
    rate = harness.median(runs_per_s)
    harness.emit({
        "benchmark": benchmark,
        "runs": args.runs,
        "steps_per_run": steps_per_run,
        "repeat": args.repeat,
        "runs_per_s": round(rate, 1),
        "steps_per_s": round(rate * steps_per_run, 1),
        "limit_commits_per_s": round(harness.median(limits), 1),
        "limit_driver": harness.ceiling_driver(),
        "ratio": round(harness.median(ratios), 3),  # (w1: runs/s, w3: steps/s) / limit commits/s
        "target": target,
        # CPU per run, in microseconds, of the engine's PostgreSQL backends and
        # of its worker processes: what the figures above cost, whatever else
        # the machine was doing.
        "db_cpu_us_per_run": round(harness.median(db_cpu)),
        "worker_cpu_us_per_run": round(harness.median(worker_cpu)),
        "runs_per_s_each": [round(r, 1) for r in runs_per_s],
        "limit_each": [round(x, 1) for x in limits],
        "not_completed": failed,
        "tracing": harness.TRACING,
    })
