"""The history (0017_history.sql, everystep.retention): finished runs move
from the hot tables to the weekly-partitioned history, every read finds
them there, partitions are made ahead, the retention by end status drops
whole partitions (batches otherwise), and an idempotency key stays unique
across the move, under concurrency."""

from __future__ import annotations

import datetime
import json
import threading
import time
import uuid

import psycopg
import pytest

import everystep
import everystep.db
from everystep import config as config_module
from everystep import retention
from everystep.db.rows import RunFilter
from everystep.errors import EverystepError
from everystep.ids import uuid7, uuid7_many
from everystep.maintenance import Maintenance
from everystep.runner import Runner
from everystep.testing import clock
from tests.apps.cli_workflows import fails, greet
from tests.apps.flow_workflows import mailbox, parent_calls, publisher
from tests.support.engine import schedule_one
from tests.support.migrations import migrated_before
from tests.support.processes import wait_for

DAY = 86400.0


def archive(db, after: float = 0.0) -> int:
    with db.connect() as conn:
        return retention.archive(conn, after)


def hot_ids(db) -> set:
    return {row[0] for row in db.query("SELECT id FROM everystep_workflow")}


def history_ids(db) -> set:
    return {row[0] for row in db.query("SELECT id FROM everystep_workflow_history")}


def partitions(db) -> list[str]:
    return [row[0] for row in db.query(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
        " WHERE i.inhparent = 'everystep_workflow_history'::regclass ORDER BY 1")]


def step_once(db, runner: str = "test-runner"):
    """Claim one run and execute it; the run claimed."""
    engine = Runner(db.pool, runner)
    try:
        with db.connect() as conn:
            runs = everystep.db.claim(conn, runner, 1)
        assert len(runs) == 1
        engine.execute(runs[0])
        return runs[0].id
    finally:
        engine.close()


def monday(day: datetime.date) -> datetime.date:
    return day - datetime.timedelta(days=day.weekday())


# ---------------------------------------------------------------- the move, and reading across it


def test_finished_runs_move_with_their_steps_and_unfinished_ones_stay(db):
    done = schedule_one(db, greet, "a").id
    failed = schedule_one(db, fails, 1).id
    db.run_pending()
    waiting = schedule_one(db, greet, "later").id  # scheduled, not run
    steps = db.steps(done)
    assert archive(db) == 2
    assert hot_ids(db) == {waiting}
    assert history_ids(db) == {done, failed}
    assert db.value("SELECT count(*) FROM everystep_step WHERE workflow_id = ANY(%s)", ([done, failed],)) == 0
    # Read across: the run, its steps, its status, the list of runs.
    assert db.run(done)["status"] == "completed" and db.run(done)["result"] == "hello A"
    assert db.steps(done) == steps
    assert db.run(failed)["status"] == "failed"
    with db.connect() as conn:
        listed = [row["id"] for row in everystep.db.list_runs(conn, None, None, 10)]
        assert set(listed) == {done, failed, waiting}
        assert [row["id"] for row in everystep.db.list_runs(conn, "failed", None, 10)] == [failed]
    # Nothing moves twice; the partition is this week's.
    assert archive(db) == 0
    this_week = monday(datetime.datetime.now(datetime.UTC).date())
    assert f"everystep_workflow_history_{this_week:%Y%m%d}" in partitions(db)


def test_a_run_moves_only_after_it_has_been_finished_for_archive_after(db):
    done = schedule_one(db, greet, "a").id
    db.run_pending()
    assert archive(db, after=3600) == 0 and hot_ids(db) == {done}
    advance(db, 2 * 3600)
    assert archive(db, after=3600) == 1 and history_ids(db) == {done}


def test_messages_events_and_children_read_across_the_move(db, marks):
    box = schedule_one(db, mailbox, marks, 1).id
    db.run_pending()  # parks waiting for a message
    with db.connect() as conn, conn.transaction():
        everystep.send(box, "in", {"n": 1}, conn=conn)
    pub = schedule_one(db, publisher, marks).id
    db.run_pending()
    assert archive(db) == 2
    with db.connect() as conn:
        assert everystep.db.load_messages(conn, box)[0]["payload"] == {"n": 1}
        assert everystep.get_event(pub, "stage", conn=conn) == "second"
        assert everystep.get_event(box, "got", conn=conn) == [{"n": 1}]
        # A message for a run in the history is refused as for any finished run.
        with pytest.raises(EverystepError, match="is completed; it takes no more messages"), conn.transaction():
            everystep.send(box, "in", {"n": 2}, conn=conn)


def test_a_parent_reads_the_end_of_a_child_that_moved_to_the_history(db):
    parent = schedule_one(db, parent_calls, 5).id
    assert step_once(db) == parent  # starts the first child, and waits for it
    child = step_once(db)
    assert child != parent and db.run(child)["status"] == "completed"
    assert archive(db) == 1 and history_ids(db) == {child}  # the child moved; the parent waits in the hot table
    db.run_pending()  # the parent takes the child's end from the history, calls the second child
    assert db.run(parent)["status"] == "completed"
    assert db.run(parent)["result"] == [str(child), 10, 12]
    archive(db)
    with db.connect() as conn:
        assert {row["id"] for row in everystep.db.children(conn, parent)} >= {child}
        assert len(everystep.db.children(conn, parent)) == 2
        assert everystep.db.load_run(conn, child)["parent_id"] == parent


def test_the_ui_and_the_cli_show_runs_in_the_history(db):
    from tests.test_cli import cli, ok  # noqa: PLC0415

    done = schedule_one(db, greet, "ui").id
    db.run_pending()
    pending = schedule_one(db, greet, "hot").id
    archive(db)
    assert history_ids(db) == {done}
    with db.connect() as conn:
        page = everystep.db.ui_runs(conn, RunFilter(), 10)
        assert [row["id"] for row in page] == [pending, done] and page[1]["steps_total"] == 1
        assert [row["id"] for row in everystep.db.ui_runs(conn, RunFilter(status="completed"), 10)] == [done]
        assert everystep.db.ui_workflow_names(conn) == ["tests.apps.cli_workflows.greet"]
        shown = everystep.db.ui_run(conn, done)
        assert shown["status"] == "completed" and len(shown["steps"]) == 1
        overview = everystep.db.ui_overview(conn, ["completed", "scheduled"], 10)
        assert overview["counts"] == {"completed": 1, "scheduled": 1}
        assert [row["id"] for row in overview["runs"]] == [str(pending), str(done)]
    assert "completed" in ok(cli(db, "runs", "show", str(done)))
    exported = json.loads(ok(cli(db, "runs", "export", str(done))))
    assert [run["id"] for run in exported["runs"]] == [str(done)] and len(exported["runs"][0]["steps"]) == 1
    listed = ok(cli(db, "runs", "list", "--status", "completed"))
    assert str(done) in listed


# ---------------------------------------------------------------- partitions


def test_partitions_are_made_ahead_for_this_week_and_the_next_two(db):
    with db.connect() as conn:
        assert retention.prepare(conn) == 3 * 5  # three weeks, five tables
        assert retention.prepare(conn) == 0
    start = monday(datetime.datetime.now(datetime.UTC).date())
    weeks = [start + datetime.timedelta(days=7 * n) for n in range(3)]
    assert partitions(db) == [f"everystep_workflow_history_{week:%Y%m%d}" for week in weeks]
    for table in ("everystep_step_history", "everystep_message_history", "everystep_event_history",
                  "everystep_stream_history"):
        assert db.value("SELECT count(*) FROM pg_inherits WHERE inhparent = %s::regclass", (table,)) == 3
    # The bounds are the weeks' first UUIDv7s: a run made now falls in this week's.
    now = uuid7()
    assert db.value("SELECT everystep_history_week(%s)", (now,)) == start
    low, high = db.query("SELECT everystep_uuid_at(%s::date::timestamp AT TIME ZONE 'UTC'),"
                         " everystep_uuid_at((%s::date + 7)::timestamp AT TIME ZONE 'UTC')", (start, start))[0]
    assert low <= now < high
    assert db.value("SELECT pg_get_expr(c.relpartbound, c.oid) FROM pg_class c WHERE relname = %s",
                    (f"everystep_workflow_history_{start:%Y%m%d}",)) == f"FOR VALUES FROM ('{low}') TO ('{high}')"


# ---------------------------------------------------------------- retention


def finished_runs(db, count: int, fn=greet) -> list[uuid.UUID]:
    runs = [schedule_one(db, fn, str(i)).id for i in range(count)]
    db.run_pending()
    return runs


def advance(db, seconds: float) -> None:
    with db.connect() as conn:
        clock.advance(conn, seconds, drain=False)


def test_retention_drops_a_week_whose_runs_are_all_expired(db):
    runs = finished_runs(db, 3) + finished_runs(db, 1, fails)
    archive(db)
    week = monday(datetime.datetime.now(datetime.UTC).date())
    with db.connect() as conn:
        policy = {"completed": 7 * DAY, "failed": 30 * DAY}
        assert retention.apply(conn, policy) == (0, 0, 0)  # nothing expired yet
    advance(db, 10 * DAY)  # the completed runs expire, not the failed one: the partition stays
    with db.connect() as conn:
        applied = retention.apply(conn, policy)
    assert (applied.dropped_weeks, applied.deleted) == (0, 3)
    assert history_ids(db) == {runs[-1]}
    advance(db, 25 * DAY)  # now the failed one too, and the week is over: the partition goes whole
    with db.connect() as conn:
        applied = retention.apply(conn, policy)
    assert (applied.dropped_weeks, applied.dropped, applied.deleted) == (1, 1, 0)
    assert f"everystep_workflow_history_{week:%Y%m%d}" not in partitions(db)
    assert db.value("SELECT count(*) FROM everystep_step_history") == 0
    assert db.run(runs[-1]) is None


def test_retention_keeps_a_status_left_out_and_never_touches_a_blocked_or_unfinished_run(db):
    from tests.test_cli import blocked_run  # noqa: PLC0415

    done = finished_runs(db, 1)[0]
    failed = finished_runs(db, 1, fails)[0]
    blocked = blocked_run(db).id
    pending = schedule_one(db, greet, "pending").id
    archive(db)
    advance(db, 400 * DAY)
    with db.connect() as conn:
        applied = retention.apply(conn, {"completed": 1.0})
    assert applied.removed == 1
    assert db.run(done) is None
    assert db.run(failed)["status"] == "failed"  # failed: kept for ever
    assert db.run(blocked)["status"] == "blocked" and db.run(pending)["status"] == "scheduled"
    # The week holds a kept run: never dropped whole.
    assert partitions(db)


def test_retention_deletes_expired_runs_still_in_the_hot_table(db):
    db.query("INSERT INTO everystep_workflow (id, name, args, status, created_at, completed_at)"
             " SELECT gen_random_uuid(), 'x.y', '[]', 'completed', now(), now() - interval '2 days'"
             " FROM generate_series(1, 30) RETURNING 1")
    assert archive(db) == 0  # ids with no time in them never move
    with db.connect() as conn:
        assert retention.apply(conn, {"completed": DAY}, batch=7).deleted == 30
    assert hot_ids(db) == set()


def test_the_maintenance_child_moves_runs_and_applies_the_retention(db):
    done = finished_runs(db, 2)
    advance(db, 3 * DAY)
    maintenance = Maintenance(db.url, interval=0.2, retention={"completed": DAY}, archive_after=0)
    thread = threading.Thread(target=maintenance.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: all(db.run(run) is None for run in done), timeout=30, what="the retention")
        assert partitions(db)  # the weeks ahead
        kept = finished_runs(db, 1)[0]
        wait_for(lambda: history_ids(db) == {kept}, timeout=30, what="the move")
    finally:
        maintenance.stop()
        thread.join(10)


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(("value", "seconds"), [(45, 45.0), (1.5, 1.5), ("45s", 45.0), ("30m", 1800.0),
                                                ("12h", 43200.0), ("7d", 7 * DAY)])
def test_retention_durations(tmp_path, value, seconds):
    path = tmp_path / "everystep.yaml"
    path.write_text(f"retention:\n  completed: {value!r}\n  failed: 30d\n" if isinstance(value, str)
                    else f"retention:\n  completed: {value}\n")
    loaded = config_module.load(path)
    assert loaded.retention["completed"] == seconds
    assert config_module.maintenance_options(loaded)["retention"] == loaded.retention


@pytest.mark.parametrize(("body", "problem"), [
    ("retention:\n  blocked: 7d\n", "retention.blocked: blocked runs wait for an operator"),
    ("retention:\n  running: 7d\n", "retention: the key 'running' must be an end status"),
    ("retention:\n  completed: 7w\n", "retention.completed: must be a duration"),
    ("retention:\n  completed: 0\n", "retention.completed: must be more than 0 seconds"),
    ("retention:\n  completed: true\n", "retention.completed: must be a duration"),
    ("retention: 7d\n", "retention: must be a mapping"),
])
def test_retention_config_errors(tmp_path, body, problem):
    path = tmp_path / "everystep.yaml"
    path.write_text(body)
    with pytest.raises(config_module.ConfigError) as raised:
        config_module.load(path)
    assert problem in str(raised.value)


# ---------------------------------------------------------------- idempotency keys


def test_a_key_stays_taken_after_its_run_moved_to_the_history(db):
    with db.connect() as conn, conn.transaction():
        first = everystep.schedule(greet, "k", idempotency_key="order-1", conn=conn)
    db.run_pending()
    archive(db)
    assert history_ids(db) == {first.id}
    with db.connect() as conn, conn.transaction():
        again = everystep.schedule(greet, "k", idempotency_key="order-1", conn=conn)
        assert again.id == first.id
        many = everystep.schedule_many(greet, [("k",), ("other",)], idempotency_keys=["order-1", "order-2"],
                                       conn=conn)
    assert many[0].id == first.id and many[1].id != first.id
    assert db.value("SELECT count(*) FROM everystep_workflow_all WHERE idempotency_key = 'order-1'") == 1


def test_a_key_is_unique_under_concurrent_inserts_and_moves(db):
    """Threads schedule the same keys again and again while the move runs
    with no delay: whatever the interleaving, one run per key, hot or in
    the history, and every schedule() of a key returns that run."""
    keys = [f"race-{i}" for i in range(40)]
    seen: dict[str, set] = {key: set() for key in keys}
    stop = threading.Event()
    errors: list[BaseException] = []

    def scheduler() -> None:
        try:
            with db.connect() as conn:
                while not stop.is_set():
                    for key in keys:
                        with conn.transaction():
                            seen[key].add(everystep.schedule(greet, key, idempotency_key=key, conn=conn).id)
        except BaseException as exc:  # reported below
            errors.append(exc)

    def finisher() -> None:
        try:
            with db.connect() as conn:
                while not stop.is_set():
                    conn.execute("UPDATE everystep_workflow SET status = 'completed', completed_at = now()"
                                 " WHERE status = 'scheduled'")
                    retention.archive(conn, 0.0, batch=7)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=scheduler) for _ in range(3)] + [threading.Thread(target=finisher)]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: len(history_ids(db)) == len(keys) or errors, timeout=60, what="every key moved")
        stop.wait(1.0)
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert errors == []
    counts = dict(db.query("SELECT idempotency_key, count(*) FROM everystep_workflow_all GROUP BY 1"))
    assert counts == {key: 1 for key in keys}
    assert all(len(ids) == 1 for ids in seen.values()), {k: v for k, v in seen.items() if len(v) > 1}
    assert len(history_ids(db)) == len(keys)


def test_a_keyed_run_waits_for_a_move_holding_the_keys_lock(db):
    """The race the keys lock closes, made to happen: the move of a keyed
    run has deleted it from the hot table and not committed yet; a
    schedule() of the same key waits for it, then finds the run in the
    history rather than inserting a second one."""
    with db.connect() as conn, conn.transaction():
        first = everystep.schedule(greet, "k", idempotency_key="held", conn=conn)
    db.run_pending()
    with db.connect() as conn:
        retention.prepare(conn)
    mover = psycopg.connect(db.url, autocommit=False)
    try:
        mover.execute("SELECT pg_advisory_xact_lock(hashtextextended('everystep:keys:' || current_schema(), 0))")
        mover.execute("WITH runs AS (DELETE FROM everystep_workflow WHERE id = %s RETURNING *),"
                      " steps AS (DELETE FROM everystep_step WHERE workflow_id = %s RETURNING *),"
                      " s AS (INSERT INTO everystep_step_history SELECT * FROM steps)"
                      " INSERT INTO everystep_workflow_history SELECT * FROM runs", (first.id, first.id))
        got: list = []

        def schedule_again() -> None:
            with db.connect() as conn, conn.transaction():
                got.append(everystep.schedule(greet, "k", idempotency_key="held", conn=conn).id)

        thread = threading.Thread(target=schedule_again)
        thread.start()
        thread.join(1.0)
        assert thread.is_alive()  # waiting for the keys lock
        mover.commit()
        thread.join(10)
        assert got == [first.id]
    finally:
        mover.close()
    assert db.value("SELECT count(*) FROM everystep_workflow_all WHERE idempotency_key = 'held'") == 1


# ---------------------------------------------------------------- what holds back vacuum


def scrape(db) -> dict:
    """The vacuum gauges as the HTTP child computes them: {(name, table label): value}."""
    from supervisor.http_server import Database, QueueCollector  # noqa: PLC0415

    collector = QueueCollector(Database(db.url))
    return {(family.name, sample.labels.get("table")): sample.value
            for family in collector.collect() for sample in family.samples}


def test_the_metrics_show_a_snapshot_held_open_and_an_idle_transaction(db):
    finished_runs(db, 3)
    with db.connect() as conn:
        conn.execute("DELETE FROM everystep_step")
        conn.execute("ANALYZE everystep_step")
    quiet = scrape(db)
    assert {("everystep_table_dead_tuples", table) for table in HOT} <= set(quiet)
    assert {("everystep_table_last_autovacuum_timestamp_seconds", table) for table in HOT} <= set(quiet)
    # (The server is shared with other tests' sessions: only a lower bound
    # on the ages holds whatever they do.)
    holder = psycopg.connect(db.url, autocommit=False)
    try:
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM everystep_workflow")  # a snapshot, held, idle in transaction
        time.sleep(2.0)
        shown = scrape(db)
        assert shown[("everystep_oldest_xmin_age_seconds", None)] >= 2.0
        assert shown[("everystep_idle_in_transaction_max_seconds", None)] >= 2.0
        assert shown[("everystep_oldest_xmin_age_transactions", None)] >= 0
    finally:
        holder.close()


HOT = ("everystep_workflow", "everystep_step", "everystep_message", "everystep_event")


# ---------------------------------------------------------------- migrating in place


def test_a_database_with_runs_in_flight_and_a_history_migrates_in_place(server_url, tmp_path):
    """Runs held mid-step by a real worker, and 20,000 finished runs with a
    step each, in a schema of the version before: the migration takes an
    instant, the held runs finish, and the maintenance child then moves
    the finished runs to the history in batches."""

    from everystep.testing import server  # noqa: PLC0415
    from tests.conftest import Database  # noqa: PLC0415
    from tests.support.migrations import previous_release  # noqa: PLC0415
    from tests.support.processes import WorkerProcess  # noqa: PLC0415

    schema = f"t_{uuid.uuid4().hex[:12]}"
    migrated_before(server_url, schema, "0017")  # the layout before the history
    db = Database(server_url, schema)
    worker = None
    try:
        old = uuid7_many(20_000)
        with db.connect() as conn:
            conn.execute(
                "INSERT INTO everystep_workflow (id, name, args, status, result, completed_at)"
                " SELECT id, 'tests.apps.cli_workflows.greet', '[\"x\"]', 'completed', '\"hello X\"', now()"
                " FROM unnest(%s::uuid[]) AS id", (old,))
            conn.execute(
                "INSERT INTO everystep_step (workflow_id, step_id, name, args, kwargs, status, result)"
                " SELECT id, '1', 'tests.apps.cli_workflows.shout', '[\"x\"]', '{}', 'done', '\"X\"'"
                " FROM unnest(%s::uuid[]) AS id", (old,))
        marks, release = tmp_path / "marks", tmp_path / "release"
        marks.mkdir()
        from tests.apps.workflows import held  # noqa: PLC0415

        in_flight = uuid7_many(3)  # scheduled as the version before does (its insert, by hand here)
        with db.connect() as conn:
            conn.execute("INSERT INTO everystep_workflow (id, name, args, status)"
                         " SELECT id, %s, %s::jsonb, 'scheduled' FROM unnest(%s::uuid[]) AS id",
                         (f"{held.__module__}.{held.__qualname__}", json.dumps([str(marks), str(release)]),
                          in_flight))
        # A worker of a version before 0032 (its code from git): later ones
        # need the queue tables of 0032.
        worker = WorkerProcess(db.url, "migrating", tmp_path / "logs", threads=4,
                               cwd=previous_release(tmp_path / "previous", before="0032"))
        wait_for(lambda: len((marks / "steps").read_text().splitlines()) == 3 if (marks / "steps").exists()
                 else False, timeout=60, what="the runs held mid-step")
        started = time.monotonic()
        with db.connect() as conn:
            assert everystep.db.migrate(conn)[:1] == ["0017_history"]  # and those after it
        took = time.monotonic() - started
        assert took < 10, took  # an instant: nothing is copied
        release.touch()
        wait_for(lambda: all(db.run(run)["status"] == "completed" for run in in_flight), timeout=60,
                 what="the held runs to finish")
        assert db.run(old[0])["result"] == "hello X"  # read across, before the move
        maintenance = Maintenance(db.url, interval=0.5, archive_after=0)
        thread = threading.Thread(target=maintenance.run, daemon=True)
        thread.start()
        try:
            wait_for(lambda: db.value("SELECT count(*) FROM everystep_workflow") == 0, timeout=120,
                     what="the move of the finished runs")
        finally:
            maintenance.stop()
            thread.join(10)
        assert db.value("SELECT count(*) FROM everystep_workflow_history") == 20_003
        assert db.value("SELECT count(*) FROM everystep_step_history") == 20_003
        assert db.run(old[-1])["status"] == "completed" and len(db.steps(old[-1])) == 1
        assert all(db.run(run)["result"] == "held" for run in in_flight)
    finally:
        if worker is not None:
            worker.close()
        server.drop(db, server_url)


@pytest.mark.parametrize("table", ["everystep_workflow", "everystep_step", "everystep_message", "everystep_event",
                                   "everystep_stream"])
def test_a_history_table_has_its_hot_tables_columns_in_the_same_order(db, table):
    """The move copies rows with `*`: a column added to a hot table is added
    to its history table, in the same order, by the same migration."""
    columns = ("SELECT a.attname, format_type(a.atttypid, a.atttypmod) FROM pg_attribute a"
               " WHERE a.attrelid = %s::regclass AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum")
    assert db.query(columns, (f"{table}_history",)) == db.query(columns, (table,))
    assert db.query(columns, (f"{table}_all",)) == db.query(columns, (table,))


def test_operator_actions_on_a_run_in_the_history_say_it_has_ended(db):
    from everystep import operations  # noqa: PLC0415

    done = finished_runs(db, 1)[0]
    archive(db)
    assert history_ids(db) == {done}
    actor = operations.Actor("ada@ops", "cli")
    with db.connect() as conn:
        assert everystep.db.cancel_run(conn, done, None).status == "completed"  # nothing to cancel
        with pytest.raises(everystep.db.ResolveRefused, match="is completed, not blocked"):
            everystep.db.resolve_step(conn, done, "1", "done", "1", None)
        new = operations.reschedule(conn, actor, [done])
    assert len(new.done) == 1 and db.run(new.done[0].new)["args"] == ["0"]


def test_prune_applies_the_config_files_retention(db, tmp_path):
    from tests.test_cli import everystep_cli, ok  # noqa: PLC0415

    done = finished_runs(db, 2)
    failed = finished_runs(db, 1, fails)[0]
    archive(db)
    advance(db, 2 * DAY)
    path = tmp_path / "everystep.yaml"
    path.write_text(f"database:\n  url: {json.dumps(db.url)}\nretention:\n  completed: 1d\n  failed: 30d\n")
    assert ok(everystep_cli("prune", "-c", str(path), "--dry-run")) == (
        "would delete 2 runs past their retention (completed 1d, failed 30d), with their steps"
        " (dry run: nothing deleted)\n")
    assert ok(everystep_cli("prune", "-c", str(path))) == (
        "deleted 2 runs past their retention (completed 1d, failed 30d), with their steps\n")
    assert all(db.run(run) is None for run in done) and db.run(failed)["status"] == "failed"
    record = db.query("SELECT details FROM everystep_audit WHERE action = 'prune'")[0][0]
    assert record["deleted"] == 2 and record["retention"] == {"completed": DAY, "failed": 30 * DAY}


def test_a_moved_run_keeps_its_executions_can_be_re_run_and_retention_takes_both(db):
    """The executions of a run (0015_console.sql) stay when it moves; a run
    that failed and moved is re-run from a step like a hot one; retention
    removes its executions with it, by batch and by a dropped week."""
    from tests.apps.console_workflows import BUG, pay_then_deliver  # noqa: PLC0415

    BUG["on"] = True
    [original] = [run.id for run in db.schedule_many(pay_then_deliver, [("o-1",)])]
    with db.connect() as conn:
        [held] = everystep.db.claim(conn, "gone", 1)
        everystep.db.requeue_held(conn, "gone", [everystep.db.Claim(held.id, held.token)], "swept")
    db.run_pending()
    assert db.run(original)["status"] == "failed"
    assert archive(db) == 1 and history_ids(db) == {original}
    assert db.query("SELECT claimer, outcome FROM everystep_execution WHERE run_id = %s", (original,)) == [
        ("gone", "swept")]
    BUG["on"] = False
    try:
        with db.connect() as conn, everystep.transaction(conn):
            rerun = everystep.rerun(original, from_step="4")
        assert sorted(s["step_id"] for s in db.steps(rerun)) == ["1", "2", "3.0.1", "3.1.1"]
        db.run_pending()
        assert db.run(rerun)["status"] == "completed"
    finally:
        BUG["on"] = True
    assert db.value("SELECT rerun_of FROM everystep_workflow_all WHERE id = %s", (rerun,)) == original
    advance(db, 40 * DAY)
    with db.connect() as conn:
        retention.apply(conn, {"completed": DAY, "failed": DAY})
    assert db.run(original) is None and db.run(rerun) is None
    assert db.value("SELECT count(*) FROM everystep_execution") == 0
