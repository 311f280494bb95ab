"""`everystep-supervisor`: real supervisor processes, their children, signals,
restarts and recovery, against a real PostgreSQL."""

from __future__ import annotations

import collections
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import psycopg
import pytest
import yaml
from psycopg import conninfo

import everystep.db
from tests.apps import workflows
from tests.apps.workflows import marks_of
from tests.support.processes import ROOT, console_script, wait_for
from tests.support.supervisor_process import children_of, config, cpu_seconds, running


def count(db, status):
    return db.value("SELECT count(*) FROM everystep_workflow WHERE status = %s", (status,))


def test_sigkill_of_a_worker_child_brings_the_same_name_back(db, supervisors, marks, tmp_path):
    sup = supervisors(config(db.url, "sk", workers={"processes": 1}))
    (before,) = sup.wait_workers({"sk-0"}).values()
    (run,) = db.schedule_many(workflows.three_steps_held, [(marks, str(tmp_path / "never"))])
    wait_for(lambda: any(tag == "two" for _, tag, _ in workflows.marks_of(marks)), what="step two started")
    os.kill(before, signal.SIGKILL)
    # Restarted at once (no back-off for a first crash): well within 15 s even on a loaded machine.
    after = wait_for(lambda: (w := sup.workers()).get("sk-0") not in (None, before) and w["sk-0"], timeout=15,
                     what="sk-0 restarted")
    wait_for(lambda: db.run(run.id)["status"] == "completed", what="the run completed")
    assert db.run(run.id)["claimed_by"] == "sk-0"
    assert {pid for _, tag, pid in workflows.marks_of(marks) if tag == "three"} == {after}
    sup.wait_logged(f"worker sk-0 (pid {before}) was killed by signal 9 (SIGKILL) unexpectedly")


def test_a_worker_child_freezes_what_it_loaded_out_of_the_collectors_walks(db, supervisors):
    sup = supervisors(config(db.url, "gc", workers={"processes": 1}))
    sup.wait_workers({"gc-0"})
    (run,) = db.schedule_many(workflows.collector_settings, [()])
    wait_for(lambda: db.run(run.id)["status"] == "completed", what="the run completed")
    assert db.run(run.id)["result"]["frozen"] > 1000  # the modules, the application, the config


def test_a_lost_pod_is_recovered_by_another_supervisor(db, supervisors, marks, tmp_path):
    first = supervisors(config(db.url, "pod-a"))
    first.wait_workers({"pod-a-0", "pod-a-1"})
    # Held until released: still in flight once pod-b is up, however slowly a loaded machine starts it.
    release = tmp_path / "release"
    db.schedule_many(workflows.recorded_then_held, [(marks, str(release))] * 6)
    wait_for(lambda: count(db, "running") == 6 and [tag for _, tag, _ in marks_of(marks)].count("held") == 6,
             what="six runs in flight, past their first step")
    second = supervisors(config(db.url, "pod-b"))
    second.wait_workers({"pod-b-0", "pod-b-1"})
    wait_for(lambda: "started maintenance" in second.output(), what="pod-b's sweep running")
    first.kill_tree()
    lost = time.monotonic()
    recovery = second.document["recovery"]
    wait_for(lambda: count(db, "running") == 6 and db.value(
        "SELECT count(*) FROM everystep_workflow WHERE claimed_by LIKE 'pod-b-%%'") == 6,
        timeout=60, interval=0.02, what="every run running again under pod-b")
    # The bound docs/running.md states (the process died, its host lives: detection
    # is immediate), with a margin for a loaded machine.
    assert time.monotonic() - lost < recovery["interval"] + recovery["grace"] + 5
    release.touch()
    wait_for(lambda: count(db, "completed") == 6, timeout=60, what="every run completed")


def test_a_slow_live_worker_is_never_recovered_from_under_it(db, supervisors, marks):
    slow = supervisors(config(db.url, "slow", workers={"processes": 1}))
    slow.wait_workers({"slow-0"})
    (run,) = db.schedule_many(workflows.timed_steps, [(marks, 1, 6.0)])
    wait_for(lambda: workflows.marks_of(marks), what="the slow step started")
    other = supervisors(config(db.url, "other", workers={"processes": 1}))  # its sweep probes slow-0
    other.wait_workers({"other-0"})
    wait_for(lambda: db.run(run.id)["status"] == "completed", timeout=30, what="the slow run completed")
    assert [tag for _, tag, _ in workflows.marks_of(marks)] == ["s0", "s0:end"]  # ran once, never stolen
    assert db.run(run.id)["claimed_by"] == "slow-0"
    assert "is dead: requeued" not in other.output()


def all_children(sup) -> list[int]:
    """The pids of the supervisor's children once all four are up."""
    return list(wait_for(lambda: len(found := children_of(sup.pid)) == 4 and found,
                         what="workers, http and maintenance"))


def nothing_claimed(db) -> bool:
    return db.value("SELECT count(*) FROM everystep_workflow WHERE claimed_by IS NOT NULL AND status <> 'completed'"
                    " AND status <> 'failed'") == 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_sigint_drain_and_exit_zero_with_nothing_running(db, supervisors, marks, sig):
    sup = supervisors(config(db.url, "term"))
    sup.wait_workers({"term-0", "term-1"})
    children = all_children(sup)
    db.schedule_many(workflows.timed_steps, [(marks, 20, 0.1)] * 6)
    wait_for(lambda: count(db, "running") == 6, what="runs in flight")
    sup.signal(sig)
    assert sup.wait(30) == 0
    assert f"{sig.name}: stopping (draining workers)" in sup.output()  # the signal received, a Ctrl-C too
    assert count(db, "running") == 0
    assert nothing_claimed(db)
    assert not [pid for pid in children if running(pid)]
    finished = {(run, tag[:-4]) for run, tag, _ in workflows.marks_of(marks) if tag.endswith(":end")}
    recorded = {(str(w), f"s{int(s) - 1}") for w, s in db.query("SELECT workflow_id, step_id FROM everystep_step")}
    assert finished == recorded  # every step that ended was recorded


def test_sigquit_stops_fast_and_exits_zero_with_nothing_running(db, supervisors, marks, tmp_path):
    sup = supervisors(config(db.url, "quit", workers={"drain": 120}))
    sup.wait_workers({"quit-0", "quit-1"})
    children = all_children(sup)
    runs = db.schedule_many(workflows.held, [(marks, str(tmp_path / "never"))] * 4)
    wait_for(lambda: len(marks_of(marks)) == 4, what="four steps held")
    sup.signal(signal.SIGQUIT)
    # A drain would wait 120 s for the held steps: a fast stop does not.
    assert sup.wait(60) == 0
    assert {db.run(run.id)["status"] for run in runs} == {"scheduled"}  # requeued, to run again elsewhere
    assert nothing_claimed(db)
    assert not [pid for pid in children if running(pid)]
    assert "QUIT: stopping fast" in sup.output()


def test_ttin_and_ttou_change_the_number_of_workers(db, supervisors):
    sup = supervisors(config(db.url, "scale"))
    sup.wait_workers({"scale-0", "scale-1"})
    sup.signal(signal.SIGTTIN)
    sup.wait_workers({"scale-0", "scale-1", "scale-2"})
    sup.signal(signal.SIGTTOU)  # the highest index goes first
    sup.wait_workers({"scale-0", "scale-1"})
    sup.signal(signal.SIGTTOU)  # (signals sent together may merge into one: one at a time)
    sup.wait_workers({"scale-0"})
    sup.signal(signal.SIGTTOU)  # never below one
    sup.wait_logged("TTOU: already at one worker")
    assert set(sup.workers()) == {"scale-0"}


def test_hup_applies_a_new_thread_count_without_losing_a_run(db, supervisors, marks):
    sup = supervisors(config(db.url, "hup", workers={"processes": 1, "threads": 2}))
    sup.wait_workers({"hup-0"})
    runs = db.schedule_many(workflows.timed_steps, [(marks, 5, 0.1)] * 12)
    wait_for(lambda: count(db, "running") == 2, what="two runs in flight")
    sup.write_config(config(db.url, "hup", workers={"processes": 1, "threads": 5}) | {"http": sup.document["http"]})
    sup.signal(signal.SIGHUP)
    sup.wait_logged("HUP: config reloaded")
    wait_for(lambda: any(title.endswith("/5]") for title in children_of(sup.pid).values()), timeout=30,
             what="a worker with 5 threads")
    wait_for(lambda: count(db, "completed") == len(runs), timeout=60, what="every run completed")
    executions = collections.Counter((run, tag) for run, tag, _ in workflows.marks_of(marks))
    assert set(executions.values()) == {1}  # the roll drained: nothing ran twice


def test_a_crash_looping_child_backs_off(db, supervisors, marks):
    # A grace far longer than the test: the sweep never requeues the poison
    # run between two restarts, so each incarnation of loop-0 dies on it at once.
    sup = supervisors(config(db.url, "loop", workers={"processes": 1}, recovery={"max_crashes": 100, "grace": 600}))
    sup.wait_workers({"loop-0"})
    db.schedule_many(workflows.poison, [(marks,)])
    sup.wait_logged("crashes in a row; restarting in 2.0 s", timeout=60)
    delays = re.findall(r"worker loop-0: (\d+) crashes in a row; restarting in ([\d.]+) s", sup.output())
    assert delays[:3] == [("2", "0.5"), ("3", "1.0"), ("4", "2.0")]
    assert sup.proc.poll() is None  # a crash loop of a child that booted never stops the supervisor


def test_the_children_exit_when_the_supervisor_dies(db, supervisors):
    sup = supervisors(config(db.url, "orphan"))
    sup.wait_workers({"orphan-0", "orphan-1"})
    children = all_children(sup)
    sup.proc.send_signal(signal.SIGKILL)
    sup.proc.wait(10)
    wait_for(lambda: not [pid for pid in children if running(pid)], timeout=20, what="the children to exit")
    assert "Traceback" not in sup.output()  # each drained and left quietly


def _supervisor(config_path, timeout=30):
    return subprocess.run([sys.executable, "-m", "supervisor", "-c", str(config_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("text, message", [
    ("workers:\n  threads: eight\n", "workers.threads: "),
    ("workers:\n  processes: 0\n", "workers.processes: "),
    ("wrokers: {}\n", "wrokers: "),
    ("database:\n  url: ${EVERYSTEP_TEST_UNSET_VARIABLE}\n", "EVERYSTEP_TEST_UNSET_VARIABLE"),
    ("http: [1, 2\n", "everystep.yaml"),
    ("database:\n  url: localhost\n", "database.url: not a PostgreSQL URL"),
])
def test_a_bad_config_exits_2_with_one_clear_line(tmp_path, text, message):
    path = tmp_path / "everystep.yaml"
    path.write_text(text)
    result = _supervisor(path)
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1
    assert message in result.stderr and "everystep.yaml" in result.stderr


def test_a_missing_config_file_exits_2(tmp_path):
    result = _supervisor(tmp_path / "nowhere.yaml")
    assert result.returncode == 2
    assert "nowhere.yaml" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_a_workflow_module_that_does_not_import_fails_fast(db, tmp_path):
    path = tmp_path / "everystep.yaml"
    path.write_text(yaml.safe_dump({"database": {"url": db.url}, "imports": ["tests.no_such_module"]}))
    result = _supervisor(path)
    assert result.returncode == 1
    assert "cannot import workflow module tests.no_such_module" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_child_that_cannot_boot_stops_the_supervisor(db, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        path = tmp_path / "everystep.yaml"
        path.write_text(yaml.safe_dump({"database": {"url": db.url}, "name": "boot",
                                        "http": {"bind": "127.0.0.1", "port": port}}))
        result = _supervisor(path)
    assert result.returncode == 1
    assert "http http could not boot" in result.stderr + result.stdout


def test_a_setup_that_fails_stops_the_supervisor(server_url, tmp_path):
    # A database user that may not create tables: the migrations fail.
    suffix = uuid.uuid4().hex[:12]
    schema, role = f"t_{suffix}", f"es_no_ddl_{suffix}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
        conn.execute(f"CREATE ROLE {role} LOGIN")
        conn.execute(f"GRANT USAGE ON SCHEMA {schema} TO {role}")
    try:
        url = conninfo.make_conninfo(server_url, user=role, options=f"-c search_path={schema}")
        path = tmp_path / "everystep.yaml"
        path.write_text(yaml.safe_dump(config(url, "nosetup")))
        result = _supervisor(path, timeout=60)
    finally:
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")
            conn.execute(f"DROP ROLE {role}")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "the setup (migrations, schedules) failed" in result.stderr
    assert "the setup failed: stopping (draining workers)" in result.stdout + result.stderr  # no signal came
    assert "permission denied for schema" in result.stdout
    assert "started worker" not in result.stdout


def test_a_bad_config_on_hup_is_logged_and_the_running_one_kept(db, supervisors):
    sup = supervisors(config(db.url, "badhup"))
    before = sup.wait_workers({"badhup-0", "badhup-1"})
    sup.config_path.write_text("workers:\n  threads: eight\n")
    sup.signal(signal.SIGHUP)
    sup.wait_logged("HUP: keeping the running config: ")
    assert "workers.threads: must be an integer >= 1, got 'eight'" in sup.output()
    assert sup.workers() == before and sup.proc.poll() is None  # nothing replaced, still running
    # The running config is still the one in force: a worker is restarted with it.
    sup.kill_worker("badhup-0")
    sup.wait_workers({"badhup-0", "badhup-1"})
    assert sup.proc.poll() is None


def test_a_hup_during_the_setup_applies_to_the_workers_it_starts(private_server, supervisors):
    private_server.stop()  # the setup waits for the database
    sup = supervisors(config(private_server.url, "early"))
    sup.wait_logged("setup: the database is unreachable")
    sup.write_config(config(private_server.url, "early", workers={"processes": 3}))
    sup.signal(signal.SIGHUP)
    sup.wait_logged("HUP: config reloaded")
    private_server.start()
    sup.wait_workers({"early-0", "early-1", "early-2"}, timeout=60)


def test_a_child_that_cannot_boot_after_a_hup_is_retried_not_fatal(db, supervisors):
    sup = supervisors(config(db.url, "port"))
    sup.wait_workers({"port-0", "port-1"})
    first_port = sup.port
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        sup.write_config(config(db.url, "port", http={"port": port}))
        sup.signal(signal.SIGHUP)
        sup.wait_logged("could not boot (see its log above); trying again", count=2, timeout=60)
        assert sup.proc.poll() is None  # the workers go on (the HUP rolls them one at a time meanwhile)
        sup.wait_workers({"port-0", "port-1"})
    # The port is free now: the next attempt (after a back-off) serves on it.
    wait_for(lambda: sup.port == port, timeout=60, what=f"the HTTP child on port {port} (was {first_port})")
    assert sup.proc.poll() is None


def test_hup_replaces_the_workers_one_at_a_time(db, supervisors, marks, tmp_path):
    sup = supervisors(config(db.url, "roll", workers={"threads": 1, "drain": 120}))
    before = sup.wait_workers({"roll-0", "roll-1"})
    # One held run per worker (one thread each), each with its own release file.
    releases = {}
    for i in range(2):
        release = tmp_path / f"release-{i}"
        (run,) = db.schedule_many(workflows.held, [(marks, str(release))])
        holder = wait_for(lambda run=run: db.run(run.id)["claimed_by"], what=f"run {i} claimed")
        releases[holder] = release
    assert set(releases) == {"roll-0", "roll-1"}

    sup.write_config(config(db.url, "roll", workers={"threads": 2, "drain": 120}))
    sup.signal(signal.SIGHUP)
    sup.wait_logged("runner=roll-0 draining 1 runs in flight")
    # roll-0 drains its held step; roll-1 is left at work meanwhile: once its
    # own run ends, it runs a new one.
    releases["roll-1"].touch()
    (quick,) = db.schedule_many(workflows.quick, [(marks,)])
    wait_for(lambda: db.run(quick.id)["status"] == "completed", timeout=30, what="the quick run completed")
    ran_by = {pid for run, _, pid in marks_of(marks) if run == str(quick.id)}
    assert ran_by == {before["roll-1"]}, (before, sup.workers(), sup.output()[-6000:])  # who ran it, if not roll-1
    assert running(before["roll-0"]) and "HUP: replacing worker roll-1" not in sup.output()

    # Keep the new roll-0 from its lock: this connection queues for it, and gets
    # it the moment the old roll-0 exits.
    with db.connect() as blocker:
        # The blocking form of the runner lock's try_lock (session.sql).
        lock = "SELECT pg_advisory_lock(hashtextextended('everystep:' || current_schema() || ':' || %s, 0))"
        taking = threading.Thread(target=blocker.execute, args=(lock, ("roll-0",)))
        taking.start()
        wait_for(lambda: db.value("SELECT count(*) FROM pg_locks WHERE pid = %s AND NOT granted",
                                  (blocker.info.backend_pid,)), what="the lock of roll-0 asked for")
        releases["roll-0"].touch()
        taking.join(60)
        sup.wait_logged("runner=roll-0 lock of roll-0 is held by another live process; waiting")
        # The new roll-0 is up but not at work: roll-1 is left alone.
        assert sup.workers()["roll-1"] == before["roll-1"] and "HUP: replacing worker roll-1" not in sup.output()
        everystep.db.unlock(blocker, "roll-0")
        wait_for(lambda: not set(sup.workers().values()) & set(before.values()), timeout=60,
                 what="both workers replaced")
    wait_for(lambda: all(title.endswith("/2]") for title in children_of(sup.pid).values()
                         if title.startswith("everystep: worker")), what="both workers with 2 threads")
    executions = collections.Counter((run, tag) for run, tag, _ in marks_of(marks))
    assert set(executions.values()) == {1}  # each drain let its step end: nothing ran twice


def test_ttin_while_a_retired_worker_drains_brings_it_back(db, supervisors, marks, tmp_path):
    sup = supervisors(config(db.url, "back", workers={"threads": 1, "drain": 120}))
    before = sup.wait_workers({"back-0", "back-1"})
    release = tmp_path / "release"
    db.schedule_many(workflows.held, [(marks, str(release))] * 2)
    wait_for(lambda: len(marks_of(marks)) == 2, what="both workers busy")
    sup.signal(signal.SIGTTOU)
    sup.wait_logged("now 1 workers")
    sup.signal(signal.SIGTTIN)  # while back-1 still drains its held step
    sup.wait_logged("now 2 workers")
    release.touch()
    wait_for(lambda: (w := sup.workers()).keys() == {"back-0", "back-1"} and w["back-1"] != before["back-1"],
             timeout=30, what="back-1 back after its drain")
    wait_for(lambda: count(db, "completed") == 2, timeout=30, what="both runs completed")


def test_the_supervisor_does_not_spin_while_a_worker_drains(db, supervisors, marks, tmp_path):
    sup = supervisors(config(db.url, "spin", workers={"threads": 1, "drain": 120}))
    sup.wait_workers({"spin-0", "spin-1"})
    release = tmp_path / "release"
    db.schedule_many(workflows.held, [(marks, str(release))])
    wait_for(lambda: marks_of(marks), what="the held step started")
    sup.signal(signal.SIGTERM)
    # The idle worker exits at once; the busy one drains until the release.
    wait_for(lambda: len(sup.workers()) == 1, timeout=30, what="the idle worker gone")
    used, started = cpu_seconds(sup.pid), time.monotonic()
    time.sleep(3)  # a window to measure, not a wait for something
    used, elapsed = cpu_seconds(sup.pid) - used, time.monotonic() - started
    release.touch()
    assert sup.wait(60) == 0
    assert used < elapsed / 4, f"the supervisor used {used:.2f} s of CPU in {elapsed:.2f} s of drain"


def test_the_maintenance_child_waits_out_a_database_outage_quietly(private_server, supervisors):
    sup = supervisors(config(private_server.url, "out", recovery={"grace": 10}))
    sup.wait_workers({"out-0", "out-1"})
    maintenance = wait_for(lambda: next((pid for pid, title in children_of(sup.pid).items()
                                         if title == "everystep: maintenance"), None), what="the maintenance child")
    private_server.stop()
    sup.wait_logged("maintenance: the database is unreachable", timeout=30)
    used, started = cpu_seconds(maintenance), time.monotonic()
    time.sleep(5)  # a window to measure, not a wait for something
    used, elapsed = cpu_seconds(maintenance) - used, time.monotonic() - started
    private_server.start()
    sup.wait_logged("maintenance: the database answers again", timeout=60)
    lines = [line for line in sup.output().splitlines() if "maintenance:" in line]
    assert len(lines) == 2, lines  # once when it went away, once when it came back
    assert used < elapsed / 4, f"the maintenance child used {used:.2f} s of CPU in {elapsed:.2f} s of outage"
    assert running(maintenance)  # nobody exited over it


def test_workflow_modules_are_found_in_the_current_directory(db, supervisors, tmp_path):
    # The console script, not `python -m`, which puts the current directory on sys.path by itself.
    folder = tmp_path / "app"
    folder.mkdir()
    (folder / "shop_flows.py").write_text(
        "import everystep\n\n@everystep.workflow\ndef order(n):\n    return n + 1\n")
    document = config(db.url, "here", imports=["shop_flows"])
    sup = supervisors(document, command=(console_script("everystep-supervisor"),), cwd=folder)
    sup.wait_workers({"here-0", "here-1"})
    scheduled = subprocess.run([console_script("everystep"), "--database-url", db.url, "schedule",
                                "shop_flows:order", "41"], cwd=folder, capture_output=True, text=True, timeout=60)
    assert scheduled.returncode == 0, scheduled.stderr
    run_id = scheduled.stdout.split()[2]
    wait_for(lambda: db.run(run_id)["status"] == "completed", what="the run completed by the supervisor's workers")
    assert db.run(run_id)["result"] == 42


def test_a_term_sent_right_after_the_fork_is_not_lost(db):
    result = subprocess.run([sys.executable, "-m", "tests.apps.fork_race", db.url], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.stdout.strip() == "was killed by signal 15 (SIGTERM)", result.stdout + result.stderr
