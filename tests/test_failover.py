"""A real PostgreSQL failover under load: a Patroni cluster of two nodes on
loopback ports (tests/support/patroni_cluster.py), a supervisor with two
workers connected through a URL naming both nodes
(`target_session_attrs=read-write`), and a workload of three-step runs whose
second step is unsafe to repeat. The primary's postmaster is killed with
SIGKILL mid-workload, or a switchover is asked for; executions are counted
outside the database (tests/apps/failover_workflows.py).

With synchronous replication nothing acknowledged is lost: every run ends,
every step ran once, the unsafe one included, and no run ran twice at once.
With asynchronous replication and a standby one second behind, the commits of
that second are lost: the test measures what that does to the runs.

The recovery grace is shorter than the failover takes, so a sweep that judged
by timing alone would take the live workers for dead. Each scenario prints
its figures. Skipped, with the reason printed, without Patroni and etcd
(apt-get install patroni etcd-server), unless EVERYSTEP_REQUIRE_PATRONI=1."""

from __future__ import annotations

import collections
import os
import signal
import time
import urllib.parse
import uuid
from dataclasses import dataclass

import psycopg
import pytest

import everystep.db
from everystep import schedule_many, transaction
from tests.apps import failover_workflows
from tests.support import patroni_cluster
from tests.support.processes import wait_for
from tests.support.supervisor_process import config

# One cluster for the module: its tests run one after the other on one test process.
pytestmark = pytest.mark.xdist_group("patroni")

RUNS = 200
STEP_SECONDS = 0.1
GRACE = 1.5  # shorter than any failover here: only the design keeps live workers from being taken for dead
TERMINAL = ("completed", "failed", "stopped", "blocked", "cancelled")


@pytest.fixture(scope="module")
def cluster():
    reason = patroni_cluster.missing()
    if reason is not None:
        if os.environ.get("EVERYSTEP_REQUIRE_PATRONI") == "1":
            pytest.fail(f"EVERYSTEP_REQUIRE_PATRONI=1 but {reason}")
        print(f"\nskipping the failover tests: {reason}")
        pytest.skip(reason)
    started = time.monotonic()
    cluster = patroni_cluster.PatroniCluster(synchronous=True)
    print(f"\nPatroni cluster up in {time.monotonic() - started:.1f} s")
    try:
        yield cluster
    finally:
        cluster.close()


@dataclass
class Outcome:
    statuses: collections.Counter
    executions: collections.Counter  # (run, step) -> executions
    overlapping: list[str]  # runs executed twice at once
    first_step_after: float  # seconds from the disruption to the first step recorded on the new primary
    stall: float  # the longest time without a step recorded, after the disruption
    claims_lost: int
    log: str

    def twice(self, step: str | None = None) -> int:
        return sum(1 for (_, name), count in self.executions.items() if count > 1 and step in (None, name))


def schema_url(cluster, schema: str) -> str:
    """The cluster's URL with both hosts, on the test's schema."""
    return cluster.url(options=urllib.parse.quote(f"-c search_path={schema}"))


def overlapping(marks: list[failover_workflows.Mark]) -> list[str]:
    """Runs of which two executions ran at once (a start before the previous end)."""
    open_by_run: collections.Counter = collections.Counter()
    found = set()
    for mark in marks:  # in the order they were written
        open_by_run[mark.run] += 1 if mark.event == "start" else -1
        if open_by_run[mark.run] > 1:
            found.add(mark.run)
    return sorted(found)


def failover_pause(commits: list[float], disrupted_at: float) -> tuple[float, float]:
    """The longest pause in the step commits after the disruption (the old
    primary may commit for a while after it: a switchover checkpoints first),
    and when it ended: the first step recorded on the new primary."""
    after = [at for at in commits if at > disrupted_at]
    assert after, "no step was recorded after the disruption"
    starts = [disrupted_at, *(max(at, disrupted_at) for at in after[:-1])]
    return max((end - start, end) for start, end in zip(starts, after))


def run_workload(cluster, supervisors, tmp_path, disrupt, synchronous: bool = True) -> Outcome:
    """Start a supervisor on `RUNS` runs, call `disrupt()` once a third of them
    completed, and wait for every run to end. The disruption is at the time
    `disrupt()` returns, if a float, else at the time it was called."""
    cluster.wait_healthy(synchronous)
    schema = f"f_{uuid.uuid4().hex[:12]}"
    url = schema_url(cluster, schema)
    marks = tmp_path / "marks"
    marks.mkdir()
    with psycopg.connect(cluster.url(), autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    with psycopg.connect(url, autocommit=True) as conn:
        everystep.db.migrate(conn)
        with transaction(conn):
            runs = schedule_many(failover_workflows.order, [(str(marks), STEP_SECONDS)] * RUNS)
    cluster.wait_healthy(synchronous)  # the standby has every run
    sup = supervisors(config(url, "fo", imports=["tests.apps.failover_workflows"],
                             workers={"processes": 2, "threads": 4, "poll": 0.5, "drain": 10},
                             recovery={"interval": 0.5, "grace": GRACE, "max_crashes": 3}))

    def count(conn, status: str) -> int:
        return conn.execute("SELECT count(*) FROM everystep_workflow WHERE status = %s", (status,)).fetchone()[0]

    def ended(conn) -> bool:
        return conn.execute("SELECT count(*) FROM everystep_workflow WHERE status = ANY(%s)",
                            (list(TERMINAL),)).fetchone()[0] == RUNS

    with psycopg.connect(url, autocommit=True) as conn:
        wait_for(lambda: count(conn, "completed") >= RUNS // 3, timeout=120, what="a third of the runs completed")
    called_at = time.time()
    disrupted_at = disrupt()
    if not isinstance(disrupted_at, float):
        disrupted_at = called_at

    def all_ended() -> bool:
        try:
            with psycopg.connect(url, autocommit=True, connect_timeout=2) as conn:
                return ended(conn)
        except psycopg.OperationalError:
            return False

    wait_for(all_ended, timeout=180, interval=0.5, what="every run ended")
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute("SELECT id, status FROM everystep_workflow").fetchall()
        commits = [row[0].timestamp() for row in conn.execute(
            "SELECT pg_xact_commit_timestamp(xmin) FROM everystep_step WHERE status = 'done' ORDER BY 1")]
    assert {run_id for run_id, _ in rows} == {run.id for run in runs}  # none lost, none added
    marks_seen = failover_workflows.marks_of(marks)
    executions = collections.Counter((m.run, m.step) for m in marks_seen if m.event == "start")
    stall, first_on_new = failover_pause(commits, disrupted_at)
    log = sup.output()
    outcome = Outcome(
        statuses=collections.Counter(status for _, status in rows), executions=executions,
        overlapping=overlapping(marks_seen), first_step_after=first_on_new - disrupted_at, stall=stall,
        claims_lost=log.count("claim lost"), log=log,
    )
    requeued = sum(int(line.split("requeued ")[1].split()[0]) for line in log.splitlines()
                   if "is dead: requeued" in line)
    print(f"\n{RUNS} runs of 3 steps ({STEP_SECONDS} s each), 2 workers x 4 threads, grace {GRACE} s: "
          f"statuses {dict(outcome.statuses)}; from the disruption to the first step recorded on the new "
          f"primary {outcome.first_step_after:.2f} s; the fleet stalled (no step recorded) {outcome.stall:.2f} s; "
          f"steps run twice {outcome.twice()} (unsafe {outcome.twice('charge')}); runs executed twice at once "
          f"{len(outcome.overlapping)}; claims lost {outcome.claims_lost}; sweeps that saw the server change "
          f"{log.count('the database server changed')}; runs requeued by the sweep {requeued}")
    return outcome


def assert_nothing_lost(outcome: Outcome) -> None:
    assert outcome.statuses == {"completed": RUNS}, outcome.statuses
    assert outcome.twice("charge") == 0  # no unsafe effect twice
    assert outcome.twice() == 0  # nothing acknowledged was lost: no step ran again
    assert outcome.overlapping == []  # never two executions of a run at once
    assert "is dead: requeued" not in outcome.log  # no live worker was taken for dead
    assert "engine error" not in outcome.log
    # Not asserted, printed: an execution abandoned in the moment of the change
    # (its claim lost, its run replayed by the same worker, no step twice). On a
    # loaded machine a worker's lock session on the new primary, cut again by
    # the switchover, can look held by another for longer than this test's
    # 1.5 s grace.


def test_the_primary_killed_under_load_with_synchronous_replication(cluster, supervisors, tmp_path):
    outcome = run_workload(cluster, supervisors, tmp_path, cluster.kill_primary_postmaster)
    assert_nothing_lost(outcome)
    assert "the database server changed" in outcome.log  # the sweep saw the new primary, and waited


def test_a_switchover_under_load_with_synchronous_replication(cluster, supervisors, tmp_path):
    outcome = run_workload(cluster, supervisors, tmp_path, cluster.switchover)
    assert_nothing_lost(outcome)


@pytest.mark.parametrize("lag", [0.0, 1.0], ids=["caught-up", "1s-behind"])
def test_the_primary_killed_under_load_with_asynchronous_replication(cluster, supervisors, tmp_path, lag):
    """With `synchronous_mode: false`, what the standby had not received when
    the primary died is lost. Caught up (loopback, no load on the network) it
    may have everything; made one second behind (the primary's WAL sender is
    stopped for a second, as a slow network would hold it back) it has not,
    and the runs pay for it: steps whose outcome was in that second run again,
    and an unsafe step whose claim or started mark was in it may run twice.
    Every run still ends."""
    cluster.set_synchronous(False)
    lost = []

    def kill() -> float:
        primary = cluster.primary()
        sender = cluster.wal_sender_pid(primary)
        assert sender is not None
        if lag:
            os.kill(sender, signal.SIGSTOP)
            time.sleep(lag)
        with psycopg.connect(cluster.node_url(primary), autocommit=True) as conn:
            last = conn.execute("SELECT pg_current_wal_flush_lsn() - '0/0'::pg_lsn").fetchone()[0]
        killed_at = time.time()
        cluster.kill_primary_postmaster()
        os.kill(sender, signal.SIGKILL)  # stopped or not: what it had not sent is never sent
        lost.append(last)
        return killed_at

    try:
        outcome = run_workload(cluster, supervisors, tmp_path, kill, synchronous=False)
    finally:
        cluster.set_synchronous(True)
    lost_bytes = max(0, int(lost[0]) - cluster.timeline_switch_lsn())
    print(f"asynchronous, the standby {lag:.0f} s behind: at least {lost_bytes} bytes of WAL lost; runs blocked "
          f"(an unsafe step's outcome unknown) {outcome.statuses.get('blocked', 0)}")
    assert sum(outcome.statuses.values()) == RUNS
    assert set(outcome.statuses) <= {"completed", "blocked"}
    if lag:
        assert lost_bytes > 0 and outcome.twice() > 0  # the lag was lost, as the docs say
