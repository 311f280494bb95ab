"""`everystep-supervisor`: real supervisor processes, their children, signals,
restarts and recovery, against a real PostgreSQL."""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml

from tests import workflows
from tests.processes import ROOT, wait_for
from tests.supervisor_process import SupervisorProcess, children_of, config


@pytest.fixture
def supervisors(tmp_path):
    started = []

    def start(document: dict) -> SupervisorProcess:
        sup = SupervisorProcess(document, tmp_path / "supervisors")
        started.append(sup)
        return sup

    yield start
    for sup in started:
        sup.close()


def count(db, status):
    return db.value("SELECT count(*) FROM everystep_workflow WHERE status = %s", (status,))


def test_sigkill_of_a_worker_child_brings_the_same_name_back(db, supervisors, marks, tmp_path):
    sup = supervisors(config(db.url, "sk", workers={"processes": 1}))
    (before,) = sup.wait_workers({"sk-0"}).values()
    (run,) = db.schedule_many(workflows.three_steps_held, [(marks, str(tmp_path / "never"))])
    wait_for(lambda: any(tag == "two" for _, tag, _ in workflows.marks_of(marks)), what="step two started")
    os.kill(before, signal.SIGKILL)
    killed = time.monotonic()
    after = wait_for(lambda: (w := sup.workers()).get("sk-0") not in (None, before) and w["sk-0"], timeout=10)
    assert time.monotonic() - killed < 5
    wait_for(lambda: db.run(run.id)["status"] == "completed", what="the run completed")
    assert db.run(run.id)["claimed_by"] == "sk-0"
    assert {pid for _, tag, pid in workflows.marks_of(marks) if tag == "three"} == {after}
    sup.wait_logged(f"worker sk-0 (pid {before}) was killed by signal 9 (SIGKILL) unexpectedly")


def test_a_lost_pod_is_recovered_by_another_supervisor(db, supervisors, marks):
    first = supervisors(config(db.url, "pod-a"))
    first.wait_workers({"pod-a-0", "pod-a-1"})
    db.schedule_many(workflows.timed_steps, [(marks, 3, 1.0)] * 6)
    wait_for(lambda: count(db, "running") == 6, what="six runs in flight")
    second = supervisors(config(db.url, "pod-b"))
    second.wait_workers({"pod-b-0", "pod-b-1"})
    first.kill_tree()
    lost = time.monotonic()
    recovery = second.document["recovery"]
    wait_for(lambda: count(db, "running") == 6 and db.value(
        "SELECT count(*) FROM everystep_workflow WHERE claimed_by LIKE 'pod-b-%%'") == 6,
        timeout=30, what="every run running again under pod-b")
    assert time.monotonic() - lost < recovery["interval"] + recovery["grace"] + 3
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


def test_sigterm_drains_and_exits_zero_with_nothing_running(db, supervisors, marks):
    sup = supervisors(config(db.url, "term"))
    sup.wait_workers({"term-0", "term-1"})
    db.schedule_many(workflows.timed_steps, [(marks, 20, 0.1)] * 6)
    wait_for(lambda: count(db, "running") == 6, what="runs in flight")
    sup.signal(signal.SIGTERM)
    assert sup.wait(30) == 0
    assert count(db, "running") == 0
    assert db.value("SELECT count(*) FROM everystep_workflow WHERE claimed_by IS NOT NULL AND status <> 'completed'"
                    " AND status <> 'failed'") == 0
    assert children_of(sup.pid) == {}
    finished = {(run, tag[:-4]) for run, tag, _ in workflows.marks_of(marks) if tag.endswith(":end")}
    recorded = {(str(w), f"s{int(s) - 1}") for w, s in db.query("SELECT workflow_id, step_id FROM everystep_step")}
    assert finished == recorded  # every step that ended was recorded


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
    sup = supervisors(config(db.url, "loop", workers={"processes": 1}, recovery={"max_crashes": 100}))
    sup.wait_workers({"loop-0"})
    db.schedule_many(workflows.poison, [(marks,)])
    sup.wait_logged("crashes in a row; restarting in 2.0 s", timeout=30)
    delays = [float(d) for d in re.findall(r"crashes in a row; restarting in ([\d.]+) s", sup.output())]
    assert delays[:3] == [0.5, 1.0, 2.0]
    assert "loop-0" in sup.output() and sup.proc.poll() is None


def test_the_children_exit_when_the_supervisor_dies(db, supervisors):
    sup = supervisors(config(db.url, "orphan"))
    sup.wait_workers({"orphan-0", "orphan-1"})
    wait_for(lambda: len(children_of(sup.pid)) == 4, what="workers, http and maintenance")
    children = list(children_of(sup.pid))
    sup.proc.send_signal(signal.SIGKILL)
    sup.proc.wait(10)

    def all_gone():
        return not any(os.path.exists(f"/proc/{pid}") and "Z" not in open(f"/proc/{pid}/stat").read().split(")")[-1][:3]
                       for pid in children)

    wait_for(all_gone, timeout=20, what="the children to exit")
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
    import socket  # noqa: PLC0415

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
