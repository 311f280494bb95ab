"""Runs whose only step is unsafe to repeat, sync and async, for the chaos
test of tests/test_unsafe_chaos.py: a run ends `blocked` only when its
worker died between the step's `started` mark and its outcome's commit."""

from __future__ import annotations

import asyncio
import time

from everystep import step, workflow


@step(unsafe_to_repeat=True)
def charge(n: int) -> int:
    time.sleep(0.03)
    return n


@workflow
def pay(n: int) -> int:
    return charge(n)


@step(unsafe_to_repeat=True)
async def acharge(n: int) -> int:
    await asyncio.sleep(0.02)
    return n


@workflow
async def apay(n: int) -> int:
    return await acharge(n)
