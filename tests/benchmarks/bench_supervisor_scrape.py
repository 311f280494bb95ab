"""Scrape cost of a real `everystep-supervisor` before and after hundreds of
child restarts.

A supervisor with two workers runs on the test database (a schema of its
own). Each restart SIGKILLs the worker that has just completed a run, so the
supervisor restarts it at once (a child that claimed work is not
crash-looping). /metrics is scraped over HTTP before (after as many runs,
without restarts) and after, and the multiprocess folder's files are counted.

python tests/benchmarks/bench_supervisor_scrape.py [--restarts 200] [--scrapes 100] [--quick]
Prints one JSON line."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import everystep  # noqa: E402
from everystep import store  # noqa: E402
from tests import workflows  # noqa: E402
from tests.conftest import Database, _find_server  # noqa: E402
from tests.processes import wait_for  # noqa: E402
from tests.supervisor_process import SupervisorProcess, config, restart_workers  # noqa: E402


def scrape(url: str) -> tuple[float, dict[str, float]]:
    """(milliseconds the scrape took, {sample name: sum over its series})."""
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=30) as response:
        body = response.read().decode()
    elapsed = (time.perf_counter() - started) * 1000
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0) + sample.value
    return elapsed, sums


def scrape_ms(url: str, scrapes: int) -> list[float]:
    return [scrape(url)[0] for _ in range(scrapes)]


def figures(label: str, timings: list[float], folder: Path) -> dict:
    return {
        f"scrape_ms_p50{label}": round(statistics.median(timings), 3),
        f"scrape_ms_p95{label}": round(statistics.quantiles(timings, n=20)[-1], 3),
        f"files{label}": len(list(folder.glob("*.db"))),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--restarts", type=int, default=200)
    parser.add_argument("--scrapes", type=int, default=100)
    parser.add_argument("--quick", action="store_true", help="20 restarts, 20 scrapes (CI)")
    args = parser.parse_args()
    restarts, scrapes = (20, 20) if args.quick else (args.restarts, args.scrapes)

    server = _find_server()
    schema = f"bench_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    db = Database(server, schema)
    try:
        with db.connect() as conn:
            store.migrate(conn)
        with tempfile.TemporaryDirectory() as tmp:
            marks = Path(tmp) / "marks"
            marks.mkdir()
            sup = SupervisorProcess(config(db.url, "bench"), Path(tmp) / "supervisor")
            try:
                result = run(sup, db, str(marks), restarts, scrapes)
            finally:
                sup.close()
    finally:
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")
    print(json.dumps(result))


def run(sup: SupervisorProcess, db: Database, marks: str, restarts: int, scrapes: int) -> dict:
    url = f"http://127.0.0.1:{sup.port}/metrics"
    sup.wait_workers({"bench-0", "bench-1"})
    wait_for(lambda: scrape(url)[1].get("everystep_worker_pool_size") == 8, timeout=30, what="two workers")
    folder = sup.metrics_folder
    # Runs first, without restarts, so that "before" serves the same series as "after".
    with db.connect() as conn, everystep.transaction(conn):
        for _ in range(20):
            everystep.schedule(workflows.quick, marks)
    wait_for(lambda: db.value("SELECT count(*) FROM everystep_workflow WHERE status = 'completed'") == 20,
             timeout=60, what="the warm-up runs")
    result: dict = {"benchmark": "supervisor_scrape", "restarts": restarts, "scrapes": scrapes}
    result.update(figures("_before", scrape_ms(url, scrapes), folder))

    started = time.perf_counter()
    restart_workers(sup, db.url, marks, restarts)
    result["restarts_s"] = round(time.perf_counter() - started, 3)

    _, sums = wait_for(lambda: (found := scrape(url))[1].get("everystep_worker_pool_size") == 8 and found,
                       timeout=30, what="two workers after the restarts")
    result.update(figures("", scrape_ms(url, scrapes), folder))
    result["restarts_counted"] = sums.get("everystep_supervisor_child_restarts_total")
    result["runs_counted"] = sums.get("everystep_workflow_runs_total")
    result["backed_off"] = sup.output().count("crashes in a row")
    return result


if __name__ == "__main__":
    main()
