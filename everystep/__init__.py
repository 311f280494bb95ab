"""everystep: durable workflows for Python on PostgreSQL."""

from everystep import schedules  # the schedules API: everystep.schedules.put(...)
from everystep.api import (
    ScheduledRun,
    cancel,
    parallel,
    resolve_step,
    schedule,
    schedule_many,
    sleep,
    sleep_until,
    step,
    transaction,
    use,
    workflow,
)
from everystep.context import Outcome, RunContext, current
from everystep.errors import (
    Cancelled,
    EffectUncertain,
    EverystepError,
    LostClaim,
    StepFailure,
    Terminal,
    WorkflowCodeError,
)
from everystep.retries import Backoff
from everystep.serde import decode_exception, encode_exception

__all__ = [
    "Backoff",
    "Cancelled",
    "EffectUncertain",
    "EverystepError",
    "LostClaim",
    "Outcome",
    "RunContext",
    "ScheduledRun",
    "StepFailure",
    "cancel",
    "sleep",
    "sleep_until",
    "Terminal",
    "WorkflowCodeError",
    "current",
    "decode_exception",
    "encode_exception",
    "parallel",
    "resolve_step",
    "schedule",
    "schedule_many",
    "schedules",
    "step",
    "transaction",
    "use",
    "workflow",
]
