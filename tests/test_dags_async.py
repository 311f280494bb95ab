"""The graph API from asyncio (acreate, aadd, aseal, aget, acancel, arerun)
in a psycopg AsyncConnection's and a SQLAlchemy AsyncSession's transaction,
the sync forms in a SQLAlchemy Session, aschedule(depends_on=), and an
async member reading its dependencies with `await dags.upstream()`."""

from __future__ import annotations

import asyncio

import psycopg
import pytest
from sqlalchemy import create_engine
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import everystep
from everystep import EverystepError, dags
from tests.apps.dag_async_workflows import acombine
from tests.apps.dag_workflows import fail, fail_unless, noop, produce
from tests.apps.workflows import quick
from tests.test_async_api import sqlalchemy_url
from tests.test_dags import _count_everything, status


async def _built_and_read(db) -> tuple:
    async with await psycopg.AsyncConnection.connect(db.url) as aconn:
        async with everystep.atransaction(aconn):
            wave = await dags.acreate("async-wave", workflows=("tests.apps.dag_*",), actor="api")
            prep = await wave.aadd(produce, {"article": "a-1"}, key="prepare")
            pub = await wave.aadd(produce, "published", key="publish", depends_on=[prep])
            notify = await wave.aadd(acombine, "publish", "prepare", key="notify", depends_on=[pub, "prepare"])
        opened = await dags.aget("async-wave", conn=aconn)
        async with aconn.transaction():
            await wave.aseal(actor="api", conn=aconn)
        sealed = await dags.aget("async-wave", conn=aconn)
    return (prep, pub, notify), opened, sealed


def test_a_graph_built_from_asyncio_runs_to_completion_with_an_async_member(db):
    (prep, pub, notify), opened, sealed = asyncio.run(_built_and_read(db))
    assert opened.status == "open" and opened.members["notify"].depends_on == ("publish", "prepare")
    assert sealed.status == "running" and sealed.sealed_by == "api"
    db.run_pending()
    assert [status(db, m.run_id) for m in (prep, pub, notify)] == ["completed"] * 3
    # The async member awaited dags.upstream: recorded like a step, once per dependency.
    assert db.run(notify.run_id)["result"] == {"publish": "published", "prepare": {"article": "a-1"}}
    assert [s["name"] for s in db.steps(notify.run_id)] == ["everystep.dags._upstream"] * 2
    with db.connect() as conn:
        assert dags.get("async-wave", conn=conn).status == "completed"
    assert db.value("SELECT count(*) FROM everystep_audit WHERE action = 'dag-seal' AND actor = 'api'") == 1


async def _in_async_sessions(db, fixed: str) -> dict:
    seen = {}
    engine = create_async_engine(sqlalchemy_url(db))
    try:
        async with AsyncSession(engine) as session:
            g = await dags.acreate("sa", conn=session)
            root = await g.aadd(fail_unless, fixed, key="root")  # the graph's connection: the session
            await g.aadd(produce, "after", key="after", depends_on=[root])
            await g.aseal()
            await session.commit()
            rolled_back = await dags.acreate("sa-rolled-back", conn=session)
            await rolled_back.aadd(noop, key="x")
            await session.rollback()
            seen["root"] = root
        await asyncio.to_thread(db.run_pending)
        async with AsyncSession(engine) as session:
            seen["failed"] = await dags.aget("sa", conn=session)
            seen["new"] = await dags.arerun("sa", "root", conn=session)
            await session.commit()
        await asyncio.to_thread(db.run_pending)
        async with AsyncSession(engine) as session:
            seen["rerun"] = await dags.aget("sa", conn=session)
            doomed = await dags.acreate("sa-doomed", conn=session)
            seen["doomed"] = await doomed.aadd(noop, key="x")
            await doomed.aseal()
            await dags.acancel("sa-doomed", reason="not today", conn=session)
            await session.commit()
            seen["cancelled"] = await dags.aget("sa-doomed", conn=session)
            with pytest.raises(dags.DagNotFound):
                await dags.aget("sa-rolled-back", conn=session)
    finally:
        await engine.dispose()
    return seen


def test_create_add_seal_get_rerun_and_cancel_in_a_sqlalchemy_async_session(db, tmp_path):
    fixed = str(tmp_path / "fixed")
    seen = asyncio.run(_in_async_sessions(db, fixed + ".never"))  # the root fails, and its re-run as well
    assert seen["failed"].status == "failed" and seen["failed"].members["after"].status == "cancelled"
    assert seen["rerun"].members["root"].run_id == seen["new"] != seen["root"].run_id
    assert status(db, seen["new"]) == "failed"
    assert db.value("SELECT count(*) FROM everystep_audit WHERE action = 'dag-rerun' AND target = 'sa'") == 1
    assert seen["cancelled"].status == "cancelled" and status(db, seen["doomed"].run_id) == "cancelled"
    assert db.run(seen["doomed"].run_id)["cancel_reason"] == "not today"
    assert db.value("SELECT count(*) FROM everystep_dag WHERE key = 'sa-rolled-back'") == 0


async def _rerun_completes(db, fixed: str):
    async with await psycopg.AsyncConnection.connect(db.url) as aconn:
        async with everystep.atransaction(aconn):
            g = await dags.acreate("fixable")
            root = await g.aadd(fail_unless, fixed, key="root")
            child = await g.aadd(acombine, "root", key="child", depends_on=[root])
            await g.aseal()
        await asyncio.to_thread(db.run_pending)
        open(fixed, "w").close()
        async with everystep.atransaction(aconn):
            new = await dags.arerun("fixable", "root")
        await asyncio.to_thread(db.run_pending)
        return new, child, await dags.aget("fixable", conn=aconn)


def test_an_async_rerun_releases_the_members_cancelled_because_of_it(db, tmp_path):
    new, child, state = asyncio.run(_rerun_completes(db, str(tmp_path / "fixed")))
    assert state.status == "completed" and state.members["root"].run_id == new
    assert db.run(child.run_id)["result"] == {"root": "fixed"}


def test_the_sync_forms_in_a_sqlalchemy_session(db):
    engine = create_engine(sqlalchemy_url(db))
    try:
        with Session(engine) as session:
            g = dags.create("sync-sa", conn=session)
            first = g.add(produce, 1, key="first")
            g.add(acombine, "first", key="second", depends_on=[first])
            g.seal(actor="sa")
            session.commit()
            dags.create("sync-sa-gone", conn=session).add(noop, key="x")
            session.rollback()
            assert dags.get("sync-sa", conn=session).status == "running"
    finally:
        engine.dispose()
    db.run_pending()
    with db.connect() as conn:
        state = dags.get("sync-sa", conn=conn)
    assert state.status == "completed" and db.run(state.members["second"].run_id)["result"] == {"first": 1}
    assert db.value("SELECT count(*) FROM everystep_dag") == 1


async def _follow_ups(db) -> tuple:
    async with await psycopg.AsyncConnection.connect(db.url) as aconn:
        async with everystep.atransaction(aconn):
            a = await everystep.aschedule(produce, 1)
            bad = await everystep.aschedule(fail, "x")
            after = await everystep.aschedule(noop, depends_on=[a, bad.id])
            only_a = await everystep.aschedule(noop, depends_on=a)
        with pytest.raises(EverystepError, match=r"aschedule\(depends_on=...\): no run"):
            async with everystep.atransaction(aconn):
                await everystep.aschedule(noop, depends_on=[after.id, "0190d9a4-0000-7000-8000-000000000000"])
        return a, bad, after, only_a


def test_aschedule_depends_on(db):
    a, bad, after, only_a = asyncio.run(_follow_ups(db))
    assert status(db, after.id) == status(db, only_a.id) == "waiting"
    db.run_pending()
    assert (status(db, a.id), status(db, bad.id), status(db, only_a.id)) == ("completed", "failed", "completed")
    assert (status(db, after.id), db.run(after.id)["cancel_reason"]) == ("cancelled", f"dependency {bad.id} failed")
    assert db.value("SELECT count(*) FROM everystep_workflow") == 4


BAD = {
    "outside workflows": (dags.DagError, lambda g, sealed: g.aadd(quick, "m", key="second")),
    "add on sealed": (dags.DagSealed, lambda g, sealed: sealed.aadd(noop, key="z")),
    "unknown dependency": (dags.DependencyError, lambda g, sealed: g.aadd(produce, 2, key="second",
                                                                           depends_on=["nope"])),
    "duplicate key": (dags.DagError, lambda g, sealed: g.aadd(produce, 2, key="first")),
    "seal sealed": (dags.DagSealed, lambda g, sealed: sealed.aseal()),
    "unknown graph": (dags.DagNotFound, lambda g, sealed: dags.acancel("nope")),
    "rerun a completed member": (dags.DagError, lambda g, sealed: dags.arerun("sealed", "y")),
    "graph key too long": (dags.DagError, lambda g, sealed: dags.acreate("g" * 256)),
}


async def _refused(db, case: str) -> type:
    async with await psycopg.AsyncConnection.connect(db.url) as aconn:
        async with everystep.atransaction(aconn):
            g = await dags.acreate("bad", workflows=("tests.apps.dag_workflows.*",))
            await g.aadd(produce, 1, key="first")
            sealed = await dags.acreate("sealed")
            await sealed.aadd(noop, key="y")
            await sealed.aseal()
        await asyncio.to_thread(db.run_pending)
        before = await asyncio.to_thread(_count_everything, db)
        async with everystep.atransaction(aconn):
            with pytest.raises(EverystepError) as caught:
                await BAD[case][1](g, sealed)
        assert await asyncio.to_thread(_count_everything, db) == before
        return type(caught.value)


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_raises_the_sync_forms_errors_and_writes_nothing(db, case):
    assert issubclass(asyncio.run(_refused(db, case)), BAD[case][0])


async def _wrong_kinds(db) -> list[str]:
    refused = []
    with psycopg.connect(db.url) as conn:
        for call in (dags.acreate("x", conn=conn), dags.aget("x", conn=conn), dags.acancel("x", conn=conn),
                     dags.arerun("x", "y", conn=conn), dags.Dag("x", None, conn).aseal()):
            with pytest.raises(EverystepError) as caught:
                await call
            refused.append(str(caught.value))
    async with await psycopg.AsyncConnection.connect(db.url) as aconn:
        async with aconn.transaction():
            g = await dags.acreate("async-made", conn=aconn)
            for call in (lambda: dags.create("x", conn=aconn), lambda: g.add(noop, key="a"), lambda: g.seal()):
                with pytest.raises(EverystepError) as caught:
                    call()
                refused.append(str(caught.value))
        async with aconn.transaction():
            with pytest.raises(EverystepError, match="found no transaction"):
                await dags.acreate("unbound")
    return refused


def test_a_connection_of_the_other_kind_is_refused_as_schedule_refuses_it(db):
    refused = asyncio.run(_wrong_kinds(db))
    assert [m.split(" takes", 1)[0] for m in refused] == [
        "dags.acreate()", "dags.aget()", "dags.acancel()", "dags.arerun()", "Dag.aseal()",
        "dags.create()", "Dag.add()", "Dag.seal()"]
    assert refused[0].endswith("a sync connection is for dags.create()")
    assert refused[4].endswith("a sync connection is for Dag.seal()")
    assert all("await the asyncio form" in m for m in refused[5:])
    assert db.query("SELECT key FROM everystep_dag") == [("async-made",)]
