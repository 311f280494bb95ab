"""The UI in a real browser (Playwright driving Debian's Chromium) against a
running supervisor and a real database. Skipped, with the reason printed,
where /usr/bin/chromium is absent, unless EVERYSTEP_REQUIRE_BROWSER=1."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from tests.apps import ui_workflows
from tests.support.processes import ROOT, wait_for
from tests.support.supervisor_process import config
from tests.test_ui import OPERATOR, VIEWER, blocked_run

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
DOCS = ROOT / "docs"

if not Path(CHROMIUM).exists():
    if os.environ.get("EVERYSTEP_REQUIRE_BROWSER") == "1":
        raise RuntimeError(f"EVERYSTEP_REQUIRE_BROWSER=1 but there is no Chromium at {CHROMIUM}")
    print(f"\nskipping the browser tests: no Chromium at {CHROMIUM} (apt-get install chromium)")
    pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium; EVERYSTEP_REQUIRE_BROWSER=1 makes it "
                "an error)", allow_module_level=True)

from playwright.sync_api import Page, expect, sync_playwright  # noqa: E402


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def ui_url(db, supervisors, monkeypatch):
    """A supervisor with a `ui:` section whose tokens come from the environment; the UI's address."""
    monkeypatch.setenv("EVERYSTEP_UI_VIEWER_TOKEN", VIEWER)
    monkeypatch.setenv("EVERYSTEP_UI_OPERATOR_TOKEN", OPERATOR)
    sup = supervisors(config(db.url, "uitest", imports=["tests.apps.workflows", "tests.apps.ui_workflows"],
                             ui={"bind": "127.0.0.1", "port": 0, "viewer_token": "${EVERYSTEP_UI_VIEWER_TOKEN}",
                                 "operator_token": "${EVERYSTEP_UI_OPERATOR_TOKEN}"}))
    match = wait_for(lambda: re.search(r"ui: serving on (http://[^ ]+)/", sup.output()), 30, what="the UI to serve")
    return match[1]


def open_page(browser, url: str, token: str, init_script: str | None = None) -> Page:
    page = browser.new_page(viewport={"width": 1280, "height": 820})
    if init_script:
        page.add_init_script(init_script)
    page.on("dialog", lambda dialog: dialog.accept())  # every action asks for a confirmation
    page.goto(url + "/")
    page.fill("input[name=token]", token)
    page.click("button")
    expect(page.locator("#indicator")).to_have_attribute("data-mode", re.compile("live|polling"), timeout=15000)
    return page


def shot(page: Page, name: str, full_page: bool = False) -> None:
    """The docs' screenshots, made again only on request (EVERYSTEP_SCREENSHOTS=1),
    so a test run leaves the tree as it was."""
    png = page.screenshot(full_page=full_page)
    assert png.startswith(b"\x89PNG")
    if os.environ.get("EVERYSTEP_SCREENSHOTS") == "1":
        (DOCS / f"ui-{name}.png").write_bytes(png)


def test_the_list_updates_live_when_a_run_completes(db, browser, ui_url):
    db.schedule_many(ui_workflows.nested, [(n,) for n in range(4)])
    page = open_page(browser, ui_url, OPERATOR)
    expect(page.locator("#indicator")).to_have_text("live")
    [run] = db.schedule_many(ui_workflows.slow, [(4.0,)])
    row = page.locator(f"tr[data-run='{run.id}']")
    expect(row).to_have_attribute("data-status", "running", timeout=15000)
    shot(page, "runs")
    expect(row).to_have_attribute("data-status", "completed", timeout=15000)  # no reload: pushed
    expect(page.locator(".count.completed b")).to_have_text("5")
    page.close()


def test_polling_when_server_sent_events_are_unavailable(db, browser, ui_url):
    page = open_page(browser, ui_url, VIEWER, init_script="delete window.EventSource")
    expect(page.locator("#indicator")).to_have_text("polling")
    [run] = db.schedule_many(ui_workflows.slow, [(0.1,)])
    expect(page.locator(f"tr[data-run='{run.id}']")).to_have_attribute("data-status", "completed", timeout=15000)
    page.close()


def test_filters_and_search(db, browser, ui_url):
    nested = db.schedule_many(ui_workflows.nested, [(n,) for n in range(3)])
    wait_for(lambda: all(db.run(r.id)["status"] == "completed" for r in nested), 30)
    db.query("INSERT INTO everystep_workflow (id, name, args, status) VALUES (gen_random_uuid(), 'app.absent',"
             " '[]', 'scheduled') RETURNING id")  # a workflow no worker knows: stays scheduled
    page = open_page(browser, ui_url, VIEWER)
    page.select_option("select[name=status]", "completed")
    page.click("#filters button:text('Filter')")
    expect(page.locator("#runs tr")).to_have_count(3)
    page.select_option("select[name=status]", "")
    page.fill("input[name=q]", str(nested[1].id))
    page.click("#filters button:text('Filter')")
    expect(page.locator("#runs tr")).to_have_count(1)
    expect(page.locator(f"tr[data-run='{nested[1].id}']")).to_be_visible()
    page.fill("input[name=q]", "[2]")  # args containment
    page.click("#filters button:text('Filter')")
    expect(page.locator(f"tr[data-run='{nested[2].id}']")).to_be_visible()
    expect(page.locator("#runs tr")).to_have_count(1)
    page.close()


def test_the_graph_of_nested_parallel(db, browser, ui_url):
    [run] = db.schedule_many(ui_workflows.nested, [(4,)])
    wait_for(lambda: db.run(run.id)["status"] == "completed", 30)
    page = open_page(browser, ui_url, VIEWER)
    page.goto(f"{ui_url}/#run/{run.id}")  # a deep link
    nodes = page.locator("g.node")
    expect(nodes).to_have_count(6)
    expect(page.locator("g.node[data-state='done']")).to_have_count(6)
    expect(page.locator("polygon.fork")).to_have_count(4)  # two forks, each split and join
    box_first = page.locator("g.node[data-step='1']").bounding_box()
    box_a = page.locator("g.node[data-step='2.1.2.0.1']").bounding_box()
    box_b = page.locator("g.node[data-step='2.1.2.1.1']").bounding_box()
    assert box_first["x"] < box_a["x"] and abs(box_a["x"] - box_b["x"]) < 1 and box_a["y"] < box_b["y"]
    page.locator("g.node[data-step='2.1.2.1.1']").click()
    expect(page.locator("#step-result")).to_have_text("4")
    expect(page.locator("#timeline .lane")).to_have_count(6)  # when each step started and ended
    page.click("button:text('fit')")
    shot(page, "run", full_page=True)
    page.close()


def test_resolving_a_blocked_run_from_the_page_completes_it(db, browser, ui_url):
    run = blocked_run(db, "o-9")
    page = open_page(browser, ui_url, OPERATOR)
    page.goto(f"{ui_url}/runs/{run}")  # the path form of a deep link
    expect(page.locator("#resolve")).to_contain_text("blocked on step 1")
    expect(page.locator("g.node[data-step='1']")).to_have_attribute("data-state", "uncertain")
    shot(page, "blocked")
    page.fill("#resolve-form input[name=value]", '"charged o-9"')
    page.click("#resolve-form button")
    wait_for(lambda: db.run(run)["status"] == "completed", 30, what="the resolved run to complete")
    expect(page.locator("article.run")).to_have_attribute("data-status", "completed", timeout=15000)
    expect(page.locator("#run-result")).to_have_text('"shipped o-9"')
    page.goto(f"{ui_url}/#audit")
    expect(page.locator("table.audit")).to_contain_text("resolve-step")
    page.close()


# The runs list's first fetch answers 2 s late: a view left before its
# answers came must not draw itself over the one the page moved on to.
SLOW_WORKFLOWS = """const fetched = window.fetch;
window.fetch = (url, ...rest) => String(url).includes("/api/workflows")
  ? new Promise((done) => setTimeout(done, 2000)).then(() => fetched(url, ...rest)) : fetched(url, ...rest);"""


def test_a_view_left_before_its_answers_came_does_not_cover_the_next(db, browser, ui_url):
    run = blocked_run(db)
    page = open_page(browser, ui_url, OPERATOR, init_script=SLOW_WORKFLOWS)
    page.goto(f"{ui_url}/#run/{run}")
    expect(page.locator("#resolve")).to_be_visible()
    page.wait_for_timeout(2500)  # the runs list's answers are in by now
    expect(page.locator("#resolve")).to_be_visible()
    expect(page.locator("#runs-table")).to_have_count(0)
    page.close()


def test_a_viewer_cannot_act_and_csrf_is_refused(db, browser, ui_url):
    run = blocked_run(db)
    viewer = open_page(browser, ui_url, VIEWER)
    viewer.goto(f"{ui_url}/#run/{run}")
    expect(viewer.locator("#resolve")).to_be_visible()
    expect(viewer.locator("#resolve-form")).to_have_count(0)  # no form for a viewer...
    status = viewer.evaluate("""async (run) => (await fetch('/api/actions/resolve', {method: 'POST',
        headers: {'Content-Type': 'application/json', 'X-CSRF-Token': document.querySelector(
        'meta[name="everystep-csrf-token"]').content}, body: JSON.stringify({run, step: '1', outcome: 'discard'})
        })).status""", str(run))
    assert status == 403  # ...and the server refuses it anyway
    operator = open_page(browser, ui_url, OPERATOR)
    status = operator.evaluate("""async (run) => (await fetch('/api/actions/resolve', {method: 'POST',
        headers: {'Content-Type': 'application/json'}, body: JSON.stringify({run, step: '1', outcome: 'discard'})
        })).status""", str(run))
    assert status == 403  # an operator's session without the page's CSRF token
    assert db.run(run)["status"] == "blocked"
    viewer.close()
    operator.close()
