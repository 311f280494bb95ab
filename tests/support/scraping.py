"""Reading what the HTTP child serves, and a real Prometheus server to
scrape it: helpers shared by the observability tests."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.processes import wait_for

# An answer within this many seconds came from the HTTP child's deadlines (3 s
# for the database), not from a hang; the margin is for a loaded machine.
PROMPTLY = 10.0
UUID_SHAPED = re.compile(r"[0-9a-f]{8}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{12}", re.IGNORECASE)


def get(url: str, timeout: float = 15.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def samples(exposition: str) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels): value} of a text exposition."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(exposition)
        for s in family.samples
    }


def value(exposition: dict, name: str, **labels: str) -> float | None:
    return exposition.get((name, frozenset(labels.items())))


def insert_runs(db, status: str, count: int, age_seconds: float = 0, claimed_by: str | None = None) -> None:
    with db.connect() as conn:
        conn.execute(
            "INSERT INTO everystep_workflow (id, name, args, status, claimed_by, created_at)"
            " SELECT gen_random_uuid(), 'demo.flow', '[]', %s, %s, now() - make_interval(secs => %s)"
            " FROM generate_series(1, %s)",
            (status, claimed_by, age_seconds, count),
        )


def needs_prometheus(*names: str) -> pytest.MarkDecorator:
    """Skip a test whose Prometheus binaries are not installed, with the
    reason printed; with EVERYSTEP_REQUIRE_PROMETHEUS=1 (as CI sets) it runs
    and fails instead."""
    missing = [name for name in names if shutil.which(name) is None]
    return pytest.mark.skipif(
        bool(missing) and os.environ.get("EVERYSTEP_REQUIRE_PROMETHEUS") != "1",
        reason=f"{' and '.join(missing)} not installed (apt-get install prometheus); "
               "EVERYSTEP_REQUIRE_PROMETHEUS=1 makes this a failure",
    )


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed (apt-get install prometheus); these tests need it")
    return path


def _free_port() -> int:
    # For Prometheus only, which cannot say which port it took: everystep's
    # HTTP child binds port 0 and reports the port it got.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    def __init__(self, config: Path, data: Path, log: Path):
        self.base = f"http://127.0.0.1:{_free_port()}"
        self.log = log
        self.process = subprocess.Popen(
            [binary("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={data}",
             f"--web.listen-address={self.base.removeprefix('http://')}"],
            stdout=subprocess.DEVNULL, stderr=log.open("w"),
        )
        wait_for(self._ready, timeout=30, what=f"Prometheus to start (log: {log})")

    def _ready(self) -> bool:
        assert self.process.poll() is None, f"Prometheus exited: {self.log.read_text()}"
        try:
            return get(self.base + "/-/ready", timeout=1)[0] == 200
        except OSError:
            return False

    def api(self, path: str, **params: str) -> dict:
        status, body = get(f"{self.base}/api/v1/{path}?{urllib.parse.urlencode(params)}")
        assert status == 200, body
        return json.loads(body)["data"]

    def query(self, promql: str) -> dict[frozenset, float]:
        result = self.api("query", query=promql)["result"]
        return {frozenset(r["metric"].items()): float(r["value"][1]) for r in result}

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(20)
