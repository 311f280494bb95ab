"""The benchmarks still work: `python -m tests.benchmarks --quick` runs each
one small and prints one JSON line per benchmark with its figures. Timings are
never asserted here; only that every figure is there."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.processes import ROOT

FIGURES = {
    "limit": {"clients", "driver", "commits_per_s"},
    "w1": {"runs_per_s", "limit_commits_per_s", "limit_driver", "ratio", "target", "db_cpu_us_per_run",
           "worker_cpu_us_per_run", "not_completed"},
    "w3": {"runs_per_s", "steps_per_s", "limit_commits_per_s", "limit_driver", "ratio", "target", "db_cpu_us_per_run",
           "worker_cpu_us_per_run", "not_completed"},
    "w3_write_behind": {"runs_per_s", "steps_per_s", "limit_commits_per_s", "limit_driver", "ratio", "target",
                        "db_cpu_us_per_run", "worker_cpu_us_per_run", "not_completed"},
    "w1_async": {"runs_per_s", "limit_commits_per_s", "limit_driver", "ratio", "target", "db_cpu_us_per_run",
                 "worker_cpu_us_per_run", "not_completed"},
    "w3_async": {"runs_per_s", "steps_per_s", "limit_commits_per_s", "limit_driver", "ratio", "target",
                 "db_cpu_us_per_run", "worker_cpu_us_per_run", "not_completed"},
    "latency": {"runs", "p50_ms", "p95_ms", "p99_ms", "target_p50_ms", "target_p99_ms", "not_completed"},
    "enqueue": {"limit_commits_per_s", "runs_per_s", "ratio", "runs_per_s_notified", "schedule_many_runs_per_s",
                "target_schedule_many_runs_per_s"},
    "fleet": {"runs_per_s_one_supervisor", "runs_per_s", "fleet_over_one", "empty_claims_per_run",
              "notifications_per_schedule", "not_completed"},
    "growth": {"runs_per_s_empty", "runs_per_s_with_history", "with_history_over_empty", "prune_s",
               "runs_per_s_during_prune", "left_after_prune", "not_completed"},
    "recovery": {"interval_s", "grace_s", "running_again_s", "completed_s", "target_s", "not_completed"},
    "memory": {"rss_mb_at_rest", "rss_mb_peak_under_w3", "worker_at_rest_max_mb", "target_worker_at_rest_mb"},
    "scrape": {"restarts", "scrape_ms_p50", "scrape_ms_p50_without_archive"},
    "supervisor_scrape": {"restarts", "scrape_ms_p50_before", "scrape_ms_p50", "files_before", "files",
                          "restarts_counted"},
    "ui": {"runs", "first_page_ms", "filtered_page_ms", "page_21_ms", "args_search_ms", "run_detail_ms",
           "live_poll_ms", "target_ms", "db_queries_per_s", "events_received"},
    "sleep": {"delayed_start_late_p50_ms", "delayed_start_late_p99_ms", "sleep_wake_late_p50_ms",
              "sleep_wake_late_p99_ms", "target_p99_ms", "sleeping_runs", "fleet_cpu_s_per_s_idle",
              "fleet_cpu_s_per_s_sleeping", "db_commits_per_s_idle", "db_commits_per_s_sleeping", "not_completed"},
    "flow": {"messages", "send_to_resume_p50_ms", "send_to_resume_p95_ms", "send_to_resume_p99_ms", "runs",
             "unlimited_runs_per_s", "limited_16_runs_per_s", "limited_16_vs_unlimited", "limited_4_runs_per_s",
             "not_completed", "leftover"},
    "claim_cost": {"runs_per_s_empty", "runs_per_s_with_features", "ratio", "target"},
    "priority": {"backlog", "probes", "backlog_left_min", "pickup_ms_p50", "pickup_ms_max", "target_ms"},
    "fairness": {"big_key_runs", "small_keys", "per_key_limit", "big_completed_before_small_done",
                 "target_big_completed_before", "small_keys_done_s", "most_running_per_key"},
    "rate_limit": {"steps", "workers", "rate_per_s", "burst", "observed_per_s", "observed_over_rate",
                   "max_in_any_1s"},
    "charts": {"runs", "rollup_first_hour_ms", "rollup_steady_ms", "rollup_with_backlog_sample_ms", "chart_hour_ms",
               "chart_day_ms", "chart_day_one_workflow_ms", "schedule_fires_ms"},
    "history": {"history", "fill_s", "runs_per_s_empty", "runs_per_s_with_history", "with_history_over_empty",
                "retention_removed", "retention_dropped_partitions", "retention_s", "runs_per_s_during_retention",
                "during_retention_over_with_history", "first_page_p95_ms", "filtered_page_p95_ms", "migration_s",
                "drain_longest_pause_s", "move_s", "migrate_not_completed", "not_completed"},
    "held_back": {"runs_per_s_without", "runs_per_s_held", "held_over_without", "target",
                  "oldest_xmin_age_seconds", "dead_tuples_held", "not_completed"},
    "write_cost": {"runs", "one_step", "three_steps", "not_completed"},
    "sustained": {"backlog", "runs_per_s_first", "runs_per_s_last", "last_over_first", "target", "dead_tuples_peak",
                  "autovacuums", "runs_done"},
    "stream": {"entries", "readers", "sse_readers", "entries_per_s", "commit_to_reader_p50_ms",
               "commit_to_reader_p99_ms", "target_entries_per_s", "target_p50_ms", "target_p99_ms", "entries_read",
               "not_completed"},
    "attributes": {"history", "first_page_p95_ms", "by_tenant_p95_ms", "by_order_p95_ms", "next_page_p95_ms",
                   "target_ms", "index_bytes_per_run", "insert_us_per_run_without", "insert_us_per_run_with"},
    "bulk": {"bulk", "w1_runs_per_s_alone", "w1_runs_per_s_during_bulk", "during_over_alone", "target",
             "bulk_runs_per_s", "bulk_done", "not_completed"},
    "dag": {"members", "seal_s", "seal_to_fan_in_start_s", "runs_per_s_graph", "runs_per_s_plain", "graph_over_plain",
            "target", "small_members", "release_us_per_member_small", "release_us_per_member_large",
            "fan_in_end_us_small", "fan_in_end_us_large", "not_completed"},
}


def test_the_figures_name_every_benchmark():
    from tests.benchmarks.__main__ import BENCHMARKS  # noqa: PLC0415

    assert list(FIGURES) == list(BENCHMARKS)


# One test per benchmark, so that the test processes share them out.
@pytest.mark.parametrize("name", list(FIGURES))
def test_every_benchmark_prints_its_figures_in_quick_mode(server_url, name):
    done = subprocess.run(
        [sys.executable, "-m", "tests.benchmarks", "--quick", name], cwd=ROOT, capture_output=True, text=True,
        timeout=600, env={**os.environ, "EVERYSTEP_TEST_DATABASE_URL": server_url},
    )
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["benchmark"] for line in lines] == [name]
    for line in lines:
        missing = FIGURES[line["benchmark"]] - set(line)
        assert not missing, f"{line['benchmark']} lacks {missing}"
        assert line.get("not_completed", 0) == 0, line
