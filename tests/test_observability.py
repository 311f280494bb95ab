"""The HTTP child (/metrics, /healthz, /readyz), the multiprocess metrics
folder, the alert rules and the scrape config — with real processes, the real
PostgreSQL and a real Prometheus server."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psycopg
import pytest
import yaml

import everystep
import everystep.db
from supervisor import http_server, metrics_dir, state_file
from tests.support.processes import ROOT, wait_for
from tests.support.scraping import (
    PROMPTLY,
    UUID_SHAPED,
    Prometheus,
    binary,
    get,
    insert_runs,
    needs_prometheus,
    samples,
    value,
)

RULES = ROOT / "config" / "prometheus" / "everystep.rules.yml"
SCRAPE_CONFIG = ROOT / "config" / "prometheus" / "scrape.yml"
UNREACHABLE_DATABASE = "host=127.0.0.1 port=1 user=postgres dbname=test"


# ---------------------------------------------------------------- helpers

class Folders:
    def __init__(self, tmp_path: Path):
        self.metrics = tmp_path / "metrics"
        self.runtime = tmp_path / "run"
        self.logs = tmp_path / "logs"
        metrics_dir.prepare(self.metrics)
        self.runtime.mkdir()
        self.logs.mkdir()
        self.env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(self.metrics)}


class HttpChild:
    """`serve()` in a process of its own, as the supervisor's HTTP child, on
    a port of its choosing, with a database connection named for it alone."""

    def __init__(self, folders: Folders, database_url: str):
        self.application_name = f"everystep-observer-{uuid.uuid4().hex[:12]}"
        self.log = folders.logs / f"{self.application_name}.log"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.apps.obs_serve", "127.0.0.1", "0", database_url,
             str(folders.runtime), str(folders.metrics), self.application_name],
            cwd=ROOT, env=folders.env, stdout=subprocess.DEVNULL, stderr=self.log.open("w"),
        )
        port = wait_for(self._port, what=f"the HTTP child to bind a port (log: {self.log})")
        self.base = f"http://127.0.0.1:{port}"

    def _port(self) -> int | None:
        assert self.process.poll() is None, f"the HTTP child exited: {self.log.read_text()}"
        bound = re.search(r"serving /metrics, /healthz, /readyz on \S+ port (\d+)", self.log.read_text())
        return int(bound[1]) if bound else None

    @property
    def pid(self) -> int:
        return self.process.pid

    def get(self, path: str) -> tuple[int, str]:
        return get(self.base + path)

    def metrics(self) -> dict:
        status, body = self.get("/metrics")
        assert status == 200, body
        return samples(body)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class MetricsChild:
    """A process that records worker metrics and stays alive (tests/apps/obs_child.py)."""

    def __init__(self, folders: Folders, runner: str, claims: int, completed: int):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.apps.obs_child", runner, str(claims), str(completed)],
            cwd=ROOT, env=folders.env, stdout=subprocess.PIPE, text=True,
        )
        assert self.process.stdout.readline().strip() == "ready"
        self.pid = self.process.pid

    def kill(self, reap: bool = True) -> None:
        self.process.kill()
        if reap:
            self.process.wait()


@pytest.fixture
def folders(tmp_path) -> Folders:
    return Folders(tmp_path)


@pytest.fixture
def start(folders):
    """start.http(database_url) / start.child(runner, claims, completed); all stopped at the end."""
    started: list = []

    class Start:
        @staticmethod
        def http(database_url: str) -> HttpChild:
            started.append(HttpChild(folders, database_url))
            return started[-1]

        @staticmethod
        def child(runner: str, claims: int = 0, completed: int = 0) -> MetricsChild:
            started.append(MetricsChild(folders, runner, claims, completed))
            return started[-1]

    yield Start
    for process in reversed(started):
        if isinstance(process, HttpChild):
            process.stop()
        else:
            process.kill()


# ---------------------------------------------------------------- the metrics folder

def test_counters_add_up_across_children_and_a_dead_childs_counts_stay(db, folders, start):
    server = start.http(db.url)
    first = start.child("web-0-0", claims=3, completed=2)
    second = start.child("web-0-1", claims=4, completed=5)

    scrape = server.metrics()
    assert value(scrape, "everystep_workflow_runs_total", workflow="demo.flow", status="completed") == 7
    assert value(scrape, "everystep_worker_claims_total", runner="web-0-0") == 3
    assert value(scrape, "everystep_worker_claims_total", runner="web-0-1") == 4
    assert value(scrape, "everystep_step_duration_seconds_count", workflow="demo.flow", step="demo.step") == 2
    for runner in ("web-0-0", "web-0-1"):
        assert value(scrape, "everystep_worker_pool_size", runner=runner) == 8
        assert value(scrape, "everystep_worker_inflight", runner=runner) == 2
        assert value(scrape, "everystep_worker_started_at_seconds", runner=runner) > 0

    second.kill()
    metrics_dir.mark_dead(folders.metrics, second.pid)  # as the arbiter does when it reaps a child

    scrape = server.metrics()
    assert value(scrape, "everystep_workflow_runs_total", workflow="demo.flow", status="completed") == 7
    assert value(scrape, "everystep_worker_claims_total", runner="web-0-1") == 4
    assert value(scrape, "everystep_step_duration_seconds_count", workflow="demo.flow", step="demo.step") == 2
    assert value(scrape, "everystep_step_duration_seconds_bucket", workflow="demo.flow", step="demo.step",
                 le="0.025") == 2
    for gone in ("everystep_worker_pool_size", "everystep_worker_inflight", "everystep_worker_started_at_seconds"):
        assert value(scrape, gone, runner="web-0-1") is None, gone
        assert value(scrape, gone, runner="web-0-0") is not None, gone
    assert not list(folders.metrics.glob(f"*_{second.pid}.db"))
    assert list(folders.metrics.glob(f"*_{first.pid}.db"))


def test_archived_gauges_keep_their_multiprocess_mode(db, folders, start):
    server = start.http(db.url)
    children = [start.child(f"web-0-{i}", claims=claims) for i, claims in enumerate((5, 9, 2))]
    for child in children[1:]:
        child.kill()
        metrics_dir.mark_dead(folders.metrics, child.pid)

    scrape = server.metrics()
    assert value(scrape, "test_biggest_batch", runner="all") == 9  # max over live and dead children
    assert value(scrape, "test_batches") == 3  # sum
    assert {p.name for p in folders.metrics.glob("*_archive.db")} == {
        "counter_archive.db", "histogram_archive.db", "gauge_max_archive.db", "gauge_sum_archive.db",
    }


def test_restarts_keep_the_folder_small_and_every_count(db, folders, start):
    server = start.http(db.url)
    restarts, runners = 100, 4  # (each restart archives a dead child: a hundred make the point)
    scrapes: list[dict] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def scrape_meanwhile() -> None:
        try:
            while not done.is_set():
                scrapes.append(server.metrics())
        except BaseException as exc:  # reported by the test below
            errors.append(exc)

    scraper = threading.Thread(target=scrape_meanwhile)
    scraper.start()
    try:
        arbiter = subprocess.Popen(
            [sys.executable, "-m", "tests.apps.obs_restarts", str(folders.metrics), str(restarts), str(runners)],
            cwd=ROOT, env=folders.env,
        )
        assert arbiter.wait(120) == 0
    finally:
        done.set()
        scraper.join()

    assert not errors, f"a scrape failed while children were archived: {errors[0]!r}; log: {server.log.read_text()}"
    final = server.metrics()
    assert value(final, "everystep_workflow_runs_total", workflow="demo.flow", status="completed") == restarts
    assert value(final, "everystep_step_runs_total", workflow="demo.flow", step="demo.step", status="done") == restarts
    assert value(final, "everystep_step_duration_seconds_count", workflow="demo.flow", step="demo.step") == restarts
    for i in range(runners):
        assert value(final, "everystep_worker_claims_total", runner=f"web-0-{i}") == restarts / runners
        assert value(final, "everystep_worker_pool_size", runner=f"web-0-{i}") is None
        assert value(final, "everystep_worker_inflight", runner=f"web-0-{i}") is None
    # One archive per kind, and the files of the two processes that imported
    # everystep.metrics without being restarted (its unlabelled counters).
    files = {p.name for p in folders.metrics.glob("*.db")}
    assert {"counter_archive.db", "histogram_archive.db"} <= files
    assert files <= {"counter_archive.db", "histogram_archive.db", f"counter_{arbiter.pid}.db",
                     f"counter_{server.pid}.db"}, files

    # Scrapes taken while children were archived never counted one twice nor
    # lost one: the total only grows.
    seen = [value(s, "everystep_workflow_runs_total", workflow="demo.flow", status="completed") or 0 for s in scrapes]
    assert len(seen) > 5
    assert all(a <= b for a, b in zip(seen, seen[1:])), seen
    assert max(seen) <= restarts


def test_prepare_empties_only_metrics_files(tmp_path):
    folder = tmp_path / "metrics"
    metrics_dir.prepare(folder)
    assert folder.is_dir() and (folder.stat().st_mode & 0o777) == 0o700
    for name in ("counter_12.db", "gauge_livesum_12.db", "counter_archive.db", ".counter_archive.db.tmp", "notes.txt"):
        (folder / name).write_text("x")
    metrics_dir.prepare(folder)
    assert [p.name for p in folder.iterdir()] == ["notes.txt"]


# ---------------------------------------------------------------- queue gauges

def test_queue_gauges_match_the_tables(db, folders, start):
    insert_runs(db, "scheduled", 2, age_seconds=5)
    insert_runs(db, "scheduled", 1, age_seconds=90)
    insert_runs(db, "running", 2, claimed_by="web-0-0")
    insert_runs(db, "blocked", 1)
    insert_runs(db, "completed", 4, age_seconds=600)
    insert_runs(db, "failed", 1, age_seconds=600)
    insert_runs(db, "waiting", 3, age_seconds=600)
    with db.connect() as conn:  # two not due for an hour; one due 30 s ago (pending since then)
        conn.execute("UPDATE everystep_workflow SET due_at = now() + CASE WHEN id = (SELECT min(id::text)::uuid"
                     " FROM everystep_workflow WHERE status = 'waiting') THEN interval '-30 s' ELSE interval '1 h' END"
                     " WHERE status = 'waiting'")
    server = start.http(db.url)

    scrape = server.metrics()
    assert value(scrape, "everystep_database_up") == 1
    assert value(scrape, "everystep_workflows_pending") == 4
    assert value(scrape, "everystep_workflows_waiting") == 2
    assert value(scrape, "everystep_workflows_running") == 2
    assert value(scrape, "everystep_workflows_blocked") == 1
    assert 90 <= value(scrape, "everystep_workflows_oldest_pending_age_seconds") < 150
    assert value(scrape, "everystep_schedules_auto_paused") == 0

    with db.connect() as conn:
        conn.execute("UPDATE everystep_workflow SET status = 'running', claimed_by = 'web-0-1'"
                     " WHERE status = 'scheduled'")
    scrape = server.metrics()
    assert value(scrape, "everystep_workflows_pending") == 1
    assert value(scrape, "everystep_workflows_running") == 5
    assert 30 <= value(scrape, "everystep_workflows_oldest_pending_age_seconds") < 90

    with db.connect() as conn, everystep.transaction(conn):
        everystep.schedules.put("sick", "tests.apps.workflows.quick", ["/tmp"], cron="@daily")
        everystep.schedules.put("resting", "tests.apps.workflows.quick", ["/tmp"], cron="@daily", paused=True)
        everystep.db.set_schedule_paused(conn, "sick", True, None, "auto-paused: its last 3 runs failed")
    assert value(server.metrics(), "everystep_schedules_auto_paused") == 1  # not the one paused by hand


def serving_pending_runs(db, start, count: int) -> HttpChild:
    """An HTTP child on db that has seen `count` pending runs."""
    insert_runs(db, "scheduled", count)
    server = start.http(db.url)
    scrape = server.metrics()
    assert (value(scrape, "everystep_database_up"), value(scrape, "everystep_workflows_pending")) == (1, count)
    return server


def test_queue_gauges_come_back_after_the_connection_is_dropped(db, folders, start):
    server = serving_pending_runs(db, start, 2)

    # What a database restart does to the kept connection.
    cut = db.value("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = %s",
                   (server.application_name,))
    assert cut == 1
    insert_runs(db, "scheduled", 1)
    scrape = server.metrics()
    assert value(scrape, "everystep_database_up") == 1
    assert value(scrape, "everystep_workflows_pending") == 3


def test_a_query_stuck_on_a_lock_is_cut_short(db, folders, start):
    server = serving_pending_runs(db, start, 1)

    with db.connect() as locker, locker.transaction():
        locker.execute("LOCK TABLE everystep_workflow IN ACCESS EXCLUSIVE MODE")
        started = time.monotonic()
        scrape = server.metrics()
        elapsed = time.monotonic() - started
        assert value(scrape, "everystep_database_up") == 0
        assert value(scrape, "everystep_workflows_pending") is None
        assert elapsed < PROMPTLY, elapsed
    scrape = server.metrics()  # the same connection, still good after a statement timeout
    assert value(scrape, "everystep_database_up") == 1
    assert value(scrape, "everystep_workflows_pending") == 1


def test_an_unreachable_database_answers_fast_and_does_not_touch_liveness(folders, start):
    child = start.child("web-0-0", claims=1)
    server = start.http(UNREACHABLE_DATABASE)
    state_file.write_state(folders.runtime, os.getpid(),
                           [("worker", "web-0-0", child.pid), ("http", "http", server.pid)], ["web-0-0"], ["web-0-0"])

    started = time.monotonic()
    status, body = server.get("/readyz")
    assert time.monotonic() - started < PROMPTLY
    assert status == 503 and "database" in body, body

    started = time.monotonic()
    scrape = server.metrics()
    assert time.monotonic() - started < PROMPTLY
    assert value(scrape, "everystep_database_up") == 0
    assert value(scrape, "everystep_workflows_pending") is None
    assert value(scrape, "everystep_worker_claims_total", runner="web-0-0") == 1  # the children's metrics still

    assert server.get("/healthz") == (200, "ok\n")


def test_a_database_that_never_answers_does_not_hang_a_scrape(folders, start):
    # Accepts connections and says nothing: a server that froze, a black hole.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        port = silent.getsockname()[1]
        server = start.http(f"host=127.0.0.1 port={port} user=postgres dbname=test")
        for _ in range(2):
            started = time.monotonic()
            scrape = server.metrics()
            assert time.monotonic() - started < PROMPTLY
            assert value(scrape, "everystep_database_up") == 0


# ---------------------------------------------------------------- labels

def test_label_values_never_hold_run_ids(db, folders, start, server_url):
    result = subprocess.run(
        [sys.executable, "-m", "tests.apps.obs_workload", server_url, db.schema],
        cwd=ROOT, env=folders.env, check=True, capture_output=True, text=True, timeout=120,
    )
    ended = json.loads(result.stdout.strip().splitlines()[-1])
    assert ended == {"completed": 3, "failed": 1, "stopped": 1}
    # The run ids are in the results, so they would be at hand for a careless label.
    assert db.value("SELECT count(*) FROM everystep_workflow WHERE result::text ~ 'r-[0-9a-f]{8}-'") == 3

    server = start.http(db.url)
    status, body = server.get("/metrics")
    assert status == 200
    scrape = samples(body)
    flow = "tests.apps.obs_workflows.place_order"
    assert value(scrape, "everystep_workflow_runs_total", workflow=flow, status="completed") == 3
    assert value(scrape, "everystep_workflow_runs_total", workflow=flow, status="stopped") == 1
    assert value(scrape, "everystep_step_runs_total", workflow=flow, step="tests.apps.obs_workflows.notify",
                 status="done") == 7  # 3 x (mail, sms) + 1 refund
    label_values = {v for (_, labels) in scrape for _, v in labels}
    assert label_values, "no labels at all"
    assert not [v for v in label_values if UUID_SHAPED.search(v)]
    assert not UUID_SHAPED.search(body)


# ---------------------------------------------------------------- health and readiness

def test_healthz_follows_the_supervisor_and_its_children(db, folders, start):
    server = start.http(db.url)
    status, body = server.get("/healthz")
    assert status == 503 and "not written its state" in body

    first = start.child("web-0-0")
    second = start.child("web-0-1")
    children = [("worker", "web-0-0", first.pid), ("worker", "web-0-1", second.pid), ("http", "http", server.pid)]
    workers = ["web-0-0", "web-0-1"]
    state_file.write_state(folders.runtime, os.getpid(), children, workers, workers)
    assert server.get("/healthz") == (200, "ok\n")

    # Dead, not reaped yet: a zombie is not alive. The supervisor gets a grace
    # to reap and replace it, counted from the first probe that sees it dead.
    second.kill(reap=False)
    wait_for(lambda: Path(f"/proc/{second.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z",
             what="a zombie")
    seen = time.monotonic()
    assert server.get("/healthz") == (200, "ok\n")
    status, body = wait_for(lambda: (r := server.get("/healthz"))[0] == 503 and r,
                            timeout=http_server.UNREAPED_GRACE_SECONDS + 10, what="/healthz to fail")
    assert time.monotonic() - seen >= http_server.UNREAPED_GRACE_SECONDS
    assert body == (f"worker web-0-1 (pid {second.pid}) is not running, and the supervisor has not replaced it"
                    f" in {http_server.UNREAPED_GRACE_SECONDS:g} s\n")
    second.process.wait()
    assert server.get("/healthz")[0] == 503

    # The arbiter lists the children it has; while it backs off, the dead one is not listed.
    state_file.write_state(folders.runtime, os.getpid(), [c for c in children if c[1] != "web-0-1"], workers, workers)
    assert server.get("/healthz") == (200, "ok\n")

    # A listed pid that now belongs to another process (this test's parent).
    state_file.write_state(folders.runtime, os.getpid(), [("worker", "web-0-9", os.getppid())], [], [])
    status, body = wait_for(lambda: (r := server.get("/healthz"))[0] == 503 and r,
                            timeout=http_server.UNREAPED_GRACE_SECONDS + 10, what="/healthz to fail")
    assert body.startswith(f"worker web-0-9 (pid {os.getppid()}) is not running,"), body

    # A state file left by a supervisor that is not this child's parent.
    state_file.write_state(folders.runtime, first.pid, [], [], [])
    status, body = server.get("/healthz")
    assert status == 503 and f"supervisor (pid {first.pid}) is not this process's parent" in body


def test_readyz_follows_the_workers_locks(db, folders, start):
    server = start.http(db.url)
    workers = ["web-0-0", "web-0-1"]
    state_file.write_state(folders.runtime, os.getpid(), [("http", "http", server.pid)], workers, workers)
    status, body = server.get("/readyz")
    assert status == 503 and "web-0-0, web-0-1" in body, body

    with db.connect() as holder:
        assert everystep.db.try_lock(holder, "web-0-0") and everystep.db.try_lock(holder, "web-0-1")
        assert server.get("/readyz") == (200, "ok\n")

        # Held, but not by the supervisor's worker: it did not say it holds it
        # (it waits for it while another live process of that name holds it).
        state_file.write_state(folders.runtime, os.getpid(), [("http", "http", server.pid)], workers, ["web-0-1"])
        assert server.get("/readyz") == (503, "workers not holding their lock: web-0-0\n")
        state_file.write_state(folders.runtime, os.getpid(), [("http", "http", server.pid)], workers, workers)

        everystep.db.unlock(holder, "web-0-1")
        status, body = server.get("/readyz")
        assert status == 503 and body == "workers not holding their lock: web-0-1\n"

    # The same names locked in another schema (another deployment) do not count.
    with psycopg.connect(db.url.replace(db.schema, "public"), autocommit=True) as elsewhere:
        assert everystep.db.try_lock(elsewhere, "web-0-0") and everystep.db.try_lock(elsewhere, "web-0-1")
        assert server.get("/readyz")[0] == 503


def test_unknown_paths_are_404_and_sigterm_stops_the_server(db, folders, start):
    server = start.http(db.url)
    assert server.get("/")[0] == 404
    assert server.get("/metrics/extra")[0] == 404
    assert server.get("/metrics?name[]=x")[0] == 200

    started = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(10) == 0
    assert time.monotonic() - started < PROMPTLY
    assert "SIGTERM received" in server.log.read_text()


def test_write_state_replaces_the_file_whole(tmp_path):
    state_file.write_state(tmp_path, 10, [("worker", "a-0", 11), ("maintenance", "maintenance", 12)], ["a-0"], ["a-0"])
    state_file.write_state(tmp_path, 10, [("worker", "a-0", 13)], ["a-0", "a-1"], ["a-1"])
    assert state_file.read_state(tmp_path) == state_file.SupervisorState(
        10, [state_file.Child("worker", "a-0", 13)], ["a-0", "a-1"], ["a-1"])
    assert [p.name for p in tmp_path.iterdir()] == [state_file.STATE_FILE]
    with pytest.raises(ValueError, match="role 'web'"):
        state_file.write_state(tmp_path, 10, [("web", "a-0", 11)], [], [])


# ---------------------------------------------------------------- Prometheus

@needs_prometheus("promtool")
def test_alert_rules_are_valid_and_fire_when_they_should():
    promtool = binary("promtool")
    check = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    cases = ROOT / "tests" / "prometheus" / "everystep.rules.test.yml"
    unit = subprocess.run([promtool, "test", "rules", str(cases)], capture_output=True, text=True)
    assert unit.returncode == 0, unit.stdout + unit.stderr


def kubernetes_job_as_file_sd(config: dict, targets_file: Path) -> dict:
    """The scrape config with its Kubernetes discovery replaced by a file of
    targets carrying the same meta labels: Debian's Prometheus is built
    without Kubernetes discovery, and the relabelling is what matters here."""
    for job in config["scrape_configs"]:
        if "kubernetes_sd_configs" in job:
            del job["kubernetes_sd_configs"]
            job["file_sd_configs"] = [{"files": [str(targets_file)], "refresh_interval": "1s"}]
    return config


@needs_prometheus("promtool")
def test_scrape_config_is_valid(tmp_path):
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert "static_configs" in jobs["everystep"]
    assert jobs["everystep-pods"]["kubernetes_sd_configs"] == [{"role": "pod"}]
    config["rule_files"] = [str(RULES)]
    (tmp_path / "targets.json").write_text("[]")
    checked = tmp_path / "prometheus.yml"
    checked.write_text(yaml.safe_dump(kubernetes_job_as_file_sd(config, tmp_path / "targets.json")))
    result = subprocess.run([binary("promtool"), "check", "config", str(checked)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_prometheus("prometheus")
def test_a_real_prometheus_scrapes_the_server(db, folders, start, tmp_path):
    insert_runs(db, "scheduled", 4, age_seconds=30)
    insert_runs(db, "blocked", 1)
    start.child("web-0-0", claims=3, completed=2)
    server = start.http(db.url)
    port = server.base.rsplit(":", 1)[1]

    # The example config, pointed at this server: the static job, and the
    # Kubernetes job with pods described by a file (see kubernetes_job_as_file_sd).
    pods = [
        {"targets": [f"127.0.0.1:{port}"], "labels": {
            "__meta_kubernetes_pod_annotation_everystep_io_scrape": "true",
            "__meta_kubernetes_pod_container_port_name": "metrics",
            "__meta_kubernetes_namespace": "shop", "__meta_kubernetes_pod_name": "web-0"}},
        {"targets": ["127.0.0.1:1"], "labels": {  # not annotated
            "__meta_kubernetes_pod_container_port_name": "metrics",
            "__meta_kubernetes_namespace": "shop", "__meta_kubernetes_pod_name": "db-0"}},
        {"targets": ["127.0.0.1:2"], "labels": {  # annotated, another port
            "__meta_kubernetes_pod_annotation_everystep_io_scrape": "true",
            "__meta_kubernetes_pod_container_port_name": "http",
            "__meta_kubernetes_namespace": "shop", "__meta_kubernetes_pod_name": "web-0"}},
    ]
    (tmp_path / "pods.json").write_text(json.dumps(pods))
    config = kubernetes_job_as_file_sd(yaml.safe_load(SCRAPE_CONFIG.read_text()), tmp_path / "pods.json")
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(RULES)]
    next(job for job in config["scrape_configs"] if job["job_name"] == "everystep")["static_configs"] = [
        {"targets": [f"127.0.0.1:{port}"]}
    ]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))

    prometheus = Prometheus(tmp_path / "prometheus.yml", tmp_path / "tsdb", folders.logs / "prometheus.log")
    try:
        claims = wait_for(lambda: (found := prometheus.query('everystep_worker_claims_total{runner="web-0-0"}'))
                          and len(found) == 2 and found, timeout=30, what="the claims series of both jobs")
        assert {dict(labels)["job"]: v for labels, v in claims.items()} == {"everystep": 3, "everystep-pods": 3}
        pending = prometheus.query('everystep_workflows_pending{job="everystep-pods"}')
        assert pending == {frozenset({"__name__": "everystep_workflows_pending", "job": "everystep-pods",
                                      "instance": f"127.0.0.1:{port}", "namespace": "shop", "pod": "web-0"}.items()): 4}

        targets = prometheus.api("targets")["activeTargets"]
        assert sorted((t["labels"]["job"], t["scrapeUrl"]) for t in targets) == [
            ("everystep", f"http://127.0.0.1:{port}/metrics"), ("everystep-pods", f"http://127.0.0.1:{port}/metrics"),
        ]

        # The rules run on what was scraped: the blocked run is noticed (the
        # alert waits out its `for`), the worker's slots keep "no workers" quiet.
        expected = {"EverystepRunsBlocked": "pending", "EverystepNoWorkers": "inactive",
                    "EverystepDatabaseDown": "inactive", "EverystepPendingTooOld": "inactive",
                    "EverystepScheduleAutoPaused": "inactive"}

        def rules_as_expected() -> list | None:
            rules = [r for g in prometheus.api("rules")["groups"] for r in g["rules"]]
            states = {r["name"]: r["state"] for r in rules}
            return rules if all(states.get(name) == state for name, state in expected.items()) else None

        rules = wait_for(rules_as_expected, timeout=30, what=f"the alert rules to reach {expected}")
        assert {r["name"] for r in rules} == {
            "EverystepRunsBlocked", "EverystepPendingTooOld", "EverystepChildCrashLooping", "EverystepNoWorkers",
            "EverystepDatabaseDown", "EverystepClaimsLost", "EverystepPoisonedRuns", "EverystepRunsUnserved",
            "EverystepScheduleAutoPaused", "EverystepStepRetrying", "EverystepStepThreadsAbandoned",
            "EverystepVacuumHeldBack", "EverystepTableBloat",
        }
        assert all(r["health"] == "ok" for r in rules), rules
    finally:
        prometheus.stop()


# ---------------------------------------------------------------- the tally

def test_observe_all_leaves_a_histogram_as_observe_one_by_one_does():
    """metrics.observe_all changes a histogram's sum and buckets once per
    batch; the exposition must be the one observe() gives, values on a
    bucket's bound and past the last one included."""
    from prometheus_client import CollectorRegistry, Histogram  # noqa: PLC0415

    from everystep import metrics  # noqa: PLC0415

    values = [0.0, 0.001, 0.0010001, 0.004, 0.0025, 0.3, 1, 59.9, 60, 61, 5000, 0.001]
    exposed = []
    for bulk in (False, True):
        registry = CollectorRegistry()
        histogram = Histogram("h_seconds", "h", ["workflow"], registry=registry,
                              buckets=(0.001, 0.0025, 0.005, 0.3, 1, 60))
        child = histogram.labels("w")
        if bulk:
            metrics.observe_all(child, values)
        else:
            for v in values:
                child.observe(v)
        exposed.append({(s.name, tuple(sorted(s.labels.items()))): s.value
                        for family in registry.collect() for s in family.samples if not s.name.endswith("_created")})
    assert exposed[0] == exposed[1]
    assert exposed[1][("h_seconds_count", (("workflow", "w"),))] == len(values)


def test_a_flush_applies_what_many_threads_counted_and_observed_once():
    from prometheus_client import CollectorRegistry, Counter, Histogram  # noqa: PLC0415

    from everystep import metrics  # noqa: PLC0415

    registry = CollectorRegistry()
    counter = Counter("c", "c", ["k"], registry=registry).labels("x")
    histogram = Histogram("d_seconds", "d", ["k"], registry=registry).labels("x")
    tally = metrics.Tally()

    def add() -> None:
        for _ in range(1000):
            tally.count(counter)
            tally.observe(histogram, 0.5)
            tally.count(counter, 2)

    threads = [threading.Thread(target=add) for _ in range(8)]
    for thread in threads:
        thread.start()
    tally.flush()  # while they add: what comes after waits for the next flush
    for thread in threads:
        thread.join()
    tally.flush()
    tally.flush()  # nothing left: changes nothing
    assert registry.get_sample_value("c_total", {"k": "x"}) == 8 * 3000
    assert registry.get_sample_value("d_seconds_count", {"k": "x"}) == 8000
    assert registry.get_sample_value("d_seconds_sum", {"k": "x"}) == 4000


def test_a_forked_child_does_not_apply_its_parents_figures():
    from everystep import metrics  # noqa: PLC0415

    tally = metrics.Tally()
    tally.count(object())  # (never applied: the child must not even try)
    pid = os.fork()
    if pid == 0:
        os._exit(0 if not tally._counted and not tally._observed else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert len(tally._counted) == 1
