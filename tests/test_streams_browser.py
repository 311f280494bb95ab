"""A run's page shows its durable streams live, in a real browser
(Playwright driving Chromium, as tests/test_ui_browser.py; skipped the same
way where Chromium is absent)."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect

from tests.apps import stream_workflows
from tests.support.processes import wait_for
from tests.support.supervisor_process import config
from tests.test_ui import VIEWER
from tests.test_ui_browser import browser, open_page  # noqa: F401  (a fixture, and the login)


@pytest.fixture
def ui_url(db, supervisors, monkeypatch):
    monkeypatch.setenv("EVERYSTEP_UI_VIEWER_TOKEN", VIEWER)
    sup = supervisors(config(db.url, "streamui", imports=["tests.apps.stream_workflows"],
                             ui={"bind": "127.0.0.1", "port": 0, "viewer_token": "${EVERYSTEP_UI_VIEWER_TOKEN}"}))
    match = wait_for(lambda: re.search(r"ui: serving on (http://[^ ]+)/", sup.output()), 30, what="the UI to serve")
    return match[1]


def test_the_run_page_shows_its_streams_live(db, browser, ui_url):  # noqa: F811
    [run] = db.schedule_many(stream_workflows.ticks, [(12, 0.5)])
    wait_for(lambda: db.value("SELECT count(*) FROM everystep_stream WHERE run_id = %s", (run.id,)) > 0, 30,
             what="the first entry")
    page = open_page(browser, ui_url, VIEWER)
    page.goto(f"{ui_url}/#run/{run.id}")
    stream = page.locator("pre.stream[data-stream='out']")
    expect(stream).to_contain_text("tick 0.", timeout=15000)
    partial = stream.text_content()
    assert db.run(run.id)["status"] != "completed"  # shown while the run goes on ...
    expect(stream).to_contain_text("tick 11.", timeout=30000)  # ... and as it grows, to its end
    expect(stream).to_have_attribute("data-state", "closed", timeout=15000)
    assert stream.text_content() == "".join(f"tick {i}. " for i in range(12))
    assert len(partial) < len(stream.text_content())
