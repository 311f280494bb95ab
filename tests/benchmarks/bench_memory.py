"""memory: resident set size (VmRSS) of a supervisor and each of its children,
at rest (booted, idle for a second) and the peak under the w3 load (2,000
three-step runs drained by 2 workers x 8 threads), sampled every 50 ms.
Target: a worker child at rest < 60 MB.

python -m tests.benchmarks.bench_memory [--runs N] [--quick]
Prints one JSON line."""

import argparse
import time

from tests.benchmarks import harness, workflows
from tests.support.supervisor_process import children_of

QUICK = {"runs": 200}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=2000)
    args = harness.arguments(parser, quick=QUICK)

    with harness.schema() as db, harness.scratch() as folder, harness.supervisor(db, "memory", folder) as pod:
        time.sleep(1.0)
        processes = {"supervisor": pod.pid}
        for pid, title in children_of(pod.pid).items():
            processes[" ".join(title.split()[1:3])] = pid  # "worker memory-0", "http", "maintenance"
        at_rest = {name: harness.rss_mb(pid) for name, pid in processes.items()}
        peak = dict(at_rest)
        harness.schedule_all(db, workflows.three_steps, [(i,) for i in range(args.runs)])
        while harness.unfinished(db):
            for name, pid in processes.items():
                peak[name] = max(peak[name], harness.rss_mb(pid))
            time.sleep(0.05)
    workers_at_rest = [mb for name, mb in at_rest.items() if name.startswith("worker")]
    harness.emit({
        "benchmark": "memory",
        "runs": args.runs,
        "rss_mb_at_rest": at_rest,
        "rss_mb_peak_under_w3": peak,
        "worker_at_rest_max_mb": max(workers_at_rest),
        "target_worker_at_rest_mb": 60,
    })


if __name__ == "__main__":
    main()
