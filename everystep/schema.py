"""The data model's names and bounds, as the migrations define them: the
statuses a run and a step row can have, and the widths of the text columns.
Plain strings (not an Enum), so they go into SQL parameters as they are."""

from __future__ import annotations


class RunStatus:
    """everystep_workflow.status"""
    SCHEDULED = "scheduled"  # claimable now
    WAITING = "waiting"  # claimable at its due_at: a delayed start, a sleep, a wait for a message or a child
    RUNNING = "running"  # claimed by a worker (claimed_by, claim_token)
    COMPLETED = "completed"
    FAILED = "failed"
    STOPPED = "stopped"  # a step raised Terminal
    BLOCKED = "blocked"  # an unsafe step started without a recorded outcome
    CANCELLED = "cancelled"


class StepStatus:
    """everystep_step.status"""
    DONE = "done"
    FAILED = "failed"
    STARTED = "started"  # an unsafe step's mark, or a wait not ended yet
    RETRYING = "retrying"  # a failed attempt, another one to come


# The ends of a run: nothing changes it any more (but `everystep prune`).
TERMINAL = (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.STOPPED, RunStatus.CANCELLED)

MAX_NAME = 300  # a workflow's or a step's module.qualname
MAX_STEP_ID = 300  # a step id, the whole dotpath
MAX_KEY = 255  # an idempotency key, a runner name (claimed_by), a concurrency key, a rate limit's name
MIN_PRIORITY, MAX_PRIORITY = -100, 100  # a run's priority (Django's tasks API's range): higher runs first

# The bound of a run's step calls (steps, sleeps, waits, forks, ...; replayed
# ones included) unless @workflow(max_steps=) says otherwise: generous, for a
# body that loops for ever.
DEFAULT_MAX_STEPS = 100_000
MAX_ATTRIBUTES = 20  # a run's attributes (0022): keys, each at most 64 characters, scalar values of at most 256
