"""The console's second pass, below the browser: every execution of a run
(the rare statements that end one record it), what a run's page gets from
the API (messages, events, children, re-runs, the execution history, whether
its claimer is alive), the UI's re-run and send actions, and the charts'
per-minute figures the maintenance child keeps."""

from __future__ import annotations

import datetime
import uuid

import pytest

import everystep
import everystep.db
from everystep import liveness, operations, scheduler
from everystep.ui.core import Console, Problem, Who
from tests.apps import console_workflows, ui_workflows
from tests.apps.console_workflows import BUG, pay_then_deliver
from tests.support.engine import take_lock_from
from tests.test_rerun import _reset  # noqa: F401  (the workflows' flags and calls, reset for each test)

ACTOR = operations.Actor("ada@host", "cli")
OPERATOR = Who("operator", "operator")


@pytest.fixture
def console(db):
    c = Console(db.url)
    yield c
    c.close()


def executions(db, run) -> list[tuple]:
    return db.query("SELECT token, claimer, outcome FROM everystep_execution WHERE run_id = %s ORDER BY id", (run,))


def claimed(db, runner: str, n: int = 1) -> list:
    with db.connect() as conn:
        return everystep.db.claim(conn, runner, n)


def test_each_rare_end_of_an_execution_is_recorded(db):
    runs = [run.id for run in db.schedule_many(ui_workflows.slow, [(0.0,)] * 5)]
    [a, b, c, d, e] = claimed(db, "gone-1", 5)
    with db.connect() as conn:
        everystep.db.requeue_held(conn, "gone-1", [everystep.db.Claim(a.id, a.token)])  # a drain
        everystep.db.requeue_held(conn, "gone-1", [everystep.db.Claim(b.id, b.token)], "swept")
        operations.requeue(conn, ACTOR, [c.id])  # nobody holds gone-1's lock: an operator's requeue
        [d2] = [r for r in everystep.db.reclaim_held(conn, "gone-1", [e.token]) if r.id == d.id]  # a lost claim
        [e2] = [r for r in everystep.db.reclaim_held(conn, "gone-1") if r.id == e.id]  # a crash: catchup
        everystep.db.requeue_claimer(conn, "gone-1")  # the shutdown requeues what is left
    assert executions(db, a.id) == [(a.token, "gone-1", "drained")]
    assert executions(db, b.id) == [(b.token, "gone-1", "swept")]
    assert executions(db, c.id) == [(c.token, "gone-1", "requeued")]
    [lost, crashed, shutdown] = executions(db, d.id)
    assert (lost, crashed) == ((d.token, "gone-1", "lost"), (d2.token, "gone-1", "crashed"))
    assert shutdown[1:] == ("gone-1", "shutdown") and shutdown[0] > d2.token
    assert executions(db, e.id)[0] == (e.token, "gone-1", "crashed")
    assert e2.token != e.token
    assert db.value("SELECT count(*) FROM everystep_execution") == 8
    assert set(runs) == {a.id, b.id, c.id, d.id, e.id}


def test_the_sweep_records_the_dead_claimers_executions(db):
    db.schedule_many(ui_workflows.slow, [(0.0,)])
    [run] = claimed(db, "gone-2")
    with db.connect() as conn:
        assert liveness.DeadClaimerSweep(grace=0, max_crashes=3).sweep(conn) == [run.id]
    assert executions(db, run.id) == [(run.token, "gone-2", "swept")]


def test_a_run_page_has_everything_the_run_has(db, console):
    [original] = [run.id for run in db.schedule_many(pay_then_deliver, [("o-1",)])]
    [a] = claimed(db, "gone-3")
    with db.connect() as conn:
        everystep.db.requeue_held(conn, "gone-3", [everystep.db.Claim(a.id, a.token)])
    db.run_pending()
    page = console.run(str(original))
    assert page["status"] == "failed" and page["rerun_of"] is None and page["reruns"] == []
    history = page["execution_history"]
    assert [h["outcome"] for h in history] == ["drained", "failed"]
    assert history[0]["claimer"] == "gone-3" and history[1]["claimer"] == "test-runner"
    assert history[1]["steps"] == 5 and history[1]["first_step_at"] is not None
    BUG["on"] = False
    answer = console.act(OPERATOR, "rerun", {"runs": [str(original)], "from_step": "4"})
    [new] = answer["done"]
    assert console.run(str(original))["reruns"] == [new]
    assert console.run(str(new))["rerun_of"] == original
    with pytest.raises(Problem, match="has no step '7'") as refused:
        console.act(OPERATOR, "rerun", {"runs": [str(original)], "from_step": "7"})
    assert refused.value.status == 404
    with pytest.raises(Problem, match="viewers cannot act"):
        console.act(Who("viewer", "viewer"), "rerun", {"runs": [str(original)], "from_step": "4"})


def test_send_a_message_to_a_waiting_run_from_its_page(db, console):
    [run] = [r.id for r in db.schedule_many(console_workflows.waits_for_approval, [("o-9",)])]
    db.run_pending()
    page = console.run(str(run))
    assert page["status"] == "waiting" and page["waiting_on"] == "message:approval"
    assert page["execution_history"][-1]["outcome"] == "parked"
    assert [(e["key"], e["value"]) for e in page["events"]] == [("stage", "awaiting approval")]
    answer = console.act(OPERATOR, "send", {"run": str(run), "topic": "approval", "payload": '{"by": "ada"}'})
    assert answer["done"] == [run]
    assert db.query("SELECT actor, action, target FROM everystep_audit") == [("operator", "send", "approval")]
    assert [m["topic"] for m in console.run(str(run))["messages"]] == ["approval"]
    db.run_pending()
    assert db.run(run)["result"] == "o-9: {'by': 'ada'}"
    with pytest.raises(Problem, match="completed; it takes no more messages") as refused:
        console.act(OPERATOR, "send", {"run": str(run), "topic": "approval", "payload": "1"})
    assert refused.value.status == 409
    with pytest.raises(Problem, match="payload is not a valid everystep JSON value"):
        console.act(OPERATOR, "send", {"run": str(run), "topic": "approval", "payload": "{nope"})
    with pytest.raises(Problem, match="no run") as unknown:
        console.act(OPERATOR, "send", {"run": str(uuid.uuid4()), "topic": "approval", "payload": "1"})
    assert unknown.value.status == 404
    assert db.value("SELECT count(*) FROM everystep_audit") == 1


def test_the_requeue_button_only_when_the_claimer_is_dead(db, console):
    db.schedule_many(ui_workflows.slow, [(0.0,), (0.0,)])
    [dead] = claimed(db, "gone-4")
    with db.connect() as holder:
        take_lock_from(holder, "alive-1", ())
        [alive] = claimed(db, "alive-1")
        assert console.run(str(alive.id))["claimer_alive"] is True
        assert console.run(str(dead.id))["claimer_alive"] is False


def test_the_charts_figures_per_minute(db, console):
    with db.connect() as conn:
        at = datetime.datetime(2026, 3, 1, 12, 0, 30, tzinfo=datetime.UTC)
        everystep.db.set_clock(conn, at, True)
    runs = [run.id for run in db.schedule_many(pay_then_deliver, [("a",), ("b",)])]
    BUG["on"] = False
    db.run_pending()  # one completes...
    BUG["on"] = True
    db.schedule_many(pay_then_deliver, [("c",)])
    db.run_pending()  # ...one fails
    db.schedule_many(ui_workflows.slow, [(0.0,)] * 3)  # due, not claimed: the backlog
    with db.connect() as conn:
        everystep.db.set_clock(conn, at + datetime.timedelta(seconds=20), True)
        everystep.db.roll_up_minutes(conn)
        again = everystep.db.roll_up_minutes(conn)  # idempotent: the minute is counted again, not added
    assert again == datetime.datetime(2026, 3, 1, 12, 0, tzinfo=datetime.UTC)
    charts = console.charts({"window": "hour"})
    [minute] = [m for m in charts["minutes"] if m["completed"] or m["failed"]]
    assert (minute["completed"], minute["failed"], minute["due"], minute["blocked"]) == (2, 1, 3, 0)
    assert minute["oldest_due_s"] == pytest.approx(20, abs=1)
    wf = console.charts({"window": "day", "workflow": "tests.apps.ui_workflows.slow"})
    assert [(m["completed"], m["due"]) for m in wf["minutes"]] == [(0, 3)]
    names = {s["name"]: s for s in charts["steps"]}
    assert names["tests.apps.console_workflows.deliver"]["steps"] == 3
    assert names["tests.apps.console_workflows.deliver"]["failed"] == 1
    assert "everystep.sleep" not in names and names["tests.apps.console_workflows.ship"]["p50"] >= 0
    assert {type(v) for v in names["tests.apps.console_workflows.ship"].values()} <= {str, int, float}  # JSON
    with pytest.raises(Problem, match="window must be one of hour, day"):
        console.charts({"window": "year"})
    with db.connect() as conn:
        everystep.db.set_clock(conn, at + datetime.timedelta(days=3), True)
        assert everystep.db.prune_minutes(conn) >= 2
    assert len(runs) == 2


def test_a_schedules_fires_and_their_outcomes(db, console):
    day = datetime.datetime(2026, 3, 1, 2, 59, tzinfo=datetime.UTC)
    with db.connect() as conn:
        everystep.db.set_clock(conn, day, True)
        scheduler.apply(conn, {"nightly": scheduler.Schedule(workflow="tests.apps.ui_workflows.slow",
                                                             cron="0 3 * * *", args=(0.0,))})
        for n in (1, 2):
            everystep.db.set_clock(conn, day + datetime.timedelta(days=n - 1, minutes=2), True)
            scheduler.tick(conn)
            if n == 1:
                db.run_pending()
    fires = console.schedule_fires("nightly")["fires"]
    assert [(f["fire_at"].day, f["status"]) for f in fires] == [(2, "scheduled"), (1, "completed")]
