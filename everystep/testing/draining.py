"""drain(): every runnable run of a test's schema through the engine's own
claim, replay and commit code, in this process, until none is left.

A drain is a worker that stops when it has nothing to do: it claims with
the claim statement every worker uses (due runs only, in due order, with the
slots of concurrency limits), executes each run with the runner (up to
THREADS at once, so that runs waiting on their threads for one another, such
as children started in parallel branches, get on), writes through the same
group-committed writers, and fires the recurring schedules that are due as
the maintenance child would. A run parked waiting for its time stays
waiting: the clock moves it (everystep.testing.advance).
"""

from __future__ import annotations

import collections
import logging
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import psycopg

from everystep import db, faults, liveness, metrics, scheduler
from everystep.errors import Drain
from everystep.runner import Fence, Runner
from everystep.testing import server

log = logging.getLogger("everystep")

RUNNER = "everystep-testing"  # the claimer name of drains (one schema per test: no other drain shares it)
THREADS = 8
MAX_CRASHES = 3  # as a worker's default: a run whose executions die this often in a row fails


class DrainTimeout(TimeoutError):
    """drain() did not empty the queue in time."""


class Drained(collections.Counter):
    """What a drain did: how many runs it executed, by their status once it
    returned (e.g. {"completed": 2, "waiting": 1}; a missing status counts
    0), `runs` each run's status by id, `executions` how many executions
    (a run parked and woken within the drain is executed twice), `crashed`
    how many of them an injected fault killed."""

    def __init__(self, runs: dict[uuid.UUID, str], executions: int, crashed: int):
        super().__init__(runs.values())
        self.runs = runs
        self.executions = executions
        self.crashed = crashed

    def __repr__(self) -> str:
        return f"Drained({dict(self)!r}, executions={self.executions}, crashed={self.crashed})"


class _Fence(Fence):
    """A drain's fence: stops executions at their next step boundary when the
    drain gives up (they are requeued), and refuses every write of an
    execution an injected fault killed."""

    def __init__(self) -> None:
        self.stopping = False

    def check(self, run: db.ClaimedRun) -> None:
        if self.stopping:
            raise Drain()
        self.before_write(run)

    def before_write(self, run: db.ClaimedRun) -> None:
        if faults.crashed(run.token):
            raise faults.Crash(run.id, "", "after its crash")


def drain(conn: psycopg.Connection | None = None, *, timeout: float = 10, scheduled: bool = True,
          recursive: bool = True) -> Drained:
    """Run every runnable run of the schema of `conn` (default: the
    everystep_db fixture's) until none is left, and return what became of
    them (`Drained`: counts by status).

    `recursive`: the runs these runs make runnable — children, runs they
    schedule, parents their ends wake, runs a message to them wakes — run
    too; False: only the runs runnable when the drain starts. `scheduled`:
    the recurring schedules due are fired first (and again whenever the
    drain looks for runs), as the maintenance child would. First of all,
    the runs a crash (an injected fault) left running under the drain's name
    are claimed again, as a restarted worker's catchup does: their crash is
    counted, and a run that crashed MAX_CRASHES times in a row fails.

    Runs waiting for their time stay waiting unless the clock is moved
    (`advance`). Raises DrainTimeout when runs are still running or runnable
    after `timeout` seconds (the executions in flight are stopped at their
    next step and requeued)."""
    return drain_database(server.resolve(conn), timeout=timeout, scheduled=scheduled, recursive=recursive)


def drain_database(database: server.Database, *, timeout: float = 10, scheduled: bool = True,
                   recursive: bool = True) -> Drained:
    deadline = time.monotonic() + timeout
    fence = _Fence()
    runner = Runner(database.pool, RUNNER, fence)
    executions = crashed = 0
    touched: dict[uuid.UUID, None] = {}
    executor = ThreadPoolExecutor(THREADS, thread_name_prefix="everystep-drain")
    in_flight: dict[Future, db.ClaimedRun] = {}
    try:
        with database.connect() as control:
            backlog, poisoned = _catchup(control)
            touched.update(dict.fromkeys(poisoned))
            if scheduled:
                scheduler.tick(control)
            budget = None if recursive else db.queue_stats(control).pending
            while True:
                free = THREADS - len(in_flight)
                runs, backlog = backlog[:free], backlog[free:]
                wanted = free - len(runs) if budget is None else min(free - len(runs), budget)
                if wanted > 0:
                    if scheduled and recursive:
                        scheduler.tick(control)
                    claimed = db.claim(control, RUNNER, wanted)
                    runs += claimed
                    if budget is not None:
                        budget -= len(claimed)
                for run in runs:
                    touched[run.id] = None
                    in_flight[executor.submit(_execute, runner, run)] = run
                if not in_flight:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    fence.stopping = True
                    wait(in_flight, timeout=5)
                    raise DrainTimeout(_timeout_message(timeout, in_flight.values(), db.queue_stats(control)))
                done, _ = wait(in_flight, timeout=min(left, 0.05), return_when=FIRST_COMPLETED)
                for future in done:
                    in_flight.pop(future)
                    executions += 1
                    crashed += future.result() == "crashed"
            statuses = db.run_statuses(control, list(touched))
    finally:
        executor.shutdown(wait=not in_flight)
        if not in_flight:
            runner.close()  # (which applies the runs' figures to their metrics)
        else:
            metrics.TALLY.flush()  # the figures of the runs that ended
    return Drained({run_id: statuses[run_id] for run_id in touched if run_id in statuses}, executions, crashed)


def _catchup(control: psycopg.Connection) -> tuple[list[db.ClaimedRun], set[uuid.UUID]]:
    """The runs left running under the drain's name (an execution killed by
    an injected fault), claimed again with their crash counted; and those
    that failed as poison runs."""
    held = db.reclaim_held(control, RUNNER)
    if not held:
        return [], set()
    poisoned = liveness.fail_poison_runs(control, RUNNER, [db.Claim(run.id, run.token) for run in held],
                                         MAX_CRASHES)
    return [run for run in held if run.id not in poisoned], poisoned


def _execute(runner: Runner, run: db.ClaimedRun) -> str:
    try:
        return runner.execute(run).outcome
    except faults.Crash:
        return "crashed"


def _timeout_message(timeout: float, running: object, stats: db.QueueStats) -> str:
    runs = [f"{run.id} ({run.name})" for run in running]  # type: ignore[attr-defined]
    shown = ", ".join(runs[:5]) + (f" and {len(runs) - 5} more" if len(runs) > 5 else "")
    return (f"drain() did not finish within {timeout:g} s: {len(runs)} runs still executing"
            f"{': ' + shown if runs else ''}; {stats.pending} runnable. A run that keeps making work "
            "(recursive=False drains only what was runnable at the start), a step that does not return, or a "
            "run waiting on its thread for something no run does?")
