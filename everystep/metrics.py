"""The engine's and workers' Prometheus metrics.

Under the supervisor, PROMETHEUS_MULTIPROC_DIR is set before this module is
imported, so every child writes its values to the shared folder and the HTTP
child serves them aggregated. Live gauges use a `live*` mode so the values of a
dead child disappear with it. Labels are code-defined names only (workflow,
step, runner), never run ids.
"""

from __future__ import annotations

import bisect
import collections
import os
from collections.abc import Iterator

from prometheus_client import Counter, Gauge, Histogram

WORKFLOW_RUNS = Counter(
    "everystep_workflow_runs", "Runs that reached an end on this process, by final status "
    "(completed, failed, stopped, blocked, requeued, abandoned).", ["workflow", "status"]
)
WORKFLOW_DURATION = Histogram(
    "everystep_workflow_duration_seconds", "Time from claim to the end of one execution of a run.",
    ["workflow", "status"], buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800)
)
STEP_RUNS = Counter(
    "everystep_step_runs", "Step executions (steps served from the store on replay are not counted), "
    "by outcome (done, failed).", ["workflow", "step", "status"]
)
STEP_DURATION = Histogram(
    "everystep_step_duration_seconds", "Time one step execution took, recording included.",
    ["workflow", "step"], buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
)
POOL_SIZE = Gauge(
    "everystep_worker_pool_size", "Run slots (threads) of a worker.", ["runner"], multiprocess_mode="livesum"
)
INFLIGHT = Gauge(
    "everystep_worker_inflight", "Runs a worker is executing now.", ["runner"], multiprocess_mode="livesum"
)
CLAIMS = Counter("everystep_worker_claims", "Runs claimed by a worker (catchup included).", ["runner"])
STREAM_ENTRIES = Counter(
    "everystep_stream_entries",
    "Entries committed to runs' durable streams (everystep.write_stream), closes included.",
    ["workflow"],
)
WRITE_BATCH = Histogram(
    "everystep_write_batch_size",
    "Writes (step rows, run ends) a worker process committed together (group commit).",
    ["runner"], buckets=(1, 2, 4, 8, 16, 32, 64),
)
EMPTY_CLAIMS = Counter(
    "everystep_worker_empty_claims", "Claim statements of a worker's control loop that found no run.", ["runner"]
)
WAKEUPS = Counter(
    "everystep_worker_notifications", "Notifications of new runs a worker received.", ["runner"]
)
REQUEUED = Counter(
    "everystep_worker_requeued", "Runs a worker handed back to the queue (drain).", ["runner"]
)
STARTED_AT = Gauge(
    "everystep_worker_started_at_seconds", "Unix time a worker started.", ["runner"], multiprocess_mode="livemax"
)
UNKNOWN_WORKFLOW_RUNS = Counter(
    "everystep_unknown_workflow_runs",
    "Runs a worker gave back because it cannot import their workflow (it claims no more of them).",
    ["runner", "workflow"],
)
CLAIMS_LOST = Counter(
    "everystep_claims_lost", "Runs a worker abandoned because a fenced write matched nothing.", ["runner"]
)

ASYNC_SLOTS = Gauge(
    "everystep_worker_async_slots", "Async run slots of a worker (workers.async_slots).", ["runner"],
    multiprocess_mode="livesum"
)
LOOP_LAG = Histogram(
    "everystep_loop_lag_seconds",
    "How late the event loop of a worker's async runs ran its heartbeat (every 50 ms): what a blocking call in "
    "async code costs every async run of the process.",
    ["runner"], buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
LOOP_BLOCKED = Counter(
    "everystep_loop_blocked", "Times the event loop of a worker's async runs was held up for 0.5 s or more "
    "(each is logged, naming the run and step).", ["runner"]
)

# Time and control.
CANCELLATIONS = Counter(
    "everystep_cancellations", "Cancel requests delivered to a running run's body as Cancelled.", ["workflow"]
)
STEP_RETRIES = Counter(
    "everystep_step_retries", "Failed step attempts that are tried again (retries=).", ["workflow", "step"]
)
TIMEOUTS = Counter(
    "everystep_timeouts", "Timeouts: step attempts that ran longer than their @step(timeout=) (kind=step), runs "
    "cancelled because their deadline passed (kind=deadline).", ["workflow", "kind"]
)
ABANDONED_STEP_THREADS = Gauge(
    "everystep_step_threads_abandoned", "Threads of timed-out sync step attempts that are still running (their "
    "result will be ignored): a step that never returns leaks one per timed-out attempt.", ["workflow"],
    multiprocess_mode="livesum"
)
RATE_LIMITED = Counter(
    "everystep_rate_limit_waits", "Step attempts that found no token of their rate limit (@step(rate_limit=)) "
    "and waited for the next.", ["workflow", "rate_limit"]
)

# Graphs and follow-ups (everystep.dags): runs released by the end of their last dependency.
DAG_RELEASES = Counter(
    "everystep_dag_releases", "Runs released by the end of their last dependency (graph members and follow-ups).")

# Recovery (the maintenance child's sweep and the workers' catchup).
RECOVERED = Counter("everystep_recovered_runs", "Runs requeued from dead claimers by the sweep.")
POISONED = Counter(
    "everystep_poisoned_runs", "Runs failed because their worker kept dying on them (max_crashes)."
)

# History and retention (the maintenance child, everystep.retention).
HISTORY_MOVED = Counter(
    "everystep_history_moved_runs", "Finished runs moved from the hot tables to the partitioned history."
)
RETENTION_REMOVED = Counter(
    "everystep_retention_removed_runs", "Runs removed by the retention by end status (whole partitions and batches)."
)

# Recurring schedules (the maintenance child's tick).
SCHEDULES_AUTO_PAUSED = Counter(
    "everystep_schedule_auto_pauses", "Schedules that paused themselves because their runs kept failing."
)


def declare_runner(runner: str) -> None:
    """Export the runner's counters at 0 before anything happens: Prometheus's
    increase() only sees an increment of a series that it scraped before."""
    for counter in (CLAIMS, EMPTY_CLAIMS, WAKEUPS, REQUEUED, CLAIMS_LOST):
        counter.labels(runner)


class Tally:
    """The figures counted at every step and every end of a run (and the
    notifications a worker reads), kept in the process and applied to their
    metrics in bulk by `flush` (a worker's control loop, once per turn: at
    least every poll interval, and at every end of a run that leaves a slot
    free).

    Each value a metric keeps in multiprocess mode costs, at every change, a
    process-wide lock, a getpid() and a write into a shared file: about 5 µs
    on a run's thread in a busy worker, 35 to 65 µs a run in all (one step
    is a counter and a histogram, three values). Here a figure is one append
    to a deque; a flush adds up each counter's amounts and each histogram's
    observations by bucket, and changes each value once."""

    def __init__(self) -> None:
        self._counted: collections.deque = collections.deque()  # (counter, amount)
        self._observed: collections.deque = collections.deque()  # (histogram, value)
        # A forked child starts with none: its parent applies its own figures.
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._counted.clear()
        self._observed.clear()

    def count(self, counter: Counter, amount: float = 1.0) -> None:
        self._counted.append((counter, amount))

    def observe(self, histogram: Histogram, value: float) -> None:
        self._observed.append((histogram, value))

    def flush(self) -> None:
        """Apply what was counted and observed so far (from any thread; the
        figures added meanwhile wait for the next flush)."""
        totals: dict[Counter, float] = {}
        for counter, amount in _taken(self._counted):
            totals[counter] = totals.get(counter, 0.0) + amount
        for counter, amount in totals.items():
            counter.inc(amount)
        observed: dict[Histogram, list[float]] = {}
        for histogram, value in _taken(self._observed):
            observed.setdefault(histogram, []).append(value)
        for histogram, values in observed.items():
            observe_all(histogram, values)


def _taken(pending: collections.deque) -> Iterator[tuple]:
    """The items in `pending` now, each taken out once whoever else takes."""
    for _ in range(len(pending)):
        try:
            yield pending.popleft()
        except IndexError:  # another flush took the rest
            return


def observe_all(histogram: Histogram, values: list[float]) -> None:
    """`histogram.observe(v)` for each of `values` (a labelled child's), with
    one change of its sum and of each bucket that gets any: the bucket of a
    value is the first whose upper bound is at least the value, as observe
    picks it (tests/test_observability.py compares the two)."""
    try:
        bounds, buckets, total = histogram._upper_bounds, histogram._buckets, histogram._sum
    except AttributeError:  # another layout of prometheus_client's: one at a time
        for value in values:
            histogram.observe(value)
        return
    counts = [0] * len(bounds)
    for value in values:
        counts[bisect.bisect_left(bounds, value)] += 1
    total.inc(sum(values))
    for bucket, count in zip(buckets, counts):
        if count:
            bucket.inc(count)


TALLY = Tally()
