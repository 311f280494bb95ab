"""One listener per process and database for the readers of durable streams.

However many readers a process has (threads with `read_stream`, tasks with
`aread_stream`, the UI server's Server-Sent Events), those that read by
database URL share one connection, LISTENing, and one thread that owns it.
A commit's notification carries the entries it committed (or, where they
do not fit one, names the stream and its last offset): the thread hands
them to the readers that want them next, with no statement, and looks
only at the streams that have a reader behind (once per wake for all of
its readers, from the lowest offset they need), handing each reader its
part. An entry is decoded once for all the readers of the process when
its value cannot be changed (a string, a number: the tokens of a model);
else each reader decodes its own, so that no two readers share a mutable
value (everystep.streams does it, in the readers' threads, see Cell).

A reader's backlog is bounded: the thread looks for a reader only while it
holds less than one look's worth of entries; a reader that takes a full
look's entries asks for the next look itself.

The thread ends, and closes its connection, once it has had no reader for
IDLE seconds; the next reader starts another.
"""

from __future__ import annotations

import bisect
import json
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import NamedTuple

import psycopg

from everystep import db, waits
from everystep.errors import EverystepError
from everystep.schema import TERMINAL

# Entries a look takes at most.
READ_BATCH = 1000
# Without a notification a stream with readers is looked at again this often
# (seconds): a run ended by something else than its execution (a cancel while
# it waited, a dead worker's poison run) closes its streams without notifying.
LOOK_AGAIN = 2.0
# Seconds without a reader after which the thread ends and closes its connection.
IDLE = 5.0

Row = tuple  # (offset, value JSON text, closes, step_id, attempt, claim_token), as db.read_stream gives them


class Cell:
    """One entry of a look, as all the readers of the process get it: its
    row, and the entry the first reader made of it when the others may have
    the same (see everystep.streams._entries_of)."""

    __slots__ = ("row", "entry")

    def __init__(self, row: Row):
        self.row = row
        self.entry = None  # the decoded entry, when its value is immutable


class Notice(NamedTuple):
    """A stream notification (see db/sql/streams.sql): the run, and the
    stream and its last offset written, or None for both when the run's end
    closed all its streams; `entries`: the entries themselves as JSON, when
    the notification carries them (`rows()` reads them)."""

    run: str
    last: int | None
    key: str | None
    first: int | None = None
    entries: str | None = None

    def rows(self) -> list[Row]:
        """The entries it carries, as rows of a look."""
        return [(offset, value, value is None, step_id, attempt, token)
                for offset, value, step_id, attempt, token in json.loads(self.entries)]


def parse_notification(payload: str) -> Notice:
    run, _, rest = payload.partition(" ")
    try:
        if rest.startswith("@"):  # '@<first> <last> <key length> <key><entries>'
            first, last, length, rest = rest[1:].split(" ", 3)
            length = int(length)
            return Notice(run, int(last), rest[:length], int(first), rest[length:])
        last, _, key = rest.partition(" ")  # '<last> <key>'
        return Notice(run, int(last), key)
    except ValueError:  # the run alone (or a payload of another form: look anyway)
        return Notice(run, None, None)


class Reader:
    """One reader's place in a stream: what was looked up for it and not taken yet."""

    def __init__(self, tail: _Tail, offset: int, wake: Callable[[], None]):
        self.tail = tail
        self.want = offset  # the next offset to look up for it
        self.rows: list[Cell] = []
        self.looked = False  # its first look is done (an unknown run is found out there)
        self.missing = False  # the run is not there (error says so)
        self.ended = False  # the stream ends after its rows
        self.more = False  # its last look was full: there may be more already
        self.error: BaseException | None = None
        self.wake = wake


class _Tail:
    """The readers of one stream."""

    def __init__(self, run: uuid.UUID, key: str):
        self.run = run
        self.key = key
        self.readers: list[Reader] = []
        self.pending = True  # look at it at the next turn
        self.looked_at = 0.0


class Hub:
    """The readers of one database URL in this process, and the thread that looks for them."""

    def __init__(self, url: str):
        self.url = url
        self._lock = threading.Lock()
        self._tails: dict[tuple[str, str], _Tail] = {}
        self._by_run: dict[str, list[_Tail]] = {}
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self.dead = False  # the thread has ended (idle, or its connection failed): a new reader starts another hub
        self.backend_pid: int | None = None  # its connection's server process, once connected
        self.error: BaseException | None = None  # what ended the thread, if not idleness
        self._idle_since = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="everystep-stream-readers", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ the readers' side

    def open(self, run: uuid.UUID, key: str, offset: int, wake: Callable[[], None]) -> Reader | None:
        """A reader of the stream from `offset` on (None: this hub has ended
        idle, use another; one that failed gives its error to the reader)."""
        with self._lock:
            if self.dead:
                if self.error is None:
                    return None
                reader = Reader(_Tail(run, key), offset, wake)
                reader.looked, reader.error = True, self.error
                return reader
            tail = self._tails.get((str(run), key))
            if tail is None:
                tail = self._tails[(str(run), key)] = _Tail(run, key)
                self._by_run.setdefault(str(run), []).append(tail)
            reader = Reader(tail, offset, wake)
            tail.readers.append(reader)
            tail.pending = True
        self._poke()
        return reader

    def take(self, reader: Reader) -> tuple[list[Cell], bool, BaseException | None]:
        """What was looked up for the reader since it last took, whether the
        stream ends after it, and the error that ended the reading."""
        with self._lock:
            rows, reader.rows = reader.rows, []
            ask = reader.more and not reader.ended and reader.error is None
            if ask:
                reader.more = False
                reader.tail.pending = True
        if ask:
            self._poke()
        return rows, reader.ended, reader.error

    def close(self, reader: Reader) -> None:
        with self._lock:
            tail = reader.tail
            if reader in tail.readers:
                tail.readers.remove(reader)
            if not tail.readers and self._tails.get((str(tail.run), tail.key)) is tail:
                del self._tails[(str(tail.run), tail.key)]
                others = self._by_run[str(tail.run)]
                others.remove(tail)
                if not others:
                    del self._by_run[str(tail.run)]
                if not self._tails:
                    self._idle_since = time.monotonic()

    def _poke(self) -> None:
        with self._lock:  # the thread closes the pipe under the lock: its number is never another file's here
            if not self.dead:
                try:
                    os.write(self._wake_w, b".")
                except BlockingIOError:
                    pass  # full of pokes the thread has not read yet: it will wake

    # ------------------------------------------------------------ the thread's side

    def _run(self) -> None:
        conn = None
        try:
            conn = psycopg.connect(self.url, autocommit=True)
            self.backend_pid = conn.info.backend_pid
            db.listen_streams(conn)  # before any look: no commit after it goes unnoticed
            while self._turn(conn):
                pass
        except Exception as exc:
            self._fail(exc)
        finally:
            if conn is not None:
                conn.close()
            with self._lock:
                self.dead = True
                os.close(self._wake_r)
                os.close(self._wake_w)

    def _turn(self, conn: psycopg.Connection) -> bool:
        """Look at the streams that need it, then wait for a notification or a
        reader; False when the hub is to end."""
        for tail in self._due():
            self._look(conn, tail)
        notifies = list(conn.notifies(timeout=0))  # those come during the looks, or waiting in the socket
        if not notifies:
            with self._lock:
                if any(tail.pending for tail in self._tails.values()):
                    return True
                if not self._tails and time.monotonic() - self._idle_since >= IDLE:
                    self.dead = True
                    return False
                wait = IDLE if not self._tails else max(
                    0.0, min(t.looked_at for t in self._tails.values()) + LOOK_AGAIN - time.monotonic())
            if self._wake_r in waits.readable([conn.fileno(), self._wake_r], wait):
                os.read(self._wake_r, 4096)
            notifies = list(conn.notifies(timeout=0))
        handed: dict[int, Reader] = {}  # woken once all the notifications are handed (a commit sends several)
        with self._lock:
            for notify in notifies:
                notice = parse_notification(notify.payload)
                for tail in self._by_run.get(notice.run, ()):
                    if notice.last is None:
                        tail.pending = True
                    elif tail.key == notice.key:
                        if notice.entries is not None:
                            self._hand(tail, notice, handed)
                        if any(r.want <= notice.last and not r.ended and r.error is None for r in tail.readers):
                            tail.pending = True  # behind the entries it carries, or carried none: a look
            for reader in handed.values():
                reader.wake()
        return True

    def _hand(self, tail: _Tail, notice: Notice, handed: dict[int, Reader]) -> None:
        """(With the lock held.) The entries a notification carries, to each
        reader of the stream that wants the next of them and has room: no
        look for it. A reader behind them, or not looked at yet, looks."""
        cells = None
        for reader in tail.readers:
            if (reader.error is not None or reader.ended or not reader.looked
                    or not notice.first <= reader.want <= notice.last or len(reader.rows) >= READ_BATCH):
                continue
            if cells is None:
                cells = [Cell(row) for row in notice.rows()]
            _give(reader, cells, reader.want - notice.first)
            handed[id(reader)] = reader

    def _due(self) -> list[_Tail]:
        with self._lock:
            now = time.monotonic()
            due = [t for t in self._tails.values() if t.pending or now - t.looked_at >= LOOK_AGAIN]
            for tail in due:
                tail.pending = False
            return due

    def _look(self, conn: psycopg.Connection, tail: _Tail) -> None:
        """One look at a stream for all its readers that have room."""
        with self._lock:
            readers = []
            for reader in tail.readers:
                if reader.error is None and not reader.ended:
                    if len(reader.rows) < READ_BATCH:
                        readers.append(reader)
                    else:  # no room: it asks for a look once it has taken what it holds
                        reader.more = True
            tail.looked_at = time.monotonic()
        if not readers:
            return
        low = min(r.want for r in readers)
        look = db.read_stream(conn, tail.run, tail.key, low, READ_BATCH)
        full = len(look.entries) == READ_BATCH
        offsets = [row[0] for row in look.entries]
        cells = [Cell(row) for row in look.entries]
        with self._lock:
            tail.looked_at = time.monotonic()
            for reader in readers:
                if reader not in tail.readers:
                    continue  # gone meanwhile
                first, reader.looked = not reader.looked, True
                if look.status is None:
                    reader.missing = True
                    reader.error = EverystepError(f"no run {tail.run}")
                    reader.wake()
                    continue
                got = _give(reader, cells, bisect.bisect_left(offsets, reader.want))
                if not reader.ended:
                    reader.more = full
                    reader.ended = not full and look.status in TERMINAL
                if got or reader.ended or first:
                    reader.wake()
            if full:
                tail.pending = True  # the readers that still have room get the next look at once

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            self.dead, self.error = True, exc
            readers = [r for tail in self._tails.values() for r in tail.readers]
            for reader in readers:
                reader.error = exc
        for reader in readers:
            reader.wake()


def _give(reader: Reader, cells: list[Cell], start: int) -> bool:
    """(With the hub's lock held.) The cells from `start` on to the reader,
    up to the stream's close (its last entry); whether it got any."""
    given = cells[start:]
    if given and given[-1].row[2]:  # the close
        reader.ended = True
        given = given[:-1]
    if given:
        reader.rows += given
        reader.want = given[-1].row[0] + 1
    return bool(given)


_hubs: dict[str, Hub] = {}
_hubs_lock = threading.Lock()


def open_reader(url: str, run: uuid.UUID, key: str, offset: int, wake: Callable[[], None]) -> tuple[Hub, Reader]:
    """A reader of the stream in this process's hub for `url` (started if need be)."""
    while True:
        with _hubs_lock:
            hub = _hubs.get(url)
            if hub is None or hub.dead:
                hub = _hubs[url] = Hub(url)
        reader = hub.open(run, key, offset, wake)
        if reader is not None:
            return hub, reader


def _forget_hubs() -> None:
    """In a forked child: the parent's threads are not there."""
    global _hubs_lock
    _hubs.clear()
    _hubs_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_hubs)
