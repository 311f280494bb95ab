"""The exceptions everystep raises, and `Terminal`, which steps raise."""

from __future__ import annotations

from typing import Any


class EverystepError(Exception):
    """Misuse of the engine: a bad step id, an unserializable value, a
    duplicate id in one scope, no transaction to schedule into."""


class WorkflowArgumentsError(EverystepError, TypeError):
    """Arguments that do not fit a workflow's parameters: such a run could
    never start, so it is refused before anything is written (a TypeError,
    as Python's own call would raise, and an EverystepError)."""


class WorkflowCodeError(EverystepError):
    """Replay diverged: the step recorded under this id was another function."""


class StepFailure(EverystepError):
    """A recorded step failure whose original exception class is not importable."""

    def __init__(self, message: str, type: str | None = None, args: list | None = None):
        super().__init__(message)
        self.type = type
        self.original_args = args or []


class EffectUncertain(EverystepError):
    """An unsafe-to-repeat step was started and has no recorded outcome: the run
    is `blocked` until an operator says whether the effect happened."""


class LostClaim(EverystepError):
    """A write about a held run matched nothing: another claimer owns it now."""


class Terminal(Exception):
    """Raised by a step to stop its run deliberately (status `stopped`)."""

    def __init__(self, reason: str, payload: Any = None):
        super().__init__(reason, payload)
        self.reason = reason
        self.payload = payload

    def __str__(self) -> str:
        return self.reason


class Drain(BaseException):
    """Internal: the worker is draining; unwind the run at a step boundary so it
    can be requeued. A BaseException so `except Exception` in a workflow body
    does not swallow it."""


class Cancelled(Exception):
    """Raised in a workflow body at its next step call once its run is
    cancelled (`everystep.cancel`). The body may catch it to run cleanup
    steps; the run ends `cancelled` whatever the body does then."""

    def __init__(self, reason: str | None = None):
        super().__init__(reason)
        self.reason = reason

    def __str__(self) -> str:
        return self.reason or "cancelled"


class StepTimeout(TimeoutError):
    """A step attempt ran longer than its `@step(timeout=...)`: the attempt
    failed with this, and is retried under the step's retry policy like any
    failure (a TimeoutError, so `retry_on=TimeoutError` covers it). A sync
    attempt's thread cannot be stopped: it is abandoned (its late result is
    ignored); an async attempt is cancelled at its next await. An
    unsafe_to_repeat step that times out is never retried: its run blocks."""

    def __init__(self, step: str, timeout: float):
        super().__init__(step, timeout)
        self.step = step
        self.timeout = timeout

    def __str__(self) -> str:
        return f"step {self.step} did not finish within its timeout of {self.timeout:g} s"


class RunFailed(EverystepError):
    """A run waited for (ScheduledRun.result / aresult) ended without a
    result: it failed (`error` is its error, rebuilt), was stopped, or was
    cancelled."""

    what = "run"

    def __init__(self, run_id: Any, status: str, error: BaseException | None):
        why = f": {type(error).__name__}: {error}" if error is not None else ""
        super().__init__(f"{self.what} {run_id} {status}{why}")
        self.run_id = run_id
        self.status = status
        self.error = error


class ChildFailed(RunFailed):
    """A child run (everystep.start / call) ended without a result: it failed
    (`error` is its error, rebuilt), was stopped, or was cancelled."""

    what = "child run"


class Parked(BaseException):
    """Internal: the run is parked `waiting` until its due time (a durable
    sleep, a retry's back-off); this execution is over. A BaseException so
    `except Exception` in a workflow body does not swallow it."""


# Ends of a run that are decided by the run itself, whatever the body does
# with them: once raised, every later step call raises the same again.
HALTS = (Terminal, EffectUncertain, LostClaim, WorkflowCodeError, Drain, Parked)


class DatabaseRefused(EverystepError):
    """The database answers, and what it answers will not change by trying
    again: a process refuses to run (one line, no retry)."""


class NewerSchema(DatabaseRefused):
    """The database was migrated by a newer everystep: it has migrations this
    code does not know. Refused unless the newer schema is declared
    compatible (`--allow-newer-schema`, `database.allow_newer_schema`)."""


class NoSuchDatabase(DatabaseRefused):
    """The server answers that the URL's database or role does not exist."""
