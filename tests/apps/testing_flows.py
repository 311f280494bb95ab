"""Workflows of the everystep.testing tests: sleeps, waits, retries, children,
unsafe steps. Steps count their executions in `calls` (the tests run them
in their own process, with drain())."""

from __future__ import annotations

import collections
import time

import everystep
from everystep import Backoff, step, workflow

calls: collections.Counter = collections.Counter()


@step
def note(what):
    calls[what] += 1
    return what


@step(unsafe_to_repeat=True)
def charge(customer, amount):
    calls["charge"] += 1
    return f"ch_{customer}_{amount}"


@step(retries=2, backoff=Backoff(initial=60, factor=2, jitter=0))
def flaky(name):
    calls[name] += 1
    if calls[name] < 3:
        raise ConnectionError(f"{name}: attempt {calls[name]} failed")
    return calls[name]


@step
def slow(seconds):
    time.sleep(seconds)
    return seconds


@workflow
def later(tag):
    return note(tag)


@workflow
def hourly(hours):
    """A step every hour, `hours` times."""
    done = []
    for hour in range(hours):
        everystep.sleep(3600)
        done.append(note(f"hour {hour}"))
    return done


@workflow
def approval(customer):
    """Waits a day for an approval; charges once approved."""
    note(f"asked {customer}")
    answer = everystep.wait_for("approval", timeout=86400)
    if answer is None:
        return "expired"
    return charge(customer, answer["amount"])


@workflow
def retried(name):
    return flaky(name)


@workflow
def child(n):
    return note(f"child {n}") and n * 10


@workflow
def parent(n):
    """Children in parallel branches: each branch waits on its thread."""
    return list(everystep.parallel(*[lambda i=i: everystep.call(child, i) for i in range(n)]))


@workflow
def spawner(n):
    """Starts `n` children one after the other, each waited for (parked)."""
    return [everystep.call(child, i) for i in range(n)]


@workflow
def pay(customer):
    note(f"order {customer}")
    return charge(customer, 12)


@workflow
def slow_run(seconds, steps):
    return [slow(seconds) for _ in range(steps)]


@workflow
def report(label):
    return note(f"report {label}")
