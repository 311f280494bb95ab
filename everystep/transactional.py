"""What a @step(transactional=True) reaches while it runs: the connection of
its transaction (`step_connection()`), or a SQLAlchemy session on it
(`step_session()`). The engine (everystep.execution) opens the transaction,
runs the step in it, records the step's outcome in it and commits; this
module lends the step its connection meanwhile. Knows nothing about the
database beyond psycopg and SQLAlchemy themselves.

A SQLAlchemy session is joined to the step's transaction through a
savepoint: its `commit()` keeps its work in the step's transaction, its
`rollback()` undoes its work since; what it holds when the step returns is
flushed and kept, and when the step raises, everything is rolled back with
the step's transaction. Neither the step nor its session may end the step's
transaction itself (psycopg refuses a commit() in it).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from contextvars import ContextVar
from typing import Any

from everystep.connections import bound_connection
from everystep.errors import EverystepError


class LentTransaction:
    """The step's transaction as lent to the step: its connection, and the
    SQLAlchemy sessions the step opened on it (each with its connection)."""

    def __init__(self, conn: Any, conninfo: str, kwargs: dict):
        self.conn = conn
        self.conninfo = conninfo  # to open the SQLAlchemy engine's first connection elsewhere
        self.kwargs = kwargs
        self.sessions: list[tuple[Any, Any]] = []

    def call(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        """Run the step's function; keep its sessions' work when it returns,
        undo it when it raises."""
        try:
            value = fn(*args, **kwargs)
            for session, _ in self.sessions:
                session.commit()
            return value
        finally:
            for session, _ in self.sessions:
                session.close()

    async def acall(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        try:
            value = await fn(*args, **kwargs)
            for session, _ in self.sessions:
                await session.commit()
            return value
        finally:
            for session, _ in self.sessions:
                await session.close()


_lent: ContextVar[LentTransaction | None] = ContextVar("everystep_step_transaction", default=None)
# The step connection an engine of step sessions hands out next (see _engine).
_handing: ContextVar[Any] = ContextVar("everystep_step_session_connection", default=None)


@contextlib.contextmanager
def _lending(conn: Any, conninfo: str, kwargs: dict) -> Iterator[LentTransaction]:
    lending = LentTransaction(conn, conninfo, kwargs)
    token = _lent.set(lending)
    try:
        yield lending
    finally:
        _lent.reset(token)
        _forget_sqlalchemy(lending)


@contextlib.contextmanager
def lent(conn: Any, conninfo: str, kwargs: dict) -> Iterator[LentTransaction]:
    """Lend the step `conn` (a psycopg Connection, in the step's
    transaction) while it runs; its SQLAlchemy connections are closed after
    the transaction ended (their own rollback is then a no-op)."""
    with _lending(conn, conninfo, kwargs) as lending:
        try:
            yield lending
        finally:
            for _, sa_conn in lending.sessions:
                sa_conn.close()


@contextlib.asynccontextmanager
async def alent(aconn: Any, conninfo: str, kwargs: dict) -> AsyncIterator[LentTransaction]:
    """`lent` for an AsyncConnection (an `async def` step)."""
    with _lending(aconn, conninfo, kwargs) as lending:
        try:
            yield lending
        finally:
            for _, sa_conn in lending.sessions:
                await sa_conn.close()


def _forget_sqlalchemy(lending: LentTransaction) -> None:
    """SQLAlchemy adds a notice handler to each connection it is handed: the
    pooled connection goes back without them, or they would pile up."""
    if not lending.sessions:
        return
    from sqlalchemy.dialects.postgresql import psycopg as sqlalchemy_psycopg  # noqa: PLC0415

    handler = getattr(sqlalchemy_psycopg, "_log_notices", None)
    for _ in lending.sessions:
        with contextlib.suppress(ValueError):
            lending.conn.remove_notice_handler(handler)


def step_connection() -> Any:
    """In a @step(transactional=True) running in a workflow: the connection
    of the step's transaction (a psycopg Connection; an AsyncConnection in an
    `async def` step), in which the step's outcome is recorded too, so the
    step's writes made through it and its recorded result commit together
    or not at all. The step must neither commit nor roll it back. Outside a
    run (the step called as a plain function), the connection bound with
    `everystep.use(conn)`; with none, EverystepError."""
    lending = _lent.get()
    if lending is not None:
        return lending.conn
    conn = bound_connection()
    if conn is None:
        raise EverystepError("step_connection() is for the body of a @step(transactional=True): in a run it is "
                             "the step's transaction; outside one, bind a connection with `everystep.use(conn)`")
    return conn


def step_session(**options: Any) -> Any:
    """In a sync @step(transactional=True): a SQLAlchemy Session on the
    step's transaction. What it holds when the step returns is flushed and
    committed with the step's outcome; its `commit()` before that keeps its
    work so far (a savepoint), its `rollback()` undoes it. `options` go to
    the Session (e.g. `expire_on_commit=False`). Needs SQLAlchemy 2 on the
    psycopg 3 driver; the engine closes it after the step."""
    lending = _lent_to("step_session()", asynchronous=False)
    engine = _engine(lending.conninfo, tuple(sorted(lending.kwargs.items())), False)
    if engine not in _checked:
        with engine.connect():  # the first connection: SQLAlchemy's checks, on one of its own
            _checked.add(engine)
    token = _handing.set(lending.conn)
    try:
        sa_conn = engine.connect()  # the engine's pool hands out the step's connection
    finally:
        _handing.reset(token)
    from sqlalchemy.orm import Session  # noqa: PLC0415  (the sqlalchemy extra)

    sa_conn.begin()  # the step's transaction, as SQLAlchemy sees it: never ended by it
    session = Session(bind=sa_conn, join_transaction_mode="create_savepoint", **options)
    lending.sessions.append((session, sa_conn))
    return session


async def astep_session(**options: Any) -> Any:
    """`step_session()` for an `async def` step: a SQLAlchemy AsyncSession
    on the step's AsyncConnection (`session = await everystep.astep_session()`)."""
    lending = _lent_to("astep_session()", asynchronous=True)
    engine = _engine(lending.conninfo, tuple(sorted(lending.kwargs.items())), True)
    if engine not in _checked:
        async with engine.connect():
            _checked.add(engine)
    token = _handing.set(lending.conn)
    try:
        sa_conn = await engine.connect()
    finally:
        _handing.reset(token)
    from sqlalchemy.ext.asyncio import AsyncSession  # noqa: PLC0415  (the sqlalchemy extra)

    await sa_conn.begin()
    session = AsyncSession(bind=sa_conn, join_transaction_mode="create_savepoint", **options)
    lending.sessions.append((session, sa_conn))
    return session


def _lent_to(caller: str, asynchronous: bool) -> LentTransaction:
    """The transaction lent to the step calling `caller`, of the kind it needs."""
    lending = _lent.get()
    if lending is None:
        raise EverystepError(f"{caller} is for the body of a @step(transactional=True) running in a workflow")
    import psycopg  # noqa: PLC0415

    if isinstance(lending.conn, psycopg.AsyncConnection) != asynchronous:
        other = "astep_session()" if not asynchronous else "step_session()"
        raise EverystepError(f"{caller} is for {'an async def' if asynchronous else 'a sync'} step; "
                             f"this one takes {other}")
    return lending


@functools.cache
def _engine(conninfo: str, kwargs: tuple, asynchronous: bool) -> Any:
    """A SQLAlchemy engine whose pool hands out the connection of the step
    that asks (`_handing`), once per database. Its first connection, on
    which SQLAlchemy checks the server (and rolls back), is one of its own
    (made once: `_checked`), closed when given back."""
    import psycopg  # noqa: PLC0415
    from sqlalchemy import create_engine  # noqa: PLC0415  (the sqlalchemy extra)
    from sqlalchemy.ext.asyncio import create_async_engine  # noqa: PLC0415
    from sqlalchemy.pool import NullPool  # noqa: PLC0415

    class StepPool(NullPool):
        """Hands out the step's connection; giving it back leaves it open."""

        def _do_return_conn(self, record: Any) -> None:
            if record.dbapi_connection in own:
                record.close()

    own: weakref.WeakSet = weakref.WeakSet()  # the engine's own connections, not a step's

    if asynchronous:
        async def acreator() -> Any:
            conn = _handing.get()
            if conn is None:
                conn = await psycopg.AsyncConnection.connect(conninfo, **dict(kwargs))
                own.add(conn)
            return conn
        engine = create_async_engine("postgresql+psycopg://", async_creator=acreator, poolclass=StepPool,
                                     pool_reset_on_return=None)
    else:
        def creator() -> Any:
            conn = _handing.get()
            if conn is None:
                conn = psycopg.connect(conninfo, **dict(kwargs))
                own.add(conn)
            return conn
        engine = create_engine("postgresql+psycopg://", creator=creator, poolclass=StepPool,
                               pool_reset_on_return=None)
    return engine


_checked: set = set()  # the engines whose first connection was made
