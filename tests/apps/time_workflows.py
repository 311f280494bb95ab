"""Workflows of the time-and-control tests (delayed starts, durable sleep,
cancellation, step retries), importable by worker processes. Steps mark
their executions like tests/workflows.py."""

from __future__ import annotations

import os
import time
from pathlib import Path

import everystep
from everystep import Backoff, Cancelled, step, workflow
from tests.apps.workflows import mark, work


@workflow
def started_at(marks: str) -> float:
    """Records (as its result) when its first step ran, by the worker's clock."""
    return work_time(marks)


@step
def work_time(marks: str) -> float:
    mark(marks, "start")
    return time.time()


@workflow
def sleeper(marks: str, seconds: float) -> str:
    work(marks, "before")
    everystep.sleep(seconds)
    work(marks, "after")
    return "slept"


@workflow
def sleeps_until(marks: str, when: str) -> str:
    import datetime  # noqa: PLC0415

    everystep.sleep_until(datetime.datetime.fromisoformat(when))
    work(marks, "after")
    return "woke"


@step
def wait_for_file(marks: str, tag: str, path: str) -> str:
    mark(marks, tag)
    while not os.path.exists(path):
        time.sleep(0.02)
    mark(marks, tag + ":end")
    return tag


@workflow
def cancellable(marks: str, release: str, cleanup: bool) -> str:
    """Holds its first step until `release` exists, then does more steps;
    with `cleanup`, catches Cancelled and runs a cleanup step."""
    try:
        wait_for_file(marks, "held", release)
        work(marks, "next")
        work(marks, "last")
    except Cancelled as cancelled:
        if not cleanup:
            raise
        work(marks, f"cleanup:{cancelled.reason}")
        return "cleaned up"
    return "done"


@workflow
def finishes_after_hold(marks: str, release: str) -> str:
    """One held step and nothing after: a cancel during it races the run's end."""
    wait_for_file(marks, "held", release)
    return "finished"


class Flaky(Exception):
    pass


class NotRetried(Exception):
    pass


def _failures_left(marks: str, tag: str, failures: int) -> bool:
    """True while this step has failed fewer than `failures` times (counted in the marks file)."""
    path = Path(marks) / "steps"
    done = path.read_text().split().count(tag) if path.exists() else 0
    mark(marks, tag)
    return done < failures


@step(retries=3, backoff=Backoff(initial=0.05, jitter=0))
def flaky(marks: str, failures: int) -> str:
    if _failures_left(marks, "flaky", failures):
        raise Flaky(f"transient failure {failures}")
    return "ok"


@workflow
def retrying(marks: str, failures: int) -> str:
    return flaky(marks, failures)


@step(retries=2, backoff=2.0)
def flaky_slow(marks: str, failures: int) -> str:
    if _failures_left(marks, "slow", failures):
        raise Flaky("transient")
    return "ok"


@workflow
def retrying_slowly(marks: str, failures: int) -> str:
    return flaky_slow(marks, failures)


@step(retries=2, backoff=0.01)
def fails_not_retried(marks: str) -> str:
    mark(marks, "terminal")
    raise everystep.Terminal("give up")


@step(unsafe_to_repeat=True, retries=2, backoff=0.01)
def unsafe_no_retry_on(marks: str) -> str:
    mark(marks, "unsafe")
    raise Flaky("no effect, but not said")


@step(unsafe_to_repeat=True, retries=2, backoff=0.01, retry_on=Flaky)
def unsafe_retry_on(marks: str, error: str) -> str:
    mark(marks, "unsafe")
    raise Flaky("no effect") if error == "flaky" else NotRetried("maybe an effect")


@workflow
def unsafe_retries(marks: str, which: str, error: str = "flaky") -> str:
    if which == "listed":
        return unsafe_retry_on(marks, error)
    return unsafe_no_retry_on(marks)
