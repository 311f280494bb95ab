"""Bulk actions by filter (everystep.operations.bulk, `everystep runs
cancel|requeue|rerun|resolve-step --where ...`): a preview, chunks of short
transactions, one audit record per action plus each run's, and an action
killed halfway (SIGKILL, a real process) carried on by the same command,
nothing done twice."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

import everystep
from everystep import operations
from tests.apps import attribute_workflows as flows
from tests.apps import ui_workflows
from tests.test_attributes import cli

ACTOR = operations.Actor("ada@host", "cli")


def scheduled(db, count: int, **attributes) -> list:
    with db.connect() as conn, everystep.transaction(conn):
        return everystep.schedule_many(flows.noop, [(i,) for i in range(count)], attributes=attributes)


def bulk(db, action, f, **options):
    with db.connect() as conn:
        return operations.bulk(action, f, actor=ACTOR, conn=conn, **options)


def test_a_dry_run_counts_and_samples_and_writes_nothing(db):
    runs = scheduled(db, 30, tenant="acme")
    scheduled(db, 5, tenant="globex")
    preview = bulk(db, "cancel", {"attributes": {"tenant": "acme"}})
    assert (preview.action, preview.count, preview.dry_run, preview.done) == ("cancel", 30, True, 0)
    assert preview.sample == sorted((r.id for r in runs), reverse=True)[:20]
    assert preview.filter == {"attributes": {"tenant": "acme"}}
    assert db.value("SELECT count(*) FROM everystep_workflow WHERE status = 'cancelled'") == 0
    assert db.value("SELECT count(*) FROM everystep_audit") == 0
    assert db.value("SELECT count(*) FROM everystep_bulk") == 0


def test_cancel_by_filter_in_chunks_with_one_audit_record_and_each_runs_trail(db):
    runs = scheduled(db, 25, tenant="acme")
    other = scheduled(db, 3, tenant="globex")
    outcome = bulk(db, "cancel", {"attributes": {"tenant": "acme"}, "status": "scheduled"}, dry_run=False,
                   reason="customer left", chunk=10)
    assert (outcome.count, outcome.done, outcome.refused, outcome.resumed) == (25, 25, 0, False)
    assert {db.run(r.id)["status"] for r in runs} == {"cancelled"}
    assert {db.run(r.id)["status"] for r in other} == {"scheduled"}
    assert db.value("SELECT count(*) FROM everystep_audit WHERE action = 'cancel'") == 25
    (actor, action, details), = db.query(
        "SELECT actor, action, details FROM everystep_audit WHERE action = 'bulk-cancel'")
    assert (actor, action) == ("ada@host", "bulk-cancel")
    assert details["filter"] == {"attributes": {"tenant": "acme"}, "status": "scheduled"}
    assert (details["count"], details["done"], details["refused"], details["outcome"]) == (25, 25, 0, "done")
    # Again: nothing left to do in that status.
    again = bulk(db, "cancel", {"attributes": {"tenant": "acme"}, "status": "scheduled"}, dry_run=False)
    assert (again.count, again.done) == (0, 0)


def test_runs_made_after_the_start_are_left_alone_and_refusals_are_counted(db):
    runs = scheduled(db, 4, tenant="acme")
    with db.connect() as conn:
        operations.cancel(conn, ACTOR, [runs[0].id])
    outcome = bulk(db, "cancel", {"attributes": {"tenant": "acme"}}, dry_run=False, chunk=2)
    assert (outcome.count, outcome.done, outcome.refused) == (4, 3, 1)  # one was cancelled already


@pytest.mark.parametrize("f, options, says", [
    ({}, {}, "empty filter"),
    ({"tenant": "acme"}, {}, "unknown filter key"),
    ({"attributes": {"tenant": "acme"}}, {"from_step": "1"}, "takes no from_step"),
    ({"status": "completed"}, {}, None),  # fine: rerun below needs from_step
    ({"status": "nope"}, {}, "unknown status"),
])
def test_bad_input_is_refused_with_nothing_written(db, f, options, says):
    scheduled(db, 2, tenant="acme")
    if says is None:
        with pytest.raises(everystep.EverystepError, match="from_step"):
            bulk(db, "rerun", f, dry_run=False)
        return
    with pytest.raises(everystep.EverystepError, match=says):
        bulk(db, "cancel", f, dry_run=False, **options)
    with pytest.raises(everystep.EverystepError, match="the action is one of"):
        bulk(db, "delete", {"status": "scheduled"}, dry_run=False)
    with pytest.raises(everystep.EverystepError, match="exactly one of"):
        bulk(db, "resolve-step", {"status": "blocked"}, dry_run=False, step="1")
    assert db.value("SELECT count(*) FROM everystep_audit") == 0
    assert db.value("SELECT count(*) FROM everystep_workflow WHERE status <> 'scheduled'") == 0


def test_rerun_and_resolve_step_by_filter(db):
    with db.connect() as conn, everystep.transaction(conn):
        everystep.schedule_many(flows.order, [(1,), (2,)], attributes={"tenant": "acme"})
        blocked = everystep.schedule_many(ui_workflows.charge_then_ship, [("a",), ("b",)],
                                          attributes={"tenant": "acme"})
    db.run_pending()
    with db.connect() as conn:  # the unsafe step started and its worker died: blocked
        for run in blocked:
            conn.execute("UPDATE everystep_step SET status = 'started', result = NULL WHERE workflow_id = %s "
                         "AND step_id = '1'", (run.id,))
            conn.execute("DELETE FROM everystep_step WHERE workflow_id = %s AND step_id = '2'", (run.id,))
            conn.execute("UPDATE everystep_workflow SET status = 'blocked' WHERE id = %s", (run.id,))
    reran = bulk(db, "rerun", {"workflow": "tests.apps.attribute_workflows.order"}, dry_run=False, from_step="2")
    assert (reran.count, reran.done, reran.refused) == (2, 2, 0)
    assert db.value("SELECT count(*) FROM everystep_workflow WHERE rerun_of IS NOT NULL AND attributes @> "
                    "'{\"tenant\": \"acme\"}'") == 2  # a re-run keeps its original's attributes
    resolved = bulk(db, "resolve-step", {"status": "blocked", "attributes": {"tenant": "acme"}}, dry_run=False,
                    step="1", result="charged")
    assert (resolved.count, resolved.done) == (2, 2)
    assert {db.run(r.id)["status"] for r in blocked} == {"scheduled"}
    assert db.value("SELECT count(*) FROM everystep_audit WHERE action = 'resolve-step'") == 2


def test_cli_refuses_without_a_filter_or_without_yes_and_previews_with_dry_run(db):
    runs = scheduled(db, 25, tenant="acme")
    one = scheduled(db, 1, tenant="solo")
    nothing = cli(db, "runs", "cancel", "--yes")
    assert nothing.returncode != 0 and len(nothing.stderr.strip().splitlines()) == 1
    assert "needs a filter" in nothing.stderr
    unsure = cli(db, "runs", "cancel", "--where", "tenant=acme")
    assert unsure.returncode != 0 and len(unsure.stderr.strip().splitlines()) == 1 and "--yes" in unsure.stderr
    preview = cli(db, "runs", "cancel", "--where", "tenant=acme", "--dry-run")
    assert preview.returncode == 0, preview.stderr
    lines = preview.stdout.splitlines()
    assert "25 runs" in lines[0]
    assert lines[1:21] == [str(run) for run in sorted((r.id for r in runs), reverse=True)[:20]]
    assert db.value("SELECT count(*) FROM everystep_workflow WHERE status = 'cancelled'") == 0
    solo = cli(db, "runs", "cancel", "--where", "tenant=solo")  # one run: no --yes needed
    assert solo.returncode == 0, solo.stderr
    assert db.run(one[0].id)["status"] == "cancelled"
    done = cli(db, "runs", "cancel", "--where", "tenant=acme", "--status", "scheduled", "--yes",
               "--reason", "customer left")
    assert done.returncode == 0, done.stderr
    assert "25 done" in done.stdout
    assert {db.run(r.id)["status"] for r in runs} == {"cancelled"}
    rerun = cli(db, "runs", "rerun", "--where", "tenant=acme", "--yes")
    assert rerun.returncode == 2 and "--from-step" in rerun.stderr


def test_an_action_killed_halfway_is_carried_on_by_the_same_command_nothing_twice(db):
    runs = scheduled(db, 1000, tenant="acme")  # ten chunks of 100: the kill lands after the first, well before the last
    command = [sys.executable, "-m", "everystep", "runs", "cancel", "--where", "tenant=acme", "--yes",
               "--database-url", db.url]
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            done = db.value("SELECT done FROM everystep_bulk")
            if done:
                break
            time.sleep(0.005)
        os.kill(first.pid, signal.SIGKILL)
    finally:
        first.wait(10)
    halfway = db.query("SELECT done, finished_at FROM everystep_bulk")
    assert len(halfway) == 1 and 0 < halfway[0][0] < len(runs) and halfway[0][1] is None, halfway
    cancelled = db.value("SELECT count(*) FROM everystep_workflow WHERE status = 'cancelled'")
    assert cancelled == halfway[0][0]  # the progress commits with its chunk's actions
    second = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr
    assert "carried on" in second.stdout
    assert db.value("SELECT count(*) FROM everystep_workflow WHERE status = 'cancelled'") == len(runs)
    # Each run cancelled once, by one audit record; one record for the bulk action.
    assert db.value("SELECT count(*) FROM everystep_audit WHERE action = 'cancel'") == len(runs)
    assert db.value("SELECT count(DISTINCT run_id) FROM everystep_audit WHERE action = 'cancel'") == len(runs)
    (details,), = db.query("SELECT details FROM everystep_audit WHERE action = 'bulk-cancel'")
    assert (details["count"], details["done"], details["refused"]) == (len(runs), len(runs), 0)
