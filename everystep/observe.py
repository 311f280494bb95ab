"""The runner's hooks for traces (everystep.tracing) and error reports
(everystep.sentry). With neither in use, `run_started` returns None and every
other hook returns at its first line: nothing is imported, nothing is kept.
A hook never fails a run: an error in one is logged and dropped."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from everystep import sentry, tracing
from everystep.errors import LostClaim
from everystep.schema import RunStatus, StepStatus

log = logging.getLogger("everystep")


def _never_fails(hook: Callable) -> Callable:
    @functools.wraps(hook)
    def call(*args: Any) -> Any:
        try:
            return hook(*args)
        except LostClaim:
            raise  # the run's own business
        except Exception:
            log.exception("%s failed; the run goes on without it", hook.__name__)
            return None
    return call


class Execution:
    """What the hooks keep about one execution of a run (replay.trace)."""

    __slots__ = ("span", "report", "attempt", "status", "exc", "failed_steps")

    def __init__(self, span: tracing.RunSpan | None, report: bool):
        self.span = span
        self.report = report
        self.attempt = None if span is None else span.attributes["everystep.attempt"]
        self.status: str | None = None
        self.exc: BaseException | None = None
        self.failed_steps: list[tuple[BaseException, str]] = []  # for the Sentry tag of a failed run


@_never_fails
def run_started(replay: Any, traced: tuple[dict, int] | None) -> Execution | None:
    """As the execution starts. `traced`: with tracing on, what counting
    this execution of the run returned (execution.HeldRun.start_traced)."""
    span = None if traced is None else tracing.run_started(replay.workflow_name, replay.run_id, replay.runner_name,
                                                           *traced)
    report = sentry.enabled()
    if span is None and not report:
        return None
    return Execution(span, report)


def run_ending(replay: Any, status: str, exc: BaseException | None) -> None:
    """The end the run is about to be written with."""
    execution = replay.trace
    if execution is not None:
        execution.status, execution.exc = status, exc


def run_ended(replay: Any, outcome: str) -> None:
    """After the execution: `outcome` is how it ended (see Runner.execute)."""
    if replay.trace is not None:
        _report_end(replay, replay.trace, outcome)


@_never_fails
def _report_end(replay: Any, execution: Execution, outcome: str) -> None:
    exc = execution.exc if execution.status == outcome else None
    blocked_on = _started_step(replay) if outcome == RunStatus.BLOCKED else None
    if execution.span is not None:
        tracing.run_ended(execution.span, outcome, exc, blocked_on and blocked_on[0])
    if not execution.report:
        return
    # Reported only once the end is written (outcome == status): a run fails once.
    if outcome == RunStatus.FAILED and exc is not None:
        step = next((name for failed, name in reversed(execution.failed_steps) if _caused(exc, failed)), None)
        sentry.report_failed(replay.run_id, replay.workflow_name, replay.runner_name, step, exc, execution.attempt)
    elif outcome == RunStatus.BLOCKED:
        step_id, step = blocked_on or (None, None)
        sentry.report_blocked(replay.run_id, replay.workflow_name, replay.runner_name, step_id, step,
                              execution.attempt)


def step_started(replay: Any, step_id: str, name: str) -> Any:
    """Before a step executes: its span (None when not traced)."""
    execution = replay.trace
    if execution is None or execution.span is None:
        return None
    return _step_span_started(execution.span, step_id, name)


def step_ended(replay: Any, step: Any, name: str, status: str, exc: BaseException | None = None) -> None:
    """After a step executed: done, or failed with `exc`."""
    execution = replay.trace
    if execution is None:
        return
    if exc is not None:
        execution.failed_steps.append((exc, name))
    if step is not None:
        _step_span_ended(execution.span, step, status, exc)


_step_span_started = _never_fails(tracing.step_started)
_step_span_ended = _never_fails(tracing.step_ended)


def _caused(exc: BaseException, failed: BaseException) -> bool:
    """Whether the run's exception is the step's, or was raised from it."""
    seen = 0
    while exc is not None and seen < 50:
        if exc is failed:
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _started_step(replay: Any) -> tuple[str, str] | None:
    """The (id, name) of the started step a blocked run waits on."""
    for step_id, step in list(replay.recorded.items()):
        if step.status == StepStatus.STARTED:
            return step_id, step.name
    return None


# ---------------------------------------------------------------- supervised processes

def setup(tracing_enabled: bool, sentry_enabled: bool) -> None:
    """The supervisor's switches, in each child after the fork."""
    if tracing_enabled:
        tracing.setup()
    if sentry_enabled:
        sentry.setup()


def shutdown() -> None:
    """Before a supervised child exits (it skips the interpreter's exit handlers)."""
    for flush in (tracing.shutdown, sentry.shutdown):
        try:
            flush()
        except Exception:
            log.exception("could not flush %s", flush.__module__)
