"""Run attributes and the bulk action by filter in a real browser (Playwright
driving Debian's Chromium) against a running supervisor: the list filtered
by attribute in the URL, a run's attributes on its page (each a link to the
list filtered by it), and a bulk cancel previewed with its count and sample
and confirmed by typing the count. Skipped like tests/test_ui_browser.py
where Chromium is absent."""

from __future__ import annotations

import everystep
from tests.apps import ui_workflows
from tests.test_ui import OPERATOR, VIEWER
from tests.test_ui_browser import browser, expect, open_page, shot, ui_url  # noqa: F401  (fixtures; it skips)
from tests.test_ui_console_browser import ended


def test_filter_by_attribute_and_a_bulk_cancel_confirmed_by_its_count(db, browser, ui_url):  # noqa: F811
    with db.connect() as conn, everystep.transaction(conn):
        waiting = [everystep.schedule(ui_workflows.slow, 0.0, after=3600, attributes={"tenant": "acme"})
                   for _ in range(12)]
        others = [everystep.schedule(ui_workflows.slow, 0.0, after=3600, attributes={"tenant": "globex"})
                  for _ in range(3)]
        done = everystep.schedule(ui_workflows.nested, 1, attributes={"tenant": "acme", "order": 7})
    ended(db, done.id)
    page = open_page(browser, ui_url, OPERATOR)
    page.fill("input[name=attr]", "tenant=acme")
    page.click("#filters button:text('Filter')")
    expect(page.locator("#runs tr[data-run]")).to_have_count(13)
    assert "attr=tenant%3Dacme" in page.url
    page.reload()  # the URL is the state: shareable
    expect(page.locator("#runs tr[data-run]")).to_have_count(13)
    expect(page.locator("input[name=attr]")).to_have_value("tenant=acme")
    shot(page, "attributes")
    page.goto(f"{ui_url}/#run/{done.id}")
    expect(page.locator("#attributes")).to_contain_text("tenant=acme")
    expect(page.locator("#attributes")).to_contain_text("order=7")
    page.click("#attributes a:text('order=7')")  # an attribute links to the list filtered by it
    expect(page.locator("#runs tr[data-run]")).to_have_count(1)
    page.goto(f"{ui_url}/#?status=waiting&attr=tenant%3Dacme")
    expect(page.locator("#runs tr[data-run]")).to_have_count(12)
    page.click("#bulk-open")
    page.select_option("#bulk-panel select[name=action]", "cancel")
    page.fill("#bulk-panel input[name=reason]", "customer left")
    page.click("#bulk-preview")
    expect(page.locator("#bulk-count")).to_have_text("12 run(s) found")
    expect(page.locator("#bulk-found li")).to_have_count(12)
    expect(page.locator("#bulk-apply")).to_be_disabled()
    page.fill("#bulk-confirm", "11")
    expect(page.locator("#bulk-apply")).to_be_disabled()
    page.fill("#bulk-confirm", "12")
    expect(page.locator("#bulk-apply")).to_be_enabled()
    shot(page, "bulk", full_page=True)
    page.click("#bulk-apply")
    expect(page.locator("#flash")).to_contain_text("12 of 12 run(s) done")
    assert {db.run(run.id)["status"] for run in waiting} == {"cancelled"}
    assert {db.run(run.id)["status"] for run in others} == {"waiting"}
    assert db.value("SELECT actor FROM everystep_audit WHERE action = 'bulk-cancel'") == "operator"
    # A viewer sees no bulk action.
    viewer = open_page(browser, ui_url, VIEWER)
    expect(viewer.locator("#runs tr[data-run]").first).to_be_visible()
    expect(viewer.locator("#bulk-open")).to_have_count(0)
    viewer.close()
    page.close()
