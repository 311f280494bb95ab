"""Who did it, in a real browser (Playwright driving Debian's Chromium)
against a real `everystep ui` process: the environment and the person in
the header, a person's action and a refused one (409, nothing audited), a
user named by a trusted proxy's header, and the audit page's filters by
person, action and run. Skipped, with the reason printed, where
/usr/bin/chromium is absent, unless EVERYSTEP_REQUIRE_BROWSER=1."""

from __future__ import annotations

import re

from playwright.sync_api import Page, expect

from tests.apps import ui_workflows
from tests.test_ui_browser import browser as browser  # noqa: F401  (the fixture; it skips this module too without Chromium)
from tests.test_ui_browser import shot
from tests.test_ui_people import ALICE
from tests.test_ui_people import ui as ui  # noqa: F401  (the fixture)


def new_page(browser, headers: dict | None = None) -> Page:
    page = browser.new_page(viewport={"width": 1280, "height": 820}, extra_http_headers=headers or {})
    page.on("dialog", lambda dialog: dialog.accept())
    return page


def ready(page: Page) -> None:
    expect(page.locator("#indicator")).to_have_attribute("data-mode", re.compile("live|polling"), timeout=15000)


def cancel_selected(page: Page, run_id) -> None:
    page.locator(f"tr[data-run='{run_id}'] input[type=checkbox]").check()
    page.click("button:text('Cancel selected')")


def test_people_their_actions_and_the_audit_filters(db, browser, ui):
    from everystep.cli import main  # noqa: PLC0415

    assert main(["--database-url", db.url, "migrate", "--environment", "production"]) == 0
    runs = db.schedule_many(ui_workflows.nested, [(1,), (2,), (3,)])
    base = ui({"users": {"alice": {"token": ALICE, "role": "operator"}, "dave": {"role": "operator"}},
               "trusted_user_header": "X-Forwarded-User", "trusted_proxies": ["127.0.0.1"]})

    page = new_page(browser)
    page.goto(base + "/")
    page.fill("input[name=token]", ALICE)
    page.click("button")
    ready(page)
    expect(page.locator("#environment")).to_have_text("production")
    expect(page.locator("#who")).to_have_text("alice · operator")
    cancel_selected(page, runs[0].id)
    expect(page.locator("#flash")).to_contain_text("cancelled 1 run(s)")
    expect(page.locator(f"tr[data-run='{runs[0].id}']")).to_have_attribute("data-status", "cancelled", timeout=15000)
    # Cancelling it again is refused: 409, said on the page, nothing audited.
    cancel_selected(page, runs[0].id)
    expect(page.locator("#flash.bad")).to_contain_text("nothing done")
    assert db.query("SELECT actor, action FROM everystep_audit WHERE action = 'cancel'") == [("alice", "cancel")]
    page.close()

    # Dave comes through the authenticating proxy: no login page, his name in the header and the trail.
    page = new_page(browser, {"X-Forwarded-User": "dave"})
    page.goto(base + "/")
    ready(page)
    expect(page.locator("#who")).to_have_text("dave · operator")
    cancel_selected(page, runs[1].id)
    expect(page.locator("#flash")).to_contain_text("cancelled 1 run(s)")
    page.locator(f"tr[data-run='{runs[2].id}'] input[type=checkbox]").check()
    page.click("button:text('Schedule selected again')")
    expect(page.locator("#flash")).to_contain_text("scheduled 1 new run(s)")

    # The audit page: everything, then by person, by action, by run; a click on a name filters by it.
    page.click("nav a[data-view=audit]")
    rows = page.locator("table.audit tbody tr")
    expect(rows).to_have_count(4)  # the environment record, alice's cancel, dave's cancel and schedule-again
    shot(page, "audit")
    page.fill("#audit-filters input[name=actor]", "alice")
    page.click("#audit-filters button:text('filter')")
    expect(rows).to_have_count(1)
    expect(rows.first.locator("td.action")).to_have_text("cancel")
    page.click("#audit-filters button:text('clear')")
    expect(rows).to_have_count(4)
    page.locator("table.audit td.actor a", has_text="dave").first.click()
    expect(rows).to_have_count(2)
    expect(page.locator("#audit-filters input[name=actor]")).to_have_value("dave")
    page.select_option("#audit-filters select[name=action]", "cancel")
    page.click("#audit-filters button:text('filter')")
    expect(rows).to_have_count(1)
    page.click("#audit-filters button:text('clear')")
    expect(rows).to_have_count(4)  # the cleared page drawn, before its form is filled in
    page.fill("#audit-filters input[name=run]", str(runs[0].id))
    page.click("#audit-filters button:text('filter')")
    expect(rows).to_have_count(1)
    expect(rows.first.locator("td.actor")).to_have_text("alice")
    page.fill("#audit-filters input[name=run]", "not-a-run")
    page.click("#audit-filters button:text('filter')")
    expect(page.locator("#audit-error")).to_contain_text("not a run id")
    page.close()
