"""Scrape cost after many child restarts, with the archive (supervisor's
mark_dead) and without it (prometheus_client's mark_process_dead alone).

Each restart is a real process (forked, as the arbiter forks) that records a
worker's metrics, exits, is reaped and marked dead. Then the folder is read
the way the HTTP child reads it on /metrics, many times.

python tests/benchmarks/bench_scrape.py [--restarts 200] [--scrapes 50] [--quick]
Prints one JSON line."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402

from supervisor import metrics_dir  # noqa: E402
from supervisor.http_server import FolderCollector  # noqa: E402

RUNNERS = 4


def restart_children(folder: Path, restarts: int, stock: bool) -> None:
    metrics_dir.prepare(folder)
    command = [sys.executable, "-m", "tests.apps.obs_restarts", str(folder), str(restarts), str(RUNNERS)]
    subprocess.run(command + (["--stock"] if stock else []), cwd=ROOT, check=True,
                   env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(folder)})


def scrape_ms(folder: Path, scrapes: int) -> list[float]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FolderCollector(folder))
    timings = []
    for _ in range(scrapes):
        started = time.perf_counter()
        generate_latest(registry)
        timings.append((time.perf_counter() - started) * 1000)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--restarts", type=int, default=200)
    parser.add_argument("--scrapes", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="20 restarts, 10 scrapes (CI)")
    args = parser.parse_args()
    restarts, scrapes = (20, 10) if args.quick else (args.restarts, args.scrapes)

    figures: dict = {"benchmark": "scrape", "restarts": restarts, "scrapes": scrapes}
    with tempfile.TemporaryDirectory() as tmp:
        for label, stock in (("", False), ("_without_archive", True)):
            folder = Path(tmp) / f"metrics{label}"
            started = time.perf_counter()
            restart_children(folder, restarts, stock)
            figures[f"restarts_s{label}"] = round(time.perf_counter() - started, 3)
            timings = scrape_ms(folder, scrapes)
            figures[f"files{label}"] = len(list(folder.glob("*.db")))
            figures[f"scrape_ms_p50{label}"] = round(statistics.median(timings), 3)
            figures[f"scrape_ms_p95{label}"] = round(statistics.quantiles(timings, n=20)[-1], 3)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
