"""Values: what arguments and results can be stored, and what is refused."""

from __future__ import annotations

import datetime as dt
import logging

import pytest

from everystep import (
    EverystepError,
    schedule,
    step,
    workflow,
)
from tests.apps.engine_flows import (
    VALUES,
    Color,
    Crash,
    calls,
    echo_workflow,
    round_trip,
)
from tests.support.engine import schedule_one

# ---------------------------------------------------------------- values


def test_every_extended_type_round_trips(db):
    run = schedule_one(db, round_trip, VALUES)
    with pytest.raises(Crash):
        db.run_pending(runner="w1")
    assert db.resume_held("w1") == {run.id: "completed"}  # echo served from the store on replay
    with db.connect() as conn:
        from everystep import serde  # noqa: PLC0415

        result = serde.from_json(conn.execute("SELECT result FROM everystep_workflow").fetchone()[0])
    assert result == VALUES
    assert type(result["tuple"]) is tuple and type(result["enum"]) is Color
    assert result["datetime"].utcoffset() == dt.timedelta(hours=2)


@pytest.mark.parametrize("bad", [{1, 2}, object(), float("nan"), {1: "int key"}, [float("inf")], "nul \x00",
                                 "lone \ud800", {"key \x00": 1}])
def test_unserializable_arguments_are_refused_before_any_insert(db, bad):
    with db.connect(autocommit=False) as conn:
        with pytest.raises(EverystepError):
            schedule(echo_workflow, bad, conn=conn)
        conn.commit()
    assert db.value("SELECT count(*) FROM everystep_workflow") == 0


@step
def returns_a_set():
    calls["set"] += 1
    return {1, 2}


@workflow
def bad_result():
    try:
        returns_a_set()
    except EverystepError as exc:
        return str(exc)


def test_an_unserializable_step_result_raises_after_the_function_ran(db):
    run = schedule_one(db, bad_result)
    db.run_pending()
    assert "builtins.set" in db.run(run.id)["result"]
    assert calls["set"] == 1
    assert db.steps(run.id) == []  # not recorded: it re-runs on the next claim


@step
def fails_with_unstorable_text():
    raise ValueError("bad \udcff bytes \x00")


@workflow
def unstorable_error_message():
    fails_with_unstorable_text()


def test_an_error_message_that_cannot_be_stored_as_is_is_escaped(db, monkeypatch):
    # (The run's failure is logged with the raw message, which the test
    # runner's own log capture could not ship between its processes.)
    monkeypatch.setattr(logging.getLogger("everystep"), "disabled", True)
    run = schedule_one(db, unstorable_error_message)
    db.run_pending()
    row = db.run(run.id)
    assert row["status"] == "failed"
    assert row["error"]["message"] == "bad \\udcff bytes \\x00"
    assert db.steps(run.id)[0]["error"]["type"] == "builtins.ValueError"


@workflow
def returns_object():
    return object()


def test_an_unserializable_workflow_result_fails_the_run(db):
    run = schedule_one(db, returns_object)
    db.run_pending()
    assert db.run(run.id)["status"] == "failed"
    assert db.run(run.id)["error"]["type"] == "everystep.errors.EverystepError"
