"""Workflows that misuse the API or never end, for tests/test_runaway_runs.py."""

from __future__ import annotations

import time

import everystep
from everystep import step, workflow


@step
def tick(n: int) -> int:
    time.sleep(0.005)
    return n


@step
async def add(a: int, b: int) -> int:
    return a + b


@workflow
def child() -> str:
    return "child"


@workflow
def schedules_in_its_body() -> str:
    everystep.schedule(child)
    return "scheduled"


@workflow
async def forgets_an_await() -> str:
    add(1, 2)  # the step's coroutine, never awaited
    return "done"


def _tick_for_ever(swallowed: type[BaseException]) -> None:
    n = 0
    while True:
        n += 1
        try:
            tick(n)
        except swallowed:
            pass


@workflow(max_steps=50)
def loops_for_ever() -> None:
    _tick_for_ever(Exception)  # the body that swallows everything


@workflow
def swallows_cancel() -> None:
    _tick_for_ever(everystep.Cancelled)
