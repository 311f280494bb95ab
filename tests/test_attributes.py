"""Run attributes: schedule(attributes=) and everystep.set_attributes write
them, everystep.find_runs and `everystep runs list --where` find runs by
them, across the hot table and the history, against a real PostgreSQL."""

from __future__ import annotations

import asyncio
import datetime
import json
import subprocess
import sys

import psycopg
import pytest

import everystep
import everystep.db
from tests.apps import attribute_workflows as flows


def find(db, **filters) -> list:
    with db.connect() as conn:
        return everystep.find_runs(conn=conn, **filters)


def cli(db, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "everystep", *args, "--database-url", db.url],
                          capture_output=True, text=True, timeout=60)


def test_schedule_writes_attributes_and_find_runs_finds_them(db):
    with db.connect() as conn, everystep.transaction(conn):
        acme = everystep.schedule(flows.noop, 1, attributes={"tenant": "acme", "order": 42, "vip": True})
        other = everystep.schedule(flows.noop, 2, attributes={"tenant": "globex", "order": 43})
        plain = everystep.schedule(flows.noop, 3)
    assert db.value("SELECT attributes FROM everystep_workflow WHERE id = %s", (acme.id,)) == {
        "tenant": "acme", "order": 42, "vip": True}
    assert db.value("SELECT attributes FROM everystep_workflow WHERE id = %s", (plain.id,)) is None  # NULL: none
    assert [r.id for r in find(db, attributes={"tenant": "acme"})] == [acme.id]
    assert [r.id for r in find(db, attributes={"order": 43})] == [other.id]
    # Same value, same type: 42 is not "42".
    assert [r.id for r in find(db, attributes={"order": "42"})] == []
    assert [r.id for r in find(db, attributes={"tenant": "acme", "order": 43})] == []
    found = find(db, attributes={"vip": True})[0]
    assert (found.workflow, found.status, found.attributes) == (
        "tests.apps.attribute_workflows.noop", "scheduled", {"tenant": "acme", "order": 42, "vip": True})
    assert {r.id for r in find(db, workflow="tests.apps.attribute_workflows.noop")} == {acme.id, other.id, plain.id}
    assert find(db, status="completed") == []


@pytest.mark.parametrize("attributes, says", [
    ({"k": [1]}, "a value is a string"),
    ({"k": {"a": 1}}, "a value is a string"),
    ({"k": None}, "a value is a string"),
    ({"k": float("nan")}, "a value is a string"),
    ({1: "x"}, "non-empty string"),
    ({"": "x"}, "non-empty string"),
    ({"k" * 65: "x"}, "at most 64"),
    ({"k": "v" * 257}, "at most 256"),
    ({f"k{i}": i for i in range(21)}, "at most 20"),
    (["tenant"], "takes a dict|one per run"),
])
def test_bad_attributes_are_refused_with_nothing_written(db, attributes, says):
    with db.connect() as conn, everystep.transaction(conn):
        with pytest.raises(everystep.EverystepError, match=says):
            everystep.schedule(flows.noop, 1, attributes=attributes)
        with pytest.raises(everystep.EverystepError, match=says):
            everystep.schedule_many(flows.noop, [(1,), (2,)], attributes=attributes)
    assert db.value("SELECT count(*) FROM everystep_workflow") == 0


def test_schedule_many_takes_one_dict_for_all_or_one_per_run(db):
    with db.connect() as conn, everystep.transaction(conn):
        same = everystep.schedule_many(flows.noop, [(1,), (2,)], attributes={"batch": "b1"})
        each = everystep.schedule_many(flows.noop, [(3,), (4,), (5,)],
                                       attributes=[{"batch": "b2", "n": 3}, None, {"batch": "b2", "n": 5}])
        with pytest.raises(everystep.EverystepError, match="one per run"):
            everystep.schedule_many(flows.noop, [(6,), (7,)], attributes=[{"batch": "b3"}])
    assert [r.id for r in find(db, attributes={"batch": "b1"})] == [same[1].id, same[0].id]  # newest first
    assert [r.id for r in find(db, attributes={"batch": "b2"})] == [each[2].id, each[0].id]
    assert db.value("SELECT attributes FROM everystep_workflow WHERE id = %s", (each[1].id,)) is None


def test_aschedule_takes_attributes(db):
    async def main():
        async with await psycopg.AsyncConnection.connect(db.url) as aconn, everystep.atransaction(aconn):
            one = await everystep.aschedule(flows.noop, 1, attributes={"tenant": "acme"})
            many = await everystep.aschedule_many(flows.noop, [(2,)], attributes={"tenant": "initech"})
        return one, many

    one, many = asyncio.run(main())
    assert [r.id for r in find(db, attributes={"tenant": "acme"})] == [one.id]
    assert [r.id for r in find(db, attributes={"tenant": "initech"})] == [many[0].id]


def test_set_attributes_is_recorded_like_a_step_and_not_repeated_by_a_replay(db):
    with db.connect() as conn, everystep.transaction(conn):
        run = everystep.schedule(flows.order, 7, attributes={"tenant": "acme"})
    assert db.run_pending() == {run.id: "completed"}
    assert db.value("SELECT attributes FROM everystep_workflow WHERE id = %s", (run.id,)) == {
        "tenant": "acme", "stage": "done", "order": 7}
    names = [s["name"] for s in db.steps(run.id)]
    assert names == ["everystep.set_attributes", "tests.apps.attribute_workflows.charge", "everystep.set_attributes"]
    assert db.steps(run.id)[0]["args"] == [{"stage": "charging", "order": 7}]
    assert [r.id for r in find(db, attributes={"stage": "done", "tenant": "acme"})] == [run.id]


def test_set_attributes_beyond_the_bound_fails_the_run_and_writes_nothing(db):
    with db.connect() as conn, everystep.transaction(conn):
        fits = everystep.schedule(flows.crowded, 20)
        passes = everystep.schedule(flows.crowded, 15, attributes={f"x{i}": i for i in range(6)})
    assert db.run_pending() == {fits.id: "completed", passes.id: "failed"}
    assert len(db.value("SELECT attributes FROM everystep_workflow WHERE id = %s", (fits.id,))) == 20
    assert len(db.value("SELECT attributes FROM everystep_workflow WHERE id = %s", (passes.id,))) == 6
    assert "more than 20 attributes" in db.run(passes.id)["error"]["message"]
    with pytest.raises(everystep.EverystepError, match="inside a workflow|in a workflow|workflow body"):
        everystep.set_attributes({"a": 1})


def _move_to_history(db) -> int:
    with db.connect() as conn:
        everystep.db.history_ahead(conn, 1)
        return everystep.db.archive_batch(conn, "completed", 1000, 0.0).moved


def test_find_runs_pages_by_id_across_the_hot_table_and_the_history(db):
    with db.connect() as conn, everystep.transaction(conn):
        old = everystep.schedule_many(flows.noop, [(i,) for i in range(5)], attributes={"tenant": "acme"})
    assert set(db.run_pending().values()) == {"completed"}
    assert _move_to_history(db) == 5
    with db.connect() as conn, everystep.transaction(conn):
        new = everystep.schedule_many(flows.noop, [(i,) for i in range(4)], attributes={"tenant": "acme"})
        everystep.schedule(flows.noop, 9, attributes={"tenant": "globex"})
    assert db.value("SELECT count(*) FROM everystep_workflow_history WHERE attributes IS NOT NULL") == 5
    pages, after = [], None
    while page := find(db, attributes={"tenant": "acme"}, limit=2, after=after):
        pages.append([r.id for r in page])
        after = page[-1].id
    expected = sorted([r.id for r in old + new], reverse=True)
    assert [run for page in pages for run in page] == expected
    assert [len(page) for page in pages] == [2, 2, 2, 2, 1]
    assert {r.status for r in find(db, attributes={"tenant": "acme"}, status="completed")} == {"completed"}
    assert len(find(db, attributes={"tenant": "acme"}, status=["completed", "scheduled"])) == 9
    now = datetime.datetime.now(datetime.UTC)
    assert find(db, attributes={"tenant": "acme"}, since=now + datetime.timedelta(hours=1)) == []
    assert len(find(db, attributes={"tenant": "acme"}, until=now + datetime.timedelta(hours=1))) == 9


@pytest.mark.parametrize("filters, says", [
    ({"status": "done"}, "unknown status"),
    ({"attributes": {}}, "non-empty dict"),
    ({"attributes": {"k": [1]}}, "a value is a string"),
    ({"since": datetime.datetime(2026, 1, 1)}, "with a timezone"),
    ({"limit": 0}, "limit"),
    ({"after": "not-an-id"}, "run id"),
])
def test_find_runs_refuses_bad_filters(db, filters, says):
    with pytest.raises(everystep.EverystepError, match=says):
        find(db, **filters)


def test_the_index_serves_a_search_by_one_attribute(db):
    with db.connect() as conn, everystep.transaction(conn):
        everystep.schedule_many(flows.noop, [(i,) for i in range(200)],
                                attributes=[{"tenant": f"t{i % 50}"} for i in range(200)])
    with db.connect() as conn:
        conn.execute("ANALYZE everystep_workflow")
        conn.execute("SET enable_seqscan = off")
        plan = "\n".join(row[0] for row in conn.execute(
            "EXPLAIN SELECT id FROM everystep_workflow WHERE attributes @> %s::jsonb",
            (json.dumps({"tenant": "t7"}),)))
    assert "everystep_workflow_attributes" in plan


def test_runs_list_where(db):
    with db.connect() as conn, everystep.transaction(conn):
        acme = everystep.schedule(flows.noop, 1, attributes={"tenant": "acme", "order": 42})
        everystep.schedule(flows.noop, 2, attributes={"tenant": "acme", "order": 43})
    listed = cli(db, "runs", "list", "--where", "tenant=acme", "--where", "order=42", "-o", "json")
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert [row["id"] for row in rows] == [str(acme.id)]
    assert rows[0]["attributes"] == {"tenant": "acme", "order": 42}
    text = cli(db, "runs", "list", "--where", "tenant=acme")
    assert text.returncode == 0 and text.stdout.count("acme") == 2
    quoted = cli(db, "runs", "list", "--where", 'order="42"', "-o", "json")  # the string "42": none
    assert quoted.returncode == 0 and json.loads(quoted.stdout) == []
    bad = cli(db, "runs", "list", "--where", "tenant")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    shown = cli(db, "runs", "show", str(acme.id))
    assert '"tenant": "acme"' in next(line for line in shown.stdout.splitlines() if line.startswith("attributes"))


def test_a_database_of_the_version_before_migrates_in_place(server_url):
    """0022 on a schema of the version before, with runs in the hot table and
    the history: they keep running (no attributes: NULL) and the new ones
    are found by theirs."""
    import uuid  # noqa: PLC0415

    from everystep.ids import uuid7  # noqa: PLC0415
    from tests.conftest import Database  # noqa: PLC0415
    from tests.support.migrations import migrated_before  # noqa: PLC0415

    schema = f"t_{uuid.uuid4().hex[:12]}"
    migrated_before(server_url, schema, "0022")
    db = Database(server_url, schema)
    try:
        old = uuid7()
        with db.connect() as conn:
            conn.execute("INSERT INTO everystep_workflow (id, name, args, status) VALUES (%s, %s, '[1]', "
                         "'scheduled')", (old, "tests.apps.attribute_workflows.noop"))
            assert everystep.db.migrate(conn)[:1] == ["0022_attributes"]  # and those after it
        with db.connect() as conn, everystep.transaction(conn):
            new = everystep.schedule(flows.order, 3, attributes={"tenant": "acme"})
        assert db.run_pending() == {old: "completed", new.id: "completed"}
        assert db.value("SELECT attributes FROM everystep_workflow WHERE id = %s", (old,)) is None
        assert [r.id for r in find(db, attributes={"tenant": "acme"})] == [new.id]
        assert _move_to_history(db) == 2  # the move's `SELECT *` meets the same columns on both sides
        assert [r.id for r in find(db, attributes={"stage": "done"})] == [new.id]
    finally:
        db.close()
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


def test_set_attributes_in_an_async_workflow(db):
    with db.connect() as conn, everystep.transaction(conn):
        run = everystep.schedule(flows.async_order, 5)
    assert db.run_pending() == {run.id: "completed"}
    assert [r.id for r in find(db, attributes={"stage": "async", "order": 5})] == [run.id]
