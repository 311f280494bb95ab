"""Group commit: the step rows and run ends of a worker process's runs share
statements and commits, each row fenced by its own execution's token, each
answer (and each error) reaching only its own run."""

from __future__ import annotations

import collections
import json
import threading
import time
import uuid
from importlib import resources

import psycopg
import pytest

import everystep
import everystep.db
from everystep import metrics
from everystep import writer as writer_module
from everystep.execution import Successors
from everystep.ids import uuid7_many
from everystep.runner import Runner
from everystep.writer import GroupWriter
from tests.apps import workflows
from tests.apps.workflows import marks_of
from tests.support.processes import wait_for


def claimed(db, n: int, runner: str = "w1") -> list[everystep.db.ClaimedRun]:
    with db.connect() as conn, everystep.transaction(conn):
        everystep.schedule_many(workflows.quick, [("unused",)] * n)
    with db.connect() as conn:
        return everystep.db.claim(conn, runner, n)


def row(step_id: str, args: str = "[]") -> everystep.db.StepRow:
    now = time.time()
    return everystep.db.StepRow(step_id, "step", args, "{}", "done", "1", None, now, now)


def batches(runner: str) -> tuple[float, float]:
    """(batches, writes) the group commit of `runner` observed so far."""
    metrics.TALLY.flush()  # the writers' figures wait there for the worker's next turn
    samples = {s.name: s.value for m in metrics.WRITE_BATCH.collect() for s in m.samples
               if s.labels.get("runner") == runner}
    return samples.get("everystep_write_batch_size_count", 0.0), samples.get("everystep_write_batch_size_sum", 0.0)


@pytest.fixture
def writer(db):
    made = []

    def make(runner: str = "w1") -> GroupWriter:
        made.append(GroupWriter(db.pool, runner, lambda: None))
        return made[-1]

    yield make
    for w in made:
        w.close()


def write_together(db, writer: GroupWriter, writes: list) -> list:
    """Submit `writes` (callables on the writer) from a thread each while the
    writer's first batch, the first write alone, is held up by a row lock on
    its run: the others queue meanwhile and must go as one batch. Returns the
    answers (or exceptions) in order."""
    answers: list = [None] * len(writes)

    def submit(i: int) -> None:
        try:
            answers[i] = writes[i]()
        except Exception as exc:  # noqa: BLE001  (the test looks at it)
            answers[i] = exc

    first_run = writes[0].run
    with db.connect(autocommit=False) as blocker:
        blocker.execute("SELECT 1 FROM everystep_workflow WHERE id = %s FOR UPDATE", (first_run,))
        threads = [threading.Thread(target=submit, args=(0,))]
        threads[0].start()
        # Waiting for this blocker's lock (the server may be running other tests' batches).
        wait_for(lambda: db.value("SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))",
                                  (blocker.info.backend_pid,)) == 1, 10, what="the first batch waiting")
        threads += [threading.Thread(target=submit, args=(i,)) for i in range(1, len(writes))]
        for t in threads[1:]:
            t.start()
        wait_for(lambda: len(writer._waiting) == len(writes) - 1, 10, what="the other writes queued")
        blocker.rollback()
    for t in threads:
        t.join(10)
    return answers


class Write:
    """A deferred write on a writer, remembering its run."""

    def __init__(self, fn, run, *args):
        self.fn, self.run, self.args = fn, run, args

    def __call__(self):
        return self.fn(*self.args)


@pytest.fixture
def writing_threads(monkeypatch) -> list[tuple[int, int]]:
    """(thread ident, rows) of every step-row statement the writers run, in order."""
    seen: list[tuple[int, int]] = []
    record_steps = everystep.db.record_steps

    def recorded(conn, runner, writes):
        seen.append((threading.get_ident(), len(writes)))
        return record_steps(conn, runner, writes)

    monkeypatch.setattr(everystep.db, "record_steps", recorded)
    return seen


def test_writes_waiting_together_share_one_commit(db, writer, writing_threads):
    runs = claimed(db, 9)
    w = writer("w1")
    before = batches("w1")
    submitted: list[int] = []
    writes = [Write(lambda r=r: submitted.append(threading.get_ident()) or w.record_step(r.id, "w1", r.token, row("1")),
                    r.id) for r in runs]
    answers = write_together(db, w, writes)
    assert answers == [everystep.db.Written(False)] * 9
    count, total = batches("w1")
    assert (count - before[0], total - before[1]) == (2, 9)  # the first alone, then the eight others at once
    assert db.value("SELECT count(*) FROM everystep_step") == 9
    # No thread of the writer's own: the first write's thread wrote it, and
    # one of the eight threads waiting meanwhile wrote theirs, handed the lead.
    (first, alone), (second, together) = writing_threads
    assert (first, alone) == (submitted[0], 1)
    assert second in submitted[1:] and together == 8


def test_a_lone_write_costs_no_hand_off_between_threads(db, writer, writing_threads):
    (run,) = claimed(db, 1)
    w = writer("w1")
    assert w.record_step(run.id, "w1", run.token, row("1")) == everystep.db.Written(False)
    assert writing_threads == [(threading.get_ident(), 1)]  # written by the thread that asked


def test_entries_nobody_waits_for_are_written_by_a_thread_of_their_own(db, writer):
    (run,) = claimed(db, 1)
    w = writer("w1")
    answered = threading.Event()
    got: list = []

    def then(held, error):
        got.append((held, error, threading.current_thread().name))
        answered.set()

    entries = [everystep.db.StreamEntryRow("out", 0, '"hello"', None, None)]
    w.send_streams(everystep.db.StreamWrite(run.id, run.token, entries), then)
    assert answered.wait(10)
    assert got == [(True, None, "everystep-writer-w1")]
    assert db.value("SELECT value FROM everystep_stream WHERE run_id = %s", (run.id,)) == "hello"



def test_a_callback_that_fails_leaves_the_other_writes_of_its_batch_their_answers(db, writer, caplog):
    first, sent, waited = claimed(db, 3)
    w = writer("w1")

    def entries(value: str) -> list:
        return [everystep.db.StreamEntryRow("out", 0, json.dumps(value), None, None)]

    def failing(held, error):
        raise RuntimeError("a bug in a callback")

    def send() -> None:
        w.send_streams(everystep.db.StreamWrite(sent.id, sent.token, entries("sent")), failing)

    # The entries sent ahead and the waited ones queue behind the first
    # write's batch, and go in the next one, written by the waited write's thread.
    answers = write_together(db, w, [
        Write(lambda: w.record_step(first.id, "w1", first.token, row("1")), first.id),
        Write(send, sent.id),
        Write(lambda: w.write_streams(waited.id, "w1", waited.token, entries("waited")), waited.id),
    ])
    assert answers == [everystep.db.Written(False), None, True]
    assert "a callback of the group commit failed" in caplog.text
    assert db.value("SELECT count(*) FROM everystep_stream") == 2

def test_a_writer_idle_for_a_while_gives_its_connection_back(db, writer, monkeypatch):
    monkeypatch.setattr(writer_module, "IDLE", 1.0)
    first, second = claimed(db, 2)
    w = writer("w1")
    w.record_step(first.id, "w1", first.token, row("1"))
    w.give_back_if_idle()
    assert w._conn is not None  # written a moment ago: kept
    time.sleep(1.2)
    w.give_back_if_idle()
    assert w._conn is None
    assert w.record_step(second.id, "w1", second.token, row("1")) == everystep.db.Written(False)


def test_a_leader_that_fails_leaves_the_next_write_a_writer(db):
    first, second = claimed(db, 2)
    asked = []

    def gather() -> int:
        asked.append(1)
        if len(asked) == 1:
            raise RuntimeError("a bug while waiting for more writes")
        return 1

    w = GroupWriter(db.pool, "w1", lambda: None, gather=gather)
    try:
        with pytest.raises(RuntimeError):
            w.record_step(first.id, "w1", first.token, row("1"))
        done = threading.Thread(target=lambda: w.record_step(second.id, "w1", second.token, row("1")))
        done.start()
        done.join(10)
        assert not done.is_alive()
        # The failed write was taken out: only the second was written.
        assert db.value("SELECT array_agg(workflow_id) FROM everystep_step") == [second.id]
    finally:
        w.close()


def test_ends_and_successors_of_one_batch_each_go_to_their_own_run(db, writer):
    runs = claimed(db, 4)
    with db.connect() as conn, everystep.transaction(conn):
        waiting = everystep.schedule_many(workflows.quick, [("unused",)] * 3)
    w = writer("w1")
    ends = [Write(w.finish_run, r.id, r.id, r.token, "completed", '"ok"', None, row("last"), True) for r in runs]
    ends[2] = Write(w.finish_run, runs[2].id, runs[2].id, runs[2].token + 1000, "completed", '"ok"', None, None, True)
    answers = write_together(db, w, ends)
    # The run whose token is stale is not ended and gets no successor; the
    # three others end, and the three waiting runs are theirs, one each.
    assert answers[2] == everystep.db.BatchEnd(None, False, None)
    ended = [a for i, a in enumerate(answers) if i != 2]
    assert [a.status for a in ended] == ["completed"] * 3
    successors = [a.successor.id for a in ended if a.successor]
    assert sorted(successors) == sorted(run.id for run in waiting)
    assert db.run(runs[2].id)["status"] == "running"
    for run in waiting:
        assert db.run(run.id)["status"] == "running"
    assert db.value("SELECT count(*) FROM everystep_step WHERE step_id = 'last'") == 3


def test_ends_wait_for_the_other_slots_only_while_every_slot_is_busy(db, monkeypatch):
    # A wait long enough to be seen on a loaded machine; the engine's is 2 ms.
    monkeypatch.setattr(writer_module, "LINGER", 5.0)
    runs = claimed(db, 5)
    busy = {"slots": True}
    w = GroupWriter(db.pool, "w1", lambda: None, gather=lambda: 3 if busy["slots"] else 1)
    answers: dict = {}

    def end(i: int) -> threading.Thread:
        run = runs[i]
        thread = threading.Thread(target=lambda: answers.__setitem__(
            i, w.finish_run(run.id, run.token, "completed", '"ok"', None, row("last"), 0)))
        thread.start()
        return thread

    try:
        before = batches("w1")
        first = end(0)
        time.sleep(0.5)
        assert first.is_alive() and db.run(runs[0].id)["status"] == "running"  # waiting for the others' ends
        second = end(1)
        time.sleep(0.2)
        assert second.is_alive()
        third = end(2)
        for t in (first, second, third):
            t.join(4.0)  # all there: written at once, well before the wait's end
            assert not t.is_alive()
        assert [answers[i].status for i in range(3)] == ["completed"] * 3
        after = batches("w1")
        assert (after[0] - before[0], after[1] - before[1]) == (1, 3)

        # A slot with nothing to run: the end waiting is written at the next
        # end's arrival, and then none waits.
        fourth = end(3)
        time.sleep(0.5)
        assert fourth.is_alive()
        busy["slots"] = False
        fifth = end(4)
        for t in (fourth, fifth):
            t.join(4.0)
            assert not t.is_alive()
        assert [answers[i].status for i in (3, 4)] == ["completed"] * 2
    finally:
        w.close()


def test_step_rows_wait_for_the_other_slots_only_while_every_slot_is_busy(db, monkeypatch):
    """A runner's writer of step rows gathers as its writer of ends does:
    while every slot runs a body, a batch waits for a write from each."""
    monkeypatch.setattr(writer_module, "LINGER", 5.0)  # long enough to be seen on a loaded machine

    class Slots(Successors):
        busy = True

        def writes_to_gather(self) -> int:
            return 3 if self.busy else 1

    slots = Slots()
    runner = Runner(db.pool, "w1", successors=slots)
    runs = claimed(db, 4)
    answers: dict = {}

    def write(i: int) -> threading.Thread:
        run = runs[i]
        thread = threading.Thread(target=lambda: answers.__setitem__(
            i, runner.step_writer.record_step(run.id, "w1", run.token, row("1"))))
        thread.start()
        return thread

    try:
        first = write(0)
        time.sleep(0.5)
        assert first.is_alive() and db.value("SELECT count(*) FROM everystep_step") == 0  # waiting for the others
        others = [write(1), write(2)]
        for t in (first, *others):
            t.join(4.0)  # all there: written at once, well before the wait's end
            assert not t.is_alive()
        assert [answers[i] for i in range(3)] == [everystep.db.Written(False)] * 3
        slots.busy = False
        alone = write(3)
        alone.join(4.0)  # a slot is free: nothing waits
        assert not alone.is_alive() and answers[3] == everystep.db.Written(False)
    finally:
        runner.close()


def test_one_bad_write_fails_alone(db, writer):
    runs = claimed(db, 4)
    w = writer("w1")
    writes = [Write(w.record_step, r.id, r.id, "w1", r.token, row("1")) for r in runs]
    writes[3] = Write(w.record_step, runs[3].id, runs[3].id, "w1", runs[3].token, row("1", args="not json"))
    answers = write_together(db, w, writes)
    assert answers[:3] == [everystep.db.Written(False)] * 3
    assert isinstance(answers[3], psycopg.errors.InvalidTextRepresentation)
    assert db.value("SELECT count(*) FROM everystep_step") == 3


def test_a_step_row_already_there_is_reported_to_its_run(db, writer):
    (run,) = claimed(db, 1)
    w = writer("w1")
    assert w.record_step(run.id, "w1", run.token, row("1")) == everystep.db.Written(False)
    assert w.record_step(run.id, "w1", run.token, row("1")) is False  # the runner asks why_not_written
    end = w.finish_run(run.id, run.token, "completed", "null", None, row("1"), False)
    assert end == everystep.db.BatchEnd(None, True, None)  # the runner ends it again without the row
    assert w.finish_run(run.id, run.token, "completed", "null", None, None, False).status == "completed"


def test_a_worker_commits_many_runs_together(db, start_worker, marks):
    """Through a real worker: 200 one-step runs on 8 slots end in fewer
    transactions than runs (rows written by one transaction share its xmin),
    and each step ran once."""
    with db.connect() as conn, everystep.transaction(conn):
        runs = everystep.schedule_many(workflows.quick, [(marks,)] * 200)
    start_worker("grouped", threads=8)
    wait_for(lambda: db.value("SELECT count(*) FROM everystep_workflow WHERE status = 'completed'") == 200, 60,
             what="every run completed")
    assert {db.run(r.id)["status"] for r in runs} == {"completed"}
    assert db.value("SELECT count(*) FROM everystep_step") == 200
    assert len(marks_of(marks)) == 2 * 200  # each step ran once (a mark as it starts, one as it ends)
    transactions = db.value("SELECT count(DISTINCT xmin::text) FROM everystep_step")
    assert transactions < 200, "no two runs' ends shared a commit"


def step_rows_in_the_ends_transaction(db) -> tuple[int, int]:
    """(runs whose every step row was committed by the transaction that
    ended the run, runs) among the completed runs."""
    (row,) = db.query("""
        SELECT count(*) FILTER (WHERE carried), count(*) FROM (
            SELECT bool_and(s.xmin::text = w.xmin::text) AS carried
            FROM everystep_workflow w JOIN everystep_step s ON s.workflow_id = w.id
            WHERE w.status = 'completed' GROUP BY w.id) runs""")
    return tuple(row)


def test_write_behind_is_refused_where_an_outcome_must_be_written_at_once():
    with pytest.raises(everystep.EverystepError, match="write_behind must be True or False"):
        everystep.step(write_behind="yes")
    with pytest.raises(everystep.EverystepError, match="unsafe_to_repeat=True.*cannot be write_behind=True"):
        everystep.step(write_behind=True, unsafe_to_repeat=True)
    with pytest.raises(everystep.EverystepError, match="transactional=True.*cannot be write_behind=True"):
        everystep.step(write_behind=True, transactional=True)
    assert everystep.step(write_behind=True)(len)("abc") == 3  # outside a run: the plain function


def test_under_load_write_behind_steps_commit_with_their_runs_end(db, start_worker, marks):
    """While every slot runs a body, the outcome of a short write-behind
    step waits past the next step's start: a run of them commits its step
    rows in the transaction of its end. Every row is there, and every step
    ran once."""
    with db.connect() as conn, everystep.transaction(conn):
        runs = everystep.schedule_many(workflows.two_steps_behind, [(marks,)] * 200)
    start_worker("carrying", threads=4)
    wait_for(lambda: db.value("SELECT count(*) FROM everystep_workflow WHERE status = 'completed'") == 200, 60,
             what="every run completed")
    assert db.value("SELECT count(*) FROM everystep_step") == 2 * 200
    assert len(marks_of(marks)) == 2 * 2 * 200  # each step ran once (a mark as it starts, one as it ends)
    carried, ended = step_rows_in_the_ends_transaction(db)
    assert ended == len(runs) and carried > 0, "no run's first step row waited for its end"


def test_under_load_a_plain_steps_row_commits_before_the_next_step_starts(db, start_worker, marks):
    """Without write_behind, under the same load, no step row waits for its
    run's end: a step's outcome is durable before the next step starts."""
    with db.connect() as conn, everystep.transaction(conn):
        everystep.schedule_many(workflows.two_steps, [(marks,)] * 200)
    start_worker("plain", threads=4)
    wait_for(lambda: db.value("SELECT count(*) FROM everystep_workflow WHERE status = 'completed'") == 200, 60,
             what="every run completed")
    assert step_rows_in_the_ends_transaction(db) == (0, 200)


def test_at_rest_a_write_behind_steps_row_commits_before_the_next_step_starts(db, start_worker, marks):
    """With a slot free, nothing is carried: the first step's row commits on
    its own, before the second step starts."""
    start_worker("at-rest", threads=4)
    for _ in range(3):
        with db.connect() as conn, everystep.transaction(conn):
            run = everystep.schedule(workflows.two_steps_behind, marks)
        wait_for(lambda run=run: db.run(run.id)["status"] == "completed", 20, what="the run completed")
    assert step_rows_in_the_ends_transaction(db) == (0, 3)


def test_an_outcome_carried_under_load_is_written_while_the_next_step_runs(db, start_worker, marks, tmp_path):
    """A carried outcome waits at most for the late-outcome thread: with
    both slots held by runs blocked in their second step, their first
    steps' rows are written meanwhile."""
    release = str(tmp_path / "release")
    with db.connect() as conn, everystep.transaction(conn):
        runs = everystep.schedule_many(workflows.behind_then_held, [(marks, release)] * 2)
    start_worker("carrying", threads=2)
    wait_for(lambda: sum(1 for m in marks_of(marks) if m[1] == "two") == 2, 30, what="both runs in their second step")
    wait_for(lambda: db.value("SELECT count(*) FROM everystep_step WHERE step_id = '1'") == 2, 5,
             what="the first steps' rows written while the second steps run")
    assert db.value("SELECT count(*) FROM everystep_step WHERE step_id = '2'") == 0
    open(release, "w").close()
    wait_for(lambda: {db.run(r.id)["status"] for r in runs} == {"completed"}, 30, what="both runs completed")
    assert sorted(tag for _, tag, _ in marks_of(marks) if tag in ("one", "three")) == ["one"] * 2 + ["three"] * 2


def test_a_worker_killed_while_outcomes_wait_loses_no_run_and_no_step_row(db, start_worker, marks):
    """SIGKILL of a worker draining write-behind runs under load: its
    catchup finishes every run, each with all its step rows; a step whose
    outcome was carried ran again (at least once), none was skipped."""
    runs = db.schedule_many(workflows.two_steps_behind, [(marks,)] * 3000)
    first = start_worker("w-behind", threads=4)
    wait_for(lambda: db.value("SELECT count(*) FROM everystep_workflow WHERE status = 'completed'") >= 300, 60,
             what="some runs completed")
    first.kill()
    assert db.value("SELECT count(*) FROM everystep_workflow WHERE status = 'running'") > 0, "killed with no run held"
    start_worker("w-behind", threads=4)
    wait_for(lambda: db.value("SELECT count(*) FROM everystep_workflow WHERE status = 'completed'") == 3000, 120,
             what="every run completed after the catchup")
    assert db.value("SELECT count(*) FROM everystep_step") == 2 * 3000
    ran = collections.Counter((run, tag) for run, tag, _ in marks_of(marks) if tag in ("a", "b"))
    assert set(ran) == {(str(r.id), tag) for r in runs for tag in ("a", "b")}  # every step ran, at least once


def test_write_behind_runs_across_a_server_crash_lose_no_step_row(private_server, tmp_path, marks):
    """A crash of the server (WAL not flushed lost, sessions asked to commit
    without waiting for it) while a worker drains write-behind runs under
    load: the batches it broke are written again once the server is back,
    and every run ends with all its step rows, every step run at least once."""
    from tests.support.processes import WorkerProcess  # noqa: PLC0415

    private_server.lose_unflushed_commits()
    with psycopg.connect(private_server.url, autocommit=True) as conn, everystep.transaction(conn):
        runs = everystep.schedule_many(workflows.two_steps_behind, [(marks,)] * 3000)

    def completed() -> int:
        with psycopg.connect(private_server.url, autocommit=True) as conn:
            return conn.execute("SELECT count(*) FROM everystep_workflow WHERE status = 'completed'").fetchone()[0]

    worker = WorkerProcess(private_server.url, "w-behind", tmp_path / "logs", threads=4)
    try:
        wait_for(lambda: completed() >= 300, 60, what="some runs completed")
        before = completed()
        private_server.crash()
        assert before < 3000, "crashed after the drain"
        wait_for(lambda: completed() == 3000, 120, what="every run completed after the crash")
        with psycopg.connect(private_server.url, autocommit=True) as conn:
            assert conn.execute("SELECT count(*) FROM everystep_step").fetchone()[0] == 2 * 3000
        ran = {(run, tag) for run, tag, _ in marks_of(marks) if tag in ("a", "b")}
        assert ran == {(str(r.id), tag) for r in runs for tag in ("a", "b")}
        assert worker.alive(), worker.output()
    finally:
        worker.close()


def test_limited_runs_are_not_starved_by_an_unlimited_backlog(db, start_worker, marks):
    """Ends claim successors among unlimited workflows only until a batch
    finds a limited workflow with runs to claim: then the whole claim (slots
    included) takes them in their turn. Limited runs scheduled before a
    backlog of unlimited ones end long before the backlog does."""
    from tests.apps.flow_workflows import limited, unlimited  # noqa: PLC0415

    limited_runs = db.schedule_many(limited, [(marks, 0.0)] * 6)
    unlimited_runs = db.schedule_many(unlimited, [(marks, 0.0)] * 400)
    start_worker("mixed", threads=8, imports=("tests.apps.flow_workflows",))
    wait_for(lambda: db.value("SELECT count(*) FROM everystep_workflow WHERE status = 'completed'") == 406, 90,
             what="every run completed")
    last_limited = max(db.run(r.id)["completed_at"] for r in limited_runs)
    unlimited_ends = sorted(db.run(r.id)["completed_at"] for r in unlimited_runs)
    assert last_limited < unlimited_ends[200], "the limited runs waited for the unlimited backlog"


def test_a_database_of_the_previous_version_migrates_in_place_with_runs_in_flight(server_url, tmp_path, marks):
    """A database as 0010 (the last version before the lanes) left it, with
    runs in flight: a run held by a worker of that version ends under its
    claim after the migrations; queued runs of a limited workflow move to the
    limited lane and run within their limit; a delayed run finishes too,
    under a worker of this version."""
    from everystep.testing import server  # noqa: PLC0415
    from tests.apps import flow_workflows  # noqa: PLC0415
    from tests.conftest import Database  # noqa: PLC0415
    from tests.support.migrations import migrated_before  # noqa: PLC0415
    from tests.support.processes import WorkerProcess  # noqa: PLC0415

    schema = f"t_{uuid.uuid4().hex[:12]}"
    migrated_before(server_url, schema, "0011")
    db = Database(server_url, schema)
    worker = None
    try:
        limited_name = flow_workflows.limited.__everystep_workflow__
        quick_name = workflows.quick.__everystep_workflow__
        limited_runs, (delayed, in_flight) = uuid7_many(5), uuid7_many(2)
        with db.connect() as conn:  # as 0010's statements leave them
            conn.execute("INSERT INTO everystep_limit (name, concurrency) VALUES (%s, 3)", (limited_name,))
            conn.execute("INSERT INTO everystep_slot (name, slot) SELECT %s, n FROM generate_series(1, 3) AS n",
                         (limited_name,))
            conn.execute("INSERT INTO everystep_workflow (id, name, args, status) SELECT id, %s, %s::jsonb,"
                         " 'scheduled' FROM unnest(%s::uuid[]) AS id",
                         (limited_name, json.dumps([marks, 0.0]), limited_runs))
            conn.execute("INSERT INTO everystep_workflow (id, name, args, status, due_at)"
                         " VALUES (%s, %s, %s::jsonb, 'waiting', now() + interval '1 second')",
                         (delayed, quick_name, json.dumps([marks])))
            token = conn.execute(
                "INSERT INTO everystep_workflow (id, name, args, status, claimed_by, claim_token)"
                " VALUES (%s, %s, %s::jsonb, 'running', 'old-worker', nextval('everystep_claim_token'))"
                " RETURNING claim_token", (in_flight, quick_name, json.dumps([marks]))).fetchone()[0]
        with db.connect() as conn:
            newer = sorted(f.name.removesuffix(".sql") for f in resources.files("everystep.migrations").iterdir()
                           if f.name.endswith(".sql") and f.name >= "0011")
            assert everystep.db.migrate(conn) == newer
            assert everystep.db.migrate(conn) == []
            lanes = dict(conn.execute("SELECT limited, count(*) FROM everystep_workflow"
                                      " WHERE status IN ('scheduled', 'waiting') GROUP BY limited").fetchall())
            assert lanes == {True: 5, False: 1}  # the limited runs; the delayed run
            ended = everystep.db.finish_run(conn, in_flight, "old-worker", token, "completed", "null", None,
                                            row("1"))
        assert ended.status == "completed"
        worker = WorkerProcess(db.url, "new-worker", tmp_path / "logs", threads=8,
                               imports=("tests.apps.workflows", "tests.apps.flow_workflows"))
        wait_for(lambda: all(db.run(r)["status"] == "completed" for r in [*limited_runs, delayed]), 60,
                 what="every run in flight completed")
        steps = db.query("SELECT s.started_at, s.finished_at FROM everystep_step s JOIN everystep_workflow_all w"
                         " ON w.id = s.workflow_id WHERE w.name = %s", (limited_name,))
        assert len(steps) == 5
        assert max(sum(1 for a, b in steps if a <= t < b) for t, _ in steps) <= 3
    finally:
        if worker is not None:
            worker.close()
        server.drop(db, server_url)
