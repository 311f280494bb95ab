"""The engine: step identity, replay, recording, Terminal, unsafe steps,
scheduling — executed in this process against a real PostgreSQL."""

from __future__ import annotations

import collections
import datetime as dt
import decimal
import enum
import logging
import threading
import uuid

import psycopg
import pytest

import everystep
from everystep import (
    EffectUncertain,
    EverystepError,
    StepFailure,
    Terminal,
    WorkflowCodeError,
    parallel,
    registry,
    schedule,
    step,
    store,
    workflow,
)
from tests.processes import wait_for

calls: collections.Counter = collections.Counter()
seen: dict = {}


@pytest.fixture(autouse=True)
def _reset():
    calls.clear()
    seen.clear()


class Crash(BaseException):
    """Stands for the worker dying mid-step: not recorded, leaves the run claimed."""


class Color(enum.Enum):
    RED = "red"
    BLUE = 2


@step
def record(tag):
    calls[tag] += 1
    return tag


@step
def crash_once(tag):
    calls[tag] += 1
    if calls[tag] == 1:
        raise Crash()
    return tag


def schedule_one(db, fn, *args, **kw):
    with db.connect() as conn, everystep.transaction(conn):
        return schedule(fn, *args, **kw)


def step_ids(db, run_id):
    return [s["step_id"] for s in db.steps(run_id)]


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


# ---------------------------------------------------------------- replay


@workflow
def three_steps():
    a = record("one")
    b = crash_once("two")
    c = record("three")
    return [a, b, c]


def test_replay_serves_recorded_steps_without_running_them(db):
    run = schedule_one(db, three_steps)
    with pytest.raises(Crash):
        db.run_pending(runner="w1")
    assert db.run(run.id)["status"] == "running"
    assert step_ids(db, run.id) == ["1"]
    assert db.resume_held("w1") == {run.id: "completed"}
    assert calls == {"one": 1, "two": 2, "three": 1}
    row = db.run(run.id)
    assert row["result"] == ["one", "two", "three"]
    assert row["completed_at"] is not None and row["claimed_by"] == "w1"


@step
def recorded_so_far():
    """The step ids of this run recorded when this step starts."""
    with psycopg.connect(seen["url"]) as conn:
        rows = conn.execute("SELECT step_id FROM everystep_step WHERE workflow_id = %s ORDER BY step_id",
                            (everystep.current().workflow_id,)).fetchall()
    return [row[0] for row in rows]


@workflow
def looks_back():
    record("x")
    record("y")
    return recorded_so_far()


def test_a_steps_outcome_is_written_before_the_next_step_starts(db):
    seen["url"] = db.url
    run = schedule_one(db, looks_back)
    assert db.run_pending() == {run.id: "completed"}
    assert db.run(run.id)["result"] == ["1", "2"]
    assert step_ids(db, run.id) == ["1", "2", "3"]  # the last one with the end of the run


def test_the_end_of_a_run_claims_the_next_one_with_its_recorded_steps(db):
    first, second, third = (schedule_one(db, three_steps) for _ in range(3))
    with db.connect() as conn:
        claims = store.claim(conn, "w1", 2)
        assert [run.id for run in claims] == [first.id, second.id]
        assert claims[1].token != claims[0].token  # a new execution token for every claim
        assert store.record_step(conn, second.id, "w1", claims[1].token, store.StepRow(
            "1", "tests.test_engine.record", "[]", "{}", "done", '"one"', None, 1.0, 2.0))
        # second: scheduled again, one step recorded
        assert store.requeue_held(conn, "w1", [store.Claim(second.id, claims[1].token)]) == [second.id]
        last_step = store.StepRow("1", "tests.test_engine.record", '["one"]', "{}", "done", '"one"', None, 1.0, 2.0)
        claimed = store.finish_run(conn, first.id, "w1", claims[0].token, "completed", '"ok"', None, last_step,
                                   claim=True)
        assert [(run.id, run.steps) for run in claimed] == [
            (second.id, [["1", "tests.test_engine.record", "done", "one", None]])
        ]
        assert claimed[0].token not in (claims[0].token, claims[1].token)
        # Not held any more: nothing is written, nothing claimed.
        assert store.finish_run(conn, first.id, "w1", claims[0].token, "failed", None, None, claim=True) is None
        # Held, but by another execution (a stale token): nothing is written.
        assert store.finish_run(conn, second.id, "w1", claims[1].token, "failed", None, None) is None
    assert (db.run(first.id)["status"], db.run(second.id)["claimed_by"]) == ("completed", "w1")
    assert step_ids(db, first.id) == ["1"]
    assert db.run(third.id)["status"] == "scheduled"


@step
def other_step(tag):
    return tag


@workflow
def diverging():
    record("first")
    crash_once("second")


def diverged():
    other_step("first")  # same id "1", another function


def test_divergence_fails_the_run_with_workflow_code_error(db, monkeypatch):
    run = schedule_one(db, diverging)
    with pytest.raises(Crash):
        db.run_pending(runner="w1")
    monkeypatch.setitem(registry.WORKFLOWS, diverging.__everystep_workflow__, diverged)
    db.resume_held("w1")
    row = db.run(run.id)
    assert row["status"] == "failed"
    assert row["error"]["type"] == "everystep.errors.WorkflowCodeError"
    assert "other_step" in row["error"]["message"]


class CardDeclined(Exception):
    pass


@step
def charge(amount):
    calls["charge"] += 1
    raise CardDeclined(f"declined {amount}")


@step
def refund_hold():
    calls["refund_hold"] += 1
    return "released"


@workflow
def durable_cleanup():
    try:
        charge(10)
    except CardDeclined as exc:
        released = refund_hold()
        crash_once("after")
        return {"error": str(exc), "cleanup": released}


def test_failures_are_recorded_and_re_raised_with_their_type_on_replay(db):
    run = schedule_one(db, durable_cleanup)
    with pytest.raises(Crash):
        db.run_pending(runner="w1")
    db.resume_held("w1")
    row = db.run(run.id)
    assert row["status"] == "completed"
    assert row["result"] == {"error": "declined 10", "cleanup": "released"}
    assert calls == {"charge": 1, "refund_hold": 1, "after": 2}
    failed = db.steps(run.id)[0]
    assert failed["status"] == "failed"
    assert failed["error"] == {
        "type": "tests.test_engine.CardDeclined", "message": "declined 10", "args": ["declined 10"]
    }


def _local_failure():
    class NotImportable(Exception):
        pass

    raise NotImportable("gone")


@step
def fails_with_local_class():
    calls["local"] += 1
    _local_failure()


@workflow
def catches_step_failure():
    try:
        fails_with_local_class()
    except Exception as exc:
        seen.setdefault("types", []).append(type(exc).__name__)
    crash_once("crash")


def test_a_failure_whose_class_cannot_be_imported_replays_as_step_failure(db):
    schedule_one(db, catches_step_failure)
    with pytest.raises(Crash):
        db.run_pending(runner="w1")
    db.resume_held("w1")
    assert seen["types"] == ["NotImportable", "StepFailure"]
    assert calls["local"] == 1


@workflow
def unhandled_failure():
    charge(5)


def test_an_unhandled_step_failure_fails_the_run(db):
    run = schedule_one(db, unhandled_failure)
    db.run_pending()
    row = db.run(run.id)
    assert row["status"] == "failed"
    assert row["error"]["type"] == "tests.test_engine.CardDeclined"
    assert row["completed_at"] is not None


pause = threading.Event()


@workflow
def waits_between_steps():
    record("before")
    pause.wait(20)  # the body, not a step, waits: the outcome above must not wait with it
    record("after")


def test_a_step_outcome_is_written_while_the_body_waits(db):
    pause.clear()
    run = schedule_one(db, waits_between_steps)
    executing = threading.Thread(target=db.run_pending)
    executing.start()
    try:
        wait_for(lambda: step_ids(db, run.id) == ["1"], timeout=5, what="the first outcome written")
    finally:
        pause.set()
        executing.join(30)
    assert db.run(run.id)["status"] == "completed"
    assert step_ids(db, run.id) == ["1", "2"]


# ---------------------------------------------------------------- Terminal


@step
def hand_off(order):
    calls["hand_off"] += 1
    raise Terminal("handed to a human", {"order": order})


@workflow
def stops():
    record("before")
    try:
        hand_off(7)
    except Terminal:
        record("swallowed")  # a Terminal cannot be swallowed: this never runs
    record("after")


def test_terminal_stops_the_run_before_any_further_step(db):
    run = schedule_one(db, stops)
    db.run_pending()
    row = db.run(run.id)
    assert row["status"] == "stopped"
    assert row["error"] == {"type": "everystep.errors.Terminal", "message": "handed to a human",
                            "args": ["handed to a human", {"order": 7}]}
    assert calls == {"before": 1, "hand_off": 1}
    assert [(s["step_id"], s["status"]) for s in db.steps(run.id)] == [("1", "done"), ("2", "failed")]


# ---------------------------------------------------------------- unsafe to repeat


@step(unsafe_to_repeat=True)
def send_money(db_url, run_marker):
    calls["send_money"] += 1
    # The started row is committed before the effect runs.
    with psycopg.connect(db_url) as conn:
        seen["row_before_effect"] = conn.execute(
            "SELECT status FROM everystep_step WHERE step_id = '1'").fetchone()
    if run_marker == "crash" and calls["send_money"] == 1:
        raise Crash()
    return "sent"


@workflow
def pays(db_url, run_marker):
    try:
        return send_money(db_url, run_marker)
    except StepFailure as exc:
        return f"failed: {exc}"


def test_unsafe_step_writes_started_first_and_updates_it_in_place(db):
    run = schedule_one(db, pays, db.url, "ok")
    db.run_pending()
    assert seen["row_before_effect"] == ("started",)
    (row,) = db.steps(run.id)
    assert row["status"] == "done" and row["result"] == "sent"
    assert db.value("SELECT max(id) FROM everystep_step") == row["id"]  # updated, not re-inserted


def _blocked_run(db):
    run = schedule_one(db, pays, db.url, "crash")
    with pytest.raises(Crash):
        db.run_pending(runner="w1")
    db.resume_held("w1")
    row = db.run(run.id)
    assert row["status"] == "blocked"
    assert row["error"]["type"] == "everystep.errors.EffectUncertain"
    assert calls["send_money"] == 1  # never run twice
    return run


def test_unsafe_step_found_started_blocks_the_run(db):
    run = _blocked_run(db)
    assert [s["status"] for s in db.steps(run.id)] == ["started"]


def test_resolve_with_a_result_completes_the_run(db):
    run = _blocked_run(db)
    with db.connect() as conn:
        everystep.resolve_step(conn, run.id, "1", result="confirmed by bank")
    assert db.run(run.id)["status"] == "scheduled"
    db.run_pending()
    row = db.run(run.id)
    assert (row["status"], row["result"], row["error"]) == ("completed", "confirmed by bank", None)
    assert calls["send_money"] == 1


def test_resolve_with_an_error_raises_it_at_the_step(db):
    run = _blocked_run(db)
    with db.connect() as conn:
        everystep.resolve_step(conn, run.id, "1", error="bank rejected it")
    db.run_pending()
    assert db.run(run.id)["result"] == "failed: bank rejected it"
    assert calls["send_money"] == 1


def test_resolve_by_discarding_runs_the_step_again(db):
    run = _blocked_run(db)
    with db.connect() as conn:
        everystep.resolve_step(conn, run.id, "1", discard=True)
    db.run_pending()
    assert db.run(run.id)["result"] == "sent"
    assert calls["send_money"] == 2


def test_resolve_refuses_what_is_not_a_blocked_runs_started_step(db):
    blocked = _blocked_run(db)
    done = schedule_one(db, pays, db.url, "ok")
    db.run_pending()
    with db.connect() as conn:
        with pytest.raises(EverystepError, match="not blocked"):
            everystep.resolve_step(conn, done.id, "1", result=1)
        with pytest.raises(EverystepError, match="no step '9'"):
            everystep.resolve_step(conn, blocked.id, "9", result=1)
        with pytest.raises(EverystepError, match="no run"):
            everystep.resolve_step(conn, uuid.uuid4(), "1", discard=True)
        with pytest.raises(EverystepError, match="exactly one"):
            everystep.resolve_step(conn, blocked.id, "1", result=1, discard=True)
    with db.connect() as conn:
        conn.execute("UPDATE everystep_step SET status = 'done' WHERE workflow_id = %s", (blocked.id,))
        conn.execute("INSERT INTO everystep_step (workflow_id, step_id, name, args, kwargs, status)"
                     " VALUES (%s, '2', 'x', '[]', '{}', 'done')", (blocked.id,))
        with pytest.raises(EverystepError, match="only its started step"):
            everystep.resolve_step(conn, blocked.id, "2", result=1)
    assert db.run(blocked.id)["status"] == "blocked"


def test_removing_the_unsafe_mark_lets_a_started_step_run_again(db, monkeypatch):
    run = schedule_one(db, pays, db.url, "crash")
    with pytest.raises(Crash):
        db.run_pending(runner="w1")
    safe_send = step(send_money.__wrapped__)  # the same function, no longer marked unsafe
    monkeypatch.setitem(registry.WORKFLOWS, pays.__everystep_workflow__,
                        lambda url, marker: safe_send(url, "ok"))
    db.resume_held("w1")
    row = db.run(run.id)
    assert row["status"] == "completed" and row["result"] == "sent"
    (only,) = db.steps(run.id)
    assert only["status"] == "done"
    assert calls["send_money"] == 2


# ---------------------------------------------------------------- parallel errors


@step
def boom(tag):
    calls[tag] += 1
    raise ValueError(tag)


@workflow
def two_failures():
    try:
        parallel(lambda: boom("x"), lambda: record("ok"), lambda: boom("y"))
    except ExceptionGroup as group:
        return sorted(str(e) for e in group.exceptions)


@workflow
def one_failure():
    try:
        parallel(lambda: boom("x"), lambda: record("ok"))
    except ValueError as exc:
        return str(exc)


@workflow
def terminal_in_branch():
    parallel(lambda: boom("x"), lambda: hand_off(1), lambda: boom("y"))


def test_parallel_errors(db):
    two = schedule_one(db, two_failures)
    one = schedule_one(db, one_failure)
    term = schedule_one(db, terminal_in_branch)
    db.run_pending()
    assert db.run(two.id)["result"] == ["x", "y"]
    assert db.run(one.id)["result"] == "x"
    assert db.run(term.id)["status"] == "stopped"
    # Every branch ran to completion and was recorded.
    assert sorted((s["step_id"], s["status"]) for s in db.steps(term.id)) == [
        ("1.0.1", "failed"), ("1.1.1", "failed"), ("1.2.1", "failed")]
    assert sorted(s["step_id"] for s in db.steps(two.id)) == ["1.0.1", "1.1.1", "1.2.1"]


# ---------------------------------------------------------------- values


class Point(tuple):
    pass


VALUES = {
    "datetime": dt.datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=dt.timezone(dt.timedelta(hours=2))),
    "naive": dt.datetime(2026, 1, 2, 3, 4, 5),
    "date": dt.date(2026, 2, 28),
    "time": dt.time(23, 59, 1),
    "timedelta": dt.timedelta(days=-1, seconds=5, microseconds=7),
    "uuid": uuid.UUID("01900000-0000-7000-8000-000000000001"),
    "bytes": b"\x00\xffbinary",
    "decimal": decimal.Decimal("12.50"),
    "enum": Color.RED,
    "int_enum": Color.BLUE,
    "tuple": (1, "two", (3,)),
    "nested": {"$es": "not a tag", "list": [1.5, None, True]},
    "unicode": "żółw ✓",
}


@step
def echo(value):
    return value


@workflow
def round_trip(values):
    assert values == VALUES
    echoed = echo(values)
    assert echoed == VALUES
    crash_once("rt")
    return echoed


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


@workflow
def echo_workflow(value):
    return value


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


# ---------------------------------------------------------------- scheduling


def test_schedule_rolled_back_leaves_nothing_and_committed_is_claimable(db):
    with db.connect() as conn:
        with pytest.raises(RuntimeError):
            with everystep.transaction(conn):
                schedule(echo_workflow, 1)
                raise RuntimeError("order failed")
        assert conn.execute("SELECT count(*) FROM everystep_workflow").fetchone()[0] == 0
        with everystep.transaction(conn):
            run = schedule(echo_workflow, 2)
            assert isinstance(run.id, uuid.UUID) and run.id.version == 7
    assert db.run(run.id)["status"] == "scheduled"
    assert db.run_pending() == {run.id: "completed"}
    assert db.run(run.id)["result"] == 2


def test_schedule_writes_into_an_explicit_or_bound_connection_only(db):
    with pytest.raises(EverystepError, match="no transaction"):
        schedule(echo_workflow, 1)
    with db.connect(autocommit=True) as conn:
        with pytest.raises(EverystepError, match="autocommit"):
            schedule(echo_workflow, 1, conn=conn)
    with db.connect(autocommit=False) as conn:
        schedule(echo_workflow, 3, conn=conn)
        with everystep.use(conn):
            schedule(echo_workflow, 4)
        conn.rollback()
    assert db.value("SELECT count(*) FROM everystep_workflow") == 0


def test_schedule_refuses_a_function_that_is_not_a_workflow(db):
    with db.connect() as conn, everystep.transaction(conn):
        with pytest.raises(TypeError):
            schedule(record, "x")
        with pytest.raises(TypeError):
            schedule(print)
    assert db.value("SELECT count(*) FROM everystep_workflow") == 0


def test_schedule_notifies_listeners_at_commit(db):
    with db.connect() as listener:
        store.listen(listener)
        store.wait_for_runs(listener, "a listener")  # scheduling notifies only when a worker waits
        with db.connect() as conn, everystep.transaction(conn):
            schedule(echo_workflow, 1)
            assert list(listener.notifies(timeout=0.2)) == []  # not before commit
        assert [n.channel for n in listener.notifies(timeout=2, stop_after=1)] == [f"everystep:{db.schema}"]


def test_idempotency_under_eight_concurrent_schedulers(db):
    barrier = threading.Barrier(8)
    ids = []

    def one():
        with db.connect() as conn, everystep.transaction(conn):
            barrier.wait()
            ids.append(schedule(echo_workflow, "once", idempotency_key="order:42"))

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({r.id for r in ids}) == 1
    assert sum(r.created for r in ids) == 1
    assert db.value("SELECT count(*) FROM everystep_workflow") == 1
    # Another workflow may use the same key.
    with db.connect() as conn, everystep.transaction(conn):
        assert schedule(round_trip, VALUES, idempotency_key="order:42").created


# ---------------------------------------------------------------- outside a workflow


def test_outside_a_workflow_everything_is_plain_python():
    assert everystep.current() is None
    assert record("plain", everystep_id="ignored") == "plain"
    assert echo_workflow(5) == 5
    barrier = threading.Barrier(2, timeout=5)
    assert parallel(lambda: barrier.wait() is not None and "a",
                    [lambda: barrier.wait() is not None and "b", lambda: "c"]) == ("a", ("b", "c"))
    assert parallel() == ()
    with pytest.raises(ExceptionGroup):
        parallel(lambda: boom("p"), lambda: boom("q"))


@step
def look_around():
    ctx = everystep.current()
    seen["in_step"] = (ctx.workflow_id, ctx.workflow_name)
    return 1


@workflow
def introspect():
    look_around()
    ctx = everystep.current()
    seen["outcomes"] = dict(ctx.outcomes)
    seen["in_body"] = ctx.workflow_id


def test_current_gives_the_running_workflow(db):
    run = schedule_one(db, introspect)
    db.run_pending()
    assert seen["in_step"] == (run.id, "tests.test_engine.introspect")
    assert seen["in_body"] == run.id
    assert seen["outcomes"]["1"].status == "done" and seen["outcomes"]["1"].result == 1


def test_errors_are_exported():
    assert issubclass(WorkflowCodeError, EverystepError)
    assert issubclass(EffectUncertain, EverystepError)
    assert issubclass(everystep.LostClaim, EverystepError)
