"""`everystep roles`: the producer may only schedule, the worker runs
workflows but cannot resolve a step, the operator acts."""

from __future__ import annotations

import subprocess
import sys
import uuid

import psycopg
import pytest

import everystep
import everystep.db
from everystep import api
from everystep.errors import EverystepError
from tests.apps import ui_workflows
from tests.apps.flow_workflows import mailbox, publisher
from tests.support.processes import ROOT, wait_for
from tests.test_ui import blocked_run


@pytest.fixture
def roles(db, server_url):
    """The three roles, with names of this test's own, applied to its schema
    with the CLI; dropped at the end."""
    prefix = f"t{uuid.uuid4().hex[:10]}_"
    result = subprocess.run([sys.executable, "-m", "everystep.cli", "--database-url", db.url, "roles", "--apply",
                             "--prefix", prefix, "--schema", db.schema], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    yield prefix
    with psycopg.connect(server_url, autocommit=True) as conn:
        for role in ("producer", "worker", "operator"):
            conn.execute(f"DROP OWNED BY {prefix}{role}")
            conn.execute(f"DROP ROLE {prefix}{role}")


def as_role(db, role: str) -> psycopg.Connection:
    conn = db.connect()
    conn.execute(f"SET ROLE {role}")
    return conn


def test_roles_prints_the_sql(db):
    result = subprocess.run([sys.executable, "-m", "everystep.cli", "roles"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0
    assert "CREATE ROLE everystep_producer NOLOGIN" in result.stdout
    assert "ENABLE ROW LEVEL SECURITY" in result.stdout
    bad = subprocess.run([sys.executable, "-m", "everystep.cli", "roles", "--prefix", "x; DROP"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1


def test_producer_schedules_but_cannot_modify_a_run(db, roles):
    [existing] = db.schedule_many(ui_workflows.slow, [(0.0,)])
    with as_role(db, f"{roles}producer") as conn:
        with everystep.transaction(conn):
            run = everystep.schedule(ui_workflows.slow, 0.0, idempotency_key="k-1")
        with everystep.transaction(conn):
            again = everystep.schedule(ui_workflows.slow, 0.0, idempotency_key="k-1")
        assert again.id == run.id and not again.created
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("UPDATE everystep_workflow SET status = 'completed' WHERE id = %s", (existing.id,))
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("DELETE FROM everystep_workflow WHERE id = %s", (existing.id,))
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("SELECT args FROM everystep_workflow")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):  # a run inserted as already done
            conn.execute("INSERT INTO everystep_workflow (id, name, args, status)"
                         " VALUES (%s, 'x.y', '[]', 'completed')", (uuid.uuid4(),))
    assert db.run(existing.id)["status"] == "scheduled"


def test_worker_runs_workflows_but_cannot_resolve_a_step(db, roles):
    [run] = db.schedule_many(ui_workflows.nested, [(2,)])
    blocked = blocked_run(db)
    with as_role(db, f"{roles}worker") as conn:
        claimed = everystep.db.claim(conn, "role-runner", 10)
        assert [c.id for c in claimed] == [run.id]
    assert db.resume_held("role-runner") != {}  # (run as the owner here: the pool is the test's)
    with as_role(db, f"{roles}worker") as conn:
        with pytest.raises(EverystepError, match="no run"):  # the blocked run is not the worker's to change
            api.resolve_step(conn, blocked, "1", result="charged")
        assert conn.execute("UPDATE everystep_step SET status = 'done' WHERE workflow_id = %s",
                            (blocked,)).rowcount == 0
        assert conn.execute("UPDATE everystep_workflow SET status = 'scheduled' WHERE id = %s",
                            (blocked,)).rowcount == 0
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("DELETE FROM everystep_step WHERE workflow_id = %s", (blocked,))
    assert db.run(blocked)["status"] == "blocked" and db.steps(blocked)[0]["status"] == "started"
    with as_role(db, f"{roles}operator") as conn:
        api.resolve_step(conn, blocked, "1", result="charged")
        everystep.db.audit(conn, "ops", "cli", "resolve-step", blocked, "1")
    assert db.run(blocked)["status"] == "scheduled"


def test_a_worker_process_runs_as_the_worker_role(db, roles, tmp_path):
    """The whole engine under the worker role: claim, steps, forks, the end."""
    from psycopg import conninfo  # noqa: PLC0415

    from tests.support.processes import WorkerProcess, wait_for  # noqa: PLC0415

    url = conninfo.make_conninfo(db.url, options=f"-c search_path={db.schema} -c role={roles}worker")
    runs = db.schedule_many(ui_workflows.nested, [(n,) for n in range(3)])
    worker = WorkerProcess(url, "role-worker", tmp_path / "logs", imports=("tests.apps.ui_workflows",))
    try:
        wait_for(lambda: all(db.run(r.id)["status"] == "completed" for r in runs), 30, what="the runs to complete")
    finally:
        worker.signal(15)
        worker.proc.wait(30)


def test_producer_schedules_a_delayed_run_that_a_worker_claims_when_due(db, roles):
    with as_role(db, f"{roles}producer") as conn, everystep.transaction(conn):
        run = everystep.schedule(ui_workflows.slow, 0.0, after=0.5)
    assert db.run(run.id)["status"] == "waiting"
    with as_role(db, f"{roles}worker") as conn:
        assert everystep.db.claim(conn, "role-runner", 10) == []  # not due yet
        deadline = db.run(run.id)["due_at"]
        wait_for(lambda: db.value("SELECT now()") >= deadline, timeout=10)
        assert [c.id for c in everystep.db.claim(conn, "role-runner", 10)] == [run.id]


def test_producer_sends_messages_and_reads_events(db, roles, marks):
    [published] = db.schedule_many(publisher, [(marks,)])
    db.run_pending()  # publishes "stage" twice
    [waiting] = db.schedule_many(mailbox, [(marks, 1)])  # not started: a message waits for it
    with as_role(db, f"{roles}producer") as conn:
        with everystep.transaction(conn):
            everystep.send(waiting.id, "in", {"hello": 1}, idempotency_key="m-1")
        with everystep.transaction(conn):
            everystep.send(waiting.id, "in", {"hello": 1}, idempotency_key="m-1")  # the same key sends once
        assert everystep.get_event(published.id, "stage", 1, conn=conn) == "second"
    with db.connect() as conn:
        assert [m["payload"] for m in everystep.db.load_messages(conn, waiting.id)] == [{"hello": 1}]


def test_a_worker_keeps_tracebacks_and_an_operator_reads_them(db, roles, tmp_path):
    from psycopg import conninfo  # noqa: PLC0415

    from tests.apps import console_workflows  # noqa: PLC0415
    from tests.support.processes import WorkerProcess, wait_for  # noqa: PLC0415

    url = conninfo.make_conninfo(db.url, options=f"-c search_path={db.schema} -c role={roles}worker")
    [run] = db.schedule_many(console_workflows.pay_then_deliver, [("o-1",)])
    worker = WorkerProcess(url, "role-worker", tmp_path / "logs", imports=("tests.apps.console_workflows",))
    try:
        wait_for(lambda: db.run(run.id)["status"] == "failed", 30, what="the run to fail")
    finally:
        worker.signal(15)
        worker.proc.wait(30)
    with as_role(db, f"{roles}operator") as conn:
        [found] = everystep.db.step_tracebacks(conn, run.id)
    assert found["step_id"] == "4" and "ValueError: no address for o-1" in found["traceback"]
def test_a_worker_role_releases_and_cancels_graph_members_an_operator_wrote(db, roles, tmp_path):
    from psycopg import conninfo  # noqa: PLC0415

    from everystep import dags  # noqa: PLC0415
    from tests.apps.dag_workflows import fail, produce  # noqa: PLC0415
    from tests.support.processes import WorkerProcess  # noqa: PLC0415

    with as_role(db, f"{roles}operator") as conn, everystep.transaction(conn):
        g = dags.create("roles")
        ok = g.add(produce, 1, key="ok")
        bad = g.add(fail, "x", key="bad")
        after_ok = g.add(produce, 2, key="after-ok", depends_on=[ok])
        after_bad = g.add(produce, 3, key="after-bad", depends_on=[bad])
        g.seal()
    url = conninfo.make_conninfo(db.url, options=f"-c search_path={db.schema} -c role={roles}worker")
    worker = WorkerProcess(url, "role-worker", tmp_path / "logs", imports=("tests.apps.dag_workflows",))
    try:
        wait_for(lambda: db.run(after_ok.run_id)["status"] == "completed", 30, what="the released member")
        wait_for(lambda: db.run(after_bad.run_id)["status"] == "cancelled", 30, what="the cancelled member")
    finally:
        worker.signal(15)
        worker.proc.wait(30)
    assert db.run(after_bad.run_id)["cancel_reason"] == "dependency bad failed"


def test_a_role_that_does_not_own_the_queue_tables_leaves_them_to_autovacuum(db, roles, caplog):
    """The maintenance loop's vacuum of the queue's tables is for their owner
    (another role's VACUUM is refused): under a role of the three it says so
    once and does not try."""
    import logging  # noqa: PLC0415

    from psycopg import conninfo  # noqa: PLC0415

    from everystep.maintenance import Maintenance  # noqa: PLC0415

    caplog.set_level(logging.INFO, logger="everystep")
    loop = Maintenance(db.url)
    for role in ("worker", "operator"):
        url = conninfo.make_conninfo(db.url, options=f"-c search_path={db.schema} -c role={roles}{role}")
        with psycopg.connect(url, autocommit=True) as conn:
            assert everystep.db.queue_dead_tuples(conn)[0] is False
            notices: list[str] = []
            conn.add_notice_handler(lambda notice, notices=notices: notices.append(notice.message_primary))
            loop._vacuum_queue(conn)
            loop._vacuum_queue(conn)
            assert notices == []  # no VACUUM tried: it would warn that it skips the tables
    assert caplog.text.count("vacuumed by autovacuum alone") == 1
    with db.connect() as conn:
        assert everystep.db.queue_dead_tuples(conn)[0] is True  # the owner (here a superuser) may
