"""everystep: durable workflows for Python on PostgreSQL."""

from everystep import schedules  # the schedules API: everystep.schedules.put(...)
from everystep.api import (
    ScheduledRun,
    parallel,
    resolve_step,
    schedule,
    schedule_many,
    step,
    transaction,
    use,
    workflow,
)
from everystep.context import Outcome, RunContext, current
from everystep.errors import (
    EffectUncertain,
    EverystepError,
    LostClaim,
    StepFailure,
    Terminal,
    WorkflowCodeError,
)
from everystep.serde import decode_exception, encode_exception

__all__ = [
    "EffectUncertain",
    "EverystepError",
    "LostClaim",
    "Outcome",
    "RunContext",
    "ScheduledRun",
    "StepFailure",
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
