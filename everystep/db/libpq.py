"""The hot path: statements run straight through libpq's PQexecPrepared.

The statements of every step and every end of a run (record_steps,
end_runs) and the claim go to libpq directly, which releases the GIL for
the whole round trip: psycopg's execute costs ~45 us of Python per
statement here (a cursor, parameter adaptation, generators), about a
tenth of all the CPU a step takes, and on a small machine the workers' CPU
is taken from the database. The parameters are text or NULL (arrays as
array literals); rows are read from their text. A notification that comes
in during one of these statements waits in libpq's queue
(session.notifications reads it).
"""

from __future__ import annotations

import json
import uuid
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import psycopg
from psycopg import errors, pq

from everystep import waits
from everystep.db import queries
from everystep.db.rows import ClaimedRun
from everystep.db.session import Executor, TransactionPooledConnection


class Hot(NamedTuple):
    name: bytes  # of the prepared statement, on each connection that runs it
    sql: bytes  # with $1, $2, ... in the order of `params`
    params: tuple[str, ...]
    query: str  # with %(param)s, for connections that cannot keep a prepared statement


def hot(name: str) -> Hot:
    """The named statement (everystep/db/sql/) for the hot path."""
    numbered = queries.numbered(name)
    return Hot(f"everystep_{name}".encode(), numbered.text.encode(), numbered.params, queries.get(name))


# The hot statements prepared on each connection (gone with the connection).
_prepared: weakref.WeakKeyDictionary[psycopg.Connection, set[bytes]] = weakref.WeakKeyDictionary()


def run(on: Executor, statement: Hot, values: dict[str, Any]) -> pq.abc.PGresult:
    """Execute a hot statement, preparing it on first use on this connection."""
    conn = on.connection if isinstance(on, psycopg.Cursor) else on
    # Through a transaction pooler, and on a connection that would begin a
    # transaction first (not autocommit, none open): psycopg, which does.
    if isinstance(conn, TransactionPooledConnection) or (
            not conn.autocommit and conn.info.transaction_status == pq.TransactionStatus.IDLE):
        cursor = conn.cursor()
        cursor.execute(statement.query, {param: None if (value := values[param]) is None else str(value)
                                         for param in statement.params})
        return cursor.pgresult
    pgconn = conn.pgconn
    prepared = _prepared.setdefault(conn, set())
    params = [None if (value := values[param]) is None else str(value).encode() for param in statement.params]
    if statement.name not in prepared:
        check(conn, pgconn.prepare(statement.name, statement.sql))
        prepared.add(statement.name)
    result = pgconn.exec_prepared(statement.name, params)
    if result.error_field(pq.DiagnosticField.SQLSTATE) == b"26000":
        # Deallocated: psycopg drops every prepared statement of a connection
        # after a ROLLBACK or a DISCARD ALL on it. Prepare it again.
        prepared.clear()
        return run(on, statement, values)
    return check(conn, result)


def run_before_commit(on: Executor, statement: Hot,
                      values: dict[str, Any]) -> tuple[pq.abc.PGresult, Callable[[], None]]:
    """Execute a hot statement in a transaction of its own and return its rows
    as soon as it ran, before its commit: the server flushes them at a Flush
    message sent after it, then commits at the Sync that follows (pipeline
    mode). `confirm()` waits for the commit and raises what it raised; it
    must be called before anything else runs on the connection. Where no
    pipeline can be used (a transaction pooler, a transaction open, a libpq
    before 14): `run`, and a confirm that returns at once."""
    conn = on.connection if isinstance(on, psycopg.Cursor) else on
    if isinstance(conn, TransactionPooledConnection) or not conn.autocommit or pq.version() < 140000:
        return run(on, statement, values), committed
    pgconn = conn.pgconn
    prepared = _prepared.setdefault(conn, set())
    if statement.name not in prepared:
        check(conn, pgconn.prepare(statement.name, statement.sql))
        prepared.add(statement.name)
    params = [None if (value := values[param]) is None else str(value).encode() for param in statement.params]
    pgconn.enter_pipeline_mode()
    try:
        pgconn.send_query_prepared(statement.name, params)
        pgconn.send_flush_request()
        pgconn.pipeline_sync()
        while pgconn.flush():
            waits.writable(pgconn.socket)
        result = _next_result(pgconn)
    except BaseException:
        conn.close()  # where the pipeline stands is not known: no statement may follow on it
        raise
    if result.status != pq.ExecStatus.TUPLES_OK:
        _to_sync(conn)  # an error: the rest of the pipeline is skipped, up to its sync
        if result.error_field(pq.DiagnosticField.SQLSTATE) == b"26000":  # deallocated (see run)
            prepared.clear()
            return run_before_commit(on, statement, values)
        return check(conn, result), committed

    def confirm() -> None:
        error = _to_sync(conn)
        if error is not None:
            check(conn, error)

    return result, confirm


def committed() -> None:
    """The confirm of a statement whose commit returned with its rows."""


def _next_result(pgconn: pq.abc.PGconn) -> pq.abc.PGresult | None:
    """The next result of a pipeline, waiting for the server (the GIL is
    released meanwhile); None: the end of one statement's results."""
    while True:
        pgconn.consume_input()
        if not pgconn.is_busy():
            return pgconn.get_result()
        waits.readable([pgconn.socket])


def _to_sync(conn: psycopg.Connection) -> pq.abc.PGresult | None:
    """Read a pipeline's results up to its sync (the commit of its implicit
    transaction) and leave pipeline mode; the first error among them, if any."""
    pgconn, error = conn.pgconn, None
    try:
        while (result := _next_result(pgconn)) is None or result.status != pq.ExecStatus.PIPELINE_SYNC:
            if result is not None and result.status == pq.ExecStatus.FATAL_ERROR and error is None:
                error = result
        pgconn.exit_pipeline_mode()
    except BaseException:
        conn.close()
        raise
    return error


def check(conn: psycopg.Connection, result: pq.abc.PGresult) -> pq.abc.PGresult:
    """The result, or the error it reports raised as psycopg would."""
    if result.status in (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK):
        return result
    # The connection is lost (the server crashed or restarted under it): the
    # write is retried on another. libpq reports that without an SQLSTATE,
    # sometimes before it marks the connection bad.
    if conn.pgconn.status == pq.ConnStatus.BAD or result.error_field(pq.DiagnosticField.SQLSTATE) is None:
        raise errors.OperationalError(conn.pgconn.get_error_message(conn.info.encoding))
    raise errors.error_from_result(result, encoding=conn.info.encoding)


# The steps of a claimed run that has none, as everystep_claim returns them (to_json of an empty array).
NO_STEPS = b"[]"


def claimed_runs(on: Executor, result: pq.abc.PGresult, first_column: int) -> list[ClaimedRun]:
    """The runs in a result whose columns from `first_column` on are those of
    a claimed run (ClaimedRun's; a NULL id: no run), read from their text."""
    encoding = (on.connection if isinstance(on, psycopg.Cursor) else on).info.encoding
    value = result.get_value
    runs = []
    for row in range(result.ntuples):
        run_id = value(row, first_column)
        if run_id is None:
            continue  # no run (end_runs: one of the rows about the ends, two in three of a busy batch)
        name, args, steps, token, cancel, now, slot, parent = (value(row, first_column + i) for i in range(1, 9))
        # A first claim has no steps (most claims, in a busy queue): nothing to decode.
        recorded = [] if steps == NO_STEPS else json.loads(steps.decode(encoding))
        runs.append(ClaimedRun(uuid.UUID(run_id.decode()), name.decode(encoding), json.loads(args.decode(encoding)),
                               recorded, int(token), cancel == b"t", float(now),
                               None if slot is None else int(slot),
                               None if parent is None else uuid.UUID(parent.decode())))
    return runs


def array_literal(items: list | None) -> str | None:
    """An array literal of `items` (a None item: NULL; None: no array) for the
    hot statements' text parameters."""
    if items is None:
        return None
    parts = []
    for item in items:
        if item is None:
            parts.append("NULL")
            continue
        text = str(item)
        if "\\" in text or '"' in text:  # (ids, numbers and names have neither: no replace to run)
            text = text.replace("\\", "\\\\").replace('"', '\\"')
        parts.append('"' + text + '"')
    return "{" + ",".join(parts) + "}"
