"""Workflows the console's tests run: one that pays and then fails on a bug
(re-run from the failing step once the bug is fixed), one that waits for a
message, one whose step is retried."""

from __future__ import annotations

import os
from pathlib import Path

from everystep import parallel, set_event, step, wait_for, workflow
from everystep.retries import Backoff

calls: list[str] = []  # which step bodies ran, in order
BUG = {"on": True}  # deliver() fails while the bug is "deployed" (in this process)
FIXED = "EVERYSTEP_TEST_FIX_FILE"  # a file whose existence says the fix is deployed (in a worker process too)


def bug_deployed() -> bool:
    fixed = os.environ.get(FIXED)
    return BUG["on"] and not (fixed and Path(fixed).exists())


@step
def reserve(order: str) -> str:
    calls.append("reserve")
    return f"reserved {order}"


@step(unsafe_to_repeat=True)
def charge(order: str) -> str:
    calls.append("charge")
    return f"charged {order}"


@step
def note(what: str) -> str:
    calls.append(f"note {what}")
    return what


@step
def deliver(order: str) -> str:
    calls.append("deliver")
    if bug_deployed():
        raise ValueError(f"no address for {order}")
    return f"delivered {order}"


@step
def ship(order: str) -> str:
    calls.append("ship")
    return f"shipped {order}"


@workflow
def pay_then_deliver(order: str) -> str:
    reserve(order)  # step 1
    charge(order)  # step 2, unsafe to repeat
    parallel(lambda: note("a"), lambda: note("b"))  # fork 3: 3.0.1, 3.1.1
    deliver(order)  # step 4
    return ship(order)  # step 5


@workflow
def waits_for_approval(order: str) -> str:
    set_event("stage", "awaiting approval")  # step 1
    approval = wait_for("approval", timeout=3600)  # step 2
    return f"{order}: {approval}"


@step(retries=2, backoff=Backoff(initial=0.01, maximum=0.01))
def flaky(order: str) -> str:
    calls.append("flaky")
    if calls.count("flaky") < 3:
        raise RuntimeError(f"try {calls.count('flaky')} failed")
    return f"ok {order}"


@workflow
def retried(order: str) -> str:
    return flaky(order)
