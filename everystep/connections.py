"""The connection a call from outside a run works in: `conn=`, else the one
bound in the context (everystep.transaction / use, atransaction), else
Django's when Django is configured. A SQLAlchemy 2 Session or Connection
(the psycopg driver) stands for the psycopg connection under it, and an
AsyncSession or AsyncConnection for the psycopg AsyncConnection under it:
what everystep writes there is in the caller's SQLAlchemy transaction, and
commits or rolls back with it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from contextvars import ContextVar
from typing import Any

import psycopg

from everystep.context import current_scope
from everystep.errors import EverystepError

_bound: ContextVar[Any] = ContextVar("everystep_connection", default=None)


@contextlib.contextmanager
def use(conn: Any) -> Iterator[Any]:
    """Bind `conn` as the connection `schedule()` (or `aschedule()`) writes
    into, in this context."""
    token = _bound.set(conn)
    try:
        yield conn
    finally:
        _bound.reset(token)


@contextlib.contextmanager
def transaction(conn: psycopg.Connection) -> Iterator[psycopg.Connection]:
    """Open a transaction on `conn` and bind it for `schedule()`: the runs are
    scheduled when the block commits, and vanish if it rolls back."""
    with conn.transaction(), use(conn):
        yield conn


@contextlib.asynccontextmanager
async def atransaction(aconn: psycopg.AsyncConnection) -> AsyncIterator[psycopg.AsyncConnection]:
    """`transaction` for an AsyncConnection and `aschedule()`:
    `async with everystep.atransaction(aconn): await everystep.aschedule(...)`."""
    async with aconn.transaction():
        with use(aconn):
            yield aconn


def _refuse_in_body(caller: str) -> None:
    """A run scheduled from a workflow body would be scheduled again by
    every replay: the body starts a child instead."""
    if current_scope.get() is not None and caller.removeprefix("a").startswith("schedule"):
        start = "await everystep.start" if caller.startswith("a") else "everystep.start"
        raise EverystepError(
            f"{caller} in a workflow body: start a child run with `{start}(workflow, *args)` instead (recorded "
            f"once, not scheduled again by a replay); {caller} is for code outside workflows, in its own transaction")


def bound_connection() -> Any:
    """The connection bound in this context, if any."""
    return _bound.get()


def transaction_connection(conn: Any, caller: str, write: bool = True) -> Any:
    """The connection `caller` works in: `conn`, else the one bound by
    everystep.transaction/use, else Django's. One that writes needs an open
    transaction, so what it writes commits or rolls back with the caller's work."""
    conn = conn or _bound.get() or _django_connection()
    if conn is None:
        _refuse_in_body(caller)
        raise EverystepError(
            f"{caller} found no transaction: pass conn=<psycopg connection or SQLAlchemy session>, bind one with "
            "`with everystep.transaction(conn):` or `everystep.use(conn)`, or configure Django"
        )
    conn = _under_sqlalchemy(conn, caller)
    if isinstance(conn, psycopg.AsyncConnection):
        raise EverystepError(f"{caller} takes a sync connection; with an AsyncConnection (or an AsyncSession) "
                             "await the asyncio form of the call (aschedule(), asend(), acancel(), ...)")
    if write and isinstance(conn, psycopg.Connection):
        _check_open(conn, caller)
    return conn


async def async_connection(conn: Any, caller: str, write: bool = True) -> psycopg.AsyncConnection:
    """`transaction_connection` for the asyncio API: a psycopg
    AsyncConnection (given, bound, or under a SQLAlchemy AsyncSession or
    AsyncConnection)."""
    conn = conn or _bound.get()
    if conn is None:
        _refuse_in_body(caller)
        raise EverystepError(
            f"{caller} found no transaction: pass conn=<psycopg AsyncConnection or SQLAlchemy AsyncSession>, or "
            "bind one with `async with everystep.atransaction(aconn):` or `everystep.use(aconn)`"
        )
    if type(conn).__module__.startswith("sqlalchemy."):
        conn = await _under_sqlalchemy_async(conn, caller)
    if not isinstance(conn, psycopg.AsyncConnection):
        raise EverystepError(f"{caller} takes a psycopg AsyncConnection or a SQLAlchemy AsyncSession, not "
                             f"{type(conn).__name__}; a sync connection is for {_sync_form(caller)}")
    if write:
        _check_open(conn, caller)
    return conn


def _sync_form(caller: str) -> str:
    """The sync call of an asyncio one: aschedule() -> schedule(), Dag.aseal() -> Dag.seal()."""
    owner, dot, name = caller.rpartition(".")
    return owner + dot + name.removeprefix("a")


def _check_open(conn: psycopg.Connection | psycopg.AsyncConnection, caller: str) -> None:
    if conn.autocommit and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
        raise EverystepError(
            f"{caller} needs an open transaction: this connection is in autocommit mode outside "
            "a transaction block; use `with everystep.transaction(conn):` or `with conn.transaction():`"
        )


# ---------------------------------------------------------------- SQLAlchemy

def _under_sqlalchemy(conn: Any, caller: str) -> Any:
    """The psycopg connection under a SQLAlchemy Session or Connection (in its
    transaction, begun if it was not); anything else as it is."""
    if not type(conn).__module__.startswith("sqlalchemy."):
        return conn
    from sqlalchemy.engine import Connection  # noqa: PLC0415  (the sqlalchemy extra)
    from sqlalchemy.orm import Session  # noqa: PLC0415

    if isinstance(conn, Session):
        conn = conn.connection()
    if not isinstance(conn, Connection):
        raise EverystepError(f"{caller} takes a SQLAlchemy Session or Connection, not {type(conn).__name__} "
                             "(an AsyncSession is for the asyncio API: aschedule() and the others)")
    _check_driver(conn.dialect, caller)
    return conn.connection.driver_connection


async def _under_sqlalchemy_async(conn: Any, caller: str) -> Any:
    """The psycopg AsyncConnection under a SQLAlchemy AsyncSession or AsyncConnection."""
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession  # noqa: PLC0415  (the sqlalchemy extra)

    if isinstance(conn, AsyncSession):
        conn = await conn.connection()
    if not isinstance(conn, AsyncConnection):
        raise EverystepError(f"{caller} takes a SQLAlchemy AsyncSession or AsyncConnection, not "
                             f"{type(conn).__name__} (a Session is for schedule() and the other sync calls)")
    _check_driver(conn.dialect, caller)
    raw = await conn.get_raw_connection()
    return raw.driver_connection


def _check_driver(dialect: Any, caller: str) -> None:
    if dialect.name != "postgresql" or not dialect.driver.startswith("psycopg") or dialect.driver == "psycopg2":
        raise EverystepError(f"{caller} needs SQLAlchemy's psycopg (3) driver on PostgreSQL (a URL like "
                             f"postgresql+psycopg://...), not {dialect.name}+{dialect.driver}")


# ---------------------------------------------------------------- Django

def _django_connection() -> Any:
    """Django's connection, when Django is installed and configured."""
    try:
        from django.conf import settings  # noqa: PLC0415  (optional integration)
        from django.db import connection  # noqa: PLC0415
    except ImportError:
        return None
    if not settings.configured:
        return None
    return DjangoCursorConnection(connection)


class DjangoCursorConnection:
    """Adapts Django's connection to the `execute(...).fetchone()` calls of everystep.db."""

    def __init__(self, connection: Any):
        self.connection = connection

    def execute(self, query: str, params: Any = None) -> Any:
        cursor = self.connection.cursor()
        cursor.execute(query, params)
        return cursor
