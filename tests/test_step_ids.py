"""Step identity: the dotpath of each step call, names, and their bounds."""

from __future__ import annotations

from everystep import (
    parallel,
    workflow,
)
from tests.apps.engine_flows import (
    calls,
    record,
)
from tests.support.engine import schedule_one, step_ids

# ---------------------------------------------------------------- identity


@workflow
def positional_and_named():
    record("a")
    record("b", everystep_id="charge")
    record("c")
    parallel(lambda: record("d"), lambda: record("e"), everystep_id="fan")
    parallel(lambda: record("f"), [lambda: record("g"), lambda: record("h")])
    parallel(lambda: parallel(lambda: record("i"), lambda: record("j")))


def test_step_ids_follow_the_dotpath_rules(db):
    run = schedule_one(db, positional_and_named)
    db.run_pending()
    assert db.run(run.id)["status"] == "completed"
    assert sorted(step_ids(db, run.id)) == sorted(
        ["1", "charge", "3", "fan.0.1", "fan.1.1", "5.0.1", "5.1.1", "5.1.2", "6.0.1.0.1", "6.0.1.1.1"]
    )


@workflow
def duplicate_names():
    record("a", everystep_id="x")
    record("b", everystep_id="x")


@workflow
def bad_name():
    record("a", everystep_id="a.b")


@workflow
def too_long_id():
    parallel(lambda: record("deep", everystep_id="n" * 290), everystep_id="f" * 10)


def test_duplicate_bad_and_too_long_ids_fail_before_the_step_runs(db):
    dup = schedule_one(db, duplicate_names)
    bad = schedule_one(db, bad_name)
    long = schedule_one(db, too_long_id)
    db.run_pending()
    assert db.run(dup.id)["error"]["type"] == "everystep.errors.EverystepError"
    assert "duplicate step id 'x'" in db.run(dup.id)["error"]["message"]
    assert step_ids(db, dup.id) == ["x"]
    assert "bad everystep_id" in db.run(bad.id)["error"]["message"]
    assert "at most 300" in db.run(long.id)["error"]["message"]
    assert calls == {"a": 1}  # "b", the bad id's step and "deep" never ran
    assert step_ids(db, long.id) == []


@workflow
def exactly_300():
    return record("ok", everystep_id="n" * 300)


def test_a_step_id_of_exactly_300_characters_is_accepted(db):
    run = schedule_one(db, exactly_300)
    db.run_pending()
    assert db.run(run.id)["status"] == "completed"
    assert step_ids(db, run.id) == ["n" * 300]
