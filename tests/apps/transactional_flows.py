"""Workflows with @step(transactional=True) steps: each books an order into
the table `booking` (made by the test, in its schema) through the step's
connection. `marks` is a folder where the steps say what they reached, and
where a file `hold-<where>` makes the step wait there (the test SIGKILLs the
worker meanwhile) until the file is removed or its run's second execution."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import everystep
from everystep import step, workflow

# Tests in this process count their steps' calls here.
calls: dict[str, int] = {}


def _reached(marks: str, where: str) -> None:
    """Say that the step reached `where`; wait there while `hold-<where>` says so."""
    folder = Path(marks)
    (folder / f"reached-{where}").write_text(str(os.getpid()))
    hold = folder / f"hold-{where}"
    while hold.exists() and hold.read_text() == str(os.getpid()):
        time.sleep(0.02)


def _hold_in_first_process(marks: str, where: str) -> None:
    """The first process that reaches `where` waits there (for its SIGKILL)."""
    hold = Path(marks) / f"hold-{where}"
    if not hold.exists():
        hold.write_text(str(os.getpid()))
    _reached(marks, where)


@step(transactional=True)
def book(order: str, marks: str = "", hold: str = "") -> str:
    conn = everystep.step_connection()
    conn.execute("INSERT INTO booking (order_id, line) VALUES (%s, 1), (%s, 2)", (order, order))
    calls[order] = calls.get(order, 0) + 1
    if hold == "before-commit":
        _hold_in_first_process(marks, hold)
    return f"booked {order}"


@step(transactional=True)
async def abook(order: str, marks: str = "", hold: str = "") -> str:
    aconn = everystep.step_connection()
    await aconn.execute("INSERT INTO booking (order_id, line) VALUES (%s, 1), (%s, 2)", (order, order))
    calls[order] = calls.get(order, 0) + 1
    if hold == "before-commit":
        await asyncio.to_thread(_hold_in_first_process, marks, hold)
    return f"booked {order}"


@step
def after(marks: str, hold: str) -> str:
    if hold == "after-commit":
        _hold_in_first_process(marks, hold)
    return "after"


@workflow
def order(order_id: str, marks: str = "", hold: str = "") -> list:
    return [book(order_id, marks, hold), after(marks, hold)]


@workflow
async def aorder(order_id: str, marks: str = "", hold: str = "") -> list:
    return [await abook(order_id, marks, hold), await after(marks, hold)]


@workflow
async def aorder_sync_step(order_id: str) -> str:
    return await book(order_id)


@workflow
def order_async_step(order_id: str) -> str:
    return abook(order_id)


@step(transactional=True, retries=2, backoff=0)
def flaky_book(order: str) -> str:
    everystep.step_connection().execute("INSERT INTO booking (order_id, line) VALUES (%s, 1)", (order,))
    calls[order] = calls.get(order, 0) + 1
    if calls[order] < 3:
        raise RuntimeError(f"attempt {calls[order]} fails after its insert")
    return "booked"


@workflow
def flaky(order_id: str) -> str:
    return flaky_book(order_id)


@step(transactional=True)
def bad_result(order: str) -> object:
    everystep.step_connection().execute("INSERT INTO booking (order_id, line) VALUES (%s, 1)", (order,))
    return {1, 2}  # cannot be stored: the step fails, its insert rolled back


@workflow
def unstorable(order_id: str) -> object:
    return bad_result(order_id)


@step(transactional=True)
def book_losing_claim(order: str, url: str) -> str:
    """The first call: the run is requeued meanwhile (as the dead-claimer sweep
    does), so this execution's claim is lost before the step's commit."""
    everystep.step_connection().execute("INSERT INTO booking (order_id, line) VALUES (%s, 1)", (order,))
    calls[order] = calls.get(order, 0) + 1
    if calls[order] == 1:
        import psycopg  # noqa: PLC0415

        with psycopg.connect(url, autocommit=True) as other:
            other.execute("UPDATE everystep_workflow SET status = 'scheduled', claimed_by = NULL WHERE id = %s",
                          (everystep.current().workflow_id,))
    return "booked"


@workflow
def losing_claim(order_id: str, url: str) -> str:
    return book_losing_claim(order_id, url)


# ---------------------------------------------------------------- SQLAlchemy sessions on the step's transaction

def _insert(line: int):
    from sqlalchemy import text  # noqa: PLC0415

    return text(f"INSERT INTO booking (order_id, line) VALUES (:order, {line})")


@step(transactional=True, retries=1, backoff=0)
def book_with_session(order: str) -> str:
    session = everystep.step_session()
    session.execute(_insert(1), {"order": order})
    session.commit()  # kept in the step's transaction (a savepoint)
    session.execute(_insert(2), {"order": order})  # kept when the step returns
    calls[order] = calls.get(order, 0) + 1
    if calls[order] == 1:
        raise RuntimeError("the first attempt fails: its rows are rolled back")
    return "booked"


@step(transactional=True, retries=1, backoff=0)
async def abook_with_session(order: str) -> str:
    session = await everystep.astep_session()
    await session.execute(_insert(1), {"order": order})
    await session.commit()
    await session.execute(_insert(2), {"order": order})
    calls[order] = calls.get(order, 0) + 1
    if calls[order] == 1:
        raise RuntimeError("the first attempt fails: its rows are rolled back")
    return "booked"


@workflow
def order_with_session(order_id: str) -> str:
    return book_with_session(order_id)


@workflow
async def aorder_with_session(order_id: str) -> str:
    return await abook_with_session(order_id)
