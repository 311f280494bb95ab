"""Workflows of tests/test_timeouts.py (step timeouts, deadlines), importable
by worker processes. Steps mark their executions like tests/apps/workflows.py."""

from __future__ import annotations

import asyncio
import time

import everystep
from everystep import Cancelled, step, workflow
from tests.apps.workflows import hold, mark, marks_of, work


def attempts_of(marks: str, tag: str) -> int:
    run = str(everystep.current().workflow_id)
    return sum(1 for m in marks_of(marks) if m[0] == run and m[1] == tag)


@step(timeout=0.5, retries=3, backoff=0.05)
def hangs_at_first(marks: str, hangs: int) -> str:
    """Hangs (far past its timeout) in its first `hangs` attempts, then returns."""
    attempt = attempts_of(marks, "attempt") + 1
    mark(marks, "attempt")
    if attempt <= hangs:
        time.sleep(3)
        mark(marks, f"late:{attempt}")  # an abandoned attempt's thread gets here; its result is ignored
        return "late"
    return f"ok after {attempt}"


@workflow
def retries_a_timeout(marks: str, hangs: int) -> str:
    return hangs_at_first(marks, hangs)


@step(timeout=0.3, unsafe_to_repeat=True, retries=3, retry_on=TimeoutError)
def unsafe_hangs(marks: str) -> str:
    mark(marks, "effect")
    time.sleep(3)
    return "charged"


@workflow
def unsafe_times_out(marks: str) -> str:
    return unsafe_hangs(marks)


@step(timeout=0.3, retries=1, backoff=0.05)
async def async_hangs(marks: str) -> str:
    mark(marks, "async-attempt")
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        mark(marks, "async-cancelled")
        raise
    return "never"


@workflow
async def async_times_out(marks: str) -> str:
    try:
        return await async_hangs(marks)
    except everystep.StepTimeout as timeout:
        return f"gave up: {timeout}"


@workflow
def sync_calls_async_timeout(marks: str) -> str:
    try:
        return async_hangs(marks)
    except everystep.StepTimeout:
        return "timed out"


@step(timeout=0.2)
def sync_step_times_out_in_async(marks: str) -> str:
    mark(marks, "sync-in-async")
    time.sleep(2)
    return "late"


@workflow
async def async_with_sync_timeout(marks: str) -> str:
    try:
        return await sync_step_times_out_in_async(marks)
    except everystep.StepTimeout:
        return "timed out"


# ---------------------------------------------------------------- deadlines

@workflow
def sleeps_long(marks: str) -> str:
    work(marks, "before")
    everystep.sleep(3600)
    work(marks, "after")
    return "slept"


@workflow
def waits_for_a_message(marks: str) -> object:
    work(marks, "before")
    return everystep.wait_for("go")


@workflow
def steps_on(marks: str, release: str) -> str:
    """Holds its first step until `release`, then goes on; catches Cancelled to run a cleanup step."""
    try:
        hold(marks, "held", release)
        work(marks, "next")
        return "done"
    except Cancelled as cancelled:
        work(marks, f"cleanup:{cancelled.reason}")
        raise


@workflow(timeout=3600)
def parent_of_child(marks: str, child_timeout: bool) -> object:
    work(marks, "parent")
    handle = everystep.start(child_with_timeout if child_timeout else child_without_timeout, marks)
    return handle.result()


def sleeping_child(marks: str) -> str:
    work(marks, "child")
    everystep.sleep(7200)
    return "child done"


@workflow
def child_without_timeout(marks: str) -> str:
    return sleeping_child(marks)


@workflow(timeout=60)
def child_with_timeout(marks: str) -> str:
    return sleeping_child(marks)


@workflow(timeout=120)
def has_a_timeout(marks: str) -> str:
    return work(marks, "timed")


@workflow
def counted(marks: str) -> str:
    """retries_a_timeout's step under a workflow of its own: its metrics' labels are this test's alone."""
    return hangs_at_first(marks, 1)
