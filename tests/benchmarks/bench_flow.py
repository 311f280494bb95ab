"""flow: (1) messages: runs parked in everystep.wait_for on an idle fleet
(2 processes x 8 threads); a message sent to each, one by one ~20 ms apart,
each in its own transaction; the time from the send's commit (when commit()
returned) to the body resuming (the step after the wait starts; same host's
clock). (2) concurrency limits: the same one-step runs drained unlimited,
under a limit as large as the fleet's 16 slots (the cost of the limit's
bookkeeping), and under a limit of 4 (a queue behind the limit), in runs/s.

python -m tests.benchmarks.bench_flow [--messages N] [--runs N] [--quick]
Prints one JSON line."""

import argparse
import time

import everystep
from tests.benchmarks import harness, workflows

QUICK = {"messages": 10, "runs": 150}


def drain_rate(db, workflow, runs: int) -> float:
    """Runs/s from the commit of `runs` scheduled runs to the last completion."""
    committed = harness.schedule_all(db, workflow, [(i,) for i in range(runs)])
    harness.wait_drained(db)
    return runs / max(harness.last_completion(db) - committed, 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=200)
    parser.add_argument("--runs", type=int, default=3000)
    parser.add_argument("--gap", type=float, default=0.02, help="seconds between two sends")
    args = harness.arguments(parser, quick=QUICK)

    with harness.schema() as db, harness.scratch() as folder, harness.supervisor(db, "flow", folder):
        probes = [run.id for run in db.schedule_many(workflows.message_probe, [()] * args.messages)]
        deadline = time.monotonic() + 60
        while db.value("SELECT count(*) FROM everystep_workflow WHERE status = 'waiting'") < len(probes):
            if time.monotonic() > deadline:
                raise TimeoutError("the probes did not all park")
            time.sleep(0.05)
        time.sleep(0.5)  # at rest
        sent = {}
        with db.connect(autocommit=False) as conn:
            for run in probes:
                with everystep.transaction(conn):
                    everystep.send(run, "go", None)
                sent[run] = time.time()
                time.sleep(args.gap)
        harness.wait_drained(db)
        resumed = dict(db.query("SELECT workflow_id, result::text::float8 FROM everystep_step WHERE step_id = '2'"))
        latencies_ms = [(resumed[run] - at) * 1000 for run, at in sent.items() if run in resumed]

        unlimited = drain_rate(db, workflows.one_step, args.runs)
        limited = drain_rate(db, workflows.one_step_limited, args.runs)
        limited_4 = drain_rate(db, workflows.one_step_limited_4, args.runs)
        not_completed = harness.failures(db)  # every run of the schema, the probes included
        leftover = db.query(
            "SELECT name, status, count(*) FROM everystep_workflow WHERE status <> 'completed' GROUP BY 1, 2"
        )
    cuts = harness.percentiles(latencies_ms)
    harness.emit({
        "benchmark": "flow",
        "messages": args.messages,
        "send_to_resume_p50_ms": round(cuts["p50"], 3),
        "send_to_resume_p95_ms": round(cuts["p95"], 3),
        "send_to_resume_p99_ms": round(cuts["p99"], 3),
        "runs": args.runs,
        "unlimited_runs_per_s": round(unlimited, 1),
        "limited_16_runs_per_s": round(limited, 1),
        "limited_16_vs_unlimited": round(limited / unlimited, 3),
        "limited_4_runs_per_s": round(limited_4, 1),
        "not_completed": not_completed,
        "leftover": [list(row) for row in leftover],
    })


if __name__ == "__main__":
    main()
