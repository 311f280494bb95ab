"""The graphs pages: the list filtered by status, a graph drawn with its
members and edges, each member linking to its run, and a member's run page
linking back (Playwright and Debian's Chromium, as tests/test_ui_browser.py;
skipped likewise)."""

from __future__ import annotations

import everystep
from everystep import dags
from tests.apps import ui_workflows
from tests.support.processes import wait_for
from tests.test_ui_browser import VIEWER, browser, open_page, ui_url  # noqa: F401  (fixtures)


def test_the_graph_pages_draw_members_and_edges_and_link_to_runs(db, browser, ui_url):  # noqa: F811
    from playwright.sync_api import expect  # noqa: PLC0415  (after test_ui_browser's skip without Chromium)

    with db.connect() as conn, everystep.transaction(conn):
        g = dags.create("ui-wave")
        root = g.add(ui_workflows.nested, 1, key="root")
        left = g.add(ui_workflows.nested, 2, key="left", depends_on=[root])
        g.add(ui_workflows.nested, 3, key="right", depends_on=[root])
        g.add(ui_workflows.typed, key="join", depends_on=["left", "right"])
        g.seal()
        dags.create("ui-open").add(ui_workflows.nested, 1, key="only")
    wait_for(lambda: db.value("SELECT count(*) FROM everystep_workflow WHERE status = 'completed'") == 4, 30,
             what="the graph completed")
    page = open_page(browser, ui_url, VIEWER)
    page.click("nav a[data-view=dags]")
    expect(page.locator("#dags tr[data-key='ui-wave']")).to_contain_text("completed")
    expect(page.locator("#dags tr[data-key='ui-open']")).to_contain_text("open")
    page.click("#dag-filters a[data-status=open]")
    expect(page.locator("#dags tbody tr")).to_have_count(1)
    expect(page.locator("#dags tbody tr")).to_contain_text("ui-open")
    page.goto(f"{ui_url}/#dag/ui-wave")
    nodes = page.locator("#dag-graph .dag-node")
    expect(nodes).to_have_count(4)
    expect(page.locator("#dag-graph .edge")).to_have_count(4)
    expect(page.locator("#dag-graph .edge[data-from=left][data-to=join]")).to_have_count(1)
    expect(page.locator("#dag-graph .dag-node[data-member=join]")).to_have_attribute("data-status", "completed")
    page.click("#dag-graph .dag-node[data-member=left]")
    expect(page.locator("article.run h2")).to_contain_text(str(left.run_id))
    expect(page.locator("#run-dag")).to_have_text("ui-wave")
    page.click("#run-dag")
    expect(page.locator("#dag-graph .dag-node")).to_have_count(4)
    page.close()
