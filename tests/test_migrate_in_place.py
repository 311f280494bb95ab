"""A database of the previous version migrates in place with `everystep
migrate`, its runs in flight keep running: delayed, sleeping, waiting for a
message, held mid-step by a live worker of the previous version (its code
from git), and graphs (one sealed, its fan-in waiting for a completed member
and one held mid-step; one open), beside 100,000 finished runs in the
history; each finishes as it would have without the migration, under that
worker and one of this version."""

from __future__ import annotations

import subprocess
import sys
import uuid

import everystep
from everystep import dags
from everystep.ids import uuid7_many
from tests.apps.cli_workflows import greet
from tests.apps.flow_workflows import mailbox
from tests.apps.time_workflows import sleeper
from tests.apps.workflows import held
from tests.support.migrations import migrated_before, previous_release
from tests.support.processes import ROOT, WorkerProcess, wait_for

# The first migration the previous version did not have.
FIRST_NEW = "0042"
HISTORY = 100_000


def fill_history(db, count: int) -> None:
    """`count` finished one-step runs of greet, in the history's partitions:
    written in the hot tables (their defaults) and moved there at once."""
    ids = uuid7_many(count)
    with db.connect() as conn:
        for week in {ids[0], ids[-1]}:
            conn.execute("SELECT everystep_history_partition(everystep_history_week(%s))", (week,))
        conn.execute(
            "INSERT INTO everystep_workflow (id, name, args, status, result, completed_at)"
            " SELECT id, 'tests.apps.cli_workflows.greet', '[\"x\"]', 'completed', '\"hello X\"', now()"
            " FROM unnest(%s::uuid[]) AS id", (ids,))
        conn.execute(
            "INSERT INTO everystep_step (workflow_id, step_id, name, args, kwargs, status, result)"
            " SELECT id, '1', 'tests.apps.cli_workflows.shout', '[\"x\"]', '{}', 'done', '\"X\"'"
            " FROM unnest(%s::uuid[]) AS id", (ids,))
        conn.execute("WITH s AS (DELETE FROM everystep_step RETURNING *) INSERT INTO everystep_step_history"
                     " SELECT * FROM s")
        conn.execute("WITH w AS (DELETE FROM everystep_workflow RETURNING *) INSERT INTO everystep_workflow_history"
                     " SELECT * FROM w")


# Graphs made by the previous version's code (its statements fit its schema).
GRAPHS = """
import sys, everystep, psycopg
from everystep import dags
from tests.apps.cli_workflows import greet
from tests.apps.workflows import held
url, marks, release = sys.argv[1:4]
with psycopg.connect(url) as conn, everystep.transaction(conn):
    wave = dags.create("wave")
    first = wave.add(greet, "first", key="first")
    middle = wave.add(held, marks, release, key="middle")
    wave.add(greet, "fan-in", key="fan-in", depends_on=[first, middle])
    wave.seal()
    dags.create("open").add(greet, "open", key="only")
"""


def schedule(db, fn, *args, **options) -> uuid.UUID:
    with db.connect() as conn, everystep.transaction(conn):
        return everystep.schedule(fn, *args, **options).id


def test_a_database_of_the_previous_version_with_runs_in_flight_migrates_in_place(server_url, tmp_path):
    from everystep.testing import server  # noqa: PLC0415
    from tests.conftest import Database  # noqa: PLC0415

    schema = f"t_{uuid.uuid4().hex[:12]}"
    migrated_before(server_url, schema, FIRST_NEW)
    db = Database(server_url, schema)
    worker = new_worker = None
    imports = ("tests.apps.workflows", "tests.apps.time_workflows", "tests.apps.flow_workflows",
               "tests.apps.cli_workflows")
    try:
        fill_history(db, HISTORY)
        marks, release = tmp_path / "marks", tmp_path / "release"
        marks.mkdir()
        sleeping = schedule(db, sleeper, str(marks), 10.0)
        waiting = schedule(db, mailbox, str(marks), 1)
        mid_step = [schedule(db, held, str(marks), str(release)) for _ in range(2)]
        previous = previous_release(tmp_path / "previous")
        subprocess.run([sys.executable, "-c", GRAPHS, db.url, str(marks), str(release)], cwd=previous, check=True,
                       timeout=60)
        member = dict(db.query("SELECT key, run_id FROM everystep_dag_member"))
        worker = WorkerProcess(db.url, "before", tmp_path / "logs", threads=4, imports=imports, cwd=previous)
        wait_for(lambda: db.run(sleeping)["status"] == "waiting" and db.run(waiting)["status"] == "waiting",
                 60, what="the sleeping and the waiting run parked")
        wait_for(lambda: all(db.run(run)["status"] == "running" for run in mid_step)
                 and db.run(member["first"])["status"] == "completed"
                 and (marks / "steps").exists() and (marks / "steps").read_text().count(" held ") == 3, 60,
                 what="the runs held mid-step, and the graph's first member completed")
        assert db.run(member["fan-in"])["status"] == db.run(member["only"])["status"] == "waiting"
        delayed = schedule(db, greet, "later", after=3)
        assert db.run(sleeping)["status"] == db.run(delayed)["status"] == "waiting"  # not due yet

        done = subprocess.run([sys.executable, "-m", "everystep.cli", "--database-url", db.url, "migrate"],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert db.value("SELECT count(*) FROM everystep_migration WHERE name >= %s", (FIRST_NEW,)) >= 1
        # The fan-in's edge from the completed member, met, is gone (the previous worker deleted it); the other waits.
        assert db.value("SELECT array_agg(depends_on) FROM everystep_dependency") == [member["middle"]]

        new_worker = WorkerProcess(db.url, "after", tmp_path / "logs", threads=4, imports=imports)
        with db.connect() as conn, everystep.transaction(conn):
            everystep.send(waiting, "in", "hello", conn=conn)
        with db.connect() as conn, everystep.transaction(conn):
            dags.create("open", conn=conn).seal()  # a graph left open by the previous version, sealed by this one
        release.touch()
        wait_for(lambda: all(db.run(run)["status"] == "completed"
                             for run in [delayed, sleeping, waiting, *mid_step, *member.values()]), 60,
                 what="every run finished")
        assert db.run(member["fan-in"])["result"] == "hello FAN-IN"
        assert db.value("SELECT count(*) FROM everystep_dependency") == 0  # every edge met, deleted
        assert db.run(delayed)["result"] == "hello LATER"
        assert db.run(sleeping)["result"] == "slept"
        assert db.run(waiting)["result"] == ["hello"]
        assert all(db.run(run)["result"] == "held" for run in mid_step)
        # Each step ran once (the held ones were not started again), and the
        # history reads as before.
        assert db.value("SELECT count(*) FROM everystep_step WHERE workflow_id = ANY(%s) AND name LIKE %s",
                        ([*mid_step, member["middle"]], "%.hold")) == 3
        assert db.value("SELECT count(*) FROM everystep_workflow_history") == HISTORY
        assert db.value("SELECT count(*) FROM everystep_workflow_all WHERE status = 'completed'") == HISTORY + 9
        assert db.value("SELECT count(*) FROM everystep_execution") == 0  # no execution was lost or requeued
        # Nothing is left waiting nor held in the queue's tables.
        assert db.value("SELECT (SELECT count(*) FROM everystep_ready) + (SELECT count(*) FROM everystep_timer)"
                        " + (SELECT count(*) FROM everystep_blocked) + (SELECT count(*) FROM everystep_claimed)") == 0
    finally:
        for process in (worker, new_worker):
            if process is not None:
                process.close()
        server.drop(db, server_url)


def test_migration_0034_deletes_the_edges_0033_marked_met(server_url):
    """0033 kept a met edge, marked; from 0034 on an edge in the table is one
    not met, so the migration deletes the marked ones and keeps the others."""
    from everystep.testing import server  # noqa: PLC0415
    from tests.conftest import Database  # noqa: PLC0415

    schema = f"t_{uuid.uuid4().hex[:12]}"
    migrated_before(server_url, schema, "0034")
    db = Database(server_url, schema)
    try:
        done, waiting, dependent = uuid7_many(3)
        with db.connect() as conn:
            conn.execute("INSERT INTO everystep_dependency (depends_on, run_id, met) VALUES (%s, %s, true),"
                         " (%s, %s, false)", (done, dependent, waiting, dependent))
        with db.connect() as conn:
            everystep.db.migrate(conn)
        assert db.query("SELECT depends_on, run_id FROM everystep_dependency") == [(waiting, dependent)]
    finally:
        server.drop(db, server_url)
