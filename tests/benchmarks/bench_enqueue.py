"""enqueue: scheduling at volume, against the raw commit ceiling (`limit`)
measured in the same run.

- `schedule()` one run per transaction from 16 concurrent clients (2 processes
  x 8 threads, one connection each: the shape of the limit's Python clients),
  for S seconds: runs/s with no worker waiting for runs (no NOTIFY) and with
  one waiting (every transaction notifies; a row in everystep_waiting stands
  for the idle worker, so no worker takes CPU from the clients).
- the same scheduling statement driven by pgbench (16 clients, C): what the
  server alone can take, with and without the NOTIFY.
- `schedule_many()` of N runs in one transaction: runs/s (target >= 50,000).

python -m tests.benchmarks.bench_enqueue [--seconds S] [--many N] [--repeat N] [--quick]
Prints one JSON line."""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time

import psycopg
from psycopg import conninfo

import everystep
from tests.benchmarks import harness, workflows

QUICK = {"seconds": 1.0, "many": 5000, "repeat": 1}
# The statement schedule() runs (everystep.db.insert_run), for pgbench.
_SCHEDULE_SQL = (
    "WITH ins AS (INSERT INTO everystep_workflow (id, name, args, idempotency_key, status)"
    " VALUES (gen_random_uuid(), 'tests.benchmarks.workflows.one_step', '[1]'::jsonb, NULL, 'scheduled')"
    " ON CONFLICT (name, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING RETURNING id)"
    " SELECT id, everystep_wake() FROM ins;\n"
)


def set_waiting(db, waiting: bool) -> None:
    db.query("DELETE FROM everystep_waiting RETURNING runner")
    if waiting:
        db.query("INSERT INTO everystep_waiting (runner) VALUES ('an idle worker') RETURNING runner")


def python_clients(db, seconds: float) -> float:
    """Runs/s of 2 processes x 8 threads, each scheduling one run per transaction."""

    def schedule_one(client: int, conn: psycopg.Connection) -> None:
        with everystep.transaction(conn):
            everystep.schedule(workflows.one_step, client)

    return harness.clients_rate(db.url, seconds, schedule_one)


def pgbench_clients(db, seconds: float) -> float:
    with tempfile.NamedTemporaryFile("w", suffix=".sql") as f:
        f.write(_SCHEDULE_SQL)
        f.flush()
        info = conninfo.conninfo_to_dict(db.url)
        env = {**os.environ, "PGOPTIONS": f"-c search_path={db.schema}"}
        command = [harness.PGBENCH, "-n", "-M", "prepared", "-c", str(harness.CLIENTS), "-j", "2",
                   "-T", str(max(1, round(seconds))), "-f", f.name, "-h", info.get("host", "127.0.0.1"),
                   "-p", str(info.get("port", 5432)), "-U", info.get("user", "postgres"), info.get("dbname", "test")]
        out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return float(out.split("tps = ")[1].split()[0])


def schedule_many_rate(db, runs: int) -> float:
    args_list = [(i,) for i in range(runs)]
    with db.connect(autocommit=False) as conn:
        started = time.perf_counter()
        with everystep.transaction(conn):
            everystep.schedule_many(workflows.one_step, args_list)
        return runs / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--many", type=int, default=50000, help="runs of the schedule_many transaction")
    parser.add_argument("--repeat", type=int, default=3, help="repeats; the figures are their medians")
    args = harness.arguments(parser, quick=QUICK)
    figures: dict[str, list[float]] = {key: [] for key in (
        "limit", "quiet", "notified", "pgbench_quiet", "pgbench_notified", "many")}
    for _ in range(args.repeat):
        figures["limit"].append(harness.commit_ceiling(args.seconds))
        with harness.schema() as db:
            for waiting in (False, True):
                set_waiting(db, waiting)
                suffix = "notified" if waiting else "quiet"
                figures[suffix].append(python_clients(db, args.seconds))
                if harness.PGBENCH:
                    figures["pgbench_" + suffix].append(pgbench_clients(db, args.seconds))
            set_waiting(db, False)
            figures["many"].append(schedule_many_rate(db, args.many))
    medians = {key: round(harness.median(values), 1) if values else None for key, values in figures.items()}
    limit = medians["limit"]

    def ratio(key: str) -> float | None:
        return round(medians[key] / limit, 3) if medians[key] is not None else None

    harness.emit({
        "benchmark": "enqueue",
        "clients": harness.CLIENTS,
        "seconds": args.seconds,
        "repeat": args.repeat,
        "limit_commits_per_s": limit,
        "limit_driver": harness.ceiling_driver(),
        "runs_per_s": medians["quiet"],
        "ratio": ratio("quiet"),
        "runs_per_s_notified": medians["notified"],
        "ratio_notified": ratio("notified"),
        "pgbench_runs_per_s": medians["pgbench_quiet"],
        "pgbench_runs_per_s_notified": medians["pgbench_notified"],
        "schedule_many_runs": args.many,
        "schedule_many_runs_per_s": medians["many"],
        "target_schedule_many_runs_per_s": 50000,
        "each": {key: [round(v, 1) for v in values] for key, values in figures.items()},
    })


if __name__ == "__main__":
    main()
