"""Workflows of the flow tests (limits, routing) that worker processes import."""

from __future__ import annotations

import everystep
from everystep import workflow
from tests.apps.workflows import hold, work


@workflow(concurrency=3)
def limited(marks: str, seconds: float) -> str:
    return work(marks, "limited", seconds)


@workflow
def unlimited(marks: str, seconds: float) -> str:
    return work(marks, "unlimited", seconds)


@workflow
def gpu_job(marks: str) -> str:
    return work(marks, "gpu")


@workflow
def cpu_job(marks: str) -> str:
    return work(marks, "cpu")


@workflow
def mailbox(marks: str, count: int, timeout: float | None = None) -> list:
    """Wait for `count` messages on "in", with a step after each."""
    got = []
    for i in range(count):
        message = everystep.wait_for("in", timeout=timeout)
        got.append(message)
        work(marks, f"got{i}")
    everystep.set_event("got", got)
    return got


@workflow
def publisher(marks: str) -> str:
    everystep.set_event("stage", "first")
    work(marks, "between")
    everystep.set_event("stage", "second")
    return "done"


@workflow
def child_double(x: int) -> int:
    return x * 2


@workflow
def child_fails(message: str) -> None:
    raise ValueError(message)


@workflow
def child_held(marks: str, release: str) -> str:
    return hold(marks, "child", release)


@workflow
def parent_calls(x: int) -> list:
    handle = everystep.start(child_double, x)
    return [str(handle.id), handle.result(), everystep.call(child_double, x + 1)]


@workflow
def parent_of_failure(message: str) -> list:
    try:
        everystep.call(child_fails, message)
    except everystep.ChildFailed as failed:
        return [failed.status, type(failed.error).__name__, str(failed.error)]
    return ["no failure"]


@workflow
def parent_of_held(marks: str, release: str) -> str:
    return everystep.call(child_held, marks, release)


PARENT_BODIES: list[str] = []  # how many times fan_out's body ran, in this process


@workflow
def fan_out(count: int) -> int:
    PARENT_BODIES.append("run")
    handles = [everystep.start(child_double, i) for i in range(count)]
    return sum(handle.result() for handle in handles)
