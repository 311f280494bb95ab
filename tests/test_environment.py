"""The right database, every time: `everystep migrate --environment NAME`
records which environment a database is, `everystep --context NAME` takes
the URL and the expected environment from a contexts file, and every
command refuses a database that is another environment, in one line, before
it writes anything."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

import everystep
from tests.apps.cli_workflows import greet
from tests.support.inprocess import run_cli as run
from tests.support.processes import ROOT


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and err.startswith("everystep: "), err
    return err


@pytest.fixture
def contexts(tmp_path, monkeypatch, db):
    """A contexts file with staging (this test's schema) and production (the same schema)."""
    path = tmp_path / "contexts.yaml"
    path.write_text(yaml.safe_dump({"contexts": {
        "staging": {"url": db.url, "environment": "staging"},
        "production": {"url": db.url, "environment": "production"},
        "anything": {"url": db.url},
    }}))
    monkeypatch.setenv("EVERYSTEP_CONTEXTS", str(path))
    monkeypatch.delenv("EVERYSTEP_DATABASE_URL", raising=False)
    return path


def counts(db) -> tuple:
    return (db.value("SELECT count(*) FROM everystep_workflow"), db.value("SELECT count(*) FROM everystep_audit"),
            db.value("SELECT count(*) FROM everystep_environment"))


def test_migrate_records_the_environment_and_a_context_checks_it(db, contexts):
    code, out, err = run("--context", "staging", "migrate", "--environment", "staging")
    assert (code, err) == (0, ""), err
    assert out.splitlines()[-1] == "environment: staging (recorded now)"
    assert db.value("SELECT name FROM everystep_environment") == "staging"
    assert db.value("SELECT action || ' ' || target FROM everystep_audit") == "environment staging"
    # Again: nothing to record.
    code, out, _ = run("--context", "staging", "migrate", "--environment", "staging")
    assert code == 0 and out.splitlines()[-1] == "environment: staging"

    with db.connect() as conn, everystep.transaction(conn):
        run_id = everystep.schedule(greet, "ann").id
    before = counts(db)
    code, out, err = run("--context", "production", "cancel", str(run_id))
    assert code == 2 and out == ""
    assert "--context production expects the environment 'production', but this database is 'staging'" in one_line(err)
    assert counts(db) == before and db.value("SELECT status FROM everystep_workflow") == "scheduled"

    # The context of the right environment acts, and says where.
    code, out, err = run("--context", "staging", "cancel", str(run_id))
    assert (code, err) == (0, "")
    assert out.splitlines() == [f"cancelled run {run_id}", "environment: staging"]
    # Reads are checked too (the check is before anything, whatever the command).
    assert run("--context", "production", "runs", "list")[0] == 2
    assert run("runs", "list", "--context", "staging")[0] == 0  # the option after the command
    # A context that expects nothing in particular acts anywhere.
    assert run("--context", "anything", "runs", "list")[0] == 0


def test_a_database_recording_no_environment_is_refused_by_a_context_that_expects_one(db, contexts):
    before = counts(db)
    code, out, err = run("--context", "staging", "schedule", "tests.apps.cli_workflows:greet", '"x"')
    assert code == 2 and out == ""
    assert "this database records none" in one_line(err) and "everystep migrate --environment staging" in err
    assert counts(db) == before


def test_migrate_refuses_to_record_another_environment_without_force(db, contexts):
    assert run("--context", "staging", "migrate", "--environment", "staging")[0] == 0
    code, _, err = run("--database-url", db.url, "migrate", "--environment", "production")
    assert code == 2 and "recorded as 'staging', not 'production'" in one_line(err)
    code, _, err = run("--context", "staging", "migrate", "--environment", "production")
    assert code == 2 and "--context staging expects 'staging'" in one_line(err)
    assert db.value("SELECT name FROM everystep_environment") == "staging"
    # A copy of production restored as staging, say: --force records it again.
    code, out, _ = run("--database-url", db.url, "migrate", "--environment", "production", "--force")
    assert code == 0 and out.splitlines()[-1] == "environment: production (recorded now; it was staging)"
    assert db.value("SELECT name FROM everystep_environment") == "production"


@pytest.mark.parametrize(("argv", "needle"), [
    (("--context", "nope", "runs", "list"), "no such context in"),
    (("--context", "staging", "--database-url", "postgresql://x/y", "runs", "list"), "both name a database"),
    (("migrate", "--environment", "pro duction"), "an environment is 1 to 64 letters"),
    (("migrate", "--force"), "--force only goes with --environment"),
])
def test_bad_context_options_are_one_line(db, contexts, argv, needle):
    before = counts(db)
    code, out, err = run(*argv)
    assert code == 2 and out == "" and needle in one_line(err)
    assert counts(db) == before


def test_a_bad_contexts_file_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("EVERYSTEP_CONTEXTS", str(tmp_path / "missing.yaml"))
    code, _, err = run("--context", "staging", "runs", "list")
    assert code == 2 and "no contexts file" in one_line(err)
    for text, needle in [("contexts: [1]", "must be a mapping with one key"),
                         ("contexts: {staging: {url: x, env: staging}}", "contexts.staging.env: unknown key"),
                         ("contexts: {staging: {environment: staging}}", "contexts.staging.url: is required"),
                         ("contexts: {staging: {url: '${NOT_SET_ANYWHERE_XYZ}'}}", "NOT_SET_ANYWHERE_XYZ is not set"),
                         ("contexts: {staging: [", "not valid YAML")]:
        (tmp_path / "c.yaml").write_text(text)
        monkeypatch.setenv("EVERYSTEP_CONTEXTS", str(tmp_path / "c.yaml"))
        code, _, err = run("--context", "staging", "runs", "list")
        assert code == 2 and needle in one_line(err), (text, err)


def test_the_config_file_can_expect_an_environment(db, tmp_path, monkeypatch):
    monkeypatch.delenv("EVERYSTEP_DATABASE_URL", raising=False)
    config = tmp_path / "everystep.yaml"
    config.write_text(yaml.safe_dump({"database": {"url": db.url, "expected_environment": "production"}}))
    before = counts(db)
    code, _, err = run("-c", str(config), "prune", "--older-than", "1")
    assert code == 2 and "database.expected_environment expects the environment 'production'" in one_line(err)
    assert counts(db) == before


def test_the_operator_variable_names_the_person_in_the_audit_trail(db, contexts, monkeypatch):
    monkeypatch.setenv("EVERYSTEP_OPERATOR", "alice")
    assert run("--context", "anything", "schedule", "tests.apps.cli_workflows:greet", '"x"')[0] == 0
    assert db.value("SELECT actor FROM everystep_audit WHERE action = 'schedule'") == "alice"


def _supervisor(document: dict, tmp_path) -> subprocess.CompletedProcess:
    path = tmp_path / "everystep.yaml"
    path.write_text(yaml.safe_dump(document))
    return subprocess.run([sys.executable, "-m", "supervisor", "-c", str(path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def test_the_supervisor_refuses_another_environment_before_it_starts_anything(db, tmp_path):
    assert run("--database-url", db.url, "migrate", "--environment", "staging")[0] == 0
    before = counts(db)
    result = _supervisor({"database": {"url": db.url, "expected_environment": "production"},
                          "imports": ["tests.apps.cli_workflows"], "http": {"port": 0}}, tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1
    assert "database.expected_environment: expects 'production', but the database is 'staging'" in result.stderr
    assert "starting" not in result.stderr and counts(db) == before


def test_the_supervisor_refuses_a_schedule_the_code_cannot_run(db, tmp_path):
    result = _supervisor({"database": {"url": db.url}, "imports": ["tests.apps.cli_workflows"],
                          "http": {"port": 0}, "schedules": {"nightly": {
                              "workflow": "tests.apps.cli_workflows.greet", "args": [1, 2], "cron": "@daily"}}},
                         tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1
    assert "schedules.nightly.args: tests.apps.cli_workflows.greet(name): too many positional arguments" \
        in result.stderr
    assert db.value("SELECT count(*) FROM everystep_schedule") == 0
