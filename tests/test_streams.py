"""Durable streams (everystep.write_stream / read_stream, 0023): offsets
dense from 0, exactly once from the body and at least once (tagged) from a
step, read live as entries commit and again from any offset, closed by a
close or by the run's end, moved to the history and pruned with the run;
bad input refused with nothing written."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

import everystep
from everystep import faults, metrics, retention
from everystep.errors import EverystepError
from everystep.testing import crash_after_step
from tests.apps import stream_workflows as flows
from tests.support.engine import schedule_one


@pytest.fixture(autouse=True)
def _counters():
    flows.calls.clear()
    yield
    faults.disarm_all()  # the executions a crash killed are known by token, which the next test's schema reuses


def read_all(db, run_id, key="out", offset=0, timeout=5.0) -> list:
    return list(everystep.read_stream(run_id, key, offset=offset, timeout=timeout, conn=db.url))


def test_body_writes_are_read_in_order_from_any_offset_and_the_close_ends_the_reader(db):
    run = schedule_one(db, flows.writes, 5)
    assert db.run_pending() == {run.id: "completed"}
    with db.connect() as conn:
        conn.autocommit = True
        assert list(everystep.read_stream(run.id, "out", conn=conn)) == [(i, {"i": i}) for i in range(5)]
    entries = read_all(db, run.id, offset=3)
    assert entries == [(3, {"i": 3}), (4, {"i": 4})]
    assert [(e.offset, e.value, e.step, e.attempt) for e in entries] == [(3, {"i": 3}, None, None),
                                                                          (4, {"i": 4}, None, None)]
    assert read_all(db, run.id, offset=99) == []
    assert read_all(db, run.id, key="other") == []  # the run's end closed every stream, even an empty one
    # Dense offsets, and the close as the last row.
    assert db.query('SELECT "offset", value IS NULL FROM everystep_stream WHERE run_id = %s ORDER BY 1',
                    (run.id,)) == [(i, i == 5) for i in range(6)]


def test_a_reader_gets_entries_as_they_commit_while_the_run_goes_on(db):
    run = schedule_one(db, flows.waits_then_writes, 6)
    got: list = []

    def reader() -> None:
        for entry in everystep.read_stream(run.id, "out", timeout=10, conn=db.url):
            got.append((entry.value, time.monotonic()))

    thread = threading.Thread(target=reader)
    thread.start()
    time.sleep(0.2)
    assert db.run_pending() == {run.id: "completed"}
    ended = time.monotonic()
    thread.join(10)
    assert [value for value, _ in got] == list(range(6))
    assert got[0][1] < ended - 0.15  # read while the run still slept between its writes


def test_a_replay_does_not_write_the_bodys_entries_again(db):
    run = schedule_one(db, flows.mixed, 3)
    with crash_after_step(flows.tokens), pytest.raises(faults.Crash):
        db.run_pending()
    assert db.run(run.id)["status"] == "running"
    assert db.resume_held() == {run.id: "completed"}
    assert flows.calls["tokens"] == 1
    assert [v for _, v in read_all(db, run.id)] == ["start", "t0", "t1", "t2", "end"]


def last_tries(entries: list) -> list:
    """What a reader that shows each value once keeps: of each step's
    entries, those of its last try (the reader rule of docs/streams.md)."""
    last = {}
    for entry in entries:
        if entry.step is not None:
            last[entry.step] = entry.tried
    return [e.value for e in entries if e.step is None or e.tried == last[e.step]]


def test_a_steps_entries_are_at_least_once_and_tell_their_try(db):
    run = schedule_one(db, flows.mixed, 2)
    # Its outcome lost: the step runs again.
    with crash_after_step(flows.tokens, before_outcome=True), pytest.raises(faults.Crash):
        db.run_pending()
    assert db.resume_held() == {run.id: "completed"}
    assert flows.calls["tokens"] == 2
    entries = read_all(db, run.id)
    assert [e.offset for e in entries] == list(range(len(entries)))
    assert last_tries(entries) == ["start", "t0", "t1", "end"]
    tries = {e.tried for e in entries if e.step == "2"}
    if len(entries) > 4:  # the first try's entries committed before the crash: another execution's
        assert len(tries) == 2 and {attempt for _, attempt in tries} == {1}
    # Retries of a step within one execution: the attempt tells them apart.
    run = schedule_one(db, flows.retried)
    assert db.run_pending() == {run.id: "completed"}
    entries = read_all(db, run.id)
    assert [(e.value, e.step, e.attempt) for e in entries] == [("try1", "1", 1), ("try2", "1", 2)]
    assert last_tries(entries) == ["try2"]


def test_async_workflows_and_steps_write_with_await(db):
    run = schedule_one(db, flows.writes_async, 3)
    assert db.run_pending() == {run.id: "completed"}
    entries = read_all(db, run.id)
    assert [v for _, v in entries] == [0, 1, 2, "a0", "a1"]
    assert [e.step for e in entries] == [None, None, None, "4", "4"]

    async def read() -> list:
        return [entry async for entry in everystep.aread_stream(run.id, "out", offset=2, conn=db.url)]

    assert asyncio.run(read()) == [(2, 2), (3, "a0"), (4, "a1")]


def test_bad_input_is_one_clear_error_and_writes_nothing(db):
    run = schedule_one(db, flows.after_close)
    assert db.run_pending() == {run.id: "failed"}
    error = db.run(run.id)["error"]
    assert error["type"] == "everystep.errors.EverystepError" and "is closed" in error["message"]
    assert db.value("SELECT count(*) FROM everystep_stream WHERE run_id = %s", (run.id,)) == 1  # the close only
    with pytest.raises(EverystepError, match="no run"):
        everystep.read_stream(everystep.ids.uuid7(), "out", conn=db.url)
    with pytest.raises(EverystepError, match="stream key of 1 to 300"):
        everystep.read_stream(run.id, "k" * 301, conn=db.url)
    with pytest.raises(EverystepError, match="offset"):
        everystep.read_stream(run.id, "out", offset=-1, conn=db.url)
    with db.connect(autocommit=False) as conn, pytest.raises(EverystepError, match="autocommit"):
        everystep.read_stream(run.id, "out", conn=conn)
    with pytest.raises(EverystepError, match="running workflow"):
        everystep.write_stream("out", 1)


def test_a_value_that_cannot_be_stored_or_a_long_key_fails_the_write_not_the_stream(db):
    runs = [schedule_one(db, flows.bad_value), schedule_one(db, flows.bad_key)]
    assert set(db.run_pending().values()) == {"failed"}
    assert [v for _, v in read_all(db, runs[0].id)] == ["fine"]
    assert "300" in db.run(runs[1].id)["error"]["message"]
    assert db.value("SELECT count(*) FROM everystep_stream WHERE run_id = %s AND value IS NOT NULL",
                    (runs[1].id,)) == 0


def test_a_reader_times_out_with_nothing_new(db):
    run = schedule_one(db, flows.writes, 1)  # scheduled, not executed: nothing comes
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        read_all(db, run.id, timeout=0.3)
    assert 0.25 < time.monotonic() - started < 3


def test_streams_move_to_the_history_with_their_run_and_are_pruned_with_it(db):
    run = schedule_one(db, flows.writes, 3)
    db.run_pending()
    with db.connect() as conn:
        assert retention.archive(conn, 0) == 1
    assert db.value("SELECT count(*) FROM everystep_stream") == 0
    assert db.value("SELECT count(*) FROM everystep_stream_history") == 4
    assert [v for _, v in read_all(db, run.id, offset=1)] == [{"i": 1}, {"i": 2}]
    with db.connect() as conn:
        everystep.testing.clock.advance(conn, 3 * 86400, drain=False)
        retention.apply(conn, {"completed": 86400})
    assert db.value("SELECT count(*) FROM everystep_stream_history") == 0


def test_the_entries_written_are_counted(db):
    name = f"{flows.writes.__module__}.{flows.writes.__qualname__}"
    before = metrics.STREAM_ENTRIES.labels(name)._value.get()
    run = schedule_one(db, flows.writes, 4)
    db.run_pending()
    assert metrics.STREAM_ENTRIES.labels(name)._value.get() - before == 5  # and the close
    assert read_all(db, run.id)


def test_a_lost_claim_writes_no_entry(db):
    run = schedule_one(db, flows.waits_then_writes, 3)
    with db.connect() as conn:
        claimed = everystep.db.claim(conn, "w1", 1)
    # Another worker took it over (the sweep requeued it and it was claimed again).
    db.query("UPDATE everystep_workflow SET claim_token = claim_token + 1000 WHERE id = %s RETURNING 1", (run.id,))
    from everystep.runner import Runner  # noqa: PLC0415
    runner = Runner(db.pool, "w1")
    try:
        assert runner.execute(claimed[0]).outcome == "abandoned"
    finally:
        runner.close()
    assert db.value("SELECT count(*) FROM everystep_stream") == 0


# ---------------------------------------------------------------- over HTTP: the UI's Server-Sent Events

VIEWER = "viewer-token-0123456789abcdef"


@pytest.fixture
def ui_url(db, tmp_path):
    from tests.support.ui_process import UiProcess  # noqa: PLC0415

    process = UiProcess(db.url, tmp_path / "ui", env={"EVERYSTEP_UI_VIEWER_TOKEN": VIEWER})
    yield process.url
    process.close()


def test_the_ui_serves_a_stream_as_server_sent_events_resumable_by_offset(db, ui_url):
    import httpx  # noqa: PLC0415

    from tests.support.sse import events  # noqa: PLC0415

    run = schedule_one(db, flows.waits_then_writes, 6)
    path = f"{ui_url}/api/runs/{run.id}/streams/out"
    auth = {"Authorization": f"Bearer {VIEWER}"}
    worker = threading.Thread(target=db.run_pending)
    with httpx.Client() as client:
        assert client.get(path).status_code == 401  # under the UI's authentication
        assert client.get(f"{ui_url}/api/runs/{everystep.ids.uuid7()}/streams/out", headers=auth).status_code == 404
        got = []
        worker.start()
        for event in events(client, path, auth):  # a client that drops after three entries ...
            got.append((event.id, json.loads(event.data)))
            if len(got) == 3:
                break
        assert got == [("0", 0), ("1", 1), ("2", 2)]
        # ... and reconnects with the last id it saw: the entries after it, then the end.
        rest = list(events(client, path, {**auth, "Last-Event-ID": "2"}))
        worker.join(10)
        assert [(e.id, e.data) for e in rest[:-1]] == [("3", "3"), ("4", "4"), ("5", "5")]
        assert rest[-1].event == "end"
        assert [e.data for e in events(client, path + "?offset=4", auth)][:2] == ["4", "5"]
        run_page = client.get(f"{ui_url}/api/runs/{run.id}", headers=auth).json()
        assert run_page["streams"] == [{"key": "out", "entries": 6, "closed": True}]


# ---------------------------------------------------------------- docs/streams.md, as written

def test_the_examples_of_the_docs_run_as_written(db, tmp_path, monkeypatch):
    import sys  # noqa: PLC0415

    from tests.support.docs import python_blocks, write_module  # noqa: PLC0415

    write_module("streams.md", 0, tmp_path, "streams_doc_example")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("streams_doc_example", None)
    import streams_doc_example as example  # noqa: PLC0415

    run = schedule_one(db, example.book_summary, 2)
    assert db.run_pending() == {run.id: "completed"}
    printed: list = []
    namespace = {"everystep": everystep, "run_id": run.id, "database_url": db.url,
                 "print": lambda *args: printed.append(args)}
    exec(python_blocks("streams.md")[2], namespace)  # the reader of "progress"
    assert printed == [(0, {"chapter": 0, "of": 2}), (1, {"chapter": 1, "of": 2})]
    exec(python_blocks("streams.md")[4], namespace)  # the reader that keeps each step's last try
    shown = namespace["shown"]
    assert "".join(e.value for kept in shown.values() for e in kept) == "Chapter 0 in short.Chapter 1 in short."
    sys.modules.pop("streams_doc_example", None)
