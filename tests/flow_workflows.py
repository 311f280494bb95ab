"""Workflows of the flow tests (limits, routing) that worker processes import."""

from __future__ import annotations

import everystep
from everystep import workflow
from tests.workflows import work


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
