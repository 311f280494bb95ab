"""The UI's API against a real `everystep ui` process and a real database:
lists, filters, search and paging, a run's detail, actions with their
CSRF and token checks, the audit trail, the bind rule, the live hub."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
import uuid

import pytest

import everystep.db
from everystep.ui.core import Console
from tests.apps import ui_workflows
from tests.support.processes import ROOT
from tests.support.ui_process import Client, UiProcess

OPERATOR = "operator-token-0123456789abcdef"
VIEWER = "viewer-token-0123456789abcdef"


@pytest.fixture
def ui(db, tmp_path):
    started = []

    def start(**env) -> str:
        process = UiProcess(db.url, tmp_path / "ui", env=env)
        started.append(process)
        return process.url

    yield start
    for process in started:
        process.close()


def blocked_run(db, order: str = "o-1") -> uuid.UUID:
    """A run of charge_then_ship blocked on its unsafe step 1, as a worker
    leaves it when it finds the step started without an outcome."""
    run = uuid.uuid4()
    db.query("INSERT INTO everystep_workflow (id, name, args, status, claimed_by) VALUES (%s, %s, %s::jsonb,"
             " 'blocked', 'gone-1') RETURNING id",
             (run, "tests.apps.ui_workflows.charge_then_ship", json.dumps([order])))
    db.query("INSERT INTO everystep_step (workflow_id, step_id, name, args, kwargs, status)"
             " VALUES (%s, '1', 'tests.apps.ui_workflows.charge', %s::jsonb, '{}', 'started') RETURNING id",
             (run, json.dumps([order])))
    return run


def test_list_filters_search_and_keyset_paging(db, ui):
    nested = db.schedule_many(ui_workflows.nested, [(n,) for n in range(7)])
    db.run_pending()
    [typed] = db.schedule_many(ui_workflows.typed, [()])
    client = Client(ui())

    status, page = client.get("/api/runs?limit=3")
    assert status == 200 and [r["id"] for r in page["runs"]] == [str(typed.id), str(nested[6].id), str(nested[5].id)]
    seen = []
    path = "/api/runs?limit=3&workflow=tests.apps.ui_workflows.nested"
    while path:
        status, page = client.get(path)
        assert status == 200
        seen += [r["id"] for r in page["runs"]]
        path = page["next"] and f"/api/runs?limit=3&workflow=tests.apps.ui_workflows.nested&before={page['next']}"
    assert seen == [str(run.id) for run in reversed(nested)]  # every run once, newest first

    assert [r["id"] for r in client.get("/api/runs?status=scheduled")[1]["runs"]] == [str(typed.id)]
    completed = client.get("/api/runs?status=completed")[1]["runs"]
    assert len(completed) == 7 and all(r["steps_done"] == r["steps_total"] == 6 for r in completed)
    assert [r["id"] for r in client.get(f"/api/runs?q={nested[3].id}")[1]["runs"]] == [str(nested[3].id)]
    assert [r["id"] for r in client.get("/api/runs?q=%5B4%5D")[1]["runs"]] == [str(nested[4].id)]  # args @> [4]
    future = "2999-01-01T00:00:00Z"
    assert client.get(f"/api/runs?since={future}")[1]["runs"] == []
    assert len(client.get(f"/api/runs?until={future}")[1]["runs"]) == 8

    status, answer = client.get("/api/runs?status=bogus")
    assert status == 400 and "status must be one of" in answer["error"]
    status, answer = client.get("/api/runs?q=%7Bnot+json")
    assert status == 400 and "must be JSON" in answer["error"]


def test_search_by_idempotency_key(db, ui):
    with db.connect() as conn:
        import everystep  # noqa: PLC0415

        with everystep.transaction(conn):
            keyed = everystep.schedule(ui_workflows.slow, 0.0, idempotency_key="order:77")
    client = Client(ui())
    assert [r["id"] for r in client.get("/api/runs?q=order:77")[1]["runs"]] == [str(keyed.id)]


def test_run_detail_has_steps_and_extended_values(db, ui):
    [nested] = db.schedule_many(ui_workflows.nested, [(4,)])
    [typed] = db.schedule_many(ui_workflows.typed, [()])
    db.run_pending()
    client = Client(ui())
    status, run = client.get(f"/api/runs/{nested.id}")
    assert status == 200 and run["status"] == "completed" and run["result"] == 13
    assert sorted(s["step_id"] for s in run["steps"]) == ["1", "2.0.1", "2.1.1", "2.1.2.0.1", "2.1.2.1.1", "3"]
    assert all(s["started_at"] <= s["finished_at"] for s in run["steps"])  # the timeline's data
    status, run = client.get(f"/api/runs/{typed.id}")
    assert run["result"]["day"] == {"$es": "date", "v": "2026-01-02"}  # tagged: the page renders it readably
    assert client.get(f"/api/runs/{uuid.uuid4()}")[0] == 404
    status, answer = client.get("/api/runs/not-a-uuid")
    assert status == 400 and "not a run id" in answer["error"]


def test_resolve_needs_csrf_and_is_audited(db, ui):
    run = blocked_run(db)
    client = Client(ui())
    status, run_page = client.get(f"/api/runs/{run}")
    assert run_page["resolve"]["step"] == "1"
    assert f"everystep resolve-step {run} 1 --discard" in run_page["resolve"]["cli"]
    body = {"run": str(run), "step": "1", "outcome": "result", "value": '"charged o-1"'}

    status, answer = client.request("POST", "/api/actions/resolve", body)
    assert status == 403 and "CSRF" in answer["error"]
    status, answer = client.request("POST", "/api/actions/resolve", body, headers={"X-CSRF-Token": "0" * 64})
    assert status == 403
    assert db.run(run)["status"] == "blocked"  # nothing happened

    status, answer = client.request("POST", "/api/actions/resolve", {**body, "value": "{bad"},
                                    headers={"X-CSRF-Token": client.csrf()})
    assert status == 400 and "not a valid everystep JSON value" in answer["error"]
    status, answer = client.request("POST", "/api/actions/resolve", body, headers={"X-CSRF-Token": client.csrf()})
    assert status == 200, answer
    assert db.run(run)["status"] == "scheduled"
    assert db.run_pending() == {run: "completed"}
    assert db.run(run)["result"] == "shipped o-1"
    [record] = db.query("SELECT actor, source, action, run_id, step_id, details FROM everystep_audit")
    assert record == ("local", "ui", "resolve-step", run, "1", {"result": "charged o-1"})  # as the CLI records it
    status, answer = client.request("POST", "/api/actions/resolve", body, headers={"X-CSRF-Token": client.csrf()})
    assert status == 409 and "not blocked" in answer["error"]  # resolved already


def test_tokens_viewer_reads_operator_acts(db, ui):
    run = blocked_run(db)
    base = ui(EVERYSTEP_UI_VIEWER_TOKEN=VIEWER, EVERYSTEP_UI_OPERATOR_TOKEN=OPERATOR)
    anonymous = Client(base)
    assert anonymous.get("/api/runs")[0] == 401
    status, page = anonymous.get("/")  # redirected to the login form
    assert status == 200 and 'name="token"' in page
    assert Client(base, "wrong").get("/api/runs")[0] == 401

    viewer = Client(base, VIEWER)
    assert viewer.get("/api/runs")[0] == 200
    body = {"run": str(run), "step": "1", "outcome": "discard"}
    status, answer = viewer.request("POST", "/api/actions/resolve", body)
    assert status == 403 and "viewers cannot act" in answer["error"]
    assert db.run(run)["status"] == "blocked"

    browser = Client(base)  # logs in with the form: a cookie session
    status, _ = browser.request("POST", "/login", form={"token": "nope"})
    assert status == 401
    browser.request("POST", "/login", form={"token": OPERATOR})
    assert browser.get("/api/runs")[0] == 200
    assert browser.request("POST", "/api/actions/resolve", body)[0] == 403  # a cookie alone is not enough
    status, answer = browser.request("POST", "/api/actions/resolve", body, headers={"X-CSRF-Token": browser.csrf()})
    assert status == 200, answer
    assert db.run(run)["status"] == "scheduled" and db.steps(run) == []
    assert db.value("SELECT actor FROM everystep_audit") == "operator"


def test_requeue_refuses_a_live_claimer_and_reschedule_copies_args(db, ui):
    [run] = db.schedule_many(ui_workflows.nested, [(1,)])
    with db.connect() as conn:
        everystep.db.claim(conn, "dead-runner", 1)  # its lock is free: the claimer is dead
    client = Client(ui())
    csrf = {"X-CSRF-Token": client.csrf()}
    with db.connect() as holder:
        assert everystep.db.try_lock(holder, "dead-runner")  # alive while this session holds its lock
        status, answer = client.request("POST", "/api/actions/requeue", {"runs": [str(run.id)]}, headers=csrf)
        # Refused, and nothing done: 409 with why (and no audit record).
        assert status == 409 and "nothing done" in answer["error"] and "holds its lock" in answer["error"]
    status, answer = client.request("POST", "/api/actions/requeue", {"runs": [str(run.id)]}, headers=csrf)
    assert answer["done"] == [str(run.id)] and db.run(run.id)["status"] == "scheduled"

    status, answer = client.request("POST", "/api/actions/reschedule",
                                    {"filter": {"workflow": "tests.apps.ui_workflows.nested"}}, headers=csrf)
    assert status == 200 and len(answer["done"]) == 1
    assert db.run(uuid.UUID(answer["done"][0]))["args"] == [1]
    actions = [row[0] for row in db.query("SELECT action FROM everystep_audit ORDER BY id")]
    assert actions == ["requeue", "schedule-again"]


def test_cancel_ends_a_scheduled_run_asks_a_running_one_and_reports_an_ended_one(db, ui):
    claimed, queued, ended = db.schedule_many(ui_workflows.nested, [(1,), (2,), (3,)])
    with db.connect() as conn:
        everystep.db.claim(conn, "some-runner", 1)  # the oldest, `claimed`, is running now
    db.query("UPDATE everystep_workflow SET status = 'completed' WHERE id = %s RETURNING id", (ended.id,))
    base = ui(EVERYSTEP_UI_VIEWER_TOKEN=VIEWER, EVERYSTEP_UI_OPERATOR_TOKEN=OPERATOR)
    runs = [str(r.id) for r in (claimed, queued, ended)]
    status, answer = Client(base, VIEWER).request("POST", "/api/actions/cancel", {"runs": runs})
    assert status == 403 and db.run(queued.id)["status"] == "scheduled"
    status, answer = Client(base, OPERATOR).request("POST", "/api/actions/cancel",
                                                    {"runs": runs, "reason": "not needed"})
    assert status == 200, answer
    assert set(answer["done"]) == set(runs[:2])
    assert answer["refused"] == [f"{ended.id}: already completed"]
    assert db.run(queued.id)["status"] == "cancelled"  # not running: cancelled at once
    assert db.run(claimed.id)["status"] == "running"  # asked: it stops at its next step
    assert db.value("SELECT cancel_reason FROM everystep_workflow WHERE id = %s", (claimed.id,)) == "not needed"
    audited = db.query("SELECT action, run_id FROM everystep_audit ORDER BY id")
    assert sorted(audited) == sorted([("cancel", claimed.id), ("cancel", queued.id)])  # the refused one wrote nothing


def test_non_loopback_bind_without_credentials_is_refused(db, tmp_path):
    result = subprocess.run([sys.executable, "-m", "everystep.cli", "--database-url", db.url, "ui", "--bind",
                             "0.0.0.0", "--port", "0"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                            env={k: v for k, v in __import__("os").environ.items() if not k.startswith("EVERYSTEP_UI")})
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "not a loopback address and no credentials" in result.stderr
    config = tmp_path / "everystep.yaml"
    config.write_text(f"database:\n  url: \"{db.url}\"\nui:\n  bind: 0.0.0.0\n  port: 0\n")
    result = subprocess.run([sys.executable, "-m", "supervisor", "-c", str(config)], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "ui.bind: bind '0.0.0.0' is not a loopback address" in result.stderr


def test_the_ui_socket_sends_each_write_at_once():
    """Connections to the UI's socket have Nagle's algorithm off, as asyncio
    sets it (TCP_NODELAY) on connections of a socket that names TCP; with it
    on, a stream's events waited up to 40 ms for the client's delayed ACK."""
    from everystep.ui.server import bind  # noqa: PLC0415

    async def accepted_nodelay(sock: socket.socket) -> int:
        accepted = asyncio.get_running_loop().create_future()

        class Accept(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                accepted.set_result(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP,
                                                                                   socket.TCP_NODELAY))

        server = await asyncio.get_running_loop().create_server(Accept, sock=sock)  # as uvicorn serves it
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            try:
                return await asyncio.wait_for(accepted, 10)
            finally:
                writer.close()

    assert asyncio.run(accepted_nodelay(bind("127.0.0.1", 0))) != 0


def test_cli_actions_are_audited(db):
    run = blocked_run(db)

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "everystep.cli", "--database-url", db.url, *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)

    assert cli("resolve-step", str(run), "1", "--result", '"charged"').returncode == 0
    assert cli("schedule", "tests.apps.ui_workflows:slow", "0.5").returncode == 0
    assert cli("prune", "--older-than", "30").returncode == 0
    rows = db.query("SELECT source, action, run_id, step_id, details FROM everystep_audit ORDER BY id")
    assert [(r[0], r[1]) for r in rows] == [("cli", "resolve-step"), ("cli", "schedule"), ("cli", "prune")]
    assert rows[0][2:] == (run, "1", {"result": "charged"})
    assert rows[1][4]["args"] == [0.5] and rows[2][4] == {"older_than_days": 30, "deleted": 0}


def test_one_poll_a_second_however_many_listeners(db):
    console = Console(db.url, poll_interval=1.0)
    try:
        stops = [console.hub.listen(lambda: None) for _ in range(10)]
        for _ in range(50):  # pages that poll instead: served from the same answer
            console.overview()
            time.sleep(0.06)
        for stop in stops:
            stop()
        assert 2 <= console.hub.queries <= 5  # about 3 s of polling
    finally:
        console.close()


def test_counts_are_exact_when_small_and_estimated_when_large(db):
    db.query("INSERT INTO everystep_workflow (id, name, args, status, created_at, completed_at)"
             " SELECT gen_random_uuid(), 'app.bulk', '[]', 'completed', now(), now()"
             " FROM generate_series(1, 3000) RETURNING 1")
    db.schedule_many(ui_workflows.slow, [(0.0,)] * 3)
    with db.connect() as conn:
        conn.execute("ANALYZE everystep_workflow")
    console = Console(db.url)
    try:
        counts = console.overview()["counts"]
    finally:
        console.close()
    assert counts["scheduled"] == {"n": 3, "exact": True}
    assert counts["failed"] == {"n": 0, "exact": True}
    assert counts["completed"]["exact"] is False and 2500 <= counts["completed"]["n"] <= 3500


def test_schedules_pause_resume_and_fire_now(db, ui):
    from everystep import scheduler  # noqa: PLC0415

    with db.connect() as conn:
        scheduler.apply(conn, {"nightly": scheduler.Schedule(workflow="tests.apps.ui_workflows.slow", cron="0 3 * * *",
                                                             args=(0.0,))})
    client = Client(ui())
    csrf = {"X-CSRF-Token": client.csrf()}
    [row] = client.get("/api/schedules")[1]["schedules"]
    assert row["key"] == "nightly" and row["paused"] is False and row["last_run_id"] is None

    assert client.request("POST", "/api/actions/schedule", {"key": "nightly", "verb": "pause"}, headers=csrf)[0] == 200
    assert db.value("SELECT paused FROM everystep_schedule") is True
    db.query("UPDATE everystep_schedule SET next_fire_at = now() - interval '3 days' RETURNING 1")  # paused long
    assert client.request("POST", "/api/actions/schedule", {"key": "nightly", "verb": "resume"}, headers=csrf)[0] == 200
    assert db.value("SELECT paused FROM everystep_schedule") is False
    assert db.value("SELECT next_fire_at > now() FROM everystep_schedule")  # the paused days are not caught up
    status, answer = client.request("POST", "/api/actions/schedule", {"key": "nightly", "verb": "fire"}, headers=csrf)
    assert status == 200
    [row] = client.get("/api/schedules")[1]["schedules"]
    assert row["last_run_id"] == answer["done"][0] and row["last_run_status"] == "scheduled"
    assert db.run(uuid.UUID(row["last_run_id"]))["args"] == [0.0]
    status, answer = client.request("POST", "/api/actions/schedule", {"key": "nope", "verb": "fire"}, headers=csrf)
    assert status == 409 and "no live schedule 'nope'" in answer["error"]
    actions = [r[0] for r in db.query("SELECT action || ' ' || target FROM everystep_audit ORDER BY id")]
    assert actions == ["schedule-pause nightly", "schedule-resume nightly", "schedule-fire nightly"]


def test_failures_grouped_and_workers_listed(db, ui, tmp_path):
    from tests.support.processes import WorkerProcess, wait_for  # noqa: PLC0415

    for error_type, count in (("app.Timeout", 3), ("app.Refused", 1)):
        for _ in range(count):
            db.query("INSERT INTO everystep_workflow (id, name, args, status, error, completed_at)"
                     " VALUES (gen_random_uuid(), 'app.pay', '[]', 'failed', %s::jsonb, now()) RETURNING 1",
                     (json.dumps({"type": error_type, "message": "no", "args": []}),))
    client = Client(ui())
    groups = client.get("/api/failures?window=day")[1]["groups"]
    assert [(g["workflow"], g["error_type"], g["runs"]) for g in groups] == [
        ("app.pay", "app.Timeout", 3), ("app.pay", "app.Refused", 1)]
    assert client.get("/api/failures?window=year")[0] == 400

    [run] = db.schedule_many(ui_workflows.slow, [(30.0,)])
    worker = WorkerProcess(db.url, "ui-worker-1", tmp_path / "logs", threads=3, imports=("tests.apps.ui_workflows",))
    try:
        wait_for(lambda: db.run(run.id)["status"] == "running", 30, what="the run to be claimed")
        workers = client.get("/api/workers")[1]["workers"]
        assert [(w["name"], w["in_flight"]) for w in workers] == [("ui-worker-1", 1)]
        assert workers[0]["pool_connections"] >= 1 and workers[0]["since"]
    finally:
        worker.signal(3)  # fast stop: requeue
        worker.proc.wait(30)
    assert client.get("/api/workers")[1]["workers"] == []
