"""everystep as a backend of Django's tasks API (Django 6's django.tasks, or
the django-tasks backport on older Django and Python 3.11): enqueue in the
transaction, results in every state, deferred and async tasks, a task that
is a workflow, signals, the system check; a worker running a project's
tasks with DJANGO_SETTINGS_MODULE set, and `manage.py everystep_worker`.
CI runs this module on Python 3.12 with Django 6 too."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import django
import pytest

import everystep
import everystep.db
from tests.support.processes import ROOT, WorkerProcess, wait_for
from tests.support.supervisor_process import config


def test_the_backend_in_a_django_project(db):
    done = subprocess.run([sys.executable, "-m", "tests.apps.django_tasks_project", db.url], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["api"] == ("django.tasks" if django.VERSION >= (6,) else "django_tasks")
    # transaction.atomic(): the committed task is there with its order; the rolled back left nothing.
    assert out["runs_after_atomic"] == 1 and out["orders"] == [1]
    assert out["enqueued"][1] == "READY" and out["ready"] == "READY"
    assert out["deferred"] == "READY"  # run_after: a delayed start
    assert out["keyed"] is True
    assert set(out["executed"].values()) == {"completed", "failed"}
    assert out["committed"] == ["SUCCESSFUL", 5, []]
    assert out["failing"] == ["FAILED", None, ["builtins.ValueError"]]
    assert out["async"] == ["SUCCESSFUL", 9, []] and out["async_result"] == "SUCCESSFUL"
    assert out["durable"] == ["SUCCESSFUL", 42, []] and out["durable_steps"] == ["1", "2"]
    assert out["flaky"] == ["SUCCESSFUL", "ok", []]
    assert out["contextual"][0] == "SUCCESSFUL" and out["contextual"][1][1] == 7
    assert (out["status_running"], out["status_blocked"], out["status_waiting"], out["status_cancelled"]) == (
        "RUNNING", "RUNNING", "RUNNING", "FAILED")
    # A receiver that raises failed no run.
    assert out["signals"] == ["finished", "started"]
    assert out["finished"].count("FAILED") == 1 and out["finished"].count("SUCCESSFUL") >= 6
    assert out["check"] == [] and out["check_without_schema"] == ["everystep.E001"]


def _enqueue(db, *calls: str) -> list[str]:
    """Enqueue tasks of tests/apps/django_tasks.py in a process with the project's settings."""
    script = ("import django, json; django.setup(); from tests.apps import django_tasks as t; "
              f"print(json.dumps([{', '.join(calls)}]))")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **_project(db)})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _project(db) -> dict:
    return {"DJANGO_SETTINGS_MODULE": "tests.apps.django_tasks_settings", "EVERYSTEP_TEST_DJANGO_URL": db.url}


@pytest.mark.parametrize("command", ["supervisor", "everystep", "manage.py"])
def test_a_worker_runs_a_django_projects_tasks(db, tmp_path, command, monkeypatch, supervisors):
    for name, value in _project(db).items():
        monkeypatch.setenv(name, value)
    if command == "supervisor":  # Django set up before its imports:, so in each worker
        worker = supervisors(config(db.url, "dj", imports=["tests.apps.django_tasks"]))
        worker.wait_logged("holding the lock of", count=2)
    elif command == "everystep":  # as the supervisor's workers
        worker = WorkerProcess(db.url, "dj-1", tmp_path / "logs", imports=("tests.apps.django_tasks",))
    else:  # the database from Django's settings
        log = open(tmp_path / "manage.log", "w")
        worker = subprocess.Popen([sys.executable, "-m", "django", "everystep_worker", "--name", "dj-1",
                                   "--import", "tests.apps.django_tasks"], cwd=ROOT, stdout=log,
                                  stderr=subprocess.STDOUT)
        worker.close = lambda: (worker.kill(), worker.wait(10), log.close())
    try:
        ids = _enqueue(db, "t.add.enqueue(40, 2).id", "t.durable.enqueue(1).id", "t.add_later.enqueue(1, 2).id")
        wait_for(lambda: {db.run(run_id)["status"] for run_id in ids} == {"completed"}, timeout=30,
                 what="the tasks completed")
        assert [db.run(run_id)["result"] for run_id in ids] == [42, 6, 3]
        assert everystep.ScheduledRun(ids[0], "", True).result(conn=db.connect()) == 42
    finally:
        worker.close()


def test_a_tasks_priority_is_its_runs(db):
    """Django's task priority (-100..100, higher first, default 0) goes to
    schedule(priority=...): the claim takes the higher first."""
    urgent, plain, late = _enqueue(db, "t.add.using(priority=9).enqueue(1, 2).id", "t.add.enqueue(1, 2).id",
                                   "t.add.using(priority=-100).enqueue(1, 2).id")
    priorities = dict(db.query("SELECT id::text, priority FROM everystep_workflow"))
    assert (priorities[urgent], priorities[plain], priorities[late]) == (9, 0, -100)
    with db.connect() as conn:
        assert [str(r.id) for r in everystep.db.claim(conn, "w", 1)] == [urgent]


def test_tasks_enqueued_under_attributes_are_found_by_them(db):
    """`with everystep.django.tasks.attributes({...}):` gives the runs of the
    tasks enqueued in the block those attributes (schedule(attributes=...))."""
    script = ("import django, json; django.setup(); from tests.apps import django_tasks as t\n"
              "from everystep.django.tasks import attributes\n"
              "with attributes({'tenant': 'acme', 'order': 42}):\n"
              "    tagged = t.add.enqueue(1, 2).id\n"
              "plain = t.add.enqueue(3, 4).id\n"
              "print(json.dumps([tagged, plain]))")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **_project(db)})
    assert done.returncode == 0, done.stderr
    tagged, plain = json.loads(done.stdout)
    with db.connect() as conn:
        assert [str(r.id) for r in everystep.find_runs(attributes={"tenant": "acme"}, conn=conn)] == [tagged]
    assert db.value("SELECT attributes FROM everystep_workflow WHERE id = %s", (plain,)) is None
