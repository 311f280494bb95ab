"""Priorities and fair queues, decided in the claim: the highest priority
first among due runs, then the time order; per-key concurrency limits with
the keys taken in turn; bad inputs refused before anything is written."""

from __future__ import annotations

import json

import pytest

import everystep
import everystep.db
from everystep import EverystepError
from tests.apps.priority_workflows import plain, tenant_job, tenant_job_bounded, urgent
from tests.apps.workflows import marks_of
from tests.support.engine import claim_hard, most_at_once
from tests.support.processes import wait_for

IMPORTS = ("tests.apps.workflows", "tests.apps.priority_workflows")
PLAIN = plain.__everystep_workflow__
URGENT = urgent.__everystep_workflow__
TENANT = tenant_job.__everystep_workflow__
BOUNDED = tenant_job_bounded.__everystep_workflow__


def schedule(db, fn, *args, **options):
    with db.connect() as conn, everystep.transaction(conn):
        return everystep.schedule(fn, *args, **options)


def end(conn, run: everystep.db.ClaimedRun, runner: str, claim: bool = False) -> list[everystep.db.ClaimedRun]:
    return everystep.db.finish_run(conn, run.id, runner, run.token, "completed", "null", None, claim=claim).claimed


def claim_ids(conn, runner: str, n: int, **options) -> list:
    return [r.id for r in sorted(everystep.db.claim(conn, runner, n, **options), key=lambda r: r.id)]


# ---------------------------------------------------------------- priorities


def test_the_claim_takes_the_highest_priority_first_then_the_time_order(db):
    backlog = db.schedule_many(plain, [("m", i) for i in range(5)])
    low = schedule(db, plain, "m", 0, priority=-5)
    high = schedule(db, plain, "m", 0, priority=50)
    higher = schedule(db, plain, "m", 0, priority=100)
    also_high = schedule(db, plain, "m", 0, priority=50)
    with db.connect() as conn:
        got = [r.id for r in everystep.db.claim(conn, "w0", 1)]
        everystep.db.requeue_claimer(conn, "w0")  # back in line, in its place
        assert got == [higher.id]
        order = []
        for _ in range(9):
            (run,) = everystep.db.claim(conn, "w", 1)
            order.append(run.id)
            # The successor claim of an end orders alike.
        assert order == [higher.id, high.id, also_high.id, *[r.id for r in backlog], low.id]
    assert db.value("SELECT count(*) FROM everystep_workflow WHERE status = 'running'") == 9


def test_the_successor_of_an_end_is_the_highest_priority_due_run(db):
    first = schedule(db, plain, "m", 0)
    db.schedule_many(plain, [("m", i) for i in range(3)])
    high = schedule(db, plain, "m", 0, priority=3)
    with db.connect() as conn:
        (run,) = everystep.db.claim(conn, "w", 1, routes=everystep.db.routes_of([PLAIN]))
        assert run.id == high.id
        assert [r.id for r in end(conn, run, "w", claim=True)] == [first.id]
        low = schedule(db, plain, "m", 0, priority=-1)
        nxt = everystep.db.claim(conn, "w", 3)
        assert low.id not in [r.id for r in nxt]
        assert [r.id for r in everystep.db.claim(conn, "w", 3)] == [low.id]


def test_a_workflows_default_priority_from_the_decorator_and_the_workers_config(db):
    run = schedule(db, urgent, "m", 0)
    explicit = schedule(db, urgent, "m", 0, priority=-3)
    assert db.value("SELECT priority FROM everystep_workflow WHERE id = %s", (run.id,)) == 7
    assert db.value("SELECT priority FROM everystep_workflow WHERE id = %s", (explicit.id,)) == -3
    with db.connect() as conn:  # as a worker writes its config's `workflows: {name: {priority: ...}}`
        everystep.db.apply_limits(conn, {}, priorities={URGENT: 2, PLAIN: -4})
        assert everystep.db.priorities(conn) == {URGENT: 2, PLAIN: -4}
    runs = db.schedule_many(plain, [("m", 0)])
    assert db.value("SELECT priority FROM everystep_workflow WHERE id = %s", (runs[0].id,)) == -4
    assert db.value("SELECT priority FROM everystep_workflow WHERE id = %s", (schedule(db, urgent, "m", 0).id,)) == 2
    with db.connect() as conn:
        everystep.db.apply_limits(conn, {}, priorities={URGENT: None})
    assert db.value("SELECT priority FROM everystep_workflow WHERE id = %s", (schedule(db, urgent, "m", 0).id,)) == 7


@pytest.mark.parametrize("bad", [101, -101, 1.5, "1", True, None.__class__])
def test_a_bad_priority_is_refused_before_anything_is_written(db, bad):
    with pytest.raises(EverystepError, match="priority"):
        schedule(db, plain, "m", 0, priority=bad)
    with pytest.raises(EverystepError, match="priority"):
        db.schedule_many(plain, [])  # nothing to check: no error
        with db.connect() as conn, everystep.transaction(conn):
            everystep.schedule_many(plain, [("m", 0)], priority=bad)
    with pytest.raises(EverystepError, match="priority"):
        everystep.workflow(priority=bad)
    assert db.value("SELECT count(*) FROM everystep_workflow") == 0


@pytest.mark.parametrize("bad", ["", "k" * 256, 42, b"tenant"])
def test_a_bad_concurrency_key_is_refused_before_anything_is_written(db, bad):
    with pytest.raises(EverystepError, match="concurrency_key"):
        schedule(db, tenant_job, "t", 0, concurrency_key=bad)
    assert db.value("SELECT count(*) FROM everystep_workflow") == 0


def test_the_decorator_refuses_a_bad_per_key_limit():
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(EverystepError, match="concurrency_per_key"):
            everystep.workflow(concurrency_per_key=bad)


# ---------------------------------------------------------------- fair queues


def per_key(db, limits: dict) -> None:
    with db.connect() as conn:
        everystep.db.apply_limits(conn, {}, per_key=limits)


def test_a_key_is_admitted_up_to_its_limit_and_the_keys_in_turn(db):
    per_key(db, {TENANT: 2})
    big = [schedule(db, tenant_job, "big", 0, concurrency_key="big") for _ in range(6)]
    small = [schedule(db, tenant_job, key, 0, concurrency_key=key) for key in ("a", "b") for _ in range(2)]
    unkeyed = schedule(db, tenant_job, "none", 0)  # no key: no per-key limit
    with db.connect() as conn:
        got = claim_ids(conn, "w", 20)
        assert set(got) == {*[r.id for r in big[:2]], *[r.id for r in small], unkeyed.id}
        assert everystep.db.claim(conn, "w", 20) == []  # every key is at its limit
        running = {r.id: r for r in everystep.db.reclaim_held(conn, "w")}
        # Ending a big run frees room in its key only: big's next is admitted in
        # the end's transaction (its successor claim ran first: none was ready).
        assert end(conn, running[big[0].id], "w", claim=True) == []
        assert db.value("SELECT run_id FROM everystep_ready") == big[2].id
        assert claim_ids(conn, "w", 20) == [big[2].id]
        assert everystep.db.claim(conn, "w", 20) == []
    assert db.value("SELECT count(*) FROM everystep_workflow WHERE concurrency_key = 'big' AND status = 'running'") == 2


def test_round_robin_a_big_key_does_not_starve_the_small_ones(db):
    """One claim at a time with room for one run per key: every key in turn,
    least recently claimed first, whatever its backlog."""
    per_key(db, {TENANT: 1})
    with db.connect() as conn, everystep.transaction(conn):
        for i in range(30):
            everystep.schedule(tenant_job, "big", i, concurrency_key="big")
        for key in ("a", "b", "c"):
            everystep.schedule(tenant_job, key, 0, concurrency_key=key)
            everystep.schedule(tenant_job, key, 1, concurrency_key=key)
    order = []
    with db.connect() as conn:
        (run,) = everystep.db.claim(conn, "w", 1)
        while run is not None:
            order.append(db.value("SELECT concurrency_key FROM everystep_workflow WHERE id = %s", (run.id,)))
            following = end(conn, run, "w", claim=True)
            run = following[0] if following else None
            if len(order) == 8:
                break
    assert sorted(order[:4]) == ["a", "b", "big", "c"]
    assert sorted(order[4:8]) == ["a", "b", "big", "c"]


def test_a_workflow_limit_bounds_every_key_together(db):
    with db.connect() as conn:
        everystep.db.apply_limits(conn, {BOUNDED: 3}, per_key={BOUNDED: 1})
    for key in "abcdef":
        schedule(db, tenant_job_bounded, key, 0, concurrency_key=key)
        schedule(db, tenant_job_bounded, key, 0, concurrency_key=key)
    with db.connect() as conn:
        got = everystep.db.claim(conn, "w", 10)
        assert len(got) == 3
        keys = {db.value("SELECT concurrency_key FROM everystep_workflow WHERE id = %s", (r.id,)) for r in got}
        assert len(keys) == 3
        assert everystep.db.claim(conn, "w", 10) == []
        end(conn, got[0], "w", claim=True)  # its slot goes to a run of a key with room
        assert len(everystep.db.claim(conn, "w", 10)) == 1


def waiting_where(db) -> dict[str, int]:
    """How many runs wait in each queue table (0032_ready.sql)."""
    return {table: db.value(f"SELECT count(*) FROM everystep_{table}") for table in ("ready", "blocked", "timer")}


def test_setting_a_per_key_limit_admits_the_ready_keyed_runs_again(db):
    runs = [schedule(db, tenant_job, "t", 0, concurrency_key="t") for _ in range(3)]
    assert waiting_where(db) == {"ready": 3, "blocked": 0, "timer": 0}
    per_key(db, {TENANT: 1})  # the first keeps its place with the key's room, the others wait for it
    assert waiting_where(db) == {"ready": 1, "blocked": 2, "timer": 0}
    assert db.value("SELECT held FROM everystep_key WHERE key = 't'") == 1
    with db.connect() as conn:
        assert claim_ids(conn, "w", 5) == [runs[0].id]
        assert everystep.db.key_limits(conn) == {TENANT: 1}
    per_key(db, {TENANT: None})
    assert waiting_where(db) == {"ready": 2, "blocked": 0, "timer": 0}
    with db.connect() as conn:
        assert claim_ids(conn, "w", 5) == [r.id for r in runs[1:]]


def test_concurrent_claimers_never_exceed_a_keys_limit(db):
    """8 claimers claiming and ending keyed runs (with successor claims) as
    fast as they can while an observer counts each key's running runs."""
    limit = 2
    per_key(db, {TENANT: limit})
    with db.connect() as conn, everystep.transaction(conn):
        for i in range(200):
            everystep.schedule(tenant_job, "big", i, concurrency_key="big")
        for key in "abcd":
            for i in range(20):
                everystep.schedule(tenant_job, key, i, concurrency_key=key)
    seen = claim_hard(db, "SELECT coalesce(max(n), 0) FROM (SELECT count(*) AS n FROM everystep_workflow"
                          " WHERE status = 'running' GROUP BY concurrency_key) AS k")
    assert db.value("SELECT count(*) FROM everystep_workflow WHERE status <> 'completed'") == 0
    assert max(seen) <= limit
    assert len(seen) > 20


def test_eight_worker_processes_keep_each_keys_limit_and_starve_no_key(db, start_worker):
    """The per-key limit from the step rows' started/finished times, with 8
    worker processes; the small keys finish before the big key's first 60."""
    per_key(db, {TENANT: 2})
    with db.connect() as conn, everystep.transaction(conn):
        big = [everystep.schedule(tenant_job, "big", 0.02, concurrency_key="big") for _ in range(200)]
        small = {key: [everystep.schedule(tenant_job, key, 0.02, concurrency_key=key) for _ in range(5)]
                 for key in ("k1", "k2", "k3", "k4", "k5")}
    for i in range(8):
        start_worker(f"w{i}", threads=4, imports=IMPORTS)
    every = big + [run for runs in small.values() for run in runs]
    wait_for(lambda: db.value("SELECT count(*) FROM everystep_workflow WHERE status = 'completed'") == len(every),
             180, what="every run completed")
    for runs in (big, *small.values()):
        assert most_at_once(db, runs) <= 2
    assert most_at_once(db, big) == 2  # the limit admits in parallel, not one at a time
    big_done = sorted(db.value("SELECT completed_at FROM everystep_workflow WHERE id = %s", (r.id,)) for r in big)
    small_last = max(db.value("SELECT completed_at FROM everystep_workflow WHERE id = %s", (r.id,))
                     for runs in small.values() for r in runs)
    assert small_last <= big_done[59]


# ---------------------------------------------------------------- shown


def test_runs_show_and_the_ui_show_priority_and_concurrency_key(db):
    from tests.test_cli import cli, ok  # noqa: PLC0415

    per_key(db, {TENANT: 3})
    keyed = schedule(db, tenant_job, "t", 0, concurrency_key="tenant:42", priority=-7)
    plain_run = schedule(db, plain, "m", 0)
    out = ok(cli(db, "runs", "show", str(keyed.id)))
    assert "priority        -7\n" in out and "concurrency key tenant:42\n" in out
    assert "\npriority" not in ok(cli(db, "runs", "show", str(plain_run.id)))  # the default is not shown
    shown = json.loads(ok(cli(db, "runs", "show", str(keyed.id), "-o", "json")))
    assert (shown["priority"], shown["concurrency_key"]) == (-7, "tenant:42")
    with db.connect() as conn:
        found = everystep.db.ui_run(conn, keyed.id)
    assert (found["priority"], found["concurrency_key"]) == (-7, "tenant:42")


def test_schedule_many_takes_one_priority_and_one_concurrency_key_for_all(db):
    per_key(db, {TENANT: 1})
    with db.connect() as conn, everystep.transaction(conn):
        runs = everystep.schedule_many(tenant_job, [("t", i) for i in range(3)], priority=4, concurrency_key="k")
    rows = db.query("SELECT priority, concurrency_key FROM everystep_workflow WHERE id = ANY(%s)",
                    ([r.id for r in runs],))
    assert rows == [(4, "k")] * 3
    with db.connect() as conn:
        assert len(everystep.db.claim(conn, "w", 3)) == 1


def test_a_worker_writes_the_configs_priorities_and_per_key_limits(db, start_worker, tmp_path):
    """`everystep worker -c FILE` writes the decorators' defaults with the
    file's overrides; an entry giving only a priority leaves the limits."""
    config = tmp_path / "everystep.yaml"
    config.write_text(f"workflows:\n  {PLAIN}:\n    priority: 3\n  {TENANT}:\n    concurrency_per_key: 1\n"
                      f"  {BOUNDED}:\n    priority: -2\n")
    start_worker("w-config", threads=2, imports=IMPORTS, config=config)
    with db.connect() as conn:
        wait_for(lambda: everystep.db.key_limits(conn) == {TENANT: 1, BOUNDED: 1}, 30, what="the per-key limits")
        assert everystep.db.priorities(conn) == {PLAIN: 3, URGENT: 7, BOUNDED: -2}
        assert everystep.db.limits(conn) == {BOUNDED: 3}
    run = schedule(db, plain, "m", 0)
    assert db.value("SELECT priority FROM everystep_workflow WHERE id = %s", (run.id,)) == 3


def test_an_idle_key_goes_at_the_sweep_and_comes_back_with_its_next_run(db):
    """The sweep deletes the keys with no run admitted, running or blocked
    (a tenant gone for good costs the pumps nothing); a run scheduled for
    the key makes its row again."""
    per_key(db, {TENANT: 1})
    done = schedule(db, tenant_job, "t", 0, concurrency_key="gone")
    waiting = schedule(db, tenant_job, "t", 0, concurrency_key="later")
    with db.connect() as conn:
        run = next(r for r in everystep.db.claim(conn, "w", 5) if r.id == done.id)
        end(conn, run, "w")
        everystep.db.requeue_claimer(conn, "w")  # the other one back to scheduled: admitted again
        assert everystep.db.sweep_keys(conn) == 1
    assert dict(db.query("SELECT key, held FROM everystep_key")) == {"later": 1}
    again = schedule(db, tenant_job, "t", 0, concurrency_key="gone")
    assert dict(db.query("SELECT key, held FROM everystep_key")) == {"later": 1, "gone": 1}
    with db.connect() as conn:
        assert {r.id for r in everystep.db.claim(conn, "w", 5)} == {again.id, waiting.id}


def test_a_worker_runs_the_highest_priority_first(db, marks, start_worker):
    """One worker thread, a backlog scheduled before it starts: the runs go in
    priority order, then in time order; the decorator's default counts."""
    plain_runs = db.schedule_many(plain, [(marks, 0) for _ in range(3)])
    low = schedule(db, plain, marks, 0, priority=-1)
    by_default = schedule(db, urgent, marks, 0)  # @workflow(priority=7)
    top = schedule(db, plain, marks, 0, priority=100)
    start_worker("w0", threads=1, imports=IMPORTS)
    wait_for(lambda: db.value("SELECT count(*) FROM everystep_workflow WHERE status = 'completed'") == 6, 60,
             what="every run completed")
    order = [run for run, tag, _pid in marks_of(marks) if not tag.endswith(":end")]
    assert order == [str(r.id) for r in (top, by_default, *plain_runs, low)]


def test_aschedule_and_aschedule_many_take_priority_and_key(db):
    import asyncio  # noqa: PLC0415

    import psycopg  # noqa: PLC0415

    per_key(db, {TENANT: 1})

    async def scheduled() -> list:
        async with await psycopg.AsyncConnection.connect(db.url) as aconn, everystep.atransaction(aconn):
            one = await everystep.aschedule(tenant_job, "t", 0, priority=9, concurrency_key="a")
            many = await everystep.aschedule_many(tenant_job, [("t", 0)], priority=-9, concurrency_key="b")
            with pytest.raises(EverystepError):
                await everystep.aschedule(tenant_job, "t", 0, priority=200)
            return [one.id, many[0].id]

    ids = asyncio.run(scheduled())
    rows = db.query("SELECT priority, concurrency_key FROM everystep_workflow WHERE id = ANY(%s)"
                    " ORDER BY priority", (ids,))
    assert rows == [(-9, "b"), (9, "a")]


def test_the_cli_schedules_with_a_priority_and_a_key(db):
    from tests.test_cli import cli, error_line, ok  # noqa: PLC0415

    target = "tests.apps.priority_workflows:tenant_job"
    out = ok(cli(db, "schedule", target, '"t"', "0", "--priority", "12", "--concurrency-key", "tenant:7"))
    run_id = out.split()[2]
    assert db.query("SELECT priority, concurrency_key FROM everystep_workflow WHERE id = %s", (run_id,)) == [
        (12, "tenant:7")]
    assert "priority" in error_line(cli(db, "schedule", target, '"t"', "0", "--priority", "101"), 2)
    assert db.value("SELECT count(*) FROM everystep_workflow") == 1


def test_a_limited_workflows_slots_go_to_its_highest_priority_runs_first(db):
    """Runs scheduled while a slot is free take it at once; those that wait
    for one get the slots as they free, the highest priority first."""
    with db.connect() as conn:
        everystep.db.apply_limits(conn, {BOUNDED: 2})
    older = [schedule(db, tenant_job_bounded, "t", 0) for _ in range(3)]
    low = schedule(db, tenant_job_bounded, "t", 0, priority=-3)
    high = schedule(db, tenant_job_bounded, "t", 0, priority=5)
    higher = schedule(db, tenant_job_bounded, "t", 0, priority=9)
    with db.connect() as conn:
        first = everystep.db.claim(conn, "w", 5)
        assert {r.id for r in first} == {older[0].id, older[1].id}  # admitted as they were scheduled
        for run in first:
            end(conn, run, "w")
        assert {r.id for r in everystep.db.claim(conn, "w", 5)} == {higher.id, high.id}
        for run in everystep.db.reclaim_held(conn, "w"):
            end(conn, run, "w")
        assert {r.id for r in everystep.db.claim(conn, "w", 5)} == {older[2].id, low.id}
