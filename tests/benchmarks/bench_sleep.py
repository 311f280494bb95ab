"""sleep: what time costs. Idle workers (a supervisor, 2 processes x 8 threads):

- wake-up latency: runs scheduled with `after=` a second or two, and runs
  that `everystep.sleep()` a second or two (parked, their slot given back),
  from the due time (the database's clock) to the first step after it
  starting (the worker's clock, on the same host): p50, p99. Target p99 < 100 ms.
- the cost of many sleeping runs: N runs parked in a sleep of an hour, then a
  window of W seconds in which the fleet's CPU seconds (the supervisor and
  all its children, from /proc) and the database's transactions (xact_commit
  of a database of the benchmark's own, so no other client counts) are
  measured — per second, in two windows one after the other (the first may
  still see the parking's after-effects: autovacuum, statistics reported
  late), and against a window with no sleeping run at all.

python -m tests.benchmarks.bench_sleep [--probes N] [--sleeping N] [--window S] [--quick]
Prints one JSON line."""

import argparse
import contextlib
import time
from collections.abc import Iterator

import psycopg
from psycopg import conninfo

import everystep
import everystep.db
from tests.benchmarks import harness, workflows
from tests.conftest import Database, find_server
from tests.support.supervisor_process import children_of, cpu_seconds

QUICK = {"probes": 5, "sleeping": 200, "window": 1.0, "quiet": 0.5}


DATABASE = "everystep_bench_sleep"


@contextlib.contextmanager
def own_database() -> Iterator[Database]:
    """A database of its own (its pg_stat_database row counts only our
    clients), its public schema made again and migrated. The database is
    kept between runs: dropping one forces a checkpoint of the whole server
    (seconds of writes, which every other client of the server shares).
    Runs on one server take turns (a session advisory lock)."""
    server_url = find_server()
    with psycopg.connect(server_url, autocommit=True) as turn:
        turn.execute("SELECT pg_advisory_lock(hashtextextended(%s, 0))", (DATABASE,))
        if not turn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,)).fetchone():
            turn.execute(f"CREATE DATABASE {DATABASE}")
        database = Database(conninfo.make_conninfo(server_url, dbname=DATABASE), "public")
        try:
            with database.connect() as conn:
                conn.execute("DROP SCHEMA IF EXISTS public CASCADE")
                conn.execute("CREATE SCHEMA public")
                everystep.db.migrate(conn)
            yield database
        finally:
            database.close()


def fleet_cpu(pid: int) -> float:
    total = cpu_seconds(pid)
    for child in children_of(pid):
        with contextlib.suppress(FileNotFoundError):
            total += cpu_seconds(child)
    return total


def commits(db: Database) -> int:
    with db.connect() as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        return conn.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
                            ).fetchone()[0]


def window(db: Database, pid: int, seconds: float) -> tuple[float, float]:
    """(fleet CPU seconds per second, database commits per second) over a window."""
    cpu, xacts = fleet_cpu(pid), commits(db)
    time.sleep(seconds)
    cpu, xacts = fleet_cpu(pid) - cpu, commits(db) - xacts - 2  # minus our own two reads of the counter
    return cpu / seconds, xacts / seconds


def latencies(db: Database, probes: int) -> tuple[list[float], list[float]]:
    """Delayed starts and sleeps, one at a time ~0.2 s apart, due 1 to 2 s later: ms late each."""
    delayed, slept = {}, {}
    with db.connect(autocommit=False) as conn:
        for i in range(probes):
            with everystep.transaction(conn):
                delayed[everystep.schedule(workflows.latency_probe, after=1 + i % 5 / 5).id] = None
                slept[everystep.schedule(workflows.sleep_probe, 1 + i % 5 / 5).id] = None
            time.sleep(0.2)
    deadline = time.monotonic() + 120
    while db.value("SELECT count(*) FROM everystep_workflow WHERE status <> 'completed'"):
        if time.monotonic() > deadline:
            raise TimeoutError("probes unfinished after 120 s")
        time.sleep(0.1)
    late_start = [(started - due.timestamp()) * 1000 for started, due in db.query(
        "SELECT w.result::text::float8, w.due_at FROM everystep_workflow w WHERE w.id = ANY(%s)", (list(delayed),))]
    late_wake = [(started - wake) * 1000 for started, wake in db.query(
        "SELECT w.result::text::float8, s.result::text::float8 FROM everystep_workflow w"
        " JOIN everystep_step s ON s.workflow_id = w.id AND s.name = 'everystep.sleep' WHERE w.id = ANY(%s)",
        (list(slept),))]
    return late_start, late_wake


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--probes", type=int, default=100, help="delayed starts and sleeps each")
    parser.add_argument("--sleeping", type=int, default=10_000, help="runs sleeping while the cost is measured")
    parser.add_argument("--window", type=float, default=20.0, help="seconds the cost is measured over")
    parser.add_argument("--quiet", type=float, default=11.0,
                        help="seconds of rest before each window (a session's statistics come up to 10 s late)")
    args = harness.arguments(parser, quick=QUICK)

    with own_database() as db, harness.scratch() as folder, harness.supervisor(db, "sleep", folder) as sup:
        time.sleep(args.quiet)  # at rest: connections made, pools filled, their statistics reported
        idle_cpu, idle_xacts = window(db, sup.pid, args.window)
        late_start, late_wake = latencies(db, args.probes)

        started = time.monotonic()
        with db.connect(autocommit=False) as conn, everystep.transaction(conn):
            for _ in range(args.sleeping):
                everystep.schedule(workflows.sleep_probe, 3600)
        while db.value("SELECT count(*) FROM everystep_workflow WHERE status = 'waiting'") < args.sleeping:
            if time.monotonic() - started > 600:
                raise TimeoutError("the runs did not all park within 600 s")
            time.sleep(0.2)
        parked_s = time.monotonic() - started
        # Autovacuum would otherwise count its work on the 10,000 new rows in the window.
        with db.connect() as conn:
            conn.execute("VACUUM ANALYZE everystep_workflow, everystep_step")
        # A session's statistics reach pg_stat_database up to 10 s after its
        # last transaction (PGSTAT_IDLE_INTERVAL): let the parking's arrive first.
        time.sleep(args.quiet)
        sleeping_cpu, sleeping_xacts = window(db, sup.pid, args.window)
        # Again: what remains of the parking (autovacuum, statistics reported late) is over by now.
        later_cpu, later_xacts = window(db, sup.pid, args.window)
        not_completed = db.value("SELECT count(*) FROM everystep_workflow WHERE status NOT IN ('completed', 'waiting')")
    start_cuts, wake_cuts = harness.percentiles(late_start), harness.percentiles(late_wake)
    harness.emit({
        "benchmark": "sleep",
        "probes": args.probes,
        "delayed_start_late_p50_ms": round(start_cuts["p50"], 1),
        "delayed_start_late_p99_ms": round(start_cuts["p99"], 1),
        "sleep_wake_late_p50_ms": round(wake_cuts["p50"], 1),
        "sleep_wake_late_p99_ms": round(wake_cuts["p99"], 1),
        "target_p99_ms": 100.0,
        "sleeping_runs": args.sleeping,
        "parked_in_s": round(parked_s, 1),
        "window_s": args.window,
        "fleet_cpu_s_per_s_idle": round(idle_cpu, 4),
        "fleet_cpu_s_per_s_sleeping": round(sleeping_cpu, 4),
        "db_commits_per_s_idle": round(idle_xacts, 2),
        "db_commits_per_s_sleeping": round(sleeping_xacts, 2),
        "fleet_cpu_s_per_s_sleeping_later": round(later_cpu, 4),
        "db_commits_per_s_sleeping_later": round(later_xacts, 2),
        "not_completed": not_completed,
    })


if __name__ == "__main__":
    main()
