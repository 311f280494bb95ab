"""Workers through PgBouncer in transaction pooling: the pool keeps no
session state (no prepared statement, no session setting) while the control
session (advisory lock, LISTEN, claims) goes straight to PostgreSQL. A real
`pgbouncer` is started by the test, with fewer server connections than the
worker has pooled connections, so consecutive transactions of one client run
on different server sessions."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import psycopg
import pytest
from psycopg import conninfo

import everystep
import everystep.db
from everystep.config import ConfigError, load
from tests.apps.workflows import held, marks_of, quick, timed_steps, two_steps_behind
from tests.support.processes import WorkerProcess, wait_for
from tests.support.supervisor_process import config

PGBOUNCER = shutil.which("pgbouncer") or ("/usr/sbin/pgbouncer" if os.path.exists("/usr/sbin/pgbouncer") else None)


@pytest.fixture
def pgbouncer(db):
    """A PgBouncer in transaction mode in front of the test server; its
    server sessions are set to the test's schema (connect_query). Yields
    the URL through it."""
    if PGBOUNCER is None:
        if os.environ.get("EVERYSTEP_REQUIRE_PGBOUNCER") == "1":
            pytest.fail("pgbouncer is not installed and EVERYSTEP_REQUIRE_PGBOUNCER=1")
        print("SKIPPED: pgbouncer is not installed (apt-get install pgbouncer)")
        pytest.skip("pgbouncer is not installed (apt-get install pgbouncer)")
    server = conninfo.conninfo_to_dict(db.url)
    user = server.get("user", "postgres")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # PgBouncer refuses to run as root: then it runs as nobody, in a folder
    # nobody can reach (pytest's are private to their owner).
    folder = Path(tempfile.mkdtemp(prefix="everystep-pgbouncer-"))
    folder.chmod(0o777)
    (folder / "users.txt").write_text(f'"{user}" ""\n')
    (folder / "pgbouncer.ini").write_text(f"""
[databases]
{server.get("dbname", "test")} = host={server.get("host", "127.0.0.1")} port={server.get("port", 5432)} \
user={user} connect_query='SET search_path = {db.schema}'

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {folder}/users.txt
admin_users = {user}
pool_mode = transaction
default_pool_size = 3
max_client_conn = 200
stats_period = 1
logfile = {folder}/pgbouncer.log
pidfile = {folder}/pgbouncer.pid
""")
    as_user = ["-u", "nobody"] if os.geteuid() == 0 else []
    process = subprocess.Popen([PGBOUNCER, *as_user, str(folder / "pgbouncer.ini")], stdout=subprocess.DEVNULL,
                               stderr=subprocess.STDOUT)
    url = conninfo.make_conninfo(host="127.0.0.1", port=port, dbname=server.get("dbname", "test"), user=user)
    try:
        wait_for(lambda: _answers(url), 20, what="pgbouncer to accept connections")
        yield url
    finally:
        process.terminate()
        process.wait(10)
        shutil.rmtree(folder, ignore_errors=True)


def _answers(url: str) -> bool:
    try:
        with psycopg.connect(url, connect_timeout=2, autocommit=True) as conn:
            conn.execute("SELECT 1")
        return True
    except psycopg.OperationalError:
        return False


@pytest.fixture
def pooled_worker(db, pgbouncer, tmp_path):
    """pooled_worker(name) starts an `everystep worker` whose pool goes
    through PgBouncer and whose control session goes straight to PostgreSQL."""
    started = []

    def start(name: str) -> WorkerProcess:
        worker = WorkerProcess(pgbouncer, name, tmp_path / "logs", threads=4, direct_url=db.url)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.close()


def transactions_through(url: str) -> int:
    """Transactions PgBouncer has passed to the server (its admin console)."""
    admin = conninfo.make_conninfo(url, dbname="pgbouncer")
    with psycopg.connect(admin, autocommit=True, prepare_threshold=None) as conn:
        cur = conn.execute("SHOW STATS")
        columns = [c.name for c in cur.description]
        return sum(int(row[columns.index("total_xact_count")]) for row in cur.fetchall()
                   if row[columns.index("database")] != "pgbouncer")


def test_a_workload_runs_through_pgbouncer_in_transaction_mode(db, pgbouncer, pooled_worker, marks):
    before = transactions_through(pgbouncer)
    worker = pooled_worker("pooled")
    worker.wait_logged("holding the lock of")
    with db.connect() as conn, everystep.transaction(conn):
        runs = everystep.schedule_many(quick, [(marks,)] * 60)
        runs += [everystep.schedule(timed_steps, marks, 3, 0.0) for _ in range(20)]
        runs += [everystep.schedule(two_steps_behind, marks) for _ in range(40)]  # carried rows: with the end
    wait_for(lambda: all(db.run(run.id)["status"] in everystep.db.TERMINAL for run in runs), 60,
             what="every run ended")
    assert {db.run(run.id)["status"] for run in runs} == {"completed"}, worker.output()
    assert db.value("SELECT count(*) FROM everystep_step") == 60 + 20 * 3 + 40 * 2
    assert len(marks_of(marks)) == 2 * (60 + 20 * 3 + 40 * 2)  # each step ran once
    # Step rows and run ends went through PgBouncer: the worker's pool has no other URL. Group
    # commit writes many runs' rows per transaction, so there are fewer transactions than runs,
    # but some (PgBouncer's totals lag by its stats_period).
    wait_for(lambda: transactions_through(pgbouncer) - before >= 5, 10,
             what="PgBouncer counting the transactions")
    assert "prepared statement" not in worker.output()


def test_a_lost_pod_is_recovered_through_pgbouncer(db, pgbouncer, supervisors, marks, tmp_path):
    """Two supervisors whose workers' pools go through PgBouncer and whose
    sessions (control, maintenance) use database.direct_url. Pod A's whole
    process tree is SIGKILLed with four runs in flight; B recovers them."""
    release = tmp_path / "release"
    sections = {"database": {"url": pgbouncer, "direct_url": db.url},
                "workers": {"processes": 1, "threads": 4}, "recovery": {"interval": 0.3, "grace": 0.5}}
    pod_a = supervisors(config(pgbouncer, "pod-a", **sections))
    pod_a.wait_logged("holding the lock of")
    with db.connect() as conn, everystep.transaction(conn):
        runs = everystep.schedule_many(held, [(marks, str(release))] * 4)
    wait_for(lambda: len(marks_of(marks)) == 4, 30, what="the four runs holding in their step on pod A")
    held_by_a = {pid for _, _, pid in marks_of(marks)}
    pod_a.kill_tree()
    release.touch()
    pod_b = supervisors(config(pgbouncer, "pod-b", **sections))
    wait_for(lambda: all(db.run(run.id)["status"] == "completed" for run in runs), 60,
             what="pod A's runs completed by pod B")
    held_by_b = [pid for _, tag, pid in marks_of(marks) if tag == "held" and pid not in held_by_a]
    assert len(held_by_b) == 4, pod_b.output()
    assert "claimer pod-a" in pod_b.output() and "is dead" in pod_b.output()
    # B's run ends (with their steps' rows, grouped in fewer transactions than runs) went through
    # PgBouncer (its totals lag by its stats_period).
    wait_for(lambda: transactions_through(pgbouncer) >= 1, 10, what="PgBouncer counting the transactions")


def test_a_transaction_pooled_connection_commits_synchronously_and_prepares_nothing(db):
    """What the worker's pool relies on through PgBouncer, checked on a
    direct connection whose session says `synchronous_commit = off`."""
    url = conninfo.make_conninfo(db.url, options=f"-c search_path={db.schema} -c synchronous_commit=off")
    with db.connect() as conn, everystep.transaction(conn):
        run = everystep.schedule(quick, "/nonexistent")
    with everystep.db.TransactionPooledConnection.connect(url, autocommit=True) as pooled:
        assert pooled.execute("SELECT current_setting('synchronous_commit')").fetchone() == ("on",)
        for _ in range(10):
            assert everystep.db.step_row(pooled, run.id, "1") is None
        assert everystep.db.claim(pooled, "pooled", 1)[0].id == run.id
        assert pooled.execute("SELECT count(*) FROM pg_prepared_statements").fetchone() == (0,)
        assert pooled.execute("SHOW synchronous_commit").fetchone() == ("on",)  # in its own transaction
        with pooled.transaction():
            assert pooled.execute("SHOW synchronous_commit").fetchone() == ("off",)  # the session's, untouched


def test_the_config_takes_a_direct_url_only_with_a_url(tmp_path):
    file = tmp_path / "everystep.yaml"
    file.write_text("database:\n  url: host=127.0.0.1 port=6432\n  direct_url: host=127.0.0.1 port=5432\n")
    database = load(file).database
    assert (database.url, database.direct_url) == ("host=127.0.0.1 port=6432", "host=127.0.0.1 port=5432")
    file.write_text("database:\n  direct_url: host=127.0.0.1 port=5432\n")
    with pytest.raises(ConfigError, match=r"database\.direct_url: needs database\.url"):
        load(file)
    file.write_text("database:\n  url: host=127.0.0.1\n  direct_url: localhost\n")
    with pytest.raises(ConfigError, match=r"database\.direct_url: not a PostgreSQL URL"):
        load(file)
