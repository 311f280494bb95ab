"""Restarts, the way the arbiter sees them: fork a child that records the
metrics a worker records and exits, reap it, mark it dead. Run with
PROMETHEUS_MULTIPROC_DIR set to the folder.

python -m tests.apps.obs_restarts FOLDER RESTARTS RUNNERS [--stock]

--stock marks children dead the way prometheus_client alone does (no archive),
for comparison in the benchmark."""

import argparse
import os
import time

from prometheus_client import multiprocess

from everystep import metrics
from supervisor import metrics_dir


def record(runner: str) -> None:
    metrics.POOL_SIZE.labels(runner).set(8)
    metrics.INFLIGHT.labels(runner).set(1)
    metrics.STARTED_AT.labels(runner).set(time.time())
    metrics.CLAIMS.labels(runner).inc()
    metrics.WORKFLOW_RUNS.labels("demo.flow", "completed").inc()
    metrics.STEP_RUNS.labels("demo.flow", "demo.step", "done").inc()
    metrics.STEP_DURATION.labels("demo.flow", "demo.step").observe(0.02)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("restarts", type=int)
    parser.add_argument("runners", type=int)
    parser.add_argument("--stock", action="store_true")
    args = parser.parse_args()
    for i in range(args.restarts):
        pid = os.fork()
        if pid == 0:
            record(f"web-0-{i % args.runners}")
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            raise SystemExit(f"child {pid} ended with status {status}")
        if args.stock:
            multiprocess.mark_process_dead(pid, args.folder)
        else:
            metrics_dir.mark_dead(args.folder, pid)


if __name__ == "__main__":
    main()
