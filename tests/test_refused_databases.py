"""Databases refused for good, in one line, rather than retried or run on:
one that a newer everystep migrated (migrations this code does not know),
refused by `migrate`, `worker` and the supervisor naming both versions unless
the newer schema is declared compatible; and a database or role that does
not exist (a server that does not answer is still waited for)."""

from __future__ import annotations

import re

import pytest
import yaml
from psycopg import conninfo

from everystep import db as everystep_db
from everystep.errors import NewerSchema
from tests.support.inprocess import run_cli as cli
from tests.support.processes import WorkerProcess
from tests.support.supervisor_process import config

FUTURE = "0999_from_a_newer_everystep"


@pytest.fixture
def newer(db):
    db.query("INSERT INTO everystep_migration (name) VALUES (%s) RETURNING name", (FUTURE,))
    return db


def refusal_line(code_version: str) -> str:
    return (f"the database's schema is at {FUTURE}, newer than this everystep's {code_version} (a newer everystep "
            f"applied {FUTURE}): upgrade everystep, or, if that schema is compatible with this version, pass "
            "--allow-newer-schema (config: database.allow_newer_schema: true)")


def latest_shipped(database) -> str:
    return max(name for (name,) in database.query("SELECT name FROM everystep_migration") if name != FUTURE)


def test_migrate_refuses_a_newer_schema_in_one_line_unless_allowed(newer):
    shipped = latest_shipped(newer)
    code, out, err = cli("--database-url", newer.url, "migrate")
    assert (code, out, err) == (1, "", f"everystep: {refusal_line(shipped)}\n")

    code, out, err = cli("--database-url", newer.url, "migrate", "--allow-newer-schema")
    assert (code, out) == (0, "nothing to apply: the schema is up to date\n"), err

    with newer.connect() as conn:
        with pytest.raises(NewerSchema):
            everystep_db.check_schema(conn)
        everystep_db.check_schema(conn, allow_newer=True)


def test_a_worker_refuses_a_newer_schema_unless_allowed(newer, start_worker, tmp_path):
    refused = start_worker("too-old")
    assert refused.wait() == 1
    assert refused.output().strip().splitlines()[-1] == f"everystep: {refusal_line(latest_shipped(newer))}"
    assert newer.value("SELECT count(*) FROM everystep_route WHERE runner = 'too-old'") == 0

    file = tmp_path / "compatible.yaml"
    file.write_text(yaml.safe_dump({"database": {"url": newer.url, "allow_newer_schema": True},
                                    "imports": ["tests.apps.workflows"]}))
    allowed = start_worker("compatible", config=file)
    allowed.wait_logged("holding the lock of compatible")


def test_the_supervisor_refuses_a_newer_schema_unless_its_config_allows_it(newer, supervisors):
    sup = supervisors(config(newer.url, "behind", workers={"processes": 1}))
    assert sup.wait() != 0
    assert refusal_line(latest_shipped(newer)) in sup.output()
    assert "Traceback" not in sup.output()

    # Without migrate: the workers refuse, and the supervisor stops rather than restart them in a loop.
    unmigrating = supervisors(config(newer.url, "behind-no-migrate", workers={"processes": 1}, migrate=False))
    assert unmigrating.wait() != 0
    assert f"worker behind-no-migrate-0: {refusal_line(latest_shipped(newer))}" in unmigrating.output()
    assert "worker behind-no-migrate-0 refused the database" in unmigrating.output()

    allowed = supervisors(config(newer.url, "behind-ok", workers={"processes": 1},
                                 database={"url": newer.url, "allow_newer_schema": True}))
    allowed.wait_logged("holding the lock of behind-ok-0")


# ---------------------------------------------------------------- a database or role that does not exist

def url_with(server_url: str, **changes: str) -> str:
    return conninfo.make_conninfo(server_url, **changes)


@pytest.mark.parametrize(("change", "said"), [
    ({"dbname": "no_such_database_here"}, 'database "no_such_database_here" does not exist'),
    ({"user": "no_such_role_here"}, 'role "no_such_role_here" does not exist'),
])
def test_a_worker_and_a_supervisor_exit_on_a_database_or_role_that_does_not_exist(
        server_url, tmp_path, supervisors, change, said):
    url = url_with(server_url, **change)
    line = f"the server answers that {said} (check database.url, or create it; not retrying)"
    worker = WorkerProcess(url, "nowhere", tmp_path / "logs")
    try:
        assert worker.wait() == 1
        assert worker.output().strip().splitlines()[-1] == f"everystep: {line}"
    finally:
        worker.close()

    sup = supervisors(config(url, "nowhere", workers={"processes": 1}))
    assert sup.wait() != 0
    assert f"setup setup: {line}" in sup.output() and "Traceback" not in sup.output()
    sup = supervisors(config(url, "nowhere-nothing-to-set-up", workers={"processes": 1}, migrate=False))
    assert sup.wait() != 0
    # The first child to meet it (the maintenance, a worker) refuses, and the supervisor stops.
    assert f": {line}" in sup.output() and "refused the database" in sup.output()
    assert "Traceback" not in sup.output()


def test_a_server_that_does_not_answer_is_still_waited_for(tmp_path):
    worker = WorkerProcess("host=127.0.0.1 port=1 user=postgres dbname=test connect_timeout=1", "patient",
                           tmp_path / "logs")
    try:
        worker.wait_logged("database unreachable")
        assert worker.alive()
    finally:
        worker.close()


def test_a_role_without_grants_is_one_setup_line(db, supervisors):
    role = f"{db.schema}_nobody"
    with db.connect() as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN")
    try:
        sup = supervisors(config(conninfo.make_conninfo(db.url, user=role), "ungranted", workers={"processes": 1}))
        assert sup.wait() != 0
        output = sup.output()
        assert re.search(r"setup setup: the database refuses the setup: [^\n]+ \(migrations need the role that owns "
                         r"the tables; a role with only the grants of `everystep roles` needs migrate: false\)\n",
                         output), output
        assert "Traceback" not in output
    finally:
        with db.connect() as conn:
            conn.execute(f"DROP ROLE {role}")
