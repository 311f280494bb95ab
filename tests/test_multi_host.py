"""Connection strings naming several hosts, as for a replicated PostgreSQL
(`postgresql://h1:5432,h2:5432/db?target_session_attrs=read-write`): every
connection the engine opens — the workers' control sessions and pools, the
maintenance child's sweep, the setup's migrations, the HTTP child's queries,
the UI, the command line — takes the first host that answers as a primary.
Here the first host refuses connections, the second is a read-only server (as
a standby is), and the third is the test server."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.parse
import urllib.request

import psycopg
import pytest
from psycopg import conninfo

from everystep import schedule_many, transaction
from tests.apps import workflows
from tests.support.processes import ROOT, free_ports, wait_for
from tests.support.supervisor_process import config
from tests.support.ui_process import Client, UiProcess


@pytest.fixture
def read_only_server(private_server):
    """A server every session of which is read-only, as on a standby."""
    with psycopg.connect(private_server.url, autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET default_transaction_read_only = on")
        conn.execute("SELECT pg_reload_conf()")
    return private_server


def multi_host_url(db, read_only_server) -> str:
    """A URL whose hosts are: a closed port, the read-only server (by its
    socket folder), the test server; on the test's schema."""
    params = conninfo.conninfo_to_dict(db.url)
    (closed,) = free_ports(1)
    hosts = [f"127.0.0.1:{closed}", f"{urllib.parse.quote(read_only_server.socket_dir, safe='')}:5432",
             f"{urllib.parse.quote(params.get('host', '127.0.0.1'), safe='')}:{params.get('port', 5432)}"]
    query = urllib.parse.urlencode({"target_session_attrs": "read-write", "options": params["options"],
                                    "connect_timeout": "3"}, quote_via=urllib.parse.quote)
    return f"postgresql://{params.get('user', 'postgres')}@{','.join(hosts)}/{params.get('dbname', 'test')}?{query}"


def everystep_sessions(server_url: str) -> set[str]:
    with psycopg.connect(server_url, autocommit=True) as conn:
        return {row[0] for row in conn.execute(
            "SELECT application_name FROM pg_stat_activity WHERE application_name LIKE 'everystep%%'")}


def test_every_connection_of_the_engine_takes_the_primary_among_several_hosts(db, read_only_server, supervisors,
                                                                              tmp_path, marks):
    url = multi_host_url(db, read_only_server)
    with psycopg.connect(url, autocommit=True) as conn:
        assert conn.execute("SELECT current_setting('transaction_read_only')").fetchone()[0] == "off"
        with transaction(conn):
            runs = schedule_many(workflows.quick, [(marks,)] * 20)
    # A run held by a claimer that is gone: only the sweep can give it back.
    db.query("UPDATE everystep_workflow SET status = 'running', claimed_by = 'gone-0' WHERE id = %s RETURNING id",
             (runs[0].id,))
    sup = supervisors(config(url, "mh", workers={"processes": 1}, recovery={"interval": 0.2, "grace": 0.5}))
    wait_for(lambda: db.value("SELECT count(*) FROM everystep_workflow WHERE status = 'completed'") == len(runs),
             timeout=60, what="every run completed")
    assert "claimer gone-0 is dead: requeued 1 runs" in sup.output()
    sessions = everystep_sessions(db.url)
    assert {"everystep mh-0 control", "everystep mh-0", "everystep maintenance"} <= sessions
    with urllib.request.urlopen(f"http://127.0.0.1:{sup.port}/metrics", timeout=10) as answer:
        assert "everystep_database_up 1.0" in answer.read().decode()  # the HTTP child's queries
    assert not everystep_sessions(read_only_server.url)  # nothing stayed on the read-only host

    ui = UiProcess(url, tmp_path / "ui")
    try:
        status, page = Client(ui.url).get("/api/runs?status=completed&limit=100")
        assert status == 200 and len(page["runs"]) == len(runs)
    finally:
        ui.close()

    listed = subprocess.run([sys.executable, "-m", "everystep.cli", "--database-url", url, "runs", "list", "-o",
                             "json"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert {run["status"] for run in json.loads(listed.stdout)} == {"completed"}
