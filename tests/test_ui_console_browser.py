"""The console's second pass in a real browser (Playwright driving Debian's
Chromium) against a running supervisor: a run's page shows everything the
run has (retry attempts, executions, messages, where a running or waiting
run is), re-run from a step and send a message from the page, the filters
kept in the URL, the list at a phone's width, the charts and a schedule's
fires. Skipped like tests/test_ui_browser.py where Chromium is absent."""

from __future__ import annotations

import datetime
import re

import pytest

from tests.apps import console_workflows, ui_workflows
from tests.support.processes import wait_for
from tests.support.supervisor_process import config
from tests.test_ui import OPERATOR, VIEWER
from tests.test_ui_browser import browser, expect, open_page, shot  # noqa: F401  (its browser fixture; it skips)

IMPORTS = ["tests.apps.workflows", "tests.apps.ui_workflows", "tests.apps.console_workflows"]


@pytest.fixture
def fix_file(tmp_path, monkeypatch):
    """The file whose existence deploys the fix of deliver()'s bug in the workers."""
    path = tmp_path / "fixed"
    monkeypatch.setenv(console_workflows.FIXED, str(path))
    return path


@pytest.fixture
def ui_url(db, supervisors, monkeypatch, fix_file):
    monkeypatch.setenv("EVERYSTEP_UI_VIEWER_TOKEN", VIEWER)
    monkeypatch.setenv("EVERYSTEP_UI_OPERATOR_TOKEN", OPERATOR)
    sup = supervisors(config(db.url, "consoletest", imports=IMPORTS,
                             ui={"bind": "127.0.0.1", "port": 0, "viewer_token": "${EVERYSTEP_UI_VIEWER_TOKEN}",
                                 "operator_token": "${EVERYSTEP_UI_OPERATOR_TOKEN}"}))
    match = wait_for(lambda: re.search(r"ui: serving on (http://[^ ]+)/", sup.output()), 30, what="the UI to serve")
    return match[1]


def ended(db, run_id, timeout: float = 30) -> dict:
    return wait_for(lambda: (row := db.run(run_id))["status"] in ("completed", "failed", "cancelled") and row,
                    timeout, what=f"run {run_id} to end")


def test_rerun_a_failed_run_from_its_failing_step(db, browser, ui_url, fix_file):  # noqa: F811
    [run] = db.schedule_many(console_workflows.pay_then_deliver, [("o-7",)])
    assert ended(db, run.id)["status"] == "failed"
    page = open_page(browser, ui_url, OPERATOR)
    page.goto(f"{ui_url}/#run/{run.id}")
    expect(page.locator("#executions tbody tr")).to_have_count(1)
    expect(page.locator("#executions tbody tr").first).to_have_attribute("data-outcome", "failed")
    expect(page.locator("#executions")).to_contain_text("consoletest")
    expect(page.locator("#requeue")).to_have_count(0)
    expect(page.locator("#rerun-form select[name=step]")).to_have_value("4")  # the failed step, chosen
    expect(page.locator("g.node[data-step='4']")).to_have_attribute("data-state", "failed")
    shot(page, "rerun", full_page=True)
    fix_file.write_text("deployed")
    page.click("#rerun-form button")
    expect(page.locator("#rerun-of")).to_contain_text(str(run.id)[:8], timeout=15000)  # now on the new run's page
    new = page.url.rsplit("#run/", 1)[1]
    assert ended(db, new)["status"] == "completed"
    expect(page.locator("article.run")).to_have_attribute("data-status", "completed", timeout=15000)
    charge = db.query("SELECT claim_token FROM everystep_step WHERE workflow_id = %s AND step_id = '2'", (new,))
    assert charge == [(None,)]  # copied, never executed again
    page.click("#rerun-of a")
    expect(page.locator("#reruns")).to_contain_text(new[:8])
    assert db.value("SELECT action FROM everystep_audit") == "rerun"
    # On a selection of the list: each selected run re-run from the step asked for.
    fix_file.unlink()
    more = db.schedule_many(console_workflows.pay_then_deliver, [("o-8",), ("o-9",)])
    for each in more:
        assert ended(db, each.id)["status"] == "failed"
    fix_file.write_text("deployed")
    page.goto(f"{ui_url}/#?status=failed")
    expect(page.locator("#runs tr[data-run]")).to_have_count(3)
    for each in more:
        page.check(f"tr[data-run='{each.id}'] input[type=checkbox]")
    page.evaluate("window.prompt = () => '4'")
    page.click("button:text('Re-run selected from a step')")
    expect(page.locator("#flash")).to_contain_text("re-ran 2 run(s) from step 4")
    reruns = wait_for(lambda: (rows := db.query("SELECT id FROM everystep_workflow WHERE rerun_of = ANY(%s)",
                                                ([each.id for each in more],))) and len(rows) == 2 and rows, 10)
    assert {ended(db, row[0])["status"] for row in reruns} == {"completed"}
    page.close()


def test_attempts_executions_and_a_running_run_shown_where_it_is(db, browser, ui_url):  # noqa: F811
    [retried] = db.schedule_many(console_workflows.retried, [("r-1",)])
    assert ended(db, retried.id)["status"] == "completed"
    page = open_page(browser, ui_url, VIEWER)
    page.goto(f"{ui_url}/#run/{retried.id}")
    lane = page.locator("#timeline .lane[data-step='1']")
    expect(lane.locator(".bar.attempt")).to_have_count(2)  # each failed attempt its own bar...
    expect(lane.locator(".bar.backoff")).to_have_count(2)  # ...and its back-off
    expect(lane.locator(".bar.attempt").first).to_have_attribute("title", re.compile("try 1 failed.*back-off"))
    expect(lane).to_contain_text("3 attempts")
    [slow] = db.schedule_many(ui_workflows.slow, [(6.0,)])
    page.goto(f"{ui_url}/#run/{slow.id}")
    expect(page.locator("article.run")).to_have_attribute("data-status", "running", timeout=15000)
    expect(page.locator("g.node[data-step='1']")).to_have_attribute("data-state", "inflight")  # where it is
    expect(page.locator("#claimer-state")).to_contain_text("alive")
    expect(page.locator("#executions tbody tr").last).to_have_attribute("data-outcome", "running")
    expect(page.locator("article.run")).to_have_attribute("data-status", "completed", timeout=20000)  # live
    expect(page.locator("g.node[data-step='1']")).to_have_attribute("data-state", "done")
    page.close()


def test_send_a_message_to_a_waiting_run_from_its_page(db, browser, ui_url):  # noqa: F811
    [run] = db.schedule_many(console_workflows.waits_for_approval, [("o-3",)])
    wait_for(lambda: db.run(run.id)["status"] == "waiting", 30, what="the run to wait")
    page = open_page(browser, ui_url, OPERATOR)
    page.goto(f"{ui_url}/#run/{run.id}")
    expect(page.locator("g.node[data-step='2']")).to_have_attribute("data-state", "waiting")  # not "uncertain"
    expect(page.locator("#events")).to_contain_text("awaiting approval")
    page.locator("g.node[data-step='2']").click()
    expect(page.locator("#step-deadline")).to_contain_text(re.compile(r"approval until \d{4}-\d\d-\d\d \d\d:"))
    expect(page.locator("#waiting-on")).to_have_text("message:approval")
    expect(page.locator("#due-at")).to_contain_text(re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ"))  # a date
    expect(page.locator("#send-form input[name=topic]")).to_have_value("approval")
    shot(page, "waiting", full_page=True)
    page.fill("#send-form input[name=payload]", '{"by": "ada"}')
    page.click("#send-form button")
    expect(page.locator("article.run")).to_have_attribute("data-status", "completed", timeout=20000)
    expect(page.locator("#messages")).to_contain_text("approval")
    expect(page.locator("#messages")).to_contain_text('"by": "ada"')
    assert db.run(run.id)["result"] == "o-3: {'by': 'ada'}"
    assert db.query("SELECT action, target FROM everystep_audit") == [("send", "approval")]
    page.close()


def test_filters_in_the_url_utc_times_and_a_phone_width(db, browser, ui_url):  # noqa: F811
    runs = db.schedule_many(ui_workflows.nested, [(n,) for n in range(3)])
    for run in runs:
        ended(db, run.id)
    db.query("UPDATE everystep_workflow SET created_at = '2026-01-02 03:30+00' WHERE id = %s RETURNING 1",
             (runs[0].id,))
    page = open_page(browser, ui_url, VIEWER)
    page.fill("input[name=since]", "2026-01-02T03:00")  # read as UTC, whatever the browser's zone
    page.fill("input[name=until]", "2026-01-02T04:00")
    page.click("#filters button:text('Filter')")
    expect(page.locator("#runs tr")).to_have_count(1)
    expect(page.locator(f"tr[data-run='{runs[0].id}']")).to_be_visible()
    assert "since=2026-01-02T03%3A00" in page.url and "until=" in page.url
    page.reload()  # the URL is the state: shareable
    expect(page.locator("#runs tr")).to_have_count(1)
    expect(page.locator("input[name=since]")).to_have_value("2026-01-02T03:00")
    page.goto(f"{ui_url}/#?status=completed")
    expect(page.locator("#runs tr")).to_have_count(3)
    page.go_back()  # the back button goes back to the time filter
    expect(page.locator("#runs tr")).to_have_count(1)
    page.fill("input[name=since]", "2026-01-03T00:00")  # from > to: refused, with a message
    page.click("#filters button:text('Filter')")
    expect(page.locator("#flash")).to_contain_text("is after to")
    status = page.evaluate(
        "async () => (await fetch('/api/runs?since=2026-01-03T00:00Z&until=2026-01-02T00:00Z')).status")
    assert status == 400
    expect(page.locator("tr[data-run] .bar-track.completed")).to_have_count(1)  # progress coloured by status
    narrow = browser.new_page(viewport={"width": 420, "height": 800})
    narrow.goto(ui_url + "/")
    narrow.fill("input[name=token]", VIEWER)
    narrow.click("button")
    expect(narrow.locator("#runs tr[data-run]")).to_have_count(3)
    assert narrow.evaluate("document.documentElement.scrollWidth") <= 420  # nothing overflows the screen
    # Measured in the page in one go: the list may be drawn again between a
    # locator's lookup and its box (a row replaced has no box).
    assert narrow.evaluate("document.querySelector('#runs tr[data-run]').getBoundingClientRect().width") <= 420
    shot(narrow, "narrow")
    narrow.close()
    page.close()


def test_charts_and_a_schedules_fires(db, browser, ui_url):  # noqa: F811
    db.schedule_many(ui_workflows.nested, [(n,) for n in range(4)])
    [failing] = db.schedule_many(console_workflows.pay_then_deliver, [("o-1",)])
    ended(db, failing.id)
    # The maintenance child rolls the minute up within 10 s.
    wait_for(lambda: db.value("SELECT sum(completed) FROM everystep_minute WHERE workflow = '*'") == 4, 40,
             what="the per-minute figures")
    page = open_page(browser, ui_url, VIEWER)
    page.click("nav a[data-view=charts]")
    expect(page.locator("#chart-ended rect[data-status=completed]")).to_have_count(1)
    expect(page.locator("#chart-ended rect[data-status=failed]")).to_have_count(1)
    expect(page.locator("#chart-due")).to_be_visible()
    expect(page.locator("#chart-latency")).to_be_visible()
    expect(page.locator("#step-durations tr[data-step-name='tests.apps.ui_workflows.add']")).to_be_visible()
    shot(page, "charts", full_page=True)
    page.click("button[data-window=day]")
    assert "window=day" in page.url
    page.select_option("select[name=workflow]", "tests.apps.console_workflows.pay_then_deliver")
    expect(page.locator("#chart-ended rect[data-status=completed]")).to_have_count(0)
    expect(page.locator("#chart-ended rect[data-status=failed]")).to_have_count(1)
    # A schedule's fires and their outcomes.
    db.query("INSERT INTO everystep_schedule (key, workflow, args, cron, timezone, catchup, max_catchup, overlap,"
             " max_lateness_seconds, paused, next_fire_at) VALUES ('nightly', 'tests.apps.ui_workflows.nested',"
             " '[1]', '0 3 * * *', 'UTC', 'skip', 1, 'allow', 60, false, now() + interval '1 day') RETURNING 1")
    day = datetime.datetime(2026, 1, 1, 3, tzinfo=datetime.UTC)
    ids = [r[0] for r in db.query("SELECT id FROM everystep_workflow ORDER BY created_at")]
    for n, run in enumerate(ids):
        db.query("INSERT INTO everystep_schedule_run (schedule_key, fire_at, run_id) VALUES ('nightly', %s, %s)"
                 " RETURNING 1", (day + datetime.timedelta(days=n), run))
    page.click("nav a[data-view=schedules]")
    page.click("a[href='#schedule/nightly']")
    expect(page.locator("#fire-strip a")).to_have_count(5)
    expect(page.locator("#fire-strip a[data-status=failed]")).to_have_count(1)
    expect(page.locator("#fires tbody tr")).to_have_count(5)
    shot(page, "fires")
    page.close()
