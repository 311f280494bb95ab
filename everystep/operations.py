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

`bulk` acts on every run a filter finds (workflow, status, attributes, time),
however many: the same functions, chunk by chunk, each chunk its own
transaction with the action's progress, so that it is resumed after an
interruption and acts on no run twice.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import time
import uuid
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import psycopg

from everystep import api, db, liveness, reruns, scheduler, serde
from everystep import attributes as run_attributes
from everystep.connections import bound_connection
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


# ---------------------------------------------------------------- bulk actions by filter

BULK_ACTIONS = ("cancel", "requeue", "rerun", "resolve-step")
# Runs per chunk, each chunk its own transaction: its actions, their audit
# records and the action's progress commit together. 100 keeps a chunk's
# transaction to some tens of milliseconds and its row locks to 100 runs (the
# claim skips them, SKIP LOCKED), while the per-chunk costs (finding the
# next runs, writing the progress) stay under a few percent of the work.
BULK_CHUNK = 100
BULK_SAMPLE = 20  # the run ids a preview shows
# After each chunk a bulk action waits this many times as long as the chunk
# took: on a database that is busy with the workers too, it takes about half
# of what it would alone, and leaves them the rest (w1 during a 100,000-run
# bulk cancel: 0.68 of w1 alone without the pause, on 2 cores).
BULK_PAUSE = 1.0
_FILTER_KEYS = ("workflow", "status", "attributes", "since", "until")


class BulkOutcome(NamedTuple):
    """What `bulk` found, and did."""

    action: str
    filter: dict  # the filter as given, JSON-ready (datetimes as ISO 8601)
    count: int  # the runs the filter found (a resumed action: when it first started)
    sample: list[uuid.UUID]  # the newest BULK_SAMPLE of them, newest first
    dry_run: bool  # True: nothing was written
    done: int  # the runs acted on (0 in a dry run)
    refused: int  # the runs left as they were (ended already, a live claimer, ...), each for its reason
    resumed: bool  # an interrupted action of the same action, arguments and filter was carried on


def bulk(action: str, filter: dict, dry_run: bool = True, actor: Actor | str | None = None, *,
         conn: psycopg.Connection | None = None, reason: str | None = None, from_step: str | None = None,
         step: str | None = None, result: Any = _UNSET, error: str | None = None, discard: bool = False,
         chunk: int = BULK_CHUNK, pause: float = BULK_PAUSE) -> BulkOutcome:
    """Act on every run `filter` finds: `action` is "cancel" (`reason=`),
    "requeue", "rerun" (`from_step=`, required) or "resolve-step" (`step=`
    and exactly one of `result=`, `error=`, `discard=True`). `filter` has
    one or more of: workflow (module.qualname), status (one or a list),
    attributes (a dict, values compared as text), since and until (aware
    datetimes, on the creation time). A dry run (the default) only counts
    and samples. Otherwise the runs are taken newest first in chunks of
    `chunk`, each in its own transaction with its audit records and the
    action's progress (everystep_bulk), so an interrupted action, asked
    again with the same arguments, carries on where it stopped and acts on
    no run twice; runs created after it started are left alone. One audit
    record (`bulk-<action>`) says who, the filter, the count and the outcome.
    After each chunk it waits `pause` times as long as the chunk took (0:
    not at all), leaving the database to the workers meanwhile.
    `actor`: an Actor, or a name (source "api"; None: user@host).
    `conn`: a psycopg connection outside a transaction (each chunk commits),
    else the one bound with everystep.use. Bad input is an EverystepError
    with nothing written."""
    how = _bulk_arguments(action, reason, from_step, step, result, error, discard)
    given = _bulk_filter(filter)
    f = run_attributes.run_filter(f"bulk({action!r})", **given)
    if type(chunk) is not int or not 1 <= chunk <= 10_000:
        raise EverystepError(f"bulk(): chunk is a whole number from 1 to 10000, not {chunk!r:.40}")
    if not isinstance(pause, int | float) or isinstance(pause, bool) or not 0 <= pause <= 100:
        raise EverystepError(f"bulk(): pause is a number from 0 to 100, not {pause!r:.40}")
    who = actor if isinstance(actor, Actor) else Actor(actor or api._local_actor(), "api")
    conn = _bulk_connection(conn)
    shown = {key: value.isoformat() if isinstance(value, datetime.datetime) else value
             for key, value in given.items() if value is not None}
    count = db.count_runs(conn, f)
    sample = [row["id"] for row in db.find_runs(conn, f, BULK_SAMPLE)]
    conn.commit()  # the reads' transaction (a non-autocommit connection) ends before the chunks'
    if dry_run:
        return BulkOutcome(action, shown, count, sample, True, 0, 0, False)
    key = json.dumps({"action": action, "filter": shown, "arguments": how}, sort_keys=True, default=str)
    with conn.transaction():
        progress = db.open_bulk(conn, key, action, json.dumps(shown), who.name, who.source, count,
                                sample[0] if sample else None)
    done, refused = progress.done, progress.refused
    while True:
        began = time.monotonic()
        with conn.transaction():
            at = db.lock_bulk(conn, progress.id)
            if at.finished:  # another process resuming it finished it
                done, refused = at.done, at.refused
                break
            runs = [row["id"] for row in db.runs_in_order(conn, f, chunk, at.cursor, progress.upto)]
            if not runs:
                done, refused = db.finish_bulk(conn, progress.id)
                db.audit(conn, who.name, who.source, f"bulk-{action}", target=json.dumps(shown)[:300], details={
                    "filter": shown, "arguments": how, "count": progress.total, "done": done, "refused": refused,
                    "outcome": "done", "bulk": progress.id})
                break
            acted, left = _bulk_chunk(conn, who, action, runs, how)
            db.advance_bulk(conn, progress.id, runs[-1], acted, left)
        time.sleep((time.monotonic() - began) * pause)
    return BulkOutcome(action, shown, progress.total, sample, False, done, refused, progress.resumed)


def _bulk_arguments(action: Any, reason: Any, from_step: Any, step: Any, result: Any, error: Any,
                    discard: Any) -> dict:
    """The action's own arguments, checked, as JSON-ready values."""
    if action not in BULK_ACTIONS:
        raise EverystepError(f"bulk(): the action is one of {', '.join(BULK_ACTIONS)}, not {action!r:.60}")
    extra = {"reason": reason, "from_step": from_step, "step": step, "error": error}
    allowed = {"cancel": {"reason"}, "requeue": set(), "rerun": {"from_step"}, "resolve-step": {"step", "error"}}
    wrong = [name for name, value in extra.items() if value is not None and name not in allowed[action]]
    if wrong or (action != "resolve-step" and (result is not _UNSET or discard)):
        raise EverystepError(f"bulk({action!r}) takes no {(wrong or ['result/discard'])[0]}=")
    if action == "cancel":
        return {"reason": reason}
    if action == "rerun":
        if not isinstance(from_step, str) or not from_step:
            raise EverystepError("bulk('rerun') takes from_step=, the step id to run again, e.g. '3' or 'charge'")
        return {"from_step": from_step}
    if action == "resolve-step":
        if not isinstance(step, str) or not step:
            raise EverystepError("bulk('resolve-step') takes step=, the id of the started step, e.g. 'charge'")
        if (result is not _UNSET) + (error is not None) + bool(discard) != 1:
            raise EverystepError("bulk('resolve-step') takes exactly one of result=, error= or discard=True")
        if discard:
            return {"step": step, "discard": True}
        if error is not None:
            return {"step": step, "error": str(error)}
        serde.dumps(result)  # an unserializable result is refused before anything is written
        return {"step": step, "result": serde.to_json(result)}
    return {}


def _bulk_filter(filter: Any) -> dict:
    """The filter's conditions by name; none at all is refused (a bulk action
    on every run is never what an operator meant)."""
    if not isinstance(filter, dict):
        raise EverystepError(f"bulk() takes a filter dict, e.g. {{'attributes': {{'tenant': 'acme'}}}}, "
                             f"not {filter!r:.80}")
    unknown = [key for key in filter if key not in _FILTER_KEYS]
    if unknown:
        raise EverystepError(f"bulk(): unknown filter key {unknown[0]!r}; the keys are {', '.join(_FILTER_KEYS)}")
    given = {key: filter.get(key) for key in _FILTER_KEYS}
    if all(value is None for value in given.values()):
        raise EverystepError("bulk() refuses an empty filter: give workflow, status, attributes, since or until")
    return given


def _bulk_connection(conn: Any) -> psycopg.Connection:
    conn = conn or bound_connection()
    if not isinstance(conn, psycopg.Connection):
        raise EverystepError("bulk() needs a psycopg connection: pass conn= or bind one with everystep.use(conn)")
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        raise EverystepError("bulk() commits chunk by chunk: give it a connection outside a transaction")
    return conn


def _bulk_chunk(conn: psycopg.Connection, who: Actor, action: str, runs: list[uuid.UUID],
                how: dict) -> tuple[int, int]:
    """One chunk's actions (each run's audit record with it): (done, refused)."""
    if action == "cancel":
        done, refused = cancel(conn, who, runs, how["reason"], all_or_nothing=False)
    elif action == "requeue":
        done, refused = requeue(conn, who, runs, all_or_nothing=False)
    elif action == "rerun":
        done, refused = rerun_many(conn, who, runs, how["from_step"], all_or_nothing=False)
    else:
        outcome = {key: serde.from_json(value) if key == "result" else value
                   for key, value in how.items() if key != "step"}
        done, refused = [], []
        for run in runs:
            try:
                done.append(resolve_step(conn, who, run, how["step"], **outcome))
            except Refused as why:
                refused.append(why)
    return len(done), len(refused)
