"""What the data layer's functions take and return: one NamedTuple per
kind of row, so that nothing positional leaves the layer. Rows read whole
(a run, a schedule, a page of the UI) are dicts keyed by column name."""

from __future__ import annotations

import datetime
import uuid
from typing import Any, NamedTuple

import psycopg

# ---------------------------------------------------------------- claims


class ClaimedRun(NamedTuple):
    id: uuid.UUID
    name: str
    args: Any  # stored JSON, not yet decoded
    steps: list  # [[step_id, name, status, result, error, attempts], ...] as stored
    token: int  # the execution token of this claim
    cancel_requested: bool = False  # a cancel request was on the run when it was claimed
    claimed_at: float = 0.0  # the database's time of the claim (epoch seconds)
    slot: int | None = None  # the concurrency slot it was claimed into (None: an unlimited workflow)
    parent: uuid.UUID | None = None  # the run that started it as a child


class Claim(NamedTuple):
    """A run held by a claimer, as its row says: which run, which execution."""
    id: uuid.UUID
    token: int | None  # None: claimed before execution tokens existed


# ---------------------------------------------------------------- step rows and ends of runs


class StepRow(NamedTuple):
    """A step row as the runner writes it: JSON as text, times as epoch seconds."""
    step_id: str
    name: str
    args: str
    kwargs: str
    status: str  # done, failed, or started (an unsafe step's mark)
    result: str | None
    error: str | None
    started_at: float
    finished_at: float | None  # None while `started`


class Written(NamedTuple):
    """A fenced step write went through; the run's row said whether a cancel
    is requested (learnt with the write, at no extra round trip)."""
    cancel_requested: bool


class Attempt(NamedTuple):
    cancel_requested: bool
    attempt: dict  # {"attempt": n, "error": {...}, "at": epoch, "retry_at": epoch}, database time


class StepWrite(NamedTuple):
    """One step row of a group commit (record_steps), fenced by its execution's token."""
    run: uuid.UUID
    token: int
    row: StepRow


class EndWrite(NamedTuple):
    """One end of a run of a group commit (end_runs), fenced by its execution's token."""
    run: uuid.UUID
    token: int
    status: str
    result: str | None
    error: str | None
    last_step: StepRow | None
    claim: int  # successors to claim: 1 for the slot this end frees, 2 with one claimed ahead (a bool: 0 or 1)
    # Outcomes of its earlier steps not written yet (HeldRun.boundary carried
    # them): written in the end's transaction, before it.
    earlier: tuple[StepRow, ...] = ()


class BatchEnd(NamedTuple):
    status: str | None  # the run's end as written; None: not written (see why_not_written)
    step_exists: bool  # not written because its last step's row is there already
    successor: ClaimedRun | None  # claimed for this slot (it is this execution's to run, even if status is None)
    ahead: ClaimedRun | None = None  # the second successor, when the end asked for two


class EndedRuns(NamedTuple):
    finished: list[BatchEnd]  # for each end
    released: int = 0  # runs these ends released (their last dependency completed: everystep.dags)


class Ended(NamedTuple):
    status: str  # the run's end as written: `cancelled` when a cancel request was on the row
    claimed: list[ClaimedRun]  # the successor claimed for the slot, if any


class TracedExecution(NamedTuple):
    context: dict  # the run's stored trace context
    number: int  # which traced execution of the run this is (1, 2, ...)


class StepState(NamedTuple):
    name: str
    status: str


# ---------------------------------------------------------------- time, waits, messages


class Sleep(NamedTuple):
    wake_at: float  # epoch seconds, database time
    now: float  # the database's time of the write


class CancelDelivery(NamedTuple):
    """The cancel a running body is about to get (everystep.db.deliver_cancel)."""
    reason: str | None
    deadline: bool  # its deadline passed, with no request: 'deadline' was written as its request here


class Deadline(NamedTuple):
    """A run's deadline as schedule() is given it: the earliest of `at`, `in_`
    seconds from now and `timeout` seconds from its due time (each None: not
    that one)."""
    at: datetime.datetime | None = None
    in_: float | None = None
    timeout: float | None = None


NO_DEADLINE = Deadline()


class Parking(NamedTuple):
    parked: bool  # the run is `waiting` until its due time; this execution is over
    cancel_requested: bool  # not parked: a cancel request is on the run
    # neither: the time has come already (by the database's clock)


class Wait(NamedTuple):
    """The answer of a fenced write about a wait (truthy: the run is held)."""
    result: Any  # the wait's recorded result (JSON data), None while nothing came
    wakes: int  # the run's message count as this statement saw it
    now: float  # the database's time (epoch seconds)


class Sent(NamedTuple):
    status: str | None  # the run's status; None: no such run
    created: bool  # this call stored the message (False: terminal run, or the key sent it already)


class EventValue(NamedTuple):
    status: str | None  # the run's status; None: no such run
    found: bool  # the event is set
    value: Any  # its value as JSON data


# ---------------------------------------------------------------- scheduling and control


class Scheduled(NamedTuple):
    id: uuid.UUID
    created: bool  # False: an existing run of the same (name, idempotency key)


class CancelOutcome(NamedTuple):
    status: str | None  # the run's status after the call; None: no such run
    changed: bool  # this call cancelled it, or requested its cancel


# ---------------------------------------------------------------- observability and the UI


class QueueStats(NamedTuple):
    pending: int  # claimable now: scheduled, or waiting and due
    running: int
    blocked: int
    oldest_pending_age_seconds: float  # database time; 0 when nothing is pending
    waiting: int = 0  # waiting for their time (delayed starts, sleeps, retry back-offs)


class TableHealth(NamedTuple):
    table: str
    live_tuples: int
    dead_tuples: int
    last_autovacuum: float | None  # Unix time; None: never (since the statistics were reset)
    last_vacuum: float | None  # the last vacuum of any kind (manual or auto)


class VacuumHorizon(NamedTuple):
    oldest_xmin_age_seconds: float  # the oldest transaction or snapshot holding back vacuum (0: none)
    oldest_xmin_age_xids: int  # the oldest xmin's age in transaction ids (slots and prepared ones included)
    idle_in_transaction_seconds: float  # the longest idle-in-transaction session (0: none)


class RunFilter(NamedTuple):
    """What the UI's run list is narrowed by; None: no condition."""

    status: str | None = None
    workflow: str | None = None
    since: datetime.datetime | None = None  # created at or after
    until: datetime.datetime | None = None  # created before
    run_id: uuid.UUID | None = None
    idempotency_key: str | None = None
    args_contain: str | None = None  # JSON text: args @> it
    before: tuple[datetime.datetime, uuid.UUID] | None = None  # keyset cursor: (created_at, id) of the last row shown
    attributes_contain: str | None = None  # JSON text: attributes @> it (0022)


def dicts(cur: psycopg.Cursor) -> list[dict]:
    """A result's rows as dicts keyed by column name."""
    names = [c.name for c in cur.description]
    return [dict(zip(names, row)) for row in cur]


class Server(NamedTuple):
    """Which PostgreSQL server a session talks to. Any change of it (a
    restart, a failover to a standby, a promotion under an open session)
    means the advisory locks held on the previous one are gone."""
    system_identifier: int  # the cluster's (a physical standby shares its primary's)
    started_at: datetime.datetime  # the postmaster's start: differs between servers, and across restarts
    timeline: int | None  # the WAL timeline of a primary (a promotion starts a new one); None: in recovery


class TokenTake(NamedTuple):
    """A rate limit's answer to a step asking for a token."""
    wait: float  # 0.0: taken; else the seconds until the next one is due
    now: float  # the engine's time then (epoch seconds)
    taken_at: float | None  # when it was taken, by the server's clock (epoch seconds); None: not taken


# ---------------------------------------------------------------- streams (0023)


class StreamEntryRow(NamedTuple):
    """One stream entry as an execution writes it (value None: the close)."""
    key: str
    offset: int
    value: str | None  # the value's JSON (the extended codec)
    step_id: str | None  # the body call's id, or the step's that wrote it
    attempt: int | None  # None from the body; else the step's try


class StreamWrite(NamedTuple):
    """One execution's stream entries of a group commit (write_streams), fenced by its token."""
    run: uuid.UUID
    token: int
    entries: list[StreamEntryRow]


class StreamState(NamedTuple):
    """A run's streams as an execution finds them before it writes."""
    next_offsets: dict[str, int]  # by key
    closed: set[str]
    body_writes: dict[str, int]  # the offset each body call wrote, by its id


class StreamLook(NamedTuple):
    """A reader's look at a stream (read_stream)."""
    status: str | None  # the run's; None: no such run
    entries: list[tuple]  # (offset, value's JSON text, is the close, step_id, attempt, claim_token)
