"""The console's charts on a big table: with N runs (10,000,000 by default,
over 30 days, as bench_ui fills them) what the maintenance child's rollup of
the per-minute figures costs (the first one, over the last hour; the steady
one, every 10 s, over the current minute; the backlog's sample), and what
each chart's read costs the page (the hour and the day of per-minute
figures, the step duration percentiles, a schedule's fires).

python -m tests.benchmarks.bench_charts [--runs 10000000] [--quick]
Prints one JSON line."""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import everystep.db  # noqa: E402
from everystep.db import queries  # noqa: E402
from everystep.ui.core import Console  # noqa: E402
from tests.benchmarks.bench_ui import fill, server_ms  # noqa: E402
from tests.benchmarks.harness import arguments, emit, schema  # noqa: E402

FIRES = 10_000


def timed_ms(call) -> float:
    started = time.perf_counter()
    call()
    return round((time.perf_counter() - started) * 1000, 2)


def main() -> None:
    args = arguments(_parser(), {"runs": 20_000})
    with schema() as db:
        started = time.perf_counter()
        fill(db, args.runs)
        with db.connect() as conn:
            conn.execute(
                "INSERT INTO everystep_schedule (key, workflow, args, cron, timezone, catchup, max_catchup, overlap,"
                " max_lateness_seconds, paused, next_fire_at) VALUES ('every-minute', 'app.workflows.wf1', '[]',"
                " '* * * * *', 'UTC', 'skip', 1, 'allow', 60, false, now())")
            conn.execute(
                "INSERT INTO everystep_schedule_run (schedule_key, fire_at, run_id)"
                " SELECT 'every-minute', now() - make_interval(mins => n::int), id"
                " FROM (SELECT id, row_number() OVER (ORDER BY created_at DESC) AS n FROM everystep_workflow"
                "       ORDER BY created_at DESC LIMIT %(fires)s) r", {"fires": FIRES})
        fill_s = time.perf_counter() - started
        console = Console(db.url)
        try:
            with db.connect() as conn:
                day_ago = everystep.db.database_now(conn) - datetime.timedelta(days=1)

                def roll_up(since: datetime.datetime) -> None:
                    with conn.transaction():
                        conn.execute(queries.get("roll_up_minutes"),
                                     {"since": since, "lookback_s": everystep.db.CHART_LOOKBACK_S})

                backfill_day_ms = timed_ms(lambda: roll_up(day_ago))  # a day of figures, for the day chart
                first_ms = timed_ms(lambda: everystep.db.roll_up_minutes(conn))
                steady = server_ms(lambda: everystep.db.roll_up_minutes(conn, sample_backlog=False), 10)
                sample = server_ms(lambda: everystep.db.roll_up_minutes(conn, sample_backlog=True), 10)
                figure_rows = conn.execute("SELECT count(*) FROM everystep_minute").fetchone()[0]
            figures = {
                "benchmark": "charts", "runs": args.runs, "fill_s": round(fill_s, 1), "figure_rows": figure_rows,
                "rollup_backfill_day_ms": backfill_day_ms, "rollup_first_hour_ms": first_ms,
                "rollup_steady_ms": steady, "rollup_with_backlog_sample_ms": sample,
                "chart_hour_ms": server_ms(lambda: console.charts({"window": "hour"})),
                "chart_day_ms": server_ms(lambda: console.charts({"window": "day"})),
                "chart_day_one_workflow_ms": server_ms(lambda: console.charts({"window": "day",
                                                                              "workflow": "app.workflows.wf3"})),
                "schedule_fires_ms": server_ms(lambda: console.schedule_fires("every-minute")),
            }
        finally:
            console.close()
    emit(figures)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10_000_000)
    return parser


if __name__ == "__main__":
    main()
