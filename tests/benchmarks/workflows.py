"""The workflows the benchmarks run: steps that do next to nothing, so what is
measured is the engine (claim, replay, recording) and the database."""

from __future__ import annotations

import os
import time

import everystep
from everystep import step, workflow


@step
def noop(i: int) -> int:
    return i


@workflow
def one_step(i: int) -> int:
    return noop(i)


@workflow
def three_steps(i: int) -> int:
    return noop(i) + noop(i + 1) + noop(i + 2)


@step(write_behind=True)
def noop_behind(i: int) -> int:
    return i


@workflow
def three_steps_behind(i: int) -> int:
    return noop_behind(i) + noop_behind(i + 1) + noop_behind(i + 2)


@step
def started_at() -> float:
    """The moment the step's function starts, on this host's clock."""
    return time.time()


@workflow
def latency_probe() -> float:
    return started_at()


@step
def wait_for_file(path: str) -> str:
    while not os.path.exists(path):
        time.sleep(0.01)
    return path


@workflow
def held_until(path: str) -> str:
    return wait_for_file(path)


@workflow
def sleep_probe(seconds: float) -> float:
    """Sleeps durably, then records when it went on (this host's clock)."""
    everystep.sleep(seconds)
    return started_at()


@workflow
def message_probe() -> float:
    """Parks in a wait for a message; once one comes, the moment the body resumed."""
    everystep.wait_for("go")
    return started_at()


@workflow(concurrency=16)
def one_step_limited(i: int) -> int:
    """one_step under a limit as large as the benchmark fleet's slots: what
    the limit's bookkeeping costs, not a queue behind it."""
    return noop(i)


@workflow(concurrency=4)
def one_step_limited_4(i: int) -> int:
    return noop(i)


@workflow(concurrency=1)
def one_step_limited_1(i: int) -> int:
    """A limited workflow the claim_cost benchmark keeps saturated."""
    return noop(i)


@workflow
def parent_of_limited(i: int) -> int:
    """Waits on a child queued behind a saturated limit (claim_cost)."""
    return everystep.call(one_step_limited_1, i)


@workflow(concurrency_per_key=4)
def one_step_keyed(i: int) -> int:
    """one_step in a fair queue: at most 4 runs per concurrency key (fairness)."""
    return noop(i)


@step(rate_limit="bench-api")
def paced() -> float:
    return time.time()


@workflow
def rate_limited(i: int) -> float:
    """One step that takes a token of the `bench-api` rate limit (rate_limit)."""
    return paced()


# One stream entry of 40 bytes as stored JSON: a string of 38 characters, quoted.
STREAM_ENTRY = "x" * 38


@workflow
def stream_writer(entries: int) -> int:
    """Writes `entries` entries to its stream "out" as fast as it can."""
    for _ in range(entries):
        everystep.write_stream("out", STREAM_ENTRY)
    return entries
