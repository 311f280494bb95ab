"""Workflows of the tracing and Sentry tests (tests/test_tracing.py)."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import everystep
from everystep import parallel, step, workflow


@step
def double(x: int) -> int:
    return 2 * x


@step
def refuse(message: str) -> None:
    raise ValueError(message)


@step
def die_first_time(marks: str) -> str:
    """SIGKILL this process on the run's first execution of this step."""
    mark = Path(marks) / f"{everystep.current().workflow_id}-died"
    if not mark.exists():
        mark.write_text("")
        os.kill(os.getpid(), signal.SIGKILL)
    return "survived"


@step(unsafe_to_repeat=True)
def charge_card(marks: str) -> str:
    """Unsafe to repeat, and its process is killed the first time: the run blocks."""
    die_first_time.__wrapped__(marks)
    return "charged"


@step
def stop_here(reason: str) -> None:
    raise everystep.Terminal(reason)


@workflow
def fan_out(n: int) -> int:
    first = double(n)
    left, right = parallel(lambda: double(first), [lambda: double(n + 1), lambda: double(n + 2)])
    return first + left + sum(right)


@workflow
def fails(message: str) -> None:
    double(1)
    refuse(message)


@workflow
def killed_then_done(marks: str) -> int:
    a, b = double(1), double(2)
    die_first_time(marks)
    return a + b + double(3)


@workflow
def killed_then_fails(marks: str) -> None:
    try:
        refuse("card declined")
    except ValueError as declined:
        error = declined
    die_first_time(marks)
    raise RuntimeError("the order could not be paid") from error


@workflow
def blocks(marks: str) -> str:
    return charge_card(marks)


@workflow
def stops(reason: str) -> None:
    stop_here(reason)


@step
def say(message: str) -> None:
    logging.getLogger("shop").warning(message)


@workflow
def talks(message: str) -> None:
    say(message)


_failed_once: set[str] = set()


@step(retries=1, backoff=0)
def flaky_once(key: str) -> str:
    """Fails its first attempt in this process, then succeeds: one retry."""
    if key not in _failed_once:
        _failed_once.add(key)
        raise ConnectionError("first attempt fails")
    return key


@workflow
def retried_once(key: str) -> str:
    return flaky_once(key)


_slow_once: set[str] = set()


@step(timeout=0.2, retries=1, backoff=0)
def slow_once(key: str) -> str:
    """Runs past its timeout at its first attempt in this process (the
    attempt is abandoned), then returns at once: one step timeout."""
    if key not in _slow_once:
        _slow_once.add(key)
        time.sleep(1.0)
    return key


@workflow
def timed_out_once(key: str) -> str:
    return slow_once(key)


@step
def touch(path: str) -> str:
    Path(path).touch()
    return path


@workflow
def touches(path: str) -> str:
    return touch(path)
