"""Steps shared by the engine's tests (step ids, replay, unsafe steps,
values, the API), which execute them in-process; `calls` and `seen` are
emptied before every test (conftest)."""

from __future__ import annotations

import collections
import datetime as dt
import decimal
import enum
import uuid

from everystep import step, workflow

calls: collections.Counter = collections.Counter()
seen: dict = {}


class Crash(BaseException):
    """Stands for the worker dying mid-step: not recorded, leaves the run claimed."""


class Color(enum.Enum):
    RED = "red"
    BLUE = 2


@step
def record(tag):
    calls[tag] += 1
    return tag


@step
def crash_once(tag):
    calls[tag] += 1
    if calls[tag] == 1:
        raise Crash()
    return tag


@step
def boom(tag):
    calls[tag] += 1
    raise ValueError(tag)


class Point(tuple):
    pass


VALUES = {
    "datetime": dt.datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=dt.timezone(dt.timedelta(hours=2))),
    "naive": dt.datetime(2026, 1, 2, 3, 4, 5),
    "date": dt.date(2026, 2, 28),
    "time": dt.time(23, 59, 1),
    "timedelta": dt.timedelta(days=-1, seconds=5, microseconds=7),
    "uuid": uuid.UUID("01900000-0000-7000-8000-000000000001"),
    "bytes": b"\x00\xffbinary",
    "decimal": decimal.Decimal("12.50"),
    "enum": Color.RED,
    "int_enum": Color.BLUE,
    "tuple": (1, "two", (3,)),
    "nested": {"$es": "not a tag", "list": [1.5, None, True]},
    "unicode": "żółw ✓",
}


@step
def echo(value):
    return value


@workflow
def round_trip(values):
    assert values == VALUES
    echoed = echo(values)
    assert echoed == VALUES
    crash_once("rt")
    return echoed


@workflow
def echo_workflow(value):
    return value
