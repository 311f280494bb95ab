"""Recurring schedules (SPEC section 10): plan and apply the manifest, and
the tick that fires what is due.

The clock is the database's: `now()` of the server, never the host's. A tick
holds a transaction-level advisory lock, so exactly one scheduler fires at a
time across the fleet, and every firing inserts a run as `everystep.schedule()`
does, with the stored args as they are, and with the idempotency key
`schedule:<key>:<fire time in UTC>` in the same transaction that advances
the schedule: a fire time can never produce two runs, even across a failover.

Which fire times fire. At each tick, the due fire times of a schedule are
those from its next fire time up to now. One that is at most
`max_lateness_seconds` old is on time and fires. Older ones were missed (the
scheduler was down, the workflow was not importable, a run overlapped) and
the catch-up policy decides: `skip` fires none of them, `fire_once` fires the
latest, `fire_all` fires the latest `max_catchup` of them. With overlap
`forbid`, nothing fires while the schedule's previous run is scheduled,
running or blocked: its due times wait, and are judged as above once the run
has ended; then at most one run is made per tick. A paused schedule fires
nothing; un-pausing it (or changing its cron or time zone) starts again from
the next fire time after the apply.

Owners. Every schedule belongs to a source: the `source:` of the manifest
that applied it (default `deployment`), or the application's
(everystep.schedules, default `api`). A plan covers the keys of its own
source only, and refuses a key another source owns.

Auto-pause. A schedule with `auto_pause_after: N` pauses itself, at a tick,
once its latest N ended runs (made since its definition last changed) all
failed; it says why in the log once and on its row (`paused_reason`).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import uuid
import zoneinfo
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import psycopg
from croniter import croniter

from everystep import db, registry, serde
from everystep.ids import uuid7
from everystep.metrics import SCHEDULES_AUTO_PAUSED

log = logging.getLogger("everystep")

# The fields that make a schedule's definition, in the order plans show them.
DEFINITION = ("workflow", "args", "cron", "timezone", "catchup", "max_catchup", "overlap",
              "max_lateness_seconds", "paused", "auto_pause_after")
CATCHUP_POLICIES = ("skip", "fire_once", "fire_all")
OVERLAP_POLICIES = ("allow", "forbid")
DEFAULT_SOURCE = "deployment"  # the owner of a manifest that names none
API_SOURCE = "api"  # the owner of what everystep.schedules writes, unless told otherwise


@dataclass(frozen=True)
class Schedule:
    """A recurring schedule's definition: what each entry of the manifest
    (the `schedules:` section of everystep.yaml) becomes."""

    workflow: str  # module.qualname of an @workflow
    cron: str  # five fields, or @hourly, @daily, ...
    args: tuple = ()
    timezone: str = "UTC"
    catchup: str = "fire_once"  # skip | fire_once | fire_all
    max_catchup: int = 10  # fire_all: at most this many of the missed times
    overlap: str = "allow"  # allow | forbid
    max_lateness_seconds: float = 60.0  # a fire time reached later than this is missed
    paused: bool = False
    auto_pause_after: int | None = None  # pause after this many failed runs in a row; None: never


class Manifest(dict[str, Schedule]):
    """The schedules of one source, by key: the `schedules:` section of
    everystep.yaml. A dict, with the `source` that owns its keys."""

    def __init__(self, schedules: Mapping[str, Schedule] | None = None, source: str = DEFAULT_SOURCE):
        super().__init__(schedules or {})
        self.source = source

    def __repr__(self) -> str:
        return f"Manifest({dict(self)!r}, source={self.source!r})"


# ---------------------------------------------------------------- fire times

class Decision(NamedTuple):
    fire: list[datetime.datetime]  # the fire times to fire now, oldest first, in UTC
    next_fire_at: datetime.datetime  # the earliest fire time left undecided
    dropped_missed: bool  # some missed fire times were not fired (catch-up policy)


def next_fire_time(cron: str, timezone: str, after: datetime.datetime) -> datetime.datetime:
    """The first fire time strictly after `after`, in UTC."""
    zone = zoneinfo.ZoneInfo(timezone)
    return croniter(cron, after.astimezone(zone)).get_next(datetime.datetime).astimezone(datetime.UTC)


def decide(
    cron: str,
    timezone: str,
    next_fire_at: datetime.datetime,
    now: datetime.datetime,
    catchup: str,
    max_catchup: int,
    max_lateness_seconds: float,
    one_at_a_time: bool = False,
) -> Decision:
    """Which of the fire times from `next_fire_at` up to `now` fire now.

    Walks back from now, so a long downtime costs no more than the fire times
    it keeps. With `one_at_a_time` (overlap forbid) only the oldest of them
    fires, and the rest stay due."""
    keep_missed = {"skip": 0, "fire_once": 1, "fire_all": max_catchup}[catchup]
    on_time: list[datetime.datetime] = []
    missed: list[datetime.datetime] = []
    dropped = False
    # get_prev is strict: start just after now, so a fire time of exactly now counts.
    times = croniter(cron, (now + datetime.timedelta(microseconds=1)).astimezone(zoneinfo.ZoneInfo(timezone)))
    # In UTC: two times of one zone compare by wall clock, so the two 02:30s of
    # a daylight-saving fall-back would compare equal.
    while (fire_time := times.get_prev(datetime.datetime).astimezone(datetime.UTC)) >= next_fire_at:
        if (now - fire_time).total_seconds() <= max_lateness_seconds:
            on_time.append(fire_time)
        elif len(missed) < keep_missed:
            missed.append(fire_time)
        else:
            dropped = True
            break
    fire = sorted(missed + on_time)
    if one_at_a_time and fire:
        return Decision(fire[:1], next_fire_time(cron, timezone, fire[0]), dropped)
    return Decision(fire, next_fire_time(cron, timezone, now), dropped)


def idempotency_key(key: str, fire_time: datetime.datetime) -> str:
    return f"schedule:{key}:{iso_utc(fire_time)}"


def state_of(row: Mapping[str, Any]) -> str:
    """A schedule row's state: active, paused, auto-paused or retired."""
    if row["retired_at"] is not None:
        return "retired"
    if row["paused"]:
        return "auto-paused" if row["paused_reason"] else "paused"
    return "active"


def iso_utc(moment: datetime.datetime) -> str:
    """A moment as the idempotency keys, the log and the CLI write it."""
    return moment.astimezone(datetime.UTC).isoformat(timespec="seconds")


# ---------------------------------------------------------------- the tick

class Fired(NamedTuple):
    key: str
    fire_time: datetime.datetime
    run_id: uuid.UUID


def tick(conn: psycopg.Connection) -> list[Fired]:
    """Fire every due schedule, if no other scheduler is doing so right now.

    Call it every few seconds with an autocommit connection: it runs one
    transaction, holding the scheduler's advisory lock until it commits.
    Returns the runs it made."""
    fired: list[Fired] = []
    with conn.transaction():
        if not db.try_lock_scheduler(conn):
            return fired  # another scheduler is ticking
        for row in db.schedules_failing(conn):
            _auto_pause(conn, row)
        now = db.database_now(conn)
        for row in db.due_schedules(conn):
            fired += _fire_due(conn, row, now)
    return fired


def _fire_due(conn: psycopg.Connection, row: dict, now: datetime.datetime) -> list[Fired]:
    key = row["key"]
    if row["overlap"] == "forbid" and row["last_run_status"] not in (None, *db.TERMINAL):
        return []  # its previous run has not ended: the due times wait
    decision = decide(row["cron"], row["timezone"], row["next_fire_at"], now, row["catchup"],
                      row["max_catchup"], row["max_lateness_seconds"], one_at_a_time=row["overlap"] == "forbid")
    if decision.fire:
        try:
            registry.resolve(row["workflow"])  # fire only what is an @workflow now
        except Exception as exc:  # noqa: BLE001  (whatever importing the module raised)
            _cannot_fire(conn, row, f"cannot fire: workflow {row['workflow']}: {exc}", exc)
            return []
    try:
        with conn.transaction():  # a savepoint: one schedule's failure leaves the others' firings
            # The stored args go into the run as stored; they are decoded only to
            # check that the run will be able to (a bad value fails here, not in a run).
            serde.from_json(row["args"])
            fired = _fire(conn, key, row["workflow"], serde.dump_data(row["args"]), decision)
    except psycopg.OperationalError:
        raise
    except Exception as exc:  # noqa: BLE001  (kept on the schedule's row, and logged)
        _cannot_fire(conn, row, f"firing failed: {type(exc).__name__}: {exc}", exc)
        return []
    if decision.dropped_missed:
        log.warning("schedule %s: fire times missed before %s were not fired (catchup: %s)",
                    key, iso_utc(decision.fire[0] if decision.fire else decision.next_fire_at), row["catchup"],
                    extra={"schedule": key})
    return fired


def _fire(conn: psycopg.Connection, key: str, workflow: str, args_json: str, decision: Decision) -> list[Fired]:
    """Schedule a run for each fire time decided, as schedule() does (one
    insert each, in this transaction, keyed by the fire time)."""
    fired = []
    last_run_id = None
    timeout = registry.timeout_of(workflow)  # @workflow(timeout=), where this process can import it
    deadline = db.NO_DEADLINE if timeout is None else db.Deadline(timeout=timeout)
    for fire_time in decision.fire:
        run_id, created = db.insert_run(conn, uuid7(), workflow, args_json, idempotency_key(key, fire_time),
                                        deadline=deadline)
        last_run_id = run_id
        db.record_schedule_run(conn, key, fire_time, run_id)
        if created:
            fired.append(Fired(key, fire_time, run_id))
            log.info("schedule %s fired for %s: run %s", key, iso_utc(fire_time), run_id,
                     extra={"schedule": key, "run": str(run_id)})
        else:
            log.info("schedule %s: %s had already fired (run %s)", key, iso_utc(fire_time), run_id,
                     extra={"schedule": key, "run": str(run_id)})
    last_fire_at = decision.fire[-1] if decision.fire else None
    db.advance_schedule(conn, key, decision.next_fire_at, last_fire_at, last_run_id)
    return fired


def _auto_pause(conn: psycopg.Connection, row: dict) -> None:
    """Pause a schedule whose runs keep failing, and say so once."""
    runs = "run" if row["auto_pause_after"] == 1 else f"{row['auto_pause_after']} runs"
    reason = f"auto-paused: its last {runs} failed (latest: run {row['last_run_id']})"
    db.set_schedule_paused(conn, row["key"], True, None, reason)
    SCHEDULES_AUTO_PAUSED.inc()
    log.error("schedule %s %s; resume it with everystep.schedules.resume(%r) or an apply that un-pauses it",
              row["key"], reason, row["key"], extra={"schedule": row["key"], "run": str(row["last_run_id"])})


def _cannot_fire(conn: psycopg.Connection, row: dict, error: str, exc: BaseException) -> None:
    """Keep the due times (they fire, or are judged missed, once the cause is
    fixed) and say why: on the schedule's row, and in the log once, not on
    every tick."""
    if error != row["last_error"]:
        log.error("schedule %s: %s", row["key"], error, exc_info=exc, extra={"schedule": row["key"]})
        db.set_schedule_error(conn, row["key"], error)


# ---------------------------------------------------------------- plan and apply

class PlanEntry(NamedTuple):
    key: str
    action: str  # add, revive (a retired key back in the file), change, unchanged, not_in_file
    changes: dict[str, tuple[Any, Any]]  # field -> (in the database, in the file), for change
    next_fire_at: datetime.datetime  # the next fire time once applied
    paused: bool
    version: int | None = None  # the version in the database now (None: no such key)
    paused_reason: str | None = None  # why it paused itself, for a schedule auto-paused now

    @property
    def writes(self) -> bool:
        return self.action in ("add", "revive", "change")


class Plan(NamedTuple):
    source: str
    entries: list[PlanEntry]
    digest: str  # what the plan writes: see plan_digest()


class PlanChanged(Exception):
    """apply --plan-digest: the plan is no longer the one reviewed; nothing was written."""

    def __init__(self, expected: str, plan: Plan):
        super().__init__(f"the plan changed since it was reviewed: its digest is now {plan.digest}, not {expected}"
                         "; nothing was written")
        self.expected = expected
        self.plan = plan


def plan_entry(key: str, spec: Schedule, row: dict | None, now: datetime.datetime, source: str) -> PlanEntry:
    """What writing `spec` under `key` would do to the database's `row`.
    A key another source owns (and has not retired) is refused."""
    if row is not None and row["retired_at"] is None and row["source"] != source:
        raise db.ScheduleRefused(
            f"schedule {key!r} belongs to source {row['source']!r}, not {source!r}: it is left alone "
            "(use another key, or retire it from its own source first)")
    wanted = definition(spec)
    if row is None:
        return PlanEntry(key, "add", {}, next_fire_time(spec.cron, spec.timezone, now), spec.paused)
    changes = {name: (row[name], wanted[name]) for name in DEFINITION if row[name] != wanted[name]}
    if row["retired_at"] is not None:
        return PlanEntry(key, "revive", changes, next_fire_time(spec.cron, spec.timezone, now), spec.paused,
                         row["version"])
    if changes:
        # A new cron, time zone or un-pausing starts from the next fire time
        # after now: nothing is caught up for the old timing or the pause.
        restart = "cron" in changes or "timezone" in changes or ("paused" in changes and not spec.paused)
        next_fire_at = next_fire_time(spec.cron, spec.timezone, now) if restart else row["next_fire_at"]
        return PlanEntry(key, "change", changes, next_fire_at, spec.paused, row["version"], row["paused_reason"])
    return PlanEntry(key, "unchanged", {}, row["next_fire_at"], spec.paused, row["version"], row["paused_reason"])


def plan(conn: psycopg.Connection, manifest: Mapping[str, Schedule]) -> Plan:
    """What `apply` would do (read-only): each key of the manifest, then the
    live keys of its source that the manifest no longer has (apply leaves
    them alone; they are retired explicitly). Keys of other sources are not
    looked at, unless the manifest has one: that is refused
    (db.ScheduleRefused), one line naming every such key."""
    source = getattr(manifest, "source", DEFAULT_SOURCE)
    now = db.database_now(conn)
    rows = {row["key"]: row for row in db.load_schedules(conn)}
    owned_elsewhere = [key for key in sorted(manifest) if key in rows and rows[key]["retired_at"] is None
                       and rows[key]["source"] != source]
    if owned_elsewhere:
        owners = ", ".join(f"{key!r} ({rows[key]['source']})" for key in owned_elsewhere)
        raise db.ScheduleRefused(
            f"source {source!r} cannot apply {owners}: other sources own them; nothing was written "
            "(use other keys, or retire them from their own source first)")
    entries = [plan_entry(key, manifest[key], rows.get(key), now, source) for key in sorted(manifest)]
    for key, row in sorted(rows.items()):
        if key not in manifest and row["retired_at"] is None and row["source"] == source:
            entries.append(PlanEntry(key, "not_in_file", {}, row["next_fire_at"], row["paused"], row["version"],
                                     row["paused_reason"]))
    return Plan(source, entries, plan_digest(source, entries, manifest))


def plan_digest(source: str, entries: list[PlanEntry], manifest: Mapping[str, Schedule]) -> str:
    """A hash of exactly what apply would write: the source, and for each key
    it writes, the action, the version it replaces and the definition. Fire
    times are left out: they follow from the definition and the time of the
    apply, so a plan reviewed a minute ago is still the same plan."""
    writes = [{"key": e.key, "action": e.action, "replaces_version": e.version,
               "definition": definition(manifest[e.key])} for e in entries if e.writes]
    text = json.dumps({"source": source, "writes": writes}, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def apply(conn: psycopg.Connection, manifest: Mapping[str, Schedule], expected_digest: str | None = None) -> Plan:
    """Write the manifest: add, revive and change its source's schedules, in
    one transaction, while no tick runs. Keys not in the manifest are left as
    they are. With `expected_digest`, only if the plan is still that one: else
    PlanChanged, and nothing is written. Returns the plan it carried out."""
    with conn.transaction():
        db.lock_scheduler(conn)
        done = plan(conn, manifest)
        if expected_digest is not None and expected_digest != done.digest:
            raise PlanChanged(expected_digest, done)
        for entry in done.entries:
            if entry.writes:
                write(conn, entry, manifest[entry.key], done.source)
    return done


def write(conn: psycopg.Connection, entry: PlanEntry, spec: Schedule, source: str) -> None:
    """Carry out one planned add, revive or change."""
    wanted = definition(spec)
    db.put_schedule(conn, entry.key, {**wanted, "args": serde.dump_data(wanted["args"])}, entry.next_fire_at,
                       source)


def definition(spec: Schedule) -> dict[str, Any]:
    """A manifest schedule as the database row holds it (args as stored JSON)."""
    return {
        "workflow": spec.workflow,
        "args": serde.encode(list(spec.args)),
        "cron": spec.cron,
        "timezone": spec.timezone,
        "catchup": spec.catchup,
        "max_catchup": spec.max_catchup,
        "overlap": spec.overlap,
        "max_lateness_seconds": float(spec.max_lateness_seconds),
        "paused": spec.paused,
        "auto_pause_after": spec.auto_pause_after,
    }
