"""The run page shows a run's deadline, its cancel reason and its step
timeouts, in a real browser (as tests/test_ui_browser.py, whose fixtures
these are: skipped with them where Chromium is absent)."""

from __future__ import annotations

import everystep
from tests.apps import timeout_workflows as tf
from tests.test_ui import VIEWER
from tests.test_ui_browser import browser, expect, open_page, ui_url  # noqa: F401  (browser, ui_url: fixtures)


def test_the_run_page_shows_the_deadline_the_cancel_reason_and_the_timeouts(db, marks, browser, request):  # noqa: F811
    with db.connect() as conn, everystep.transaction(conn):
        timed = everystep.schedule(tf.retries_a_timeout, marks, 1, deadline=3600)
        cancelled = everystep.schedule(tf.sleeps_long, marks, deadline=3600)
        plain = everystep.schedule(tf.sleeps_long, marks)
    db.run_pending()
    with db.connect() as conn:  # an hour later, as far as this run is concerned
        conn.execute("UPDATE everystep_workflow SET deadline_at = now(), due_at = now() WHERE id = %s",
                     (cancelled.id,))
    assert db.run_pending() == {cancelled.id: "cancelled"}
    url = request.getfixturevalue("ui_url")  # its workers start now: the runs above are over or asleep
    page = open_page(browser, url, VIEWER)
    page.goto(f"{url}/runs/{timed.id}")
    expect(page.locator("#run-timeouts")).to_have_text("1 step attempt(s) timed out")
    expect(page.locator("#run-deadline")).to_be_visible()
    expect(page.locator("#run-cancel")).to_have_count(0)
    page.goto(f"{url}/runs/{cancelled.id}")
    expect(page.locator("#run-cancel")).to_have_text("reason: deadline")
    expect(page.locator("#run-deadline")).to_be_visible()
    page.goto(f"{url}/runs/{plain.id}")
    expect(page.locator("article.run")).to_have_attribute("data-status", "waiting")
    expect(page.locator("#run-deadline")).to_have_count(0)
    page.close()
