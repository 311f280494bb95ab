"""Workflows the UI tests run: nested parallel forks, a slow one to watch
live, one that blocks on an unsafe step, one with extended JSON values."""

from __future__ import annotations

import datetime
import decimal
import time

from everystep import parallel, step, workflow


@step
def add(a: int, b: int) -> int:
    return a + b


@step
def pause(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@step(unsafe_to_repeat=True)
def charge(order: str) -> str:
    return f"charged {order}"


@step
def ship(order: str) -> str:
    return f"shipped {order}"


@step
def typed_value() -> dict:
    return {"day": datetime.date(2026, 1, 2), "price": decimal.Decimal("12.50"), "blob": b"\x00\x01"}


@workflow
def nested(n: int) -> int:
    first = add(n, 1)  # step 1
    left, right = parallel(  # fork 2
        lambda: add(first, 1),  # 2.0.1
        [lambda: add(first, 2),  # 2.1.1
         lambda: parallel(lambda: add(1, 1), lambda: add(2, 2))],  # fork 2.1.2: 2.1.2.0.1, 2.1.2.1.1
    )
    return add(left, right[0])  # step 3


@workflow
def slow(seconds: float) -> float:
    return pause(seconds)


@workflow
def charge_then_ship(order: str) -> str:
    charge(order)  # step 1, unsafe to repeat
    return ship(order)  # step 2


@workflow
def typed() -> dict:
    return typed_value()
