"""Workflows that write durable streams (tests/test_streams.py)."""

from __future__ import annotations

import everystep

calls: dict[str, int] = {}


@everystep.step
def tokens(n: int) -> str:
    """Writes n entries from inside a step (at least once), returns their text."""
    calls["tokens"] = calls.get("tokens", 0) + 1
    for i in range(n):
        everystep.write_stream("out", f"t{i}")
    return "".join(f"t{i}" for i in range(n))


@everystep.step(retries=1, backoff=0)
def flaky(marker: str) -> str:
    calls["flaky"] = calls.get("flaky", 0) + 1
    everystep.write_stream("out", f"try{calls['flaky']}")
    if calls["flaky"] == 1:
        raise RuntimeError("first try fails")
    return marker


@everystep.workflow
def writes(n: int) -> int:
    for i in range(n):
        everystep.write_stream("out", {"i": i})
    everystep.close_stream("out")
    return n


@everystep.workflow
def mixed(n: int) -> str:
    everystep.write_stream("out", "start")
    text = tokens(n)
    everystep.write_stream("out", "end")
    return text


@everystep.workflow
def retried() -> str:
    return flaky("ok")


@everystep.workflow
def after_close() -> None:
    everystep.close_stream("out")
    everystep.write_stream("out", 1)


@everystep.workflow
def waits_then_writes(n: int) -> int:
    for i in range(n):
        everystep.write_stream("out", i)
        everystep.sleep(0.05)
    return n


@everystep.workflow
async def writes_async(n: int) -> int:
    for i in range(n):
        await everystep.write_stream("out", i)
    await atokens(2)
    return n


@everystep.step
async def atokens(n: int) -> int:
    for i in range(n):
        await everystep.awrite_stream("out", f"a{i}")
    return n


@everystep.workflow
def bad_value() -> None:
    everystep.write_stream("out", "fine")
    everystep.write_stream("out", object())


@everystep.workflow
def bad_key() -> None:
    everystep.write_stream("k" * 301, 1)


@everystep.workflow
def ticks(n: int, pause: float) -> str:
    """Text tokens, one every `pause` seconds: what a page shows as it comes."""
    for i in range(n):
        everystep.write_stream("out", f"tick {i}. ")
        everystep.sleep(pause)
    return "".join(f"tick {i}. " for i in range(n))


@everystep.workflow
def writes_sizes(sizes: list[int]) -> int:
    """Writes one entry of each size (characters) to "out", then closes it."""
    for size in sizes:
        everystep.write_stream("out", "x" * size)
    everystep.close_stream("out")
    return len(sizes)
