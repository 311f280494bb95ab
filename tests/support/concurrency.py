"""Helpers for tests that run sessions side by side against the database."""

from __future__ import annotations

import threading
from collections.abc import Callable

import psycopg


def hold_a_snapshot(url: str) -> psycopg.Connection:
    """A session idle in a REPEATABLE READ transaction that has read once:
    no vacuum removes a row deleted after its snapshot while it stays open.
    Close it to let go."""
    holder = psycopg.connect(url, autocommit=False)
    holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    holder.execute("SELECT count(*) FROM everystep_workflow")
    return holder


def reporting_thread(errors: list[BaseException], target: Callable, *args) -> threading.Thread:
    """A thread running target(*args), whatever it raises appended to
    `errors` (for the test to assert empty: an exception in a thread is
    otherwise only printed)."""
    def run() -> None:
        try:
            target(*args)
        except BaseException as exc:  # noqa: BLE001  (reported through `errors`)
            errors.append(exc)

    return threading.Thread(target=run)
