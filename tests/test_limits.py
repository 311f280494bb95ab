"""Concurrency limits, fleet-wide: the claim never admits more runs of a
limited workflow than its limit, in order, whoever claims at once; unlimited
workflows are not held back by limited ones."""

from __future__ import annotations

import pytest

import everystep
import everystep.db
from everystep import EverystepError
from tests.apps.flow_workflows import limited, unlimited
from tests.apps.workflows import marks_of
from tests.support.engine import claim_hard, most_at_once
from tests.support.processes import wait_for

IMPORTS = ("tests.apps.workflows", "tests.apps.flow_workflows")
LIMITED = limited.__everystep_workflow__
UNLIMITED = unlimited.__everystep_workflow__


def running(db, name: str) -> int:
    return db.value("SELECT count(*) FROM everystep_workflow WHERE name = %s AND status = 'running'", (name,))


def end(db, run: everystep.db.ClaimedRun, runner: str, claim: bool = False) -> list[everystep.db.ClaimedRun]:
    with db.connect() as conn:
        return everystep.db.finish_run(conn, run.id, runner, run.token, "completed", "null", None, claim=claim).claimed


def test_the_claim_admits_a_limited_workflow_up_to_its_limit_in_order(db):
    with db.connect() as conn:
        everystep.db.apply_limits(conn, {LIMITED: 2})
    limited_runs = db.schedule_many(limited, [("m", i) for i in range(5)])
    unlimited_runs = db.schedule_many(unlimited, [("m", i) for i in range(3)])
    with db.connect() as conn:
        claimed = everystep.db.claim(conn, "w1", 10)
        assert [r.id for r in claimed] == [r.id for r in limited_runs[:2] + unlimited_runs]
        assert everystep.db.claim(conn, "w1", 10) == []  # the limited runs wait
    # Ending one frees its slot for the next in line (and wakes the claimers).
    with db.connect() as listener:
        everystep.db.listen(listener)
        end(db, claimed[0], "w1")
        assert list(listener.notifies(timeout=2, stop_after=1))
    with db.connect() as conn:
        assert [r.id for r in everystep.db.claim(conn, "w1", 10)] == [limited_runs[2].id]
    assert running(db, LIMITED) == 2


def test_a_slot_is_free_again_whichever_way_its_run_left_running(db):
    with db.connect() as conn:
        everystep.db.apply_limits(conn, {LIMITED: 1})
    runs = db.schedule_many(limited, [("m", i) for i in range(3)])
    with db.connect() as conn:
        first = everystep.db.claim(conn, "w1", 5)
        assert [r.id for r in first] == [runs[0].id]
        everystep.db.requeue_held(conn, "w1", [everystep.db.Claim(first[0].id, first[0].token)])  # a drain
        again = everystep.db.claim(conn, "w2", 5)
        assert [r.id for r in again] == [runs[0].id]  # requeued: first in line again
        assert everystep.db.reclaim_held(conn, "w2")  # a catchup: new token, same slot, still counted
        assert everystep.db.claim(conn, "w3", 5) == []


def test_the_end_of_a_limited_run_admits_the_next_in_line_into_its_slot(db):
    with db.connect() as conn:
        everystep.db.apply_limits(conn, {LIMITED: 1})
    runs = db.schedule_many(limited, [("m", i) for i in range(3)])
    other = db.schedule_many(unlimited, [("m", 0)])
    with db.connect() as conn:
        first = everystep.db.claim(conn, "w1", 1)
    assert [r.id for r in first] == [runs[0].id]
    # The end's successor claim takes the head of the ready runs (it runs
    # before the release); the slot goes to the next limited run in line,
    # admitted in the end's transaction.
    assert [r.id for r in end(db, first[0], "w1", claim=True)] == [other[0].id]
    assert db.query("SELECT run_id, slot FROM everystep_ready") == [(runs[1].id, 1)]
    with db.connect() as conn:
        (second,) = everystep.db.claim(conn, "w2", 5)
        assert second.id == runs[1].id
        other_claim = everystep.db.reclaim_held(conn, "w1")
    assert running(db, LIMITED) == 1
    # The end of an unlimited run frees no slot: nothing is admitted.
    assert end(db, other_claim[0], "w1", claim=True) == []
    assert db.value("SELECT count(*) FROM everystep_ready") == 0
    end(db, second, "w2")
    assert db.query("SELECT run_id, slot FROM everystep_ready") == [(runs[2].id, 1)]


def test_raising_lowering_and_removing_a_limit(db):
    runs = db.schedule_many(limited, [("m", i) for i in range(6)])
    with db.connect() as conn:
        everystep.db.apply_limits(conn, {LIMITED: 1})
        assert len(everystep.db.claim(conn, "w1", 10)) == 1
        everystep.db.apply_limits(conn, {LIMITED: 3})
        assert everystep.db.limits(conn) == {LIMITED: 3}
        assert len(everystep.db.claim(conn, "w1", 10)) == 2
        everystep.db.apply_limits(conn, {LIMITED: 2})
        assert everystep.db.claim(conn, "w1", 10) == []
        everystep.db.apply_limits(conn, {LIMITED: None})
        assert everystep.db.limits(conn) == {}
        assert len(everystep.db.claim(conn, "w1", 10)) == 3
    assert running(db, LIMITED) == len(runs)


def test_concurrent_claims_never_over_admit(db):
    """8 claimers claiming and ending runs (with successor claims) as fast as
    they can while an observer counts the running runs of the workflow."""
    limit = 3
    with db.connect() as conn:
        everystep.db.apply_limits(conn, {LIMITED: limit})
    db.schedule_many(limited, [("m", i) for i in range(300)])
    db.schedule_many(unlimited, [("m", i) for i in range(100)])
    seen = claim_hard(db, f"SELECT count(*) FROM everystep_workflow WHERE name = '{LIMITED}' AND status = 'running'")
    assert db.value("SELECT count(*) FROM everystep_workflow WHERE status <> 'completed'") == 0
    assert max(seen) <= limit
    assert len(seen) > 50


def test_eight_worker_processes_keep_the_limit(db, marks, start_worker):
    limited_runs = db.schedule_many(limited, [(marks, 0.05) for _ in range(40)])
    db.schedule_many(unlimited, [(marks, 0.05) for _ in range(40)])
    for i in range(8):
        start_worker(f"w{i}", threads=4, imports=("tests.apps.workflows", "tests.apps.flow_workflows"))
    wait_for(lambda: db.value("SELECT count(*) FROM everystep_workflow WHERE status = 'completed'") == 80, 120,
             what="every run completed")
    ids = {str(r.id) for r in limited_runs}
    now = highest = 0
    for run, tag, _pid in marks_of(marks):
        if run in ids:
            now += 1 if tag == "limited" else -1 if tag == "limited:end" else 0
            highest = max(highest, now)
    assert highest <= 3
    assert highest >= 2  # the limit admits in parallel, not one at a time


def test_a_worker_started_with_a_config_file_keeps_its_workflow_limits(db, marks, start_worker, tmp_path):
    """`everystep worker -c FILE` writes the file's `workflows:` limits, as the
    supervisor's workers do; without them its own limits (the decorators')
    would replace the file's, and a workflow the file limits to one run would
    run four at once on four threads."""
    config = tmp_path / "everystep.yaml"
    config.write_text(f"workflows:\n  {UNLIMITED}:\n    concurrency: 1\n")
    runs = db.schedule_many(unlimited, [(marks, 0.2) for _ in range(6)])
    start_worker("w-config", threads=4, imports=IMPORTS, config=config)
    ids = [run.id for run in runs]
    wait_for(lambda: db.value("SELECT count(*) FROM everystep_workflow WHERE id = ANY(%s) AND status = 'completed'",
                              (ids,)) == 6, 60, what="every run completed")
    with db.connect() as conn:
        assert everystep.db.limits(conn) == {LIMITED: 3, UNLIMITED: 1}  # the decorator's, and the file's override
    assert most_at_once(db, runs) == 1


def test_the_decorator_refuses_a_bad_limit():
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(EverystepError):
            everystep.workflow(concurrency=bad)


def waiting_where(db, name: str) -> dict[str, int]:
    """How many of the workflow's runs wait in each queue table (0032_ready.sql)."""
    return {table: db.value(f"SELECT count(*) FROM everystep_{table} WHERE name = %s", (name,))
            for table in ("ready", "blocked")}


def test_setting_and_removing_a_limit_admits_the_waiting_runs_again(db):
    runs = db.schedule_many(unlimited, [("m", i) for i in range(4)])
    assert waiting_where(db, UNLIMITED) == {"ready": 4, "blocked": 0}
    with db.connect() as conn:
        everystep.db.apply_limits(conn, {UNLIMITED: 1})
        assert waiting_where(db, UNLIMITED) == {"ready": 1, "blocked": 3}  # the first in line holds the slot
        assert [r.id for r in everystep.db.claim(conn, "w1", 10)] == [runs[0].id]  # within the new limit
        everystep.db.apply_limits(conn, {UNLIMITED: None})
        assert waiting_where(db, UNLIMITED) == {"ready": 3, "blocked": 0}
        assert [r.id for r in everystep.db.claim(conn, "w1", 10)] == [r.id for r in runs[1:]]


def test_a_run_admitted_as_its_limit_was_set_is_admitted_again_at_the_sort(db):
    """A run admitted in the moment its workflow's limit was set (a producer's
    transaction in flight) is ready without a slot: the next sort (the
    worker's that writes the limits, the maintenance child's at every sweep)
    gives it a slot or makes it wait for one."""
    runs = db.schedule_many(limited, [("m", i) for i in range(3)])
    db.query("INSERT INTO everystep_limit (name, concurrency) VALUES (%s, 1) RETURNING 1", (LIMITED,))
    db.query("INSERT INTO everystep_slot (name, slot) VALUES (%s, 1) RETURNING 1", (LIMITED,))
    assert waiting_where(db, LIMITED) == {"ready": 3, "blocked": 0}
    with db.connect() as conn:
        assert everystep.db.sort_lanes(conn) == 3
        assert everystep.db.sort_lanes(conn) == 0
        assert waiting_where(db, LIMITED) == {"ready": 1, "blocked": 2}
        assert [r.id for r in everystep.db.claim(conn, "w1", 10)] == [runs[0].id]
        assert everystep.db.claim(conn, "w1", 10) == []
