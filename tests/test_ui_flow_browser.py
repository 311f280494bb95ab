"""The run page shows a run's priority and concurrency key (Playwright and
Debian's Chromium, as tests/test_ui_browser.py; skipped likewise)."""

from __future__ import annotations

import everystep
from tests.apps import ui_workflows
from tests.support.processes import wait_for
from tests.test_ui_browser import VIEWER, browser, open_page, ui_url  # noqa: F401  (fixtures)


def test_the_run_page_shows_priority_and_concurrency_key(db, browser, ui_url):  # noqa: F811
    from playwright.sync_api import expect  # noqa: PLC0415  (after test_ui_browser's skip without Chromium)

    with db.connect() as conn, everystep.transaction(conn):
        run = everystep.schedule(ui_workflows.nested, 2, priority=-7, concurrency_key="tenant:42")
    wait_for(lambda: db.run(run.id)["status"] == "completed", 30)
    page = open_page(browser, ui_url, VIEWER)
    page.goto(f"{ui_url}/#run/{run.id}")
    facts = page.locator("article.run dl")
    expect(facts).to_contain_text("priority")
    expect(facts).to_contain_text("-7")
    expect(facts).to_contain_text("tenant:42")
    page.close()
