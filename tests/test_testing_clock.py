"""Time travel on the database clock (everystep.testing.advance and the
engine's clock, everystep_now(), of migration 0012): one function moves
time for everything the engine times, for every session of the schema at
once, and costs nothing when it does not move."""

from __future__ import annotations

import datetime as dt

import psycopg
import pytest

import everystep
from everystep import db, schedules
from everystep.errors import EverystepError
from everystep.testing import (
    advance,
    assert_ended,
    drain,
    freeze,
    now,
    reset_clock,
    scheduled_runs,
    step_result,
)
from tests.apps import testing_flows as flows
from tests.support.engine import schedule_in as schedule

HOUR = 3600
DAY = 24 * HOUR
UTC = dt.UTC




def clock_body(conn) -> str:
    return conn.execute("SELECT prosrc FROM pg_proc WHERE oid = 'everystep_now()'::regprocedure").fetchone()[0]


# ---------------------------------------------------------------- the clock itself

def test_the_clock_is_the_servers_until_moved_and_moves_for_every_session(everystep_db):
    conn = everystep_db
    assert clock_body(conn) == " SELECT pg_catalog.now() "  # a deployment's: inlined into now()
    server_now = conn.execute("SELECT now()").fetchone()[0]
    assert abs((now(conn) - server_now).total_seconds()) < 1
    with psycopg.connect(conn.info.dsn, autocommit=True) as other:  # another session of the schema
        other.execute(f"SET search_path = {db.current_schema(conn)}")
        before = now(other)
        advance(conn, HOUR, drain=False)
        assert 3599 < (now(other) - before).total_seconds() < 3610
        reset_clock(conn)
        assert abs((now(other) - before).total_seconds()) < 10
    assert clock_body(conn) == " SELECT pg_catalog.now() "  # back as migrated


def test_freeze_stands_the_clock_still_and_advance_moves_it_frozen(everystep_db):
    conn = everystep_db
    moment = dt.datetime(2030, 1, 1, 9, 0, tzinfo=UTC)
    assert freeze(conn, moment) == moment
    assert now(conn) == moment == now(conn)
    assert advance(conn, dt.timedelta(minutes=90)) == moment + dt.timedelta(minutes=90)
    assert now(conn) == moment + dt.timedelta(minutes=90)  # still frozen


def test_advance_refuses_bad_input_and_an_open_transaction(everystep_db):
    for bad in (-1, float("nan"), "60", True):
        with pytest.raises(EverystepError, match="seconds >= 0"):
            advance(everystep_db, bad)
    with everystep_db.transaction(), pytest.raises(EverystepError, match="outside a transaction"):
        advance(everystep_db, 60)


def test_the_claims_promotion_keeps_its_index_condition_with_the_clock_moved(everystep_db):
    """The claim admits the timers whose time came (everystep_promote,
    0032_ready.sql) by a range scan of everystep_timer_due bounded by the
    engine's clock, inlined: the plan of now(), and of now() + an hour once
    the clock moved (the function's cached plan is made again)."""
    conn = everystep_db
    conn.execute("INSERT INTO everystep_workflow (id, name, args, status, due_at) SELECT gen_random_uuid(),"
                 " 'app.later', '[]', 'waiting', now() + interval '1 day' FROM generate_series(1, 20000)")
    conn.execute("ANALYZE everystep_timer")
    plans: list[str] = []
    conn.add_notice_handler(lambda diagnostic: plans.append(diagnostic.message_primary or ""))
    conn.execute("LOAD 'auto_explain'")
    for setting, value in (("log_min_duration", "0"), ("log_nested_statements", "on"), ("log_level", "notice")):
        conn.execute(f"SET auto_explain.{setting} = {value}")

    def promotion_condition() -> str:
        plans.clear()
        conn.execute("SELECT everystep_promote(10)")
        (plan,) = [plan for plan in plans if "everystep_timer_due" in plan]
        return next(line.strip() for line in plan.splitlines() if "Index Cond" in line)

    assert promotion_condition() == "Index Cond: (due_at <= now())"
    advance(conn, HOUR, drain=False)
    assert promotion_condition() == "Index Cond: (due_at <= (now() + '01:00:00'::interval))"
    conn.execute("SET auto_explain.log_min_duration = -1")



def test_a_day_of_hourly_sleeps_runs_every_hour_at_its_time(everystep_db):
    run = schedule(everystep_db, flows.hourly, 24)
    start = now(everystep_db)
    drain()
    advance(everystep_db, DAY)
    assert assert_ended(run.id).result == [f"hour {h}" for h in range(24)]
    # Each sleep counted from the moment the previous one ended: the wake times are the hours exactly.
    wakes = [step["result"] for step in db.load_steps(everystep_db, run.id) if step["name"] == "everystep.sleep"]
    assert [round(wake - start.timestamp()) for wake in wakes] == [HOUR * (h + 1) for h in range(24)]


def test_a_wait_times_out_and_a_message_in_time_is_taken(everystep_db):
    expiring = schedule(everystep_db, flows.approval, "ann")
    answered = schedule(everystep_db, flows.approval, "bob")
    drain()
    advance(everystep_db, 12 * HOUR)
    with everystep.transaction(everystep_db):
        everystep.send(answered.id, "approval", {"amount": 30})
    drain()
    assert assert_ended(answered.id).result == "ch_bob_30"
    assert scheduled_runs(flows.approval, status="waiting")[0].id == expiring.id
    advance(everystep_db, 12 * HOUR)
    assert assert_ended(expiring.id).result == "expired"


def test_retries_wait_their_back_off_on_the_clock(everystep_db):
    run = schedule(everystep_db, flows.retried, "rates")
    drain()
    assert flows.calls["rates"] == 1
    advance(everystep_db, 59, drain=True)
    assert flows.calls["rates"] == 1  # the first back-off is 60 s
    advance(everystep_db, 1)
    assert flows.calls["rates"] == 2
    advance(everystep_db, 120)  # the second is 120 s
    assert step_result(run.id, "1") == 3
    [step] = db.load_steps(everystep_db, run.id)
    assert [round(a["retry_at"] - a["at"]) for a in step["attempts"]] == [60, 120]


def test_an_hourly_schedule_fires_every_hour_of_a_day(everystep_db):
    conn = everystep_db
    freeze(conn, dt.datetime(2030, 3, 1, 0, 30, tzinfo=UTC))
    with everystep.transaction(conn):
        schedules.put("reports", flows.report, ["daily"], cron="0 * * * *")
    advance(conn, DAY)
    runs = scheduled_runs(flows.report)
    assert len(runs) == 24 and {run.status for run in runs} == {"completed"}
    fired = sorted(row[0] for row in conn.execute("SELECT fire_at FROM everystep_schedule_run"))
    assert fired == [dt.datetime(2030, 3, 1, 1, tzinfo=UTC) + dt.timedelta(hours=h) for h in range(24)]
    # Each fired on time: at its fire time by the engine's clock, not once for the missed ones.
    assert [run.created_at for run in runs] == fired


def test_a_jump_fires_a_schedule_once_as_its_catch_up_says(everystep_db):
    conn = everystep_db
    freeze(conn, dt.datetime(2030, 3, 1, 0, 30, tzinfo=UTC))
    with everystep.transaction(conn):
        schedules.put("reports", flows.report, ["daily"], cron="0 * * * *")
    advance(conn, DAY, drain=False)
    drain()
    assert len(scheduled_runs(flows.report)) == 1  # fire_once: the latest of the missed times


def test_cancel_times_ages_and_pruning_follow_the_clock(everystep_db):
    conn = everystep_db
    run = schedule(conn, flows.later, "x", after=DAY)
    advance(conn, HOUR, drain=False)
    with everystep.transaction(conn):
        assert everystep.cancel(run.id) == "cancelled"
    row = db.load_run(conn, run.id)
    assert abs((row["completed_at"] - now(conn)).total_seconds()) < 5
    assert (row["completed_at"] - row["created_at"]).total_seconds() > HOUR - 5
    assert db.count_expired(conn, "cancelled", 30 * DAY) == 0
    advance(conn, 31 * DAY, drain=False)
    assert db.count_expired(conn, "cancelled", 30 * DAY) == 1


def test_a_worker_in_another_session_sees_the_time_move(everystep_db, everystep_worker):
    run = schedule(everystep_db, flows.later, "worker", after=DAY)
    everystep_worker.wait_idle()
    assert db.load_run(everystep_db, run.id)["status"] == "waiting"
    advance(everystep_db, DAY, drain=False)  # the worker's prepared claims are planned again
    everystep_worker.wait_idle()
    assert_ended(run.id)
