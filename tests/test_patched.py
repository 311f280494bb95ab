"""everystep.patched: runs recorded under the old code replay the old branch,
runs reaching the patch under the new code take the new one, and the decision
replays the same after a crash."""

from __future__ import annotations

import collections

import pytest

import everystep
from everystep import EverystepError, WorkflowCodeError, registry, step, workflow

calls: collections.Counter = collections.Counter()
crash_on: set[str] = set()


class Crash(BaseException):
    """Stands for the worker dying mid-step: not recorded, leaves the run claimed."""


@pytest.fixture(autouse=True)
def _reset():
    calls.clear()
    crash_on.clear()


@step
def record(tag):
    calls[tag] += 1
    if tag in crash_on:
        crash_on.discard(tag)
        raise Crash(tag)
    return tag


@step
def old_price(amount):
    calls["old_price"] += 1
    return amount


@step
def new_price(amount):
    calls["new_price"] += 1
    return amount * 9 // 10


@workflow
def checkout(amount):
    """The old code (its body is swapped for new_checkout's under its name)."""
    record("a")
    price = old_price(amount)
    record("b")
    return price


def new_checkout(amount):
    record("a")
    if everystep.patched("new-discount"):
        price = new_price(amount)
    else:
        price = old_price(amount)
    record("b")
    return price


def deploy_new_code(monkeypatch):
    monkeypatch.setitem(registry.WORKFLOWS, checkout.__everystep_workflow__, new_checkout)


def schedule(db, *args):
    with db.connect() as conn, everystep.transaction(conn):
        return everystep.schedule(checkout, *args)


def test_a_run_recorded_under_the_old_code_replays_the_old_branch(db, monkeypatch):
    run = schedule(db, 100)
    crash_on.add("b")  # the old code got past old_price, then the worker died
    with pytest.raises(Crash):
        db.run_pending(runner="w1")
    deploy_new_code(monkeypatch)
    db.resume_held("w1")
    row = db.run(run.id)
    assert row["status"] == "completed", row["error"]
    assert row["result"] == 100
    assert calls["old_price"] == 1 and calls["new_price"] == 0  # served from the record, not run again
    steps = {s["step_id"]: (s["name"], s["result"]) for s in db.steps(run.id)}
    assert steps["patch:new-discount"] == ("everystep.patched", False)
    assert steps["2"][0].endswith("old_price") and steps["3"][1] == "b"


def test_a_new_run_takes_the_new_branch_and_replays_it_after_a_crash(db, monkeypatch):
    deploy_new_code(monkeypatch)
    run = schedule(db, 100)
    crash_on.add("b")
    with pytest.raises(Crash):
        db.run_pending(runner="w1")
    db.resume_held("w1")
    row = db.run(run.id)
    assert row["status"] == "completed", row["error"]
    assert row["result"] == 90
    assert calls["new_price"] == 1 and calls["old_price"] == 0
    assert [s["step_id"] for s in db.steps(run.id)] == ["1", "patch:new-discount", "2", "3"]


def test_an_old_run_that_had_not_reached_the_patch_takes_the_new_branch(db, monkeypatch):
    run = schedule(db, 100)
    crash_on.add("a")  # died in the first step: nothing recorded past it
    with pytest.raises(Crash):
        db.run_pending(runner="w1")
    deploy_new_code(monkeypatch)
    db.resume_held("w1")
    assert db.run(run.id)["result"] == 90


def test_the_old_branch_can_be_removed_once_old_runs_are_done(db, monkeypatch):
    """Step 3 of the recipe: the patch call is gone; runs recorded with the
    marker replay without it (the marker is not a step of the new code)."""
    deploy_new_code(monkeypatch)
    run = schedule(db, 100)
    crash_on.add("b")
    with pytest.raises(Crash):
        db.run_pending(runner="w1")

    def cleaned(amount):
        record("a")
        price = new_price(amount)
        record("b")
        return price

    monkeypatch.setitem(registry.WORKFLOWS, checkout.__everystep_workflow__, cleaned)
    db.resume_held("w1")
    assert db.run(run.id)["result"] == 90
    assert calls["new_price"] == 1


@workflow
def bad_patch_name():
    everystep.patched("1.2")


@workflow
def patch_over_a_step():
    record("x", everystep_id="patch:p")


def test_bad_patch_names_and_collisions_fail_the_run_with_a_clear_error(db, monkeypatch):
    with db.connect() as conn, everystep.transaction(conn):
        bad = everystep.schedule(bad_patch_name)
        clash = everystep.schedule(patch_over_a_step)
    with pytest.raises(EverystepError):
        everystep.patched("")
    db.run_pending()
    assert "bad patch name" in db.run(bad.id)["error"]["message"]
    assert db.steps(bad.id) == []

    def patched_over(amount=None):
        return everystep.patched("p")

    # "patch:p" was recorded by a step, so the patch cannot take that id.
    monkeypatch.setitem(registry.WORKFLOWS, patch_over_a_step.__everystep_workflow__, patched_over)
    with db.connect() as conn:
        conn.execute("UPDATE everystep_workflow SET status = 'scheduled' WHERE id = %s", (clash.id,))
    db.run_pending()
    assert db.run(clash.id)["error"]["type"] == WorkflowCodeError.__module__ + "." + WorkflowCodeError.__name__


def test_outside_a_workflow_patched_is_true():
    assert everystep.patched("new-discount") is True
