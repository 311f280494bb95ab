"""A child that records metrics the way a worker does, then stays alive
until killed: python -m tests.apps.obs_child RUNNER CLAIMS COMPLETED_RUNS

Run with PROMETHEUS_MULTIPROC_DIR set, as the supervisor's children are.
Prints "ready" once everything is written."""

import sys
import time

from prometheus_client import Gauge

from everystep import metrics

# Gauges in the modes everystep does not use (yet), to check how the archive
# merges them.
BIGGEST_BATCH = Gauge("test_biggest_batch", "Largest batch seen.", ["runner"], multiprocess_mode="max")
BATCHES = Gauge("test_batches", "Batches, summed over processes.", multiprocess_mode="sum")

if __name__ == "__main__":
    runner, claims, completed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    metrics.POOL_SIZE.labels(runner).set(8)
    metrics.INFLIGHT.labels(runner).set(2)
    metrics.STARTED_AT.labels(runner).set(time.time())
    metrics.CLAIMS.labels(runner).inc(claims)
    metrics.WORKFLOW_RUNS.labels("demo.flow", "completed").inc(completed)
    metrics.STEP_DURATION.labels("demo.flow", "demo.step").observe(0.02)
    BIGGEST_BATCH.labels("all").set(claims)
    BATCHES.set(1)
    print("ready", flush=True)
    while True:
        time.sleep(60)
