"""The operators' actions, written once for both front ends (the `everystep`
CLI and the web UI): resolving the started step of a blocked run, requeueing
runs whose claimer is dead, cancelling runs, scheduling runs again, and
pausing, resuming or firing a recurring schedule.

Each action does its database work and writes its record in the audit trail
(everystep_audit) in one transaction, through the data layer: the change and its
record commit together, or neither does. Each returns a typed result that the
front ends render their own way. A refusal writes nothing: a single-target
action raises `Refused` (`NotFound` for a run, step or schedule that does not
exist); an action on several runs returns the runs it refused, with why.

An action on several runs is all or nothing by default (the CLI's commands:
one refusal refuses the whole action, and nothing is written). With
`all_or_nothing=False` (the UI's bulk actions, up to a whole filter) it acts on
every run it can and reports the others; what it did still commits in one
transaction, with its audit records.
"""

from __future__ import annotations

import contextlib
import datetime
import uuid
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import psycopg

from everystep import api, db, liveness, reruns, scheduler, serde
from everystep.errors import EverystepError
from everystep.ids import uuid7
from everystep.schema import TERMINAL, RunStatus

_UNSET: Any = object()  # resolve_step's "no result given" (None is a result)


class Actor(NamedTuple):
    """Who acts, as the audit trail records it."""

    name: str  # the CLI: user@host; the UI: operator, local, or the Django user
    source: str  # "cli" or "ui"


class Refused(EverystepError):
    """The action was refused; nothing was written."""


class NotFound(Refused):
    """The run, step or schedule named does not exist; nothing was written."""


class Refusal(NamedTuple):
    """A run an action on several runs left as it was."""

    run: uuid.UUID
    status: str | None  # its status; None: there is no such run
    why: str  # one sentence, naming the run


def _unknown(run: uuid.UUID) -> Refusal:
    return Refusal(run, None, f"no run {run}")


def _runs(runs: Iterable[uuid.UUID]) -> list[uuid.UUID]:
    return list(dict.fromkeys(runs))  # in order, each once


# ---------------------------------------------------------------- resolve-step

class Resolved(NamedTuple):
    run: uuid.UUID
    step: str
    outcome: str  # "result", "error" or "discard"
    value: Any  # the result recorded, the error's message, or None (discarded)


def resolve_step(conn: psycopg.Connection, actor: Actor, run: uuid.UUID, step: str, *, result: Any = _UNSET,
                 error: str | None = None, discard: bool = False) -> Resolved:
    """Say what happened to the `started` step of a blocked run (exactly one
    of `result=`, `error=`, `discard=True`, as `everystep.resolve_step`), and
    put the run back to `scheduled`. Raises NotFound for an unknown run or
    step, Refused for a run that is not blocked or a step that is not started."""
    if (result is not _UNSET) + (error is not None) + bool(discard) != 1:
        raise EverystepError("resolve_step takes exactly one of result=, error= or discard=True")
    if discard:
        outcome, value, how = "discard", None, {"discard": True}
    elif error is not None:
        outcome, value, how = "error", error, {"error": error}
    else:
        outcome, value, how = "result", result, {"result": result}
    with conn.transaction():
        if db.load_run(conn, run) is None:
            raise NotFound(f"no run {run}")
        if db.step_row(conn, run, step) is None:
            raise NotFound(f"run {run} has no step {step!r}")
        try:
            api.resolve_step(conn, run, step, **how)
        except EverystepError as refused:
            raise Refused(str(refused)) from None
        db.audit(conn, actor.name, actor.source, "resolve-step", run=run, step_id=step,
                    details={name: serde.to_json(given) for name, given in how.items()})
    return Resolved(run, step, outcome, value)


# ---------------------------------------------------------------- requeue

class RequeuedRun(NamedTuple):
    run: uuid.UUID
    claimer: str | None  # the dead claimer it was taken from; None: it had none


class Requeued(NamedTuple):
    done: list[RequeuedRun]
    refused: list[Refusal]


def requeue(conn: psycopg.Connection, actor: Actor, runs: Iterable[uuid.UUID], *,
            all_or_nothing: bool = True) -> Requeued:
    """Put `running` runs whose claimer is dead back to `scheduled`. A claimer
    is dead when its lock can be taken (one look: no grace); the locks are
    held while the runs are requeued, so no claimer comes back meanwhile, and
    each run is requeued only if it is still claimed by the claimer found dead."""
    runs = _runs(runs)
    found = {run: db.load_run(conn, run) for run in runs}
    claimers = {row["claimed_by"] for row in found.values() if row is not None and row["status"] == RunStatus.RUNNING}
    with liveness.dead_claimers_locked(conn, claimers) as dead:
        refused = [refusal for run in runs if (refusal := _not_requeued(run, found[run], dead))]
        if refused and all_or_nothing:
            return Requeued([], refused)
        left = {refusal.run for refusal in refused}
        chosen = [found[run] for run in runs if run not in left]
        with conn.transaction() as transaction:
            requeued = set(db.requeue_from_dead_claimers(conn, [(row["id"], row["claimed_by"]) for row in chosen]))
            done = [RequeuedRun(row["id"], row["claimed_by"]) for row in chosen if row["id"] in requeued]
            refused += [Refusal(row["id"], RunStatus.RUNNING, f"run {row['id']} changed while being requeued")
                        for row in chosen if row["id"] not in requeued]
            if refused and all_or_nothing:
                raise psycopg.Rollback(transaction)
            for each in done:
                db.audit(conn, actor.name, actor.source, "requeue", run=each.run, details={"claimer": each.claimer})
    return Requeued([] if refused and all_or_nothing else done, refused)


def _not_requeued(run: uuid.UUID, row: dict | None, dead: set[str | None]) -> Refusal | None:
    """Why a run is not requeued; None when it is requeued."""
    if row is None:
        return _unknown(run)
    status = row["status"]
    if status == RunStatus.RUNNING:
        if row["claimed_by"] in dead:
            return None
        why = f"is running on {row['claimed_by']}, which holds its lock: the claimer is alive"
    elif status == RunStatus.SCHEDULED:
        why = "is scheduled: it needs nothing, a worker will claim it"
    elif status == RunStatus.WAITING:
        why = f"is waiting for its time ({_utc(row['due_at'])}): a worker will claim it then"
    elif status == RunStatus.BLOCKED:
        why = "is blocked: resolve its started step with `everystep resolve-step`"
    elif status in TERMINAL:
        why = f"is {status}: a finished run is never requeued; schedule it again"
    else:
        why = f"is {status}, not running"
    return Refusal(run, status, f"run {run} {why}")


def _utc(moment: datetime.datetime) -> str:
    return moment.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---------------------------------------------------------------- cancel

class CancelledRun(NamedTuple):
    run: uuid.UUID
    status: str  # cancelled now; running: asked to stop, it ends cancelled at its next step


class Cancelled(NamedTuple):
    done: list[CancelledRun]
    refused: list[Refusal]  # unknown runs, runs that had ended (cancelled too), runs asked to stop already


def cancel(conn: psycopg.Connection, actor: Actor, runs: Iterable[uuid.UUID], reason: str | None = None, *,
           all_or_nothing: bool = True) -> Cancelled:
    """Cancel runs, as `everystep.cancel` does: a scheduled, waiting or blocked
    run is `cancelled` at once, a running one is asked to stop at its next
    step (a parent's cancel reaches its unfinished children); `reason` is
    recorded with each and given to its `Cancelled`."""
    done, refused = [], []
    with conn.transaction() as transaction:
        for run in _runs(runs):
            outcome = db.cancel_run(conn, run, reason)
            status = outcome.status
            if status is None:
                refused.append(_unknown(run))
            elif outcome.changed:
                done.append(CancelledRun(run, status))
            elif status == RunStatus.RUNNING:
                refused.append(Refusal(run, status, f"run {run} was asked to stop already: it ends cancelled at "
                                                    "its next step"))
            else:
                refused.append(Refusal(run, status, f"run {run} is {status} already"))
        if refused and all_or_nothing:
            raise psycopg.Rollback(transaction)
        for each in done:
            db.audit(conn, actor.name, actor.source, "cancel", run=each.run,
                        details={"reason": reason, "status": each.status})
    return Cancelled([] if refused and all_or_nothing else done, refused)


# ---------------------------------------------------------------- schedule again

class RescheduledRun(NamedTuple):
    run: uuid.UUID  # the run scheduled again
    new: uuid.UUID  # the new run: the same workflow and args, no idempotency key


class Rescheduled(NamedTuple):
    done: list[RescheduledRun]
    refused: list[Refusal]  # unknown runs


def reschedule(conn: psycopg.Connection, actor: Actor, runs: Iterable[uuid.UUID], *,
               all_or_nothing: bool = True) -> Rescheduled:
    """Schedule a new run of each run's workflow with its args, whatever its
    status; the audit record is the new run's, from the old one."""
    done, refused = [], []
    with conn.transaction() as transaction:
        for run in _runs(runs):
            new = db.ui_reschedule(conn, run, uuid7())
            if new is None:
                refused.append(_unknown(run))
            else:
                done.append(RescheduledRun(run, new))
        if refused and all_or_nothing:
            raise psycopg.Rollback(transaction)
        for each in done:
            db.audit(conn, actor.name, actor.source, "schedule-again", run=each.new,
                        details={"from_run": str(each.run)})
    return Rescheduled([] if refused and all_or_nothing else done, refused)


# ---------------------------------------------------------------- re-run from a step

class Rerun(NamedTuple):
    run: uuid.UUID  # the run re-run
    new: uuid.UUID  # the re-run: rerun_of = run
    from_step: str
    copied: list[str]  # the step ids whose recorded outcomes were copied


def rerun(conn: psycopg.Connection, actor: Actor, run: uuid.UUID, from_step: str) -> Rerun:
    """Schedule a re-run of an ended run from one of its steps (everystep.rerun):
    the steps before it are copied, it and what follows execute. NotFound for
    an unknown run or step; Refused for a run in flight or an unsafe step
    before it whose outcome is unknown."""
    with conn.transaction():
        try:
            new, copied = reruns.rerun_in(conn, run, from_step, actor.name, actor.source)
        except reruns.RerunNotFound as unknown:
            raise NotFound(str(unknown)) from None
        except reruns.RerunRefused as refused:
            raise Refused(str(refused)) from None
    return Rerun(run, new, from_step, copied)


class Reruns(NamedTuple):
    done: list[Rerun]
    refused: list[Refusal]


def rerun_many(conn: psycopg.Connection, actor: Actor, runs: Iterable[uuid.UUID], from_step: str, *,
               all_or_nothing: bool = True) -> Reruns:
    """`rerun` of several runs from the same step id, in one transaction (the
    runs that failed on one bug): all or nothing by default; with
    `all_or_nothing=False` every run that can be is re-run and the others
    are reported."""
    done, refused = [], []
    with conn.transaction() as transaction:
        for run in _runs(runs):
            try:
                new, copied = reruns.rerun_in(conn, run, from_step, actor.name, actor.source)
            except reruns.RerunRefused as why:
                refused.append(Refusal(run, None if isinstance(why, reruns.RerunNotFound) else "refused", str(why)))
                continue
            done.append(Rerun(run, new, from_step, copied))
        if refused and all_or_nothing:
            raise psycopg.Rollback(transaction)
    return Reruns([] if refused and all_or_nothing else done, refused)


# ---------------------------------------------------------------- send a message

def send_message(conn: psycopg.Connection, actor: Actor, run: uuid.UUID, topic: str, payload: Any) -> None:
    """Send a message to a run (everystep.send: its wait_for(topic) returns
    it), audited (`send`, with the topic and the payload). Refused, writing
    nothing, for an unknown or finished run or a bad topic."""
    with conn.transaction():
        try:
            api.send(run, topic, payload, conn=conn)
        except EverystepError as refused:
            text = str(refused).removeprefix("send(): ")
            raise (NotFound if text.startswith("no run") else Refused)(text) from None
        db.audit(conn, actor.name, actor.source, "send", run=run, target=topic,
                 details={"topic": topic, "payload": serde.to_json(payload)})


# ---------------------------------------------------------------- recurring schedules

def pause_schedule(conn: psycopg.Connection, actor: Actor, key: str) -> None:
    """Pause a live schedule (until the next `schedules apply` writes the file's value)."""
    _set_schedule_paused(conn, actor, key, True)


def resume_schedule(conn: psycopg.Connection, actor: Actor, key: str) -> None:
    """Resume a live schedule from its next fire time: the time spent paused is not caught up."""
    _set_schedule_paused(conn, actor, key, False)


def _set_schedule_paused(conn: psycopg.Connection, actor: Actor, key: str, paused: bool) -> None:
    with conn.transaction(), _schedule_refused():
        db.ui_set_schedule_paused(conn, key, paused, lambda row: scheduler.next_fire_time(
            row["cron"], row["timezone"], row["database_now"]))
        db.audit(conn, actor.name, actor.source, "schedule-pause" if paused else "schedule-resume", target=key)


def fire_schedule(conn: psycopg.Connection, actor: Actor, key: str) -> uuid.UUID:
    """Schedule a run of a live schedule now, outside its cron times; returns the run."""
    with conn.transaction(), _schedule_refused():
        run = db.fire_schedule_now(conn, key, uuid7())
        db.audit(conn, actor.name, actor.source, "schedule-fire", run=run, target=key)
    return run


@contextlib.contextmanager
def _schedule_refused() -> Iterator[None]:
    """The data layer's refusal of a schedule it does not have, as NotFound."""
    try:
        yield
    except db.ScheduleRefused as refused:
        raise NotFound(str(refused)) from None
