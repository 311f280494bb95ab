"""Workflows of the flow tests (limits, routing) that worker processes import."""

from __future__ import annotations

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
