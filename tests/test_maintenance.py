"""Maintenance (the dead-claimer sweep and the recurring schedules' tick) as
an engine class, and as `everystep maintenance`, run as a real process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import everystep
import everystep.db
from everystep import schedule, scheduler
from everystep.maintenance import Maintenance
from everystep.scheduler import Schedule
from tests.apps import workflows
from tests.apps.cli_workflows import greet
from tests.support.concurrency import hold_a_snapshot
from tests.support.engine import OLD_CLAIM, in_ready_order
from tests.support.processes import wait_for

ROOT = Path(__file__).resolve().parent.parent
UNREACHABLE = "host=127.0.0.1 port=1 user=postgres dbname=test connect_timeout=3"


class MaintenanceProcess:
    """`everystep maintenance ...` in a subprocess, logging to a file."""

    def __init__(self, log_path: Path, *args: str):
        self.log_path = log_path
        self.log = open(log_path, "w")
        env = {k: v for k, v in os.environ.items() if k != "EVERYSTEP_DATABASE_URL"}
        self.proc = subprocess.Popen([sys.executable, "-m", "everystep", "maintenance", *args], cwd=ROOT,
                                     stdout=self.log, stderr=subprocess.STDOUT, env={**env, "PYTHONUNBUFFERED": "1"})

    def output(self) -> str:
        return self.log_path.read_text()

    def stop(self, sig: int = signal.SIGTERM) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(30)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


@pytest.fixture
def maintenance(tmp_path):
    started: list[MaintenanceProcess] = []

    def start(*args: str) -> MaintenanceProcess:
        process = MaintenanceProcess(tmp_path / f"maintenance-{len(started)}.log", *args)
        started.append(process)
        return process

    yield start
    for process in started:
        process.close()


def dead_claimers_run(db) -> everystep.ScheduledRun:
    """A run claimed by a worker that is gone: nobody holds its name's lock."""
    with db.connect() as conn, everystep.transaction(conn):
        run = schedule(greet, "ada")
    with db.connect() as conn:
        assert [claimed.id for claimed in everystep.db.claim(conn, "worker-dead", 10)] == [run.id]
    return run


def due_schedule(db) -> None:
    """A schedule of greet('linus') whose fire time is now."""
    every_minute = Schedule(workflow="tests.apps.cli_workflows.greet", args=("linus",), cron="* * * * *")
    with db.connect() as conn:
        scheduler.apply(conn, {"every-minute": every_minute})
        conn.execute("UPDATE everystep_schedule SET next_fire_at = date_trunc('minute', now())")


def fired(db) -> bool:
    """The due schedule fired (once, or twice when a minute turned meanwhile)."""
    runs = fired_runs(db)
    return bool(runs) and all(args == ["linus"] for args in runs)


def fired_runs(db) -> list:
    return [row[0] for row in db.query(
        "SELECT args FROM everystep_workflow WHERE idempotency_key LIKE 'schedule:every-minute:%%'")]


def test_the_command_recovers_a_dead_claimers_run_fires_a_due_schedule_and_stops_on_sigterm(db, maintenance):
    run = dead_claimers_run(db)
    due_schedule(db)
    process = maintenance("--database-url", db.url, "--interval", "0.2", "--grace", "0",
                          "--import", "tests.apps.cli_workflows")
    wait_for(lambda: db.run(run.id)["status"] == "scheduled", timeout=30, what="the dead claimer's run requeued")
    assert db.run(run.id)["claimed_by"] is None
    wait_for(lambda: fired(db), timeout=30, what="the due schedule fired")
    assert process.stop(signal.SIGTERM) == 0
    log = process.output()
    assert "maintenance: the dead-claimer sweep every 0.2 s (grace 0 s)" in log
    assert "claimer worker-dead is dead: requeued 1 runs" in log
    assert db.run_pending() == {run.id: "completed", **dict.fromkeys(
        (row[0] for row in db.query("SELECT id FROM everystep_workflow WHERE idempotency_key IS NOT NULL")),
        "completed")}


def test_the_command_takes_recovery_from_the_config_file_and_options_win(db, maintenance, tmp_path):
    config = tmp_path / "everystep.yaml"
    config.write_text(f"database:\n  url: {json.dumps(db.url)}\n"
                      "recovery:\n  interval: 0.3\n  grace: 7\n  max_crashes: 2\n")
    process = maintenance("-c", str(config), "--grace", "0.5")
    wait_for(lambda: "sweep every" in process.output(), timeout=30, what="the maintenance loop to start")
    assert "maintenance: the dead-claimer sweep every 0.3 s (grace 0.5 s)" in process.output()
    assert process.stop(signal.SIGINT) == 0


def test_the_command_runs_as_the_supervisors_maintenance_child_does(db, maintenance, tmp_path):
    """With -c FILE it connects with database.direct_url when the file has one
    (a session: the sweep's and the scheduler's locks; database.url may be
    PgBouncer's, here a port where nothing answers), and logs in the file's format."""
    run = dead_claimers_run(db)
    config = tmp_path / "everystep.yaml"
    config.write_text(f"database:\n  url: {json.dumps(UNREACHABLE)}\n  direct_url: {json.dumps(db.url)}\n"
                      "logging:\n  format: json\nrecovery:\n  interval: 0.2\n  grace: 0\n")
    process = maintenance("-c", str(config))
    wait_for(lambda: db.run(run.id)["status"] == "scheduled", timeout=30, what="the dead claimer's run requeued")
    assert process.stop(signal.SIGTERM) == 0
    records = [json.loads(line) for line in process.output().splitlines() if line.strip()]
    assert any("claimer worker-dead is dead" in record["message"] for record in records)


@pytest.mark.parametrize("args, message", [
    (["--interval", "0"], "everystep maintenance: argument --interval: expected a number of seconds > 0, not '0'"),
    (["--grace", "-1"], "everystep maintenance: argument --grace: expected a number of seconds >= 0, not '-1'"),
    (["--max-crashes", "0"], "everystep maintenance: argument --max-crashes: expected a whole number of at least 1"),
    (["--import", "tests.no_such_module"],
     "everystep: cannot import tests.no_such_module: ModuleNotFoundError: No module named 'tests.no_such_module'"),
])
def test_the_command_refuses_bad_options_in_one_line(db, args, message):
    env = {k: v for k, v in os.environ.items() if k != "EVERYSTEP_DATABASE_URL"}
    done = subprocess.run([sys.executable, "-m", "everystep", "--database-url", db.url, "maintenance", *args],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(message), done.stderr


def test_an_embedding_program_runs_it_on_a_thread_and_stops_it(db):
    run = dead_claimers_run(db)
    due_schedule(db)
    loop = Maintenance(db.url, interval=0.1, grace=0)
    thread = threading.Thread(target=loop.run)
    thread.start()
    try:
        wait_for(lambda: db.run(run.id)["status"] == "scheduled" and fired(db), timeout=30,
                 what="the run requeued and the schedule fired")
    finally:
        loop.stop()
        thread.join(10)
    assert not thread.is_alive()


def test_the_sweep_vacuums_the_queue_tables_once_claims_left_dead_rows(db):
    """Each claim walks the ready order's dead entries until a vacuum removes
    them, and autovacuum visits a database once a minute: the maintenance
    loop vacuums the queue's tables itself once they hold VACUUM_QUEUE_AT
    dead row versions (here the test server runs without autovacuum). A
    snapshot held open keeps the vacuum from removing them: the sweep then
    rewrites the ready table with its live rows alone (0037)."""
    from everystep import maintenance  # noqa: PLC0415

    holder = hold_a_snapshot(db.url)
    with db.connect() as conn, everystep.transaction(conn):
        for i in range(maintenance.VACUUM_QUEUE_AT + 500):
            everystep.schedule(workflows.quick, str(i))
    with db.connect() as conn:
        while everystep.db.claim(conn, "gone", 1000):
            pass  # every ready row deleted: dead rows at the front of the ready order
    with db.connect() as conn, everystep.transaction(conn):
        waiting = {everystep.schedule(workflows.quick, f"live-{i}").id for i in range(5)}
    file = "SELECT pg_relation_filenode('everystep_ready')"
    before = db.value(file)
    dead = "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = 'everystep_ready'::regclass"
    wait_for(lambda: db.value(dead) >= maintenance.VACUUM_QUEUE_AT, timeout=30, what="the claims' dead rows counted")
    assert db.value("SELECT vacuum_count FROM pg_stat_user_tables WHERE relid = 'everystep_ready'::regclass") == 0
    loop = Maintenance(db.url, interval=0.1, grace=600)
    thread = threading.Thread(target=loop.run)
    thread.start()
    vacuums = "SELECT vacuum_count FROM pg_stat_user_tables WHERE relid = 'everystep_ready'::regclass"
    try:
        wait_for(lambda: db.value(vacuums) >= 1, timeout=30, what="the queue's tables vacuumed")
        wait_for(lambda: db.value(file) != before, timeout=30, what="the ready table rewritten")
        assert {row[0] for row in db.query("SELECT run_id FROM everystep_ready")} == waiting
    finally:
        loop.stop()
        thread.join(10)
        holder.close()


def test_the_sweep_looks_at_the_head_of_the_queue_for_strays_and_at_all_of_it_now_and_then(db, monkeypatch):
    """The strays a worker of a version before 0032 leaves in the queue are
    looked for at every sweep among the first runs of the ready order, and
    in the whole queue at the first sweep and every STRAYS_INTERVAL (0042)."""
    from everystep import maintenance  # noqa: PLC0415

    monkeypatch.setattr(everystep.db.queue, "STRAYS_HEAD", 5)
    monkeypatch.setattr(maintenance, "STRAYS_INTERVAL", 6.0)
    db.schedule_many(workflows.quick, [(str(i),) for i in range(20)])
    order = in_ready_order(db)
    held = "SELECT count(*) FROM everystep_claimed WHERE run_id = %s"
    with db.connect() as conn:
        conn.execute(OLD_CLAIM, (order[15],))  # far from the head: found by the first sweep, which reads it all
    loop = Maintenance(db.url, interval=0.1, grace=600)
    thread = threading.Thread(target=loop.run)
    thread.start()
    try:
        wait_for(lambda: db.value(held, (order[15],)) == 1, timeout=30,
                 what="the first sweep's look at the whole queue")
        first_look = time.monotonic()
        with db.connect() as conn:
            conn.execute(OLD_CLAIM, (order[0],))
            conn.execute(OLD_CLAIM, (order[12],))
        wait_for(lambda: db.value(held, (order[0],)) == 1, timeout=30, what="the stray at the head held")
        if time.monotonic() - first_look < maintenance.STRAYS_INTERVAL:
            assert db.value(held, (order[12],)) == 0  # not looked for yet
        wait_for(lambda: db.value(held, (order[12],)) == 1, timeout=30, what="the next look at the whole queue")
        # (Far longer than the sweeps' 0.1 s between them: not a look at the head.)
        assert time.monotonic() - first_look >= maintenance.STRAYS_INTERVAL / 2
    finally:
        loop.stop()
        thread.join(10)
