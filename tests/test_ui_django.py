"""The UI mounted in a Django project's URLconf, with Django's test client:
staff only, Django's CSRF check on actions, the Django user in the audit."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.processes import ROOT
from tests.test_ui import blocked_run


def test_the_ui_behind_djangos_auth(db):
    run = blocked_run(db)
    result = subprocess.run([sys.executable, "-m", "tests.apps.django_ui", db.url, str(run)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["anonymous"] == [302, 302]  # to Django's login
    assert out["not_staff"] == 403
    assert out["page"] == 200 and out["page_has_csrf"] and out["static"] == 200
    assert out["runs"] == [200, [str(run)]]
    assert out["bad_filter"] == 400
    assert out["post_without_csrf"] == 403
    assert out["post_with_csrf"] == 200
    assert out["events"].startswith("id: 1\nevent: overview\ndata: {")
    assert out["unknown_run_stream"] == 404  # the stream route is there, behind the same checks
    assert db.run(run)["status"] == "scheduled"
    assert db.query("SELECT actor, source, action FROM everystep_audit") == [("ada", "ui", "resolve-step")]
