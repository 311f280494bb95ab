"""The async workflows of the w1_async and w3_async benchmarks: async steps
that do next to nothing, as tests/benchmarks/workflows.py's sync ones. A
module of their own, so that the workers running them have async
workflows only (and those running the sync benchmarks sync ones only)."""

from __future__ import annotations

from everystep import step, workflow


@step
async def noop(i: int) -> int:
    return i


@workflow
async def one_step(i: int) -> int:
    return await noop(i)


@workflow
async def three_steps(i: int) -> int:
    return await noop(i) + await noop(i + 1) + await noop(i + 2)
