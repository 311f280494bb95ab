"""Chaos for unsafe-to-repeat steps, sync and async side by side: two
worker processes run a backlog of runs whose only step is unsafe (a 30 ms
sync one, a 20 ms async one) while their database sessions are killed and
the workers are SIGKILLed and restarted. Every run must end; a run may end
`blocked` only when its worker died between the step's `started` mark and
its outcome's commit, so the share of runs blocked measures that window:
an async run's must be no longer than a sync run's (its outcome's write once
queued behind every other write of the async runs, several times the step).
One test, bounded to well under a minute; marked `chaos` (select it with
`-m chaos`, leave it out with `-m "not chaos"`)."""

from __future__ import annotations

import random
import time

import psycopg
import pytest

import everystep
from tests.apps import chaos_unsafe as flows
from tests.support.processes import wait_for

RUNS = 1500  # of each kind: more than the chaos lets either finish
CHAOS_SECONDS = 12
WORKER = {"threads": 4, "grace": 2, "max_crashes": 100, "imports": ("tests.apps.chaos_unsafe",)}

pytestmark = [pytest.mark.chaos, pytest.mark.xdist_group("chaos")]


def ends(db) -> dict:
    return {(name.rsplit(".", 1)[1], status): count for name, status, count in db.query(
        "SELECT name, status, count(*) FROM everystep_workflow GROUP BY name, status")}


def in_window(db) -> list:
    """The runs inside the window now, and their kind: the `started` mark of
    their unsafe step committed, its outcome not."""
    return db.query("SELECT w.id, w.name FROM everystep_step s JOIN everystep_workflow w ON w.id = s.workflow_id"
                    " WHERE s.status = 'started' AND w.status = 'running'")


def ended(counts: dict, kind: str) -> int:
    return counts.get((kind, "completed"), 0) + counts.get((kind, "blocked"), 0)


def test_unsafe_steps_sync_and_async_block_alike_under_kills(db, start_worker):
    random.seed(34)
    names = [f"chaos-{db.schema}-{i}" for i in range(2)]  # the server is shared: kill only this test's sessions
    with psycopg.connect(db.url) as conn, everystep.transaction(conn):  # a backlog: every slot busy, both kinds
        for first in range(0, RUNS, 20):  # interleaved: the claims take both kinds from the start
            everystep.schedule_many(flows.pay, [(n,) for n in range(first, first + 20)])
            everystep.schedule_many(flows.apay, [(n,) for n in range(first, first + 20)])
    workers = {name: start_worker(name, **WORKER) for name in names}
    for worker in workers.values():
        worker.wait_logged("holding the lock of", timeout=30)
    kills = backend_kills = 0
    samples = []  # of in_window
    started = time.monotonic()
    with psycopg.connect(db.url, autocommit=True) as admin:
        next_kill = started + 1.0
        # Kill while both kinds have runs waiting, so that both are exposed alike.
        while time.monotonic() - started < CHAOS_SECONDS and min(
                ended(counts := ends(db), "pay"), ended(counts, "apay")) < RUNS - 100:
            time.sleep(0.1)
            samples.append(in_window(db))
            pids = [pid for (pid,) in admin.execute(
                "SELECT pid FROM pg_stat_activity WHERE application_name = ANY(%s)",
                ([f"everystep {name}"[:63] for name in names],))]
            if pids:  # a write's session dies: the write must be retried, not lost
                admin.execute("SELECT pg_terminate_backend(%s)", (random.choice(pids),))
                backend_kills += 1
            if time.monotonic() >= next_kill:  # a worker dies, and comes back under its name
                name = names[kills % 2]
                workers[name].kill()
                workers[name] = start_worker(name, **WORKER)
                kills += 1
                next_kill = time.monotonic() + random.uniform(1.5, 3.5)
    exposed = ends(db)  # the runs that had ended by the last kill: the runs the kills could block
    seconds = time.monotonic() - started
    wait_for(lambda: ended(ends(db), "pay") + ended(ends(db), "apay") == 2 * RUNS, timeout=90,
             what="every run ended")
    final = ends(db)
    assert set(final) <= {("pay", "completed"), ("pay", "blocked"), ("apay", "completed"), ("apay", "blocked")}
    blocked = {run for (run,) in db.query("SELECT id FROM everystep_workflow WHERE status = 'blocked'")}
    window = {}
    for kind in ("pay", "apay"):
        # Little's law: the mean number inside the window over the rate of runs
        # through it is the mean time a run spends in it. (A blocked run stays
        # in it from its worker's death until its replay: left out.)
        mean = sum(1 for sample in samples for run, name in sample
                   if name.endswith(f".{kind}") and run not in blocked) / len(samples)
        window[kind] = mean / (max(ended(exposed, kind), 1) / seconds)
        print(f"{kind}: {final.get((kind, 'blocked'), 0)} blocked of {ended(exposed, kind)} exposed; "
              f"{1000 * window[kind]:.0f} ms from its mark to its outcome's commit")
    print(f"{kills} worker kills, {backend_kills} session kills in {seconds:.0f} s")
    assert kills >= 3 and backend_kills >= 5
    assert min(ended(exposed, kind) for kind in ("pay", "apay")) >= 100  # both kinds ran through the kills
    # The async step is the shorter (20 ms against 30): its window must not be
    # the longer one by much. It was 4 to 7 times as long before its outcome
    # had a lane of its own and a write on a dead pooled connection was
    # retried at once; since, 0.9 to 2 times on 2 loaded cores (the event
    # loop of 100 runs lags behind 4 threads there).
    assert window["apay"] <= 3 * window["pay"], window
