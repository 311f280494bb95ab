"""Async workflows and steps of tests/test_async.py; `calls` counts the
executions of the steps in this process (emptied before every test)."""

from __future__ import annotations

import asyncio
import collections
import os
import time

import everystep
from everystep import step, workflow

calls: collections.Counter = collections.Counter()


@step
async def fetch(tag: str, delay: float = 0.0) -> str:
    calls[tag] += 1
    await asyncio.sleep(delay)
    return f"fetched {tag}"


@step
def compute(tag: str) -> str:
    calls[tag] += 1
    return f"computed {tag}"


@workflow
async def mixed(tag: str) -> list:
    first = await fetch(f"{tag}-a")
    second = await compute(f"{tag}-b")
    both = await everystep.gather(fetch(f"{tag}-c", 0.05), fetch(f"{tag}-d", 0.0))
    return [first, second, *both]


@workflow
def sync_calls_async(tag: str) -> str:
    return fetch(tag)


@workflow
async def races(delays: list) -> list:
    """Steps started together and ending in another order than they started."""
    return await asyncio.gather(*(fetch(f"race-{i}", delay) for i, delay in enumerate(delays)))


async def branch(tag: str, delay: float) -> list:
    first = await fetch(f"{tag}-1", delay)
    return [first, await fetch(f"{tag}-2", 0.0)]


@workflow
async def branches(delays: list) -> list:
    return await asyncio.gather(*(branch(f"b{i}", delay) for i, delay in enumerate(delays)))


@workflow
async def everystep_branches(delays: list) -> list:
    return await everystep.gather(*(branch(f"g{i}", delay) for i, delay in enumerate(delays)))


@workflow
async def waits_first(delays: list) -> str:
    tasks = [asyncio.create_task(fetch(f"w{i}", delay)) for i, delay in enumerate(delays)]
    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    return done.pop().result()


@workflow
async def as_completed_first(delays: list) -> str:
    for first in asyncio.as_completed([fetch(f"c{i}", delay) for i, delay in enumerate(delays)]):
        return await first
    return ""


@workflow
async def sleeps(seconds: float) -> str:
    await everystep.sleep(seconds)
    return await fetch("after-sleep")


@workflow
async def waits_for_message() -> object:
    message = await everystep.wait_for("go", timeout=30)
    await everystep.set_event("got", message)
    return message


@workflow
async def child(n: int) -> int:
    return n * 2


@workflow
async def parent(n: int) -> list:
    handle = await everystep.start(child, n)
    first = await handle.result()
    second = await everystep.call(child, n + 1)
    return [first, second, everystep.patched("extra")]


attempts: collections.Counter = collections.Counter()


@step(retries=2, backoff=0.01)
async def flaky(tag: str) -> str:
    attempts[tag] += 1
    if attempts[tag] < 3:
        raise ValueError(f"attempt {attempts[tag]}")
    return tag


@workflow
async def retried(tag: str) -> str:
    return await flaky(tag)


@workflow
async def uses_parallel() -> tuple:
    return everystep.parallel(lambda: 1)


class Crash(BaseException):
    """Stands for the worker dying mid-step: not recorded, leaves the run claimed."""


@step
async def crash_once(tag: str) -> str:
    calls[tag] += 1
    if calls[tag] == 1:
        raise Crash()
    return tag


@workflow
async def races_then_crash(delays: list) -> list:
    raced = await asyncio.gather(*(fetch(f"rc-{i}", delay) for i, delay in enumerate(delays)))
    return [*raced, await crash_once("rc-crash")]


# ---------------------------------------------------------------- in worker processes

def marks_of(folder: str) -> list[str]:
    """The tags marked in `folder`, one per execution of a marking step."""
    return [name.split(".")[0] for name in os.listdir(folder)]


async def _marking(folder: str, tag: str, hold: str) -> str:
    """Marks the execution in `folder`, then waits while the file `hold` exists."""
    with open(os.path.join(folder, f"{tag}.{os.getpid()}.{os.urandom(4).hex()}"), "w"):
        pass
    while os.path.exists(hold):
        await asyncio.sleep(0.02)
    return tag


@step
async def marked(folder: str, tag: str, hold: str) -> str:
    return await _marking(folder, tag, hold)


@workflow
async def gathered(folder: str, hold: str) -> list:
    head = await marked(folder, "head", "")
    results = await everystep.gather(marked(folder, "g0", ""), marked(folder, "g1", hold), marked(folder, "g2", hold))
    return [head, *results, await marked(folder, "tail", "")]


@step(unsafe_to_repeat=True)
async def unsafe_marked(folder: str, tag: str, hold: str) -> str:
    return await _marking(folder, tag, hold)


@workflow
async def unsafe_held(folder: str, hold: str) -> str:
    return await unsafe_marked(folder, "unsafe", hold)


@workflow
async def held_then_more(folder: str, hold: str, unsafe: bool) -> str:
    await (unsafe_marked if unsafe else marked)(folder, "held", hold)
    return await marked(folder, "never", "")


@workflow
async def naps(seconds: float) -> str:
    """A step that waits for I/O (here asyncio.sleep) without holding a thread."""
    return await fetch("nap", seconds)


@workflow
async def sleeps_long(seconds: float) -> str:
    await everystep.sleep(seconds)
    return "woke"


@step
async def blocks_the_loop(seconds: float) -> str:
    time.sleep(seconds)  # a blocking call in async code, on purpose
    return "blocked"


@workflow
async def blocking(seconds: float) -> str:
    return await blocks_the_loop(seconds)
