"""Durable streams: the group-committed writes of entries, what an
execution loads before it writes, and the readers' looks and LISTEN.
Statements: sql/streams.sql."""

from __future__ import annotations

import uuid

import psycopg

from everystep.db import queries, session
from everystep.db.rows import StreamLook, StreamState, StreamWrite
from everystep.db.session import Executor


def write_streams(conn: psycopg.Connection, runner: str, writes: list[StreamWrite]) -> set[uuid.UUID]:
    """Write the entries of `runner`'s executions in one statement (and
    notify their readers at its commit): the runs whose writing execution
    still holds them (the others' entries are not written)."""
    rows = [(w.run, w.token, e) for w in writes for e in w.entries]
    held = conn.execute(queries.get("write_streams"), {
        "runs": [r for r, _, _ in rows], "tokens": [t for _, t, _ in rows], "runner": runner,
        "keys": [e.key for _, _, e in rows], "offsets": [e.offset for _, _, e in rows],
        "values": [e.value for _, _, e in rows], "step_ids": [e.step_id for _, _, e in rows],
        "attempts": [e.attempt for _, _, e in rows]}).fetchall()
    return {row[0] for row in held}


def stream_state(conn: Executor, run: uuid.UUID) -> StreamState:
    next_offsets, closed, body = {}, set(), {}
    for key, next_offset, is_closed, step_ids, offsets in conn.execute(queries.get("stream_state"), {"run": run}):
        next_offsets[key] = next_offset
        if is_closed:
            closed.add(key)
        body.update(zip(step_ids, offsets))
    return StreamState(next_offsets, closed, body)


def read_stream(conn: psycopg.Connection, run: uuid.UUID, key: str, offset: int, limit: int) -> StreamLook:
    rows = conn.execute(queries.get("read_stream"),
                        {"run": run, "key": key, "offset": offset, "limit": limit}).fetchall()
    if not rows:
        return StreamLook(None, [])
    return StreamLook(rows[0][0], [row[1:] for row in rows if row[1] is not None])


async def aread_stream(aconn: psycopg.AsyncConnection, run: uuid.UUID, key: str, offset: int,
                       limit: int) -> StreamLook:
    cur = await aconn.execute(queries.get("read_stream"), {"run": run, "key": key, "offset": offset, "limit": limit})
    rows = await cur.fetchall()
    if not rows:
        return StreamLook(None, [])
    return StreamLook(rows[0][0], [row[1:] for row in rows if row[1] is not None])


def run_streams(conn: Executor, run: uuid.UUID) -> list[tuple[str, int, bool]]:
    """(key, entries, closed by a close) of each stream of the run."""
    return [tuple(row) for row in conn.execute(queries.get("run_streams"), {"run": run})]


def notify_streams(conn: Executor, run: uuid.UUID) -> None:
    conn.execute(queries.get("notify_streams"), {"run": str(run)})


def listen_streams(conn: psycopg.Connection) -> None:
    """LISTEN for stream entries (an autocommit connection: at once)."""
    channel = conn.execute(queries.get("stream_channel"), {}).fetchone()[0]
    conn.execute(session.listen_statement(channel))


async def alisten_streams(aconn: psycopg.AsyncConnection) -> None:
    channel = (await (await aconn.execute(queries.get("stream_channel"), {})).fetchone())[0]
    await aconn.execute(session.listen_statement(channel))
