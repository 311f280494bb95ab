"""Who did it: per-person UI credentials (`ui.users`), the user a trusted
authenticating proxy names in a header (`ui.trusted_user_header`, only from
`ui.trusted_proxies`), the audit trail naming the person, the audit page's
filters, and the database's environment in the header. Against a real
`everystep ui` process."""

from __future__ import annotations

import pytest
import yaml

from tests.apps import ui_workflows
from tests.support.ui_process import Client, UiProcess

ALICE = "alice-token-0123456789"
BOB = "bob-token-0123456789"
SHARED = "shared-operator-token-0123"


@pytest.fixture
def ui(db, tmp_path):
    started = []

    def start(ui_section: dict) -> str:
        config = tmp_path / f"ui-{len(started)}.yaml"
        config.write_text(yaml.safe_dump({"ui": {"port": 0, **ui_section}}))
        process = UiProcess(db.url, tmp_path / "ui", args=("-c", str(config)),
                            env={"EVERYSTEP_UI_VIEWER_TOKEN": "", "EVERYSTEP_UI_OPERATOR_TOKEN": ""})
        started.append(process)
        return process.url

    yield start
    for process in started:
        process.close()


def audit_rows(db) -> list[tuple]:
    return db.query("SELECT actor, source, action FROM everystep_audit ORDER BY id")


def test_each_person_acts_under_their_own_name(db, ui):
    runs = db.schedule_many(ui_workflows.nested, [(1,), (2,), (3,)])
    base = ui({"operator_token": SHARED, "users": {"alice": {"token": ALICE, "role": "operator"},
                                                     "bob": {"token": BOB, "role": "viewer"}}})
    status, me = Client(base, ALICE).get("/api/me")
    assert status == 200 and me == {"name": "alice", "role": "operator", "environment": None}
    assert Client(base, BOB).get("/api/me")[1]["role"] == "viewer"
    assert Client(base, "nobody-0123456789").get("/api/me")[0] == 401

    status, answer = Client(base, ALICE).request("POST", "/api/actions/cancel", {"runs": [str(runs[0].id)]})
    assert status == 200, answer
    status, answer = Client(base, BOB).request("POST", "/api/actions/cancel", {"runs": [str(runs[1].id)]})
    assert status == 403 and db.run(runs[1].id)["status"] == "scheduled"
    # The shared token of before still works, as the anonymous "operator".
    assert Client(base, SHARED).request("POST", "/api/actions/cancel", {"runs": [str(runs[2].id)]})[0] == 200
    assert audit_rows(db) == [("alice", "ui", "cancel"), ("operator", "ui", "cancel")]

    # A browser session: the login page takes the person's token; the page names them.
    browser = Client(base)
    assert browser.request("POST", "/login", form={"token": ALICE})[0] == 200
    status, page = browser.get("/")
    assert status == 200 and "alice · operator" in page


def test_a_trusted_proxy_names_the_user_and_any_other_address_is_ignored(db, ui):
    [run, other] = db.schedule_many(ui_workflows.nested, [(1,), (2,)])
    header = {"X-Forwarded-User": "dave"}
    base = ui({"trusted_user_header": "X-Forwarded-User", "trusted_proxies": ["127.0.0.0/8"],
               "users": {"dave": {"role": "operator"}}})  # dave has no token: only through the proxy
    client = Client(base)
    status, me = client.request("GET", "/api/me", headers=header)
    assert status == 200 and (me["name"], me["role"]) == ("dave", "operator")
    # Someone the proxy names who is not in ui.users: trusted_user_role (viewer by default).
    assert client.request("GET", "/api/me", headers={"X-Forwarded-User": "erin"})[1]["role"] == "viewer"
    assert client.request("POST", "/api/actions/cancel", {"runs": [str(run.id)]},
                          headers={"X-Forwarded-User": "erin", "X-CSRF-Token": "x"})[0] == 403
    assert client.request("GET", "/api/me")[0] == 401  # no header, no token
    # A browser behind the proxy: the page's CSRF token is bound to the person.
    status, page = client.request("GET", "/", headers=header)
    assert status == 200 and "dave · operator" in page and "log out" not in page
    import re  # noqa: PLC0415

    csrf = re.search(r'name="everystep-csrf-token" content="([0-9a-f]+)"', page)[1]
    assert client.request("POST", "/api/actions/cancel", {"runs": [str(run.id)]}, headers=header)[0] == 403
    status, answer = client.request("POST", "/api/actions/cancel", {"runs": [str(run.id)]},
                                    headers={**header, "X-CSRF-Token": csrf})
    assert status == 200, answer
    assert audit_rows(db) == [("dave", "ui", "cancel")]

    # The same header from an address that is not a trusted proxy's is ignored.
    base = ui({"trusted_user_header": "X-Forwarded-User", "trusted_proxies": ["10.9.9.9"],
               "users": {"dave": {"role": "operator"}}, "viewer_token": "viewer-token-0123456789"})
    assert Client(base).request("GET", "/api/me", headers=header)[0] == 401
    # Nor does a forwarded-for header make a client the proxy: the peer address is the socket's.
    assert Client(base).request("GET", "/api/me", headers={**header, "X-Forwarded-For": "10.9.9.9",
                                                             "Forwarded": "for=10.9.9.9"})[0] == 401
    assert Client(base).request("POST", "/api/actions/cancel", {"runs": [str(other.id)]}, headers=header)[0] == 401
    assert db.run(other.id)["status"] == "scheduled" and len(audit_rows(db)) == 1


def test_trusted_user_role_none_lets_in_only_the_listed_people(db, ui):
    base = ui({"trusted_user_header": "X-Remote-User", "trusted_proxies": ["127.0.0.1"],
               "trusted_user_role": "none", "users": {"fay": {"role": "viewer"}}})
    assert Client(base).request("GET", "/api/me", headers={"X-Remote-User": "fay"})[0] == 200
    assert Client(base).request("GET", "/api/me", headers={"X-Remote-User": "gus"})[0] == 401


def test_the_audit_page_filters_by_person_action_and_run(db, ui):
    runs = db.schedule_many(ui_workflows.nested, [(1,), (2,), (3,)])
    base = ui({"users": {"alice": {"token": ALICE, "role": "operator"}, "bob": {"token": BOB, "role": "operator"}}})
    assert Client(base, ALICE).request("POST", "/api/actions/cancel", {"runs": [str(runs[0].id)]})[0] == 200
    assert Client(base, BOB).request("POST", "/api/actions/cancel", {"runs": [str(runs[1].id)]})[0] == 200
    assert Client(base, BOB).request("POST", "/api/actions/reschedule", {"runs": [str(runs[2].id)]})[0] == 200
    client = Client(base, ALICE)

    def records(query: str) -> list[tuple]:
        status, answer = client.get(f"/api/audit?{query}")
        assert status == 200, answer
        return [(r["actor"], r["action"]) for r in answer["records"]]

    assert records("") == [("bob", "schedule-again"), ("bob", "cancel"), ("alice", "cancel")]
    assert records("actor=alice") == [("alice", "cancel")]
    assert records("actor=bob&action=cancel") == [("bob", "cancel")]
    assert records("action=schedule-again") == [("bob", "schedule-again")]
    assert records(f"run={runs[1].id}") == [("bob", "cancel")]
    assert records(f"actor=alice&run={runs[1].id}") == []
    assert records("actor=nobody") == []
    for query, needle in [("run=nope", "not a run id"), ("action=drop%20table", "action must be"),
                          ("before=x", "before must be"), ("limit=0", "limit must be"),
                          ("actor=" + "x" * 300, "actor must be at most")]:
        status, answer = client.get(f"/api/audit?{query}")
        assert status == 400 and needle in answer["error"], (query, answer)


def test_the_header_shows_the_environment(db, ui):
    from everystep.cli import main  # noqa: PLC0415

    assert main(["--database-url", db.url, "migrate", "--environment", "staging"]) == 0
    base = ui({"users": {"alice": {"token": ALICE, "role": "viewer"}}})
    client = Client(base, ALICE)
    assert client.get("/api/me")[1]["environment"] == "staging"
    status, page = client.get("/")
    assert status == 200 and 'id="environment"' in page and ">staging</span>" in page
