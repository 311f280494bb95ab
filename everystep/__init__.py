"""everystep: durable workflows for Python on PostgreSQL."""

from everystep.api import (
    ScheduledRun,
    cancel,
    get_event,
    parallel,
    patched,
    resolve_step,
    schedule,
    send,
    set_event,
    sleep,
    sleep_until,
    step,
    transaction,
    use,
    wait_for,
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
from everystep.runner import Backoff
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
    "get_event",
    "sleep",
    "sleep_until",
    "Terminal",
    "WorkflowCodeError",
    "current",
    "decode_exception",
    "encode_exception",
    "parallel",
    "patched",
    "resolve_step",
    "schedule",
    "send",
    "set_event",
    "step",
    "transaction",
    "use",
    "wait_for",
    "workflow",
]
