"""The readers of durable streams in one process share one listener per
database (everystep.stream_readers): one LISTEN connection, one look per
wake of each stream for all its readers, a notification that carries the
entries (or names the stream and its last offset); every reader still gets every entry in order,
from its own offset, after a reconnect too."""

from __future__ import annotations

import asyncio
import threading
import time

import psycopg
import pytest

import everystep
import everystep.db
from everystep import stream_readers, streams
from tests.apps import stream_workflows as flows
from tests.support.engine import schedule_one

ENTRIES = 30


def ticks(start: int = 0) -> list:
    return [(i, f"tick {i}. ") for i in range(start, ENTRIES)]


def wait_until(test, what: str, seconds: float = 10.0) -> None:
    limit = time.monotonic() + seconds
    while not test():
        assert time.monotonic() < limit, f"waited {seconds} s for {what}"
        time.sleep(0.01)


def hub_of(db) -> stream_readers.Hub:
    return stream_readers._hubs[db.url]


def readers_of(db, run, key: str = "out") -> int:
    tail = hub_of(db)._tails.get((str(run.id), key))
    return 0 if tail is None else len(tail.readers)


def test_many_readers_share_one_listener_and_each_gets_every_entry_in_order_after_a_reconnect(db, monkeypatch):
    looks = []
    read_stream = everystep.db.read_stream

    def counted(conn, run, key, offset, limit):
        looks.append(offset)
        return read_stream(conn, run, key, offset, limit)

    monkeypatch.setattr(everystep.db, "read_stream", counted)
    run = schedule_one(db, flows.ticks, ENTRIES, 0.01)
    got: dict[int, list] = {}

    def reader(i: int) -> None:
        got[i] = []
        entries = everystep.read_stream(run.id, "out", timeout=20, conn=db.url)
        for entry in entries:
            got[i].append(tuple(entry))
            if i >= 6 and entry.offset == 3 + i:  # a reconnect, from the offset after the last entry it got
                entries.close()
                break
        else:
            return
        got[i] += [tuple(e) for e in everystep.read_stream(run.id, "out", offset=got[i][-1][0] + 1, timeout=20,
                                                             conn=db.url)]

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(12)]
    for thread in threads:
        thread.start()
    wait_until(lambda: db.url in stream_readers._hubs and readers_of(db, run) == 12, "the 12 readers")
    hub = hub_of(db)
    assert len(hub._tails) == 1  # one tail for the stream, all 12 readers in it
    first_looks = len(looks)
    assert db.run_pending() == {run.id: "completed"}
    for thread in threads:
        thread.join(20)
    assert got == {i: ticks() for i in range(12)}
    assert stream_readers._hubs[db.url] is hub  # the reconnects came back to the same listener
    # The entries come in the notifications: a look only for each reader that
    # comes back (6), and at the run's end (the last reader of a stream
    # looking every notification would take 30 or more).
    assert len(looks) - first_looks < 12


def notices_of(db, workflow, *args) -> tuple[list[stream_readers.Notice], list[str]]:
    """The stream notifications of a run of `workflow`, parsed, and as sent."""
    with psycopg.connect(db.url, autocommit=True) as listener:
        everystep.db.listen_streams(listener)
        run = schedule_one(db, workflow, *args)
        assert db.run_pending() == {run.id: "completed"}
        payloads = [n.payload for n in listener.notifies(timeout=0.5)]
    assert payloads[-1] == str(run.id)  # the run's end: every stream of the run
    notices = [stream_readers.parse_notification(p) for p in payloads[:-1]]
    assert notices and all(n.run == str(run.id) and n.key == "out" for n in notices)
    return notices, payloads


def looked(db, run_id: str, offset: int) -> list[tuple]:
    with psycopg.connect(db.url, autocommit=True) as conn:
        return everystep.db.read_stream(conn, run_id, "out", offset, 1000).entries


def test_a_notification_carries_the_entries_it_notifies_as_a_look_reads_them(db):
    notices, payloads = notices_of(db, flows.writes, 3)
    assert all(n.entries is not None for n in notices)
    rows = [row for n in notices for row in n.rows()]
    assert [n.last for n in notices][-1] == 3 == rows[-1][0]  # the close, after the entries 0..2
    assert rows == looked(db, notices[0].run, 0)  # offset, value as JSON text, close, step, attempt, token
    assert rows[-1][2] and not any(row[2] for row in rows[:-1])
    assert all(len(p.encode()) < 8000 for p in payloads)


def test_entries_that_do_not_fit_a_notification_are_notified_by_offset(db):
    # 300 small entries take several notifications; one of 9,000 characters fits none.
    notices, payloads = notices_of(db, flows.writes_sizes, [40] * 300 + [9000, 40])
    assert all(len(p.encode()) < 8000 for p in payloads)
    carried = [row for n in notices if n.entries is not None for row in n.rows()]
    by_offset = [n for n in notices if n.entries is None]
    assert by_offset and all(n.last >= 300 for n in by_offset)  # the large entry's part: a reader looks
    assert len(notices) > 2
    everything = looked(db, notices[0].run, 0)
    assert [row for row in everything if row[0] < 300] == [row for row in carried if row[0] < 300]
    assert len(everything) == 303


def test_a_notification_names_its_stream_and_last_offset():
    run = "0190a0b4-0000-7000-8000-000000000000"
    assert stream_readers.parse_notification(f"{run} 7 a key with spaces") == (run, 7, "a key with spaces", None, None)
    notice = stream_readers.parse_notification(f'{run} @4 5 5 a b c[[4,"1",null,null,9],[5,null,"s1",2,9]]')
    assert (notice.run, notice.first, notice.last, notice.key) == (run, 4, 5, "a b c")
    assert notice.rows() == [(4, "1", False, None, None, 9), (5, None, True, "s1", 2, 9)]
    assert stream_readers.parse_notification(run) == (run, None, None, None, None)


def test_a_reader_looks_only_at_a_notification_of_its_stream_at_or_after_its_offset():
    run = "0190a0b4-0000-7000-8000-000000000000"
    assert streams._concerns(f"{run} 5 out", run, "out", 5)
    assert not streams._concerns(f"{run} 4 out", run, "out", 5)  # not behind: nothing new for it
    assert not streams._concerns(f"{run} 9 other", run, "out", 5)
    assert not streams._concerns("0190a0b4-0000-7000-8000-000000000001 9 out", run, "out", 5)
    assert streams._concerns(run, run, "out", 5)  # the run's end closes its streams


def test_sync_and_async_readers_of_a_process_share_the_listener(db):
    run = schedule_one(db, flows.ticks, ENTRIES, 0.005)
    got: list = []

    async def read() -> list:
        return [tuple(e) async for e in everystep.aread_stream(run.id, "out", offset=5, timeout=20, conn=db.url)]

    thread = threading.Thread(target=lambda: got.append(asyncio.run(read())))
    thread.start()
    entries = everystep.read_stream(run.id, "out", timeout=20, conn=db.url)
    wait_until(lambda: readers_of(db, run) == 2, "both readers in one tail")
    assert db.run_pending() == {run.id: "completed"}
    assert [tuple(e) for e in entries] == ticks()
    thread.join(20)
    assert got == [ticks(5)]


def test_the_listener_ends_when_idle_and_the_next_reader_starts_another(db, monkeypatch):
    monkeypatch.setattr(stream_readers, "IDLE", 0.2)
    run = schedule_one(db, flows.writes, 2)
    assert db.run_pending() == {run.id: "completed"}
    assert [tuple(e) for e in everystep.read_stream(run.id, "out", conn=db.url)] == [(0, {"i": 0}), (1, {"i": 1})]
    first = hub_of(db)
    wait_until(lambda: first.dead and not first._thread.is_alive(), "the idle listener to end")
    assert db.value("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (first.backend_pid,)) == 0
    assert [tuple(e) for e in everystep.read_stream(run.id, "out", offset=1, conn=db.url)] == [(1, {"i": 1})]
    assert hub_of(db) is not first


def test_a_lost_listener_connection_ends_its_readers_with_the_error_and_the_next_reader_reconnects(db):
    run = schedule_one(db, flows.writes, 2)  # scheduled, not executed yet
    errors: list = []

    def reader() -> None:
        try:
            list(everystep.read_stream(run.id, "out", timeout=20, conn=db.url))
        except psycopg.OperationalError as exc:
            errors.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    wait_until(lambda: db.url in stream_readers._hubs and readers_of(db, run) == 1
               and hub_of(db)._tails[(str(run.id), "out")].readers[0].looked, "the reader's first look")
    lost = hub_of(db)
    db.value("SELECT pg_terminate_backend(%s)", (lost.backend_pid,))
    thread.join(20)
    assert len(errors) == 1 and lost.dead
    assert db.run_pending() == {run.id: "completed"}
    assert [tuple(e) for e in everystep.read_stream(run.id, "out", conn=db.url)] == [(0, {"i": 0}), (1, {"i": 1})]


def test_an_unknown_run_is_an_error_at_the_call_and_leaves_no_reader(db):
    with pytest.raises(everystep.EverystepError, match="read_stream\\(\\): no run"):
        everystep.read_stream(everystep.ids.uuid7(), "out", conn=db.url)
    assert all(not tail.readers for tail in hub_of(db)._tails.values())


def test_a_slow_reader_holds_at_most_a_look_or_two_and_still_gets_everything(db, monkeypatch):
    monkeypatch.setattr(stream_readers, "READ_BATCH", 4)
    monkeypatch.setattr(stream_readers, "LOOK_AGAIN", 60.0)  # a look it would not ask for would come too late
    run = schedule_one(db, flows.ticks, ENTRIES, 0.002)
    fast = everystep.read_stream(run.id, "out", timeout=20, conn=db.url)
    slow = everystep.read_stream(run.id, "out", timeout=3, conn=db.url)
    assert db.run_pending() == {run.id: "completed"}
    assert [tuple(e) for e in fast] == ticks()
    reader = hub_of(db)._tails[(str(run.id), "out")].readers[0]
    assert len(reader.rows) <= 2 * 4  # the slow one was not given the whole stream meanwhile
    got = []
    for entry in slow:
        got.append(tuple(entry))
        time.sleep(0.001)
    assert got == ticks()


def test_a_database_that_cannot_be_reached_is_an_error_at_the_call():
    url = "host=127.0.0.1 port=1 user=nobody dbname=nothing connect_timeout=2"
    for _ in range(2):  # and again: a new listener tries again
        with pytest.raises(psycopg.OperationalError):
            everystep.read_stream(everystep.ids.uuid7(), "out", conn=url)

    async def read() -> None:
        async for _entry in everystep.aread_stream(everystep.ids.uuid7(), "out", conn=url):
            pass

    with pytest.raises(psycopg.OperationalError):
        asyncio.run(read())
