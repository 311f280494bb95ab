"""attributes: searching runs by one attribute among H runs of history
(10,000,000 by default), each with attributes {"tenant": "t<n % 1000>",
"order": n}, bulk-generated (INSERT ... SELECT generate_series) into ten
weekly partitions of the history, the GIN index built afterwards:

- the first page (100 runs, newest first) of everystep.find_runs by one
  tenant (1 run in 1,000 has it) and by one order (1 run has it), p95 of 30
  random values each (target <= 50 ms);
- what the index costs: its bytes per run with attributes, and the
  microseconds per run an insert of runs with attributes takes over the
  same insert without (the hot table's index, N runs in one statement); a
  run without attributes adds no index entry (the index is partial).

The schema is dropped afterwards (no rows are left lying around).

python -m tests.benchmarks.bench_attributes [--history H] [--inserts N] [--quick]
Prints one JSON line."""

from __future__ import annotations

import argparse
import datetime as dt
import random
import time

import everystep
from tests.benchmarks import harness
from tests.benchmarks.bench_history import AT, V7, WEEKS, fill, monday, settle, timed

QUICK = {"history": 20_000, "inserts": 1_000}
NAME = "tests.benchmarks.workflows.one_step"
TENANTS = 1000

FILL = f"""
INSERT INTO everystep_workflow_history (id, name, args, status, result, created_at, completed_at, due_at, wakes,
                                        limited, priority, keyed, attributes, dependents)
SELECT {V7.format(at=AT)}, '{NAME}', jsonb_build_array(n), 'completed', to_jsonb(n), {AT}, {AT} + interval '1 second',
       {AT}, 0, false, 0, false, jsonb_build_object('tenant', 't' || (n %% {TENANTS}), 'order', n), false
FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS n
"""

INSERT_HOT = """
INSERT INTO everystep_workflow (id, name, args, status, attributes)
SELECT gen_random_uuid(), %(name)s, jsonb_build_array(n), 'completed',
       CASE WHEN %(with)s THEN jsonb_build_object('tenant', 't' || (n %% 1000), 'order', n) END
FROM generate_series(1, %(runs)s) AS n
"""


def insert_cost(db, runs: int) -> tuple[float, float]:
    """Microseconds per run of inserting `runs` runs without, then with,
    attributes (each the best of 3), into the hot table."""
    costs = {}
    for with_attributes in (False, True):
        best = float("inf")
        for _ in range(3):
            with db.connect() as conn:
                conn.execute("DELETE FROM everystep_workflow")
                conn.execute("VACUUM everystep_workflow")
                began = time.perf_counter()
                conn.execute(INSERT_HOT, {"name": NAME, "with": with_attributes, "runs": runs})
                best = min(best, time.perf_counter() - began)
        costs[with_attributes] = best * 1e6 / runs
    with db.connect() as conn:
        conn.execute("DELETE FROM everystep_workflow")
    return costs[False], costs[True]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--history", type=int, default=10_000_000)
    parser.add_argument("--inserts", type=int, default=100_000)
    args = harness.arguments(parser, QUICK)
    with harness.schema() as db:
        start = dt.datetime.combine(monday(dt.datetime.now(dt.UTC).date()) - dt.timedelta(weeks=WEEKS + 2),
                                    dt.time(), dt.UTC)
        began = time.monotonic()
        with db.connect() as conn:
            conn.execute("SELECT everystep_history_partition((%s::date + 7 * w)) FROM generate_series(0, %s) AS w",
                         (start.date(), WEEKS))
            conn.execute("DROP INDEX everystep_workflow_history_attributes")  # built once, below
        fill(db, FILL, args.history, start, dt.timedelta(weeks=WEEKS))
        fill_s = time.monotonic() - began
        with db.connect() as conn:
            began = time.monotonic()
            conn.execute("CREATE INDEX everystep_workflow_history_attributes ON everystep_workflow_history"
                         " USING gin (attributes jsonb_path_ops) WHERE attributes IS NOT NULL")
            index_s = time.monotonic() - began
            conn.execute("VACUUM ANALYZE everystep_workflow_history")
            index_bytes = conn.execute(
                "SELECT sum(pg_relation_size(i.indexrelid)) FROM pg_inherits h"
                " JOIN pg_index i ON i.indrelid = h.inhrelid"
                " JOIN pg_class c ON c.oid = i.indexrelid"
                " WHERE h.inhparent = 'everystep_workflow_history'::regclass"
                " AND c.relname LIKE '%%attributes%%'").fetchone()[0]
        settle(db)
        rng = random.Random(7)
        with db.connect() as conn:
            tenants = iter([f"t{rng.randrange(TENANTS)}" for _ in range(30)])
            by_tenant = timed(lambda: everystep.find_runs(attributes={"tenant": next(tenants)}, conn=conn))
            orders = iter([rng.randrange(args.history) for _ in range(30)])
            by_order = timed(lambda: everystep.find_runs(attributes={"order": next(orders)}, conn=conn))
            page = everystep.find_runs(attributes={"tenant": "t7"}, conn=conn)
            next_page = timed(lambda: everystep.find_runs(attributes={"tenant": "t7"}, after=page[-1].id, conn=conn))
        without_us, with_us = insert_cost(db, args.inserts)
    harness.emit({
        "benchmark": "attributes",
        "history": args.history,
        "fill_s": round(fill_s, 1),
        "index_build_s": round(index_s, 1),
        "first_page_p95_ms": round(max(by_tenant["p95"], by_order["p95"]), 1),
        "by_tenant_p95_ms": round(by_tenant["p95"], 1),
        "by_order_p95_ms": round(by_order["p95"], 1),
        "next_page_p95_ms": round(next_page["p95"], 1),
        "target_ms": 50,
        "index_bytes_per_run": round(float(index_bytes) / args.history, 1),
        "insert_us_per_run_without": round(without_us, 2),
        "insert_us_per_run_with": round(with_us, 2),
        "page_size": len(page),
    })


if __name__ == "__main__":
    main()
