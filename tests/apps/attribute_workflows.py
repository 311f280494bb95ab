"""Workflows the run-attribute tests run: one that sets attributes as it
goes, one that would set too many, and a plain one to find and act on."""

from __future__ import annotations

import everystep
from everystep import step, workflow


@step
def charge(order: int) -> str:
    return f"charged {order}"


@workflow
def order(n: int) -> str:
    everystep.set_attributes({"stage": "charging", "order": n})
    charged = charge(n)
    everystep.set_attributes({"stage": "done"})
    return charged


@workflow
def crowded(n: int) -> int:
    everystep.set_attributes({f"k{i}": i for i in range(n)})
    return n


@workflow
def noop(n: int) -> int:
    return n


@workflow
async def async_order(n: int) -> int:
    await everystep.set_attributes({"stage": "async", "order": n})
    return n
