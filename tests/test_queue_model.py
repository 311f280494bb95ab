"""The data model of 0032_ready.sql: the run row is the record, where a run
waits is a narrow row (a timer, blocked for room, ready, held), admission
happens at the event that makes a run runnable, and the claim reads only
the ready runs."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import psycopg
import pytest

import everystep
import everystep.db
from everystep.testing import advance
from tests.apps import workflows
from tests.apps.priority_workflows import tenant_job_bounded
from tests.support.concurrency import hold_a_snapshot, reporting_thread
from tests.support.engine import OLD_CLAIM, in_ready_order
from tests.support.plans import record_plans
from tests.support.processes import wait_for

BOUNDED = tenant_job_bounded.__everystep_workflow__
SQL = Path(everystep.db.__file__).resolve().parent / "sql"
# What changes on the run row while it is claimed, run and ended: no index may
# name it, or the claim's and the end's updates could not be HOT.
CHANGING = ("status", "due_at", "claimed_by", "claim_token", "slot", "completed_at", "result", "error", "wakes",
            "waiting_on", "cancel_requested_at")


def where(db, run) -> list[str]:
    return [table for table in ("timer", "blocked", "ready", "claimed")
            if db.value(f"SELECT count(*) FROM everystep_{table} WHERE run_id = %s", (run.id,))]


def test_a_claim_and_an_end_update_the_run_row_hot(db):
    with db.connect() as conn, everystep.transaction(conn):
        everystep.schedule(workflows.quick, "unused")
    with db.connect() as conn, conn.transaction():
        (run,) = everystep.db.claim(conn, "w1", 1)
        everystep.db.finish_run(conn, run.id, "w1", run.token, "completed", "null", None)
        updates, hot = conn.execute("SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables"
                                    " WHERE relid = 'everystep_workflow'::regclass").fetchone()
    assert (updates, hot) == (2, 2)


def test_no_index_of_the_run_row_names_what_changes_while_it_runs(db):
    definitions = [row[0] for row in db.query(
        "SELECT pg_get_indexdef(indexrelid) FROM pg_index WHERE indrelid = 'everystep_workflow'::regclass")]
    assert definitions
    for definition in definitions:
        named = set(re.findall(r"\b(\w+)\b", definition.split(" USING ", 1)[1]))
        assert not named & set(CHANGING), definition


def test_the_claim_is_short_and_no_statement_is_large():
    claim = everystep.db.queries.get("claim")
    schema = (SQL.parent / "schema.sql").read_text()  # the newest definition (0036)
    function = re.search(r"CREATE FUNCTION everystep_claim\(.*?END \$\$;", schema, re.S).group(0)
    assert len(claim) + len(function) <= 3000
    for path in SQL.glob("*.sql"):
        for statement in re.split(r"(?m)^(?=-- name: )", path.read_text())[1:]:
            assert len(statement) <= 6000, (path.name, statement.split("\n", 1)[0])


def test_an_end_finds_its_runs_by_key_under_a_writers_plan_made_on_a_small_table(db):
    """A worker's writer plans end_runs once, generic (db/sql/session.sql),
    perhaps while the run table is small and was never analyzed (a new
    schema; a server without autovacuum never corrects it): the plan must
    still find the ended runs by the primary key, not read the whole run
    table at every end as it grows. The plan is read with auto_explain."""
    from everystep.db import session  # noqa: PLC0415

    def schedule(count: int) -> None:
        with db.connect() as producer, everystep.transaction(producer):
            for i in range(count):
                everystep.schedule(workflows.quick, str(i))

    def end(conn, runs) -> list[str]:
        ends = [everystep.db.EndWrite(run.id, run.token, "completed", "null", None, None, False) for run in runs]
        return [end.status for end in everystep.db.end_runs(conn, "w1", ends, None).finished]

    with db.connect() as conn:
        session.prepare_claiming_session(conn)
        schedule(1000)  # a first batch: 40 pages, where a read of them all looks cheaper than 10 probes
        assert end(conn, everystep.db.claim(conn, "w1", 1)) == ["completed"]  # planned now
        runs = everystep.db.claim(conn, "w1", 2)
        conn.execute("LOAD 'auto_explain'")
        for setting in ("auto_explain.log_min_duration = 0", "client_min_messages = log"):
            conn.execute(f"SET {setting}")
        plans: list[str] = []
        conn.add_notice_handler(lambda notice: plans.append(notice.message_primary))
        assert end(conn, runs) == ["completed", "completed"]
    (plan,) = [plan for plan in plans if "everystep_claim(" in plan]
    assert "everystep_workflow_pkey" in plan and "Seq Scan on everystep_workflow" not in plan, plan


def test_a_claim_deletes_the_queue_rows_it_took_by_their_address_whatever_the_statistics(db):
    """A claiming session plans the claim once, generic, without sequential
    scans (db/sql/session.sql), perhaps just after a vacuum found a queue
    table nearly empty, when the statistics call it tiny: the deletes of the
    ready rows and due timers it took must still probe each row (a TID scan
    by the ctid it locked), not walk a whole index with the taken rows
    inside, which reads the whole backlog at every claim (0036). The plans
    of the claim's statements are read with auto_explain."""
    from everystep.db import session  # noqa: PLC0415

    with db.connect() as conn:
        # What a vacuum of the queue tables while they held a row or so
        # leaves the planner.
        conn.execute("UPDATE pg_class SET reltuples = 1, relpages = 1 WHERE oid IN"
                     " ('everystep_ready'::regclass, 'everystep_ready_pkey'::regclass,"
                     " 'everystep_ready_order'::regclass, 'everystep_timer'::regclass,"
                     " 'everystep_timer_pkey'::regclass, 'everystep_timer_due'::regclass)")
        session.prepare_claiming_session(conn)
        assert everystep.db.claim(conn, "w1", 1) == []  # planned now: the queue tables hold no row
        with db.connect() as producer, everystep.transaction(producer):
            for i in range(1000):
                everystep.schedule(workflows.quick, str(i))
            for i in range(3):
                everystep.schedule(workflows.quick, f"due-{i}", after=0.01)
        time.sleep(0.05)  # the delayed runs are due: the next claim admits them
        plans = record_plans(conn)
        taken = everystep.db.claim(conn, "w1", 8)
    assert len(taken) == 8 and len({run.id for run in taken}) == 8
    assert db.value("SELECT count(*) FROM everystep_ready WHERE run_id = ANY(%s)", ([run.id for run in taken],)) == 0
    assert db.value("SELECT count(*) FROM everystep_timer") == 0  # the due ones were admitted
    (ready,) = [plan for plan in plans if "DELETE FROM everystep_ready" in plan]
    (timer,) = [plan for plan in plans if "DELETE FROM everystep_timer" in plan]
    assert "Tid Scan on everystep_ready" in ready, ready
    assert "Tid Scan on everystep_timer" in timer, timer


READY = "SELECT run_id, name, priority, ready_at, slot FROM everystep_ready ORDER BY run_id"


def test_a_queue_table_whose_dead_rows_a_held_snapshot_keeps_is_rewritten_with_its_live_rows(db):
    """Under a snapshot held open, the ready rows the claims deleted stay, and
    each claim steps over their index entries at the front of the ready
    order: the vacuum cannot remove them, the compaction (0037) rewrites the
    table with its live rows alone, which the claims then take as before."""
    holder = hold_a_snapshot(db.url)
    try:
        with db.connect() as conn, everystep.transaction(conn):
            for i in range(600):
                everystep.schedule(workflows.quick, str(i), priority=i % 3)
        with db.connect() as conn:
            assert len(everystep.db.claim(conn, "gone", 500)) == 500
            live = conn.execute(READY).fetchall()
            conn.execute("VACUUM everystep_ready")
            assert conn.execute("SELECT pg_stat_get_dead_tuples('everystep_ready'::regclass)").fetchone()[0] >= 500
            size = conn.execute("SELECT pg_relation_size('everystep_ready')").fetchone()[0]
            assert everystep.db.compact_queue(conn, dead=500, live=10_000, wait_ms=5000) == ["everystep_ready"]
            assert conn.execute(READY).fetchall() == live
            assert conn.execute("SELECT pg_relation_size('everystep_ready')").fetchone()[0] < size / 2
            expected = [row[0] for row in conn.execute(
                "SELECT run_id FROM everystep_ready ORDER BY priority DESC, ready_at, run_id").fetchall()]
            assert [run.id for run in everystep.db.claim(conn, "w1", 100)] == expected
    finally:
        holder.close()


def test_a_compaction_that_does_not_get_its_lock_in_time_changes_nothing(db):
    """A producer's transaction that scheduled a run and has not committed
    holds the ready table: the compaction waits `wait_ms` for its lock, gives
    up, and leaves every row as it was; the producer commits as usual."""
    with db.connect() as conn, everystep.transaction(conn):
        for i in range(10):
            everystep.schedule(workflows.quick, str(i))
    before = db.query(READY)
    with db.connect(autocommit=False) as producer:
        with everystep.transaction(producer):
            late = everystep.schedule(workflows.quick, "late")
            with db.connect() as conn:
                began = time.monotonic()
                assert "everystep_ready" not in everystep.db.compact_queue(conn, dead=0, live=10_000, wait_ms=100)
                assert time.monotonic() - began < 5
    after = db.query(READY)
    assert [row for row in after if row[0] != late.id] == before
    assert late.id in {row[0] for row in after}


def test_a_compaction_leaves_a_table_a_reader_holds_without_waiting(db):
    """A reader's lock may last (a pg_dump holds every table it dumps until
    it ends): the compaction does not wait behind it at every sweep, making
    the claims queue behind its own lock request, and changes nothing."""
    with db.connect() as conn, everystep.transaction(conn):
        for i in range(10):
            everystep.schedule(workflows.quick, str(i))
    before = db.query(READY)
    with db.connect(autocommit=False) as reader:
        reader.execute("SELECT count(*) FROM everystep_ready")
        with db.connect() as conn:
            began = time.monotonic()
            assert "everystep_ready" not in everystep.db.compact_queue(conn, dead=0, live=10_000, wait_ms=10_000)
            assert time.monotonic() - began < 5
    assert db.query(READY) == before


def test_a_rewrite_of_the_timers_does_not_wait_behind_the_ready_tables_lock(db):
    """A claim locks the timers, then the ready runs. Each queue table is
    rewritten in a transaction of its own: a claim that holds the timers and
    asks for the ready table while the rewrite waits for the timers goes on
    at once, and the timers are rewritten once it ends. In one transaction
    for all three, the claim waited for the rewrite of the ready table to
    end, which waited for the claim until its lock's time ran out, and the
    timers were not rewritten."""
    with db.connect() as conn, everystep.transaction(conn):
        everystep.schedule(workflows.quick, "now")
        everystep.schedule(workflows.quick, "later", after=3600)
    errors: list[BaseException] = []
    rewritten: list[str] = []

    def compact() -> None:
        with db.connect() as conn:
            rewritten.extend(everystep.db.compact_queue(conn, dead=0, live=10_000, wait_ms=500))

    waiting_for_timers = ("SELECT count(*) FROM pg_locks WHERE relation = 'everystep_timer'::regclass"
                          " AND mode = 'AccessExclusiveLock' AND NOT granted")
    with db.connect() as claim, claim.transaction():
        claim.execute("LOCK TABLE everystep_timer IN ROW SHARE MODE")
        compactor = reporting_thread(errors, compact)
        compactor.start()
        wait_for(lambda: db.value(waiting_for_timers) == 1, timeout=30, what="the rewrite of the timers waiting")
        started = time.monotonic()
        claim.execute("LOCK TABLE everystep_ready IN ROW SHARE MODE")
        waited = time.monotonic() - started
    compactor.join(30)
    assert not errors and not compactor.is_alive()
    assert waited < 0.25
    assert rewritten == list(everystep.db.queue.QUEUE_TABLES)


def test_the_timers_and_the_blocked_runs_are_rewritten_as_they_were(db):
    """The other queue tables a snapshot can leave dirty: the timers' due
    order and the blocked runs' (a limited workflow's backlog), each row put
    back as it was, and the runs admitted from them as before."""
    with db.connect() as conn:
        everystep.db.apply_limits(conn, {BOUNDED: 1})
    with db.connect() as conn, everystep.transaction(conn):
        delayed = [everystep.schedule(workflows.quick, f"later-{i}", after=3600) for i in range(5)]
        bounded = [everystep.schedule(tenant_job_bounded, "t", 0) for _ in range(3)]
    timers = "SELECT run_id, due_at FROM everystep_timer ORDER BY run_id"
    blocked = "SELECT run_id, name, ckey, priority, due_at FROM everystep_blocked ORDER BY run_id"
    before = (db.query(timers), db.query(blocked))
    assert len(before[0]) == 5 and len(before[1]) == 2
    assert db.value("SELECT everystep_compact('everystep_timer', 1000)"
                    " AND everystep_compact('everystep_blocked', 1000)")
    assert (db.query(timers), db.query(blocked)) == before
    with db.connect() as conn:
        (first,) = everystep.db.claim(conn, "w1", 10)
        assert first.id == bounded[0].id
        everystep.db.finish_run(conn, first.id, "w1", first.token, "completed", "null", None)
    assert where(db, bounded[1]) == ["ready"] and where(db, delayed[0]) == ["timer"]


def test_only_the_queue_tables_are_compacted(db):
    with db.connect() as conn:
        with pytest.raises(psycopg.errors.RaiseException, match="not a queue table"):
            conn.execute("SELECT everystep_compact('everystep_workflow', 10)")


def test_a_run_waits_in_one_place_at_a_time_from_its_schedule_to_its_end(db):
    with db.connect() as conn:
        everystep.db.apply_limits(conn, {BOUNDED: 1})
    with db.connect() as conn, everystep.transaction(conn):
        first = everystep.schedule(tenant_job_bounded, "t", 0)
        second = everystep.schedule(tenant_job_bounded, "t", 0)
        later = everystep.schedule(workflows.quick, "unused", after=3600)
    assert (where(db, first), where(db, second), where(db, later)) == (["ready"], ["blocked"], ["timer"])
    with db.connect() as conn:
        (run,) = everystep.db.claim(conn, "w1", 5)
        assert run.id == first.id and where(db, first) == ["claimed"]
        everystep.db.finish_run(conn, run.id, "w1", run.token, "completed", "null", None)
    assert (where(db, first), where(db, second)) == ([], ["ready"])  # the end gave its slot to the next
    with db.connect() as conn:
        advance(conn, 3601, drain=False)
        assert {r.id for r in everystep.db.claim(conn, "w1", 5)} == {second.id, later.id}  # the timer is due
    assert (where(db, second), where(db, later)) == (["claimed"], ["claimed"])
    with db.connect() as conn:
        assert everystep.db.requeue_claimer(conn, "w1")
    assert (where(db, second), where(db, later)) == (["ready"], ["ready"])
    with db.connect() as conn, everystep.transaction(conn):
        everystep.cancel(later.id)
    assert where(db, later) == []


def trigger_calls(conn) -> int:
    """How many times the trigger's function ran on this connection, not yet
    flushed to the statistics (compare two readings in one transaction)."""
    return conn.execute(
        "SELECT coalesce(pg_stat_get_xact_function_calls('everystep_queue'::regproc), 0)").fetchone()[0]


def test_the_trigger_leaves_a_claim_alone_and_holds_a_run_made_running_by_hand(db):
    """A claim moves the queue rows itself, and only a claim gives a run a
    new execution token as it makes it running: the trigger does not fire
    at its update (0039). A run made running by hand keeps its token: the
    trigger takes it out of the queue and holds it for its claimed_by."""
    claimed, by_hand = db.schedule_many(workflows.quick, [("a",), ("b",)])
    with db.connect() as conn, conn.transaction():
        conn.execute("SET LOCAL track_functions = 'pl'")
        before = trigger_calls(conn)
        (run,) = everystep.db.claim(conn, "w1", 1)
        assert run.id == claimed.id and trigger_calls(conn) == before
        conn.execute("UPDATE everystep_workflow SET status = 'running', claimed_by = 'w2' WHERE id = %s",
                      (by_hand.id,))
        assert trigger_calls(conn) == before + 1
        everystep.db.finish_run(conn, run.id, "w1", run.token, "completed", "null", None)
        assert trigger_calls(conn) == before + 2  # the end: out of everystep_claimed
    assert (where(db, claimed), where(db, by_hand)) == ([], ["claimed"])
    assert db.value("SELECT claimed_by FROM everystep_claimed WHERE run_id = %s", (by_hand.id,)) == "w2"


def test_the_sweep_holds_the_runs_an_older_version_claimed_itself(db):
    """A worker of a version before 0032 claims with its own statement, with a
    new token: the trigger takes it for a claim and leaves the queue row
    behind, at the head of the ready order, where a new worker's claim skips
    it and takes nothing. The sweep takes such rows out, holds the running
    run for its claimed_by (the dead-claimer recovery reads those) and lets
    the claims through (0040)."""
    running, ended, waiting = db.schedule_many(workflows.quick, [("a",), ("b",), ("c",)])
    with db.connect() as conn:
        conn.execute(OLD_CLAIM, (running.id,))
        conn.execute(OLD_CLAIM, (ended.id,))
        conn.execute("UPDATE everystep_workflow SET status = 'completed', completed_at = now() WHERE id = %s",
                     (ended.id,))
    assert (where(db, running), where(db, ended)) == (["ready"], ["ready"])
    with db.connect() as conn, conn.transaction():
        assert everystep.db.claim(conn, "w1", 2) == []  # the two rows left behind stand before the third
    with db.connect() as conn:
        assert everystep.db.sort_lanes(conn) == 2
    assert (where(db, running), where(db, ended), where(db, waiting)) == (["claimed"], [], ["ready"])
    assert db.value("SELECT claimed_by FROM everystep_claimed WHERE run_id = %s", (running.id,)) == "old-0"
    with db.connect() as conn, conn.transaction():
        assert [run.id for run in everystep.db.claim(conn, "w1", 2)] == [waiting.id]


def records_read(conn) -> int:
    """Run records read in this transaction so far."""
    return conn.execute("SELECT seq_tup_read + idx_tup_fetch FROM pg_stat_xact_user_tables"
                        " WHERE relid = 'everystep_workflow'::regclass").fetchone()[0]


def test_between_its_looks_at_the_whole_queue_the_sweep_reads_its_head_for_strays(db):
    """The look for strays among the first runs of the ready order reads
    their records alone, not the queue's: a stray further back waits for
    the look at the whole queue. The readmission reads no record while no
    limited workflow has a ready run without its room. Both whatever the
    plans the session made while the tables were empty (0042)."""
    with db.connect() as conn:
        everystep.db.apply_limits(conn, {BOUNDED: 1})
        for _ in range(8):  # the session's plans, made on empty tables
            conn.execute("SELECT everystep_hold_strays(10), everystep_readmit()")
        db.schedule_many(workflows.quick, [(str(i),) for i in range(500)])
        order = in_ready_order(db)
        head, deep = order[0], order[20]
        conn.execute(OLD_CLAIM, (head,))
        conn.execute(OLD_CLAIM, (deep,))
        with conn.transaction():
            assert conn.execute("SELECT everystep_hold_strays(10)").fetchone()[0] == 1
            read = records_read(conn)
            assert read < 20  # the head's 10 records and the stray's again; the whole-queue look reads 500
            assert conn.execute("SELECT everystep_readmit()").fetchone()[0] == 0
            assert records_read(conn) == read
        assert in_ready_order(db) == [run for run in order if run != head]
        assert db.value("SELECT claimed_by FROM everystep_claimed WHERE run_id = %s", (head,)) == "old-0"
        assert everystep.db.sort_lanes(conn, whole_queue=True) == 1
    assert deep not in in_ready_order(db)
    assert db.value("SELECT claimed_by FROM everystep_claimed WHERE run_id = %s", (deep,)) == "old-0"


def promotions_in(conn) -> int:
    """How many times everystep_promote ran in this transaction so far."""
    return conn.execute(
        "SELECT coalesce(pg_stat_get_xact_function_calls('everystep_promote'::regproc), 0)").fetchone()[0]


def test_a_claim_admits_timers_only_when_one_is_due(db):
    with db.connect() as conn, everystep.transaction(conn):
        ready = everystep.schedule(workflows.quick, "now")
        later = everystep.schedule(workflows.quick, "later", after=3600)
    with db.connect() as conn, conn.transaction():
        conn.execute("SET LOCAL track_functions = 'pl'")
        assert [r.id for r in everystep.db.claim(conn, "w1", 5)] == [ready.id]
        assert everystep.db.claim(conn, "w1", 5) == []
        assert promotions_in(conn) == 0  # a timer waits, none is due: nothing to admit
    with db.connect() as conn:
        advance(conn, 3601, drain=False)
    with db.connect() as conn, conn.transaction():
        conn.execute("SET LOCAL track_functions = 'pl'")
        assert [r.id for r in everystep.db.claim(conn, "w1", 5)] == [later.id]
        assert promotions_in(conn) == 1
    assert where(db, later) == ["claimed"]


def test_a_notification_that_comes_in_during_a_claim_is_counted_after_it(db):
    with db.connect() as conn, everystep.transaction(conn):
        run = everystep.schedule(workflows.quick, "unused")
    with db.connect() as listener, db.connect() as other:
        channel = everystep.db.listen(listener)
        assert everystep.db.notifications(listener) == 0
        other.execute("SELECT pg_notify(%s, '')", (channel,))
        time.sleep(0.2)  # the server sends it to the idle session at once: it waits in the socket
        # The claim (through libpq, which reads the notification off the socket) takes the run.
        assert [r.id for r in everystep.db.claim(listener, "w1", 1)] == [run.id]
        assert everystep.db.notifications(listener) == 1
        assert everystep.db.notifications(listener) == 0


def test_notifications_are_counted_once_whichever_reader_takes_them_off_the_socket(db):
    """Before the first count, psycopg keeps what its statements read; after
    it, they are counted by a handler; the rest wait in libpq or on the
    socket. Each notification is counted once."""
    with db.connect() as listener, db.connect() as other:
        channel = everystep.db.listen(listener)
        notify = lambda: other.execute("SELECT pg_notify(%s, '')", (channel,))  # noqa: E731
        notify()
        time.sleep(0.2)
        listener.execute("SELECT 1")  # psycopg reads it, and keeps it
        assert everystep.db.notifications(listener) == 1
        notify()
        time.sleep(0.2)
        listener.execute("SELECT 1")  # psycopg reads it: the handler counts it
        notify()
        time.sleep(0.2)  # on the socket
        assert everystep.db.notifications(listener) == 2
        assert everystep.db.notifications(listener) == 0


def test_a_claim_on_a_connection_outside_autocommit_is_in_its_transaction(db):
    with db.connect() as conn, everystep.transaction(conn):
        run = everystep.schedule(workflows.quick, "unused")
    with db.connect(autocommit=False) as conn:
        assert [r.id for r in everystep.db.claim(conn, "w1", 1)] == [run.id]
        assert where(db, run) == ["ready"]  # not committed
        conn.rollback()
    assert where(db, run) == ["ready"]
    assert db.run(run.id)["status"] == "scheduled"


def test_producers_and_ends_at_once_never_strand_a_run_nor_pass_the_limit(db):
    """Producers schedule runs of a limited workflow while claimers claim
    and end them: an admission and a release that ran at once (each blind
    to the other's uncommitted row) are caught up by the next empty claim,
    and never more than the limit run at once."""
    limit = 2
    with db.connect() as conn:
        everystep.db.apply_limits(conn, {BOUNDED: limit})
    produced = threading.Event()
    seen: list[int] = []
    errors: list[BaseException] = []

    def produce() -> None:
        for _ in range(100):
            with db.connect() as conn, everystep.transaction(conn):
                everystep.schedule(tenant_job_bounded, "t", 0)

    def claimer(i: int) -> None:
        with db.connect() as conn:
            while True:
                runs = everystep.db.claim(conn, f"w{i}", 1)
                if not runs:
                    if produced.is_set() and not db.value(
                            "SELECT count(*) FROM everystep_workflow WHERE status <> 'completed'"):
                        return
                    continue
                seen.append(db.value("SELECT count(*) FROM everystep_claimed WHERE name = %s", (BOUNDED,)))
                (run,) = runs
                everystep.db.finish_run(conn, run.id, f"w{i}", run.token, "completed", "null", None)

    producers = [reporting_thread(errors, produce) for _ in range(3)]
    claimers = [reporting_thread(errors, claimer, i) for i in range(4)]
    for thread in producers + claimers:
        thread.start()
    for thread in producers:
        thread.join()
    produced.set()
    for thread in claimers:
        thread.join(timeout=120)
    assert not errors
    assert db.value("SELECT count(*) FROM everystep_workflow WHERE status = 'completed'") == 300
    assert 0 < max(seen) <= limit
    assert db.value("SELECT count(*) FROM everystep_slot WHERE run_id IS NOT NULL") == 0


def test_compactions_among_producers_and_claimers_lose_no_run(db):
    """The queue tables rewritten again and again while producers schedule
    runs (plain, delayed, of a limited workflow) and claimers claim and end
    them: every run ends, once, and the limit holds."""
    limit = 2
    with db.connect() as conn:
        everystep.db.apply_limits(conn, {BOUNDED: limit})
    done = threading.Event()
    errors: list[BaseException] = []
    rewrites: list[str] = []
    seen: list[int] = []

    def produce(n: int) -> None:
        for i in range(60):
            with db.connect() as conn, everystep.transaction(conn):
                everystep.schedule(workflows.quick, f"{n}-{i}")
                everystep.schedule(workflows.quick, f"{n}-{i}-later", after=0.05)
                everystep.schedule(tenant_job_bounded, "t", 0)

    def claimer(i: int) -> None:
        with db.connect() as conn:
            while not done.is_set():
                runs = everystep.db.claim(conn, f"w{i}", 2)
                if runs:
                    seen.append(db.value("SELECT count(*) FROM everystep_claimed WHERE name = %s", (BOUNDED,)))
                for run in runs:
                    everystep.db.finish_run(conn, run.id, f"w{i}", run.token, "completed", "null", None)

    def compactor() -> None:
        with db.connect() as conn:
            while not done.is_set():
                rewrites.extend(everystep.db.compact_queue(conn, dead=0, live=10_000, wait_ms=20))
                time.sleep(0.02)

    producers = [reporting_thread(errors, produce, n) for n in range(3)]
    others = [reporting_thread(errors, claimer, i) for i in range(3)] + [reporting_thread(errors, compactor)]
    for thread in producers + others:
        thread.start()
    for thread in producers:
        thread.join()
    try:
        ended = "SELECT count(*) FROM everystep_workflow WHERE status = 'completed'"
        wait_for(lambda: errors or db.value(ended) == 540, timeout=120, what="every run ended")
    finally:
        done.set()
        for thread in others:
            thread.join(timeout=30)
    assert not errors
    assert db.value("SELECT count(*) FROM everystep_workflow WHERE status <> 'completed'") == 0
    assert db.value("SELECT count(*) FROM everystep_ready") + db.value("SELECT count(*) FROM everystep_timer") == 0
    assert set(everystep.db.queue.QUEUE_TABLES) <= set(rewrites)  # among the claims, each in its turn
    assert 0 < max(seen) <= limit


def test_the_sweeps_readmission_reads_no_queue_without_a_limit_and_admits_again_with_one(db):
    runs = db.schedule_many(workflows.quick, [("ready",)] * 3)

    def scans_of_the_ready_runs(conn) -> int:
        return conn.execute("SELECT pg_stat_get_xact_numscans('everystep_ready'::regclass)"
                            " + pg_stat_get_xact_numscans('everystep_workflow'::regclass)").fetchone()[0]

    with db.connect() as conn, conn.transaction():
        assert conn.execute("SELECT everystep_readmit()").fetchone()[0] == 0
        assert scans_of_the_ready_runs(conn) == 0  # no limit anywhere: not a row read (0041)
    # A limit set after the runs became ready: they take its slot, or wait for it.
    name = runs[0].name
    with db.connect() as conn:
        everystep.db.apply_limits(conn, {name: 1})
    placed = db.query("SELECT (SELECT count(*) FROM everystep_ready WHERE slot IS NOT NULL),"
                      " (SELECT count(*) FROM everystep_blocked)")
    assert placed == [(1, 2)]
