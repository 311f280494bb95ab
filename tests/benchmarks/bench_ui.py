"""The UI on a big table: with N runs (1,000,000 by default) the server time
of the list's first page, a filtered page, a page deep in the keyset, a
search by args, a run's detail and the live page's poll; and what ten open
live pages cost the database (queries per second, however many pages).

Server time is the time the UI's code takes to answer (its queries and the
shaping of the answer), measured in the process, without the network.

python -m tests.benchmarks.bench_ui [--runs 1000000] [--seconds 10] [--quick]
Prints one JSON line."""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import uvicorn  # noqa: E402

from everystep.ui import server  # noqa: E402
from everystep.ui.core import Console  # noqa: E402
from everystep.ui.web import create_app  # noqa: E402
from tests.benchmarks.harness import arguments, emit, median, percentiles, schema  # noqa: E402

WORKFLOWS = 20
REPEATS = 30
PAGES = 10
TARGET_MS = 100


def fill(db, runs: int) -> str:
    """N runs in one INSERT ... SELECT generate_series, over 30 days, most of
    them completed (workflow and status independent of each other); two
    steps for each of the newest 50,000; a run with 40 steps for the detail.
    Returns that run's id."""
    with db.connect() as conn:
        conn.execute(
            "INSERT INTO everystep_workflow (id, name, args, idempotency_key, status, claimed_by, result, error,"
            " created_at, completed_at)"
            " SELECT gen_random_uuid(), 'app.workflows.wf' || ((i / 100) %% %(workflows)s),"
            "  jsonb_build_array(jsonb_build_object('order', i, 'region', 'r' || (i %% 7))),"
            "  CASE WHEN i %% 10 = 0 THEN 'key-' || i END, s.status, 'bench-' || (i %% 8),"
            "  CASE WHEN s.status = 'completed' THEN to_jsonb(i) END,"
            "  CASE WHEN s.status = 'failed' THEN jsonb_build_object('type', 'app.Error' || (i %% 3),"
            "   'message', 'boom', 'args', '[]'::jsonb) END,"
            "  t.at, CASE WHEN s.status IN ('completed', 'failed', 'stopped') THEN t.at + interval '2 seconds' END"
            " FROM generate_series(1, %(runs)s) AS i,"
            " LATERAL (SELECT now() - make_interval(secs => (%(runs)s - i) * 2592000.0 / %(runs)s) AS at) t,"
            " LATERAL (SELECT CASE WHEN i %% 100 < 90 THEN 'completed' WHEN i %% 100 < 96 THEN 'failed'"
            "  WHEN i %% 100 < 97 THEN 'stopped' WHEN i %% 100 < 98 THEN 'scheduled' WHEN i %% 100 < 99 THEN 'running'"
            "  ELSE 'blocked' END AS status) s",
            {"runs": runs, "workflows": WORKFLOWS},
        )
        conn.execute(
            "INSERT INTO everystep_step (workflow_id, step_id, name, args, kwargs, status, result)"
            " SELECT w.id, n::text, 'app.steps.s' || n, '[1]', '{}', 'done', '1'"
            " FROM (SELECT id FROM everystep_workflow ORDER BY created_at DESC LIMIT 50000) w,"
            " generate_series(1, 2) n"
        )
        detail = conn.execute("SELECT id FROM everystep_workflow ORDER BY created_at DESC OFFSET 100 LIMIT 1"
                              ).fetchone()[0]
        conn.execute(
            "INSERT INTO everystep_step (workflow_id, step_id, name, args, kwargs, status, result)"
            " SELECT %s, '3.' || (n %% 4) || '.' || (n / 4 + 1), 'app.steps.branch', '[1]', '{}', 'done', '1'"
            " FROM generate_series(0, 39) n",
            (detail,),
        )
        conn.execute("VACUUM ANALYZE everystep_workflow")
        conn.execute("VACUUM ANALYZE everystep_step")
    return str(detail)


def server_ms(call, repeats: int = REPEATS) -> dict:
    call()  # warm: plans, pool
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        timings.append((time.perf_counter() - started) * 1000)
    cuts = percentiles(timings)
    return {"p50": round(median(timings), 2), "p95": round(cuts["p95"], 2)}


def live_pages(console: Console, pages: int, seconds: float) -> dict:
    """`pages` Server-Sent Event streams and `pages` polling clients on a real
    server for `seconds`: how many times the database was asked."""
    sock = server.bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(create_app(console), log_config=None, access_log=False, lifespan="off"))
    thread = threading.Thread(target=lambda: asyncio.run(uv.serve(sockets=[sock])), daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.05)
    events = [0] * pages
    stop = threading.Event()

    def stream(i: int) -> None:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/events", timeout=seconds + 20) as response:
            for line in response:
                if line.startswith(b"event: overview"):
                    events[i] += 1
                if stop.is_set():
                    return

    def poll() -> None:
        while not stop.is_set():
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/overview", timeout=10).read()
            time.sleep(0.5)

    before = console.hub.queries
    workers = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(pages)]
    workers += [threading.Thread(target=poll, daemon=True) for _ in range(pages)]
    for w in workers:
        w.start()
    time.sleep(seconds)
    stop.set()
    queries = console.hub.queries - before
    uv.should_exit = True
    thread.join(10)
    return {"live_pages": pages, "polling_pages": pages, "live_seconds": seconds,
            "db_queries_per_s": round(queries / seconds, 2), "events_received": sum(events)}


def main() -> None:
    args = arguments(_parser(), {"runs": 5000, "seconds": 2.0})
    with schema() as db:
        started = time.perf_counter()
        detail = fill(db, args.runs)
        fill_s = time.perf_counter() - started
        console = Console(db.url)
        try:
            first = console.runs({})
            cursor = first["next"]
            for _ in range(20):  # 20 pages deep
                cursor = console.runs({"before": cursor})["next"]
            figures = {
                "benchmark": "ui", "runs": args.runs, "fill_s": round(fill_s, 1),
                "first_page_ms": server_ms(lambda: console.runs({})),
                "filtered_page_ms": server_ms(lambda: console.runs({"status": "failed",
                                                                    "workflow": "app.workflows.wf3"})),
                "page_21_ms": server_ms(lambda: console.runs({"before": cursor})),
                "args_search_ms": server_ms(lambda: console.runs({"q": '[{"region": "r3"}]'})),
                # Nothing matches: no index serves containment, so this one reads the table.
                "args_search_no_match_ms": server_ms(lambda: console.runs({"q": '[{"region": "nowhere"}]'}), 5),
                "run_detail_ms": server_ms(lambda: console.run(detail)),
                "live_poll_ms": server_ms(lambda: console._overview()),
                "target_ms": TARGET_MS,
                **live_pages(console, PAGES, args.seconds),
            }
        finally:
            console.close()
    emit(figures)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1_000_000)
    parser.add_argument("--seconds", type=float, default=10.0, help="how long the live pages stay open")
    return parser


if __name__ == "__main__":
    main()
