"""Fault injection for user code: kill a run's execution at a step, as a
SIGKILL of its worker would leave it, so that a test proves the workflow is
safe to replay (everystep.faults does the killing).

Each function arms a fault and returns it (`.fired`: how many executions it
killed); it stays armed until `.disarm()`, the end of its `with` block, or
the end of the test (the everystep_db fixture disarms every fault).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from everystep import faults


def _target(step: Callable | str) -> dict:
    name = getattr(step, "__everystep_step__", None)
    if name is not None:
        return {"name": name}
    if isinstance(step, str):
        return {"step_id": step}
    raise TypeError(f"expected an @step function or a step id, not {step!r}")


def crash_after_step(step: Callable | str, *, run: uuid.UUID | None = None, before_outcome: bool = False,
                     times: int = 1) -> faults.Fault:
    """The execution dies right after the step (an @step function: any call
    of it; a string: the step with that id) returned or raised and its
    outcome was committed. The run stays `running`; the next drain claims it
    again and replays it: the step is served from its record, not run
    again, and the run goes on from the next step.

    `before_outcome=True`: it dies with the outcome not yet written — the
    moment between a step's return and the write of its outcome (within
    50 ms, or with the next step) that a SIGKILL may leave —, so the replay
    runs the step again: at least once, as steps are; a step that is not
    idempotent shows it here. (An unsafe step's outcome, and a transactional
    step's, are written before the step returns: replayed, they are served.)
    `run`: only in this run. `times`: the first so many executions that
    reach it."""
    return faults.Fault(faults.AFTER_STEP, run=run, durable=not before_outcome, times=times, **_target(step))


def crash_before_effect(unsafe_step: Callable | str, *, run: uuid.UUID | None = None, times: int = 1
                        ) -> faults.Fault:
    """The execution dies after the unsafe step's `started` mark is committed
    and before its function is called: the effect never happens, and nobody
    can tell. The next drain replays the run, finds the mark without an
    outcome, and the run ends `blocked` for an operator to resolve
    (everystep resolve-step), as it would in production."""
    if callable(unsafe_step) and not getattr(unsafe_step, "unsafe_to_repeat", False):
        raise ValueError(f"{getattr(unsafe_step, '__everystep_step__', unsafe_step)} is not an "
                         "@step(unsafe_to_repeat=True): only an unsafe step writes a started mark first")
    return faults.Fault(faults.BEFORE_EFFECT, run=run, times=times, **_target(unsafe_step))
