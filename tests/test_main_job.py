"""The README's first command: the shipped everystep.yaml runs the demo
workflows on the embedded PostgreSQL, with nothing else configured."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest
import yaml

from tests.support.private_postgres import private_folder
from tests.support.processes import ROOT, wait_for


@pytest.fixture
def folder():
    """The supervisor's working folder, where the embedded server keeps its
    data: outside pytest's temporary folders (see tests/support/private_postgres.py)."""
    path = private_folder()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_shipped_config_runs_the_demo_on_the_embedded_database(folder):
    tmp_path = folder
    config = yaml.safe_load((ROOT / "everystep.yaml").read_text())
    config["http"]["port"] = 0  # the only change: tests run side by side
    (tmp_path / "everystep.yaml").write_text(yaml.safe_dump(config))
    env = {key: value for key, value in os.environ.items()
           if key not in ("EVERYSTEP_DATABASE_URL", "POD_NAME", "PROMETHEUS_MULTIPROC_DIR")}
    env["PYTHONUNBUFFERED"] = "1"
    log_path = tmp_path / "supervisor.log"
    with open(log_path, "w") as log:
        supervisor = subprocess.Popen([sys.executable, "-m", "supervisor", "-c", "everystep.yaml"], cwd=tmp_path,
                                      stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_for(lambda: log_path.read_text().count("holding the lock of") == 2, timeout=90,
                 what="two workers on the embedded database")
        assert "embedded PostgreSQL running" in log_path.read_text()

        def everystep(*args: str) -> str:
            result = subprocess.run([sys.executable, "-m", "everystep", "-c", "everystep.yaml", *args],
                                    cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
            assert result.returncode == 0, result.stderr
            return result.stdout

        created = everystep("schedule", "everystep.demo:process_order", '"ada"')
        run_id = created.split()[2]
        wait_for(lambda: any(status in everystep("runs", "show", run_id) for status in
                             ("status          completed", "status          failed", "status          stopped")),
                 timeout=30, what="the demo order to end")
        assert f"order {run_id[-6:]}: " in log_path.read_text()  # the demo's steps logged
        schedules = everystep("schedules", "list")
        assert "demo-orders-ada" in schedules and "active" in schedules
    finally:
        supervisor.send_signal(signal.SIGTERM)
        code = supervisor.wait(60)
    assert code == 0, log_path.read_text()[-3000:]
    assert "embedded PostgreSQL stopped" in log_path.read_text()
