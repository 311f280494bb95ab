"""Faults a test injects into executions (everystep.testing's
crash_after_step and crash_before_effect): an execution that reaches an
armed fault dies there, leaving its run as a SIGKILL of its worker would.

The runner looks here at two points of a step: right after its outcome was
handed to the writer (AFTER_STEP), and right after an unsafe step's
`started` mark was committed, before its function is called
(BEFORE_EFFECT). Nothing is armed outside such a test, and the runner's cost
is one look at an empty list per step. Imports nothing of the engine.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

AFTER_STEP = "after step"
BEFORE_EFFECT = "before effect"

# The faults armed now, and the execution tokens of the executions they
# killed (their fences refuse any write that was still under way).
ARMED: list[Fault] = []
CRASHED: set[int] = set()
_lock = threading.Lock()


class Crash(BaseException):
    """The execution dies here. A BaseException, so that no `except
    Exception` of a workflow body catches it, and the execution's halt, so
    that it writes nothing more: the run stays `running` under its claim, as
    a killed worker leaves it, for the next claimer's catchup."""

    def __init__(self, run_id: uuid.UUID, step_id: str, where: str):
        super().__init__(f"injected crash of run {run_id} {where} {step_id!r}")
        self.run_id = run_id
        self.step_id = step_id
        self.where = where


class Fault:
    """Where an execution dies: at `where` of the step with this id, or of
    any step of this function (its `module.qualname`), in the run `run` (None:
    any run), the first `times` times it is reached. `durable`: at
    AFTER_STEP, the step's outcome is written (committed) first; else it dies
    with the outcome unwritten, as a worker killed between a step's return
    and its write does. Armed from its creation until `disarm()` (or the end
    of a `with` block)."""

    def __init__(self, where: str, *, step_id: str | None = None, name: str | None = None,
                 run: uuid.UUID | None = None, durable: bool = False, times: int = 1):
        self.where = where
        self.step_id = step_id
        self.name = name
        self.run = run
        self.durable = durable
        self.times = times
        self.fired = 0  # how many executions it killed
        with _lock:
            ARMED.append(self)

    def matches(self, run_id: uuid.UUID, step_id: str, name: str) -> bool:
        return ((self.step_id is None or self.step_id == step_id) and (self.name is None or self.name == name)
                and (self.run is None or self.run == run_id))

    def disarm(self) -> None:
        with _lock:
            if self in ARMED:
                ARMED.remove(self)

    def __enter__(self) -> Fault:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.disarm()

    def __repr__(self) -> str:
        target = self.step_id if self.step_id is not None else self.name
        return f"<Fault {self.where} {target!r}, fired {self.fired} of {self.times}>"


def reached(where: str, run_id: uuid.UUID, step_id: str, name: str) -> Fault | None:
    """The armed fault that kills this execution here, if any (counted as fired)."""
    with _lock:
        for fault in ARMED:
            if fault.where == where and fault.fired < fault.times and fault.matches(run_id, step_id, name):
                fault.fired += 1
                return fault
    return None


def crash(token: int, run_id: uuid.UUID, step_id: str, where: str) -> Crash:
    """The execution of this token dies: its fence refuses its writes from now on."""
    with _lock:
        CRASHED.add(token)
    return Crash(run_id, step_id, where)


def crashed(token: int) -> bool:
    """Whether an injected fault killed the execution of this token."""
    return token in CRASHED


def disarm_all() -> None:
    with _lock:
        ARMED.clear()
        CRASHED.clear()
