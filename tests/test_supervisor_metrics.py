"""The observability contract against a real `everystep-supervisor` with two
workers: one scrape of /metrics adds up every child, a killed child's counts
stay while its live gauges go with it, the supervisor counts its restarts and
children, the queue gauges match the tables, /healthz and /readyz say what
they promise, and a real Prometheus server reads it all back."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.error

import psycopg
import yaml

import everystep
from supervisor import http_server
from tests.apps import obs_workflows, obs_workload, workflows
from tests.support.processes import WorkerProcess, wait_for
from tests.support.scraping import PROMPTLY, UUID_SHAPED, Prometheus, get, insert_runs, needs_prometheus, samples, value
from tests.support.supervisor_process import SupervisorProcess, children_of, config, process_state, restart_workers

ROLES = ("worker", "http", "maintenance")


def schedule_runs(url: str, fn, args_list) -> list:
    with psycopg.connect(url, autocommit=True) as conn, everystep.transaction(conn):
        return [everystep.schedule(fn, *args) for args in args_list]


# ---------------------------------------------------------------- helpers

def base(sup: SupervisorProcess) -> str:
    return f"http://127.0.0.1:{sup.port}"


def scrape(sup: SupervisorProcess) -> dict:
    status, body = get(base(sup) + "/metrics")
    assert status == 200, body
    return samples(body)


def scrape_when(sup: SupervisorProcess, condition, timeout: float = 30.0, what: str = "") -> dict:
    """The first scrape for which `condition(scrape)` holds (the HTTP child may be restarting meanwhile)."""
    def attempt():
        try:
            found = scrape(sup)
        except (OSError, urllib.error.URLError):
            return None
        return found if condition(found) else None

    return wait_for(attempt, timeout=timeout, what=what or "a scrape that satisfies the condition")


def total(found: dict, name: str, **labels: str) -> float:
    """The sum of the samples `name` whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(v for (n, have), v in found.items() if n == name and wanted <= have)


def children_gauge(found: dict) -> dict[str, float | None]:
    return {role: value(found, "everystep_supervisor_children", role=role) for role in ROLES}


def probe(sup: SupervisorProcess, path: str) -> tuple[int, str]:
    try:
        return get(base(sup) + path, timeout=10)
    except (OSError, urllib.error.URLError) as exc:
        return 0, str(exc)


def held_by(url: str) -> dict[str, int]:
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute("SELECT claimed_by, count(*) FROM everystep_workflow WHERE status = 'running'"
                            " GROUP BY claimed_by").fetchall()
    return dict(rows)


def status_counts(url: str) -> dict[str, int]:
    with psycopg.connect(url, autocommit=True) as conn:
        return dict(conn.execute("SELECT status, count(*) FROM everystep_workflow GROUP BY status").fetchall())


def pid_of(sup: SupervisorProcess, title: str) -> int | None:
    found = [pid for pid, cmdline in children_of(sup.pid).items() if cmdline == f"everystep: {title}"]
    return found[0] if len(found) == 1 else None


def restarted(sup: SupervisorProcess, title: str, old: int) -> int:
    return wait_for(lambda: (pid := pid_of(sup, title)) not in (None, old) and pid, timeout=30,
                    what=f"{title} restarted")


class Scraper:
    """Scrapes /metrics in a thread, as Prometheus would, while the test goes on."""

    def __init__(self, sup: SupervisorProcess):
        self.scrapes: list[dict] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(sup,), daemon=True)
        self._thread.start()

    def _run(self, sup: SupervisorProcess) -> None:
        try:
            while not self._stop.is_set():
                self.scrapes.append(scrape(sup))
        except BaseException as exc:  # reported by stop()
            self.errors.append(exc)

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join(30)
        assert not self.errors, f"a scrape failed: {self.errors[0]!r}"
        return self.scrapes


# ---------------------------------------------------------------- counters and live gauges

def test_both_workers_add_up_and_a_sigkilled_worker_loses_no_count(db, supervisors, marks, tmp_path):
    sup = supervisors(config(db.url, "sum"))  # two workers of four threads
    sup.wait_workers({"sum-0", "sum-1"})
    release = tmp_path / "release"
    schedule_runs(db.url, workflows.held, [(marks, str(release))] * 8)
    wait_for(lambda: held_by(db.url) == {"sum-0": 4, "sum-1": 4}, what="four runs held by each worker")

    before = scrape_when(sup, lambda s: total(s, "everystep_worker_inflight") == 8, what="eight runs in flight")
    for runner in ("sum-0", "sum-1"):
        assert value(before, "everystep_worker_claims_total", runner=runner) == 4
        assert value(before, "everystep_worker_inflight", runner=runner) == 4
        assert value(before, "everystep_worker_pool_size", runner=runner) == 4
        # Present before anything happens, so that increase() sees the first one.
        assert value(before, "everystep_claims_lost_total", runner=runner) == 0
        assert value(before, "everystep_worker_requeued_total", runner=runner) == 0
        assert value(before, "everystep_supervisor_child_restarts_total", child=runner) == 0
    assert total(before, "everystep_worker_claims_total") == 8
    assert children_gauge(before) == {"worker": 2, "http": 1, "maintenance": 1}
    started_at = value(before, "everystep_worker_started_at_seconds", runner="sum-0")

    scraper = Scraper(sup)
    try:
        dead = sup.workers()["sum-0"]
        os.kill(dead, signal.SIGKILL)
        # The new incarnation takes its four runs back (catchup) and holds them again.
        after = scrape_when(sup, lambda s: (value(s, "everystep_worker_started_at_seconds", runner="sum-0") or 0)
                            > started_at and value(s, "everystep_worker_inflight", runner="sum-0") == 4,
                            what="the restarted sum-0 holding its four runs again")
    finally:
        during = scraper.stop()
    assert sup.workers()["sum-0"] != dead
    assert value(after, "everystep_worker_pool_size", runner="sum-0") == 4  # not the dead one's 4 added in
    assert value(after, "everystep_worker_claims_total", runner="sum-0") == 8  # 4 claimed, 4 taken back
    assert value(after, "everystep_worker_claims_total", runner="sum-1") == 4
    assert value(after, "everystep_supervisor_child_restarts_total", child="sum-0") == 1
    assert value(after, "everystep_supervisor_child_restarts_total", child="sum-1") == 0
    assert children_gauge(after) == {"worker": 2, "http": 1, "maintenance": 1}
    assert not list(sup.metrics_folder.glob(f"*_{dead}.db"))

    # No scrape taken meanwhile counted the dead incarnation twice, or lost it.
    assert len(during) >= 2
    claims = [total(s, "everystep_worker_claims_total") for s in during]
    assert all(a <= b for a, b in zip(claims, claims[1:])), claims
    assert min(claims) >= 8
    assert {value(s, "everystep_worker_pool_size", runner="sum-0") for s in during} <= {None, 4}
    assert {value(s, "everystep_worker_inflight", runner="sum-0") for s in during} <= {None, 0, 1, 2, 3, 4}

    release.touch()
    wait_for(lambda: status_counts(db.url) == {"completed": 8}, timeout=30, what="every run completed")
    done = scrape_when(sup, lambda s: total(s, "everystep_worker_inflight") == 0, what="nothing in flight")
    assert total(done, "everystep_workflow_runs_total", status="completed") == 8
    assert total(done, "everystep_workflow_runs_total") == 8

    # A worker killed when idle: its completed runs stay counted.
    idle = sup.workers()["sum-1"]
    sup.kill_worker("sum-1")
    final = scrape_when(sup, lambda s: value(s, "everystep_supervisor_child_restarts_total", child="sum-1") == 1
                        and value(s, "everystep_worker_pool_size", runner="sum-1") == 4,
                        what="sum-1 counted as restarted and running")
    assert total(final, "everystep_workflow_runs_total", status="completed") == 8
    assert value(final, "everystep_worker_claims_total", runner="sum-1") == 4
    assert total(final, "everystep_step_runs_total", status="done") == 8
    assert not list(sup.metrics_folder.glob(f"*_{idle}.db"))


def test_a_retired_worker_takes_its_live_gauges_and_leaves_its_counts(db, supervisors, marks, tmp_path):
    sup = supervisors(config(db.url, "ret"))
    sup.wait_workers({"ret-0", "ret-1"})
    release = tmp_path / "release"
    schedule_runs(db.url, workflows.held, [(marks, str(release))] * 8)
    wait_for(lambda: held_by(db.url) == {"ret-0": 4, "ret-1": 4}, what="four runs held by each worker")
    release.touch()
    wait_for(lambda: status_counts(db.url) == {"completed": 8}, timeout=30, what="every run completed")

    sup.signal(signal.SIGTTOU)
    sup.wait_workers({"ret-0"})
    found = scrape_when(sup, lambda s: value(s, "everystep_supervisor_children", role="worker") == 1,
                        what="one worker left")
    for gone in ("everystep_worker_pool_size", "everystep_worker_inflight", "everystep_worker_started_at_seconds"):
        assert value(found, gone, runner="ret-1") is None, gone
        assert value(found, gone, runner="ret-0") is not None, gone
    assert value(found, "everystep_worker_claims_total", runner="ret-1") == 4
    assert total(found, "everystep_workflow_runs_total", status="completed") == 8
    assert value(found, "everystep_supervisor_child_restarts_total", child="ret-1") == 0  # retired, not restarted
    assert probe(sup, "/readyz") == (200, "ok\n")  # ret-1 is no longer expected to hold its lock

    sup.signal(signal.SIGTTIN)
    sup.wait_workers({"ret-0", "ret-1"})
    found = scrape_when(sup, lambda s: value(s, "everystep_worker_pool_size", runner="ret-1") == 4
                        and value(s, "everystep_supervisor_children", role="worker") == 2, what="ret-1 back")
    assert value(found, "everystep_worker_claims_total", runner="ret-1") == 4
    assert value(found, "everystep_supervisor_child_restarts_total", child="ret-1") == 0


# ---------------------------------------------------------------- the supervisor's own metrics

def test_restarts_of_every_kind_of_child_are_counted(db, supervisors):
    sup = supervisors(config(db.url, "rst"))
    sup.wait_workers({"rst-0", "rst-1"})
    found = scrape_when(sup, lambda s: children_gauge(s) == {"worker": 2, "http": 1, "maintenance": 1},
                        what="every child running")
    for child in ("rst-0", "rst-1", "http", "maintenance"):
        assert value(found, "everystep_supervisor_child_restarts_total", child=child) == 0, child

    for title in ("maintenance", "http"):
        old = pid_of(sup, title)
        os.kill(old, signal.SIGKILL)
        restarted(sup, title, old)
        sup.wait_logged(f"{title} {title} (pid {old}) was killed by signal 9 (SIGKILL) unexpectedly")
    sup.kill_worker("rst-1")

    found = scrape_when(sup, lambda s: value(s, "everystep_supervisor_child_restarts_total", child="rst-1") == 1
                        and children_gauge(s)["worker"] == 2, what="the worker's restart counted")
    assert {child: value(found, "everystep_supervisor_child_restarts_total", child=child)
            for child in ("rst-0", "rst-1", "http", "maintenance")} == {
        "rst-0": 0, "rst-1": 1, "http": 1, "maintenance": 1}
    assert children_gauge(found) == {"worker": 2, "http": 1, "maintenance": 1}


def test_the_metrics_folder_holds_only_live_processes_and_archives_after_many_restarts(db, supervisors, marks):
    sup = supervisors(config(db.url, "many"))
    sup.wait_workers({"many-0", "many-1"})
    restart_workers(sup, db.url, marks, 12)

    found = scrape_when(sup, lambda s: total(s, "everystep_supervisor_child_restarts_total") == 12
                        and total(s, "everystep_worker_pool_size") == 8, what="twelve restarts, two workers")
    assert total(found, "everystep_workflow_runs_total", status="completed") == 12
    assert total(found, "everystep_worker_claims_total") == 12
    assert "crashes in a row" not in sup.output()  # every one restarted at once

    live = {sup.pid, *children_of(sup.pid)}
    files = {path.name for path in sup.metrics_folder.glob("*.db")}
    owners = {name.rsplit("_", 1)[1].removesuffix(".db") for name in files}
    assert owners <= {"archive", *map(str, live)}, (files, live)
    kinds = {"counter", "histogram", "gauge_livesum", "gauge_livemax"}
    assert len(files) <= len(kinds) * len(live) + len(kinds), files


# ---------------------------------------------------------------- the queue, from the database

def test_queue_gauges_match_the_tables(db, supervisors, marks, tmp_path):
    sup = supervisors(config(db.url, "queue", workers={"threads": 2}))
    sup.wait_workers({"queue-0", "queue-1"})
    release = tmp_path / "release"
    schedule_runs(db.url, workflows.held, [(marks, str(release))] * 4)
    wait_for(lambda: held_by(db.url) == {"queue-0": 2, "queue-1": 2}, what="every slot busy")
    waiting = schedule_runs(db.url, workflows.held, [(marks, str(release))] * 3)  # no slot left for these
    with db.connect() as conn:
        conn.execute("UPDATE everystep_workflow SET created_at = created_at - interval '90 seconds',"
                     " due_at = due_at - interval '90 seconds' WHERE id = %s", (waiting[1].id,))  # as if scheduled then
    insert_runs(db, "blocked", 2)
    insert_runs(db, "completed", 5, age_seconds=600)
    insert_runs(db, "failed", 1, age_seconds=900)

    def oldest_pending_age() -> float:
        return db.value("SELECT extract(epoch FROM now() - min(created_at)) FROM everystep_workflow"
                        " WHERE status = 'scheduled'")

    assert status_counts(db.url) == {"scheduled": 3, "running": 4, "blocked": 2, "completed": 5, "failed": 1}
    low = float(oldest_pending_age())
    found = scrape(sup)
    high = float(oldest_pending_age())
    assert value(found, "everystep_database_up") == 1
    assert value(found, "everystep_workflows_pending") == 3
    assert value(found, "everystep_workflows_running") == 4
    assert value(found, "everystep_workflows_blocked") == 2
    assert 90 <= low <= value(found, "everystep_workflows_oldest_pending_age_seconds") <= high

    release.touch()
    wait_for(lambda: status_counts(db.url) == {"completed": 12, "blocked": 2, "failed": 1}, timeout=30,
             what="the held and the waiting runs completed")
    found = scrape(sup)
    assert value(found, "everystep_workflows_pending") == 0
    assert value(found, "everystep_workflows_running") == 0
    assert value(found, "everystep_workflows_blocked") == 2
    assert value(found, "everystep_workflows_oldest_pending_age_seconds") == 0


def test_no_label_value_is_a_run_id(db, supervisors):
    sup = supervisors(config(db.url, "lbl", imports=["tests.apps.obs_workflows"]))
    sup.wait_workers({"lbl-0", "lbl-1"})
    runs = schedule_runs(db.url, obs_workflows.place_order, obs_workload.ORDERS)
    wait_for(lambda: status_counts(db.url) == {"completed": 3, "failed": 1, "stopped": 1}, timeout=30,
             what="every order ended")
    # The run ids are in the results, so they would be at hand for a careless label.
    assert db.value("SELECT count(*) FROM everystep_workflow WHERE result::text ~ 'r-[0-9a-f]{8}-'") == 3

    flow = "tests.apps.obs_workflows.place_order"
    status, body = get(base(sup) + "/metrics")
    assert status == 200
    found = samples(body)
    label_values = {v for (_, labels) in found for _, v in labels}
    assert not [v for v in label_values if UUID_SHAPED.search(v)]
    assert not UUID_SHAPED.search(body)
    assert {flow, "tests.apps.obs_workflows.notify", "lbl-0", "lbl-1", "completed", "worker"} <= label_values
    assert total(found, "everystep_workflow_runs_total", workflow=flow) == len(runs)


# ---------------------------------------------------------------- liveness and readiness

def test_healthz_stays_up_across_restarts_and_fails_when_a_dead_child_is_left_unreaped(db, supervisors):
    sup = supervisors(config(db.url, "hz"))
    sup.wait_workers({"hz-0", "hz-1"})
    wait_for(lambda: probe(sup, "/healthz") == (200, "ok\n"), what="/healthz 200")

    answers: list[tuple[int, str]] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            answers.append(probe(sup, "/healthz"))

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        for _ in range(3):  # the second and third come back after a back-off, unlisted meanwhile
            sup.kill_worker("hz-0")
    finally:
        stop.set()
        poller.join(30)
    assert answers and set(answers) == {(200, "ok\n")}, {a for a in answers if a[0] != 200}

    # A supervisor that does not reap its dead child (stopped here) is not alive.
    victim = sup.workers()["hz-1"]
    os.kill(sup.pid, signal.SIGSTOP)
    try:
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: process_state(victim) == "Z", what="hz-1 dead and not reaped")
        seen = time.monotonic()
        assert probe(sup, "/healthz") == (200, "ok\n")  # its supervisor may be about to reap it
        status, body = wait_for(lambda: (r := probe(sup, "/healthz"))[0] == 503 and r,
                                timeout=http_server.UNREAPED_GRACE_SECONDS + 10, what="/healthz 503")
        assert time.monotonic() - seen >= http_server.UNREAPED_GRACE_SECONDS
        assert body.startswith(f"worker hz-1 (pid {victim}) is not running"), body
    finally:
        os.kill(sup.pid, signal.SIGCONT)
    wait_for(lambda: sup.workers().get("hz-1") not in (None, victim), timeout=30, what="hz-1 restarted")
    wait_for(lambda: probe(sup, "/healthz") == (200, "ok\n"), what="/healthz 200 again")


def test_readyz_fails_while_a_worker_cannot_take_its_lock(db, supervisors, tmp_path):
    squatters = [WorkerProcess(db.url, "rz-0", tmp_path / "logs"), WorkerProcess(db.url, "rz-2", tmp_path / "logs")]
    try:
        for squatter in squatters:
            squatter.wait_logged(f"holding the lock of {squatter.name}")
        sup = supervisors(config(db.url, "rz"))
        sup.wait_workers({"rz-0", "rz-1"})
        sup.wait_logged("lock of rz-0 is held by another live process; waiting")
        wait_for(lambda: probe(sup, "/readyz") == (503, "workers not holding their lock: rz-0\n"),
                 what="/readyz naming rz-0")
        assert probe(sup, "/healthz") == (200, "ok\n")  # waiting for a lock is alive

        squatters[0].signal(signal.SIGTERM)
        assert squatters[0].wait() == 0
        wait_for(lambda: probe(sup, "/readyz") == (200, "ok\n"), what="/readyz 200 once rz-0 holds its lock")

        sup.signal(signal.SIGTTIN)  # rz-2: its lock is held by the other process
        sup.wait_workers({"rz-0", "rz-1", "rz-2"})
        wait_for(lambda: probe(sup, "/readyz") == (503, "workers not holding their lock: rz-2\n"),
                 what="/readyz naming rz-2")
        sup.signal(signal.SIGTTOU)  # rz-2 retired: no longer expected
        sup.wait_workers({"rz-0", "rz-1"})
        wait_for(lambda: probe(sup, "/readyz") == (200, "ok\n"), what="/readyz 200 without rz-2")
    finally:
        for squatter in squatters:
            squatter.close()


def timed_probe(sup: SupervisorProcess, path: str) -> tuple[int, str]:
    started = time.monotonic()
    answer = probe(sup, path)
    assert time.monotonic() - started < PROMPTLY, f"{path} took {time.monotonic() - started:.1f} s"
    return answer


def test_readyz_answers_503_fast_while_the_database_is_down(private_server, supervisors, marks):
    sup = supervisors(config(private_server.url, "pg", recovery={"grace": 10}))
    sup.wait_workers({"pg-0", "pg-1"})
    wait_for(lambda: probe(sup, "/readyz") == (200, "ok\n"), timeout=30, what="/readyz 200")

    private_server.stop()
    status, body = wait_for(lambda: (r := timed_probe(sup, "/readyz"))[0] == 503 and r, timeout=30,
                            what="/readyz 503")
    assert body.startswith("the database does not answer"), body
    for _ in range(3):
        assert timed_probe(sup, "/readyz")[0] == 503
        assert timed_probe(sup, "/healthz") == (200, "ok\n")  # liveness never asks the database
    started = time.monotonic()
    found = scrape(sup)
    assert time.monotonic() - started < PROMPTLY
    assert value(found, "everystep_database_up") == 0
    assert value(found, "everystep_workflows_pending") is None
    assert total(found, "everystep_worker_pool_size") == 8  # the children's metrics still

    private_server.start()
    wait_for(lambda: timed_probe(sup, "/readyz") == (200, "ok\n"), timeout=60, what="/readyz 200 again")
    (run,) = schedule_runs(private_server.url, workflows.quick, [(marks,)])
    wait_for(lambda: status_counts(private_server.url) == {"completed": 1}, timeout=30, what="a new run completed")
    found = scrape(sup)
    assert value(found, "everystep_database_up") == 1
    assert total(found, "everystep_supervisor_child_restarts_total") == 0  # nobody exited over it
    assert {p for r, _, p in workflows.marks_of(marks) if r == str(run.id)} <= set(sup.workers().values())


# ---------------------------------------------------------------- a real Prometheus

@needs_prometheus("prometheus")
def test_a_real_prometheus_scrapes_the_supervisor_and_sees_a_restart(db, supervisors, tmp_path):
    sup = supervisors(config(db.url, "prom"))
    sup.wait_workers({"prom-0", "prom-1"})
    target = f"127.0.0.1:{sup.port}"
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "everystep", "static_configs": [{"targets": [target]}]}],
    }))
    prometheus = Prometheus(tmp_path / "prometheus.yml", tmp_path / "tsdb", tmp_path / "prometheus.log")

    def one(promql: str) -> float | None:
        found = prometheus.query(promql)
        return next(iter(found.values())) if len(found) == 1 else None

    try:
        labels = {"job": "everystep", "instance": target}
        wait_for(lambda: prometheus.query("everystep_supervisor_children") == {
            frozenset({"__name__": "everystep_supervisor_children", "role": role, **labels}.items()): n
            for role, n in (("worker", 2), ("http", 1), ("maintenance", 1))}, timeout=30, what="the children")
        wait_for(lambda: one("sum(everystep_worker_pool_size)") == 8, timeout=30, what="eight run slots")
        wait_for(lambda: one('count_over_time(everystep_supervisor_child_restarts_total{child="prom-0"}[1m])')
                 and one('everystep_supervisor_child_restarts_total{child="prom-0"}') == 0,
                 timeout=30, what="the restart counter at 0")

        started_at = one('everystep_worker_started_at_seconds{runner="prom-0"}')
        sup.kill_worker("prom-0")
        # increase() sees the restart only because the series was there, at 0, before it.
        wait_for(lambda: (one('increase(everystep_supervisor_child_restarts_total{child="prom-0"}[1m])') or 0) > 0,
                 timeout=30, what="increase() of the restarts of prom-0")
        assert one('everystep_supervisor_child_restarts_total{child="prom-1"}') == 0
        wait_for(lambda: one("sum(everystep_worker_pool_size)") == 8
                 and one("count(everystep_worker_pool_size)") == 2
                 and (one('everystep_worker_started_at_seconds{runner="prom-0"}') or 0) > started_at,
                 timeout=30, what="the new prom-0 scraped, with its own slots only")
    finally:
        prometheus.stop()
