"""The UI's attribute filter (in the URL), a run's attributes on its page,
and the bulk action by filter: a preview with the count and a sample, then
the action confirmed by typing the count; operators only, audited."""

from __future__ import annotations

import everystep
from tests.apps import attribute_workflows as flows
from tests.support.ui_process import Client
from tests.test_ui import OPERATOR, VIEWER, ui  # noqa: F401  (its fixture)


def scheduled(db, count: int, **attributes) -> list:
    with db.connect() as conn, everystep.transaction(conn):
        return everystep.schedule_many(flows.noop, [(i,) for i in range(count)], attributes=attributes)


def test_the_list_filters_by_attributes_and_a_run_shows_them(db, ui):  # noqa: F811
    acme = scheduled(db, 3, tenant="acme", order=42)
    scheduled(db, 2, tenant="globex")
    client = Client(ui())
    status, page = client.get("/api/runs?attr=tenant%3Dacme")
    assert status == 200 and {run["id"] for run in page["runs"]} == {str(r.id) for r in acme}
    status, page = client.get("/api/runs?attr=tenant%3Dacme%2Corder%3D42")
    assert status == 200 and len(page["runs"]) == 3
    status, page = client.get('/api/runs?attr={"tenant":"globex"}')
    assert status == 200 and len(page["runs"]) == 2
    status, answer = client.get("/api/runs?attr=tenant")
    assert status == 400 and "attr" in answer["error"]
    status, run = client.get(f"/api/runs/{acme[0].id}")
    assert run["attributes"] == {"tenant": "acme", "order": 42}


def test_bulk_by_filter_previews_then_acts_when_the_count_is_typed(db, ui):  # noqa: F811
    acme = scheduled(db, 25, tenant="acme")
    scheduled(db, 2, tenant="globex")
    base = ui(EVERYSTEP_UI_VIEWER_TOKEN=VIEWER, EVERYSTEP_UI_OPERATOR_TOKEN=OPERATOR)
    body = {"action": "cancel", "filter": {"attr": "tenant=acme", "status": "scheduled"}, "reason": "left"}
    viewer = Client(base, VIEWER)
    status, answer = viewer.request("POST", "/api/actions/bulk-preview", body)
    assert status == 403 and "viewers cannot act" in answer["error"]
    operator = Client(base, OPERATOR)
    status, preview = operator.request("POST", "/api/actions/bulk-preview", body)
    assert status == 200, preview
    assert preview["count"] == 25
    assert preview["sample"] == [str(run) for run in sorted((r.id for r in acme), reverse=True)[:20]]
    status, answer = operator.request("POST", "/api/actions/bulk", {**body, "confirm": "24"})
    assert status == 409 and "finds 25" in answer["error"]
    status, answer = operator.request("POST", "/api/actions/bulk", {"action": "cancel", "filter": {}, "confirm": "0"})
    assert status == 400 and "empty filter" in answer["error"]
    status, answer = operator.request("POST", "/api/actions/bulk",
                                      {**body, "filter": {**body["filter"], "q": "x"}, "confirm": "25"})
    assert status == 400 and "search box" in answer["error"]
    assert db.value("SELECT count(*) FROM everystep_workflow WHERE status = 'cancelled'") == 0
    status, answer = operator.request("POST", "/api/actions/bulk", {**body, "confirm": "25"})
    assert status == 200, answer
    assert (answer["done_count"], answer["refused_count"]) == (25, 0)
    assert {db.run(r.id)["status"] for r in acme} == {"cancelled"}
    assert db.query("SELECT actor, source FROM everystep_audit WHERE action = 'bulk-cancel'") == [("operator", "ui")]
    assert db.value("SELECT count(*) FROM everystep_audit WHERE action = 'cancel' AND source = 'ui'") == 25
