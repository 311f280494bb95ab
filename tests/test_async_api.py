"""Scheduling from asyncio and SQLAlchemy: aschedule and the other asyncio
calls in a psycopg AsyncConnection's transaction; schedule() in a
SQLAlchemy Session or Connection, aschedule() in an AsyncSession or
AsyncConnection; committed, the run is there; rolled back, nothing is."""

from __future__ import annotations

import asyncio
import threading

import psycopg
import pytest
from psycopg import conninfo
from sqlalchemy import create_engine, text
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import everystep
from everystep import EverystepError, RunFailed
from tests.apps import async_workflows as flows
from tests.apps.engine_flows import echo_workflow
from tests.support.engine import schedule_one


def runs(db) -> list:
    return db.query("SELECT name, idempotency_key, status FROM everystep_workflow ORDER BY created_at")


def sqlalchemy_url(db) -> URL:
    params = conninfo.conninfo_to_dict(db.url)
    return URL.create("postgresql+psycopg", username=params.get("user"), host=params.get("host"),
                      port=int(params.get("port", 5432)), database=params.get("dbname"),
                      query={"options": params["options"]})


async def _scheduled_in_an_async_transaction(db) -> dict:
    seen = {}
    async with await psycopg.AsyncConnection.connect(db.url) as aconn:
        async with everystep.atransaction(aconn):
            seen["one"] = await everystep.aschedule(echo_workflow, 1, idempotency_key="async:1")
        again = await everystep.aschedule(echo_workflow, 1, idempotency_key="async:1", conn=aconn)
        await aconn.commit()
        seen["again"] = again
        with pytest.raises(RuntimeError):
            async with aconn.transaction():
                await everystep.aschedule(echo_workflow, 2, idempotency_key="async:2", conn=aconn)
                await everystep.aschedule_many(echo_workflow, [(3,), (4,)], conn=aconn)
                raise RuntimeError("roll back")
        async with aconn.transaction():
            seen["many"] = await everystep.aschedule_many(echo_workflow, [(5,), (6,)],
                                                          idempotency_keys=["async:1", None], conn=aconn)
    return seen


def test_aschedule_joins_the_async_connections_transaction(db):
    seen = asyncio.run(_scheduled_in_an_async_transaction(db))
    assert seen["one"].created and not seen["again"].created and seen["again"].id == seen["one"].id
    assert [run.created for run in seen["many"]] == [False, True] and seen["many"][0].id == seen["one"].id
    name = "tests.apps.engine_flows.echo_workflow"
    assert runs(db) == [(name, "async:1", "scheduled"), (name, None, "scheduled")]  # the rolled back left nothing


async def _refused(db) -> list:
    refused = []
    async with await psycopg.AsyncConnection.connect(db.url, autocommit=True) as aconn:
        for call in (everystep.aschedule(echo_workflow, 1, conn=aconn),
                     everystep.aschedule(echo_workflow, 1),
                     everystep.aschedule(echo_workflow, {1, 2}, conn=aconn)):
            with pytest.raises(EverystepError) as caught:
                await call
            refused.append(str(caught.value))
    with psycopg.connect(db.url) as conn:
        with pytest.raises(EverystepError) as caught:
            await everystep.aschedule(echo_workflow, 1, conn=conn)
        refused.append(str(caught.value))
    return refused


def test_aschedule_refuses_what_has_no_transaction_to_join(db):
    autocommit, unbound, unstorable, sync = asyncio.run(_refused(db))
    assert "needs an open transaction" in autocommit
    assert "found no transaction" in unbound
    assert "set" in unstorable
    assert "a sync connection is for schedule()" in sync
    assert runs(db) == []


async def _messages_events_cancel_and_results(db, waiting, doomed, done, failed) -> dict:
    seen = {}
    async with await psycopg.AsyncConnection.connect(db.url, autocommit=True) as aconn:
        async with everystep.atransaction(aconn):
            seen["sent"] = await everystep.asend(waiting.id, "go", {"n": 1}, idempotency_key="k")
            seen["sent_again"] = await everystep.asend(waiting.id, "go", {"n": 1}, idempotency_key="k")
            seen["cancelled"] = await everystep.acancel(doomed.id, "no longer", conn=aconn)
        seen["done"] = await done.aresult(timeout=5, conn=aconn)
        with pytest.raises(RunFailed) as caught:
            await failed.aresult(timeout=5, conn=aconn)
        seen["failed"] = (caught.value.status, type(caught.value.error).__name__)
        with pytest.raises(TimeoutError):
            await everystep.ScheduledRun(waiting.id, waiting.name, True).aresult(timeout=0.1, conn=aconn)
        # The message wakes the waiting run; a thread of this process executes it meanwhile.
        executing = threading.Thread(target=lambda: [db.run_pending() for _ in range(3)])
        executing.start()
        seen["event"] = await everystep.aget_event(waiting.id, "got", timeout=20, conn=aconn)
        await asyncio.to_thread(executing.join)
        seen["result"] = await waiting.aresult(timeout=20, conn=aconn)
    return seen


def test_asend_acancel_aget_event_and_aresult(db):
    waiting = schedule_one(db, flows.waits_for_message)
    done = schedule_one(db, echo_workflow, "echoed")
    failed = schedule_one(db, flows.as_completed_first, [0.0])
    db.run_pending()
    doomed = schedule_one(db, flows.child, 1)
    seen = asyncio.run(_messages_events_cancel_and_results(db, waiting, doomed, done, failed))
    assert seen["sent"] is True and seen["sent_again"] is False
    assert seen["cancelled"] == "cancelled" and db.run(doomed.id)["status"] == "cancelled"
    assert seen["done"] == "echoed"
    assert seen["failed"] == ("failed", "WorkflowCodeError")
    assert seen["event"] == {"n": 1} and seen["result"] == {"n": 1}


def test_a_runs_result_waited_for_from_sync_code(db):
    run = schedule_one(db, echo_workflow, [1, 2])
    with db.connect() as conn:
        with pytest.raises(TimeoutError):
            run.result(timeout=0.1, conn=conn)
        db.run_pending()
        assert run.result(timeout=5, conn=conn) == [1, 2]


# ---------------------------------------------------------------- SQLAlchemy

@pytest.mark.parametrize("kind", ["session", "connection"])
def test_schedule_in_a_sqlalchemy_transaction(db, kind):
    engine = create_engine(sqlalchemy_url(db))
    try:
        with Session(engine) if kind == "session" else engine.connect() as target:
            target.execute(text("CREATE TABLE orders (id int)"))
            target.execute(text("INSERT INTO orders VALUES (1)"))
            committed = everystep.schedule(echo_workflow, "kept", idempotency_key=f"{kind}:1", conn=target)
            target.commit()
            target.execute(text("INSERT INTO orders VALUES (2)"))
            everystep.schedule(echo_workflow, "gone", idempotency_key=f"{kind}:2", conn=target)
            everystep.schedule_many(echo_workflow, [("gone too",)], conn=target)
            target.rollback()
    finally:
        engine.dispose()
    assert db.query("SELECT id FROM orders") == [(1,)]
    assert db.query("SELECT id, idempotency_key FROM everystep_workflow") == [(committed.id, f"{kind}:1")]


async def _in_an_async_session(db, kind: str) -> everystep.ScheduledRun:
    engine = create_async_engine(sqlalchemy_url(db))
    try:
        async with AsyncSession(engine) if kind == "session" else engine.connect() as target:
            await target.execute(text("CREATE TABLE orders (id int)"))
            await target.execute(text("INSERT INTO orders VALUES (1)"))
            committed = await everystep.aschedule(echo_workflow, "kept", idempotency_key=f"{kind}:1", conn=target)
            await target.commit()
            await target.execute(text("INSERT INTO orders VALUES (2)"))
            await everystep.aschedule(echo_workflow, "gone", conn=target)
            await target.rollback()
            with pytest.raises(EverystepError, match="is for the asyncio API|takes a sync connection"):
                everystep.schedule(echo_workflow, "wrong kind", conn=target)
            return committed
    finally:
        await engine.dispose()


@pytest.mark.parametrize("kind", ["session", "connection"])
def test_aschedule_in_a_sqlalchemy_async_transaction(db, kind):
    committed = asyncio.run(_in_an_async_session(db, kind))
    assert db.query("SELECT id FROM orders") == [(1,)]
    assert db.query("SELECT id, idempotency_key FROM everystep_workflow") == [(committed.id, f"{kind}:1")]
    assert db.run_pending() == {committed.id: "completed"}
    assert db.run(committed.id)["result"] == "kept"


def test_a_sqlalchemy_driver_other_than_psycopg_is_refused(db):
    engine = create_engine("sqlite://")
    try:
        with Session(engine) as session, pytest.raises(EverystepError, match="psycopg"):
            everystep.schedule(echo_workflow, 1, conn=session)
    finally:
        engine.dispose()
