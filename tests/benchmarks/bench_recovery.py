"""recovery: 16 runs in flight on supervisor A (2 workers x 8 threads, every
slot busy) when its whole process tree is SIGKILLed, as a lost pod. A second
supervisor B (another name), already up and idle, recovers them through its
dead-claimer sweep. Seconds from the kill until all 16 are running again under
B, and until all completed; the bound is recovery.interval + recovery.grace
(the sockets of a killed process on this host close at once, so keepalive
detection adds nothing here). Target: < interval + grace + 2 s.

python -m tests.benchmarks.bench_recovery [--interval S] [--grace S] [--quick]
Prints one JSON line."""

import argparse
import time

from tests.benchmarks import harness, workflows
from tests.support.processes import wait_for

QUICK = {"interval": 0.5, "grace": 1.5}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--interval", type=float, default=5.0, help="recovery.interval (default: the shipped 5)")
    parser.add_argument("--grace", type=float, default=10.0, help="recovery.grace (default: the shipped 10)")
    args = harness.arguments(parser, quick=QUICK)
    recovery = {"interval": args.interval, "grace": args.grace, "max_crashes": 3}
    runs = harness.CLIENTS

    def running_under(name: str) -> int:
        return db.value("SELECT count(*) FROM everystep_workflow WHERE status = 'running' AND claimed_by LIKE %s",
                        (f"{name}-%",))

    with harness.schema() as db, harness.scratch() as folder:
        release = folder / "release"
        with harness.supervisor(db, "pod-a", folder, recovery=recovery) as pod_a:
            harness.schedule_all(db, workflows.held_until, [(str(release),)] * runs)
            wait_for(lambda: running_under("pod-a") == runs, 30, interval=0.01, what="every run held by pod-a")
            with harness.supervisor(db, "pod-b", folder, recovery=recovery):
                killed = time.monotonic()
                pod_a.kill_tree()
                wait_for(lambda: running_under("pod-b") == runs, args.interval + args.grace + 30, interval=0.01,
                         what="every run held by pod-b")
                running_again = time.monotonic() - killed
                release.touch()
                wait_for(lambda: harness.unfinished(db) == 0, 30, interval=0.01, what="every run completed")
                completed = time.monotonic() - killed
        not_completed = harness.failures(db)
    harness.emit({
        "benchmark": "recovery",
        "runs": runs,
        "interval_s": args.interval,
        "grace_s": args.grace,
        "running_again_s": round(running_again, 3),
        "completed_s": round(completed, 3),
        "bound_s": args.interval + args.grace,
        "target_s": args.interval + args.grace + 2,
        "not_completed": not_completed,
    })


if __name__ == "__main__":
    main()
