"""A slot takes its next run while its end commits: the end of a short run
claims a second run ahead, which the slot the next end frees starts at once,
on another thread, before that end's commit returns; a run claimed ahead
that finds no free slot within a second goes back to the queue."""

from __future__ import annotations

import signal
import uuid
from pathlib import Path
from types import SimpleNamespace

import everystep
import everystep.db
from everystep import registry
from everystep.worker import Worker
from tests.apps.workflows import held, marks_of, quick
from tests.support.processes import wait_for


def schedule(db, fn, *args):
    with db.connect() as conn, everystep.transaction(conn):
        return everystep.schedule(fn, *args).id


def status(db, run) -> tuple:
    return db.query("SELECT status, claimed_by FROM everystep_workflow WHERE id = %s", (run,))[0]


def tags(marks: str) -> list[tuple[str, str]]:
    return [(run, tag) for run, tag, _pid in marks_of(marks)]


def four_runs(db, marks: str, tmp_path: Path, start_worker, **options) -> tuple:
    """A worker `w0` of two slots, warmed up by four short runs (marked
    elsewhere), so that a short run of it ends well within AHEAD_RUN however
    busy the machine; then, in one transaction, a run held in its step until
    `tmp_path/busy` exists, a short run, a run held until
    `tmp_path/release` exists, and a short one: the worker claims the first
    two at once; the short one's end claims the third for its slot and the
    fourth ahead, while the first keeps the other slot. Returns the worker
    and the four runs."""
    worker = start_worker("w0", threads=2, **options)
    (tmp_path / "warm-up").mkdir()
    warm = db.schedule_many(quick, [(str(tmp_path / "warm-up"),)] * 4)
    wait_for(lambda: all(status(db, run.id)[0] == "completed" for run in warm), 30, what="the warm-up runs")
    with db.connect() as conn, everystep.transaction(conn):
        runs = (everystep.schedule(held, marks, str(tmp_path / "busy")).id, everystep.schedule(quick, marks).id,
                everystep.schedule(held, marks, str(tmp_path / "release")).id, everystep.schedule(quick, marks).id)
    return worker, runs


def test_the_next_run_starts_while_the_end_of_the_last_one_commits(db, marks, tmp_path, start_worker):
    release = tmp_path / "release"
    worker, (busy, short, holding, ahead) = four_runs(db, marks, tmp_path, start_worker)
    wait_for(lambda: (str(holding), "held") in tags(marks), 30, interval=0.01, what="the held run in its step")
    # The short run's end claimed the held run for its slot and the third run ahead.
    assert status(db, short)[0] == "completed"
    assert status(db, ahead) == ("running", "w0")
    assert (str(ahead), "q") not in tags(marks)
    # The held run's end will wait on its step row's unique entry, taken by
    # this transaction, for as long as it stays open.
    with db.connect(autocommit=False) as blocker:
        blocker.execute(
            "INSERT INTO everystep_step (workflow_id, step_id, name, args, kwargs, status, result, error)"
            " VALUES (%s, '1', 'x', '[]', '{}', 'done', '\"x\"', NULL)", (holding,))
        release.touch()
        # The third run executes in the slot while the held run's end has not committed.
        wait_for(lambda: (str(ahead), "q:end") in tags(marks), 10, interval=0.01,
                 what="the run claimed ahead executing while the end before it waits")
        assert status(db, holding) == ("running", "w0")
        blocker.rollback()
    wait_for(lambda: [status(db, run)[0] for run in (short, holding, ahead)] == ["completed"] * 3, 20,
             what="the three runs completed")
    # The slot ran one body at a time; the other slot's run is still held.
    mine = [entry for entry in tags(marks) if entry[0] != str(busy)]
    assert mine == [(str(short), "q"), (str(short), "q:end"), (str(holding), "held"),
                    (str(ahead), "q"), (str(ahead), "q:end")]
    assert status(db, busy) == ("running", "w0")
    (tmp_path / "busy").touch()
    wait_for(lambda: status(db, busy)[0] == "completed", 20, what="the first run completed")
    assert worker.proc.poll() is None


def test_a_run_claimed_ahead_goes_back_when_no_slot_frees_for_it(db, marks, tmp_path, start_worker):
    _, (busy, short, holding, ahead) = four_runs(db, marks, tmp_path, start_worker)
    wait_for(lambda: (str(holding), "held") in tags(marks), 30, interval=0.01, what="the held run in its step")
    assert status(db, ahead) == ("running", "w0")
    # Its slot stays taken: the run claimed ahead goes back to the queue,
    # where another worker takes it.
    wait_for(lambda: status(db, ahead)[0] == "scheduled", 10, interval=0.01, what="the run claimed ahead given back")
    other = start_worker("w1", threads=1)
    wait_for(lambda: status(db, ahead)[0] == "completed", 20, what="the run given back completed")
    assert status(db, holding) == ("running", "w0")
    executions = db.query("SELECT claimer, outcome FROM everystep_execution WHERE run_id = %s", (ahead,))
    assert executions == [("w0", "given back")]
    assert [pid for run, tag, pid in marks_of(marks) if run == str(ahead)] == [other.pid, other.pid]
    (tmp_path / "release").touch()
    (tmp_path / "busy").touch()
    wait_for(lambda: status(db, holding)[0] == "completed" and status(db, busy)[0] == "completed", 20,
             what="the held runs completed")


def test_a_drain_puts_the_runs_claimed_ahead_back_at_once(db, marks, tmp_path, start_worker):
    """SIGTERM: the runs executing finish (the drain waits for them); a run
    claimed ahead, not started, goes back to the queue at once."""
    worker, (busy, short, holding, ahead) = four_runs(db, marks, tmp_path, start_worker, drain=30)
    wait_for(lambda: (str(holding), "held") in tags(marks), 30, interval=0.01, what="the held run in its step")
    assert status(db, ahead) == ("running", "w0")
    worker.signal(signal.SIGTERM)
    wait_for(lambda: status(db, ahead)[0] == "scheduled", 5, interval=0.01, what="the run claimed ahead put back")
    assert (status(db, busy), status(db, holding)) == (("running", "w0"), ("running", "w0"))
    assert db.query("SELECT claimer, outcome FROM everystep_execution WHERE run_id = %s", (ahead,)) == [
        ("w0", "drained")]
    (tmp_path / "release").touch()
    (tmp_path / "busy").touch()
    assert worker.wait(30) == 0
    assert (status(db, busy)[0], status(db, holding)[0], status(db, ahead)[0]) == ("completed", "completed",
                                                                                   "scheduled")
    assert (str(ahead), "q") not in tags(marks)


def test_a_worker_of_one_slot_claims_nothing_ahead(db, marks, start_worker):
    runs = db.schedule_many(quick, [(marks,) for _ in range(20)])
    start_worker("w0", threads=1)
    wait_for(lambda: db.value("SELECT count(*) FROM everystep_workflow WHERE status = 'completed'") == 20, 30,
             what="every run completed")
    assert [run for run, tag in tags(marks) if tag == "q"] == [str(run.id) for run in runs]
    assert db.value("SELECT count(*) FROM everystep_execution") == 0


def test_ends_wait_for_each_other_only_while_every_sync_slot_runs_a_body(monkeypatch):
    # The rule the writer of ends asks (writer.LINGER); its wait is tested in test_group_commit.py.
    monkeypatch.setattr(registry, "kinds", lambda: (True, False))  # sync workflows only
    worker = Worker("postgresql://unused", "w0", threads=2)
    first, second = (SimpleNamespace(token=token, id=uuid.uuid4()) for token in (1, 2))
    assert worker.writes_to_gather() == 1  # idle slots: an end goes at once
    worker._take_slot(first, False)
    assert worker.writes_to_gather() == 1
    worker._take_slot(second, False)
    assert worker.writes_to_gather() == 2  # every slot runs a body: an end waits for the other's
    worker._ending.add(first.token)  # its end is being written, its slot lent and taken by no run
    assert worker.writes_to_gather() == 1
    worker._ending.discard(first.token)
    monkeypatch.setattr(registry, "kinds", lambda: (True, True))  # async slots are held until their end commits
    assert worker.writes_to_gather() == 1
