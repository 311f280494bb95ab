"""Sealed workflows (everystep.dags) and follow-ups: members wait for their
dependencies and the seal, are released in the transaction that ends their
last dependency, and are cancelled when one fails."""

from __future__ import annotations

import uuid

import pytest

import everystep
from everystep import EverystepError, dags
from tests.apps.dag_workflows import combine, fail, fail_unless, noop, produce, unsafe_member
from tests.apps.workflows import quick
from tests.support.plans import record_plans


def status(db, run_id):
    return db.run(run_id)["status"]


def test_members_wait_for_the_seal_then_run_in_dependency_order(db):
    with db.connect() as conn, everystep.transaction(conn):
        wave = dags.create("wave:1", workflows=("tests.apps.dag_workflows.*",), actor="api")
        prep = wave.add(produce, {"article": "a-1"}, key="prepare")
        pub = wave.add(produce, "published", key="publish", depends_on=[prep])
        notify = wave.add(combine, "publish", "prepare", key="notify", depends_on=[pub, "prepare"])
    assert db.run_pending() == {}  # not sealed: nothing runs
    with db.connect() as conn:
        state = dags.get("wave:1", conn=conn)
        assert state.status == "open"
        assert state.members["publish"].depends_on == ("prepare",)
        assert db.value("SELECT waiting_on FROM everystep_workflow WHERE id = %s", (prep.run_id,)) == "dependencies"
        with everystep.transaction(conn):
            wave.seal(actor="api", conn=conn)
    db.run_pending()
    assert [status(db, m.run_id) for m in (prep, pub, notify)] == ["completed"] * 3
    assert db.run(notify.run_id)["result"] == {"publish": "published", "prepare": {"article": "a-1"}}
    with db.connect() as conn:
        state = dags.get("wave:1", conn=conn)
        assert state.status == "completed"
        assert state.members["notify"].run_id == notify.run_id
        assert state.members["notify"].depends_on == ("publish", "prepare")
        assert db.value("SELECT actor FROM everystep_audit WHERE action = 'dag-seal'") == "api"


def test_creating_an_existing_key_returns_that_graph(db):
    with db.connect() as conn, everystep.transaction(conn):
        first = dags.create("same")
        first.add(noop, key="a")
        again = dags.create("same")
        again.add(noop, key="b", depends_on=["a"])
        again.seal()
    assert db.value("SELECT count(*) FROM everystep_dag") == 1
    db.run_pending()
    with db.connect() as conn:
        assert dags.get("same", conn=conn).status == "completed"


def test_a_failed_member_cancels_its_dependents_transitively_and_fails_the_graph(db):
    with db.connect() as conn, everystep.transaction(conn):
        g = dags.create("g")
        root = g.add(fail, "boom", key="root")
        mid = g.add(produce, 1, key="mid", depends_on=[root])
        leaf = g.add(produce, 2, key="leaf", depends_on=[mid])
        side = g.add(produce, 3, key="side")
        g.seal()
    db.run_pending()
    assert status(db, root.run_id) == "failed"
    assert status(db, side.run_id) == "completed"
    assert (status(db, mid.run_id), db.run(mid.run_id)["cancel_reason"]) == ("cancelled", "dependency root failed")
    assert (status(db, leaf.run_id), db.run(leaf.run_id)["cancel_reason"]) == ("cancelled", "dependency mid cancelled")
    with db.connect() as conn:
        assert dags.get("g", conn=conn).status == "failed"


def test_rerunning_a_failed_member_releases_its_dependents_again(db, tmp_path):
    fixed = str(tmp_path / "fixed")
    with db.connect() as conn, everystep.transaction(conn):
        g = dags.create("r")
        root = g.add(fail_unless, fixed, key="root")
        child = g.add(combine, "root", key="child", depends_on=[root])
        grandchild = g.add(produce, "end", key="grandchild", depends_on=[child])
        g.seal()
    db.run_pending()
    assert status(db, grandchild.run_id) == "cancelled"
    open(fixed, "w").close()
    with db.connect() as conn, everystep.transaction(conn):
        new = dags.rerun("r", "root", conn=conn)
    assert status(db, child.run_id) == "waiting"
    db.run_pending()
    assert status(db, new) == "completed"
    assert db.run(child.run_id)["result"] == {"root": "fixed"}
    assert status(db, grandchild.run_id) == "completed"
    with db.connect() as conn:
        state = dags.get("r", conn=conn)
    assert state.members["root"].run_id == new and state.status == "completed"


def test_a_blocked_dependency_holds_its_dependents_until_resolved(db):
    with db.connect() as conn, everystep.transaction(conn):
        g = dags.create("b")
        root = g.add(unsafe_member, key="root")
        after = g.add(noop, key="after", depends_on=[root])
        g.seal()
    # The unsafe step's mark without an outcome: the run blocks.
    with db.connect() as conn:
        conn.execute("INSERT INTO everystep_step (workflow_id, step_id, name, args, kwargs, status) "
                     "VALUES (%s, '1', 'tests.apps.dag_workflows._unsafe', '[]', '{}', 'started')", (root.run_id,))
    db.run_pending()
    assert status(db, root.run_id) == "blocked"
    assert status(db, after.run_id) == "waiting"
    with db.connect() as conn, everystep.transaction(conn):
        everystep.resolve_step(conn, root.run_id, "1", result="done")
    db.run_pending()
    assert status(db, root.run_id) == "completed"
    assert status(db, after.run_id) == "completed"


def test_cancelling_a_graph_cancels_its_members_not_ended(db):
    with db.connect() as conn, everystep.transaction(conn):
        g = dags.create("c")
        a = g.add(noop, key="a")
        b = g.add(noop, key="b", depends_on=[a])
        g.seal()
    with db.connect() as conn, everystep.transaction(conn):
        follow = everystep.schedule(noop, depends_on=[b.run_id])
        dags.cancel("c", reason="not today", conn=conn)
    assert [status(db, r) for r in (a.run_id, b.run_id, follow.id)] == ["cancelled"] * 3
    assert db.run(follow.id)["cancel_reason"] == "dependency b cancelled"
    with db.connect() as conn:
        assert dags.get("c", conn=conn).status == "cancelled"


def test_a_follow_up_starts_when_every_run_it_names_has_completed(db):
    with db.connect() as conn, everystep.transaction(conn):
        a = everystep.schedule(produce, 1)
        b = everystep.schedule(produce, 2)
        after = everystep.schedule(noop, depends_on=[a, b.id])
    assert db.run(after.id)["status"] == "waiting"
    db.run_pending()
    assert status(db, after.id) == "completed"
    # A follow-up of a run that completed already is due at once; of one that failed, cancelled at once.
    with db.connect() as conn, everystep.transaction(conn):
        bad = everystep.schedule(fail, "x")
    db.run_pending()
    with db.connect() as conn, everystep.transaction(conn):
        late = everystep.schedule(noop, depends_on=[a.id])
        doomed = everystep.schedule(noop, depends_on=[bad.id])
    assert status(db, late.id) == "scheduled"
    assert (status(db, doomed.id), db.run(doomed.id)["cancel_reason"]) == ("cancelled", f"dependency {bad.id} failed")
    db.run_pending()
    assert status(db, late.id) == "completed"


def test_plain_runs_never_touch_the_graph_tables(db):
    with db.connect() as conn, everystep.transaction(conn):
        run = everystep.schedule(noop)
    db.run_pending()
    assert db.query("SELECT status, awaiting, dependents FROM everystep_workflow WHERE id = %s",
                    (run.id,)) == [("completed", None, False)]


def _count_everything(db) -> tuple:
    return db.value("SELECT (SELECT count(*) FROM everystep_workflow) + (SELECT count(*) FROM everystep_dag_member)"
                    " + (SELECT count(*) FROM everystep_dependency) + (SELECT count(*) FROM everystep_audit)")


@pytest.mark.parametrize("case", [
    "unknown key", "other graph's member", "run id", "duplicate key", "add on sealed", "seal sealed",
    "seal empty", "outside workflows", "key too long", "follow-up of no run", "graph key too long",
])
def test_bad_input_is_refused_and_writes_nothing(db, case):
    with db.connect() as conn, everystep.transaction(conn):
        g = dags.create("bad", workflows=("tests.apps.dag_workflows.*",))
        first = g.add(produce, 1, key="first")
        other = dags.create("other")
        foreign = other.add(noop, key="x")
        sealed = dags.create("sealed")
        sealed.add(noop, key="y")
        sealed.seal()
        dags.create("empty")
    before = _count_everything(db)
    attempts = {
        "unknown key": lambda: g.add(produce, 2, key="second", depends_on=["nope"]),
        "other graph's member": lambda: g.add(produce, 2, key="second", depends_on=[foreign]),
        "run id": lambda: g.add(produce, 2, key="second", depends_on=[first.run_id]),
        "duplicate key": lambda: g.add(produce, 2, key="first"),
        "add on sealed": lambda: sealed.add(noop, key="z"),
        "seal sealed": lambda: sealed.seal(),
        "seal empty": lambda: dags.create("empty").seal(),
        "outside workflows": lambda: g.add(quick, "m", key="second"),
        "key too long": lambda: g.add(produce, 2, key="k" * 256),
        "follow-up of no run": lambda: everystep.schedule(noop, depends_on=[uuid.uuid4()]),
        "graph key too long": lambda: dags.create("g" * 256),
    }
    with db.connect() as conn, everystep.transaction(conn):
        with pytest.raises(EverystepError):
            attempts[case]()
    assert _count_everything(db) == before


def test_the_cli_lists_shows_cancels_and_reruns_graphs(db, tmp_path):
    import json  # noqa: PLC0415

    from tests.support.inprocess import run_cli  # noqa: PLC0415

    fixed = str(tmp_path / "fixed")
    with db.connect() as conn, everystep.transaction(conn):
        g = dags.create("cli")
        root = g.add(fail_unless, fixed, key="root")
        g.add(noop, key="after", depends_on=[root])
        g.seal()
        dags.create("open-one").add(noop, key="x")
    db.run_pending()
    code, out, err = run_cli("--database-url", db.url, "dag", "list", "-o", "json")
    assert code == 0, err
    assert {g["key"]: g["status"] for g in json.loads(out)} == {"cli": "failed", "open-one": "open"}
    code, out, _ = run_cli("--database-url", db.url, "dag", "list", "--status", "open")
    assert "open-one" in out and "cli" not in out.replace("open-one", "")
    code, out, _ = run_cli("--database-url", db.url, "dag", "show", "cli", "-o", "json")
    shown = json.loads(out)
    assert [(m["key"], m["status"], m["depends_on"]) for m in shown["members"]] == [
        ("root", "failed", []), ("after", "cancelled", ["root"])]
    code, out, _ = run_cli("--database-url", db.url, "dag", "show", "cli")
    assert "after" in out and str(root.run_id) in out
    open(fixed, "w").close()
    code, out, err = run_cli("--database-url", db.url, "dag", "rerun", "cli", "root", "-o", "json")
    assert code == 0, err
    new = uuid.UUID(json.loads(out)["run_id"])
    db.run_pending()
    assert status(db, new) == "completed"
    code, out, _ = run_cli("--database-url", db.url, "dag", "show", "cli", "-o", "json")
    assert json.loads(out)["status"] == "completed"
    code, out, err = run_cli("--database-url", db.url, "dag", "cancel", "open-one", "-o", "json")
    assert (code, json.loads(out)["status"]) == (0, "cancelled"), err
    assert db.value("SELECT count(*) FROM everystep_audit WHERE action IN ('dag-rerun', 'dag-cancel')") == 2
    code, _, err = run_cli("--database-url", db.url, "dag", "show", "nope")
    assert code == 2 and "no graph 'nope'" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli("--database-url", db.url, "dag", "rerun", "cli", "after")
    assert code == 1 and "completed" in err


def test_the_examples_of_docs_dags_run_as_written(db, tmp_path, monkeypatch):
    import re  # noqa: PLC0415
    import sys  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    text = (Path(__file__).resolve().parent.parent / "docs" / "dags.md").read_text()
    # The module, its run, a follow-up (then the asyncio example, which tests/test_docs_examples.py runs).
    module, _, follow_up = re.findall(r"```python\n(.*?)```", text, re.S)[:3]
    (tmp_path / "myapp").mkdir()
    (tmp_path / "myapp" / "__init__.py").write_text("")
    (tmp_path / "myapp" / "publishing.py").write_text(module)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("myapp", "myapp.publishing"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    from myapp import publishing  # noqa: PLC0415

    with db.connect() as conn:
        publishing.plan_wave(conn, "2026-08-02")
    db.run_pending()
    with db.connect() as conn:
        state = dags.get("publish-wave:2026-08-02", conn=conn)
        assert state.status == "completed"
        assert db.run(state.members["notify"].run_id)["result"] == {
            "article": "a-123", "url": "https://example.com/a-123", "html": "<h1>a-123</h1>"}
        namespace = {"everystep": everystep, "conn": conn, "order_id": 7,
                     "make_invoice": produce, "send_invoice": produce}
        exec(follow_up, namespace)
    db.run_pending()
    assert db.query("SELECT status, awaiting FROM everystep_workflow ORDER BY id DESC LIMIT 1") == [("completed", 0)]


def test_ends_of_a_fan_ins_dependencies_in_flight_at_once_release_it_exactly_once(db):
    """The ends of a fan-in's dependencies, each in its own transaction held
    open a little while the others run: whatever the interleaving, exactly
    one of them releases the fan-in (none would leave it waiting for ever,
    two would start it twice)."""
    import random  # noqa: PLC0415
    import threading  # noqa: PLC0415

    from everystep.db import dags as dag_store  # noqa: PLC0415

    for round_ in range(12):
        with db.connect() as conn, everystep.transaction(conn):
            g = dags.create(f"race-{round_}")
            deps = [g.add(noop, key=f"dep{i}") for i in range(6)]
            fan_in = g.add(noop, key="fan-in", depends_on=deps)
            g.seal()
        released, start = [], threading.Barrier(len(deps))

        def end(dep, pause, start=start, released=released):
            with db.connect(autocommit=False) as conn:
                start.wait()
                released.append(dag_store.settle_runs(conn, [dep.run_id], ["completed"]))
                threading.Event().wait(pause)  # the commit comes a little later, as after an end's other writes
                conn.commit()

        threads = [threading.Thread(target=end, args=(dep, random.random() / 200)) for dep in deps]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sum(released) == 1, (round_, released)
        assert db.value("SELECT waiting_on FROM everystep_workflow WHERE id = %s", (fan_in.run_id,)) is None
        assert db.value("SELECT count(*) FROM everystep_dependency WHERE run_id = %s AND NOT met",
                        (fan_in.run_id,)) == 0


def test_an_end_reads_only_its_own_edges_under_the_plans_of_a_workers_writer(db):
    """A worker's writer plans its statements once, generic, without bitmap
    scans (db/sql/session.sql). With a root holding half of a graph's edges,
    the end of one of its members must still find its edges by the primary
    key, not by reading the whole edge table (migration 0035). The plan of
    the delete in everystep_settle is read with auto_explain."""
    from everystep.db import dags as dag_store  # noqa: PLC0415
    from everystep.db import session  # noqa: PLC0415

    with db.connect() as conn, everystep.transaction(conn):
        g = dags.create("wide")
        root = g.add(noop, key="root")
        middle = [g.add(noop, key=f"m{i}", depends_on=[root]) for i in range(1000)]
        g.add(noop, key="fan-in", depends_on=middle)
        g.seal()
    with db.connect() as conn:
        conn.execute("ANALYZE everystep_dependency")  # the statistics a busy table has: one dependency is half of it
        session.prepare_claiming_session(conn)
        plans = record_plans(conn)
        for member in middle[:8]:
            dag_store.settle_runs(conn, [member.run_id], ["completed"])
    deletes = [plan for plan in plans if "DELETE FROM everystep_dependency" in plan]
    assert len(deletes) == 8
    assert all("everystep_dependency_pkey" in plan and "Seq Scan on everystep_dependency" not in plan
               for plan in deletes), deletes[-1]
