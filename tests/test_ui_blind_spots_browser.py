"""The console's blind spots, in a real browser against a running supervisor:
a form being filled survives the live refresh, the runs list's duration and
its actions shown with a selection, the day chart in readable buckets with
unstretched text, a re-run's copied steps shown as copied. Skipped like
tests/test_ui_browser.py where Chromium is absent."""

from __future__ import annotations

import re

import psycopg

import everystep
from tests.apps import console_workflows, ui_workflows
from tests.support.processes import wait_for
from tests.test_ui import OPERATOR, VIEWER, blocked_run
from tests.test_ui_browser import browser, expect, open_page, shot  # noqa: F401  (its browser fixture; it skips)
from tests.test_ui_console_browser import ended, fix_file, ui_url  # noqa: F401  (the console's fixtures)


def redrawn(page) -> None:
    """Wait for the run's page to be drawn again by the live refresh."""
    page.evaluate("document.querySelector('article.run').dataset.before = 'yes'")
    expect(page.locator("article.run:not([data-before])")).to_have_count(1, timeout=15000)


def test_a_half_filled_resolve_form_is_not_wiped_by_the_live_refresh(db, browser, ui_url):  # noqa: F811
    run = blocked_run(db, "o-4")
    page = open_page(browser, ui_url, OPERATOR)
    page.goto(f"{ui_url}/#run/{run}")
    expect(page.locator("#resolve-form")).to_be_visible()
    page.check("#resolve-form input[value=error]")
    page.fill("#resolve-form input[name=value]", "declined by the ba")  # half typed, the caret in the field
    db.schedule_many(ui_workflows.nested, [(1,)])  # the database changes: the blocked run's page refreshes
    redrawn(page)
    expect(page.locator("#resolve-form input[name=value]")).to_have_value("declined by the ba")
    expect(page.locator("#resolve-form input[value=error]")).to_be_checked()
    assert page.evaluate("document.activeElement.name") == "value"  # still typing there
    page.keyboard.type("nk")
    page.click("#resolve-form button")
    wait_for(lambda: db.run(run)["status"] != "blocked", 15, what="the run to be resolved")
    assert db.query("SELECT status, error->>'message' FROM everystep_step WHERE workflow_id = %s", (run,)) \
        == [("failed", "declined by the bank")]
    page.close()


def test_the_runs_list_shows_durations_and_actions_only_with_a_selection(db, browser, ui_url):  # noqa: F811
    runs = db.schedule_many(ui_workflows.nested, [(n,) for n in range(2)])
    for run in runs:
        ended(db, run.id)
    page = open_page(browser, ui_url, OPERATOR)
    expect(page.locator("#runs tr[data-run]")).to_have_count(2)
    expect(page.locator("#runs-table th").last).to_have_text("duration")
    for run in runs:
        expect(page.locator(f"tr[data-run='{run.id}'] td.duration")).to_have_text(
            re.compile(r"^\d+(\.\d)? (ms|s)$"))
    expect(page.locator("#bulk")).to_be_hidden()
    expect(page.locator("button:text('Cancel selected')")).to_be_hidden()
    page.check(f"tr[data-run='{runs[0].id}'] input[type=checkbox]")
    expect(page.locator("#bulk")).to_be_visible()
    expect(page.locator("#selection")).to_have_text("1 selected")
    shot(page, "runs-selected")
    page.uncheck(f"tr[data-run='{runs[0].id}'] input[type=checkbox]")
    expect(page.locator("#bulk")).to_be_hidden()
    viewer = open_page(browser, ui_url, VIEWER)
    expect(viewer.locator("#runs tr[data-run]")).to_have_count(2)
    expect(viewer.locator("td.duration").first).to_be_visible()
    viewer.close()
    page.close()


def test_the_day_chart_draws_readable_buckets_with_unstretched_text(db, browser, ui_url):  # noqa: F811
    runs = db.schedule_many(ui_workflows.nested, [(n,) for n in range(3)])
    for run in runs:
        ended(db, run.id)
    wait_for(lambda: db.value("SELECT sum(completed) FROM everystep_minute WHERE workflow = '*'") == 3, 40,
             what="the per-minute figures")
    page = open_page(browser, ui_url, VIEWER)
    page.goto(f"{ui_url}/#charts?window=day")
    expect(page.locator("#ended-title")).to_have_text("runs ended per 15 minutes")
    bar = page.locator("#chart-ended rect[data-status=completed]")
    expect(bar).to_have_count(1)
    assert bar.bounding_box()["width"] >= 5  # one of 96 bars, not of 1,440
    expect(bar.locator("title")).to_contain_text("3 completed")
    for chart in ("#chart-ended", "#chart-due", "#chart-latency"):
        scale = page.evaluate(f"(() => {{ const m = document.querySelector('{chart} text.axis').getScreenCTM();"
                              " return [m.a, m.d]; })()")
        assert abs(scale[0] - scale[1]) < 0.01, scale  # as wide as it is tall: not stretched
        assert abs(scale[0] - 1) < 0.01, scale  # at a desktop's width, the size it was written in
    shot(page, "charts-day", full_page=True)
    page.goto(f"{ui_url}/#charts?window=hour")
    expect(page.locator("#ended-title")).to_have_text("runs ended per minute")
    page.close()


def test_a_reruns_timeline_shows_its_copied_steps_as_copied(db, browser, ui_url, fix_file):  # noqa: F811
    [run] = db.schedule_many(console_workflows.pay_then_deliver, [("o-5",)])
    assert ended(db, run.id)["status"] == "failed"
    fix_file.write_text("deployed")
    with psycopg.connect(db.url) as conn, everystep.transaction(conn):
        new = everystep.rerun(run.id, "4", conn=conn)
    assert ended(db, new)["status"] == "completed"
    page = open_page(browser, ui_url, VIEWER)
    page.goto(f"{ui_url}/#run/{new}")
    copied = page.locator("#timeline .lane[data-copied]")
    expect(copied).to_have_count(4)  # 1, 2, 3.0.1, 3.1.1: recorded by the old run
    expect(copied.first).to_contain_text("copied from")
    expect(copied.first.locator(".bar")).to_have_count(0)  # no bar at the old run's times
    expect(page.locator("#timeline .lane:not([data-copied])")).to_have_count(2)  # 4 and 5 ran here
    expect(page.locator("#timeline")).to_contain_text("4 copied step(s) left out")
    expect(page.locator("g.node[data-copied]")).to_have_count(4)  # the graph says so too
    page.locator("g.node[data-step='2']").click()
    expect(page.locator("#step-detail .copied-from")).to_contain_text(str(run.id)[:8])
    shot(page, "rerun-timeline", full_page=True)
    page.close()



def test_a_failed_step_shows_the_traceback_of_each_attempt(db, browser, ui_url):  # noqa: F811
    [run] = db.schedule_many(console_workflows.pay_then_deliver, [("o-6",)])
    assert ended(db, run.id)["status"] == "failed"
    [retried] = db.schedule_many(console_workflows.retried, [("r-2",)])
    assert ended(db, retried.id)["status"] == "completed"
    page = open_page(browser, ui_url, VIEWER)
    page.goto(f"{ui_url}/#run/{run.id}")
    traceback = page.locator("#run-traceback")
    expect(traceback).to_contain_text("traceback of step 4, attempt 1")
    expect(traceback.locator("pre")).to_contain_text("Traceback (most recent call last):")
    expect(traceback.locator("pre")).to_contain_text("console_workflows.py")  # where it failed
    expect(page.locator("#run-logs")).to_contain_text(f"run={run.id}")  # where the worker's log lines are
    page.locator("g.node[data-step='4']").click()
    expect(page.locator("#step-detail details.step-traceback")).to_have_count(1)
    shot(page, "traceback", full_page=True)
    page.goto(f"{ui_url}/#run/{retried.id}")
    expect(page.locator("article.run h2")).to_contain_text(str(retried.id))  # the new page, not the last one
    page.locator("g.node[data-step='1']").click()
    attempts = page.locator("#step-detail details.step-traceback")
    expect(attempts).to_have_count(2)  # each failed attempt its own
    expect(attempts.nth(0).locator("pre")).to_contain_text("RuntimeError: try 1 failed")
    expect(attempts.nth(1).locator("pre")).to_contain_text("RuntimeError: try 2 failed")
    page.close()
