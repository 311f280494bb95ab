"""schedule() finds Django's connection when Django is configured."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.processes import ROOT


def test_schedule_joins_the_django_transaction(db):
    result = subprocess.run([sys.executable, "-m", "tests.apps.django_scheduling", db.url], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    rows = db.query("SELECT id::text, idempotency_key, status FROM everystep_workflow ORDER BY idempotency_key")
    (third, third_created) = out["many"][1]
    # The rolled-back one left nothing; schedule_many found django:1 and created django:3.
    assert rows == [(out["committed"], "django:1", "scheduled"), (third, "django:3", "scheduled")]
    assert out["again"] == out["committed"] and out["again_created"] is False
    assert out["many"][0] == [out["committed"], False] and third_created is True


def test_a_graph_is_written_in_the_django_transaction(db):
    result = subprocess.run([sys.executable, "-m", "tests.apps.django_dags", db.url], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert db.query("SELECT key, sealed_at IS NOT NULL FROM everystep_dag") == [("django", True)]
    db.run_pending()
    assert db.query("SELECT status, count(*) FROM everystep_workflow GROUP BY status") == [("completed", 2)]
