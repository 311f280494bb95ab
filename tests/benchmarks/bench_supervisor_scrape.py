"""supervisor_scrape: the cost of /metrics of a real `everystep-supervisor`
before and after hundreds of child restarts.

A supervisor with two workers runs on a schema of its own. Each restart
SIGKILLs the worker that has just completed a run, so the supervisor restarts
it at once (a child that claimed work is not crash-looping). /metrics is
scraped over HTTP before (after as many runs, without restarts) and after, and
the multiprocess folder's files are counted.

python -m tests.benchmarks.bench_supervisor_scrape [--restarts 200] [--scrapes 100] [--quick]
Prints one JSON line."""

import argparse
import statistics
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.apps import workflows
from tests.benchmarks import harness
from tests.support.processes import wait_for
from tests.support.supervisor_process import SupervisorProcess, config, restart_workers

QUICK = {"restarts": 20, "scrapes": 20}


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
    args = harness.arguments(parser, quick=QUICK)
    with harness.schema() as db, harness.scratch() as folder:
        marks = folder / "marks"
        marks.mkdir()
        sup = SupervisorProcess(config(db.url, "bench"), folder / "supervisor")
        try:
            harness.emit(run(sup, db, str(marks), args.restarts, args.scrapes))
        finally:
            sup.close()


def run(sup: SupervisorProcess, db, marks: str, restarts: int, scrapes: int) -> dict:
    url = f"http://127.0.0.1:{sup.port}/metrics"
    sup.wait_workers({"bench-0", "bench-1"})
    wait_for(lambda: scrape(url)[1].get("everystep_worker_pool_size") == 8, timeout=30, what="two workers")
    folder = sup.metrics_folder
    # Runs first, without restarts, so that "before" serves the same series as "after".
    db.schedule_many(workflows.quick, [(marks,)] * 20)
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
