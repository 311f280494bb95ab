"""sustained: a backlog of one-step runs held at B runs (4,000) for S seconds
(120) while a real supervisor (2 workers x 8 threads) drains it, on a private
PostgreSQL server with autovacuum at its defaults (the shared test server
runs without it). Every half second the runs waiting to be claimed are
counted and topped up to B in one transaction; the runs done so far are the
runs scheduled less those not yet finished. Prints the throughput of the
first and of the last 30 s (target: last >= 0.9 x first), and the peak of
the dead tuples of the hot tables, with the autovacuums that ran.

python -m tests.benchmarks.bench_sustained [--backlog B] [--seconds S] [--window W] [--quick]
Prints one JSON line."""

from __future__ import annotations

import argparse
import time

import everystep
import everystep.db
from tests.benchmarks import harness, workflows
from tests.conftest import Database
from tests.support.private_postgres import PrivatePostgres

QUICK = {"backlog": 200, "seconds": 3.0, "window": 1.0}
# The runs waiting to be claimed, and those not finished: counted where a
# run waits (0032_ready.sql), small tables, not by reading the whole run
# table, which has no status index and holds every run of the last minutes
# with their dead versions (a read of it every half second grew with them,
# and the benchmark charged its own reads to the engine).
WAITING = """
SELECT r.n, r.n + (SELECT count(*) FROM everystep_claimed)
FROM (SELECT count(*) AS n FROM everystep_ready) r
"""
AUTOVACUUMS = """
SELECT coalesce(sum(autovacuum_count), 0)::int
FROM pg_stat_user_tables
WHERE schemaname = current_schema()
"""


def dead_tuples(db: Database) -> dict[str, int]:
    with db.connect() as conn:
        return {row.table: row.dead_tuples for row in everystep.db.table_health(conn)}


def hold_backlog(db: Database, backlog: int, seconds: float) -> tuple[list[tuple[float, int]], dict[str, int]]:
    """Keep `backlog` runs waiting for `seconds`: the (seconds since start,
    runs done) samples, and the peak dead tuples by hot table."""
    samples, peak, scheduled = [], {}, 0
    began = time.monotonic()
    last_health = 0.0
    while (elapsed := time.monotonic() - began) < seconds:
        waiting, unfinished = db.query(WAITING)[0]
        samples.append((elapsed, scheduled - unfinished))
        if waiting < backlog:
            more = backlog - waiting
            harness.schedule_all(db, workflows.one_step, [(scheduled + i,) for i in range(more)])
            scheduled += more
        if elapsed - last_health >= 1.0:
            last_health = elapsed
            for table, dead in dead_tuples(db).items():
                peak[table] = max(peak.get(table, 0), dead)
        time.sleep(0.5)
    _, unfinished = db.query(WAITING)[0]
    samples.append((time.monotonic() - began, scheduled - unfinished))  # the end's: at least two samples
    return samples, peak


def rate_between(samples: list[tuple[float, int]], start: float, end: float) -> float:
    """Runs done per second between two moments, from the samples nearest
    them: a sample before the last for the start, a later one for the end
    (on a slow machine the samples of a short run are few and far apart)."""
    first = min(samples[:-1], key=lambda s: abs(s[0] - start))
    last = min((s for s in samples if s[0] > first[0]), key=lambda s: abs(s[0] - end))
    return (last[1] - first[1]) / (last[0] - first[0])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backlog", type=int, default=4000)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--window", type=float, default=30.0, help="the first and last windows compared")
    args = harness.arguments(parser, quick=QUICK)
    with harness.scratch() as folder:
        server = PrivatePostgres(from_template=False)  # its only one: a template would cost more
        try:
            db = Database(server.url, "public")  # migrated by PrivatePostgres
            try:
                with harness.supervisor(db, "sustained", folder / "supervisor"):
                    samples, peak = hold_backlog(db, args.backlog, args.seconds)
                    autovacuums = db.value(AUTOVACUUMS)
            finally:
                db.close()
        finally:
            server.close()
    first = rate_between(samples, 0.0, args.window)
    last = rate_between(samples, args.seconds - args.window, args.seconds)
    harness.emit({
        "benchmark": "sustained",
        "backlog": args.backlog,
        "seconds": args.seconds,
        "window_s": args.window,
        "runs_per_s_first": round(first, 1),
        "runs_per_s_last": round(last, 1),
        "last_over_first": round(last / first, 3),
        "target": 0.9,
        "dead_tuples_peak": sum(peak.values()),
        "dead_tuples_peak_by_table": peak,
        "autovacuums": autovacuums,
        "runs_done": samples[-1][1],
    })


if __name__ == "__main__":
    main()
