"""Worker processes: claims, catchup, fencing, drain, liveness — real
processes (`everystep worker`) against a real PostgreSQL."""

from __future__ import annotations

import collections
import contextlib
import gc
import re
import resource
import signal
import sys
import threading
import time

import psycopg
import pytest

import everystep
import everystep.db
from everystep import schedule
from everystep.worker import Worker
from tests.apps import workflows
from tests.support.engine import take_lock_from
from tests.support.processes import WorkerProcess, wait_for


def statuses(db):
    return dict(db.query("SELECT status, count(*) FROM everystep_workflow GROUP BY status"))


def all_done(db, total):
    return lambda: statuses(db).get("completed", 0) == total


def test_two_workers_claim_disjoint_sets(db, start_worker, marks):
    runs = db.schedule_many(workflows.two_steps, [(marks,)] * 500)
    start_worker("w-a", threads=4)
    start_worker("w-b", threads=4)
    wait_for(all_done(db, 500), timeout=90, what="500 runs completed")
    assert db.value("SELECT count(*) FROM everystep_step WHERE status = 'done'") == 1000
    executions = collections.Counter((run, tag) for run, tag, _ in workflows.marks_of(marks))
    assert len(executions) == 2000  # a, a:end, b, b:end for every run
    assert set(executions.values()) == {1}  # every step executed exactly once
    by_claimer = dict(db.query("SELECT claimed_by, count(*) FROM everystep_workflow GROUP BY claimed_by"))
    assert set(by_claimer) == {"w-a", "w-b"}
    pids_per_run = collections.defaultdict(set)
    for run, _, pid in workflows.marks_of(marks):
        pids_per_run[run].add(pid)
    assert all(len(pids) == 1 for pids in pids_per_run.values())  # no run split across processes
    assert len(pids_per_run) == len(runs)


# A worker process whose first 1,100 descriptors are taken (by the
# application's files, say) before it opens its connections and pipes; its
# soft limit on open files raised to its hard one first (often 1,024).
CROWDED_WORKER = (sys.executable, "-c", "import os, resource, sys; "
                  "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE); "
                  "resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard)); "
                  "crowd = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]; "
                  "from everystep.cli import main; sys.exit(main())")


def test_a_worker_whose_descriptors_number_past_1024_waits_claims_and_ends_runs(db, start_worker, marks):
    """select(2) refuses a descriptor numbered 1024 or more: the worker's
    waits (for a notification, for the claim's answer) must not use it."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"a process may open only {hard} files here (ulimit -Hn)")
    worker = start_worker("w-crowded", threads=4, command=CROWDED_WORKER)
    worker.wait_logged("holding the lock")
    time.sleep(1.0)  # its control loop waits for a notification on a socket numbered past 1024
    runs = db.schedule_many(workflows.two_steps, [(marks,)] * 20)
    wait_for(all_done(db, len(runs)), timeout=30, what="20 runs completed by the crowded worker")
    assert worker.alive()
    assert "out of range" not in worker.output()


def test_an_everystep_worker_process_freezes_what_it_loaded_out_of_the_collectors_walks(db, start_worker):
    start_worker("w-collector", threads=2).wait_logged("holding the lock")
    (run,) = db.schedule_many(workflows.collector_settings, [()])
    wait_for(lambda: db.run(run.id)["status"] == "completed", what="the run completed")
    settings = db.run(run.id)["result"]
    assert settings["frozen"] > 1000  # the modules, the application, the config
    assert settings["threshold"] == list(gc.get_threshold())  # Python's own: young cycles are still collected


def test_a_worker_hosted_beside_other_code_leaves_its_processs_collector_alone(db):
    frozen = gc.get_freeze_count()
    worker = Worker(db.url, "w-hosted", threads=1)
    threading.Timer(1.0, worker.stop).start()
    worker.run()
    assert gc.get_freeze_count() == frozen


def test_an_idle_worker_starts_the_run_it_claims_on_the_thread_that_claimed_it(db, start_worker, tmp_path):
    """The holder of the control loop starts the first run it claims for
    idle slots itself and hands the loop to the worker's other control
    thread, which goes on claiming: a run claimed while both are busy goes
    to a slot's thread."""
    release = tmp_path / "release"
    start_worker("w-inline", threads=4).wait_logged("holding the lock")
    (held,) = db.schedule_many(workflows.on_which_thread, [(str(release),)])
    wait_for(lambda: db.run(held.id)["status"] == "running", what="the first run started")
    (meanwhile,) = db.schedule_many(workflows.on_which_thread, [(None,)])
    wait_for(lambda: db.run(meanwhile.id)["status"] == "completed", what="a run claimed while the first is held")
    release.touch()
    wait_for(lambda: db.run(held.id)["status"] == "completed", what="the first run released")
    (after,) = db.schedule_many(workflows.on_which_thread, [(None,)])
    wait_for(lambda: db.run(after.id)["status"] == "completed", what="a run claimed at rest again")
    assert re.fullmatch(r"everystep-w-inline-control-[01]", db.run(held.id)["result"])
    assert re.fullmatch(r"everystep-w-inline_\d+", db.run(meanwhile.id)["result"])
    assert re.fullmatch(r"everystep-w-inline-control-[01]", db.run(after.id)["result"])


def test_a_notification_read_during_the_loops_own_statement_ends_its_wait_at_once(db):
    """One that came in while the control loop ran a statement of its own
    was read off the socket into psycopg's queue (or libpq's, the claim's):
    the loop's wait returns at once, not at its time-out."""
    worker = Worker(db.url, "w-wait")
    with db.connect() as conn, db.connect() as other:
        channel = everystep.db.listen(conn)
        other.execute("SELECT pg_notify(%s, '')", (channel,))
        time.sleep(0.2)  # the server sends it to the idle session at once: it waits in the socket
        everystep.db.ping(conn)  # the loop's own statement reads it off the socket
        started = time.monotonic()
        assert worker._wait(conn, 30.0)
        assert time.monotonic() - started < 10


def test_the_notifications_a_wait_reads_are_counted_at_the_end_of_the_loops_turn(db):
    """everystep_worker_notifications counts what the loop's waits read, once
    per turn of the loop (_publish_load, after the claim they lead to), so
    that a pickup does not wait for the metric."""
    from prometheus_client import REGISTRY  # noqa: PLC0415

    def counted() -> float:
        return REGISTRY.get_sample_value("everystep_worker_notifications_total", {"runner": "w-count"}) or 0.0

    worker = Worker(db.url, "w-count")
    with db.connect() as conn, db.connect() as other:
        channel = everystep.db.listen(conn)
        before = counted()
        for _ in range(2):
            other.execute("SELECT pg_notify(%s, '')", (channel,))
        time.sleep(0.2)
        assert worker._wait(conn, 5.0)
        assert counted() == before
        worker._publish_load()
        assert counted() == before + 2


def test_after_a_lock_loss_only_the_executions_known_before_the_read_of_its_claims_are_judged(db, monkeypatch):
    """Back with its lock, the worker abandons the executions whose claim the
    database no longer shows under its name. A run's end may claim a
    successor while that read runs (the writers reconnect on their own): its
    execution, not yet known when the claims were read, is not judged by
    that read, so it is not abandoned and its step is not run twice."""
    held, recovered, successor = db.schedule_many(workflows.quick, [("a",), ("b",), ("c",)])
    with db.connect() as conn:
        (mine,) = everystep.db.claim(conn, "w-relock", 1)
        (elsewhere,) = everystep.db.claim(conn, "w-other", 1)  # recovered by another worker meanwhile
    assert (mine.id, elsewhere.id) == (held.id, recovered.id)
    worker = Worker(db.url, "w-relock")
    worker._executing = {mine.token: mine.id, elsewhere.token: elsewhere.id}
    read = everystep.db.held_claims
    claimed = []

    def read_while_an_end_claims_a_successor(conn, runner):
        claims = read(conn, runner)
        with db.connect() as other:
            (run,) = everystep.db.claim(other, "w-relock", 1)
        claimed.append(run)
        worker._executing[run.token] = run.id
        return claims

    monkeypatch.setattr(everystep.db, "held_claims", read_while_an_end_claims_a_successor)
    with db.connect() as conn:
        worker._after_relock(conn)
    assert claimed[0].id == successor.id
    assert worker.fence.abandoned == {elsewhere.token}


def test_sigkill_mid_step_then_catchup_under_the_same_name(db, start_worker, marks, tmp_path):
    (run,) = db.schedule_many(workflows.three_steps_held, [(marks, str(tmp_path / "never"))])
    first = start_worker("w-1")
    wait_for(lambda: any(tag == "two" for _, tag, _ in workflows.marks_of(marks)), what="step two started")
    first.kill()
    assert db.run(run.id)["status"] == "running"
    second = start_worker("w-1")
    wait_for(lambda: db.run(run.id)["status"] == "completed", what="run completed after catchup")
    second.wait_logged("catchup: resuming 1 runs")
    executions = collections.Counter(tag for _, tag, _ in workflows.marks_of(marks))
    assert executions == {"one": 1, "one:end": 1, "two": 2, "two:end": 1, "three": 1, "three:end": 1}
    assert db.run(run.id)["result"] == ["one", "two", "three"]


def test_unsafe_step_killed_mid_effect_ends_blocked(db, start_worker, marks, tmp_path):
    (run,) = db.schedule_many(workflows.unsafe_then_done, [(marks, str(tmp_path / "never"))])
    first = start_worker("w-1")
    wait_for(lambda: workflows.marks_of(marks), what="the effect started")
    first.kill()
    start_worker("w-1")
    wait_for(lambda: db.run(run.id)["status"] == "blocked", what="run blocked")
    assert db.run(run.id)["error"]["type"] == "everystep.errors.EffectUncertain"
    assert [s["status"] for s in db.steps(run.id)] == ["started"]
    assert [tag for _, tag, _ in workflows.marks_of(marks)] == ["effect"]  # never ran twice


def test_two_processes_with_one_name_never_hold_runs_together(db, start_worker, marks):
    first = start_worker("w-same")
    first.wait_logged("holding the lock of w-same")
    second = start_worker("w-same")
    second.wait_logged("held by another live process; waiting")
    db.schedule_many(workflows.timed_steps, [(marks, 3, 0.05)] * 20)
    wait_for(lambda: len(workflows.marks_of(marks)) >= 20, what="some steps ran")
    first.kill()
    before_kill = workflows.marks_of(marks)
    wait_for(all_done(db, 20), timeout=60, what="runs completed")
    after_kill = workflows.marks_of(marks)[len(before_kill):]
    assert {pid for _, _, pid in before_kill} == {first.pid}  # the waiting one ran nothing
    assert {pid for _, _, pid in after_kill} == {second.pid}
    second.wait_logged("holding the lock of w-same")


def test_a_run_taken_away_is_abandoned_without_a_stray_write(db, start_worker, marks, tmp_path):
    release = tmp_path / "release"
    (run,) = db.schedule_many(workflows.three_steps_held, [(marks, str(release))])
    worker = start_worker("w-1")
    wait_for(lambda: any(tag == "two" for _, tag, _ in workflows.marks_of(marks)), what="step two started")
    # Behind the worker's back, the run now belongs to another claimer.
    db.query("UPDATE everystep_workflow SET claimed_by = 'someone-else' WHERE id = %s RETURNING id", (run.id,))
    release.touch()
    worker.wait_logged("claim lost, run abandoned")
    time.sleep(0.3)
    assert [s["step_id"] for s in db.steps(run.id)] == ["1"]  # step two's outcome was not written
    row = db.run(run.id)
    assert (row["status"], row["claimed_by"]) == ("running", "someone-else")
    assert worker.alive()


def test_sigterm_drains_and_loses_no_recorded_step(db, start_worker, marks):
    db.schedule_many(workflows.timed_steps, [(marks, 5, 0.2)] * 6)
    worker = start_worker("w-1", threads=6, drain=30)
    wait_for(lambda: len(workflows.marks_of(marks)) >= 8, what="steps running")
    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0
    assert statuses(db).get("running", 0) == 0
    assert db.value("SELECT count(*) FROM everystep_workflow WHERE claimed_by IS NOT NULL"
                    " AND status = 'scheduled'") == 0
    # Every step that finished was recorded: the drain let in-flight steps end.
    finished = {(run, tag[:-4]) for run, tag, _ in workflows.marks_of(marks) if tag.endswith(":end")}
    recorded = {(str(w), f"s{int(s) - 1}") for w, s in db.query("SELECT workflow_id, step_id FROM everystep_step")}
    assert finished == recorded
    start_worker("w-2", threads=6)
    wait_for(all_done(db, 6), timeout=60, what="runs completed after the restart")
    executions = collections.Counter((run, tag) for run, tag, _ in workflows.marks_of(marks))
    assert set(executions.values()) == {1}  # nothing ran twice across the drain


def test_the_drain_deadline_requeues_a_step_that_runs_too_long(db, start_worker, marks):
    (run,) = db.schedule_many(workflows.timed_steps, [(marks, 1, 60)])
    worker = start_worker("w-1", drain=1)
    wait_for(lambda: workflows.marks_of(marks), what="the long step started")
    started = time.monotonic()
    worker.signal(signal.SIGTERM)
    assert worker.wait(15) == 0
    assert time.monotonic() - started < 10
    row = db.run(run.id)
    assert (row["status"], row["claimed_by"]) == ("scheduled", None)
    assert "drain deadline: requeued 1 runs" in worker.output()


def test_sigquit_requeues_at_once(db, start_worker, marks):
    (run,) = db.schedule_many(workflows.timed_steps, [(marks, 1, 60)])
    worker = start_worker("w-1", drain=60)
    wait_for(lambda: workflows.marks_of(marks), what="the long step started")
    worker.signal(signal.SIGQUIT)
    assert worker.wait(10) == 0
    assert db.run(run.id)["status"] == "scheduled"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGQUIT])
def test_stopping_a_busy_worker_leaves_nothing_claimed(db, start_worker, marks, sig):
    # While runs wait, each run that ends claims the next one in the statement
    # that ends it: a stop at any moment must still end or hand back each run.
    db.schedule_many(workflows.quick, [(marks,)] * 1000)
    worker = start_worker("w-1", threads=4)
    wait_for(lambda: statuses(db).get("completed", 0) >= 50, what="runs completing")
    worker.signal(sig)
    assert worker.wait(30) == 0
    assert set(statuses(db)) <= {"completed", "scheduled"}
    assert db.value("SELECT count(*) FROM everystep_workflow WHERE status = 'scheduled'"
                    " AND claimed_by IS NOT NULL") == 0
    start_worker("w-2", threads=4)
    wait_for(all_done(db, 1000), timeout=60, what="runs completed after the restart")
    if sig == signal.SIGTERM:  # a drain lets running steps end and records them: none runs twice
        executions = collections.Counter((run, tag) for run, tag, _ in workflows.marks_of(marks))
        assert set(executions.values()) == {1}


def test_a_poison_run_fails_after_max_crashes(db, start_worker, marks):
    (bad,) = db.schedule_many(workflows.poison, [(marks,)])
    for attempt in range(3):
        worker = start_worker("w-1", max_crashes=3)
        assert worker.wait(30) == -signal.SIGKILL, worker.output()
        assert sum(tag == "poison" for _, tag, _ in workflows.marks_of(marks)) == attempt + 1
    worker = start_worker("w-1", max_crashes=3)
    wait_for(lambda: db.run(bad.id)["status"] == "failed", what="poison run failed")
    assert "died during 3 claims" in db.run(bad.id)["error"]["message"]
    (good,) = db.schedule_many(workflows.quick, [(marks,)])
    wait_for(lambda: db.run(good.id)["status"] == "completed", what="the worker still works")
    assert worker.alive()


def test_losing_the_control_connection_pauses_and_resumes(db, start_worker, marks):
    name = f"w-ctl-{db.schema}"  # the server is shared: cut only this test's worker
    worker = start_worker(name, threads=2)
    worker.wait_logged(f"holding the lock of {name}")
    runs = db.schedule_many(workflows.timed_steps, [(marks, 10, 0.05)] * 4)
    wait_for(lambda: len(workflows.marks_of(marks)) >= 4, what="steps running")
    db.query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
             (f"everystep {name} control"[:63],))
    worker.wait_logged("lost the control connection")
    wait_for(all_done(db, len(runs)), timeout=60, what="runs completed")
    assert worker.alive()
    assert worker.output().count(f"holding the lock of {name}") == 2


def test_a_step_raising_system_exit_is_a_crash_of_its_run_not_of_the_worker(db, start_worker, marks):
    (run,) = db.schedule_many(workflows.exits, [(marks,)])
    worker = start_worker("w-1", max_crashes=2)
    wait_for(lambda: db.run(run.id)["status"] == "failed", what="the run failed as poison")
    assert "died during 2 claims" in db.run(run.id)["error"]["message"]
    assert [tag for _, tag, _ in workflows.marks_of(marks)] == ["exit", "exit"]
    (good,) = db.schedule_many(workflows.quick, [(marks,)])
    wait_for(lambda: db.run(good.id)["status"] == "completed", what="the worker still works")
    assert worker.alive()


def test_runs_recovered_elsewhere_while_the_lock_was_lost_are_abandoned_on_relock(db, start_worker, marks, tmp_path):
    release = tmp_path / "release"
    (run,) = db.schedule_many(workflows.three_steps_held, [(marks, str(release))])
    name = f"w-relock-{db.schema}"
    worker = start_worker(name, grace=60)
    wait_for(lambda: any(tag == "two" for _, tag, _ in workflows.marks_of(marks)), what="step two started")
    with db.connect() as thief:
        # Cut the worker's lock connection and take its lock before it comes back,
        # then requeue its run, as the sweep of another supervisor would.
        take_lock_from(thief, name, (f"everystep {name} control",))
        thief.execute("UPDATE everystep_workflow SET status = 'scheduled', claimed_by = NULL WHERE id = %s",
                      (run.id,))
    worker.wait_logged("1 runs in flight were recovered elsewhere while the lock was lost; abandoning them")
    release.touch()  # the abandoned execution goes on, and must not write
    wait_for(lambda: db.run(run.id)["status"] == "completed", what="the run completed, claimed again")
    executions = collections.Counter(tag for _, tag, _ in workflows.marks_of(marks))
    assert executions["two:end"] == 2 and executions["three"] == 1  # the second execution replayed the rest
    assert [s["step_id"] for s in db.steps(run.id)] == ["1", "2", "3"]
    assert "engine error" not in worker.output()


def busy_worker_through(server, folder, marks, runs: int, grace: float, disruption) -> str:
    """Start a worker on the private server with `runs` runs in flight, apply
    `disruption(worker)`, and check every run completes with the worker
    alive. Returns the worker's log."""
    worker = WorkerProcess(server.url, "w-1", folder / "logs", threads=4, grace=grace)
    try:
        with psycopg.connect(server.url, autocommit=True) as conn, everystep.transaction(conn):
            for _ in range(runs):
                schedule(workflows.timed_steps, marks, 10, 0.05)
        wait_for(lambda: len(workflows.marks_of(marks)) >= 2 * runs, what="steps running")
        disruption(worker)
        with psycopg.connect(server.url, autocommit=True) as conn:
            wait_for(lambda: conn.execute("SELECT count(*) FROM everystep_workflow WHERE status = 'completed'")
                     .fetchone()[0] == runs, timeout=60, what="every run completed")
        assert worker.alive()
        return worker.output()
    finally:
        worker.close()


def test_restarting_postgres_under_a_running_worker(private_server, tmp_path, marks):
    log = busy_worker_through(private_server, tmp_path, marks, 4, 30, lambda worker: private_server.restart())
    assert "lost the control connection" in log


def test_a_worker_cut_off_past_the_grace_keeps_its_runs_and_carries_on(private_server, tmp_path, marks):
    """While the database is away nobody can recover the worker's runs (their
    claims are on the database, and so is its lock): however long that lasts,
    the worker keeps them, paused, and goes on with them once it is back.
    No step runs twice."""
    def cut_off(worker):
        private_server.stop()
        time.sleep(3)  # three times the grace
        private_server.start()

    log = busy_worker_through(private_server, tmp_path, marks, 4, 1, cut_off)
    assert "abandoning" not in log
    executions = collections.Counter((run, tag) for run, tag, _ in workflows.marks_of(marks))
    assert set(executions.values()) == {1}


def test_a_worker_whose_lock_is_held_elsewhere_past_the_grace_abandons_its_runs(db, start_worker, marks, tmp_path):
    """Another session holds the worker's lock (a sweep recovering its runs, a
    second process under its name): past the grace, whoever holds it owns the
    runs, and the worker never writes about them again. Once it has its lock
    back, what is still its own is replayed."""
    release = tmp_path / "release"
    (run,) = db.schedule_many(workflows.held_once, [(marks, str(release))])
    name = f"w-taken-{db.schema}"
    worker = start_worker(name, grace=1)
    wait_for(lambda: [tag for _, tag, _ in workflows.marks_of(marks)] == ["held"], what="the step started")
    with db.connect() as thief:
        take_lock_from(thief, name, (f"everystep {name} control",))
        worker.wait_logged(f"lock of {name} is held by another live process; waiting")
        worker.wait_logged("abandoning 1 runs")
    release.touch()  # the abandoned execution's outcome is not written; the replay's is
    wait_for(lambda: db.run(run.id)["status"] == "completed", what="the run completed")
    assert [tag for _, tag, _ in workflows.marks_of(marks)] == ["held", "held:end", "held", "held:end"]
    assert worker.alive()


def test_a_workers_step_and_run_figures_reach_its_metrics_while_it_runs(db, marks):
    """The runs' threads count their steps and ends in metrics.TALLY; the
    control loop applies them at its turns, so the metrics show a run's
    figures soon after it ends, not only once the worker stops."""
    from prometheus_client import REGISTRY  # noqa: PLC0415

    def figures() -> tuple[float, float, float]:
        steps = runs = observed = 0.0
        for family in REGISTRY.collect():
            for sample in family.samples:
                if not sample.labels.get("workflow", "").endswith("two_steps"):
                    continue
                if sample.name == "everystep_step_runs_total" and sample.labels["status"] == "done":
                    steps += sample.value
                elif sample.name == "everystep_workflow_runs_total" and sample.labels["status"] == "completed":
                    runs += sample.value
                elif sample.name == "everystep_step_duration_seconds_count":
                    observed += sample.value
        return steps, runs, observed

    before = figures()
    with worker_in_this_process(db, "w-tally"):
        (run,) = db.schedule_many(workflows.two_steps, [(marks,)])
        wait_for(lambda: db.run(run.id)["status"] == "completed", 10, what="the run completed")
        wait_for(lambda: figures() == (before[0] + 2, before[1] + 1, before[2] + 2), 5,
                 what="the run's figures in the metrics")


def test_a_workers_writers_give_their_connections_back_once_idle(db, marks, monkeypatch):
    """A writer keeps its connection while it writes batches; once none was
    written for writer.IDLE, the worker's loop gives it back to the pool."""
    from everystep import writer  # noqa: PLC0415

    monkeypatch.setattr(writer, "IDLE", 1.0)
    with worker_in_this_process(db, "w-idle") as worker:
        (run,) = db.schedule_many(workflows.two_steps, [(marks,)])
        wait_for(lambda: db.run(run.id)["status"] == "completed", 10, what="the run completed")
        writers = (worker.runner.step_writer, worker.runner.end_writer)
        assert all(w._conn is not None for w in writers)  # (kept for the next batch, a moment ago)
        wait_for(lambda: all(w._conn is None for w in writers), 10, what="the idle writers' connections given back")


@contextlib.contextmanager
def worker_in_this_process(db, name: str):
    """A Worker of 2 slots running on a thread of the test's process, holding its lock."""
    locked = threading.Event()
    worker = Worker(db.url, name, threads=2, poll=0.05, on_lock=lambda held: held and locked.set())
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        assert locked.wait(10)
        yield worker
    finally:
        worker.stop()
        thread.join(20)
