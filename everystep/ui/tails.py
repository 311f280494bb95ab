"""One reader per stream and server, fanned out to every open response.

However many clients follow a run's stream over Server-Sent Events, the
server reads it once: a task per (run, key) with clients reads it from
offset 0 with `aread_stream_looks` (through the process's one LISTEN
connection, one statement per commit of the stream), keeps every entry as
its formatted event, and wakes the clients,
each of which sends the events from its own offset on. The task ends when
the stream does, or when its last client has gone.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

from everystep import streams


class _Tail:
    def __init__(self, tails: Tails, run: uuid.UUID, key: str):
        self.events: list[str] = []  # the event of each entry, by offset
        self.ended = False
        self.error: BaseException | None = None
        self.clients = 0
        self.changed = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self._read(tails, run, key))

    async def _read(self, tails: Tails, run: uuid.UUID, key: str) -> None:
        try:
            async for entries in streams.aread_stream_looks(run, key, offset=0, conn=tails.database_url):
                self.events.extend(f"id: {offset}\ndata: {value}\n\n" for offset, value in entries)
                self._wake()
            self.ended = True
        except Exception as exc:  # the clients end with it; the next one starts another reader
            self.error = exc
        finally:
            tails.forget(run, key, self)
            self._wake()

    def _wake(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


class Tails:
    """The stream readers of one server."""

    def __init__(self, database_url: str, heartbeat: float):
        self.database_url = database_url
        self.heartbeat = heartbeat
        self._tails: dict[tuple[uuid.UUID, str], _Tail] = {}

    def forget(self, run: uuid.UUID, key: str, tail: _Tail) -> None:
        if self._tails.get((run, key)) is tail:
            del self._tails[(run, key)]

    async def events(self, run: uuid.UUID, key: str, offset: int) -> AsyncIterator[str]:
        """The events of the stream from `offset` on, a heartbeat comment
        while nothing comes, and `event: end` once it is closed."""
        tail = self._tails.get((run, key))
        if tail is None or tail.task.done():
            tail = self._tails[(run, key)] = _Tail(self, run, key)
        tail.clients += 1
        try:
            while True:
                changed = tail.changed
                if len(tail.events) > offset:
                    chunk, offset = "".join(tail.events[offset:]), len(tail.events)
                    yield chunk
                    continue
                if tail.error is not None:
                    return
                if tail.ended:
                    yield "event: end\ndata: {}\n\n"
                    return
                try:
                    async with asyncio.timeout(self.heartbeat):  # no task per wait, as wait_for makes
                        await changed.wait()
                except TimeoutError:
                    yield ": heartbeat\n\n"
        finally:
            tail.clients -= 1
            if tail.clients == 0 and not tail.task.done():
                tail.task.cancel()
