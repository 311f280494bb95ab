"""Workflows of the priority, fair-queue and rate-limit tests that worker
processes import."""

from __future__ import annotations

import time

from everystep import step, workflow
from tests.apps.workflows import work


@workflow
def plain(marks: str, seconds: float) -> str:
    return work(marks, "plain", seconds)


@workflow(priority=7)
def urgent(marks: str, seconds: float) -> str:
    return work(marks, "urgent", seconds)


@step
def tenant_work(tenant: str, seconds: float) -> float:
    time.sleep(seconds)
    return time.time()


@workflow(concurrency_per_key=2)
def tenant_job(tenant: str, seconds: float) -> float:
    return tenant_work(tenant, seconds)


@workflow(concurrency_per_key=1, concurrency=3)
def tenant_job_bounded(tenant: str, seconds: float) -> float:
    return tenant_work(tenant, seconds)


@step(rate_limit="test-api")
def call_api(i: int) -> float:
    return time.time()


@workflow
def rate_limited(i: int) -> float:
    return call_api(i)


@step(rate_limit="no-such-limit")
def call_unknown() -> None:
    return None


@workflow
def unknown_limit() -> None:
    call_unknown()
