"""write_cost: what one run costs the database and the worker, counted, not
timed. N one-step runs, then N three-step runs (each in a schema of its own)
are scheduled in one transaction, drained by a real supervisor (2 workers x 8
threads) and moved to the history; per run:

- heap tuples written: inserts, updates (of which HOT) and deletes of the
  schema's tables, from pg_stat_user_tables (read once the fleet's sessions
  have ended, which reports their counts);
- index entries written: the B-tree leaf inserts of the WAL records about the
  schema's indexes (pg_walinspect), as no statistics view counts them;
- WAL bytes: the WAL records about the schema's relations, and the commit
  records of their transactions (pg_walinspect), so what other tenants of
  the shared server write is not counted (pg_stat_wal counts the server's);
- database CPU µs and worker CPU µs (harness.CpuMeter, /proc).

python -m tests.benchmarks.bench_write_cost [--runs N] [--quick]
Prints one JSON line."""

from __future__ import annotations

import argparse
import signal
import time

import everystep.retention
from tests.benchmarks import harness, workflows
from tests.conftest import Database

# Heap and index writes per table, by the statistics collector.
TABLE_WRITES = """
SELECT relname::text, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del
FROM pg_stat_user_tables
WHERE schemaname = current_schema()
"""

# The WAL between two positions that is about this schema: its records about
# the schema's tables, indexes and their TOAST, and the commit records of the
# transactions that wrote them. B-tree leaf inserts (a split carries the new
# entry too) are index entries written; by index too.
WAL_OF_SCHEMA = """
WITH rels AS (
    SELECT pg_relation_filenode(r.oid)::text AS node, r.oid::regclass::text AS relation
    FROM pg_class c
    CROSS JOIN LATERAL (VALUES (c.oid), (c.reltoastrelid),
                               ((SELECT i.indexrelid FROM pg_index i WHERE i.indrelid = c.reltoastrelid LIMIT 1)))
        AS r(oid)
    WHERE c.relnamespace = current_schema()::regnamespace AND r.oid IS NOT NULL AND r.oid <> 0
),
records AS (
    SELECT w.xid, w.resource_manager, w.record_type, w.record_length, w.description,
           substring(w.block_ref FROM 'rel \\d+/\\d+/(\\d+)') AS node
    FROM {ext}.pg_get_wal_records_info(%(start)s::pg_lsn, least(%(end)s::pg_lsn, pg_current_wal_flush_lsn())) w
),
mine AS (
    SELECT records.*, rels.relation FROM records JOIN rels USING (node)
),
entries AS (
    SELECT relation, count(*) AS n
    FROM mine
    WHERE resource_manager = 'Btree'
      AND (record_type IN ('INSERT_LEAF', 'INSERT_POST')
           OR (record_type IN ('SPLIT_L', 'SPLIT_R') AND description LIKE 'level 0%%'))
    GROUP BY relation
)
SELECT coalesce((SELECT sum(record_length) FROM mine), 0)
       + coalesce((SELECT sum(record_length) FROM records
                   WHERE resource_manager = 'Transaction'
                     AND xid IN (SELECT xid FROM mine WHERE xid <> '0')), 0),
       (SELECT coalesce(sum(n), 0) FROM entries),
       (SELECT coalesce(jsonb_object_agg(relation, n), '{{}}') FROM entries)
"""


def walinspect(db: Database) -> str:
    """The schema holding pg_walinspect's functions: this benchmark's own
    (dropped with it), or wherever another run installed it already."""
    with db.connect() as conn:
        conn.execute(f"CREATE EXTENSION IF NOT EXISTS pg_walinspect SCHEMA {db.schema}")
        return conn.execute("SELECT extnamespace::regnamespace::text FROM pg_extension"
                            " WHERE extname = 'pg_walinspect'").fetchone()[0]


def table_writes(db: Database) -> dict[str, tuple[int, int, int, int]]:
    return {name: counts for name, *counts in db.query(TABLE_WRITES)}


def measure(workflow, runs: int) -> dict:
    """Schedule, drain and move `runs` runs of `workflow`: their writes and CPU, per run."""
    with harness.schema() as db, harness.scratch() as folder:
        ext = walinspect(db)
        with harness.supervisor(db, "write-cost", folder) as fleet:
            meter = harness.CpuMeter(db, fleet.pid)
            time.sleep(1.0)  # the workers' start-up writes are over
            before = table_writes(db)
            start = db.value("SELECT pg_current_wal_insert_lsn()::text")
            meter.start()
            harness.schedule_all(db, workflow, [(i,) for i in range(runs)])
            harness.wait_drained(db)
            with db.connect() as conn:
                while everystep.retention.archive(conn, after=0):
                    pass
            database_seconds, worker_seconds = meter.stop()
            end = db.value("SELECT pg_current_wal_insert_lsn()::text")
            # Its sessions end with it, and report their statistics as they do.
            fleet.signal(signal.SIGTERM)
            fleet.wait(60)
        time.sleep(1.0)
        after = table_writes(db)
        wal_bytes, index_entries, by_index = db.query(WAL_OF_SCHEMA.format(ext=ext), {"start": start, "end": end})[0]
        failed = harness.failures(db)
    delta = {name: [a - b for a, b in zip(counts, before.get(name, (0, 0, 0, 0)), strict=True)]
             for name, counts in after.items()}
    inserts, updates, hot, deletes = (sum(counts[i] for counts in delta.values()) for i in range(4))
    return {
        "heap_tuples": round((inserts + updates + deletes) / runs, 2),
        "inserts": round(inserts / runs, 2),
        "updates": round(updates / runs, 2),
        "hot_updates": round(hot / runs, 2),
        "deletes": round(deletes / runs, 2),
        "index_entries": round(int(index_entries) / runs, 2),
        "wal_bytes": round(int(wal_bytes) / runs),
        "db_cpu_us": round(database_seconds * 1e6 / runs),
        "worker_cpu_us": round(worker_seconds * 1e6 / runs),
        # ins/upd/hot/del per run, by table, for the table of what each statement writes
        "by_table": {name: [round(n / runs, 2) for n in counts] for name, counts in sorted(delta.items())
                     if any(counts)},
        # index entries per run, by index
        "by_index": {name: round(n / runs, 2) for name, n in sorted(by_index.items())},
        "not_completed": failed,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3000, help="runs of each shape")
    args = harness.arguments(parser, quick={"runs": 50})
    one = measure(workflows.one_step, args.runs)
    three = measure(workflows.three_steps, args.runs)
    harness.emit({
        "benchmark": "write_cost",
        "runs": args.runs,
        "one_step": one,
        "three_steps": three,
        "not_completed": one.pop("not_completed") + three.pop("not_completed"),
    })


if __name__ == "__main__":
    main()
