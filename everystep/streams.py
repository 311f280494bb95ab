"""Durable streams: output a run writes while it goes on (tokens of a model,
progress, partial results), read from outside by offset, live, and again
after a reconnect. See docs/streams.md.

A write hands the entry to the run's execution (everystep.execution.HeldRun),
which gives it its offset and sends it to the process's group commit without
waiting: the body goes on at once, and the entries of many writes share a
statement and a commit. What a step wrote commits before its outcome, and
everything before the run's end. A reader LISTENs, looks, and looks again
when a commit of its stream notifies it (the notification names the stream
and its last offset, so a reader that is not behind does not look). The
readers of a process that read by database URL share one connection, which
hands them the entries a notification carries, and one look per wake of a
stream they are behind in (everystep.stream_readers).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any, NamedTuple

import psycopg

from everystep import db, serde, stream_readers
from everystep.connections import bound_connection
from everystep.context import current_run, current_scope
from everystep.errors import EverystepError
from everystep.schema import TERMINAL

MAX_STREAM_KEY = 300
# Entries a reader takes per look.
READ_BATCH = stream_readers.READ_BATCH
# Without a notification a reader looks again this often (seconds): a run
# ended by something else than its execution (a cancel while it waited, a
# dead worker's poison run) closes its streams without notifying them.
LOOK_AGAIN = stream_readers.LOOK_AGAIN


class StreamEntry(tuple):
    """One entry as a reader gets it: the pair (offset, value), and where it
    came from: `step` (None: written by the workflow body, exactly once; else
    the id of the step whose function wrote it), `attempt` (that step's try,
    1, 2, ... as retried) and `execution` (the execution token of the claim
    that wrote it). A step's writes are at least once: a try that failed, or
    died with its worker, may have written entries before the try that
    counted; its entries have another (execution, attempt) than the last
    try's of the same step."""

    def __new__(cls, offset: int, value: Any, step: str | None = None, attempt: int | None = None,
                execution: int | None = None) -> StreamEntry:
        entry = super().__new__(cls, (offset, value))
        entry.step, entry.attempt, entry.execution = step, attempt, execution
        return entry

    @property
    def offset(self) -> int:
        return self[0]

    @property
    def value(self) -> Any:
        return self[1]

    @property
    def tried(self) -> tuple[int | None, int | None]:
        """(execution, attempt): the try of its step that wrote it."""
        return self.execution, self.attempt


def _key(what: str, key: Any) -> str:
    if not isinstance(key, str) or not 1 <= len(key) <= MAX_STREAM_KEY:
        raise EverystepError(f"{what} takes a stream key of 1 to {MAX_STREAM_KEY} characters, not {key!r:.60}")
    return key


def _in_run(what: str) -> Any:
    run = current_run.get()
    if run is None:
        raise EverystepError(f"{what} can only be called in a running workflow (its body or one of its steps)")
    return run


# ---------------------------------------------------------------- writing, in a run

def write_stream(key: str, value: Any) -> Any:
    """Append `value` (JSON, the extended codec) to this run's stream `key`
    and return its offset. From the workflow body a write is recorded like a
    step: a replay does not write it again. From inside a step it is at least
    once (see StreamEntry). The write does not wait for its commit: the
    entry commits before the next step's outcome, and before the run ends.
    In an async workflow or step: `await everystep.write_stream(...)` (or
    `awrite_stream`). A value that cannot be stored, a bad key, a closed
    stream: EverystepError, nothing written."""
    key = _key("write_stream()", key)
    value_json = serde.dumps(value)
    run = _in_run("write_stream()")
    return run.replay.write_stream(current_scope.get(), key, value_json)


def close_stream(key: str) -> Any:
    """Close this run's stream `key`: its readers end once they read to
    here; a write after it is an EverystepError. Closing a closed stream does
    nothing. The run's end closes all its streams. Recorded like
    write_stream (in async code: awaited)."""
    key = _key("close_stream()", key)
    run = _in_run("close_stream()")
    return run.replay.write_stream(current_scope.get(), key, None)


async def awrite_stream(key: str, value: Any) -> int:
    """`write_stream` to await, in an async workflow or step."""
    return await _awaited(write_stream(key, value))


async def aclose_stream(key: str) -> None:
    """`close_stream` to await."""
    await _awaited(close_stream(key))


async def _awaited(done: Any) -> Any:
    return (await done) if asyncio.iscoroutine(done) else done


# ---------------------------------------------------------------- reading, from outside

def _run_id(what: str, run_id: Any) -> uuid.UUID:
    try:
        return run_id if isinstance(run_id, uuid.UUID) else uuid.UUID(str(run_id))
    except ValueError:
        raise EverystepError(f"{what} takes a run id, not {run_id!r}") from None


def _read_args(what: str, run_id: Any, key: Any, offset: Any, timeout: Any) -> tuple:
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise EverystepError(f"{what} takes an offset that is an int >= 0, not {offset!r}")
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0):
        raise EverystepError(f"{what} takes a timeout in seconds >= 0 (or None), not {timeout!r}")
    return _run_id(what, run_id), _key(what, key), offset, timeout


class _Look(NamedTuple):
    entries: list[StreamEntry]
    ended: bool  # the stream ends with them
    full: bool  # READ_BATCH entries: there may be more already


def _entry(row: tuple, raw: bool) -> StreamEntry | tuple[int, str]:
    """The entry of a row of a look (`raw`: the pair (offset, value as JSON text))."""
    offset, value, _closes, step_id, attempt, token = row
    if raw:
        return offset, value
    return StreamEntry(offset, serde.from_json(json.loads(value)), step_id if attempt is not None else None,
                       attempt, token)


# Values a reader cannot change: one entry of them serves all the readers of a process.
_IMMUTABLE = frozenset({str, int, float, bool, type(None), bytes, datetime.datetime, datetime.date,
                        datetime.time, datetime.timedelta, uuid.UUID})


def _entries_of(cells: list[stream_readers.Cell]) -> list[StreamEntry]:
    """The entries of cells of a shared look, for one reader: each made once
    for all the readers of the process when its value is immutable (kept in
    its cell), else this reader's own; the values still to decode are
    decoded together, in one call."""
    entries = [cell.entry for cell in cells]
    missing = [i for i, entry in enumerate(entries) if entry is None]
    if missing:
        values = json.loads(f"[{','.join([cells[i].row[1] for i in missing])}]")
        for i, value in zip(missing, values):
            offset, _text, _closes, step_id, attempt, token = cells[i].row
            entry = entries[i] = StreamEntry(offset, serde.from_json(value), step_id if attempt is not None else None,
                                             attempt, token)
            if type(entry.value) in _IMMUTABLE:
                cells[i].entry = entry
    return entries


def _entries(what: str, run_id: uuid.UUID, look: db.StreamLook, raw: bool = False) -> _Look:
    """The entries of a look (`raw`: their values as JSON text)."""
    if look.status is None:
        raise EverystepError(f"{what}: no run {run_id}")
    entries = []
    for row in look.entries:
        if row[2]:  # the close
            return _Look(entries, True, False)
        entries.append(_entry(row, raw))
    full = len(look.entries) == READ_BATCH
    return _Look(entries, not full and look.status in TERMINAL, full)


class _Clock:
    """A reader's timeout: from the last entry it got."""

    def __init__(self, timeout: float | None):
        self.timeout = timeout
        self.reset()

    def reset(self) -> None:
        self.limit = None if self.timeout is None else time.monotonic() + self.timeout

    def wait(self, run_id: uuid.UUID, key: str) -> float:
        """How long to wait for a notification now; TimeoutError once the timeout passed."""
        if self.limit is None:
            return LOOK_AGAIN
        left = self.limit - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"nothing new on stream {key!r} of run {run_id} within {self.timeout:g} s")
        return min(left, LOOK_AGAIN)


def _reader_connection(what: str, conn: Any) -> psycopg.Connection:
    """The reader's own connection (a URL is read through the process's listener)."""
    if not isinstance(conn, psycopg.Connection):
        raise EverystepError(f"{what} reads with conn=<psycopg Connection in autocommit mode, or a database URL> "
                             "(or the one bound with everystep.use), not "
                             f"{'nothing' if conn is None else type(conn).__name__}")
    if not conn.autocommit:
        raise EverystepError(f"{what} needs a connection in autocommit mode: it LISTENs for new entries between "
                             "its reads (psycopg.connect(url, autocommit=True), or pass the URL)")
    return conn


def read_stream(run_id: uuid.UUID | str, key: str, offset: int = 0, timeout: float | None = None,
                conn: Any = None) -> Iterator[StreamEntry]:
    """The entries of run `run_id`'s stream `key` from `offset` on, as
    (offset, value) pairs (StreamEntry) in offset order, as they commit:
    blocks for the next one (woken by NOTIFY) and ends when the stream is
    closed or the run has ended; TimeoutError after `timeout` seconds with
    nothing new. `conn`: a psycopg Connection in autocommit mode (the reader
    LISTENs on it), a database URL (read through the process's one
    listener for it, shared with its other readers: see
    everystep.stream_readers), or the one bound with `everystep.use`. Bad
    arguments, an unknown run and a database that cannot be reached are
    errors here, before the first entry."""
    what = "read_stream()"
    run_id, key, offset, timeout = _read_args(what, run_id, key, offset, timeout)
    conn = conn if conn is not None else bound_connection()
    if isinstance(conn, str):
        return _read_shared(what, conn, run_id, key, offset, timeout)
    conn = _reader_connection(what, conn)
    db.listen_streams(conn)  # before the first look: no commit after it goes unnoticed
    look = _entries(what, run_id, db.read_stream(conn, run_id, key, offset, READ_BATCH))
    return _read(conn, run_id, key, look, offset, _Clock(timeout))


def _read_shared(what: str, url: str, run_id: uuid.UUID, key: str, offset: int,
                 timeout: float | None) -> Iterator[StreamEntry]:
    """read_stream by URL: through this process's listener for the URL."""
    signal = threading.Event()
    hub, reader = stream_readers.open_reader(url, run_id, key, offset, signal.set)
    try:
        while not reader.looked and reader.error is None:  # the first look, here: its errors at the call
            signal.wait()
            signal.clear()
        if reader.missing:
            raise EverystepError(f"{what}: no run {run_id}")
        if reader.error is not None:  # the connection could not be made, or was lost
            raise reader.error
    except BaseException:
        hub.close(reader)
        raise
    return _follow(hub, reader, signal, run_id, key, _Clock(timeout))


def _follow(hub: stream_readers.Hub, reader: stream_readers.Reader, signal: threading.Event, run_id: uuid.UUID,
            key: str, clock: _Clock) -> Iterator[StreamEntry]:
    try:
        while True:
            signal.clear()  # before taking: a wake after it is not lost
            rows, ended, error = hub.take(reader)
            yield from _entries_of(rows)
            if ended:
                return
            if error is not None:
                raise error
            if rows:
                clock.reset()
            else:
                signal.wait(clock.wait(run_id, key))
    finally:
        hub.close(reader)


def _read(conn: psycopg.Connection, run_id: uuid.UUID, key: str, look: _Look, offset: int,
          clock: _Clock) -> Iterator[StreamEntry]:
    while True:
        for entry in look.entries:
            yield entry
            offset = entry.offset + 1
        if look.ended:
            return
        if look.entries:
            clock.reset()
        if not look.full:  # the next look after the next commit (a notification come meanwhile: at once)
            _notified(conn, str(run_id), key, offset, clock.wait(run_id, key))
        look = _entries("read_stream()", run_id, db.read_stream(conn, run_id, key, offset, READ_BATCH))


def _concerns(payload: str, run: str, key: str, offset: int) -> bool:
    """Whether a notification may bring a reader of `run`'s stream `key`
    at `offset` something new: an entry at or after it, or the run's end."""
    notice = stream_readers.parse_notification(payload)
    return notice.run == run and (notice.last is None or (notice.key == key and notice.last >= offset))


def _notified(conn: psycopg.Connection, run: str, key: str, offset: int, seconds: float) -> None:
    """Until a notification that concerns the reader, or `seconds`."""
    until = time.monotonic() + seconds
    while (left := until - time.monotonic()) > 0:
        for notify in conn.notifies(timeout=left, stop_after=1):
            if _concerns(notify.payload, run, key, offset):
                return


async def aread_stream(run_id: uuid.UUID | str, key: str, offset: int = 0, timeout: float | None = None,
                       conn: Any = None) -> AsyncIterator[StreamEntry]:
    """`read_stream` as an async iterator (`async for offset, value in
    everystep.aread_stream(...)`); `conn`: a psycopg AsyncConnection in
    autocommit mode, a database URL, or the one bound. Errors come at the
    first iteration."""
    async for entries in _alooks("aread_stream()", run_id, key, offset, timeout, conn, raw=False):
        for entry in entries:
            yield entry


def aread_stream_looks(run_id: uuid.UUID | str, key: str, offset: int = 0, timeout: float | None = None,
                       conn: Any = None) -> AsyncIterator[list[tuple[int, str]]]:
    """`aread_stream` by look: the entries each look found, together, as
    (offset, value) pairs with the value as the stored JSON text, not
    decoded (what a Server-Sent Events response sends as it is, in one
    write per look)."""
    return _alooks("aread_stream()", run_id, key, offset, timeout, conn, raw=True)


async def _alooks(what: str, run_id: Any, key: Any, offset: Any, timeout: Any, conn: Any,
                  raw: bool) -> AsyncIterator[list]:
    run_id, key, offset, timeout = _read_args(what, run_id, key, offset, timeout)
    conn = conn if conn is not None else bound_connection()
    if isinstance(conn, str):
        async for entries in _alooks_shared(what, conn, run_id, key, offset, _Clock(timeout), raw):
            yield entries
        return
    if not isinstance(conn, psycopg.AsyncConnection) or not conn.autocommit:
        raise EverystepError(f"{what} reads with conn=<psycopg AsyncConnection in autocommit mode, or a database "
                             "URL> (or the one bound with everystep.use)")
    clock = _Clock(timeout)
    await db.alisten_streams(conn)
    while True:
        look = _entries(what, run_id, await db.aread_stream(conn, run_id, key, offset, READ_BATCH), raw)
        if look.entries:
            yield look.entries
            offset = look.entries[-1].offset + 1
        if look.ended:
            return
        if look.entries:
            clock.reset()
        if look.full:
            continue
        until = time.monotonic() + clock.wait(run_id, key)
        while (left := until - time.monotonic()) > 0:
            async for notify in conn.notifies(timeout=left, stop_after=1):
                if _concerns(notify.payload, str(run_id), key, offset):
                    left = 0
            if left == 0:
                break


async def _alooks_shared(what: str, url: str, run_id: uuid.UUID, key: str, offset: int, clock: _Clock,
                         raw: bool) -> AsyncIterator[list]:
    """aread_stream by URL: through this process's listener for the URL."""
    loop, signal = asyncio.get_running_loop(), asyncio.Event()

    def wake() -> None:  # from the listener's thread
        try:
            loop.call_soon_threadsafe(signal.set)
        except RuntimeError:
            pass  # the loop has closed: nobody is waiting

    hub, reader = stream_readers.open_reader(url, run_id, key, offset, wake)
    try:
        while True:
            signal.clear()  # before taking: a wake after it is not lost
            rows, ended, error = hub.take(reader)
            if reader.missing:
                raise EverystepError(f"{what}: no run {run_id}")
            if rows:
                yield [(cell.row[0], cell.row[1]) for cell in rows] if raw else _entries_of(rows)
            if ended:
                return
            if error is not None:
                raise error
            if rows:
                clock.reset()
                continue
            seconds = clock.wait(run_id, key)
            try:
                async with asyncio.timeout(seconds):  # no task per wait, as wait_for makes
                    await signal.wait()
            except TimeoutError:
                pass  # the clock says at the next turn whether the reader's timeout has passed
    finally:
        hub.close(reader)
